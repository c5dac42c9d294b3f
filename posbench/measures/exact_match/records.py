"""Exact match's records: eval.csv and its readers.

eval.csv (a row per test length with both metrics), its columns, reader and metrics, and the length
buckets samples.txt and the tables group lengths into; no torch."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from posbench.errors import PosbenchError
from posbench.measures.base import Metric

METRIC = "exact_match"  # eval.csv's `metric`: the measure that scored the row (each row holds both metrics)

EVAL_COLUMNS = [
    "task",
    "metric",
    "scheme",
    "seed",
    "train_max",
    "length",
    "correct",
    "instances",
    "accuracy",
    "tokens_correct",
    "tokens",
    "token_accuracy",
    "status",
    "attention",
    "weights",  # the first 16 digits of the sha256 of the weights that scored the row (model.pt's)
]
WEIGHTLESS_COLUMNS = EVAL_COLUMNS[:-1]  # eval.csv before its rows named their weights


METRICS = {  # what a task report tables, by --metric
    "exact_match": Metric(
        "exact_match", "% exact match", True, 1, column="accuracy", aggregate="pooled",
        pooled=("correct", "instances"), scale=100, title="exact-match accuracy",
        how="greedy decoding, exact match of the whole answer",
    ),
    "token_accuracy": Metric(
        "token_accuracy", "% answer bytes right", True, 1, column="token_accuracy", aggregate="pooled",
        pooled=("tokens_correct", "tokens"), scale=100, title="per-token accuracy",
        how="per-token accuracy: the answer bytes (END included) right over all of them, each predicted given "
        "the true bytes before it (teacher-forced), summed over a bucket's lengths",
    ),
}  # fmt: skip


def read_task_eval(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "eval.csv"
    bad = PosbenchError(
        f"{path}: malformed task evaluation rows, or not all the columns a task run records "
        f"({', '.join(EVAL_COLUMNS)}); score the run again with posbench evaluate {run_dir}"
    )
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames == WEIGHTLESS_COLUMNS:  # its weights unnamed: taken as the run's own
            rows = [{**r, "weights": ""} for r in rows]
        elif reader.fieldnames != EVAL_COLUMNS:
            raise ValueError
        if not rows:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r["instances"]), int(r["seed"]), int(r["tokens"])
            if r["status"] == "ok":
                int(r["correct"]), int(r["tokens_correct"]), float(r["token_accuracy"])
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        raise bad from None
    return rows


def buckets(train_max: int, test_max: int, edges: list[int] = ()) -> list[tuple[int, int]]:
    """(lo, hi) length buckets covering 1..test_max, or ending at the given `edges`. By default:
    one per length up to 12; else the training lengths in two halves, each of N+1..N+5 alone
    (where extrapolation shows or fails first), and the rest in three of equal width: ten
    columns. train_max always ends a bucket, so none straddles in and out of distribution."""
    if edges:
        ends = {e for e in edges if e < test_max}
    elif test_max <= 12:
        ends = set(range(1, test_max + 1))
    else:
        N = train_max
        near = set(range(N + 1, min(N + 5, test_max) + 1))
        rest = test_max - max(near, default=N)
        ends = {math.ceil(N / 2), *near, *(test_max - rest + math.ceil(rest * k / 3) for k in range(1, 4) if rest)}
    ends = sorted(ends | {train_max, test_max})
    return [(lo, hi) for lo, hi in zip([1] + [e + 1 for e in ends[:-1]], ends)]


def bucket_name(lo: int, hi: int) -> str:
    return str(hi) if lo == hi else f"{lo}-{hi}"
