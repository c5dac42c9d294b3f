"""Stick-breaking attention: each query breaks off a share of what is left for each key, nearest first, no softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posbench.attention import TINY_PROB
from posbench.schemes.base import PositionalScheme


def stick_breaking(q, k, v, own: bool) -> torch.Tensor:
    """(B, H, Tq, D): stick-breaking attention of queries q (B, H, Tq, D), the last Tq of the Tk
    keys k and values v (B, H, Tk, D). Query i attends to keys j < i only:
        beta_ij = sigmoid(q_i.k_j / sqrt(d))
        A_ij = beta_ij * prod_{j<l<i} (1 - beta_il)
        o_i = sum_{j<i} A_ij v_j  (+ (1 - sum_{j<i} A_ij) v_i if `own`)
    in log space, log A_ij = log sigmoid(z_ij) + sum_{j<l<i} log sigmoid(-z_il), in fp32. Each
    query's row stands alone, so blocks of queries give the rows of the whole."""
    Tq, Tk = q.size(2), k.size(2)
    z = torch.matmul(q, k.transpose(-1, -2)).float() * q.size(-1) ** -0.5  # (B, H, Tq, Tk)
    qi = torch.arange(Tk - Tq, Tk, device=q.device)  # (Tq,) each query's index among the keys
    earlier = torch.arange(Tk, device=q.device)[None, :] < qi[:, None]  # (Tq, Tk): j < i
    log_left = F.logsigmoid(-z).masked_fill(~earlier, 0.0)  # (B, H, Tq, Tk): log(1 - beta_ij), j < i
    # sum_{l=j+1..i-1} log(1 - beta_il): the reverse cumulative sum along keys, from key j + 1
    rev = log_left.flip(-1).cumsum(-1).flip(-1)  # (B, H, Tq, Tk): sum over l >= j
    after = F.pad(rev[..., 1:], (0, 1))  # (B, H, Tq, Tk): sum over l > j
    att = (F.logsigmoid(z) + after).exp().masked_fill(~earlier, 0.0)  # (B, H, Tq, Tk): A_ij
    out = torch.matmul(att.to(v.dtype), v)  # (B, H, Tq, D)
    if own:
        left = 1 - att.sum(-1, keepdim=True)  # (B, H, Tq, 1): the stick no key took
        out = out + left.to(v.dtype) * v[:, :, Tk - Tq :]
    return out.to(v.dtype)


class StickBreaking(PositionalScheme):
    """Stick-breaking attention (Tan et al. 2025, "Scaling Stick-Breaking Attention: An Efficient
    Implementation and In-depth Study"): softmax is replaced by a stick broken from the nearest
    key back, so nearer keys come first and no position signal is needed (`stick_breaking`).

    As the authors' reference (shawntan/stickbreaking-attention `sb_ref.py` and the model's use
    of `sb_attn`, `attend_current=False`, and `o + rem[..., None] * v`): the diagonal j = i is
    not a key, the logits are scaled by 1/sqrt(d) with no bias, and what is left of the stick,
    1 - sum_j A_ij, weighs the query's own value. Options:
      remainder  "own" (default): add (1 - sum_j A_ij) v_i, as the authors' model;
                 "drop": leave it out, as fla's layer (`fla/layers/stickbreaking_attn.py`)

    This is no bias on softmax's logits, so the scheme sets `replaces_softmax`: every
    attention backend calls `attend`, which computes `stick_breaking` with a backward written
    out (StickBreakingAttention, tested equal to it), and nothing else."""

    description = "softmax replaced by sigmoid(q.k) shares broken off a stick, nearest key first (Tan 2025)"
    options = {"remainder": "own"}
    replaces_softmax = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.own = self.choice("remainder", ("own", "drop")) == "own"

    def attend(self, q, k, v, qpos, kpos, layer):
        return StickBreakingAttention.apply(q, k, v, self.own)  # (B, H, Tq, D), as stick_breaking


class StickBreakingAttention(torch.autograd.Function):
    """`stick_breaking` with its backward by hand, for speed: the same numbers, fewer (Tq, Tk)
    tensors made and kept. The keys are taken nearest first (reversed), so the sum over the keys
    between j and i is one forward cumsum, and log A_ij = z_ij + sum_{j<=l<i} log(1 - beta_il),
    since log sigmoid(z) = z + log sigmoid(-z); the stick left, 1 - sum_j A_ij, is the product
    prod_{l<i} (1 - beta_il), the cumsum's last column. Backward, with g = dL/dlog A = dA * A:
        dz_ij = g_ij - sigmoid(z_ij) * sum_{l<=j} g_il       (l over keys in their own order)
    since log(1 - beta_ij) is a term of log A_il for every key l < j, and of the diagonal's."""

    @staticmethod
    def forward(ctx, q, k, v, own: bool):
        B, H, Tq, D = q.shape
        Tk = k.size(2)
        kr, vr = k.flip(2), v.flip(2)  # (B, H, Tk, D): key r is key Tk - 1 - r
        qi = torch.arange(Tk - Tq, Tk, device=q.device)  # (Tq,)
        later = torch.arange(Tk - 1, -1, -1, device=q.device)[None, :] >= qi[:, None]  # (Tq, Tk): j >= i
        # -inf for j >= i, added by the matmul: beta = 0 and log(1 - beta) = 0 there, masked throughout
        mask = torch.zeros(Tq, Tk, dtype=q.dtype, device=q.device).masked_fill_(later, float("-inf"))
        z = torch.baddbmm(mask, (q * D**-0.5).reshape(B * H, Tq, D), kr.reshape(B * H, Tk, D).transpose(1, 2))
        z = z.view(B, H, Tq, Tk).float()  # (B, H, Tq, Tk)
        taken = F.softplus(z).cumsum_(-1)  # (B, H, Tq, Tk): -sum_{j<=l<i} log(1 - beta_il)
        left = taken[..., -1:].neg().exp_() if own else None  # (B, H, Tq, 1): prod_{l<i} (1 - beta_il)
        att = torch.sub(z, taken, out=taken).exp_()  # (B, H, Tq, Tk): A_ij
        # shares far back are subnormal, and every product with a subnormal float is ~100x slower
        # on x86: below TINY_PROB they change no fp32 sum that matters, so they become exact zeros
        F.threshold(att, TINY_PROB, 0.0, inplace=True)
        out = torch.matmul(att.to(v.dtype), vr)  # (B, H, Tq, D)
        if own:  # what the keys left of the stick, 1 - sum_j A_ij, weighs the query's own value
            out = out + left.to(v.dtype) * v[:, :, Tk - Tq :]
        ctx.save_for_backward(q, kr, vr, z, att, left)
        ctx.own = own
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, kr, vr, z, att, left = ctx.saved_tensors
        Tq, Tk = q.size(2), kr.size(2)
        scale = q.size(-1) ** -0.5
        d_out = d_out.float()
        d_att = torch.matmul(d_out, vr.float().transpose(-1, -2))  # (B, H, Tq, Tk)
        d_vr = torch.matmul(att.transpose(-1, -2), d_out)  # (B, H, Tk, D)
        if ctx.own:  # left = 1 - sum_j A_ij weighs v_i
            d_att.sub_((d_out * vr[:, :, :Tq].flip(2).float()).sum(-1, keepdim=True))
        g = d_att.mul_(att)  # (B, H, Tq, Tk): dL/dlog A, 0 where j >= i
        before = g.flip(-1).cumsum_(-1).flip(-1)  # (B, H, Tq, Tk): sum over keys l <= j
        d_z = g.addcmul_(torch.sigmoid(z), before, value=-1.0)  # sigmoid(-inf) = 0 masks the future
        d_q = torch.matmul(d_z, kr.float()).mul_(scale)  # (B, H, Tq, D)
        d_k = torch.matmul(d_z.transpose(-1, -2), q.float()).mul_(scale).flip(2)  # (B, H, Tk, D)
        d_v = d_vr.flip(2)
        if ctx.own:
            d_v[:, :, Tk - Tq :] += left * d_out
        return d_q.to(q.dtype), d_k.to(kr.dtype), d_v.to(vr.dtype), None
