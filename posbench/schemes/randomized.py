"""Randomized positions: sorted random positions, in training and evaluation, fed to sinusoidal or RoPE."""

from __future__ import annotations

import dataclasses

import torch

from posbench.errors import PosbenchError
from posbench.schemes.absolute import Sinusoidal
from posbench.schemes.base import PositionalScheme
from posbench.schemes.rope import RoPE


class Randomized(PositionalScheme):
    """Randomized positional encodings (Ruoss et al. 2023): a sequence's positions are a sorted
    random subset of [0, max_pos) instead of 0..T-1, so the model meets every position up to
    max_pos >> train_len and only their order is reliable. The positions feed the `base`
    scheme, sinusoidal or rope.

    Set up as the reference, google-deepmind/randomized_positional_encodings: its
    `models/transformer.py` applies the noisy encodings whether training or not, so it draws a
    fresh sorted subset for every batch at evaluation too (`experiments/range_evaluation.py`
    feeds each batch a new rng key; its issue #1: "we also randomize at test time"). While
    training, the draws come from torch's global generator, so they follow torch.manual_seed.

    Options:
      eval_positions  how positions are chosen at evaluation:
        "fresh" (default, the reference): a new sorted draw for every forward call (batch).
                The draws come from a generator this scheme owns, seeded by the length T and by
                k, the number of forward calls at that length since the scheme last entered
                train or eval mode (`train()`, `eval()`) or `restart_draws()`. So the k-th batch
                of length T gets the same positions every time: a checkpoint evaluated with
                the same config (lengths, tokens, batch size) gives the same table, and a length
                scores the same whichever other lengths are evaluated with it.
        "fixed": one sorted draw per length, seeded by the length alone, shared by every batch.
        "consecutive": 0..T-1, as the method is often described.
      base     "sinusoidal" (default) or "rope": the scheme the positions feed
      max_pos  the range positions are drawn from
    Under "fresh" and "fixed", lengths past max_pos cannot be encoded (beyond-max-len).
    """

    description = "train and evaluate on sorted random positions from [0, max_pos) (Ruoss 2023)"
    options = {"base": "sinusoidal", "max_pos": 1024, "eval_positions": "fresh"}
    bases = {"sinusoidal": Sinusoidal, "rope": RoPE}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.choice("base", tuple(self.bases))
        self.choice("eval_positions", ("fresh", "fixed", "consecutive"))
        if self.opt["max_pos"] < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}.max_pos={self.opt['max_pos']} is shorter than "
                f"model.train_len={cfg.train_len}"
            )
        self.inner = self.bases[self.opt["base"]](dataclasses.replace(cfg, options={}))
        self.gen = torch.Generator()  # the evaluation draws; reseeded for every one
        self.draws: dict[int, int] = {}  # length -> forward calls drawn at it so far

    @property
    def max_len(self):
        return None if self.opt["eval_positions"] == "consecutive" else self.opt["max_pos"]

    def train(self, mode: bool = True):
        self.restart_draws()
        return super().train(mode)

    def restart_draws(self) -> None:
        """The next evaluation draw at each length is its first again."""
        self.draws = {}

    def positions(self, T, device):
        M, kind = self.opt["max_pos"], self.opt["eval_positions"]
        if T > M and (self.training or kind != "consecutive"):
            raise PosbenchError(f"randomized: cannot draw {T} distinct positions below max_pos={M}")
        if self.training:
            return torch.randperm(M, device=device)[:T].sort().values  # (T,) increasing
        if kind == "consecutive":
            return torch.arange(T, device=device)  # (T,)
        if kind == "fixed":
            seed = T
        else:
            k = self.draws.get(T, 0)
            self.draws[T] = k + 1
            seed = (T << 32) + k  # distinct for every (T, k) with k < 2^32
        self.gen.manual_seed(seed)
        return torch.randperm(M, generator=self.gen)[:T].sort().values.to(device)  # (T,) increasing

    def embed(self, x, pos):
        return self.inner.embed(x, pos)

    def rotate(self, q, k, pos, layer):
        return self.inner.rotate(q, k, pos, layer)
