"""Transformer-XL's relative attention: content and position terms, and its shift."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench import native
from posbench.schemes.absolute import sinusoid
from posbench.schemes.base import PositionalScheme, require_even


class TransformerXL(PositionalScheme):
    """score = (q_i + u).k_j + (q_i + v).W_r r(i-j), all scaled by 1/sqrt(d) (Dai 2019).

    The content term's u rides on q through `rotate`, so attention computes (q + u).k itself;
    the position term is the bias, computed from that same q with u swapped for v.

    Set up as the reference, kimiyoung/transformer-xl `pytorch/mem_transformer.py`: u and v
    (its r_w_bias, r_r_bias) are (H, D), shared by all layers, and start N(0, 0.02) like every
    other weight (`weights_init` in `pytorch/train.py`, init_std 0.02); W_r, one nn.Linear per
    layer (its r_net), gets the model's N(0, 0.02) init of every nn.Linear (model.py), as there.

    Options:
      uv_init  "normal" (default): u, v start N(0, 0.02), as the reference; "zeros": they start at zero
    """

    description = "content-dependent relative attention with sinusoidal distances (Dai 2019)"
    options = {"uv_init": "normal"}
    fixed_distances = "its position term is built for positions 0..T-1 (rel_shift), not from the positions handed to it"

    def __init__(self, cfg):
        super().__init__(cfg)
        H, D, C = cfg.n_head, cfg.head_dim, cfg.d_model
        require_even(cfg, "model.d_model", C)  # r(i-j) is a sinusoid of width d_model
        if self.choice("uv_init", ("normal", "zeros")) == "normal":  # (H, 1, D) each
            u, v = torch.randn(H, 1, D) * 0.02, torch.randn(H, 1, D) * 0.02
        else:
            u, v = torch.zeros(H, 1, D), torch.zeros(H, 1, D)
        self.u, self.v = nn.Parameter(u), nn.Parameter(v)  # shared by all layers, as in the paper
        self.w_r = nn.ModuleList([nn.Linear(C, C, bias=False) for _ in range(cfg.n_layer)])

    def rotate(self, q, k, pos, layer):
        return q + self.u.to(q.dtype), k  # u is fp32; under bf16 autocast q must stay bf16

    def bias(self, q, k, qpos, kpos, layer):
        B, H, Tq, D = q.shape
        Tk = k.size(2)
        # Positions are consecutive and the last query sees the last key, so the distances
        # i-j run from Tk-1 down to -(Tq-1). Column c of `rev` holds distance Tk-1-c; a last
        # column of zeros is the padding the shift needs, made by the matmul for free.
        r = sinusoid(torch.arange(Tk - 1, -1, -1, device=q.device), self.cfg.d_model)  # (Tk, C)
        rk = self.w_r[layer](r.to(q.dtype)).view(Tk, H, D).permute(1, 2, 0)  # (H, D, Tk)
        rk = F.pad(rk, (0, 1))  # (H, D, Tk + 1)
        # heads first, so this is H matmuls of (B*Tq, D) x (D, Tk+1), not B*H small ones
        qv = ((q + (self.v - self.u).to(q.dtype)) * D**-0.5).transpose(0, 1).reshape(H, B * Tq, D)
        rev = torch.bmm(qv, rk).view(H, B, Tq, Tk + 1)  # (H, B, Tq, Tk + 1)
        return rel_shift(rev).transpose(0, 1)  # (B, H, Tq, Tk): [i, j] is distance qpos_i - kpos_j

    def attend(self, q, k, v, qpos, kpos, layer):
        # the same scores through posbench/native/attention.c where it applies (CPU, fp32, a C
        # compiler), the position term computed inside its tiles, so the (T, T) bias above is
        # never written; None declines, so the backend uses `bias`, as it must for a subclass
        # that changes the bias or the positions
        if type(self).bias is not TransformerXL.bias or type(self).positions is not PositionalScheme.positions:
            return None
        if not native.attention_applies(q, k, v):  # before building rk and q + v for nothing
            return None
        H, D, Tk = q.size(1), q.size(3), k.size(2)
        r = sinusoid(torch.arange(Tk, device=q.device), self.cfg.d_model)  # (Tk, C): row d, distance d
        rk = self.w_r[layer](r.to(q.dtype)).view(Tk, H, D).transpose(0, 1)  # (H, Tk, D)
        return native.relative_attention(q, k, v, q + (self.v - self.u).to(q.dtype), rk)  # q + v


def rel_shift(rev: torch.Tensor) -> torch.Tensor:
    """(..., Tq, Tk+1) -> (..., Tq, Tk) with out[..., i, j] = rev[..., i, Tq-1-i+j]: Transformer-XL's
    shift without a gather, reading the buffer with rows one element shorter. The last column
    of `rev` must be padding. Only j <= i + Tk-Tq (the past) is meaningful; the future holds
    whatever the shift reads and is masked."""
    *lead, Tq, Tk1 = rev.shape
    Tk = Tk1 - 1
    return rev.flatten(-2)[..., Tq - 1 : Tq - 1 + Tq * Tk].view(*lead, Tq, Tk)
