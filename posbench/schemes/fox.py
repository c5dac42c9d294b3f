"""FoX, the Forgetting Transformer: a forget gate read from each token decays the logits of older keys."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme


class FoX(PositionalScheme):
    """Forgetting attention (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a
    Forget Gate"). Each head of each layer reads a forget gate from every token of the layer's
    attention input x and adds the log of the gates between key and query to the logits:
        f_t = sigmoid(w_h . x_t + b_h)                            (a scalar per head and token)
        c_t = sum_{l=0..t} log f_l
        bias_ij = sum_{l=j+1..i} log f_l = c_i - c_j             (0 on the diagonal, <= 0 below)
    No other position signal. As the reference (zhixuan-lin/forgetting-transformer
    `ForgettingAttentionLayer.fgate_proj`, fla `ForgettingAttention.f_proj`): one
    Linear(d_model, n_head) with a bias per layer, its weight N(0, 0.02) and its bias 0 (the
    model's init), so every gate starts near 1/2; log f is summed with cumsum (fla
    `fla/ops/forgetting_attn/naive.py`, in fp32 there). Here c is kept in fp64 (`DecayBias`):
    c falls about linearly with t, and in fp32 c_i - c_j would lose ~1e-4 at a few thousand
    tokens and keep a trace of the gates before j, which a window (a pattern's) must not read.

    The gates come from x, which `observe` sees; `bias` reads the same layer's c by index, the
    queries being the last Tq of the Tk keys (the model's blocks of queries), so it holds at any
    length and whatever position values a modifier draws."""

    description = "logits plus the log forget gates sigmoid(w.x+b) of the tokens since the key (Lin 2025, FoX)"
    fixed_distances = "its decay sums the gates of the tokens between query and key, by index, not by position"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gates = nn.ModuleList(nn.Linear(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=0.02)
            nn.init.zeros_(gate.bias)
        self.decay: dict[int, torch.Tensor] = {}  # layer -> c of the current forward, (B, H, T)

    def observe(self, x, pos, layer):
        log_f = F.logsigmoid(self.gates[layer](x).double())  # (B, T, H)
        self.decay[layer] = log_f.cumsum(1).transpose(1, 2)  # (B, H, T): c_t

    def bias(self, q, k, qpos, kpos, layer):
        B, H, Tq, _ = q.shape
        Tk = k.size(2)
        c = self.decay.get(layer)
        if c is None or c.size(0) != B or c.size(-1) < Tk:
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}': its bias reads forget gates from the layer's input, "
                f"so observe(x, pos, layer) must see that input first (the model's attention does)"
            )
        return DecayBias.apply(c[:, :, :Tk], Tq, q.dtype)  # (B, H, Tq, Tk)


class DecayBias(torch.autograd.Function):
    """c_i - c_j, (B, H, Tq, Tk), for the last Tq of the Tk tokens of c (B, H, Tk), computed from
    fp64 c and written straight in `dtype`, so no (Tq, Tk) map is ever made in fp64. The future's
    values (j > i, positive) are masked by attention."""

    @staticmethod
    def forward(ctx, c, Tq: int, dtype):
        B, H, Tk = c.shape
        out = torch.empty(B, H, Tq, Tk, dtype=dtype, device=c.device)
        torch.sub(c[:, :, Tk - Tq :, None], c[:, :, None, :], out=out)  # query i is key Tk - Tq + i
        ctx.Tq = Tq
        return out

    @staticmethod
    def backward(ctx, d_bias):
        Tq, Tk = ctx.Tq, d_bias.size(-1)
        d_c = -d_bias.sum(2, dtype=torch.float64)  # (B, H, Tk): c_j enters row i as -c_j
        d_c[:, :, Tk - Tq :] += d_bias.sum(3, dtype=torch.float64)  # c_i enters as +c_i
        return d_c, None, None
