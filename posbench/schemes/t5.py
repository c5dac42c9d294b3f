"""T5's bucketed relative bias, and Hybrid: that bias plus sinusoidal embeddings."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from posbench.errors import PosbenchError
from posbench.schemes.absolute import Sinusoidal
from posbench.schemes.distance import DistanceBias


def t5_relative_bucket(
    relative_position: torch.Tensor,
    bidirectional: bool = False,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5's bucketing of relative_position = key_pos - query_pos: half the buckets exact, the
    rest log-spaced up to max_distance, everything farther in the last bucket."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    n = relative_position
    if bidirectional:
        num_buckets //= 2
        buckets += (n > 0).long() * num_buckets
        n = n.abs()
    else:
        n = (-n).clamp(min=0)  # only the past counts; the future shares bucket 0
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # the clamp only guards log(0), which is_small discards anyway
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    # a fractional distance: the exact buckets take its whole part, the log-spaced ones its own value
    return buckets + torch.where(is_small, n.long(), large)


class T5Bias(DistanceBias):
    """T5's relative bias (Raffel et al. 2020): a learned scalar per head for each of
    num_buckets log-spaced distance buckets, one table shared by all layers, added to the
    logits after their 1/sqrt(d_head) scaling.

    Set up as in x-transformers (lucidrains/x-transformers `x_transformers/x_transformers.py`,
    `RelativePositionBias`, built with `scale = dim_head ** 0.5`): the bias is
    table[bucket] * sqrt(d_head), and the table starts N(0, 1), nn.Embedding's default. T5
    itself adds the bias to logits that are not divided by sqrt(d); the multiplier makes the
    two parametrizations the same, so under Adam the bias moves at T5's pace.

    Options:
      scale  "sqrt_head_dim" (default): bias = table[bucket] * sqrt(d_head), as x-transformers;
             "none": bias = table[bucket]
      init   "normal" (default): the table starts N(0, 1); "zeros": it starts at zero
    scale "none" with init "zeros" is a table added as is and learned from zero: the setup a
    task gives T5 unless its config says otherwise (posbench/tasks/generators.py, Task.scheme_setup).
    """

    description = "a learned scalar per head per log-spaced distance bucket (Raffel 2020)"
    options = {"num_buckets": 32, "max_distance": 128, "scale": "sqrt_head_dim", "init": "normal"}

    def __init__(self, cfg):
        super().__init__(cfg)
        nb, far = self.opt["num_buckets"], self.opt["max_distance"]
        if nb < 2 or far <= nb // 2:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}: need num_buckets >= 2 and max_distance > "
                f"num_buckets/2 (the exact buckets), got {nb} and {far}"
            )
        scaled = self.choice("scale", ("sqrt_head_dim", "none")) == "sqrt_head_dim"
        self.scale = cfg.head_dim**0.5 if scaled else 1.0  # the bias is table[bucket] * scale
        normal = self.choice("init", ("normal", "zeros")) == "normal"
        table = torch.randn(nb, cfg.n_head) if normal else torch.zeros(nb, cfg.n_head)  # (NB, H)
        self.table = nn.Parameter(table)  # shared by all layers, as in T5

    def distance_bias(self, d, layer):
        b = t5_relative_bucket(-d, False, self.opt["num_buckets"], self.opt["max_distance"])  # (n,) of key - query
        # x-transformers scales after the lookup: the same products
        return (self.table * self.scale).index_select(0, b).t()  # (H, n)


class Hybrid(DistanceBias):
    """Sinusoidal embeddings added to the tokens, and T5Bias, with its options and setup, on
    the logits of every layer."""

    description = "sinusoidal absolute embeddings plus a T5 relative bias in every layer"
    options = T5Bias.options

    def __init__(self, cfg):
        super().__init__(cfg)
        self.absolute = Sinusoidal(dataclasses.replace(cfg, options={}))
        self.relative = T5Bias(cfg)

    def embed(self, x, pos):
        return self.absolute.embed(x, pos)

    def distance_bias(self, d, layer):
        return self.relative.distance_bias(d, layer)
