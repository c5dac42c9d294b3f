"""FIRE: an MLP of log distance normalised by log query position, as a bias."""

from __future__ import annotations

import torch
import torch.nn as nn

from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme


class FIRE(PositionalScheme):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long
    Context Transformers"): b(i, j) = f(psi(i-j) / psi(max(L_thr, i))), psi(x) = log(c x + 1),
    f an MLP 1 -> 32 -> n_head with ReLU, one per layer. Dividing by psi(i) maps every distance
    into [0, 1] whatever the length (progressive interpolation); the learned threshold L_thr
    keeps short prefixes from being stretched. c and L_thr are learned, as in the paper's
    listing (reproduced e.g. in mcleish7/arithmetic `cramming/architectures/embeddings.py`,
    whose defaults are these: MLP width 32, c from 0.1, eps 1e-6): L_thr = |m * init_L| with m
    learned from 1 and init_L fixed (512 at the paper's training length 2048, so default
    train_len / 4 here)."""

    description = "an MLP of log distance normalised by log query position (Li 2023, FIRE)"
    options = {"mlp_width": 32, "init_c": 0.1, "init_L": None}  # init_L None: train_len / 4
    eps = 1e-6  # keeps psi(max(L_thr, i)) away from 0 when i = 0 and L_thr -> 0

    def __init__(self, cfg):
        super().__init__(cfg)
        init_L = self.opt["init_L"]
        if init_L is None:
            init_L = cfg.train_len / 4
        if isinstance(init_L, bool) or not isinstance(init_L, (int, float)) or init_L <= 0:
            raise PosbenchError(f"scheme_options.{cfg.scheme}.init_L={init_L!r} must be a positive number")
        H, W, n = cfg.n_head, self.opt["mlp_width"], cfg.n_layer
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(1, W), nn.ReLU(), nn.Linear(W, H)) for _ in range(n))
        self.c = nn.Parameter(torch.full((n,), float(self.opt["init_c"])))  # (n_layer,)
        self.L_mult = nn.Parameter(torch.ones(n))  # (n_layer,)
        self.register_buffer("init_L", torch.tensor(float(init_L)), persistent=False)

    def bias(self, q, k, qpos, kpos, layer):
        c = self.c[layer].abs()
        threshold = (self.L_mult[layer] * self.init_L).abs()
        dist = (qpos[:, None] - kpos[None, :]).clamp(min=0).float()  # (Tq, Tk); future is masked
        norm = torch.maximum(qpos.float(), threshold)  # (Tq,)
        x = torch.log1p(c * dist) / (torch.log1p(c * norm) + self.eps)[:, None]  # (Tq, Tk) in [0, 1]
        b = self.mlp[layer](x.unsqueeze(-1).to(q.dtype))  # (Tq, Tk, H)
        return b.permute(2, 0, 1).unsqueeze(0)  # (1, H, Tq, Tk)
