"""What a model learns from: the corpus language model (task lm) or a synthetic task.

`task_for(cfg)` gives a config's TrainingTask (posbench/tasks/base.py): its training length and
budget, what its runs read, its batches, and the measure its runs are scored by. The synthetic
tasks' generators, their registry and the base class a task plugin subclasses are in
posbench/tasks/generators.py, importable from here (`from posbench.tasks import END, Task`).
"""

from __future__ import annotations

from posbench.tasks.base import TrainingTask
from posbench.tasks.corpus import LM, CorpusTask
from posbench.tasks.generators import (
    CPU_PARTS,
    END,
    FILLER,
    IGNORE,
    PAD,
    TASKS,
    Batches,
    Task,
    build_task,
    pack,
    task_derived,
)

__all__ = [
    "CPU_PARTS", "END", "FILLER", "IGNORE", "LM", "PAD", "TASKS", "Batches", "CorpusTask", "Task", "TrainingTask",
    "build_task", "pack", "task_derived", "task_for",
]  # fmt: skip


def task_for(cfg) -> TrainingTask:
    """The task a config's runs learn: the corpus language model for task lm, else that synthetic task."""
    if cfg.task == LM:
        return CorpusTask()
    from posbench.tasks.synthetic import SyntheticTask

    return SyntheticTask(build_task(cfg.task, cfg.task_options))
