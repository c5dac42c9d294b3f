"""The RoPE scaling law's predicted break, and the measured one.

Where RoPE should break, and where it does: the scaling law's bound from a run's base, head
size and training length, beside the first position whose loss rises past the in-window level.

The law (Liu et al. 2024, "Scaling Laws of RoPE-based Extrapolation", arXiv 2310.05209; Men et
al. 2024 bound the base from below the same way): RoPE rotates dims (k, k + d/2) by p * theta_k,
theta_k = base^(-2k/d), with period T_k = 2 pi base^(2k/d). A training window of L positions
sees every angle of the dims whose period fits in it, T_k <= L, and only an arc of the others:

    d_extra = 2 * ceil((d/2) * log_base(L / 2 pi))      the critical dimension
    T_extra = 2 pi * base^(d_extra / d)                  the period of the first dim not seen whole

Past T_extra the first partly trained dim turns to angles no training window held, so the law
predicts perplexity rises there. No torch: reports compute both from records.
"""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd

MARGIN = 0.10  # a break: a bin's mean loss above the in-window level by this fraction of it
BINS = 10  # positions are read in bins of train_len / BINS, as one position's mean is noisy


def critical_dim(d_head: int, base: float, train_len: int) -> int:
    """d_extra: how many of the head's d dims turn through a whole period within `train_len`
    positions (even, 0 to d)."""
    turns = (d_head / 2) * math.log(train_len / (2 * math.pi)) / math.log(base)
    return min(d_head, max(0, 2 * math.ceil(turns)))


def extrapolation_bound(d_head: int, base: float, train_len: int) -> float:
    """T_extra: the period of the first dim a training window does not see whole, the length
    past which the law predicts RoPE breaks (infinite when every dim is seen whole)."""
    d_extra = critical_dim(d_head, base, train_len)
    return math.inf if d_extra >= d_head else 2 * math.pi * base ** (d_extra / d_head)


def break_position(loss: pd.Series, train_len: int, margin: float = MARGIN) -> Optional[int]:
    """The first position at or past `train_len` whose bin's mean loss (bins of train_len / BINS
    positions) rises above the in-window level, the mean over positions [L/2, L), by `margin`
    of it; None if no bin of `loss` (indexed by position) does."""
    level = loss[(loss.index >= train_len // 2) & (loss.index < train_len)].mean()
    width = max(1, train_len // BINS)
    past = loss[loss.index >= train_len]
    for start in range(train_len, int(past.index.max()) + 1 if len(past) else train_len, width):
        part = past[(past.index >= start) & (past.index < start + width)]
        if len(part) and part.mean() > level * (1 + margin):
            return start
    return None


def rotary(cfg) -> Optional[tuple[int, float]]:
    """(d, base) of a run whose positions are RoPE's unscaled rotation, else None: a posbench
    run of a rotary scheme (schemes.ROTARY_BASE) not fine-tuned with a scaling, or a pretrained
    model whose rope_type is transformers' default; d is the rotated dims of a head (all of them
    but where a pretrained model's partial_rotary_factor, or a run's option fraction, says fewer:
    int(fraction * d), over which theta_k = base^(-2k/d) spans the whole spectrum). None too for
    a run with keep < 1 or hope: its slow pairs never turn, so no dim breaks where the law says."""
    from posbench.schemes import ROTARY_BASE

    model = cfg.model
    d_head = model.d_model // model.n_head
    if model.pretrained is not None:  # a config may set its head size apart from width / heads (Qwen3)
        d_head = model.pretrained.get("head_dim", d_head)
        rope = model.pretrained.get("rope") or {}
        base, rotated = rope.get("rope_theta"), int(d_head * rope.get("partial_rotary_factor", 1.0))
        return (rotated, float(base)) if base and rope.get("rope_type", "default") == "default" else None
    option = ROTARY_BASE.get(model.scheme)
    if option is None or (model.extend or {}).get("scaling"):
        return None
    opt = model.options
    if opt.get("keep", 1.0) < 1 or opt.get("hope", False):
        return None
    return int(d_head * opt.get("fraction", 1.0)), float(opt[option])
