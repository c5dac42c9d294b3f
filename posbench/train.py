"""Training: one (scheme, seed) at the training length, with AdamW, warmup and cosine decay."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from posbench.config import ExperimentConfig
from posbench.device import autocast, computed_on, pick_device
from posbench.errors import PosbenchError, first_line
from posbench.experiment.checkpoint import load_progress, restore, save_progress, snapshot
from posbench.experiment.records import CHECKPOINT
from posbench.files import write_atomic
from posbench.model import TransformerLM
from posbench.progress import Reporter
from posbench.schemes import run_label
from posbench.tasks import IGNORE


class Diverged(PosbenchError):
    """The loss became NaN or inf: the run stops there and is recorded as diverged."""

    def __init__(self, step: int, loss: float, lr: float, scheme: str = ""):
        self.step, self.loss = step, loss
        why = (
            f"the first loss, before any update: the model's forward is not finite (the scheme '{scheme}' or its "
            f"options), not the learning rate"
            if step == 0
            else f"lower train.lr (now {lr})"
        )
        super().__init__(f"diverged at step {step:,} (loss {loss}); {why}")


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, scheme_lr_mult: float = 1.0):
    """AdamW, weight decay on matrices only; fused where torch has the kernel (CPU and CUDA).
    Each group's `lr_mult` scales the schedule's rate: the parameters of `model.scheme` have
    groups of their own at `scheme_lr_mult` where it is not 1."""
    own = {id(p) for p in model.scheme.parameters()} if scheme_lr_mult != 1 else set()
    rest = [p for p in model.parameters() if id(p) not in own]
    scheme = [p for p in model.parameters() if id(p) in own]
    groups = []
    for mult, params in [(1.0, rest)] + ([(scheme_lr_mult, scheme)] if scheme else []):
        for decays in (True, False):  # matrices decay; vectors and scalars do not
            part = [p for p in params if (p.dim() >= 2) == decays]
            if part:
                groups.append({"params": part, "weight_decay": weight_decay if decays else 0.0, "lr_mult": mult})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def train_model(
    cfg: ExperimentConfig,
    batches,
    reporter: Reporter,
    folder: Path,
    init: Optional[dict] = None,
    probe: Optional[Callable] = None,
) -> TransformerLM:
    """Train cfg.model (one scheme) with seed cfg.seeds[0] in `folder`; returns the model on the CPU.
    Each line of the log (train_log.jsonl) names its attention backend, device, CPU threads and
    versions. `batches(gen)` gives (x, y), with y = -100 where no loss is taken (a task's prompts
    and padding), and has get_state/set_state (its measure makes them). Every train.checkpoint_every
    steps, and on Ctrl-C or SIGTERM, the whole training state goes to folder/checkpoint.pt; a
    later call resumes from it and ends with the weights an uninterrupted run ends with. A NaN
    or inf loss raises Diverged, naming its step.

    `init`: the weights to start from instead of a fresh initialization (a fine-tuned run's
    parent's). `batches(gen)` may give (x, y, pos), pos the (T,) or (B, T) position ids of the batch.
    `probe(step, model, resumed_at)`, if given, is called before the first step and after each
    (posbench/extend/run.py scores a few of them)."""
    seed, tc = cfg.seeds[0], cfg.train
    device = pick_device(tc.device)
    torch.manual_seed(seed)
    model = TransformerLM(cfg.model)
    if init is not None:
        model.load_state_dict(init)
    model = model.to(device)
    backend = model.backend(device, compiled=tc.compile)
    gen = torch.Generator().manual_seed(seed)  # the data order depends on the seed alone
    opt = make_optimizer(model, tc.lr, tc.weight_decay, tc.scheme_lr_mult)
    label = f"{run_label(cfg.model)} seed {seed}"  # rope:yarn for a run posbench extend fine-tunes
    start, spent = _resume(folder, reporter, label, tc.steps, model, opt, gen, device, batches)
    parts = getattr(batches, "parts", 1)  # a task's batch on the CPU comes in parts, cut by length
    params = list(model.parameters())  # once: model.parameters() walks every module each call
    forward = torch.compile(model) if tc.compile else model  # same weights, compiled graph
    log_path = folder / "train_log.jsonl"
    if start:  # lines past the checkpoint are retrained, so they are written again
        _keep_log_before(log_path, start)
    reporter.start(label, tc.steps)
    t0 = time.perf_counter() - spent
    if probe is not None:
        probe(start, model, start)
    recent = []  # this stretch's losses, left on the device until a check needs them
    # what else decides the last digits: a resumed run may differ in them, so each line says its own
    computed = computed_on(device)

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
            raise Diverged(step - len(values) + 1 + bad, values[bad], tc.lr, cfg.model.scheme)
        return values[-1]

    with (
        log_path.open("a" if start else "w", buffering=1) as log,  # line-buffered: `tail -f` works
        stop_requests() as stop,
        _finishing(reporter, label),
    ):
        for step in range(start, tc.steps):
            lr = lr_at(step, tc)
            for g in opt.param_groups:
                g["lr"] = lr * g.get("lr_mult", 1.0)  # a group without lr_mult runs at 1
            loss = train_step(forward, opt, params, batches(gen), device, tc.grad_clip, tc.compile and step == start)
            recent.append(loss.detach())
            if probe is not None:
                probe(step + 1, model, start)
            last = step == tc.steps - 1
            if step % tc.log_every == 0 or last:
                value = finite(step)
                rec = {
                    "step": step,
                    "loss": round(value, 5),
                    "lr": lr,
                    "seconds": round(time.perf_counter() - t0, 3),
                    "attention": backend,
                    **({"parts": parts} if parts > 1 else {}),
                    **computed,
                }
                log.write(json.dumps(rec) + "\n")
                reporter.step(label, step + 1, value)
            if stop.is_set() or (tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0 and not last):
                finite(step)  # never a NaN state saved
                save(step + 1)
            if stop.is_set():
                raise KeyboardInterrupt
    return model.cpu()


def _resume(folder: Path, reporter: Reporter, label: str, steps: int, model, opt, gen, device, batches):
    """(the step to start at, the seconds already spent): from folder's checkpoint where it holds
    one, whose model, optimizer, data order and batches' state are restored; else (0, 0.0)."""
    state = load_progress(folder, reporter, label)
    if state is None:
        return 0, 0.0
    try:
        start, spent = restore(state, model, opt, gen, device, batches), float(state.get("seconds", 0.0))
    except Exception as e:
        raise PosbenchError(
            f"{folder / CHECKPOINT}: does not fit this run ({first_line(e, 120, last=True)}); "
            f"delete {folder} to train this run anew"
        ) from None
    reporter.note(f"{label}: resuming from its checkpoint at step {start:,} of {steps:,}")
    return start, spent


def train_step(forward, opt, params: list, batch, device, grad_clip: float, compiling: bool = False) -> torch.Tensor:
    """One step on `batch`: its loss's gradient (loss_backward), clipped to norm `grad_clip` (0:
    not clipped), and the optimizer's update. Training and the benchmarks take the same step.
    Returns the loss, left on the device."""
    opt.zero_grad(set_to_none=True)
    loss = loss_backward(forward, batch, device, compiling)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    opt.step()
    return loss


def loss_backward(forward, batch, device, compiling: bool) -> torch.Tensor:
    """The loss of one step's batch, its gradient accumulated. A batch is (x, y) or (x, y, pos),
    pos PoSE's position ids, or a list of such parts (a task's batch cut by length): each
    part's loss is its sum over the targets of all the parts, so the gradient is the whole
    batch's mean, as one padded batch gives it."""
    whole = not isinstance(batch, list)
    parts = [batch] if whole else batch
    total = None if whole else sum(int((y != IGNORE).sum()) for _, y, *_ in parts)
    losses = []
    for i, (x, y, *pos) in enumerate(parts):
        inputs = (x.to(device), *(p.to(device) for p in pos))
        y = y.to(device)
        with autocast(device):
            logits = _compiled_call(forward, inputs) if compiling and i == 0 else forward(*inputs)  # (B, T, V)
        flat = logits.float().flatten(0, 1), y.flatten()
        loss = F.cross_entropy(*flat, ignore_index=IGNORE, reduction="mean" if whole else "sum")
        if not whole:
            loss = loss / total
        loss.backward()
        losses.append(loss.detach())
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


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


def _compiled_call(forward, inputs):
    """The first call compiles; a missing C++ compiler or an unsupported op fails here."""
    try:
        return forward(*inputs)
    except PosbenchError:
        raise
    except Exception as e:
        raise PosbenchError(
            f"train.compile: torch.compile failed ({first_line(e, 160)}); train without --compile"
        ) from None
