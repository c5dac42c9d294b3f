"""`posbench status`: what each run folder of an experiment says it is."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Optional

from posbench.config import config_from_dict
from posbench.errors import PosbenchError
from posbench.experiment.records import (
    CONFIG,
    EVAL,
    FAILED,
    SCORING,
    WEIGHTS,
    RunState,
    check_describes,
    check_weights_read,
    diverged_step,
    has_checkpoint,
    partial_dir,
    planned,
    read_config,
    read_train_log,
    run_state,
    weights_record,
)


def run_status(exp: Path) -> list[dict]:
    """A row per run found in the experiment folder `exp`, with its state (done, records,
    partial, damaged, failed, diverged or running) and what can be said of it."""
    exp = Path(exp)
    if not exp.is_dir():
        what = "is a file, not an experiment folder" if exp.exists() else "no such experiment directory"
        raise PosbenchError(f"{exp}: {what}")
    rows = {}
    for folder in sorted(p for p in exp.iterdir() if p.is_dir()):
        hidden = folder.name.startswith(".")
        if hidden and not folder.name.endswith(".partial"):
            continue
        name = folder.name[1 : -len(".partial")] if hidden else folder.name
        run = run_state(exp / name)
        if name not in rows and (run.here or run.partial):  # else not a run folder
            rows[name] = _status_of(run)  # a finished folder outranks a partial one left beside it
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
    if not rows:
        if run_state(exp).here:
            raise PosbenchError(f"{exp}: a run folder; status reads its experiment folder, {exp.parent}")
        raise PosbenchError(f"{exp}: holds no runs, finished, partial or planned")
    return [rows[name] for name in sorted(rows)]


def _status_of(run: RunState) -> dict:
    """status's words for a run's state; a run's own folder is read where it holds a record,
    else its partial folder."""
    rdir = run.folder
    folder = rdir if run.here else partial_dir(rdir)
    try:
        cfg = read_config(folder)
        ident = {"scheme": cfg.schemes[0], "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
        steps, pretrained = cfg.train.steps, cfg.model.pretrained is not None
    except PosbenchError as e:
        ident, steps, pretrained = {"scheme": "?", "seed": "?", "train_len": "?"}, None, False
        unreadable = f"{e}"
    else:
        unreadable = None
    if pretrained:  # a model posbench did not train: its folder holds only scores
        return {**ident, "run": rdir.name, "pretrained": True, **_scored_status(run, rdir)}
    row = {"run": rdir.name, **ident}
    if run.state == "diverged":
        return {**row, "state": "diverged", "detail": diverged_step(rdir)}
    step = checkpoint_step(folder) if not run.here else None
    of = f"{steps:,}" if isinstance(steps, int) else "?"  # ? where its config cannot be read
    at = f"at step {step:,} of {of}" if step is not None else "no checkpoint yet"
    if step is None and not run.here and has_checkpoint(folder):
        at = f"no readable checkpoint: delete {folder} to train it anew"
    if run.holder is not None:  # training it, or scoring a trained run
        logged = read_train_log(folder) if not run.here else []
        now = f"at step {logged[-1]['step'] + 1:,} of {of}" if logged and "step" in logged[-1] else at
        doing = f"training, {now}" if not run.here else "evaluating"
        return {**row, "state": "running", "detail": f"{doing} (pid {run.holder or '?'})"}
    if run.here and unreadable:  # a report of it would fail: say so here
        return {**row, "state": "damaged", "detail": unreadable}
    if run.here:
        missing = [f for f in (WEIGHTS, EVAL) if not (rdir / f).is_file()]
        if WEIGHTS not in missing and not zipfile.is_zipfile(rdir / WEIGHTS):  # cut short or overwritten since
            return {**row, "state": "damaged", "detail": f"{WEIGHTS} is damaged: delete it to train the run again"}
        weights = weights_record(rdir) if WEIGHTS not in missing else None
        if weights is not None:  # another run's model.pt copied in: evaluate would refuse it, so say it here
            try:
                check_describes(rdir / CONFIG, cfg, config_from_dict(weights["config"], source=str(rdir / WEIGHTS)))
                if "read" in weights:
                    check_weights_read(rdir, weights["read"], restore=False)
            except PosbenchError as e:
                return {**row, "state": "damaged", "detail": str(e)}
        if EVAL not in missing:  # as report reads it: a malformed record is its one line
            from posbench.report import check_rows, table_share

            try:
                measure = table_share(cfg, rdir)[0]
                check_rows(rdir, cfg, measure.read(rdir))
                measure.check_beside(rdir)
            except PosbenchError as e:
                return {**row, "state": "damaged", "detail": str(e)}
        if run.scoring and not missing:
            detail = f"scored in part: a stop left {SCORING}; rerun to score the rest"
            return {**row, "state": "partial", "detail": detail}
        if missing == [WEIGHTS]:  # a committed reference's records: its weights stay where it trained
            return {**row, "state": "records", "detail": f"evaluated, no {WEIGHTS}: tabled as is; a rerun trains it"}
        return {
            **row,
            "state": "done" if not missing else "partial",
            "detail": "trained and evaluated" if not missing else f"lacks {' and '.join(missing)}",
        }
    if (folder / FAILED).is_file():
        return {**row, "state": "failed", "detail": f"{(folder / FAILED).read_text(errors='replace').strip()} ({at})"}
    return {**row, "state": "partial", "detail": f"{at}; rerun to resume" if step is not None else at}


def _scored_status(run: RunState, rdir: Path) -> dict:
    """status's words for a pretrained model's folder (`posbench pretrained`): scored or not."""
    if run.holder is not None:
        return {"state": "running", "detail": f"scoring (pid {run.holder or '?'})"}
    if not (rdir / EVAL).is_file():
        return {"state": "partial", "detail": f"lacks {EVAL}; rerun posbench pretrained to score it"}
    if run.scoring:
        return {"state": "partial", "detail": f"scored in part (a stop left {SCORING}); rerun it"}
    return {"state": "done", "detail": "a pretrained model, scored"}


def checkpoint_step(folder: Path) -> Optional[int]:
    """The step a partial folder's checkpoint resumes from (None if it has no readable one)."""
    if not has_checkpoint(folder):
        return None  # nothing to read: no need to load torch
    from posbench.experiment.checkpoint import load_progress

    try:
        state = load_progress(folder)
    except PosbenchError:
        return None
    return int(state["step"]) if state is not None else None
