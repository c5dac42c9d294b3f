"""`posbench status`: what each run folder of an experiment says it is."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError
from posbench.experiment.records import (
    CHECKPOINT,
    CONFIG,
    DIVERGED,
    EVAL,
    FAILED,
    PREVIOUS,
    WEIGHTS,
    diverged_step,
    lock_file,
    planned,
    read_config,
    read_train_log,
)
from posbench.files import lock_holder


def run_status(exp: Path) -> list[dict]:
    """A row per run found in the experiment folder `exp`, with its state (done, partial,
    failed, diverged or running) and what can be said of it."""
    exp = Path(exp)
    if not exp.is_dir():
        raise PosbenchError(f"{exp}: no such experiment directory")
    rows = {}
    for folder in sorted(p for p in exp.iterdir() if p.is_dir()):
        hidden = folder.name.startswith(".")
        if hidden and not folder.name.endswith(".partial"):
            continue
        rdir = exp / folder.name[1 : -len(".partial")] if hidden else folder
        if not hidden and not any((folder / f).is_file() for f in (CONFIG, WEIGHTS, DIVERGED)):
            continue  # not a run folder
        if not hidden or rdir.name not in rows:  # a finished folder outranks a partial one left beside it
            rows[rdir.name] = _status_of(folder, rdir, hidden)
    for name in planned(exp):  # asked for, never started
        rows.setdefault(
            name,
            {
                "run": name,
                "scheme": "?",
                "seed": "?",
                "train_len": "?",
                "state": "pending",
                "detail": "not started; rerun the command that made this folder",
            },
        )
    return [rows[name] for name in sorted(rows)]


def _status_of(folder: Path, rdir: Path, hidden: bool) -> dict:
    try:
        cfg = read_config(folder)
        ident = {"scheme": cfg.schemes[0], "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
        steps = cfg.train.steps
    except PosbenchError:
        ident, steps = {"scheme": "?", "seed": "?", "train_len": "?"}, None
    row = {"run": rdir.name, **ident}
    holder = lock_holder(lock_file(rdir))
    step = checkpoint_step(folder) if hidden else None
    at = f"at step {step} of {steps}" if step is not None else "no checkpoint yet"
    if holder is not None:
        logged = read_train_log(folder) if hidden else []
        now = f"at step {logged[-1]['step'] + 1} of {steps}" if logged and "step" in logged[-1] else at
        doing = f"training, {now}" if hidden else "evaluating"
        return {**row, "state": "running", "detail": f"{doing} (pid {holder or '?'})"}
    if not hidden:
        if (folder / DIVERGED).is_file() and not (folder / WEIGHTS).is_file():
            return {**row, "state": "diverged", "detail": diverged_step(folder)}
        missing = [f for f in (WEIGHTS, EVAL) if not (folder / f).is_file()]
        return {
            **row,
            "state": "done" if not missing else "partial",
            "detail": "trained and evaluated" if not missing else f"lacks {' and '.join(missing)}",
        }
    if (folder / FAILED).is_file():
        return {**row, "state": "failed", "detail": f"{(folder / FAILED).read_text(errors='replace').strip()} ({at})"}
    return {**row, "state": "partial", "detail": f"{at}; rerun to resume" if step is not None else at}


def checkpoint_step(folder: Path) -> Optional[int]:
    """The step a partial folder's checkpoint resumes from (None if it has no readable one)."""
    if not any((folder / name).is_file() for name in (CHECKPOINT, PREVIOUS)):
        return None  # nothing to read: no need to load torch
    from posbench.experiment.checkpoint import load_progress

    try:
        state = load_progress(folder)
    except PosbenchError:
        return None
    return int(state["step"]) if state is not None else None
