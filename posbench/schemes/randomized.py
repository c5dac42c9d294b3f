"""Randomized positions: train on sorted random positions, feeding sinusoidal or RoPE."""

from __future__ import annotations

import dataclasses

import torch

from posbench.errors import PosbenchError
from posbench.schemes.absolute import Sinusoidal
from posbench.schemes.base import PositionalScheme
from posbench.schemes.rope import RoPE


class Randomized(PositionalScheme):
    """Randomized positional encodings (Ruoss et al. 2023; google-deepmind/
    randomized_positional_encodings): while training, a sequence's positions are a sorted
    random subset of [0, max_pos) instead of 0..T-1, one subset per batch, so the model meets
    every position up to max_pos >> train_len and only their order is reliable. The positions
    feed the `base` scheme, sinusoidal or rope. The training draws come from torch's global
    generator, so they follow torch.manual_seed.

    Evaluation uses 0..T-1 (eval_positions: consecutive, as the method is usually described).
    The reference code draws at evaluation too (models/transformer.py applies the noisy
    encodings unconditionally); eval_positions: random does that, with one sorted draw per
    length seeded by the length, so a table repeats exactly. Then lengths past max_pos cannot
    be encoded (beyond-max-len)."""

    description = "train on sorted random positions from [0, max_pos), evaluate on 0..T-1 (Ruoss 2023)"
    options = {"base": "sinusoidal", "max_pos": 1024, "eval_positions": "consecutive"}
    bases = {"sinusoidal": Sinusoidal, "rope": RoPE}
    eval_kinds = ("consecutive", "random")

    def __init__(self, cfg):
        super().__init__(cfg)
        for key, valid in (("base", tuple(self.bases)), ("eval_positions", self.eval_kinds)):
            if self.opt[key] not in valid:
                raise PosbenchError(
                    f"scheme_options.{cfg.scheme}.{key}={self.opt[key]!r}: expected one of {', '.join(valid)}"
                )
        if self.opt["max_pos"] < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}.max_pos={self.opt['max_pos']} is shorter than "
                f"model.train_len={cfg.train_len}"
            )
        self.inner = self.bases[self.opt["base"]](dataclasses.replace(cfg, options={}))

    @property
    def max_len(self):
        return self.opt["max_pos"] if self.opt["eval_positions"] == "random" else None

    def positions(self, T, device):
        M = self.opt["max_pos"]
        if T > M and (self.training or self.opt["eval_positions"] == "random"):
            raise PosbenchError(f"randomized: cannot draw {T} distinct positions below max_pos={M}")
        if self.training:
            return torch.randperm(M, device=device)[:T].sort().values  # (T,) increasing
        if self.opt["eval_positions"] == "consecutive":
            return torch.arange(T, device=device)  # (T,)
        gen = torch.Generator().manual_seed(T)  # the same draw for a length, every time
        return torch.randperm(M, generator=gen)[:T].sort().values.to(device)  # (T,) increasing

    def embed(self, x, pos):
        return self.inner.embed(x, pos)

    def rotate(self, q, k, pos, layer):
        return self.inner.rotate(q, k, pos, layer)
