"""A task run scored: exact match by length through greedy decoding, and the run's records.

A run of a task writes eval.csv (one row per test length: correct, instances, accuracy) and
samples.txt (a few test instances of each length bucket: prompt, target and the model's
answer). posbench/task_report.py makes the tables.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Optional

import torch

from posbench.errors import PosbenchError
from posbench.files import write_atomic, write_rows
from posbench.tasks import Task, build_task
from posbench.train import autocast

METRIC = "exact_match"
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
    "status",
    "attention",
]
SAMPLES_PER_BUCKET = 3
DECODE_BATCH = 256  # instances decoded at once


# --- decoding and scoring ---------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """The model's `steps` next bytes after each prompt, each the argmax given the ones before:
    prompts (B, P) of one length -> answers (B, steps)."""
    x = prompts
    for _ in range(steps):
        with autocast(x.device):
            logits = model(x)  # (B, T, V)
        nxt = logits[:, -1].float().argmax(-1)  # (B,): the byte after the last one
        x = torch.cat([x, nxt[:, None]], dim=1)  # (B, T+1)
    return x[:, prompts.size(1) :]


def decode(model, instances: list[tuple[bytes, bytes]], device) -> list[Optional[bytes]]:
    """Each instance's greedy answer, as long as its target (None where the model cannot encode
    the length). Instances are batched by prompt length, so no prompt is padded."""
    max_len = getattr(model, "max_len", None)
    answers: list[Optional[bytes]] = [None] * len(instances)
    by_len: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(instances):
        by_len.setdefault(len(p), []).append(i)
    for P, idx in by_len.items():
        for k in range(0, len(idx), DECODE_BATCH):
            chunk = idx[k : k + DECODE_BATCH]
            steps = max(len(instances[i][1]) for i in chunk)
            if max_len is not None and P + steps - 1 > max_len:
                continue  # the last step would read past the positions the scheme encodes
            prompts = torch.tensor([list(instances[i][0]) for i in chunk], dtype=torch.long, device=device)
            out = greedy(model, prompts, steps).cpu()  # (b, steps)
            for row, i in zip(out.tolist(), chunk):
                answers[i] = bytes(row[: len(instances[i][1])])
    return answers


@torch.no_grad()
def exact(model, instances: list[tuple[bytes, bytes]], device) -> list[Optional[bool]]:
    """Whether greedy decoding would give each instance's whole answer (None where the model
    cannot encode the length), from one forward pass over prompt + answer: greedy decoding
    emits the answer exactly when, at every answer byte, the argmax given the answer's bytes
    before it is that byte (by induction over the bytes; the same argmax, so ties too). It
    equals `decode(...) == answer` (tests/test_tasks.py checks) at a forward per batch rather
    than one per answer byte."""
    max_len = getattr(model, "max_len", None)
    ok: list[Optional[bool]] = [None] * len(instances)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, (p, a) in enumerate(instances):
        by_shape.setdefault((len(p), len(a)), []).append(i)
    for (P, A), idx in by_shape.items():
        if max_len is not None and P + A - 1 > max_len:
            continue  # greedy's last step would read past the positions the scheme encodes
        for k in range(0, len(idx), DECODE_BATCH):
            chunk = idx[k : k + DECODE_BATCH]
            seqs = torch.tensor([list(instances[i][0] + instances[i][1]) for i in chunk], device=device)  # (b, P+A)
            with autocast(seqs.device):
                logits = model(seqs[:, :-1])  # (b, P+A-1, V)
            pred = logits[:, P - 1 :].float().argmax(-1)  # (b, A): the byte after the prompt and each answer prefix
            for i, row in zip(chunk, (pred == seqs[:, P:]).all(-1).tolist()):
                ok[i] = row
    return ok


def score(model, test: list[tuple[int, bytes, bytes]], device) -> list[dict]:
    """Exact match per test length: rows (length, correct, instances, accuracy, status). An
    instance counts only if every byte of its answer, END included, is the target's."""
    model.eval()
    hits = exact(model, [(p, a) for _, p, a in test], device)
    rows = []
    for n in sorted({n for n, _, _ in test}):
        mine = [h for (m, _, _), h in zip(test, hits) if m == n]
        if any(h is None for h in mine):
            rows.append(
                {"length": n, "correct": "", "instances": len(mine), "accuracy": "", "status": "beyond-max-len"}
            )
            continue
        correct = sum(mine)
        rows.append(
            {"length": n, "correct": correct, "instances": len(mine), "accuracy": correct / len(mine), "status": "ok"}
        )
    return rows


def task_of(rc) -> Task:
    return build_task(rc.task, rc.task_options)


def evaluate_task_into(rc, rdir: Path, model, device, backend: str) -> list[dict]:
    """Score a run on its task's test set; write eval.csv and samples.txt. Returns the rows."""
    task = task_of(rc)
    test = task.test_set()
    rows = score(model, test, device)
    ident = {
        "task": rc.task,
        "metric": METRIC,
        "scheme": rc.model.scheme,
        "seed": rc.seeds[0],
        "train_max": task.train_max,
        "attention": backend,
    }
    rows = [{**ident, **r} for r in rows]
    write_rows(rdir / "eval.csv", rows, EVAL_COLUMNS)
    write_atomic(rdir / "samples.txt", samples(rc, task, test, model, device, rows))
    return rows


def show(b: Optional[bytes]) -> str:
    if b is None:
        return "(not decoded: beyond the scheme's positions)"
    return "".join(chr(c) if 32 <= c < 127 else f"\\x{c:02x}" for c in b)


def samples(rc, task: Task, test: list, model, device, rows: list[dict]) -> str:
    """samples.txt: for each length bucket, its first few test instances (the same ones in
    every run, so two schemes' files compare line by line) and the model's greedy answers."""
    acc = {r["length"]: r for r in rows}
    spans = buckets(task.train_max, task.test_max, rc.eval.buckets)
    shown = [[(p, a) for n, p, a in test if lo <= n <= hi][:SAMPLES_PER_BUCKET] for lo, hi in spans]
    flat = [inst for group in shown for inst in group]
    answers = iter(decode(model, flat, device))
    out = [
        f"# {rc.task}, {rc.model.scheme} seed {rc.seeds[0]}: the first {SAMPLES_PER_BUCKET} test instances "
        f"of each length bucket; trained on lengths 1..{task.train_max}",
        "",
    ]
    for (lo, hi), group in zip(spans, shown):
        scored = [acc[n] for n in range(lo, hi + 1) if n in acc and acc[n]["status"] == "ok"]
        right = sum(r["correct"] for r in scored)
        total = sum(r["instances"] for r in scored)
        split = "in distribution" if hi <= task.train_max else "out of distribution"
        out.append(f"## lengths {bucket_name(lo, hi)} ({split}): {right} of {total} exact")
        for (p, a), ans in zip(group, answers):
            mark = "ok" if ans == a else "WRONG"
            out += [f"prompt  {show(p)}", f"target  {show(a)}", f"answer  {show(ans)}  {mark}", ""]
    return "\n".join(out).rstrip() + "\n"


def read_task_eval(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "eval.csv"
    bad = PosbenchError(f"{path}: malformed task evaluation rows; delete it and run evaluate again")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != EVAL_COLUMNS or not rows:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r["instances"]), int(r["seed"])
            if r["status"] == "ok":
                int(r["correct"])
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        raise bad from None
    return rows


# --- buckets and tables ---------------------------------------------------------------------------


def buckets(train_max: int, test_max: int, edges: list[int] = ()) -> list[tuple[int, int]]:
    """(lo, hi) length buckets covering 1..test_max: one per length up to 40, else ten of equal
    width; or ending at the given `edges`. train_max always ends a bucket, so none straddles
    in and out of distribution."""
    if edges:
        ends = {e for e in edges if e < test_max}
    elif test_max <= 40:
        ends = set(range(1, test_max + 1))
    else:
        ends = {math.ceil(test_max * k / 10) for k in range(1, 11)}
    ends = sorted(ends | {train_max, test_max})
    return [(lo, hi) for lo, hi in zip([1] + [e + 1 for e in ends[:-1]], ends)]


def bucket_name(lo: int, hi: int) -> str:
    return str(hi) if lo == hi else f"{lo}-{hi}"
