"""FIRE: an MLP of log distance normalised by log query position, as a bias."""

from __future__ import annotations

import dataclasses
from typing import Optional

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
        threshold = (self.L_mult[layer] * self.init_L).abs()
        x = normalised(qpos, kpos, self.c[layer].abs(), threshold, self.eps)  # (Tq, Tk) in [0, 1]
        return as_lines(self.mlp[layer], x, q.dtype).unsqueeze(0)  # (1, H, Tq, Tk)

    def tiled_bias(self, qpos, kpos, layer, dtype):
        """The bias as its lines and the terms of x, for a kernel to compute (posbench/kernels):
        whole-number positions (T,) shared by the batch, the MLP as this class builds it."""
        lines = mlp_lines(self.mlp[layer])
        if lines is None or type(self).bias is not FIRE.bias or qpos.dim() != 1 or qpos.is_floating_point():
            return None
        threshold = (self.L_mult[layer] * self.init_L).abs()
        return Lines(*lines, self.c[layer].abs(), threshold, self.eps, qpos, kpos)


def normalised(qpos, kpos, c, threshold, eps: float) -> torch.Tensor:
    """FIRE's x = psi(i - j) / psi(max(L_thr, i)), psi(d) = log(1 + c d), (Tq, Tk) fp32; the
    future's distances are 0 (masked later)."""
    dist = (qpos[:, None] - kpos[None, :]).clamp(min=0).float()  # (Tq, Tk)
    norm = torch.maximum(qpos.float(), threshold)  # (Tq,)
    return torch.log1p(c * dist) / (torch.log1p(c * norm) + eps)[:, None]


@dataclasses.dataclass
class Lines:
    """FIRE's bias as posbench's Triton kernels compute it (posbench/kernels): A[h, s] x + C[h, s]
    with s the number of `kinks` below x = normalised(qpos, kpos, c, threshold, eps). A and C are
    (W + 1, H) fp32, c and threshold 0-d tensors, all of them differentiable; kinks (W,) sorted,
    +inf for a unit that never turns (mlp_lines)."""

    kinks: torch.Tensor
    A: torch.Tensor
    C: torch.Tensor
    c: torch.Tensor
    threshold: torch.Tensor
    eps: float
    qpos: torch.Tensor
    kpos: torch.Tensor

    def dense(self) -> torch.Tensor:
        """(1, H, Tq, Tk) fp32, the bias these lines stand for, in plain torch."""
        x = normalised(self.qpos, self.kpos, self.c, self.threshold, self.eps)
        return lines_at(self.kinks, self.A, self.C, x, torch.float32).unsqueeze(0)


def as_lines(mlp: nn.Sequential, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """mlp(x) for the (Tq, Tk) scalars x, as (H, Tq, Tk) in `dtype`, without its (Tq, Tk, W)
    hidden layer.
    A 1 -> W -> H ReLU MLP is piecewise linear in x: unit k turns on or off at x = -b1_k / w1_k.
    Between consecutive kinks the units that are on are fixed, so the MLP is one line per
    segment, A_s x + C_s (H values each); every x costs a bucketize and two gathers. Equal to
    the MLP up to rounding, and so are the gradients (a kink's own x aside, a set of measure
    zero); the parameters stay the MLP's. Any other MLP (a subclass's) is run as it is."""
    lines = mlp_lines(mlp)
    if lines is None:
        return mlp(x.unsqueeze(-1).to(dtype)).permute(2, 0, 1)
    return lines_at(*lines, x, dtype)


def lines_at(kinks, A, C, x: torch.Tensor, dtype) -> torch.Tensor:
    """(H, Tq, Tk) in `dtype`: at each x, the line of the segment it falls in (see as_lines)."""
    H = A.size(1)
    grad = torch.is_grad_enabled()
    # (Tq * Tk,): the kinks below each x; int64 where a gradient is taken, since a CPU's
    # index_add (the gathers' backward there) takes int32 indices 10x slower; int32 without
    seg = torch.bucketize(x.detach(), kinks, out_int32=not grad).flatten()
    if grad:  # fp32: the gathers' backward sums every (i, j) into the (W + 1, H) tables
        # a GPU's sums by bincount, whose data-dependent output shape torch.compile cannot trace
        fast = x.is_cuda and not torch.compiler.is_compiling()
        gather = SegmentGather.apply if fast else lambda table, seg: table.index_select(1, seg)
        out = gather(A.T, seg) * x.float().flatten() + gather(C.T, seg)  # (H, Tq * Tk)
        return out.to(dtype).view(H, *x.shape)
    out = C.T.to(dtype).index_select(1, seg)  # (H, Tq * Tk): one (H, Tq, Tk) beside it, added in place
    return out.addcmul_(A.T.to(dtype).index_select(1, seg), x.to(dtype).flatten()).view(H, *x.shape)


def mlp_lines(mlp: nn.Sequential) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A 1 -> W -> H ReLU MLP as lines (see as_lines): the kinks (W,), sorted, +inf for a unit
    with w1 = 0 (it never turns), and each segment's slope A and intercept C, (W + 1, H) fp32,
    differentiable in the MLP's weights. None for any other MLP."""
    if not (len(mlp) == 3 and isinstance(mlp[1], nn.ReLU) and all(isinstance(mlp[i], nn.Linear) for i in (0, 2))):
        return None
    first, last = mlp[0], mlp[2]
    w1, b1, W2, b2 = first.weight[:, 0].float(), first.bias.float(), last.weight.float(), last.bias.float()
    W = w1.numel()
    w, b = w1.detach(), b1.detach()
    kink = torch.where(w != 0, -b / w, torch.inf)  # (W,)
    kinks, order = kink.sort()  # (W,); segment s lies above the first s of them
    rank = order.argsort()  # (W,): where each unit's kink sorts
    s = torch.arange(W + 1, device=w.device)[:, None]  # (W + 1, 1)
    on = torch.where(w > 0, rank < s, torch.where(w < 0, rank >= s, b > 0)).float()  # (W + 1, W)
    # elementwise, not a matmul: autocast would take these sums to bf16
    A = (on[:, None, :] * w1 * W2).sum(-1)  # (W + 1, H): the segment's slope per head
    C = (on[:, None, :] * b1 * W2).sum(-1) + b2  # (W + 1, H)
    return kinks, A, C


class SegmentGather(torch.autograd.Function):
    """table.index_select(1, seg), (H, S) -> (H, N), whose backward sums each segment's gradient
    with one bincount over (head, segment) cells. On a GPU that is a histogram in shared memory;
    index_select's backward, an index_add of every (i, j) into the same (H, S) cells, collides
    in its atomic additions (8.5 against 1.4 ms for FIRE's bias at T = 1,024 on an H200)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(seg)
        ctx.shape = table.shape
        return table.index_select(1, seg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (seg,) = ctx.saved_tensors
        H, S = ctx.shape
        cell = (seg + S * torch.arange(H, device=seg.device)[:, None]).flatten()  # (H * N,): head h, segment s
        sums = torch.bincount(cell, weights=grad.float().flatten(), minlength=H * S)
        return sums.view(H, S).to(grad.dtype), None
