"""posbench's own GPU kernels, in Triton: the `triton` attention backend.

`attention(q, k, v, q0, form)` is softmax(q.k / sqrt(d) + bias, future masked) v for queries
q0..q0+Tq-1 over keys 0..Tk-1, with the bias in the form a scheme's `tiled_bias` hook gives it:
nothing, ALiBi's slopes, a table over distances (T5, KERPLE), FIRE's lines, or else a dense
(B or 1, H, Tq, Tk) tensor. The kernels (triton_attention.py) compute the bias inside their
tiles and sum a learned one's gradient there, so a table's or FIRE's bias never exists as a
(Tq, Tk) tensor, forward or backward. On a CPU they run under Triton's interpreter
(TRITON_INTERPRET=1), which suits checking them against the eager formula, not speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from posbench.schemes.fire import Lines

# queries and keys a program takes, and its warps and pipeline stages. Chosen for a head of 64 on
# an H200 by compiling for it, not yet timed there: at 4 warps the backward's tiles spill
# registers, at 8 the backward of FIRE, a learned table and a dense bias a little, at most 408 bytes
# of stack (FIRE's dk/dv; .ci/attention_forms.py times the others).
# The interpreter's 32 runs faster and still puts tile edges inside a small check.
BLOCK, WARPS, STAGES, INTERPRETED_BLOCK = 64, 8, 2, 32
NONE, SLOPES, TABLE, FIRE, DENSE = range(5)  # the bias's form, as triton_attention.py numbers it


def why_not(device: torch.device) -> Optional[str]:
    """Why the kernels cannot run on `device`, in one line (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (torch's CUDA wheels bring it)"
    if device.type == "cuda" or interpreted():
        return None
    return "it runs on a CUDA GPU (on a CPU only under Triton's interpreter, TRITON_INTERPRET=1, for checking)"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernels():
    from posbench.kernels import triton_attention

    return triton_attention


def attention(q, k, v, q0: int, form=None) -> torch.Tensor:
    """(B, H, Tq, D) attention of q over k and v (B, H, Tk, D), Tk = q0 + Tq. `form`: None (no
    bias), a DistanceTable (posbench/schemes/distance.py), Lines, or a dense bias tensor."""
    dummy = torch.zeros(1, device=q.device)  # for the pointers a form does not read
    mode, slopes, values, lo, lines, dense = NONE, dummy, dummy, 0, None, dummy
    qpos = kpos = torch.arange(k.size(2), device=q.device)
    qpos = qpos[q0:]
    if isinstance(form, torch.Tensor):
        mode, dense = DENSE, form
    elif isinstance(form, Lines):
        mode, lines, qpos, kpos = FIRE, form, form.qpos, form.kpos
    elif form is not None:  # a table over distances
        qpos, kpos, lo = form.qpos, form.kpos, form.lo
        if form.slopes is not None and not form.slopes.requires_grad:
            mode, slopes = SLOPES, form.slopes.float().contiguous()
        else:
            mode, values = TABLE, form.values.float().contiguous()
    if lines is None:
        A = C = fire = kinks = dummy
        eps = 0.0
    else:
        A, C = lines.A.T.float().contiguous(), lines.C.T.float().contiguous()  # (H, W + 1)
        fire = torch.stack([lines.c, lines.threshold]).float()  # (2,)
        kinks, eps = lines.kinks, lines.eps
    qpos, kpos = qpos.to(torch.int32).contiguous(), kpos.to(torch.int32).contiguous()  # fewer registers than int64
    spec = _Spec(mode, q0, lo, qpos, kpos, slopes, kinks, eps)
    return _TiledAttention.apply(q, k, v, values, A, C, fire, dense, spec)


@dataclasses.dataclass
class _Spec:
    """What the kernels read besides the differentiable tensors."""

    mode: int
    q0: int
    lo: int
    qpos: torch.Tensor
    kpos: torch.Tensor
    slopes: torch.Tensor
    kinks: torch.Tensor
    eps: float


def _padded_kinks(kinks: torch.Tensor) -> torch.Tensor:
    """(KW,) fp32, a power of two, the kinks then +inf."""
    width = max(16, 1 << (kinks.numel() - 1).bit_length()) if kinks.numel() > 1 else 16
    out = torch.full((width,), float("inf"), device=kinks.device)
    out[: kinks.numel()] = kinks.float()
    return out


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, values, A, C, fire, dense, spec: _Spec):
        K = _kernels()
        B, H, Tq, D = q.shape
        Tk = k.size(2)
        dtype = v.dtype  # under autocast a scheme's fp32 parameter can promote q or k
        q, k, v = q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(B * H, Tq, device=q.device, dtype=torch.float32)
        block = INTERPRETED_BLOCK if interpreted() else BLOCK
        kinks = _padded_kinks(spec.kinks)
        strides = _dense_strides(dense, spec.mode == DENSE, B)
        common = dict(
            H=H, Tq=Tq, Tk=Tk, q0=spec.q0, lo=spec.lo, n_values=values.size(-1), scale=D**-0.5, eps=spec.eps,
            D=D, BLOCK_D=max(16, _next_pow2(D)), BLOCK=block, BIAS=spec.mode, S=A.size(-1), KW=kinks.numel(),
            DOT=_dot_precision(dtype), num_warps=WARPS, num_stages=STAGES,
        )  # fmt: skip
        grid = (-(-Tq // block), B * H)
        with _on(q.device):
            K.forward_kernel[grid](
                q, k, v, out, lse, spec.qpos, spec.kpos, spec.slopes, values, A, C, kinks, fire, dense,
                *strides, **common,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, values, A, C, fire, dense, kinks)
        ctx.spec, ctx.common, ctx.block = spec, common, block
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        K = _kernels()
        q, k, v, out, lse, values, A, C, fire, dense, kinks = ctx.saved_tensors
        spec, common, block = ctx.spec, ctx.common, ctx.block
        B, H, Tq, D = q.shape
        Tk = k.size(2)
        d_out = d_out.to(out.dtype).contiguous()
        delta = (d_out.float() * out.float()).sum(-1).view(B * H, Tq)  # rowsum(dO * O) = rowsum(dP * P)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        needs = ctx.needs_input_grad
        learned = {TABLE: needs[3], FIRE: any(needs[4:7]), DENSE: needs[7]}.get(spec.mode, False)
        d_values, d_A, d_C, d_fire = (torch.zeros_like(t) for t in (values, A, C, fire))
        shared = spec.mode == DENSE and dense.size(0) == 1
        d_dense = torch.zeros(dense.shape if learned and spec.mode == DENSE else (1,), device=q.device)
        strides = _dense_strides(dense, spec.mode == DENSE, B)
        pointers = (spec.qpos, spec.kpos, spec.slopes)
        with _on(q.device):
            K.backward_kv_kernel[(-(-Tk // block), B * H)](
                q, k, v, d_out, dk, dv, lse, delta, *pointers, values, d_values, A, C, d_A, d_C, kinks, fire, d_fire,
                dense, *strides, d_dense, LEARNED=learned, SHARED=shared, **common,
            )  # fmt: skip
            K.backward_q_kernel[(-(-Tq // block), B * H)](
                q, k, v, d_out, dq, lse, delta, *pointers, values, A, C, kinks, fire, dense, *strides, **common
            )
        grads = [dq, dk, dv, d_values, d_A, d_C, d_fire, d_dense.to(dense.dtype)]
        return (*(g if need else None for g, need in zip(grads, needs)), None)


def _on(device: torch.device):
    """The launch's device current (Triton launches on the current one), on a GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _dense_strides(dense: torch.Tensor, used: bool, B: int) -> tuple:
    """A dense bias's (batch, head, query, key) strides, the batch's 0 where it is shared."""
    if not used:
        return (0, 0, 0, 0)
    sb, sh, sq, sk = dense.stride()
    return (0 if dense.size(0) == 1 else sb, sh, sq, sk)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products as torch's matmuls make them: exact unless torch is told tf32 will do."""
    exact = dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return "ieee" if exact else "tf32"


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
