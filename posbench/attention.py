"""The one causal attention function every scheme goes through, blocked over queries."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

BiasFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    bias_fn: BiasFn,
    block: Optional[int] = None,
) -> torch.Tensor:
    """softmax(q.k / sqrt(d) + bias + causal mask) v over (B, H, T, D) tensors.

    With `block`, queries are processed `block` at a time against the keys they can see, so no
    (T, T) tensor per head is ever built and memory grows linearly with T.
    """
    T = q.size(2)
    if block is None or T <= block:
        return _attend(q, k, v, pos, pos, 0, bias_fn)
    out = []
    for s in range(0, T, block):
        e = min(s + block, T)
        out.append(_attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], pos[s:e], pos[:e], s, bias_fn))
    return torch.cat(out, dim=2)  # (B, H, T, D)


def _attend(q, k, v, qpos, kpos, q0: int, bias_fn: BiasFn) -> torch.Tensor:
    """Queries q0..q0+Tq-1 attend to keys 0..Tk-1."""
    Tq, Tk = q.size(2), k.size(2)
    bias = bias_fn(q, k, qpos, kpos)  # None or (B or 1, H, Tq, Tk)
    if bias is None and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # causality is by index, not by position value, so schemes may renumber positions
    qi = torch.arange(q0, q0 + Tq, device=q.device)
    future = torch.arange(Tk, device=q.device)[None, :] > qi[:, None]  # (Tq, Tk)
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~future)
    bias = bias.masked_fill(future, float("-inf"))
    if not bias.requires_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    # A mask that needs grad sends SDPA to its math path, which also pays for a "safe" softmax
    # (an all(-inf) check and a where per row). Every row here sees at least its own key, so
    # the plain softmax is safe and measurably cheaper.
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5 + bias  # (B, H, Tq, Tk)
    return torch.matmul(scores.softmax(dim=-1), v)  # (B, H, Tq, D)
