"""Evaluation: a model's mean next-byte loss at each length, over the same validation tokens."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from posbench.config import ExperimentConfig
from posbench.data import Corpus
from posbench.errors import PosbenchError
from posbench.model import TransformerLM
from posbench.train import autocast

PROTOCOL_NAMES = {"nonoverlapping": "non-overlapping chunks, every token scored"}


def eval_tokens(corpus: Corpus, cfg: ExperimentConfig, lengths: list[int]) -> torch.Tensor:
    """The validation tokens scored at every length: the first eval.tokens (+1 for targets)."""
    if cfg.eval.tokens < max(lengths):
        raise PosbenchError(f"eval.tokens={cfg.eval.tokens} is fewer than eval length {max(lengths)}")
    n = min(cfg.eval.tokens, len(corpus.val) - 1)
    if n < max(lengths):
        raise PosbenchError(
            f"the validation split of '{corpus.name}' has {len(corpus.val)} bytes, too few "
            f"for eval length {max(lengths)}; use shorter lengths or more text"
        )
    return corpus.val[: n + 1]


@torch.no_grad()
def evaluate_model(
    model: TransformerLM,
    tokens: torch.Tensor,
    lengths: list[int],
    batch_size: int,
    device: torch.device,
    variant: Optional[str] = None,
    factor: Optional[float] = None,
) -> list[dict]:
    """Mean next-byte loss at each length: the same tokens cut into non-overlapping chunks of
    that length (the last one shorter), every token scored, so lengths compare directly.
    With `variant`, the scheme's evaluation-time variant of that name is applied per length.
    Each row names the attention backend that computed it."""
    model = model.to(device).eval()
    backend = model.backend(device)
    n = len(tokens) - 1
    rows = []
    for L in lengths:
        row = {"length": L, "tokens": n, "loss": float("nan"), "ppl": float("nan"), "attention": backend}
        if model.max_len is not None and L > model.max_len:
            rows.append({**row, "status": "beyond-max-len"})
            continue
        with model.scheme.eval_variant(variant, model.cfg.train_len, L, factor):
            loss = _mean_nll(model, tokens, L, batch_size, device)
        if not math.isfinite(loss):  # a blow-up at some length is a result, not a lost row
            rows.append({**row, "status": "non-finite"})
            continue
        rows.append({**row, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "status": "ok"})
    model.train()
    return rows


def _mean_nll(model, tokens: torch.Tensor, L: int, batch_size: int, device) -> float:
    """All n tokens scored in non-overlapping chunks of L."""
    n = len(tokens) - 1
    starts = list(range(0, n, L))
    full = [s for s in starts if s + L <= n]
    total = 0.0
    for i in range(0, len(full), batch_size):
        idx = torch.tensor(full[i : i + batch_size])[:, None] + torch.arange(L + 1)  # (b, L+1)
        win = tokens[idx].long().to(device)
        total += _nll_sum(model, win, device)
    if len(full) < len(starts):  # the remainder, so that every length scores all n tokens
        win = tokens[starts[-1] :].long()[None].to(device)  # (1, n - s + 1)
        total += _nll_sum(model, win, device)
    return total / n


def _nll_sum(model, win, device) -> float:
    with autocast(device):
        logits = model(win[:, :-1])  # (b, L, V)
    return F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
