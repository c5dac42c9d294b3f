"""CoPE: positions counted by sigmoid gates on q.k, read from a learned table as a bias."""

from __future__ import annotations

import torch
import torch.nn as nn

from posbench import native
from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme


def cope_bias(q, k, table, qpos, kpos) -> torch.Tensor:
    """CoPE's bias as the paper's listing writes it, left to autograd: (B, H, Tq, Tk) from q
    (B, H, Tq, D), k (B, H, Tk, D) and a (D, npos_max) table of position vectors e[p]."""
    P = table.size(1)
    future = kpos[None, :] > qpos[:, None]  # (Tq, Tk)
    gates = torch.matmul(q * q.size(-1) ** -0.5, k.transpose(-1, -2)).sigmoid()  # (B, H, Tq, Tk)
    gates = gates.masked_fill(future, 0.0)
    # positions in fp32 whatever q's dtype: summed in bf16, a position is off by up to 0.5
    pos = gates.float().flip(-1).cumsum(-1).flip(-1)  # p_ij = sum_{t=j..i} g_it
    pos = pos.clamp(max=P - 1)
    by_pos = torch.matmul(q, table)  # (B, H, Tq, P): q_i.e[p] at every whole position p
    lo, hi = pos.floor(), pos.ceil()
    w = pos - lo  # (B, H, Tq, Tk) in [0, 1)
    at_lo, at_hi = by_pos.gather(-1, lo.long()), by_pos.gather(-1, hi.long())  # (B, H, Tq, Tk) each
    return (at_lo * (1 - w) + at_hi * w).to(q.dtype)  # (B, H, Tq, Tk)


class CoPE(PositionalScheme):
    """Contextual position encoding (Golovneva et al. 2024, the paper's listing; x-transformers
    `use_cope`). Positions count what the query attends to rather than tokens:
        gate_it = sigmoid(q_i.k_t / sqrt(d)) for t <= i (0 for the future),
        p_ij = sum_{t=j..i} gate_it                                  (a real number)
        bias_ij = interpolation of q_i.e[p] between e[floor p] and e[ceil p]
    with e a learned (npos_max, d) table per layer, shared by the heads and zero at the start;
    p is clamped to npos_max - 1. The gates need q and k, which the bias hook receives, and
    the future mask by position, since this scheme keeps positions 0..T-1."""

    description = "positions counted by sigmoid gates on q.k, learned position logits (Golovneva 2024)"
    options = {"npos_max": 64}
    kernels = ("cope",)
    fixed_distances = "its positions are counted by gates on q.k, not handed to it"

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.opt["npos_max"] < 2:
            raise PosbenchError(f"scheme_options.{cfg.scheme}.npos_max must be at least 2")
        shape = (cfg.head_dim, self.opt["npos_max"])
        self.pos_emb = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for _ in range(cfg.n_layer))

    def bias(self, q, k, qpos, kpos, layer):
        return cope_bias(q, k, self.pos_emb[layer].to(q.dtype), qpos, kpos)  # (B, H, Tq, Tk)

    def attend(self, q, k, v, qpos, kpos, layer):
        # the same attention, with this bias, through the C kernel posbench/native/cope.c
        # where it applies (CPU, fp32, a C compiler); None declines, so the backend uses
        # `bias`, as it must for a subclass that changes the bias or the positions the kernel assumes
        if type(self).bias is not CoPE.bias or type(self).positions is not PositionalScheme.positions:
            return None
        return native.cope_attention(q, k, v, self.pos_emb[layer], qpos, kpos)
