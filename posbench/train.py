"""Training: one (scheme, seed) at the training length, with AdamW, warmup and cosine decay."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from posbench.config import ExperimentConfig
from posbench.data import Corpus, batch
from posbench.errors import PosbenchError
from posbench.model import TransformerLM


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


def train_model(cfg: ExperimentConfig, corpus: Optional[Corpus], reporter: Reporter, log_path: Path,
                batches: Optional[Callable] = None) -> TransformerLM:  # fmt: skip
    """Train cfg.model (one scheme) with seed cfg.seeds[0]; returns the model on the CPU. Each
    line of the log names the attention backend that computed it. `batches(gen)` gives (x, y),
    with y = -100 where no loss is taken (a task's prompts and padding); None: random windows
    of the corpus."""
    seed, tc, L = cfg.seeds[0], cfg.train, cfg.model.train_len
    if batches is None and len(corpus.train) < L + 2:
        raise PosbenchError(
            f"the training split of '{corpus.name}' has {len(corpus.train)} bytes, "
            f"fewer than model.train_len+2={L + 2}"
        )
    device = pick_device(tc.device)
    torch.manual_seed(seed)
    model = TransformerLM(cfg.model).to(device)
    backend = model.backend(device, compiled=tc.compile)
    gen = torch.Generator().manual_seed(seed)  # the data order depends on the seed alone
    opt = make_optimizer(model, tc.lr, tc.weight_decay)
    params = list(model.parameters())  # once: model.parameters() walks every module each call
    forward = torch.compile(model) if tc.compile else model  # same weights, compiled graph
    label = f"{cfg.model.scheme} seed {seed}"
    reporter.start(label, tc.steps)
    t0 = time.perf_counter()
    with log_path.open("w", buffering=1) as log:  # line-buffered: `tail -f` works
        for step in range(tc.steps):
            lr = lr_at(step, tc)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batch(corpus.train, tc.batch_size, L, gen) if batches is None else batches(gen)
            x, y = x.to(device), y.to(device)
            with autocast(device):
                logits = _compiled_call(forward, x) if tc.compile and step == 0 else forward(x)  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip, foreach=True)
            opt.step()
            if step % tc.log_every == 0 or step == tc.steps - 1:
                value = loss.item()
                if not math.isfinite(value):
                    raise PosbenchError(
                        f"training {cfg.model.scheme} diverged at step {step} (loss {value}); "
                        f"lower train.lr (now {tc.lr})"
                    )
                rec = {"step": step, "loss": round(value, 5), "lr": lr,
                       "seconds": round(time.perf_counter() - t0, 3), "attention": backend}  # fmt: skip
                log.write(json.dumps(rec) + "\n")
                reporter.step(label, step + 1, value)
    reporter.finish(label)
    return model.cpu()


def _compiled_call(forward, x):
    """The first call compiles; a missing C++ compiler or an unsupported op fails here."""
    try:
        return forward(x)
    except PosbenchError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise PosbenchError(f"train.compile: torch.compile failed ({first}); train without --compile") from None
