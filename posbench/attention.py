"""The one causal attention function every scheme goes through, blocked over queries."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from posbench import native
from posbench.errors import PosbenchError

BiasFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]
AttendFn = Callable[..., Optional[torch.Tensor]]  # (q, k, v, qpos, kpos) -> output or None
TINY_PROB = 1e-20  # BiasedAttention's probabilities below this are zeroed (subnormals are slow)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    bias_fn: BiasFn,
    block: Optional[int] = None,
    attend_fn: Optional[AttendFn] = None,
    packed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(q.k / sqrt(d) + bias + causal mask) v over (B, H, T, D) tensors.

    With `block`, queries are processed `block` at a time against the keys they can see, so no
    (T, T) tensor per head is ever built and memory grows linearly with T. `packed`: the (B, T, 3C)
    projection whose views q, k and v are, if they are (see native.attention).
    """
    T = q.size(2)
    if block is None or T <= block:
        return _attend(q, k, v, pos, pos, 0, bias_fn, attend_fn, packed)
    out = []
    for s in range(0, T, block):
        e = min(s + block, T)
        out.append(_attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], pos[s:e], pos[:e], s, bias_fn, attend_fn))
    return torch.cat(out, dim=2)  # (B, H, T, D)


def _attend(q, k, v, qpos, kpos, q0: int, bias_fn: BiasFn, attend_fn=None, packed=None) -> torch.Tensor:
    """Queries q0..q0+Tq-1 attend to keys 0..Tk-1."""
    if attend_fn is not None:
        out = attend_fn(q, k, v, qpos, kpos)
        if out is not None:
            want = (*q.shape[:3], v.size(-1))  # (B, H, Tq, D)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise PosbenchError(f"the scheme's attend returned {got}, expected None or shape {want}")
            return out
    Tq, Tk = q.size(2), k.size(2)
    bias = bias_fn(q, k, qpos, kpos)  # None or (B or 1, H, Tq, Tk)
    out = native.attention(q, k, v, bias, q0, packed)  # fp32 on a CPU: the C kernel, fused
    if out is not None:
        return out
    if bias is None and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # causality is by index, not by position value, so schemes may renumber positions
    qi = torch.arange(q0, q0 + Tq, device=q.device)
    future = torch.arange(Tk, device=q.device)[None, :] > qi[:, None]  # (Tq, Tk)
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~future)
    # an additive 0/-inf mask: adding it is ~7x faster than masked_fill with a broadcast bool mask
    mask = torch.zeros(Tq, Tk, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
    if not bias.requires_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias + mask)
    if q.device.type == "cuda" and bias.size(0) == q.size(0) > 1:
        # on a GPU, SDPA's memory-efficient kernel returns a float mask's gradient itself and
        # never keeps the (T, T) probabilities. Only for a bias per batch row (XL's): a bias
        # shared by the batch (T5's) ran 1.5x slower that way than through the math path below
        # (H100, 12 layers, d_model 768, T=1024, batch 16)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(bias + mask).to(q.dtype))
    return BiasedAttention.apply(q, k, v, bias, mask)


class BiasedAttention(torch.autograd.Function):
    """softmax(q.k / sqrt(d) + bias, future masked) v, for a bias that needs its gradient.

    SDPA cannot return a mask's gradient, so a learned bias sends it to its slow math path.
    This is that math written out once, with the backward by hand: the mask is added in
    place, and softmax's backward uses rowsum(dO * O) in place of rowsum(dP * P) (equal, and
    (T, D) instead of (T, T)), so fewer (T, T) tensors are made and kept than autograd would.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, mask):
        # q, k, v arrive as head-major views of the qkv projection; every batched matmul here
        # and in backward would copy them again, so they are made contiguous once
        # one dtype: under autocast a scheme's fp32 parameter can promote q or k (backward
        # runs outside autocast, so its matmuls would meet bf16 and fp32)
        q, k, v = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous(), v.contiguous()
        scale = q.size(-1) ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, H, Tq, Tk)
        if bias.numel() < scores.numel():  # a bias shared by the batch takes the mask first
            scores.add_(bias + mask)
        else:
            scores.add_(bias).add_(mask)
        # under CUDA autocast softmax returns fp32; keep v's dtype so backward's matmuls agree
        probs = scores.softmax(dim=-1).to(v.dtype)
        # a steep bias (KERPLE's power kernel) leaves some probabilities subnormal, and every
        # product with a subnormal float is ~100x slower on x86; below 1e-20 they change no
        # fp32 sum with the row's largest (>= 1/Tk), so they become exact zeros
        F.threshold(probs, TINY_PROB, 0.0, inplace=True)
        out = torch.matmul(probs, v)  # (B, H, Tq, D)
        ctx.save_for_backward(q, k, v, probs, out)
        ctx.bias_shape = bias.shape
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, probs, out = ctx.saved_tensors
        scale = q.size(-1) ** -0.5
        d_v = torch.matmul(probs.transpose(-1, -2), d_out)  # (B, H, Tk, D)
        delta = (d_out * out).sum(-1, keepdim=True)  # (B, H, Tq, 1)
        d_scores = torch.matmul(d_out, v.transpose(-1, -2)).sub_(delta).mul_(probs)  # (B, H, Tq, Tk)
        d_bias = d_scores.sum_to_size(ctx.bias_shape)  # the bias may be shared across the batch
        d_q = torch.matmul(d_scores, k).mul_(scale)
        d_k = torch.matmul(d_scores.transpose(-1, -2), q).mul_(scale)
        return d_q, d_k, d_v, d_bias, None
