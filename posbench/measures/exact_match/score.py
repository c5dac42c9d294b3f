"""Exact match's scoring: greedy answers on a task's test set.

A run on its task's test set into eval.csv, and samples.txt, a few test instances of each length
bucket with the model's answers (posbench/accuracy.py holds the torch side)."""

from __future__ import annotations

from pathlib import Path

from posbench.files import write_atomic, write_rows
from posbench.measures.exact_match.records import EVAL_COLUMNS, METRIC, bucket_name, buckets
from posbench.tasks.generators import Task

SAMPLES_PER_BUCKET = 3


def evaluate_task_into(rc, rdir: Path, model, task: Task, test: list, device, backend: str) -> list[dict]:
    """Score a run on its task's test set; write eval.csv and samples.txt. Returns the rows."""
    from posbench.accuracy import score
    from posbench.device import computed_on
    from posbench.experiment.checkpoint import weights_mark
    from posbench.experiment.records import log_scoring

    rows = score(model, test, device)
    ident = {
        "task": rc.task,
        "metric": METRIC,
        "scheme": rc.model.scheme,
        "seed": rc.seeds[0],
        "train_max": task.train_max,
        "attention": backend,
        "weights": weights_mark(model),
    }
    rows = [{**ident, **r} for r in rows]
    write_rows(rdir / "eval.csv", rows, EVAL_COLUMNS)
    write_atomic(rdir / "samples.txt", samples(rc, task, test, model, device, rows))
    log_scoring(rdir, "exact_match", rows, computed_on(device))
    return rows


def samples(rc, task: Task, test: list, model, device, rows: list[dict]) -> str:
    """samples.txt: for each length bucket, its first few test instances (the same ones in
    every run, so two schemes' files compare line by line) and the model's greedy answers."""
    acc = {r["length"]: r for r in rows}
    spans = buckets(task.train_max, task.test_max, rc.eval.exact_match.buckets)
    shown = [[(p, a) for n, p, a in test if lo <= n <= hi][:SAMPLES_PER_BUCKET] for lo, hi in spans]
    flat = [inst for group in shown for inst in group]
    from posbench.accuracy import decode, show

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
        right_bytes = sum(r["tokens_correct"] for r in scored)
        total_bytes = sum(r["tokens"] for r in scored)
        split = "in distribution" if hi <= task.train_max else "out of distribution"
        out.append(
            f"## lengths {bucket_name(lo, hi)} ({split}): {right} of {total} exact, "
            f"{right_bytes} of {total_bytes} answer bytes right"
        )
        for (p, a), ans in zip(group, answers):
            mark = "ok" if ans == a else "WRONG"
            out += [f"prompt  {show(p)}", f"target  {show(a)}", f"answer  {show(ans)}  {mark}", ""]
    return "\n".join(out).rstrip() + "\n"
