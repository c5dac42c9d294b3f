"""Training: one (scheme, seed) at the training length, with AdamW, warmup and cosine decay."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from posbench.config import ExperimentConfig
from posbench.data import Corpus, batch
from posbench.errors import PosbenchError
from posbench.files import TMP_PREFIX, write_atomic
from posbench.model import TransformerLM

CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"  # mid-run state; the one before it


class Diverged(PosbenchError):
    """The loss became NaN or inf: the run stops there and is recorded as diverged."""

    def __init__(self, step: int, loss: float, lr: float):
        self.step, self.loss = step, loss
        super().__init__(f"diverged at step {step} (loss {loss}); lower train.lr (now {lr})")


class Reporter:
    """Progress callbacks; the CLI supplies one that draws bars, library code never prints.
    Runs may train at once (train.workers), so each call names its run's label."""

    def start(self, label: str, total: int) -> None: ...

    def step(self, label: str, step: int, loss: float) -> None: ...

    def finish(self, label: str) -> None: ...

    def note(self, message: str) -> None: ...


def pick_device(name: str, hint: str = "evaluate takes --device cpu") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"train.device={name}: no CUDA device is available here ({hint})")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise PosbenchError(f"train.device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 on GPUs; CPUs stay fp32, the tested default."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only; fused where torch has the kernel (CPU and CUDA)."""
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def train_model(
    cfg: ExperimentConfig,
    corpus: Optional[Corpus],
    reporter: Reporter,
    folder: Path,
    batches: Optional[Callable] = None,
) -> TransformerLM:
    """Train cfg.model (one scheme) with seed cfg.seeds[0] in `folder`; returns the model on the CPU.
    The log (train_log.jsonl) names the attention backend of each line. `batches(gen)` gives
    (x, y), with y = -100 where no loss is taken (a task's prompts and padding), and has
    get_state/set_state; None: random windows of the corpus. Every train.checkpoint_every
    steps, and on Ctrl-C or SIGTERM, the whole training state goes to folder/checkpoint.pt; a
    later call resumes from it and ends with the weights an uninterrupted run ends with. A NaN
    or inf loss raises Diverged, naming its step."""
    seed, tc, L = cfg.seeds[0], cfg.train, cfg.model.train_len
    if batches is None and len(corpus.train) < L + 2:
        raise PosbenchError(
            f"the training split of '{corpus.name}' has {len(corpus.train)} bytes, fewer than model.train_len+2={L + 2}"
        )
    device = pick_device(tc.device)
    torch.manual_seed(seed)
    model = TransformerLM(cfg.model).to(device)
    backend = model.backend(device, compiled=tc.compile)
    gen = torch.Generator().manual_seed(seed)  # the data order depends on the seed alone
    opt = make_optimizer(model, tc.lr, tc.weight_decay)
    label = f"{cfg.model.scheme} seed {seed}"
    start, spent = 0, 0.0
    state = load_progress(folder, reporter, label)
    if state is not None:
        try:
            start, spent = restore(state, model, opt, gen, device, batches), float(state.get("seconds", 0.0))
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()[:120]
            raise PosbenchError(
                f"{folder / CHECKPOINT}: does not fit this run ({reason}); delete {folder} to train this run anew"
            ) from None
        reporter.note(f"{label}: resuming from its checkpoint at step {start} of {tc.steps}")
    params = list(model.parameters())  # once: model.parameters() walks every module each call
    forward = torch.compile(model) if tc.compile else model  # same weights, compiled graph
    log_path = folder / "train_log.jsonl"
    if start:  # lines past the checkpoint are retrained, so they are written again
        _keep_log_before(log_path, start)
    reporter.start(label, tc.steps)
    t0 = time.perf_counter() - spent
    recent = []  # this stretch's losses, left on the device until a check needs them

    def save(next_step: int) -> None:
        save_progress(folder, snapshot(cfg, model, opt, gen, next_step, time.perf_counter() - t0, batches))

    def finite(step: int) -> Optional[float]:
        """The last loss (None if none since the last call); raises Diverged at the first NaN or
        inf since the last call. The losses wait on the device until here: one sync a stretch."""
        if not recent:
            return None
        values = torch.stack(recent).tolist()
        recent.clear()
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            raise Diverged(step - len(values) + 1 + bad, values[bad], tc.lr)
        return values[-1]

    with (
        log_path.open("a" if start else "w", buffering=1) as log,  # line-buffered: `tail -f` works
        stop_requests() as stop,
        _finishing(reporter, label),
    ):
        for step in range(start, tc.steps):
            lr = lr_at(step, tc)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batch(corpus.train, tc.batch_size, L, gen) if batches is None else batches(gen)
            x, y = x.to(device), y.to(device)
            with autocast(device):
                logits = _compiled_call(forward, x) if tc.compile and step == start else forward(x)  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip, foreach=True)
            opt.step()
            recent.append(loss.detach())
            last = step == tc.steps - 1
            if step % tc.log_every == 0 or last:
                value = finite(step)
                rec = {
                    "step": step,
                    "loss": round(value, 5),
                    "lr": lr,
                    "seconds": round(time.perf_counter() - t0, 3),
                    "attention": backend,
                }
                log.write(json.dumps(rec) + "\n")
                reporter.step(label, step + 1, value)
            if stop.is_set() or (tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0 and not last):
                finite(step)  # never a NaN state saved
                save(step + 1)
            if stop.is_set():
                raise KeyboardInterrupt
    return model.cpu()


@contextlib.contextmanager
def _finishing(reporter: Reporter, label: str):
    """The run's progress ends however training ends: other runs may go on after it."""
    try:
        yield
    finally:
        reporter.finish(label)


@contextlib.contextmanager
def stop_requests():
    """Ctrl-C and SIGTERM set the event the training loop checks after each step, so it stops at
    a step's end with a checkpoint; a second signal interrupts at once. Only the main thread
    can own signals, and one that is ignored (Ctrl-C in a worker process) stays ignored."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old = {
        s: signal.signal(s, request)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield stop
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


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
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
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
        except Exception as e:  # torch raises many kinds for a truncated file
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            damaged.append(f"{path}: corrupt or truncated checkpoint ({reason})")
            continue
        if damaged and reporter is not None:
            reporter.note(f"{label}: {damaged[0]}; resuming from the previous one, {path.name}")
        return state
    if damaged:
        raise PosbenchError(f"{damaged[-1]} and no good checkpoint is left; delete {folder} to train this run anew")
    return None


def _keep_log_before(path: Path, step: int) -> None:
    """Drop the log's lines from `step` on, and any a kill cut short: they are trained again."""
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    steps = [_step_of(line) for line in lines]
    write_atomic(path, "".join(line for line, n in zip(lines, steps) if n is not None and n < step))


def _step_of(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a kill, or an empty one


def _compiled_call(forward, x):
    """The first call compiles; a missing C++ compiler or an unsupported op fails here."""
    try:
        return forward(x)
    except PosbenchError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise PosbenchError(f"train.compile: torch.compile failed ({first}); train without --compile") from None
