"""A run folder's layout and its records, read by plain code: no torch, no training code.

A run folder holds config.yaml (fully resolved), model.pt (weights plus that same config),
train_log.jsonl (step, loss, lr, seconds, attention backend) and its measure's records (e.g.
eval.csv); a run whose loss blew up holds diverged.json instead of model.pt. Folders are built
under a hidden name (.<run>.partial), beside their mid-run checkpoints, and renamed when whole,
so an interrupted run leaves nothing that could pass for a finished one. A lock file per run
(.<run>.lock) keeps two processes from writing one run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from posbench.config import ExperimentConfig, config_from_dict, read_record
from posbench.files import safe_name

CONFIG, WEIGHTS, DIVERGED, FAILED = "config.yaml", "model.pt", "diverged.json", "failed.txt"
CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"  # mid-run state; the one before it
EVAL = "eval.csv"  # the scored rows, in the columns of the run's measure
PLANNED = "runs.txt"  # the run folders an experiment was asked to hold, one a line: status names the missing ones
SWEEP_RECORD = "sweep.yaml"  # the grid a sweep's experiment folder was made by; its runs may differ


def planned(exp: Path) -> list[str]:
    """The run folders an experiment folder was asked to hold (empty if it does not say)."""
    try:
        return [line for line in (Path(exp) / PLANNED).read_text().splitlines() if line]
    except (OSError, UnicodeDecodeError):
        return []


def read_config(rdir: Path) -> ExperimentConfig:
    """A run's config.yaml as a config; a damaged one is one line naming it."""
    path = Path(rdir) / CONFIG
    return config_from_dict(read_record(path), source=str(path))


def run_name(scheme: str, seed: int) -> str:
    return f"{safe_name(scheme)}-seed{seed}"


def partial_dir(rdir: Path) -> Path:
    """The hidden folder a run is built in before it is renamed to `rdir`."""
    return rdir.with_name("." + rdir.name + ".partial")


def lock_file(rdir: Path) -> Path:
    """The run's lock: whoever holds it alone may write `rdir` and its partial folder."""
    return rdir.with_name("." + rdir.name + ".lock")


def diverged_step(rdir: Path) -> str:
    """'at step 12', from a diverged run's record."""
    try:
        return f"at step {json.loads((Path(rdir) / DIVERGED).read_text())['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "at an unrecorded step"


def read_train_log(rdir: Path) -> list[dict]:
    """A run's train_log.jsonl records (empty if it has none or it cannot be read)."""
    try:
        return [json.loads(line) for line in (Path(rdir) / "train_log.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []


def trained_with(rdir: Path) -> Optional[str]:
    """The attention backend a run trained with, from its train_log.jsonl (None if unrecorded)."""
    log = read_train_log(rdir)
    return log[0].get("attention") if log and isinstance(log[0], dict) else None
