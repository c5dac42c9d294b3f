"""ALiBi: a fixed linear penalty on the logits, one slope per head."""

from __future__ import annotations

import math

import torch

from posbench.schemes.base import PositionalScheme


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head h of n (1-based) gets 2^(-8h/n) when n is a power of two. Otherwise, as in the
    reference code: the slopes of the nearest lower power of two c, then every other slope
    of the 2c-head list, which interleaves and is not monotonic (n=6: 1/4..1/256, 1/2, 1/8)."""
    c = 2 ** math.floor(math.log2(n_heads))
    base = [2.0 ** (-8.0 * h / c) for h in range(1, c + 1)]
    extra = [2.0 ** (-8.0 * h / (2 * c)) for h in range(1, 2 * c + 1, 2)]
    return torch.tensor(base + extra[: n_heads - c])


class ALiBi(PositionalScheme):
    description = "a fixed linear penalty -m_h*(i-j) on the logits, one slope per head (Press 2022)"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)  # (H,)

    def bias(self, q, k, qpos, kpos, layer):
        return self.once_per_forward((qpos, kpos), lambda: self.linear_bias(qpos, kpos, q.dtype))

    def linear_bias(self, qpos, kpos, dtype):
        dist = (qpos[:, None] - kpos[None, :]).to(dtype)  # (Tq, Tk)
        return (-self.slopes.to(dtype)[:, None, None] * dist).unsqueeze(0)  # (1, H, Tq, Tk)
