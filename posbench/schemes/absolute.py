"""Absolute schemes: a vector per position added to the token embeddings (sinusoidal, learned)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme, require_even


def sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(p, 2k) = sin(p / 10000^(2k/dim)), PE(p, 2k+1) = cos(same); (len(pos), dim)."""
    inv = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    ang = pos.float()[:, None] * inv[None, :]  # (T, dim/2)
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1)  # interleaved (T, dim)


class Sinusoidal(PositionalScheme):
    """The encoding is scaled to a root mean square of `rms` per element, by default 0.02: the
    token embeddings' init std, and the learned table's, so neither drowns the other at the
    start. At x-transformers' scale, 1/sqrt(d_model) (RMS 0.06 at width 128), a 4-layer model on
    copy sits on the uniform-loss plateau 5-10x longer than NoPE; at RMS 0.02 it leaves it as
    soon as NoPE does (docs/tasks.md, "The recipe")."""

    description = "fixed sin/cos of the absolute position added to the embeddings (Vaswani 2017)"
    options = {"rms": 0.02}  # each element's root mean square; sin and cos alone have 1/sqrt(2)

    def __init__(self, cfg):
        super().__init__(cfg)
        require_even(cfg, "model.d_model", cfg.d_model)

    def embed(self, x, pos):
        return x + sinusoid(pos, x.size(-1)).to(x.dtype) * (self.opt["rms"] * math.sqrt(2))


class Learned(PositionalScheme):
    """A table of max_len rows, GPT-2 style: rows past the training length exist but are never
    trained, so evaluating there shows what an untrained position does. Past the table there
    is no position at all, and the model refuses rather than clamp."""

    description = "a trained table of absolute position vectors (GPT-2); undefined past its size"
    options = {"max_len": 1024}  # GPT-2's n_positions

    @classmethod
    def options_at(cls, options: dict, length: int) -> dict:
        """The table grows to `length`: its new rows are initialised as GPT-2's."""
        return {**options, "max_len": max(options["max_len"], length)}

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.max_len < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.learned.max_len={self.max_len} is shorter than model.train_len={cfg.train_len}"
            )
        self.table = nn.Parameter(torch.randn(self.max_len, cfg.d_model) * 0.02)  # (max_len, C)

    @property
    def max_len(self):
        return self.opt["max_len"]

    def embed(self, x, pos):
        return x + self.table[pos]  # (B, T, C)
