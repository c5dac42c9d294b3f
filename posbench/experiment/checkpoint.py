"""Checkpoints: a finished run's weights (model.pt) and the whole training state of an unfinished one.

model.pt carries its own config, so any finished run can be rebuilt and scored with nothing
else. checkpoint.pt holds everything the next training steps depend on; it is written whole
and the one it replaces is kept as checkpoint.prev.pt, a fallback if the newest is damaged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from pathlib import Path
from typing import Optional

import torch

from posbench.config import ExperimentConfig, config_from_dict, read_record
from posbench.errors import PosbenchError, first_line
from posbench.experiment.records import (
    CHECKPOINT,
    CONFIG,
    DIVERGED,
    PREVIOUS,
    WEIGHTS,
    check_describes,
    check_weights_read,
)
from posbench.files import TMP_PREFIX, atomic, room_in
from posbench.model import TransformerLM
from posbench.progress import Reporter
from posbench.registry import named_by


def weights_digest(state: dict) -> str:
    """sha256 over a state dict's names and tensor bytes, in name order: written with the
    weights and checked on load, so a file damaged on disk is never scored."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_mark(model) -> str:
    """What a record's row names the weights that scored it by: the first 16 digits of the sha256
    model.pt holds for them; "" for a model posbench did not train (a pretrained one, whose files
    are pinned by their own sha256)."""
    return weights_digest(model.state_dict())[:16] if isinstance(model, TransformerLM) else ""


def _damaged(ckpt: dict, key: str) -> bool:
    """Whether a checkpoint's weights differ from the checksum written with them (one without
    a checksum is taken as it is)."""
    return "sha256" in ckpt and weights_digest(ckpt[key]) != ckpt["sha256"]


def save_checkpoint(path: Path, model: TransformerLM, cfg: ExperimentConfig, read: Optional[dict] = None) -> None:
    """model.pt: the weights, their config and checksum, and `read`, the data they were trained
    on as data.json names it (corpus, sha256; None: a synthetic task's, which its config makes)."""
    state = model.state_dict()
    ckpt = {"config": cfg.to_dict(), "model": state, "sha256": weights_digest(state)}
    if read is not None:
        ckpt["read"] = read
    with atomic(path) as tmp, open(tmp, "wb") as f:  # a file object: a full disk keeps its errno
        torch.save(ckpt, f)


def pretrained_refused(rdir: Path, advice: str) -> None:
    """Refuse a pretrained model's scores (posbench pretrained's run folder: config.yaml names
    the model, no model.pt) in one line with `advice`, where {path} is the model's path."""
    try:
        pretrained = read_record(rdir / CONFIG).get("model", {}).get("pretrained")
    except PosbenchError:
        return
    if isinstance(pretrained, dict) and pretrained.get("path"):
        path = pretrained["path"]
        raise PosbenchError(f"{rdir}: the scores of the pretrained model {path}; {advice.format(path=path)}")


def load_run(run_dir: Path) -> tuple[ExperimentConfig, TransformerLM]:
    """A checkpoint carries its own config: nothing else is needed to rebuild the model."""
    ckpt_path = Path(run_dir) / WEIGHTS
    if not Path(run_dir).is_dir():
        raise PosbenchError(f"{run_dir}: no such run directory")
    if not ckpt_path.is_file():
        runs = sorted(p.parent for p in Path(run_dir).glob(f"*/{WEIGHTS}") if not p.parent.name.startswith("."))
        if runs:  # an experiment folder: its runs hold the checkpoints
            raise PosbenchError(f"{run_dir}: an experiment folder, not a run; give one of its runs, e.g. {runs[0]}")
        if (Path(run_dir) / DIVERGED).is_file():
            raise PosbenchError(f"{run_dir}: its training diverged, so it holds no weights; delete it to retrain")
        pretrained_refused(Path(run_dir), "score it again with posbench pretrained {path}")
        raise PosbenchError(f"{run_dir}: holds no checkpoint (model.pt); train it first")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if _damaged(ckpt, "model"):
            raise PosbenchError(
                f"{ckpt_path}: damaged: its weights do not match the checksum written with them; "
                f"restore the file or delete the run to retrain it"
            )
        cfg = config_from_dict(ckpt["config"], source=str(ckpt_path))
        with named_by(run_dir):  # a scheme of the user's, named by the run's record: said before it runs
            model = TransformerLM(cfg.model)
    except PosbenchError:
        raise
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise PosbenchError(
            f"{ckpt_path}: corrupt or not a posbench checkpoint ({first_line(e, 120)}); restore the file, "
            f"or delete it and rerun the experiment's command to train the run again"
        ) from None
    cls = type(model.scheme)  # an option added later is left out of a record at its default
    unrecorded = sorted(set(cls.options) - set(cfg.model.options) - set(cls.added_later))
    if unrecorded:  # its weights were made under defaults that this posbench may not share
        raise PosbenchError(
            f"{ckpt_path}: does not record scheme '{cfg.model.scheme}''s option(s) {', '.join(unrecorded)}, "
            f"so it cannot be scored as it was trained; it was saved by another version: retrain it"
        )
    try:
        model.load_state_dict(ckpt["model"])
    except Exception as e:
        raise PosbenchError(
            f"{ckpt_path}: its weights do not fit scheme '{cfg.model.scheme}' as this posbench "
            f"builds it ({first_line(e, 120, last=True)}); it was saved by another version: retrain it"
        ) from None
    if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
        raise PosbenchError(f"{ckpt_path}: holds non-finite weights (NaN or inf); retrain it")
    if "read" in ckpt:
        check_weights_read(Path(run_dir), ckpt["read"])
    record = Path(run_dir) / CONFIG
    if record.is_file():  # the run's record: its data and eval settings are the current ones
        rec = config_from_dict(read_record(record), source=str(record))
        check_describes(record, rec, cfg)
        cfg = rec
        model.cfg = dataclasses.replace(model.cfg, attention=rec.model.attention)
    return cfg, model


def snapshot(
    cfg: ExperimentConfig, model, opt, gen: torch.Generator, next_step: int, seconds: float, batches=None
) -> dict:
    """Everything the next steps depend on: weights, AdamW's moments and step counts, the data
    generator and every global generator a scheme or torch might draw from."""
    return {
        "config": cfg.to_dict(),
        "step": next_step,  # the first step still to train; the LR schedule is a function of it
        "seconds": seconds,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "data": gen.get_state(),
        "batches": batches.get_state() if batches is not None else None,  # a task's instance stream
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": list(random.getstate()[1]),
    }


def restore(state: dict, model, opt, gen: torch.Generator, device: torch.device, batches=None) -> int:
    """Put a snapshot back; returns the step to continue from."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["data"])
    if batches is not None:
        batches.set_state(state["batches"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate((3, tuple(state["python"]), None))
    return int(state["step"])


def save_progress(folder: Path, state: dict) -> None:
    """folder/checkpoint.pt, written whole: a temporary file, fsync, then a rename. The one it
    replaces becomes checkpoint.prev.pt, so a checkpoint damaged on disk has a fallback."""
    path, tmp = folder / CHECKPOINT, folder / (TMP_PREFIX + CHECKPOINT)
    try:
        with room_in(folder), open(tmp, "wb") as f:
            torch.save({**state, "sha256": weights_digest(state["model"])}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk, or a signal: the checkpoints before it stand
        tmp.unlink(missing_ok=True)
        raise
    if path.exists():
        os.replace(path, folder / PREVIOUS)
    os.replace(tmp, path)
    fd = os.open(folder, os.O_RDONLY)  # the renames themselves survive a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_progress(folder: Path, reporter: Optional[Reporter] = None, label: str = "") -> Optional[dict]:
    """The newest readable checkpoint in `folder`, or None if it has none. A damaged one is said
    in one line and the previous one used; with no good one left it is an error, never a silent
    restart from step 0."""
    damaged = []
    for name in (CHECKPOINT, PREVIOUS):
        path = folder / name
        if not path.is_file():
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not {"model", "optimizer", "step", "data"} <= set(state):
                raise ValueError("not a posbench training checkpoint")
            if _damaged(state, "model"):
                raise ValueError("its weights do not match the checksum written with them")
        except Exception as e:  # torch raises many kinds for a truncated file
            damaged.append(f"{path}: corrupt or truncated checkpoint ({first_line(e, 120)})")
            continue
        if damaged and reporter is not None:
            reporter.note(f"{label}: {damaged[0]}; resuming from the previous one, {path.name}")
        return state
    if damaged:
        raise PosbenchError(f"{damaged[-1]} and no good checkpoint is left; delete {folder} to train this run anew")
    return None
