"""Evaluation: a model's mean next-byte loss at each length, over the same validation tokens."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from posbench.config import ExperimentConfig
from posbench.data import Corpus, as_tensor
from posbench.device import autocast
from posbench.errors import PosbenchError
from posbench.model import TransformerLM


def stride_tokens(stride: float, L: int) -> int:
    """Sliding windows' advance at length L: `stride` tokens, or a fraction (< 1) of L."""
    return int(stride) if stride >= 1 else max(1, round(L * stride))


def windows(n: int, L: int, protocol: str, stride: Optional[float]) -> list[tuple[int, int]]:
    """(start, first scored) per window of the n targets: window inputs are tokens[start : start
    + L] (shorter at the end), and it scores its positions from `first scored` on. Every target
    is scored exactly once.
    nonoverlapping: chunks of L, each scored whole (the last one shorter).
    sliding: windows of L ending stride further each time (stride tokens, or that fraction of
    L); the first scores all of its L targets, every later one only its last stride, so each
    scored target sees at least L - stride earlier tokens (the last window scores what is left)."""
    if protocol == "nonoverlapping":
        return [(s, 0) for s in range(0, n, L)]
    step = stride_tokens(stride, L)
    if step > L:  # a window would score targets it does not hold; Perplexity.decide refuses it first
        raise PosbenchError(f"sliding stride {step} is longer than the window of {L}: some tokens would go unscored")
    out = [(0, 0)]
    end = min(L, n)
    while end < n:
        new_end = min(end + step, n)
        start = max(0, new_end - L)
        out.append((start, end - start))
        end = new_end
    return out


def eval_tokens(corpus: Corpus, cfg: ExperimentConfig, lengths: list[int]) -> torch.Tensor:
    """The validation tokens scored at every length: the first eval.tokens (+1 for targets)."""
    if cfg.eval.tokens < max(lengths):
        raise PosbenchError(f"eval.tokens={cfg.eval.tokens} is fewer than eval length {max(lengths)}")
    n = min(cfg.eval.tokens, len(corpus.val) - 1)
    if n < max(lengths):
        split = (
            f"data.val_path '{cfg.data.val_path}'" if cfg.data.val_path else f"the validation split of '{corpus.name}'"
        )
        unit = "bytes" if corpus.tokenizer == "bytes" else "tokens"
        raise PosbenchError(
            f"{split} has {len(corpus.val)} {unit}, too few for eval length {max(lengths)} (which needs "
            f"{max(lengths) + 1}); use shorter lengths or more text"
        )
    return as_tensor(corpus.val[: n + 1])  # a memory-mapped split reads these alone


@torch.no_grad()
def evaluate_model(
    model: TransformerLM,  # or what posbench/pretrained.py loads: the same scoring methods
    tokens: torch.Tensor,
    lengths: list[int],
    batch_size: int,
    device: torch.device,
    variant: Optional[str] = None,
    factor: Optional[float] = None,
    protocol: str = "nonoverlapping",
    stride: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> tuple[list[dict], dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Mean next-byte loss at each length over the same tokens, every token scored once (see
    `windows` for how each protocol cuts them), so lengths compare directly. With `variant`,
    the scheme's evaluation-time variant of that name is applied per length. Returns the rows,
    each naming the attention backend that computed it, and per scored length the loss summed
    at each window position and the number of tokens scored there, (L,) each, and each window's
    summed loss and scored tokens, (windows, 2). `progress` hears of each batch's input tokens."""
    model = model.to(device).eval()
    backend = model.backend(device, variant=variant)
    n = len(tokens) - 1
    rows, by_position = [], {}
    for L in lengths:
        row = {
            "length": L,
            "protocol": protocol,
            "stride": stride if protocol == "sliding" else None,
            "tokens": n,
            "loss": float("nan"),
            "ppl": float("nan"),
            "attention": backend,
        }
        if model.max_len is not None and L > model.max_len:
            rows.append({**row, "status": "beyond-max-len"})
            continue
        with model.eval_variant(variant, L, factor):
            sums, counts, per_window = _nll_by_position(
                model, tokens, L, batch_size, device, protocol, stride, progress
            )
        loss = sums.sum().item() / n
        if not math.isfinite(loss):  # a blow-up at some length is a result, not a lost row
            rows.append({**row, "status": "non-finite"})
            continue
        by_position[L] = (sums, counts, per_window)
        rows.append({**row, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "status": "ok"})
    model.train()
    return rows, by_position


def window_tokens(n: int, L: int, protocol: str, stride: Optional[float]) -> int:
    """The input tokens the windows of one length take, over n targets (what progress counts)."""
    return sum(min(L, n - s) for s, _ in windows(n, L, protocol, stride))


def _nll_by_position(model, tokens, L: int, batch_size: int, device, protocol, stride, progress=None):
    """The loss summed at each window position 0..L-1 and the tokens scored there, (L,) each;
    each window's summed loss and scored tokens, (windows, 2)."""
    n = len(tokens) - 1
    sums, counts = torch.zeros(L, dtype=torch.float64), torch.zeros(L, dtype=torch.long)
    per_window = []
    wins = windows(n, L, protocol, stride)
    full = [w for w in wins if w[0] + L <= n]
    for i in range(0, len(full), batch_size):
        group = full[i : i + batch_size]
        idx = torch.tensor([s for s, _ in group])[:, None] + torch.arange(L + 1)  # (b, L+1)
        nll = _nll(model, tokens[idx].long().to(device), device)  # (b, L)
        keep = torch.arange(L)[None, :] >= torch.tensor([f for _, f in group])[:, None]  # (b, L)
        sums += (nll * keep).sum(0)
        counts += keep.sum(0)
        per_window.append(torch.stack([(nll * keep).sum(1), keep.sum(1).double()], 1))
        if progress is not None:
            progress(len(group) * L)
    for s, first in wins[len(full) :]:  # the remainder: shorter, one at a time
        nll = _nll(model, tokens[s:].long()[None].to(device), device)[0]  # (n - s,)
        sums[first : len(nll)] += nll[first:]
        counts[first : len(nll)] += 1
        per_window.append(torch.tensor([[nll[first:].sum().item(), float(len(nll) - first)]], dtype=torch.float64))
        if progress is not None:
            progress(len(nll))
    return sums, counts, torch.cat(per_window)


def _nll(model, win, device) -> torch.Tensor:
    """Each target's loss in nats, fp64 on the CPU: (b, T) for windows (b, T+1)."""
    with autocast(device):
        return model.token_losses(win).double().cpu()
