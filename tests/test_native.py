"""The optional C kernel (posbench/native/cope.c) against its PyTorch twin, and its fallbacks."""

import shutil

import pytest
import torch

from posbench import check, native
from posbench.attention import BiasedAttention
from posbench.model import TransformerLM
from posbench.schemes import SCHEMES, CoPEBias

from conftest import tiny

needs_kernel = pytest.mark.skipif(
    native.load("cope") is None, reason=f"no CoPE kernel here: {native.unavailable.get('cope')}"
)


def pytorch_cope_attention(q, k, v, table, qpos, kpos):
    """The PyTorch twin: CoPE's bias (CoPEBias) through the generic grad-bias attention."""
    keep = (kpos[None, :] <= qpos[:, None]).to(q.dtype)
    mask = torch.zeros_like(keep).masked_fill_(keep == 0, float("-inf"))
    return BiasedAttention.apply(q, k, v, CoPEBias.apply(q, k, table, keep), mask)


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
def test_kernel_is_exact_at_hand_worked_point():
    """One head, one dim: gates sigmoid(q.k), positions summed from the key to the query, the
    table read between floor and ceil, then softmax; computed here in plain Python."""
    import math

    qv, ks, vs, e = 2.0, [0.3, -0.4, 1.0], [1.0, -2.0, 0.5], [0.0, 0.7, -0.2, 0.4]
    q = torch.tensor([[[[qv]]]])  # query 2 of 3, sees all keys
    k = torch.tensor(ks).view(1, 1, 3, 1)
    v = torch.tensor(vs).view(1, 1, 3, 1)
    table = torch.tensor([e])  # (D=1, P=4)
    out = native.cope_attention(q, k, v, table, torch.tensor([2]), torch.arange(3))
    logits = [qv * kj for kj in ks]  # head dim 1: no scaling
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
def test_kernel_gives_the_same_bits_on_one_thread_and_two():
    q, k, v, table = inputs(2, 4, 40, 40, 8, 16)
    pos = torch.arange(40)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
        out = native.cope_attention(*leaves, pos, pos)
        out.sum().backward()
        outs.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@needs_kernel
def test_the_model_takes_the_kernel_and_it_trains(monkeypatch):
    calls = []
    real = native.CoPEAttention.apply
    monkeypatch.setattr(native.CoPEAttention, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    m = TransformerLM(tiny("cope"))
    x = torch.randint(0, 256, (2, 17))
    loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert len(calls) == m.cfg.n_layer
    assert "attend agrees with the bias path" in check.attend_agrees(check.tiny_model("cope").train(), 40)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_off_switch_and_other_dtypes_take_the_pytorch_path(monkeypatch):
    q, k, v, table = inputs(1, 2, 5, 5, 4, 8)
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
    # the model then runs CoPE through its PyTorch twin
    twin, kernel = [], []
    real_twin, real_kernel = CoPEBias.apply, native.CoPEAttention.apply
    monkeypatch.setattr(CoPEBias, "apply", lambda *a: twin.append(1) or real_twin(*a))
    monkeypatch.setattr(native.CoPEAttention, "apply", lambda *a: kernel.append(1) or real_kernel(*a))
    m = TransformerLM(tiny("cope"))
    m(torch.randint(0, 256, (2, 16))).sum().backward()
    assert len(twin) == m.cfg.n_layer and not kernel
    # and check-scheme says that its attend check compared the bias path with itself
    assert "attend declined every call here" in check.attend_agrees(check.tiny_model("cope").train(), 16)


def test_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
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
    assert native.load("cope") is not None, native.unavailable


def test_autocast_and_second_derivatives_are_refused_not_corrupted():
    q, k, v, table = inputs(2, 4, 20, 20, 8, 8)
    pos = torch.arange(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert native.cope_attention(q, k, v, table, pos, pos) is None
        with pytest.raises(RuntimeError, match="fp32 CPU tensors outside autocast"):
            native.CoPEAttention.apply(q, k, v, table, torch.full((20,), 20, dtype=torch.int32))
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
def test_extrapolate_says_when_cope_trains_without_its_kernel(monkeypatch, tmp_path, switch):
    from conftest import smoke_experiment

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_NATIVE", switch)
    exp, res, _ = smoke_experiment(tmp_path, "--schemes", "cope,alibi")
    assert ("note: cope trains on its PyTorch path" in res.output) == (native.load("cope") is None)
    if switch == "off":
        assert "turned off by POSBENCH_NATIVE=off" in res.output
    assert (exp / "summary.csv").is_file()
