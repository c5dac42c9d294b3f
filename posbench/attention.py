"""Causal attention behind one switch, `model.attention`: eager, sdpa, native, flex, triton, or auto.

Every backend computes softmax(q.k / sqrt(d) + bias, future masked) v, where the bias comes
from the scheme's `bias` hook; a scheme that replaces softmax (`replaces_softmax`,
stick-breaking) computes its own attention in its `attend` hook, under every backend. `eager`
writes that formula out and is the reference; the others are tested equal to it. Queries are
processed in blocks once T is long, so no (T, T) tensor per head is ever built and memory grows
linearly with the length; on a GPU the fused kernels take them whole where no dense bias is held
(`whole_window`). A bias of distance alone reaches flex as a table over distances, never dense;
triton (posbench/kernels) also takes FIRE's in its own terms, the scheme's `tiled_bias`.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from posbench import kernels, native
from posbench.config import ATTENTION_BACKENDS as BACKENDS
from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme
from posbench.schemes.distance import reads_as_table

FLEX_CUDA_MIN_HEAD_DIM = 16  # below it torch's inductor refuses to lower the kernel ("NYI: ... at least 16")
TINY_PROB = 1e-20  # BiasedAttention's probabilities below this are zeroed (subnormals are slow)
FLEX_CANNOT_TRAIN_ON_CPU = (
    "model.attention=flex: torch has no FlexAttention backward on a CPU, so it cannot train "
    "here; train with auto, sdpa or eager (flex can evaluate: posbench evaluate RUN "
    "--attention flex)"
)


def backend_for(
    name: str,
    device: torch.device,
    head_dim: int,
    compiled: bool = False,
    dtype: torch.dtype = torch.float32,
    table: bool = False,
) -> str:
    """The backend that `name` runs as here. auto: the C kernels on a CPU in fp32 where they
    build; on a GPU, flex for a scheme whose bias is a table over distances (`table`: ALiBi,
    T5, Hybrid, KERPLE; docs/performance.md measured ALiBi, T5 and KERPLE 1.3x to 2.2x faster
    there than under sdpa) where this torch compiles it, else SDPA. A backend named outright
    that cannot run here is an error, never a quiet substitute, because a run's records name
    the backend that computed it."""
    if name not in BACKENDS:
        raise PosbenchError(f"model.attention={name!r}: expected one of {', '.join(BACKENDS)}")
    compiling = compiled or torch.compiler.is_compiling()  # the tracer cannot follow pointers into C
    why_not_native = native.why_not(head_dim, device, compiling, dtype)
    if name == "auto":
        flex_fits = head_dim >= FLEX_CUDA_MIN_HEAD_DIM and flex_learns_biases()
        if table and device.type == "cuda" and not compiling and flex_fits:
            return "flex"  # under train.compile the bias is the per-pair formula, not the table
        return "sdpa" if why_not_native else "native"
    if name == "triton":
        why_not = kernels.why_not(device) or ("it does not run under train.compile" if compiling else None)
        if why_not:
            raise PosbenchError(f"model.attention=triton cannot run here: {why_not}; use auto, sdpa or eager")
    if name == "native" and why_not_native:
        raise PosbenchError(f"model.attention=native cannot run here: {why_not_native}; use auto, sdpa or eager")
    if name == "flex" and device.type == "cuda" and head_dim < FLEX_CUDA_MIN_HEAD_DIM:
        raise PosbenchError(
            f"model.attention=flex cannot run here: FlexAttention's CUDA kernel needs a head dimension of at "
            f"least {FLEX_CUDA_MIN_HEAD_DIM}, and model.d_model / model.n_head is {head_dim}; use auto, sdpa or eager"
        )
    return name


@functools.cache
def flex_learns_biases() -> bool:
    """Whether this torch compiles FlexAttention with a learned bias's gradient: Triton is
    installed, and torch is 2.6 or later (the first whose compiled backward sums it)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6) and importlib.util.find_spec("triton") is not None


def causal_attention(q, k, v, pos, scheme, layer: int, backend: str, block: Optional[int] = None):
    """Attention over (B, H, T, D) tensors with `scheme`'s bias, `block` queries at a time;
    `pos` is (T,), or (B, T) for a scheme whose hooks take each row's own positions."""
    T = q.size(2)
    if backend == "triton" and not scheme.replaces_softmax:  # its kernels hold nothing (T, T) but a dense bias
        form = scheme.tiled_bias(pos, pos, layer, q.dtype)
        if form is not None or type(scheme).bias is PositionalScheme.bias:
            return kernels.attention(q, k, v, 0, form)
    if block is None or T <= block or whole_window(q, pos, scheme, backend):
        return _attend(q, k, v, pos, pos, 0, scheme, layer, backend)
    out = []
    for s in range(0, T, block):
        e = min(s + block, T)
        out.append(
            _attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], pos[..., s:e], pos[..., :e], s, scheme, layer, backend)
        )
    return torch.cat(out, dim=2)  # (B, H, T, D)


def whole_window(q, pos, scheme, backend: str) -> bool:
    """On a GPU the fused kernels hold no (Tq, Tk) tensor where there is no dense bias: SDPA's
    flash kernel (bf16 or fp16) for a scheme without a bias, FlexAttention's also for a table
    over distances. They take all queries at once, where blocks would cost launches (and flex a
    compiled kernel per block's shape). Elsewhere the blocks keep memory linear (on a CPU flex is
    unfused; SDPA in fp32 may fall back to its (Tq, Tk) math kernel)."""
    if not q.is_cuda or backend not in ("sdpa", "flex") or scheme.replaces_softmax:
        return False
    if type(scheme).bias is PositionalScheme.bias:
        return backend == "flex" or q.dtype in (torch.bfloat16, torch.float16)
    return backend == "flex" and reads_as_table(scheme, pos)


def _attend(q, k, v, qpos, kpos, q0: int, scheme, layer: int, backend: str) -> torch.Tensor:
    """Queries q0..q0+Tq-1 attend to keys 0..Tk-1 (q0 + Tq = Tk)."""
    if backend == "native" or scheme.replaces_softmax:  # a scheme's own kernel first; None declines
        out = scheme.attend(q, k, v, qpos, kpos, layer)
        if out is None and scheme.replaces_softmax:
            raise PosbenchError(
                f"scheme '{scheme.cfg.scheme}' replaces softmax, yet its attend returned None", exit_code=1
            )
        if out is not None:
            want = (*q.shape[:3], v.size(-1))  # (B, H, Tq, D)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                said = f"scheme '{scheme.cfg.scheme}': its attend returned {got}, expected None or shape {want}"
                raise PosbenchError(said, exit_code=1)
            return out
    if backend == "flex" and reads_as_table(scheme, qpos):  # a bias of distance alone: flex reads its table
        return flex(q, k, v, None, q0, scheme.distance_table(qpos, kpos, layer, q.dtype))
    bias = scheme_bias(q, k, qpos, kpos, scheme, layer)
    if backend == "triton":  # a bias with no tiled form (causal_attention takes those whole), read dense
        return kernels.attention(q, k, v, q0, bias)
    return ATTENTION[backend](q, k, v, bias, q0)


def scheme_bias(q, k, qpos, kpos, scheme, layer: int) -> Optional[torch.Tensor]:
    """The scheme's bias: None, or a tensor that broadcasts to (B, H, Tq, Tk); any other shape
    is one line naming the scheme (a bug in it: exit 1), not a shape error deep in a backend."""
    bias = scheme.bias(q, k, qpos, kpos, layer)
    if bias is None:
        return None
    want = (q.size(0), q.size(1), q.size(2), k.size(2))
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4 or any(n not in (1, w) for n, w in zip(bias.shape, want)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise PosbenchError(
            f"scheme '{scheme.cfg.scheme}': its bias is {got}, expected None or a tensor that broadcasts "
            f"to (B, H, Tq, Tk) = {want}",
            exit_code=1,
        )
    return bias.expand(bias.size(0), *want[1:])  # a view: flex and triton index every head and query


def future_mask(Tq: int, Tk: int, q0: int, device) -> torch.Tensor:
    """(Tq, Tk), True where key j is in query q0+i's future. Causality is by index, not by
    position value, so schemes may renumber positions."""
    qi = torch.arange(q0, q0 + Tq, device=device)
    return torch.arange(Tk, device=device)[None, :] > qi[:, None]


def eager(q, k, v, bias, q0: int) -> torch.Tensor:
    """The formula as written, left to autograd: the reference for every other backend."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5  # (B, H, Tq, Tk)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(future_mask(q.size(2), k.size(2), q0, q.device), float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)  # (B, H, Tq, D)


def sdpa(q, k, v, bias, q0: int) -> torch.Tensor:
    """torch's scaled_dot_product_attention; a bias that needs its gradient goes through
    BiasedAttention, since SDPA cannot return a mask's gradient."""
    Tq, Tk = q.size(2), k.size(2)
    if bias is None and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    future = future_mask(Tq, Tk, q0, q.device)
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~future)
    # an additive 0/-inf mask: adding it is much faster than masked_fill with a broadcast bool mask
    mask = torch.zeros(Tq, Tk, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
    if not bias.requires_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias + mask)
    if q.device.type == "cuda" and bias.size(0) == q.size(0) > 1:
        # on a GPU, SDPA's memory-efficient kernel returns a float mask's gradient itself and
        # never keeps the (T, T) probabilities; for a bias per batch row (XL's) it is faster
        # than the math below, for a bias shared by the batch (T5's) slower
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(bias + mask).to(q.dtype))
    return BiasedAttention.apply(q, k, v, bias, mask)


def native_attention(q, k, v, bias, q0: int) -> torch.Tensor:
    """posbench/native/attention.c, fused (see posbench/native/__init__.py)."""
    out = native.attention(q, k, v, bias, q0)
    if out is None:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        raise PosbenchError(
            f"model.attention=native: the C kernel cannot take these tensors ({shapes}, "
            f"{q.dtype}); use auto, sdpa or eager"
        )
    return out


def flex(q, k, v, bias, q0: int, table=None) -> torch.Tensor:
    """torch's FlexAttention, the causal mask as a block mask (built once per shape) and the bias
    read by a score_mod: a distance table's value at qpos[i] - kpos[j] (posbench/schemes/
    distance.py), or its slope times that distance where it is linear, so no (Tq, Tk) bias
    exists; else the dense bias's element. Compiled on a GPU;
    on a CPU torch runs its unfused reference forward, which suits checking, not speed, and has
    no backward."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise PosbenchError(FLEX_CANNOT_TRAIN_ON_CPU)
    score_mod = None
    if table is not None and table.slopes is not None:  # -slope * distance: computed, not read
        slopes, qpos, kpos = table.slopes, table.qpos, table.kpos

        def score_mod(score, b, h, i, j):
            return score - slopes[h] * (qpos[i] - kpos[j])

    elif table is not None:
        values, qpos, kpos = table.values, table.qpos - table.lo, table.kpos  # column = qpos[i] - kpos[j]

        def score_mod(score, b, h, i, j):
            return score + values[h, qpos[i] - kpos[j]]

    elif bias is not None:
        batched = bias.size(0) > 1

        def score_mod(score, b, h, i, j):
            return score + bias[b if batched else 0, h, i, j]

    mask = _causal_block_mask(q.size(2), k.size(2), q0, q.device)
    with warnings.catch_warnings():  # uncompiled on a CPU, by choice
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_fn(q.device.type)(q, k, v, score_mod=score_mod, block_mask=mask)


@functools.lru_cache(maxsize=1024)  # a dense bias at 65,536 tokens meets 256 blocks; each mask is a few KB
def _causal_block_mask(Tq: int, Tk: int, q0: int, device: torch.device):
    """Queries q0..q0+Tq-1 see keys up to their own index: FlexAttention's block mask, made once
    per (Tq, Tk, q0, device) (a training run meets one shape; evaluation, one per length and block)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = torch.tensor(q0, device=device)  # a tensor, not a constant the compiled kernel is specialised on

    def causal(b, h, i, j):
        return i + offset >= j

    return create_block_mask(causal, None, None, Tq, Tk, device=device)


FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    # one compiled function meets every kind of score_mod (none, a table, a dense bias shared by
    # the batch or per row), with and without a gradient, and each new shape until dynamic shapes
    # set in; past dynamo's default limit of 8 it would run uncompiled, building the (Tq, Tk)
    # scores that a long evaluation cannot hold
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # before torch 2.7
    setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
    return torch.compile(flex_attention)


ATTENTION = {"eager": eager, "sdpa": sdpa, "native": native_attention, "flex": flex}  # triton: _attend


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
