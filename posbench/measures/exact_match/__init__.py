"""Exact match and per-token accuracy on a synthetic task, the measure of a task's runs.

A run of a task trains on instances of lengths 1..train_max, the loss on the answer bytes
alone, and is scored on a fixed test set of every length 1..test_max by two metrics: exact
match of the whole answer under greedy decoding (the NoPE study's), and the answer bytes right,
each predicted given the true bytes before it (Ruoss et al.'s per-token accuracy). Its rooms:
records.py (eval.csv, a row per test length with both metrics; the metrics; the length
buckets), score.py (scoring into eval.csv and samples.txt, a few test instances of each bucket
with the model's answers; posbench/accuracy.py holds the torch side) and views.py (tables of one
metric, --metric, by length bucket plus the in- and out-of-distribution totals, and the plot).
This module decides how a task's runs are scored and answers the Measure interface.
"""

from __future__ import annotations

from pathlib import Path

from posbench.errors import PosbenchError
from posbench.measures.base import Measure, only_own_section
from posbench.measures.exact_match.records import METRICS, read_task_eval
from posbench.measures.exact_match.score import evaluate_task_into
from posbench.measures.exact_match.views import report
from posbench.tasks.generators import Task


class ExactMatch(Measure):
    name = "exact_match"
    records = ("eval.csv", "samples.txt")
    metrics = METRICS

    def __init__(self, task: Task):
        self.task = task

    def decide(self, cfg, test_len) -> None:
        if test_len is not None:
            raise PosbenchError(
                "--test-len sets perplexity lengths; a task's are task_options.train_max and test_max, "
                "e.g. --set task_options.test_max=60"
            )
        own = [self.task.train_len]
        # a task run's own record holds the lengths it derived: those are no choice of the user's
        if "eval.lengths" in cfg.origins and cfg.eval.lengths != own:
            raise PosbenchError(
                f"eval.lengths={cfg.eval.lengths}: a task derives it (task {cfg.task}: train_len "
                f"{self.task.train_len}, its longest training instance); lengths are perplexity's, a task's are "
                f"task_options.train_max and test_max",
                "eval.lengths",
            )
        cfg.eval.lengths = own  # perplexity lengths: a task is scored at its own lengths
        only_own_section(cfg, self.name)

    def score(self, rc, rdir: Path, model, test, device, backend: str, reporter=None) -> None:
        from posbench.experiment.checkpoint import weights_mark

        try:
            rows = read_task_eval(rdir)
            own = {r["weights"] for r in rows} <= {"", weights_mark(model)}  # not another run's rows copied in
            scored = own and {r["attention"] for r in rows} == {backend}
        except PosbenchError:
            scored = False
        if not scored:
            evaluate_task_into(rc, rdir, model.to(device), self.task, test, device, backend)

    def rescore(self, cfg, rdir: Path, model, test, device) -> list[dict]:
        return evaluate_task_into(cfg, rdir, model, self.task, test, device, model.backend(device))

    def evaluation(self, rc, rows: list[dict]) -> tuple[str, list[list[str]]]:
        table = [["length", "exact", "per-token", "instances", "answer bytes", "status"]]
        for r in rows:
            ok = r["status"] == "ok"
            table.append(
                [
                    str(r["length"]),
                    f"{100 * r['accuracy']:.1f}%" if ok else "—",
                    f"{100 * r['token_accuracy']:.1f}%" if ok else "—",
                    str(r["instances"]),
                    str(r["tokens"]),
                    r["status"],
                ]
            )
        return f"{rc.task}: {rc.model.scheme} seed {rc.seeds[0]}; attention {rows[0]['attention']}", table

    def read(self, rdir: Path) -> list[dict]:
        return read_task_eval(rdir)

    def report(self, collected, metric, transpose: bool, buckets) -> dict:
        if metric not in (None, *self.metrics):
            raise PosbenchError(f"--metric {metric}: a task's runs report {' or '.join(self.metrics)}")
        return report(collected, metric or "exact_match", transpose, buckets)

    def join_checks(self, rows: list[dict]) -> list[tuple[str, set]]:
        return [("tasks", {r["task"] for r in rows}), ("training lengths", {int(r["train_max"]) for r in rows})]
