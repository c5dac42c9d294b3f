"""A synthetic task as a run learns it: instances of lengths 1..train_max, the loss on the answer.

The task's generator (posbench/tasks/generators.py) decides the training length (its longest
training instance), its recipe (steps, batch size, depth, schedule) where the config leaves it
out, and its fixed test set, which its runs read and training never draws from. Its runs are
scored by exact match (posbench/measures/exact_match/), written in bytes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from posbench.config import DataConfig
from posbench.errors import PosbenchError
from posbench.files import safe_name
from posbench.tasks.base import TrainingTask
from posbench.tasks.generators import CPU_PARTS, Task

RECIPE_KEYS = ("n_layer", "lr", "min_lr", "warmup_steps")  # besides steps and batch_size, a task's budget sets these


class SyntheticTask(TrainingTask):
    def __init__(self, task: Task):
        self.task = task
        self.name = task.name

    def decide(self, cfg) -> None:
        task = self.task
        # a task run's own record holds the length it derived: that is no choice of the user's
        if "model.train_len" in cfg.origins and cfg.model.train_len != task.train_len:
            raise PosbenchError(
                f"model.train_len={cfg.model.train_len}: a task derives it (task {cfg.task}: train_len "
                f"{task.train_len}, its longest training instance); lengths are perplexity's, a task's are "
                f"task_options.train_max and test_max",
                "model.train_len",
            )
        if cfg.data.tokenizer != "bytes":  # its runs read their own bytes
            raise PosbenchError(f"data.tokenizer {cfg.data.tokenizer}: a task is written in bytes", "data.tokenizer")
        default = DataConfig()
        for f in dataclasses.fields(default):  # a corpus setting would be ignored: say so instead
            value = getattr(cfg.data, f.name)
            if value != getattr(default, f.name):
                raise PosbenchError(
                    f"data.{f.name}={value!r}: task {cfg.task} draws its own instances and reads no corpus; "
                    f"leave data out, or train the language model (task lm) on it",
                    f"data.{f.name}",
                )
        if cfg.model.vocab_size < 256:
            raise PosbenchError(
                f"model.vocab_size={cfg.model.vocab_size}: a task is written in bytes, so it must be >= 256",
                "model.vocab_size",
            )
        cfg.task_options = {**type(task).options, **cfg.task_options, "test_max": task.test_max}
        if cfg.name == "default":  # lm's; a task's runs go to results/<task> unless named
            cfg.name = safe_name(cfg.task)
        cfg.model.train_len = task.train_len
        cfg.train.steps = cfg.train.steps or task.budget["steps"]
        cfg.train.batch_size = cfg.train.batch_size or task.budget["batch_size"]
        for key in RECIPE_KEYS:  # the task's recipe, where the config leaves the key out
            section = "model" if key == "n_layer" else "train"
            if key in task.budget and f"{section}.{key}" not in cfg.origins:
                setattr(getattr(cfg, section), key, task.budget[key])
        for scheme, setup in task.scheme_setup.items():  # and its schemes' setup, likewise
            if scheme in cfg.schemes:
                given = cfg.scheme_options.setdefault(scheme, {})
                given.update({k: v for k, v in setup.items() if f"scheme_options.{scheme}.{k}" not in cfg.origins})

    def measure(self):
        from posbench.measures.exact_match import ExactMatch

        return ExactMatch(self.task)

    def notes(self, cfg, test) -> list[str]:
        return [
            f"task {cfg.task}: train_len {cfg.model.train_len} (its longest training instance), "
            f"{cfg.train.steps} steps x {cfg.train.batch_size} instances per run"
        ]

    def source(self, rc, reporter=None) -> list:
        return self.task.test_set()

    def source_key(self, rc) -> str:
        return json.dumps([rc.task, rc.task_options], sort_keys=True)

    def batches(self, rc, test):
        from posbench.device import pick_device  # torch: reports read records without it

        on_cpu = pick_device(rc.train.device).type == "cpu"  # elsewhere a part costs as much as the whole
        return self.task.batches(rc.seeds[0], rc.train.batch_size, test, parts=CPU_PARTS if on_cpu else 1)

    def identity(self, part: dict) -> dict:
        """A task's runs read no corpus: the data settings decide nothing."""
        return {k: v for k, v in part.items() if k != "data"}

    def padding_benchmark(self) -> Optional[str]:
        """A task's instances vary in length: its batches are padded to their longest, or cut."""
        return None
