"""The TrainingTask interface: what a model learns from, apart from how it is judged.

A training task decides a run's training length and budget, reads its data (the corpus, or a
synthetic task's test set, which training never draws from) and builds its training batches.
It names the measure its runs are scored by when nothing else is asked; how a run is scored,
and its records and tables, are the measure's (posbench/measures/).
"""

from __future__ import annotations

from typing import Any, Optional


class TrainingTask:
    """The interface; posbench/tasks/corpus.py (the corpus language model) and
    posbench/tasks/synthetic.py (a synthetic task) implement it."""

    name: str = ""

    def decide(self, cfg) -> None:
        """Decide train_len, the training budget and the vocabulary in `cfg`, in place, and
        refuse training settings that do not apply (posbench/resolve.py calls it once)."""
        raise NotImplementedError

    def measure(self):
        """The measure its runs are scored by: posbench/measures/."""
        raise NotImplementedError

    def notes(self, cfg, source) -> list[str]:
        """What to say before training, given what the runs read."""
        return []

    # --- what a run reads and trains on (these import torch) --------------------------------
    def source(self, rc, reporter=None) -> Any:
        """What a run reads: the corpus, or a task's test set. Built once per process and key;
        `reporter` hears of a first download."""
        raise NotImplementedError

    def source_key(self, rc) -> str:
        raise NotImplementedError

    def fingerprint(self, source) -> Optional[str]:
        """The sha256 of what a run read, where its config cannot say it (a file's contents may
        change under its name); None where its options make its data (a synthetic task)."""
        return None

    def batches(self, rc, source):
        """Training batches: batches(gen) -> (x, y), y = -100 where no loss is taken, with
        get_state / set_state for a checkpoint."""
        raise NotImplementedError

    # --- what else its runs offer (plans, trackers, bench and extend ask; none asks the kind) --
    def identity(self, part: dict) -> dict:
        """A run's identity (config.identity) as this task reads it: the settings its weights
        depend on."""
        return part

    def throughput(self, cfg) -> tuple[int, str]:
        """What one training step of `cfg` processes and the unit of its rate, as trackers send
        it: (per_step, unit). Each row of a batch is an instance, whatever it holds."""
        return cfg.train.batch_size, "instances_per_s"

    def padding_benchmark(self) -> Optional[str]:
        """None where its training batches vary in length, so that `posbench bench --task` can time
        a step padded whole against cut by length; else why not, for the user."""
        return f"a run of task {self.name} has no batches cut by length; give a task, e.g. --task copy"

    def not_extendable(self, cfg) -> Optional[str]:
        """None where `posbench extend` can fine-tune a run of `cfg` to a longer context; else why not."""
        return f"a run of task '{cfg.task}'; extend fine-tunes language models (task lm)"
