"""The training step's update through the C kernel optim.c: gradient clipping and AdamW in one call.

`clip_and_step(opt, params, max_norm)` is `clip_grad_norm_(params, max_norm)` (when max_norm > 0)
followed by `opt.step()`, for a torch.optim.AdamW, which stays the optimizer: its param groups,
hyperparameters and state (step, exp_avg, exp_avg_sq, in torch's own format) are read and
written as torch's step would, so either path may take any step. The C applies to fp32 CPU
parameters, gradients and state, dense and contiguous, of an AdamW without amsgrad, maximize,
capturable or differentiable, whose parameters are exactly `params`; anywhere else torch's two
calls run. At posbench's default size those two took ~1.2 ms of a ~23 ms step (28 norms, 28
scalings, and the optimizer's Python around its fused kernel), this ~0.45.

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
    if type(opt) is not torch.optim.AdamW or torch.compiler.is_compiling():
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
    if count != len(params) or {id(p) for p in ps} != {id(p) for p in params if p.grad is not None}:
        return False  # the clipping's set and the optimizer's differ: torch's two calls keep them apart
    state = opt.state
    for p in ps:
        if p not in state:  # torch's own initial state (AdamW's, fused or not: a float32 step)
            state[p] = {"step": torch.tensor(0.0, dtype=F32), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    sts = [state[p] for p in ps]
    tensors = (ps, [p.grad for p in ps], [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts])
    steps = [s["step"] for s in sts]
    if not (_plain(*tensors) and all(t.dtype == F32 and t.device.type == "cpu" and t.numel() == 1 for t in steps)):
        return False
    if any(p.shape != e.shape for p, e in zip(ps, tensors[2])):
        return False
    n = len(ps)
    arrays = [(ctypes.c_void_p * n)(*[t.data_ptr() for t in ts]) for ts in (*tensors, steps)]
    sizes = (ctypes.c_long * n)(*[p.numel() for p in ps])
    norm = ctypes.c_float(0.0)
    if lib.clip_adamw(*arrays, sizes, (ctypes.c_double * len(hyper))(*hyper), n, float(max_norm),
                      ctypes.byref(norm), torch.get_num_threads()):  # fmt: skip
        raise MemoryError("optim.c: no memory for the step's chunk list")
    return True


def _plain(*lists) -> bool:
    """Every tensor fp32, on the CPU, dense and contiguous, as the C reads and writes them."""
    return all(
        t.dtype == F32 and t.layout == torch.strided and t.device.type == "cpu" and t.is_contiguous()
        for ts in lists
        for t in ts
    )
