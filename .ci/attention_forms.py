"""One attention call's forward and backward, timed in each form a bias could take on a GPU.

    python .ci/attention_forms.py              # CUDA, GPT-2-small's attention: B 16, H 12, T 1024, D 64, bf16
    python .ci/attention_forms.py --small      # a seconds-long check of every form (on a CPU: flex forward only)

The forms posbench runs (sdpa's flash kernel for NoPE, flex with a table, ALiBi's slopes,
BiasedAttention for a learned dense bias, FIRE's lines) beside forms it could run (a learned
table copied per batch row, or per row and block of 128 queries, so that fewer of flex's
atomic additions meet in one cell; SDPA's memory-efficient kernel, which returns a dense
bias's gradient; FIRE's MLP with its hidden layer). Each line: milliseconds a call (the mean
of 10 after 2 warm-ups), its ratio to the first form, and the first call's seconds (compiling).
A form this torch cannot run says why in one line; the others still run.
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
from posbench import attention  # noqa: E402
from posbench.schemes.alibi import alibi_slopes  # noqa: E402
from posbench.schemes.distance import DistanceTable  # noqa: E402
from posbench.schemes.fire import SegmentGather, as_lines  # noqa: E402


def timed(step, sync, reps: int):
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(2):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    sync()
    return (time.perf_counter() - start) / reps * 1e3, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="B 2, H 2, T 64, D 16, 2 timed calls")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    B, H, T, D = (2, 2, 64, 16) if args.small else (16, 12, 1024, 64)
    reps = 2 if args.small else 10
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    backward = dev.type == "cuda"  # torch has no FlexAttention backward on a CPU
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=g, requires_grad=True) for _ in range(3)]
    pos = torch.arange(T, device=dev)
    lo = -(T - 1)
    learned = torch.randn(H, 2 * T - 1, device=dev, generator=g, requires_grad=True)  # T5's or KERPLE's table
    slopes = alibi_slopes(H).to(dev)
    alibi = -slopes[:, None] * torch.arange(lo, T, device=dev, dtype=torch.float32)  # ALiBi's table
    future = attention.future_mask(T, T, 0, dev)
    mask = torch.zeros(T, T, device=dev, dtype=dtype).masked_fill_(future, float("-inf"))

    def dense(table):  # (1, H, T, T) from a table over distances, as eager and sdpa read it
        return DistanceTable(table, lo, pos, pos, dtype).dense()

    def per_row(q, k, v, table, rows: int):  # flex reading a learned table copied per batch row (and block of queries)
        copies = table[None, :, None, :].repeat(B, 1, rows, 1)  # (B, H, rows, n); its backward sums the copies
        qcol, kpos, size = pos - lo, pos, T // rows

        def score_mod(score, b, h, i, j):
            return score + copies[b, h, i // size, qcol[i] - kpos[j]]

        mask_ = attention._causal_block_mask(T, T, 0, dev)
        return attention._flex_fn(dev.type)(q, k, v, score_mod=score_mod, block_mask=mask_)

    def sdpa_efficient(q, k, v, bias):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(bias + mask).expand(B, H, T, T))

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

    def table(values, slopes_=None):
        return DistanceTable(values, lo, pos, pos, dtype, slopes_)

    def nope(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def biased(q, k, v):
        return attention.sdpa(q, k, v, dense(learned), 0)

    def efficient(q, k, v):
        return sdpa_efficient(q, k, v, dense(learned))

    def flex_table(values, slopes_=None):
        return lambda q, k, v: attention.flex(q, k, v, None, 0, table(values, slopes_))

    forms = [  # (name, whether it trains on a CPU too, the call given q, k, v, the form it must equal)
        ("sdpa, no bias (NoPE's flash kernel)", True, nope, None),
        ("flex, no bias", False, lambda q, k, v: attention.flex(q, k, v, None, 0), 0),
        ("sdpa, BiasedAttention, a learned dense bias", True, biased, None),
        ("sdpa, memory-efficient kernel, a learned dense bias", True, efficient, 2),
        ("flex, a learned table (T5, KERPLE)", False, flex_table(learned), 2),
        ("flex, a learned table per batch row", False, lambda q, k, v: per_row(q, k, v, learned, 1), 2),
        ("flex, per batch row and 128 queries", False, lambda q, k, v: per_row(q, k, v, learned, max(1, T // 128)), 2),
        ("flex, ALiBi's table", False, flex_table(alibi), None),
        ("flex, ALiBi from its slopes", False, flex_table(alibi, slopes), 7),
        ("FIRE's bias, its lines, index_select", True, lambda q, k, v: fire_lines(IndexSelect), None),
        ("FIRE's bias, its lines, SegmentGather", True, lambda q, k, v: fire_lines(SegmentGather), 9),
        ("FIRE's bias, its MLP", True, lambda q, k, v: fire_mlp(), 9),
    ]

    base = None
    print(f"{dev.type}: B {B}, H {H}, T {T}, D {D}, {dtype}; torch {torch.__version__}", flush=True)
    outputs = {}
    for n, (name, any_device, call, twin) in enumerate(forms):
        train = backward or any_device
        inputs = qkv if train else [t.detach() for t in qkv]  # flex's forward on a CPU refuses a grad

        def step(call=call, train=train, inputs=inputs):
            with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda"), torch.set_grad_enabled(train):
                out = call(*inputs)
            if train:
                out.float().sum().backward()
            return out

        try:
            ms, first = timed(step, sync, reps)
            with torch.no_grad():
                outputs[n] = step(train=False, inputs=[t.detach() for t in qkv]).float()
        except Exception as e:  # a form this torch cannot run: said, and the others run
            print(f"{name}: cannot run here: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        base = base or ms
        how = "forward and backward" if train else "forward only"
        said = f"{name}: {ms:.3f} ms ({how}), {ms / base:.2f}x the first, first call {first:.1f} s"
        if twin is not None and twin in outputs:  # a form that would replace another computes what it does
            gap = (outputs[n] - outputs[twin]).abs().max().item()
            said += f"; {'equal to' if gap <= (0.02 if dtype == torch.bfloat16 else 1e-4) else 'DIFFERS from'} "
            said += f"{forms[twin][0]!r} (max gap {gap:.1e})"
        print(said, flush=True)


if __name__ == "__main__":
    main()
