"""ALiBi: a fixed linear penalty on the logits, one slope per head."""

from __future__ import annotations

import math

import torch

from posbench.schemes.distance import DistanceBias


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head h of n (1-based) gets 2^(-8h/n) when n is a power of two. Otherwise, as in the
    reference code: the slopes of the nearest lower power of two c, then every other slope
    of the 2c-head list, which interleaves and is not monotonic (n=6: 1/4..1/256, 1/2, 1/8)."""
    c = 2 ** math.floor(math.log2(n_heads))
    base = [2.0 ** (-8.0 * h / c) for h in range(1, c + 1)]
    extra = [2.0 ** (-8.0 * h / (2 * c)) for h in range(1, 2 * c + 1, 2)]
    return torch.tensor(base + extra[: n_heads - c])


class ALiBi(DistanceBias):
    description = "a fixed linear penalty -m_h*(i-j) on the logits, one slope per head (Press 2022)"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)  # (H,)

    def distance_bias(self, d, layer):
        return -self.slopes[:, None] * d  # (H, n)

    def linear_slopes(self, layer):
        own = type(self).distance_bias is ALiBi.distance_bias  # a subclass's own function may not be linear
        return self.slopes.float() if own else None  # (H,)
