"""The optional C kernels (posbench/native/cope.c, attention.c) against their PyTorch twins, and
their fallbacks."""

import os
import shutil

import pytest
import torch
from conftest import tiny

from posbench import check, native
from posbench.attention import BiasedAttention
from posbench.model import TransformerLM
from posbench.schemes import SCHEMES, cope

needs_kernel = pytest.mark.skipif(
    native.load("cope") is None, reason=f"no CoPE kernel here: {native.unavailable.get('cope')}"
)


# for the tests of the build itself (its cache, its compiler, what it says): a fresh build with no
# optimisation, since what they check does not depend on the code the compiler makes
QUICK_BUILD = (["-O0"],)

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels' parallel loops, not one thread's


def pytorch_cope_attention(q, k, v, table, qpos, kpos):
    """The PyTorch twin: CoPE's bias (the paper's formula) through the generic grad-bias attention."""
    keep = (kpos[None, :] <= qpos[:, None]).to(q.dtype)
    mask = torch.zeros_like(keep).masked_fill_(keep == 0, float("-inf"))
    return BiasedAttention.apply(q, k, v, cope.cope_bias(q, k, table, qpos, kpos), mask)


def inputs(B, H, Tq, Tk, D, P, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Tq, D, generator=g) * scale).requires_grad_()
    k = (torch.randn(B, H, Tk, D, generator=g) * scale).requires_grad_()
    v = torch.randn(B, H, Tk, D, generator=g).requires_grad_()
    table = (torch.randn(D, P, generator=g) * 0.5).requires_grad_()
    return q, k, v, table


def both(q, k, v, table, qpos, kpos, d_out):
    """(output, grads of q, k, v, table) by the kernel and by the PyTorch twin."""
    results = []
    for fn in (native.cope_attention, pytorch_cope_attention):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
        out = fn(*leaves, qpos, kpos)
        assert out is not None
        out.backward(d_out)
        results.append([out.detach()] + [t.grad for t in leaves])
    return results


@needs_kernel
@pytest.mark.parametrize(
    "B,H,Tq,Tk,q0,P",
    [
        (2, 3, 21, 21, 0, 64),  # 6 (batch, head) pairs: one group of 4 scanned together, 2 alone
        (1, 4, 16, 16, 0, 64),  # exactly one group of 4
        (2, 4, 8, 29, 21, 64),  # a query block: queries 21..28 against keys 0..28
        (1, 5, 33, 33, 0, 4),  # npos_max 4: positions clamp at 3 for most keys
    ],
)
def test_kernel_matches_pytorch_twin(B, H, Tq, Tk, q0, P):
    """Outputs and every gradient within 1e-5 in fp32, through groups of 4 pairs and the
    leftovers, row lengths that are and are not multiples of 8, query blocks and clamping."""
    D = 8
    q, k, v, table = inputs(B, H, Tq, Tk, D, P, scale=1.5)
    kpos = torch.arange(Tk)
    qpos = kpos[q0 : q0 + Tq]
    d_out = torch.randn(B, H, Tq, D, generator=torch.Generator().manual_seed(1))
    got, want = both(q, k, v, table, qpos, kpos, d_out)
    for name, a, b in zip(["out", "d_q", "d_k", "d_v", "d_table"], got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max().item())
    if P == 4:  # the case meant to clamp did: the table's last row took gradient from clamped keys
        assert want[4][:, 3].abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("D,Tq,Tk", [(32, 40, 40), (24, 37, 37), (16, 9, 30)])  # the default width; 8 mod 16; a block
def test_kernel_on_strided_views_as_the_model_passes_them(D, Tq, Tk):
    """q, k, v as head-major views of one (B, T, 3, H, D) projection (strided rows, as the
    model passes them), against the definition in fp64 (the twin run in float64): values
    and every gradient within 1e-5 of the largest. The fp32 twin itself is no closer: CoPE's
    positions are sums of gates, and the table is read between two of its rows."""
    B, H, P = 2, 3, 16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, Tk, 3, H, D, generator=g)
    views = (qkv[:, Tk - Tq :, 0], qkv[:, :, 1], qkv[:, :, 2])
    table = torch.randn(D, P, generator=g) * 0.5
    d_out = torch.randn(B, H, Tq, D, generator=g)
    kpos = torch.arange(Tk)
    results = []
    for fn, dtype in ((native.cope_attention, torch.float32), (pytorch_cope_attention, torch.float64)):
        leaves = [t.transpose(1, 2).detach().to(dtype).requires_grad_() for t in views]
        leaves.append(table.detach().to(dtype).requires_grad_())
        if dtype == torch.float32:
            assert leaves[0].stride(2) == 3 * H * D  # strided rows, as the model's
        out = fn(*leaves, kpos[Tk - Tq :], kpos)
        out.backward(d_out.to(dtype))
        results.append([out.detach().double()] + [t.grad.double() for t in leaves])
    for name, a, b in zip(["out", "d_q", "d_k", "d_v", "d_table"], *results):
        err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
        assert err <= 1e-5 * scale, (name, err, scale)


@needs_kernel
def test_kernel_is_exact_at_hand_worked_point():
    """One head, one dim: gates sigmoid(q.k), positions summed from the key to the query, the
    table read between floor and ceil, then softmax; computed here in plain Python."""
    import math

    qv, ks, vs, e = 2.0, [0.3, -0.4, 1.0], [1.0, -2.0, 0.5], [0.0, 0.7, -0.2, 0.4]
    D = 8  # the kernel's narrowest head; every vector is zero past its first entry
    q = torch.zeros(1, 1, 1, D)
    k, v, table = torch.zeros(1, 1, 3, D), torch.zeros(1, 1, 3, D), torch.zeros(D, 4)
    q[..., 0], k[..., 0], v[..., 0], table[0] = qv, torch.tensor(ks), torch.tensor(vs), torch.tensor(e)
    out = native.cope_attention(q, k, v, table, torch.tensor([2]), torch.arange(3))[..., 0]  # query 2 of 3
    logits = [qv * kj / math.sqrt(D) for kj in ks]
    gates = [1 / (1 + math.exp(-x)) for x in logits]
    scores = []
    for j in range(3):
        p = min(sum(gates[j:]), 3)
        lo = math.floor(p)
        hi = min(lo + 1, 3)
        scores.append(logits[j] + qv * (e[lo] + (p - lo) * (e[hi] - e[lo])))
    w = [math.exp(s) for s in scores]
    want = sum(wj * vj for wj, vj in zip(w, vs)) / sum(w)
    assert out.item() == pytest.approx(want, abs=1e-6)


@needs_kernel
def test_kernel_declines_what_it_would_misread():
    """It takes keys at positions 0..Tk-1 and queries at the last Tq of them, heads a multiple
    of 8 wide; anything else is left to the PyTorch path."""
    q, k, v, table = inputs(1, 2, 6, 6, 8, 8)
    pos = torch.arange(6)
    assert native.cope_attention(q, k, v, table, pos, pos) is not None
    assert native.cope_attention(q, k, v, table, pos + 1, pos + 1) is None  # shifted positions
    assert native.cope_attention(q[:, :, :3], k, v, table, pos[:3], pos) is None  # not the last queries
    q4, k4, v4, t4 = inputs(1, 2, 6, 6, 4, 8)
    assert native.cope_attention(q4, k4, v4, t4, pos, pos) is None  # head dim 4
    assert native.cope_attention(q, k, v, table[:, :0], pos, pos) is None  # a table of no positions


@needs_kernel
def test_kernel_gives_the_same_bits_on_one_thread_and_two():
    q, k, v, table = inputs(2, 4, 40, 40, 8, 16)
    pos = torch.arange(40)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
        out = native.cope_attention(*leaves, pos, pos)
        out.sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    assert_same_bits_on_one_thread_and_two(run)


def assert_same_bits_on_one_thread_and_two(run):
    """run() -> tensors: the same bits whether torch (and so the kernels) use 1 thread or 2."""
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(run())
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def calls_in_a_training_step(monkeypatch, function, scheme):
    """The tiny model of `scheme` after one loss.backward(), and how often function.apply ran."""
    calls = []
    real = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    m = TransformerLM(tiny(scheme))
    x = torch.randint(0, 256, (2, 17))
    torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    return m, len(calls)


@needs_kernel
def test_the_model_takes_the_kernel_and_it_trains(monkeypatch):
    m, calls = calls_in_a_training_step(monkeypatch, native.CoPEAttention, "cope")
    assert calls == m.cfg.n_layer
    assert "attend agrees with the eager formula" in check.attend_agrees(check.tiny_model("cope").train(), 40)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_off_switch_and_other_dtypes_take_the_pytorch_path(monkeypatch):
    q, k, v, table = inputs(1, 2, 5, 5, 8, 8)
    pos = torch.arange(5)
    bf16 = [t.detach().bfloat16() for t in (q, k, v, table)]
    assert native.cope_attention(*bf16, pos, pos) is None  # fp32 on CPU only
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    for switch in ("off", "0"):
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setenv("POSBENCH_NATIVE", switch)
        assert native.cope_attention(q, k, v, table, pos, pos) is None
        assert f"POSBENCH_NATIVE={switch}" in native.unavailable["cope"]
    # the model then runs CoPE on SDPA with its PyTorch bias
    twin, kernel = [], []
    real_twin, real_kernel = cope.cope_bias, native.CoPEAttention.apply
    monkeypatch.setattr(cope, "cope_bias", lambda *a: twin.append(1) or real_twin(*a))
    monkeypatch.setattr(native.CoPEAttention, "apply", lambda *a: kernel.append(1) or real_kernel(*a))
    m = TransformerLM(tiny("cope"))
    m(torch.randint(0, 256, (2, 16))).sum().backward()
    assert len(twin) == m.cfg.n_layer and not kernel
    # and check-scheme says that it could not try attend here
    assert "native backend only, which cannot run here" in check.attend_agrees(check.tiny_model("cope").train(), 16)


def test_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.delenv("POSBENCH_NATIVE", raising=False)  # the suite may run with kernels off
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    assert native.load("cope") is None
    why = native.unavailable["cope"]
    assert "no C compiler" in why and "no-such-compiler-xyz" in why
    assert not any(tmp_path.rglob("*.so"))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no cc on this machine")
def test_a_compiler_that_fails_is_named_and_nothing_half_built_is_left(monkeypatch, tmp_path):
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'badcc: error: refused' >&2\necho '    ^~~~' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.delenv("POSBENCH_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    assert native.load("cope") is None
    assert "could not compile cope.c: badcc: error: refused" in native.unavailable["cope"]
    assert not any((tmp_path / "cache").rglob("*.so"))
    assert not any((tmp_path / "cache" / "native").iterdir())  # no empty key folder either


@needs_kernel
def test_the_build_is_cached_and_reused(monkeypatch, tmp_path):
    import subprocess

    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path))
    runs = []
    real = subprocess.run

    def spy(cmd, **kw):
        if "-shared" in cmd:  # a compile, not the --version that goes into the cache key
            runs.append(cmd)
        return real(cmd, **kw)

    monkeypatch.setattr(native.subprocess, "run", spy)
    monkeypatch.setattr(native, "FLAG_SETS", QUICK_BUILD)
    first = native._build("cope")
    assert first.is_file() and len(runs) >= 1
    n = len(runs)
    assert native._build("cope") == first and len(runs) == n  # no second compile


@needs_kernel
def test_cc_may_carry_words(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", f"env {shutil.which('cc')}")
    monkeypatch.setattr(native, "FLAG_SETS", QUICK_BUILD)
    assert native.load("cope") is not None, native.unavailable


def test_autocast_and_second_derivatives_are_refused_not_corrupted():
    q, k, v, table = inputs(2, 4, 20, 20, 8, 8)
    pos = torch.arange(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert native.cope_attention(q, k, v, table, pos, pos) is None
        with pytest.raises(RuntimeError, match="fp32 CPU tensors outside autocast"):
            native.CoPEAttention.apply(q, k, v, table)
    if native.load("cope") is not None:
        out = native.cope_attention(q, k, v, table, pos, pos)
        (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError):
            g.sum().backward()


def test_a_cope_subclass_with_its_own_bias_is_not_sent_to_the_kernel():
    class HalfCoPE(SCHEMES["cope"]):
        def bias(self, q, k, qpos, kpos, layer):
            return 0.5 * super().bias(q, k, qpos, kpos, layer)

    scheme = HalfCoPE(tiny("cope"))
    q, k, v, _ = inputs(1, 4, 6, 6, 8, 8)
    pos = torch.arange(6)
    assert scheme.attend(q, k, v, pos, pos, 0) is None
    if native.load("cope") is not None:  # while CoPE itself takes it
        assert SCHEMES["cope"](tiny("cope")).attend(q, k, v, pos, pos, 0) is not None


@pytest.mark.parametrize("switch", ["off", "1"])
def test_extrapolate_says_when_auto_cannot_use_the_kernels(monkeypatch, tmp_path, switch):
    from conftest import smoke_experiment

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_NATIVE", switch)
    torch.set_num_threads(1)  # what it says is checked, not the kernels' loops: a busy machine's hand-offs cost seconds
    exp, res, _ = smoke_experiment(tmp_path, "--schemes", "cope,alibi")
    text = " ".join(res.output.split())
    if switch == "off":  # auto takes SDPA, says why, and the records say so
        assert "attention runs on SDPA" in text and "turned off by POSBENCH_NATIVE=off" in text
        assert "attention: sdpa backend" in (exp / "summary.md").read_text()
    else:
        assert ("attention runs on SDPA" in text) == (native.load("attention") is None)
        assert ("cope trains on its PyTorch path" in text) == (native.load("cope") is None)
    assert (exp / "summary.csv").is_file()


@pytest.mark.parametrize(
    "schemes, options, built",
    [
        ("alibi,rope", {}, ["attention"]),
        ("cope", {}, ["attention", "cope"]),
        ("pattern_mix", {"pattern_mix": {"layers": ["cope", {"scheme": "rope", "window": 8}]}}, ["attention", "cope"]),
        ("pattern_mix", {"pattern_mix": {"layers": ["nope", {"scheme": "rope", "window": 8}]}}, ["attention"]),
        ("pattern_mix", {"pattern_mix": {"layers": ["nope", {"scheme": "cope", "window": 8}]}}, ["attention"]),
        ("gemma3,irope", {}, ["attention"]),
    ],
)
def test_the_kernels_built_before_workers_start_are_those_of_every_layers_scheme(monkeypatch, schemes, options, built):
    """A pattern's full-attention layers attend through their own schemes, so a CoPE layer's kernel
    is built (and its absence reported) before any worker starts, as a plain CoPE run's is; a
    window layer attends through its mask and bias and needs none."""
    from posbench.config import load_config

    asked = []
    monkeypatch.setattr(native, "load", lambda name, building=None: asked.append(name) or object())
    monkeypatch.setattr(native, "why_not", lambda head_dim, device: None)
    cfg = load_config(None, [f"schemes=[{schemes}]", f"scheme_options={options}", "train.device=cpu"])
    native.build_for([cfg], print)
    assert asked == built


def test_a_sweep_builds_the_kernels_of_every_grid_point(monkeypatch, tmp_path):
    """A sweep whose grid varies the schemes builds before its workers start what any point needs."""
    from posbench.config import load_sweep

    asked = []
    monkeypatch.setattr(native, "load", lambda name, building=None: asked.append(name) or object())
    monkeypatch.setattr(native, "why_not", lambda head_dim, device: None)
    config = tmp_path / "sweep.yaml"
    config.write_text("train: {device: cpu}\nsweep: {schemes: [[alibi], [cope]]}\n")
    native.build_for([cfg for _, cfg in load_sweep(config)], print)
    assert asked == ["attention", "cope"]


# ---- attention.c: every scheme's causal attention (no bias, a fixed bias or a learned one) ----

needs_attention_kernel = pytest.mark.skipif(
    native.load("attention") is None, reason=f"no attention kernel here: {native.unavailable.get('attention')}"
)


def plain_attention(q, k, v, bias, q0):
    """The definition, in fp64: softmax(q.k / sqrt(d) + bias, keys after the query masked) v."""
    q, k, v = q.double(), k.double(), v.double()
    Tq, Tk = q.size(2), k.size(2)
    s = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    if bias is not None:
        s = s + bias.double()
    future = torch.arange(Tk)[None, :] > torch.arange(q0, q0 + Tq)[:, None]
    return s.masked_fill(future, float("-inf")).softmax(-1) @ v


def qkv_views(B, H, Tq, Tk, D, seed=0):
    """q, k, v as the model hands them over: head-major views of one (B, T, 3, H, D) projection,
    so rows are strided; q holds the last Tq positions (a query block when Tq < Tk)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, Tk, 3, H, D, generator=g)
    views = qkv[:, Tk - Tq :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return [t.transpose(1, 2).detach().requires_grad_() for t in views]  # (B, H, T, D)


@needs_attention_kernel
@pytest.mark.parametrize(
    "B,H,Tq,Tk,D,bias",
    [
        (2, 3, 13, 13, 8, None),  # rows not a multiple of the 4-row tile, the tiny models' head dim
        (2, 4, 100, 100, 32, None),  # the default size
        (2, 4, 100, 100, 32, "shared"),  # a bias shared by the batch (alibi, t5, kerple, fire)
        (3, 2, 37, 37, 16, "batch"),  # a bias per batch row (xl, cope's twin)
        (2, 2, 5, 21, 24, "shared"),  # a query block: queries 16..20 against keys 0..20
        (1, 2, 150, 200, 32, "shared"),  # a long block, past one 128-row work item
        (1, 1, 1, 1, 8, "batch"),  # one query, one key
        (2, 1, 40, 40, 136, None),  # a head dim that has no specialised tile
    ],
)
def test_attention_kernel_matches_the_definition(B, H, Tq, Tk, D, bias):
    """Output and the gradients of q, k, v and the bias within 1e-5 of fp64 softmax attention."""
    q, k, v = qkv_views(B, H, Tq, Tk, D)
    g = torch.Generator().manual_seed(1)
    if bias is not None:
        bias = (torch.randn(1 if bias == "shared" else B, H, Tq, Tk, generator=g) * 2).requires_grad_()
    leaves = [t for t in (q, k, v, bias) if t is not None]
    d_out = torch.randn(B, H, Tq, D, generator=g)
    results = []
    for fn in (native.attention, plain_attention):
        out = fn(q, k, v, bias, Tk - Tq)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves, d_out.to(out.dtype))))
    for name, a, b in zip(["out", "d_q", "d_k", "d_v", "d_bias"], *results):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        a, b = a.double(), b.double()  # the reference's gradients come back in the leaves' fp32
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max().item())


def plain_relative_attention(q, k, v, qr, rk):
    """The definition, in fp64: score_ij = (q_i.k_j + qr_i.rk[i - j]) / sqrt(d), with a gather
    by distance (Transformer-XL's position term written the slow, obvious way)."""
    q, k, v, qr, rk = (t.double() for t in (q, k, v, qr, rk))
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    i, j = torch.arange(Tk - Tq, Tk)[:, None], torch.arange(Tk)[None, :]
    by_distance = torch.einsum("bhid,hed->bhie", qr, rk)  # (B, H, Tq, Tk): qr_i . rk[e]
    pos = by_distance.gather(3, (i - j).clamp(min=0).expand(B, H, Tq, Tk))
    s = (q @ k.transpose(-1, -2) + pos) / D**0.5
    return s.masked_fill(j > i, float("-inf")).softmax(-1) @ v


@needs_attention_kernel
@pytest.mark.parametrize(
    "B,H,Tq,Tk,D",
    [
        (2, 3, 13, 13, 8),  # rows not a multiple of the tile, the tiny models' head dim
        (2, 4, 100, 100, 32),  # the default size
        (2, 2, 5, 21, 24),  # a query block: queries 16..20 against keys 0..20
        (1, 2, 150, 200, 32),  # a long block, past one 128-row work item
        (1, 1, 1, 1, 8),  # one query, one key
        (2, 1, 40, 40, 136),  # a head dim that has no specialised tile
    ],
)
def test_relative_term_matches_the_definition(B, H, Tq, Tk, D):
    """attention.c with a relative term (XL's position term inside the tiles): output and the
    gradients of q, k, v, qr and rk within 1e-5 of the fp64 definition."""
    q, k, v = qkv_views(B, H, Tq, Tk, D)
    g = torch.Generator().manual_seed(1)
    qr = torch.randn(B, H, Tq, D, generator=g).requires_grad_()
    rk = torch.randn(Tk, H, D, generator=g).transpose(0, 1).requires_grad_()  # strided, as XL's
    d_out = torch.randn(B, H, Tq, D, generator=g)
    results = []
    for fn in (native.relative_attention, plain_relative_attention):
        out = fn(q, k, v, qr, rk)
        results.append([out.detach()] + list(torch.autograd.grad(out, (q, k, v, qr, rk), d_out.to(out.dtype))))
    for name, a, b in zip(["out", "d_q", "d_k", "d_v", "d_qr", "d_rk"], *results):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        a, b = a.double(), b.double()
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max().item())


@needs_attention_kernel
def test_relative_term_gives_the_same_bits_on_one_thread_and_two():
    q, k, v = qkv_views(3, 4, 50, 50, 16)
    qr = torch.randn(3, 4, 50, 16).requires_grad_()
    rk = torch.randn(4, 50, 16).requires_grad_()

    def run():
        out = native.relative_attention(q, k, v, qr, rk)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v, qr, rk))]

    assert_same_bits_on_one_thread_and_two(run)


@needs_attention_kernel
def test_xl_attends_through_the_relative_term_and_a_subclass_does_not(monkeypatch):
    from posbench.schemes import TransformerXL

    m, calls = calls_in_a_training_step(monkeypatch, native.RelativeAttention, "xl")
    assert calls == m.cfg.n_layer
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)

    class Shifted(TransformerXL):  # its own bias: the kernel would compute the parent's
        def bias(self, q, k, qpos, kpos, layer):
            return super().bias(q, k, qpos, kpos, layer) + 1.0

    assert Shifted(m.cfg).attend(*[torch.zeros(1, 2, 4, 8)] * 3, torch.arange(4), torch.arange(4), 0) is None


@needs_attention_kernel
def test_attention_kernel_at_a_hand_worked_point():
    """One head of width 8, three keys, the last query: weights exp(s_j) / sum, computed by hand."""
    import math

    q = torch.zeros(1, 1, 3, 8)
    k = torch.zeros(1, 1, 3, 8)
    v = torch.zeros(1, 1, 3, 8)
    q[0, 0, 2, 0], k[0, 0, :, 0] = 2.0, torch.tensor([1.0, -1.0, 0.5])
    v[0, 0, :, 1] = torch.tensor([3.0, -2.0, 1.0])
    bias = torch.tensor([0.0, 0.25, -1.0]).expand(1, 1, 3, 3)
    out = native.attention(q, k, v, bias, 0)
    s = [2.0 * kj / math.sqrt(8) + b for kj, b in zip([1.0, -1.0, 0.5], [0.0, 0.25, -1.0])]
    w = [math.exp(x) for x in s]
    assert out[0, 0, 2, 1].item() == pytest.approx(
        sum(wj * vj for wj, vj in zip(w, [3.0, -2.0, 1.0])) / sum(w), abs=1e-6
    )
    assert out[0, 0, 0, 1].item() == pytest.approx(3.0, abs=1e-6)  # the first query sees only key 0


@needs_attention_kernel
def test_attention_kernel_gives_the_same_bits_on_one_thread_and_two():
    q, k, v = qkv_views(3, 4, 50, 50, 16)
    bias = torch.randn(1, 4, 50, 50).requires_grad_()

    def run():
        out = native.attention(q, k, v, bias, 0)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v, bias))]

    assert_same_bits_on_one_thread_and_two(run)


@needs_attention_kernel
@pytest.mark.parametrize(
    "scheme,packed",  # no bias, a fixed bias, a learned one: q, k, v unrotated, qkv taken whole;
    [("nope", True), ("alibi", True), ("t5", True), ("rope", False)],  # rotated: q, k, v apart
)
def test_the_model_attends_through_the_kernel(monkeypatch, scheme, packed):
    calls = []
    for fn, bias_at in ((native.Attention, 3), (native.PackedAttention, 1)):
        real = fn.apply
        monkeypatch.setattr(
            fn, "apply", lambda *a, f=fn, i=bias_at, r=real: calls.append((f, a[i] is not None)) or r(*a)
        )
    torch.manual_seed(0)
    m = TransformerLM(tiny(scheme))
    x = torch.randint(0, 256, (2, 17))
    torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    fn = native.PackedAttention if packed else native.Attention
    assert calls == [(fn, scheme in ("alibi", "t5"))] * m.cfg.n_layer
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@needs_attention_kernel
@pytest.mark.parametrize("bias", [None, "shared", "learned"])
def test_packed_attention_gives_the_bits_of_separate_q_k_v(bias):
    """Taking qkv whole changes where the gradient is written, not one number of it."""
    B, T, H, D = 2, 37, 3, 16
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, generator=g).requires_grad_()
    b = None if bias is None else (torch.randn(1, H, T, T, generator=g).requires_grad_(bias == "learned"))
    d_out = torch.randn(B, H, T, D, generator=g)
    q, k, v = native.qkv_views(qkv, H)
    packed = native.attention(q, k, v, b, 0)  # q, k and v are views of qkv: it is taken whole
    assert packed.grad_fn.name() == "PackedAttentionBackward"
    grads_packed = torch.autograd.grad(packed, [qkv] + ([b] if bias == "learned" else []), d_out)
    apart = [t.detach().clone().requires_grad_() for t in native.qkv_views(qkv, H)]
    out = native.attention(*apart, b, 0)
    assert out.grad_fn.name() == "AttentionBackward"
    grads = torch.autograd.grad(out, apart + ([b] if bias == "learned" else []), d_out)
    assert torch.equal(packed, out)
    assert torch.equal(grads_packed[0], torch.cat([t.transpose(1, 2).flatten(2) for t in grads[:3]], dim=2))
    if bias == "learned":
        assert torch.equal(grads_packed[1], grads[3])


@needs_attention_kernel
def test_packed_attention_only_for_the_exact_views_of_qkv():
    B, T, H, D = 1, 9, 2, 8
    qkv = torch.randn(B, T, 3 * H * D, requires_grad=True)
    q, k, v = native.qkv_views(qkv, H)
    other = torch.randn(B, T, 3 * H * D, requires_grad=True)
    mixed = (q, *native.qkv_views(other, H)[1:])
    for args in [(k, q, v), (q * 1, k, v), mixed, (q[:, :, 1:], k, v)]:
        out = native.attention(*args, None, T - args[0].size(2))
        assert out.grad_fn.name() == "AttentionBackward"
    assert native.attention(q, k, v, None, 0).grad_fn.name() == "PackedAttentionBackward"


def test_attention_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    q, k, v = qkv_views(1, 2, 6, 6, 8)
    k4, v4 = k[:, :, :4], v[:, :, :4]  # more queries than keys: q0 = -2 would index before key 0
    assert native.attention(q, k4, v4, None, -2) is None
    assert native.attention(*(t.detach().bfloat16() for t in (q, k, v)), None, 0) is None
    assert native.attention(*(t.detach()[..., :4] for t in (q, k, v)), None, 0) is None  # head dim 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert native.attention(q, k, v, None, 0) is None
        with pytest.raises(RuntimeError, match="fp32 CPU tensors outside autocast"):
            native.Attention.apply(q, k, v, None, 0)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_NATIVE", "off")
    assert native.attention(q, k, v, None, 0) is None
    assert "POSBENCH_NATIVE=off" in native.unavailable["attention"]
    # and the model then attends through SDPA, with the same result as the definition
    m = TransformerLM(tiny("alibi"))
    assert torch.isfinite(m(torch.randint(0, 256, (2, 16)))).all()


@needs_attention_kernel
def test_attention_kernel_refuses_a_second_derivative():
    q, k, v = qkv_views(1, 2, 6, 6, 8)
    (g,) = torch.autograd.grad(native.attention(q, k, v, None, 0).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_torch_compile_traces_the_pytorch_path_and_agrees_with_eager():
    """--compile: the tracer cannot follow the kernels' raw pointers (it would crash the
    process), so under torch.compile every kernel declines and the compiled model is torch's own. The
    tracer and autograd's tracing are what meet the kernels; aot_eager runs both and then the
    traced graph as is, without inductor's C++ build (a minute or more on a cold cache)."""
    torch.manual_seed(0)
    model = TransformerLM(tiny("alibi"))
    x = torch.randint(0, 256, (2, 16))
    compiled = torch.compile(model, backend="aot_eager")
    y = compiled(x)
    y.square().mean().backward()
    assert torch.allclose(y, model(x), atol=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@needs_attention_kernel
def test_attention_kernel_ignores_huge_scores_of_future_keys():
    """Keys a query cannot see yet may score anything; with scores ~1e4 above the visible ones,
    letting them into a row's maximum would underflow every visible weight to 0."""
    q, k, v = qkv_views(2, 2, 12, 12, 16)
    with torch.no_grad():
        k[:, :, 6:] *= 1e4
        q[:, :, :6].abs_()
        k[:, :, 6:].abs_()  # so their scores are large and positive for queries 0..5
    out = native.attention(q, k, v, None, 0)
    want = plain_attention(q, k, v, None, 0)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, :, :6].double(), want[:, :, :6], atol=1e-5)


@needs_attention_kernel
def test_attention_kernel_takes_steep_scores():
    """Scores in the hundreds, either sign: each row's softmax is taken from its maximum, or
    exp overflows (the row's max is a reduction across vector lanes, easy to get wrong)."""
    q, k, v = qkv_views(2, 3, 37, 37, 32)
    bias = 400 * torch.randn(1, 3, 37, 37, generator=torch.Generator().manual_seed(5))
    out = native.attention(q, k, v, bias, 0)  # within fp32's rounding of such scores
    assert torch.allclose(out.double(), plain_attention(q, k, v, bias, 0), atol=1e-4)


@needs_attention_kernel
def test_attention_kernel_lets_a_nan_through_as_the_definition_does():
    """A NaN score must reach the output (a blow-up is a result), not be masked out as if it
    were a future key."""
    q, k, v = qkv_views(1, 1, 4, 4, 8)
    bias = torch.zeros(1, 1, 4, 4)
    bias[0, 0, 3, 1] = float("nan")
    out = native.attention(q, k, v, bias, 0)
    want = plain_attention(q, k, v, bias, 0)
    assert torch.isnan(out[0, 0, 3]).all() and torch.isnan(want[0, 0, 3]).all()
    assert torch.allclose(out[0, 0, :3].double(), want[0, 0, :3], atol=1e-5)


def test_attention_kernel_declines_shapes_it_would_misread():
    q, k, v = qkv_views(2, 1, 5, 5, 8)
    one = k.detach()[:1]  # a batch of 1 that SDPA would broadcast; the C would read past it
    assert native.attention(q, one, one, None, 0) is None
    assert native.attention(q, k, v.detach()[..., :4].repeat(1, 1, 1, 4), None, 0) is None  # v wider
    assert native.attention(q[:, :, 1:], k, v, None, 0) is None  # q0 + Tq != Tk


HAS_AVX512 = os.path.exists("/proc/cpuinfo") and "avx512f" in open("/proc/cpuinfo").read()


# -O1: which code a variant runs is chosen by -march (the preprocessor's __AVX2__, __AVX512F__),
# not by how hard the compiler optimizes; at -O3 each variant takes about 30 s to compile on 2
# cores, at -O1 about 5. The -O3 build of this CPU is the one the tests above check.
@needs_attention_kernel
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(
            ["-O1", "-march=native", "-mno-avx512f", "-fopenmp"],
            id="avx2",
            marks=pytest.mark.skipif(not HAS_AVX512, reason="the 4-row tiles are what this CPU builds anyway"),
        ),
        pytest.param(["-O1", "-fopenmp"], id="generic"),  # no -march: scalar transposes and gathers
    ],
)
def test_the_four_row_tiles_of_avx2_cpus_match_the_definition_too(monkeypatch, flags):
    """Built without AVX-512 (as on most laptops: R = 4 rows a tile, AVX2 gathers and 8 x 8
    transposes), or for no particular CPU (the plain C loops those replace), attention with a
    bias, with XL's relative term, and CoPE give what the native build checked above gives:
    the fp64 definitions within 1e-5. Each variant goes to the kernel cache, keyed by its
    source, headers, flags and compiler, so it is compiled once on a machine, not once a run."""
    monkeypatch.setattr(native, "FLAG_SETS", (flags,))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    B, H, Tq, Tk, D = 2, 3, 21, 37, 24  # a query block whose rows are not a multiple of 4
    q, k, v = qkv_views(B, H, Tq, Tk, D)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(1, H, Tq, Tk, generator=g).requires_grad_()
    qr = torch.randn(B, H, Tq, D, generator=g).requires_grad_()
    rk = torch.randn(H, Tk, D, generator=g).requires_grad_()
    steep = 400 * bias.detach()  # scores in the hundreds: exp overflows unless each row's max is right
    got = native.attention(q, k, v, steep, Tk - Tq)  # within fp32's rounding of such scores
    assert torch.allclose(got.double(), plain_attention(q, k, v, steep, Tk - Tq), atol=1e-4)
    checks = [
        (
            lambda: native.attention(q, k, v, bias, Tk - Tq),
            lambda: plain_attention(q, k, v, bias, Tk - Tq),
            (q, k, v, bias),
        ),
        (
            lambda: native.relative_attention(q, k, v, qr, rk),
            lambda: plain_relative_attention(q, k, v, qr, rk),
            (q, k, v, qr, rk),
        ),
    ]
    for fast, slow, leaves in checks:
        got, want = fast(), slow()
        assert got is not None
        got = [got, *torch.autograd.grad(got.sum(), leaves)]
        want = [want, *torch.autograd.grad(want.sum(), leaves)]
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert native.load("cope") is not None, native.unavailable
    cq, ck, cv, table = inputs(2, 3, 9, 30, 8, 16, scale=1.5)
    kpos = torch.arange(30)
    d_out = torch.randn(2, 3, 9, 8, generator=g)
    got, want = both(cq, ck, cv, table, kpos[21:], kpos, d_out)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


@needs_kernel
def test_a_first_build_is_said_before_the_compiler_runs(monkeypatch, tmp_path):
    """The kernels' first build takes seconds: `building` hears of it with the cache folder;
    a cached build is loaded without a word."""
    monkeypatch.delenv("POSBENCH_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "FLAG_SETS", QUICK_BUILD)
    heard = []
    assert native.load("attention", heard.append) is not None
    assert len(heard) == 1 and heard[0].parent == tmp_path / "native" and any(heard[0].glob("*.so"))  # then built
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("attention", heard.append) is not None and len(heard) == 1


def test_a_schemes_own_kernels_are_posbench_native_ones():
    """`kernels` names the C kernels a scheme calls beside attention's, built before workers
    start: each is a posbench/native source, and CoPE, which calls native.cope_attention, names
    its own."""
    from pathlib import Path

    from posbench.schemes import SCHEMES

    sources = {p.stem for p in Path(native.__file__).parent.glob("*.c")}
    named = {name: SCHEMES.lookup(name).kernels for name in SCHEMES}
    assert all(set(k) <= sources for k in named.values()), named
    assert named["cope"] == ("cope",) and {n for n, k in named.items() if k} == {"cope"}
