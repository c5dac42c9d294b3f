"""The training step's update through the C kernel optim.c: gradient clipping and AdamW in one call.

`clip_and_step(opt, params, max_norm)` is `clip_grad_norm_(params, max_norm)` (when max_norm > 0)
followed by `opt.step()`, for a torch.optim.AdamW, which stays the optimizer: its param groups,
hyperparameters and state (step, exp_avg, exp_avg_sq, in torch's own format) are read and
written as torch's step would, so either path may take any step. The C applies to fp32 CPU
parameters, gradients and state, dense and laid out alike (each gradient and state tensor as its
parameter: grad_layout stores some weights transposed), of an AdamW without amsgrad, maximize,
capturable or differentiable, with no step hooks, whose parameters are exactly `params`;
anywhere else (a GPU among them) torch's two calls run, and the state is left for torch to
make. At posbench's default size those two took ~1.3 ms of a ~23 ms step (28 norms, 28
scalings, and the optimizer's Python around its fused kernel), this ~0.65.

One difference: torch's clipping scales the gradients in place, the C leaves them as they were
(they are not read after the step: the next backward replaces them).
"""

from __future__ import annotations

import ctypes

import torch

from posbench import native

_FLAGS_OFF = ("amsgrad", "maximize", "capturable", "differentiable")
F32 = torch.float32


def clip_and_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_(params, max_norm) if max_norm > 0, then opt.step()."""
    if not _step_in_c(opt, params, max_norm):
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()


def _step_in_c(opt, params, max_norm) -> bool:
    """The step through optim.c, if it applies (False, nothing changed, where it does not)."""
    if type(opt) is not torch.optim.AdamW or torch.compiler.is_compiling() or _hooked(opt):
        return False
    lib = native.load("optim")
    if lib is None:
        return False
    ps, hyper, count = [], [], 0
    for group in opt.param_groups:
        if any(group[flag] for flag in _FLAGS_OFF):
            return False
        (beta1, beta2), lr = group["betas"], group["lr"]
        row = [lr, beta1, beta2, group["eps"], group["weight_decay"]]
        if not all(type(x) in (float, int) for x in row):
            return False  # a tensor lr or beta: torch's path
        count += len(group["params"])
        with_grad = [p for p in group["params"] if p.grad is not None]
        ps += with_grad
        hyper += row * len(with_grad)
    ids = {id(p) for p in ps}
    if count != len(params) or len(ids) != len(ps) or ids != {id(p) for p in params if p.grad is not None}:
        return False  # the clipping's set and the optimizer's differ (or repeat): torch's two calls
    state = opt.state
    for p in ps:  # checked before the state is touched: a GPU's fused AdamW makes its own
        if not (_plain(p) and _alike(p.grad, p)):
            return False
        st = state.get(p)  # an existing state must be one the C can update in place, every tensor of it
        if st and not (_alike(st.get("exp_avg"), p) and _alike(st.get("exp_avg_sq"), p)
                       and _alike(st.get("step"), _SCALAR)):  # fmt: skip
            return False
    for p in ps:
        if p not in state:  # torch's own initial state (AdamW's, fused or not, on a CPU: a float32 step)
            state[p] = {"step": torch.tensor(0.0, dtype=F32), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    sts = [state[p] for p in ps]
    tensors = (ps, [p.grad for p in ps], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts])
    steps = [s["step"] for s in sts]
    n = len(ps)
    arrays = [(ctypes.c_void_p * n)(*[t.data_ptr() for t in ts]) for ts in (*tensors, steps)]
    sizes = (ctypes.c_long * n)(*[p.numel() for p in ps])
    if lib.clip_adamw(*arrays, sizes, (ctypes.c_double * len(hyper))(*hyper), n, float(max_norm),
                      torch.get_num_threads()):  # fmt: skip
        raise MemoryError("optim.c: no memory for the step's chunk list")
    opt._opt_called = True  # what Optimizer.step's wrapper records for an LR scheduler's check
    return True


def _hooked(opt) -> bool:
    """Whether step hooks are registered (on this optimizer or on all): torch's step runs them."""
    from torch.optim import optimizer as o

    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or o._global_optimizer_pre_hooks or o._global_optimizer_post_hooks)  # fmt: skip


_SCALAR = torch.tensor(0.0)  # what a step tensor must look like: 0-d


# Both checks run for every tensor of every step (~140 at the default size): hence the cheapest
# attributes (is_cpu, not device.type) and the layout walk only for what is not contiguous


def _plain(t) -> bool:
    """Whether t is fp32, on the CPU and dense (its numel values one block from data_ptr, in
    any order of dims), as the C reads and writes it."""
    ok = isinstance(t, torch.Tensor) and t.dtype is F32 and t.is_cpu and t.layout is torch.strided
    return ok and (t.is_contiguous() or _dense(t))


def _alike(t, like: torch.Tensor) -> bool:
    """Whether t is fp32, on the CPU, of like's shape and strides: dense where like is, and the
    C's i-th value of each is the same element."""
    ok = isinstance(t, torch.Tensor) and t.dtype is F32 and t.is_cpu and t.layout is torch.strided
    return ok and t.shape == like.shape and t.stride() == like.stride()


def _dense(t) -> bool:
    step = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size > 1:
            if stride != step:
                return False
            step *= size
    return True
