"""GELU, LayerNorm, the MLP and cross-entropy through the C kernel layers.c, as drop-in replacements.

`GELU`, `LayerNorm` and `MLP` are nn.GELU, nn.LayerNorm and nn.Sequential(Linear, GELU, Linear)
(same parameters, same state_dict keys) whose forward runs layers.c where it applies: fp32 CPU
tensors outside autocast, with the kernel built. Anywhere else, and for what the kernel does not
cover (tanh GELU, a LayerNorm without weight or bias or over more than the last dim), they are
the torch modules themselves, which are also the reference. `cross_entropy` is F.cross_entropy's
mean the same way.

Each call is a Python autograd node, and in a training step the tensors between calls push the
interpreter's own data out of cache: a node costs ~45 us there, against ~5 in a loop, and that
is what a kernel has to win back (hence the short Python below). So the MLP's LayerNorm runs
inside the MLP's node (`mlp(x, ln2)`): a LayerNorm node of its own, twice as fast as torch's
alone, made the NoPE step 0.1-0.5 ms slower; inside the MLP it made it ~2% faster. Folded the
same way into the qkv projection and the output head, it measured no change (within 1%, five
interleaved A/Bs), so those two stay torch's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from posbench import native

IGNORE_INDEX = -100  # F.cross_entropy's default


def _lib(*tensors):
    """layers.c, or None where the torch op must run (not fp32 CPU, autocast, no kernel)."""
    return native.load("layers") if native._fits_kernel(*tensors) else None


def _kernel():
    return native.require("layers")


class GELUFunction(torch.autograd.Function):
    """y = x Phi(x), the exact (erf) GELU; the backward recomputes Phi and phi from x."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        _kernel().gelu_forward(x.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
        ctx.save_for_backward(x)
        return y

    @staticmethod
    @once_differentiable  # the C computes the derivative as numbers: no graph through it
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        _kernel().gelu_backward(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), x.numel(), torch.get_num_threads())
        return dx


class MLPFunction(torch.autograd.Function):
    """fc2(gelu(fc1(norm(x)))) as one autograd node, where torch's would be six (a LayerNorm,
    two addmm, their transposes, the GELU); norm is a LayerNorm (ln_w, ln_b, eps), or none when
    ln_w is None. fc1's product is bias-free: the C adds the bias inside the GELU and writes the
    GELU's slope over the product, so the backward multiplies by it (no erf or exp again) and
    sums the bias's gradient in the same pass. Kept: x, norm(x), each row's mean and 1 / std,
    the slope, and gelu(h + b1). With `residual`, x + that: fc2's product is added into x + b2
    in place (the LayerNorm's pass writes it), where fc2's bias copy and the block's own add
    were two more passes, and x's two gradients are summed in the LayerNorm's backward."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, eps, residual=False):
        out, kept = _mlp_forward(x, ln_w, ln_b, w1, b1, w2, b2, eps, keep=True, residual=residual)
        ctx.save_for_backward(*kept, ln_w, w1, w2)  # x, stats, norm(x), slope, gelu(h + b1)
        ctx.residual = residual
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        x2, stats, xn, slope, y, ln_w, w1, w2 = ctx.saved_tensors
        threads = torch.get_num_threads()
        d2 = d_out.reshape(-1, d_out.size(-1))  # (rows, C_out)
        d_h = torch.mm(d2, w2)  # d gelu's output; the C turns it into d h in place
        d_b1 = w1.new_empty(w1.size(0))
        if _kernel().gelu_bias_backward(slope.data_ptr(), d_h.data_ptr(), d_h.data_ptr(), d_b1.data_ptr(),
                                        d_h.size(0), d_h.size(1), threads):  # fmt: skip
            raise MemoryError("layers.c: no memory for the GELU bias's partial sums")
        need = ctx.needs_input_grad  # x, ln_w, ln_b, w1, b1, w2, b2
        d_w1 = _weight_grad(d_h, xn) if need[3] else None
        d_w2 = _weight_grad(d2, y) if need[5] else None
        d_x = d_lw = d_lb = d_b2 = None
        if need[0] or need[1] or need[2]:
            d_res = d2.contiguous() if ctx.residual else None  # the residual's gradient, added to x's
            if ln_w is not None:  # d norm(x); with the residual, its sum over rows is b2's gradient
                d_x, d_lw, d_lb, d_b2 = _layernorm_backward(torch.mm(d_h, w1), x2, ln_w, stats, d_res)
            else:
                d_x = torch.mm(d_h, w1) if d_res is None else torch.addmm(d_res, d_h, w1)
            d_x = d_x.view(*d_out.shape[:-1], w1.size(1))
        d_b2 = (d2.sum(0) if d_b2 is None else d_b2) if need[6] else None
        return d_x, d_lw, d_lb, d_w1, d_b1, d_w2, d_b2, None, None


def _mlp_forward(x, ln_w, ln_b, w1, b1, w2, b2, eps, keep: bool, residual: bool = False):
    """MLPFunction's forward: the output, and what the backward needs (x, norm(x), the rows'
    mean and 1 / std, the GELU's slope and output) when `keep`; without it (no gradient wanted)
    each is let go as soon as it is used, so evaluation holds no more than torch's modules do.
    With `residual`, the output is x + the MLP's: fc2's product goes into x + b2 in place, which
    a fused LayerNorm's pass writes in training, and which is made otherwise once the hidden
    layer's product is let go (the same bits, and in evaluation no (rows, C) more held at the
    peak than torch's modules)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # (rows, C)
    xn, stats, res = x2, None, None
    if ln_w is not None:
        x2 = x2.contiguous()
        xn, stats, res = _layernorm(x2, ln_w, ln_b, eps, b2 if residual and keep else None)  # stats: mean, 1 / std
    slope = torch.mm(xn, w1.t())  # (rows, hidden): the product h, before the bias
    kept = (x2, stats, xn) if keep else ()
    del xn
    y = torch.empty_like(slope)
    _kernel().gelu_bias_forward(slope.data_ptr(), b1.data_ptr(), y.data_ptr(), slope.size(0), slope.size(1),
                                torch.get_num_threads())  # fmt: skip
    kept = (*kept, slope, y) if keep else ()  # slope now holds gelu'(h + b1)
    del slope
    if residual and res is None:
        res = x2 + b2
    out = torch.addmm(b2, y, w2.t()) if res is None else res.addmm_(y, w2.t())  # in place: x + b2 + y w2^T
    return out.view(*shape[:-1], w2.size(0)), kept


def _layernorm(x2, ln_w, ln_b, eps, add=None, res_shape=None):
    """layers.c's LayerNorm of contiguous (rows, C) x2: the output, and (2, rows) mean, 1 / std;
    with `add`, a (C,) vector, also x2 + add (else None), written in the same pass, in a tensor
    of its own of `res_shape` (default x2's)."""
    xn, stats = torch.empty_like(x2), x2.new_empty(2, x2.size(0))
    res = None if add is None else x2.new_empty(x2.shape if res_shape is None else res_shape)
    add = None if add is None else add.contiguous()  # held while the C reads
    _kernel().layernorm_forward(x2.data_ptr(), ln_w.data_ptr(), ln_b.data_ptr(), xn.data_ptr(), stats[0].data_ptr(),
                                stats[1].data_ptr(), native._ptr(add), native._ptr(res), x2.size(0), x2.size(1), eps,
                                torch.get_num_threads())  # fmt: skip
    return xn, stats, res


def _layernorm_backward(d_xn, x2, ln_w, stats, d_res=None):
    """The gradients of x2, the weight and the bias, from that of the LayerNorm's output; with
    `d_res`, a contiguous gradient that also reaches x2 (the residual's), added into x2's, and
    its sum over rows (the gradient of a bias added into the residual; else None)."""
    d_x, d_lw, d_lb = torch.empty_like(d_xn), torch.empty_like(ln_w), torch.empty_like(ln_w)
    d_sum = None if d_res is None else torch.empty_like(ln_w)
    if _kernel().layernorm_backward(d_xn.data_ptr(), x2.data_ptr(), ln_w.data_ptr(), stats[0].data_ptr(),
                                    stats[1].data_ptr(), native._ptr(d_res), d_x.data_ptr(), d_lw.data_ptr(),
                                    d_lb.data_ptr(), native._ptr(d_sum), x2.size(0), x2.size(1),
                                    torch.get_num_threads()):  # fmt: skip
        raise MemoryError("layers.c: no memory for LayerNorm's partial sums")
    return d_x, d_lw, d_lb, d_sum


class NormLinearFunction(torch.autograd.Function):
    """(linear(norm(x)), x + add) as one autograd node: norm a LayerNorm (ln_w, ln_b, eps), linear
    the attention's qkv projection (w, b), add the output projection's bias. The LayerNorm's pass
    writes x + add too: the block's residual, into which LinearAddFunction adds the output
    projection's product in place, as the MLP does its own. Its gradient arrives here, summed
    into x's in the LayerNorm's backward, where autograd would add x's two gradients apart."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w, b, add, eps):
        out, res, kept = _norm_linear(x, ln_w, ln_b, w, b, add, eps)
        ctx.save_for_backward(*kept, ln_w, w)  # x, stats, norm(x)
        return out, res  # res is its own tensor (not a view): LinearAdd writes it in place

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_res):
        x2, stats, xn, ln_w, w = ctx.saved_tensors
        d2 = d_out.reshape(-1, d_out.size(-1))
        d_r = d_res.reshape(-1, d_res.size(-1))
        need = ctx.needs_input_grad  # x, ln_w, ln_b, w, b, add
        d_w = _weight_grad(d2, xn) if need[3] else None
        d_b = d2.sum(0) if need[4] else None
        d_x = d_lw = d_lb = d_add = None
        if need[0] or need[1] or need[2]:  # the residual's gradient summed into x's, and over rows into add's
            d_x, d_lw, d_lb, d_add = _layernorm_backward(torch.mm(d2, w), x2, ln_w, stats, d_r.contiguous())
            d_x = d_x.view(d_res.shape)
        d_add = (d_r.sum(0) if d_add is None else d_add) if need[5] else None
        return d_x, d_lw, d_lb, d_w, d_b, d_add, None


def _norm_linear(x, ln_w, ln_b, w, b, add, eps):
    """NormLinearFunction's forward, and norm_linear's without gradients (the same bits): the
    output, x + add, and what the backward needs (x, the rows' mean and 1 / std, norm(x))."""
    x2 = x.reshape(-1, x.size(-1)).contiguous()  # (rows, C)
    xn, stats, res = _layernorm(x2, ln_w, ln_b, eps, add, res_shape=x.shape)
    out = torch.addmm(b, xn, w.t())  # (rows, out)
    return out.view(*x.shape[:-1], w.size(0)), res, (x2, stats, xn)


class LinearAddFunction(torch.autograd.Function):
    """res + y w^T, added into res in place: the output projection (no bias: NormLinearFunction
    put it in res) and the block's residual. y is the attention's (B, H, T, D) output, read as
    the (B, T, H D) rows it is stored as (a copy only where it is stored otherwise)."""

    @staticmethod
    def forward(ctx, res, y, w):
        B, H, T, D = y.shape
        y2 = y.transpose(1, 2).reshape(B * T, H * D)
        res.view(-1, res.size(-1)).addmm_(y2, w.t())
        ctx.mark_dirty(res)
        ctx.save_for_backward(y2, w)
        ctx.shape = (B, T, H, D)
        return res

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        y2, w = ctx.saved_tensors
        d2 = d_out.reshape(-1, d_out.size(-1))
        d_y = torch.mm(d2, w).view(ctx.shape).transpose(1, 2) if ctx.needs_input_grad[1] else None
        d_w = _weight_grad(d2, y2) if ctx.needs_input_grad[2] else None
        return d_out, d_y, d_w


def norm_linear(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear, add: torch.Tensor):
    """(linear(norm(x)), x + add), the attention's input side, through layers.c where it applies:
    the LayerNorm's pass writes x + add too, for linear_add to finish the residual in. In
    training that is one NormLinearFunction node. Anywhere else, torch's modules, and None."""
    fits = _layernorm_fits(norm, x) and linear.bias is not None and add is not None and x.numel() > 0
    tensors = [x, norm.weight, norm.bias, linear.weight, linear.bias, add] if fits else []
    if not fits or _lib(*tensors) is None:
        return linear(norm(x)), None
    args = (x, norm.weight, norm.bias, linear.weight, linear.bias, add, norm.eps)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return NormLinearFunction.apply(*args)
    return _norm_linear(*args)[:2]  # evaluation: nothing kept


def linear_add(y: torch.Tensor, linear: nn.Linear, x: torch.Tensor, res: Optional[torch.Tensor]) -> torch.Tensor:
    """x + linear(y) for the attention's (B, H, T, D) output y. With norm_linear's res (x plus
    linear's bias), the product is added into res in place (a LinearAddFunction node in
    training, where res has a graph); without, torch's modules."""
    if res is None:
        B, H, T, D = y.shape
        return x + linear(y.transpose(1, 2).reshape(B, T, H * D))
    if res.requires_grad:
        return LinearAddFunction.apply(res, y, linear.weight)
    B, H, T, D = y.shape
    res.view(-1, res.size(-1)).addmm_(y.transpose(1, 2).reshape(B * T, H * D), linear.weight.t())
    return res


def _grad_transposed(out_features: int, in_features: int) -> bool:
    """Whether _weight_grad hands a Linear's weight gradient back transposed (see there), and so
    grad_layout stores that weight the same way."""
    return out_features > in_features


def _weight_grad(d2, x2):
    """d2^T x2, the (out, in) gradient of a Linear's weight. Where out > in, MKL is ~10% faster
    at the transposed product (in, out); its transpose is handed back as it is, and autograd
    keeps it so where the weight is stored the same way (see grad_layout), else copies it into
    the weight's layout, which still leaves it ~5% faster (fc1 at the default size)."""
    return torch.mm(x2.t(), d2).t() if _grad_transposed(d2.size(1), x2.size(1)) else torch.mm(d2.t(), x2)


def grad_layout(linear: nn.Linear) -> None:
    """Store a Linear's (out, in) weight as the transpose of a contiguous (in, out) tensor where
    out > in: the layout _weight_grad hands its gradient back in, which autograd then keeps as
    it is, where for a contiguous weight it copies every gradient into the weight's layout
    (~70-90 us a weight at the default size, 1.5% of the NoPE step). The same values, and the
    same products' bits; the optimizer's state follows the weight's layout. For the weights
    whose gradient comes from this file's nodes (fc1, and qkv in norm_linear)."""
    w = linear.weight
    if w.dim() == 2 and _grad_transposed(w.size(0), w.size(1)) and w.is_contiguous():
        w.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim, with weight and bias; mean and rstd are kept per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x = x.contiguous()
        C = x.size(-1)
        rows = x.numel() // C
        y = torch.empty_like(x)
        stats = x.new_empty(2, rows)  # (2, rows): mean, rstd
        mean = stats.data_ptr()
        _kernel().layernorm_forward(x.data_ptr(), weight.contiguous().data_ptr(), bias.contiguous().data_ptr(),
                                    y.data_ptr(), mean, mean + 4 * rows, None, None, rows, C, eps,
                                    torch.get_num_threads())  # fmt: skip
        ctx.save_for_backward(x, weight.contiguous(), stats)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        C, rows = weight.numel(), stats.size(1)
        dy = dy.contiguous()
        dx, dw, db = torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)
        mean = stats.data_ptr()
        if _kernel().layernorm_backward(dy.data_ptr(), x.data_ptr(), weight.data_ptr(), mean, mean + 4 * rows,
                                        None, dx.data_ptr(), dw.data_ptr(), db.data_ptr(), None, rows, C,
                                        torch.get_num_threads()):  # fmt: skip
            raise MemoryError("layers.c: no memory for LayerNorm's partial sums")
        return dx, dw, db, None


class CrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy over rows of (N, V) logits. The forward also writes the gradient,
    (softmax - onehot) / rows counted, so the backward only scales it by the incoming grad."""

    @staticmethod
    def forward(ctx, logits, targets):
        logits, targets = logits.contiguous(), targets.contiguous()
        N, V = logits.shape
        grad = torch.empty_like(logits)  # (N, V)
        rowloss, loss = logits.new_empty(N), logits.new_empty(())
        bad = _kernel().xent_forward(logits.data_ptr(), targets.data_ptr(), grad.data_ptr(), rowloss.data_ptr(),
                                     loss.data_ptr(), N, V, IGNORE_INDEX, torch.get_num_threads())  # fmt: skip
        if bad:
            wrong = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= V)
            raise IndexError(f"Target {targets[wrong][0].item()} is out of bounds.")  # torch's words
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, dloss):
        (grad,) = ctx.saved_tensors
        # loss.backward() sends 1: the saved gradient is the answer as it is, which spares a
        # (N, V) pass (~0.7% of a step). Autograd only reads it (ctx keeps it referenced, so
        # it is never accumulated into in place), and a second backward finds it unchanged
        return (grad if dloss.item() == 1.0 else grad * dloss), None


class RopeFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for (B, H, T, D) x and fixed (T, D) tables, in one pass;
    the backward is the transposed map, also one pass. The output's memory is (B, T, H, D), the
    layout of the projection it came from, so attention reads it as it read x."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        x = native._rows(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        y = native._head_major(*x.shape)
        _rope(x, y, cos, sin, transpose=False)
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = native._rows(dy)
        dx = native._head_major(*dy.shape)
        _rope(dy, dx, cos, sin, transpose=True)
        return dx, None, None


def _rope(x, y, cos, sin, transpose: bool):
    B, H, T, D = x.shape
    st = native._strides(x, y)
    _kernel().rope_rotate(x.data_ptr(), st[0].data_ptr(), y.data_ptr(), st[1].data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), B, H, T, D, int(transpose), torch.get_num_threads())  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin: RoPE's rotation of (B, H, T, D) x by (T, D) tables,
    through layers.c where it applies (fp32 CPU, tables that need no gradient)."""
    fits = (
        x.dim() == 4
        and x.size(-1) % 2 == 0
        and cos.shape == sin.shape == x.shape[2:]
        and not (cos.requires_grad or sin.requires_grad)
        and x.numel() > 0
    )
    if fits and _lib(x, cos, sin) is not None:
        return RopeFunction.apply(x, cos, sin)
    return x * cos + rotate_half(x) * sin


class GELU(nn.GELU):
    """nn.GELU (exact, erf form) through layers.c where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "none" and _lib(x) is not None:
            return GELUFunction.apply(x)
        return super().forward(x)


class MLP(nn.Sequential):
    """nn.Sequential(Linear(C, hidden), GELU(), Linear(hidden, C)), with its parameters and
    state_dict keys, run as one MLPFunction where layers.c applies. `forward(x, norm)` applies
    an nn.LayerNorm first, fused into the same node where it can be; `residual=True` returns
    x + that, the add fused in too."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__(nn.Linear(d_model, hidden), GELU(), nn.Linear(hidden, d_model))

    def forward(self, x: torch.Tensor, norm: Optional[nn.LayerNorm] = None, residual: bool = False) -> torch.Tensor:
        fc1, act, fc2 = self
        if norm is not None and not _layernorm_fits(norm, x):  # a norm the C does not cover runs apart
            out = self(norm(x))
            return x + out if residual else out
        params = [fc1.weight, fc1.bias, fc2.weight, fc2.bias]
        ln_w, ln_b, eps = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
        tensors = [x, *params] + ([] if norm is None else [ln_w, ln_b])
        if act.approximate == "none" and x.dim() >= 2 and x.numel() > 0 and _lib(*tensors) is not None:
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                return MLPFunction.apply(x, ln_w, ln_b, *params, eps, residual)
            return _mlp_forward(x, ln_w, ln_b, *params, eps, keep=False, residual=residual)[0]  # evaluation
        out = super().forward(x if norm is None else norm(x))
        return x + out if residual else out


def _layernorm_fits(norm: nn.LayerNorm, x: torch.Tensor) -> bool:
    """Whether the MLP may run `norm` inside its node: torch's or our LayerNorm itself (not a
    subclass with its own forward), over what layers.c covers."""
    return type(norm) in (nn.LayerNorm, LayerNorm) and _layernorm_covers(norm, x)


def _layernorm_covers(norm: nn.LayerNorm, x: torch.Tensor) -> bool:
    """What layers.c's LayerNorm covers: over the last dim, with weight and bias."""
    return norm.weight is not None and norm.bias is not None and x.shape[-1:] == norm.normalized_shape


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm through layers.c where it applies: over the last dim, with weight and bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _layernorm_covers(self, x) and _lib(x, self.weight, self.bias) is not None:
            return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)
        return super().forward(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy(logits, targets): the mean over rows of (N, V) logits against (N,) int64
    targets (-100 ignored), through layers.c where it applies."""
    fits = (
        logits.dim() == 2
        and targets.shape == logits.shape[:1]
        and targets.dtype == torch.int64
        and targets.device.type == "cpu"
        and logits.numel() > 0
    )
    if fits and _lib(logits) is not None:
        return CrossEntropyFunction.apply(logits, targets)
    return F.cross_entropy(logits, targets)
