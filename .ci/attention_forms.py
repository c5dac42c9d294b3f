"""One attention call's forward and backward, timed in each form a bias could take on a GPU.

    python .ci/attention_forms.py              # CUDA, GPT-2-small's attention: B 16, H 12, T 1024, D 64, bf16
    python .ci/attention_forms.py --small      # a check of every form, no warm-up (on a CPU: flex forward only,
                                               # posbench's Triton kernels under TRITON_INTERPRET=1)
    python .ci/attention_forms.py --only triton  # the forms named so, and those they are checked against

The forms posbench runs (sdpa's flash kernel for NoPE, flex with a table, ALiBi's slopes,
BiasedAttention for a learned dense bias, posbench's own Triton kernels at their tiles and warps
and at others) beside forms it could run (a learned table copied per batch row, or per row and
block of 128 queries, so that fewer of flex's atomic additions meet in one cell; SDPA's
memory-efficient kernel, which returns a dense bias's gradient). Two lines time a bias alone: a
learned table made dense, and FIRE's bias in three forms (its lines with index_select or
SegmentGather, its MLP). Each line: milliseconds a call (the mean of 10 after 2 warm-ups; with
--small of 1 after none), every gradient cleared before each, its ratio to the first form, the
first call's seconds (compiling), and for a candidate whether its output and every gradient it
takes equal the form it would replace. A form this torch cannot run says why in one line; the
others run. Triton's interpreter (a CPU) has no warps or stages: the forms that differ only in
those are left out there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from posbench import attention, kernels  # noqa: E402
from posbench.schemes.alibi import alibi_slopes  # noqa: E402
from posbench.schemes.distance import DistanceTable  # noqa: E402
from posbench.schemes.fire import Lines, SegmentGather, as_lines, mlp_lines  # noqa: E402


def timed(step, sync, reps: int, warmups: int = 2):
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmups):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    return (time.perf_counter() - start) / reps * 1e3, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="B 2, H 2, T 64, D 16, 1 timed call")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated words: only the forms whose names hold one, the forms they are checked "
        "against, and the first (the ratios' base)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    B, H, T, D = (2, 2, 64, 16) if args.small else (16, 12, 1024, 64)
    reps = 1 if args.small else 10
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    backward = dev.type == "cuda"  # torch has no FlexAttention backward on a CPU
    torch._dynamo.config.automatic_dynamic_shapes = False  # the per-row forms' shapes differ: each its own kernel
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=g, requires_grad=True) for _ in range(3)]
    pos = torch.arange(T, device=dev)
    lo = -(T - 1)
    learned = torch.randn(H, 2 * T - 1, device=dev, generator=g, requires_grad=True)  # T5's or KERPLE's table
    slopes = alibi_slopes(H).to(dev)
    alibi = -slopes[:, None] * torch.arange(lo, T, device=dev, dtype=torch.float32)  # ALiBi's table
    future = attention.future_mask(T, T, 0, dev)
    mask = torch.zeros(T, T, device=dev, dtype=dtype).masked_fill_(future, float("-inf"))

    def table(values, slopes_=None):  # a table over the window's distances, as posbench makes it
        return DistanceTable(values, lo, pos, pos, dtype, slopes_)

    def dense(values):  # (1, H, T, T) from a table over distances, as eager and sdpa read it
        return table(values).dense()

    def per_row(q, k, v, table, rows: int):  # flex reading a learned table copied per batch row (and block of queries)
        copies = table[None, :, None, :].repeat(B, 1, rows, 1)  # (B, H, rows, n); its backward sums the copies
        qcol, kpos, size = pos - lo, pos, T // rows

        def score_mod(score, b, h, i, j):
            return score + copies[b, h, i // size, qcol[i] - kpos[j]]

        mask_ = attention._causal_block_mask(T, T, 0, dev)
        return attention._flex_fn(dev.type)(q, k, v, score_mod=score_mod, block_mask=mask_)

    def sdpa_efficient(q, k, v, bias):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        full = (bias + mask).expand(B, H, T, T)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=full)
            except RuntimeError:  # a kernel that wants the batch's copies in memory, not a stride of 0
                return F.scaled_dot_product_attention(q, k, v, attn_mask=full.contiguous())

    x = torch.rand(T, T, device=dev, generator=g)  # FIRE's normalised distances
    fire = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, H)).to(dev)

    def fire_mlp():
        hidden = torch.relu(x[..., None] * fire[0].weight[:, 0] + fire[0].bias)  # (T, T, 32)
        return fire[2](hidden.to(dtype)).permute(2, 0, 1)

    def fire_lines(gather):
        import posbench.schemes.fire as fire_module

        real = fire_module.SegmentGather
        fire_module.SegmentGather = gather  # as_lines' gather on a GPU
        try:
            return as_lines(fire, x, dtype)
        finally:
            fire_module.SegmentGather = real

    class IndexSelect:  # index_select, its backward left to autograd (an index_add)
        apply = staticmethod(lambda table_, seg: table_.index_select(1, seg))

    def nope(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def flex_table(values, slopes_=None):
        return lambda q, k, v: attention.flex(q, k, v, None, 0, table(values, slopes_))

    dense_leaf = dense(learned).detach().requires_grad_()  # (1, H, T, T): a learned bias made dense once

    # FIRE's whole attention: its c and threshold learned, its x from the positions (as FIRE.bias)
    fire_c = torch.tensor(0.1, device=dev, requires_grad=True)
    fire_thr = torch.tensor(T / 4, device=dev, requires_grad=True)

    def fire_lines_form():  # FIRE's lines as the triton backend takes them (FIRE.tiled_bias)
        return Lines(*mlp_lines(fire), fire_c, fire_thr, 1e-6, pos, pos)

    def fire_dense():  # (1, H, T, T), the same bias made dense, as sdpa reads it
        return fire_lines_form().dense().to(dtype)

    def tiled(make_form, block=None, warps=None, stages=None):  # posbench's Triton kernels, at other settings
        def call(q, k, v):
            saved = kernels.BLOCK, kernels.WARPS, kernels.STAGES
            kernels.BLOCK, kernels.WARPS, kernels.STAGES = block or saved[0], warps or saved[1], stages or saved[2]
            try:
                return kernels.attention(q, k, v, 0, make_form())
            finally:
                kernels.BLOCK, kernels.WARPS, kernels.STAGES = saved

        return call

    forms = {  # name: (whether it trains on a CPU too, the call given q, k, v, the form it must equal)
        "sdpa, no bias (NoPE's flash kernel)": (True, nope, None),
        "flex, no bias": (
            False,
            lambda q, k, v: attention.flex(q, k, v, None, 0),
            "sdpa, no bias (NoPE's flash kernel)",
        ),
        "a learned table made dense (1, H, T, T), alone": (True, lambda q, k, v: dense(learned), None),
        "sdpa, BiasedAttention, a learned dense bias": (
            True,
            lambda q, k, v: attention.sdpa(q, k, v, dense_leaf, 0),
            None,
        ),
        "sdpa, memory-efficient kernel, a learned dense bias": (
            True,
            lambda q, k, v: sdpa_efficient(q, k, v, dense_leaf),
            "sdpa, BiasedAttention, a learned dense bias",
        ),
        "flex, a learned table (T5, KERPLE)": (
            False,
            flex_table(learned),
            "sdpa, BiasedAttention, a learned dense bias",
        ),
        "flex, a learned table per batch row": (
            False,
            lambda q, k, v: per_row(q, k, v, learned, 1),
            "flex, a learned table (T5, KERPLE)",
        ),
        "flex, per batch row and 128 queries": (
            False,
            lambda q, k, v: per_row(q, k, v, learned, max(1, T // 128)),
            "flex, a learned table (T5, KERPLE)",
        ),
        "FIRE's bias alone, its lines, index_select": (True, lambda q, k, v: fire_lines(IndexSelect), None),
        "FIRE's bias alone, its lines, SegmentGather": (
            True,
            lambda q, k, v: fire_lines(SegmentGather),
            "FIRE's bias alone, its lines, index_select",
        ),
        "FIRE's bias alone, its MLP": (True, lambda q, k, v: fire_mlp(), "FIRE's bias alone, its lines, index_select"),
        "flex, ALiBi's table": (False, flex_table(alibi), None),
        "flex, ALiBi from its slopes": (False, flex_table(alibi, slopes), "flex, ALiBi's table"),
        "sdpa, FIRE's dense bias (BiasedAttention)": (
            True,
            lambda q, k, v: attention.sdpa(q, k, v, fire_dense(), 0),
            None,
        ),
        # posbench's Triton kernels (model.attention=triton), each against the form it would replace
        "triton, no bias": (True, tiled(lambda: None), "sdpa, no bias (NoPE's flash kernel)"),
        "triton, no bias, 4 warps": (True, tiled(lambda: None, warps=4), "sdpa, no bias (NoPE's flash kernel)"),
        "triton, no bias, tiles of 128": (True, tiled(lambda: None, block=128), "sdpa, no bias (NoPE's flash kernel)"),
        "triton, no bias, 3 stages": (True, tiled(lambda: None, stages=3), "sdpa, no bias (NoPE's flash kernel)"),
        "triton, ALiBi from its slopes": (True, tiled(lambda: table(alibi, slopes)), "flex, ALiBi's table"),
        "triton, a learned table (T5, KERPLE)": (
            True,
            tiled(lambda: table(learned)),
            "flex, a learned table (T5, KERPLE)",
        ),
        "triton, a learned table, 4 warps": (
            True,
            tiled(lambda: table(learned), warps=4),
            "flex, a learned table (T5, KERPLE)",
        ),
        "triton, a learned table, 3 stages": (
            True,
            tiled(lambda: table(learned), stages=3),
            "flex, a learned table (T5, KERPLE)",
        ),
        "triton, a learned table, tiles of 32": (
            True,
            tiled(lambda: table(learned), block=32),
            "flex, a learned table (T5, KERPLE)",
        ),
        "triton, FIRE's lines": (True, tiled(fire_lines_form), "sdpa, FIRE's dense bias (BiasedAttention)"),
        "triton, FIRE's lines, tiles of 32": (
            True,
            tiled(fire_lines_form, block=32),
            "sdpa, FIRE's dense bias (BiasedAttention)",
        ),
        "triton, a learned dense bias": (
            True,
            tiled(lambda: dense_leaf),
            "sdpa, BiasedAttention, a learned dense bias",
        ),
    }
    watched = [*qkv, learned, dense_leaf, *fire.parameters(), fire_c, fire_thr]  # every gradient a form may take
    grad_outs: dict = {}
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # relative to the twin's largest value

    def run(call, train: bool, inputs):
        for t in watched:
            t.grad = None  # no accumulation timed
        with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"), torch.set_grad_enabled(train):
            out = call(*inputs)
        if train:  # one fixed gradient per output's shape, so twins meet the same
            key = (tuple(out.shape), out.dtype)
            if key not in grad_outs:
                grad_outs[key] = torch.randn(out.shape, device=dev, generator=g).to(out.dtype)
            out.backward(grad_outs[key])
        return out

    if dev.type == "cpu":  # Triton's interpreter runs a program the same whatever its warps and stages
        forms = {name: form for name, form in forms.items() if not name.endswith(("warps", "stages"))}
    base = None
    results: dict = {}
    print(f"{dev.type}: B {B}, H {H}, T {T}, D {D}, {dtype}; torch {torch.__version__}", flush=True)
    if args.only:
        words = args.only.split(",")
        chosen = {name for name in forms if any(w in name for w in words)}
        chosen |= {forms[name][2] for name in chosen} | {next(iter(forms))}
        forms = {name: form for name, form in forms.items() if name in chosen}
    for name, (any_device, call, twin) in forms.items():
        train = backward or any_device
        inputs = qkv if train else [t.detach() for t in qkv]  # flex's forward on a CPU refuses a grad
        try:
            step = lambda call=call, train=train, inputs=inputs: run(call, train, inputs)  # noqa: E731
            ms, first = timed(step, sync, reps, warmups=0 if args.small else 2)
        except Exception as e:  # a form this torch cannot run: said, and the others run
            print(f"{name}: cannot run here: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}", flush=True)
            continue
        base = base or ms
        how = "forward and backward" if train else "forward only"
        said = f"{name}: {ms:.3f} ms ({how}), {ms / base:.2f}x the first, first call {first:.1f} s"
        try:  # what the timed call computed: its output and every gradient it took
            out = run(call, train, inputs)
            results[name] = [out.detach().float()] + [None if t.grad is None else t.grad.float() for t in watched]
        except Exception as e:
            said += f"; its output could not be read: {type(e).__name__}"
        if twin in results and name in results:  # a form that would replace another computes what it does
            pairs = [(a, b) for a, b in zip(results[name], results[twin]) if a is not None and b is not None]
            # a gradient that is zero but for rounding (FIRE's last bias: softmax's rows sum to
            # one) is read against the largest of the twin's tensors, not against its own noise
            most = max(b.abs().max().item() for _, b in pairs)
            scales = [b.abs().max().item() for _, b in pairs]
            scales = [scale if scale >= 1e-3 * most else most for scale in scales]
            gap = max((a - b).abs().max().item() / scale for (a, b), scale in zip(pairs, scales))
            verdict = "equal to" if gap <= tolerance else "DIFFERS from"
            said += f"; {verdict} {twin!r} in the output and {len(pairs) - 1} gradients (largest gap {gap:.1e})"
        print(said, flush=True)


if __name__ == "__main__":
    main()
