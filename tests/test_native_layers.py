"""The C kernel layers.c (GELU, LayerNorm, cross-entropy) against the torch ops it stands in for."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench import bench, native
from posbench.model import TransformerLM
from posbench.native import layers
from posbench.native.layers import (
    GELU,
    MLP,
    CrossEntropyFunction,
    GELUFunction,
    LayerNorm,
    LayerNormFunction,
    MLPFunction,
    RopeFunction,
    rope,
    rotate_half,
)

from conftest import smoke_experiment, tiny

needs_kernel = pytest.mark.skipif(
    native.load("layers") is None, reason=f"no layers kernel here: {native.unavailable.get('layers')}"
)


def close(got, want, tol=1e-5):
    """Within tol of want, relative to want's largest value where that exceeds 1 (a gradient
    summed over many rows is large, and torch's own sum is no closer than that)."""
    return (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def grads(fn, *inputs, upstream=None):
    """fn(*inputs) and the gradient of every input (and of fn's parameters, if it is a module)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    for p in params:
        p.grad = None
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) if upstream is None else upstream)
    return [out.detach()] + [t.grad for t in leaves] + [p.grad.clone() for p in params]


def counting(monkeypatch, fn_class):
    calls = []
    real = fn_class.apply
    monkeypatch.setattr(fn_class, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


SHAPES = [(1, 13), (7,), (5, 16), (3, 33, 40), (400, 129)]  # a single row; sizes off multiples of 8 and 16


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_matches_torch(monkeypatch, shape):
    calls = counting(monkeypatch, GELUFunction)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4  # tails to |x| ~ 16
    got, want = grads(GELU(), x), grads(nn.GELU(), x)
    assert calls, "the kernel did not run"
    for name, a, b in zip(["y", "dx"], got, want):
        assert close(a, b), (name, (a - b).abs().max().item())


def torch_mlp(mlp: MLP) -> nn.Sequential:
    """The same weights in torch's own Linear, GELU, Linear."""
    plain = nn.Sequential(nn.Linear(mlp[0].in_features, mlp[0].out_features), nn.GELU(),
                          nn.Linear(mlp[2].in_features, mlp[2].out_features))  # fmt: skip
    plain.load_state_dict(mlp.state_dict())  # strict: the same keys
    return plain.to(mlp[0].weight.dtype)


@needs_kernel
@pytest.mark.parametrize("residual", [False, True])  # mlp(...), and x + mlp(...) with the add fused in
@pytest.mark.parametrize("norm", [False, True])  # mlp(x), and mlp(x, ln) with the LayerNorm fused in
@pytest.mark.parametrize(
    "shape,hidden",  # rows off the 64-row chunks of the bias's sum; hidden off multiples of 8 and 16
    [((2, 50, 32), 128), ((1, 1, 8), 20), ((3, 70, 24), 100), ((130, 16), 72)],
)
def test_mlp_matches_torch_in_values_and_every_gradient(monkeypatch, shape, hidden, norm, residual):
    calls = counting(monkeypatch, MLPFunction)
    torch.manual_seed(0)
    mlp = MLP(shape[-1], hidden)
    nn.init.normal_(mlp[0].bias)  # nonzero biases: the C adds fc1's inside the GELU
    nn.init.normal_(mlp[2].bias)
    ln = nn.LayerNorm(shape[-1])
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2 + 0.5
    plain = torch_mlp(mlp)
    fused, ref = _Fused(mlp, ln if norm else None, residual), nn.Sequential(ln, plain) if norm else plain
    got, want = grads(fused, x), grads(_Residual(ref) if residual else ref, x)
    assert calls, "the kernel did not run"
    with torch.no_grad():  # evaluation: no autograd node, the same bits
        assert torch.equal(fused(x), got[0])
    names = ["y", "dx"] + (["d ln.w", "d ln.b"] if norm else []) + ["dw1", "db1", "dw2", "db2"]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and close(a, b), (name, (a - b).abs().max().item())


class _Fused(nn.Module):
    """mlp(x, ln, residual), with ln's parameters listed before mlp's, as nn.Sequential(ln, mlp)
    lists them."""

    def __init__(self, mlp, ln, residual=False):
        super().__init__()
        self.ln, self.mlp, self.residual = ln, mlp, residual

    def forward(self, x):
        return self.mlp(x, self.ln, residual=self.residual)


class _Residual(nn.Module):
    """x + inner(x)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


def head_major(B, T, H, D, seed=0):
    """A (B, H, T, D) view of (B, T, 3 H D) memory, as the model's q and k are."""
    qkv = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(seed))
    return qkv[..., H * D : 2 * H * D].view(B, T, H, D).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("B,T,H,D", [(2, 7, 3, 10), (1, 1, 1, 2), (3, 33, 4, 32)])  # halves of 5, 1, 16
def test_rope_matches_its_formula_in_fp64(monkeypatch, B, T, H, D):
    """x * cos + rotate_half(x) * sin, and its gradient, within 1e-6 of float64 autograd; tables
    of any values (xPos scales them, YaRN too), not only cosines and sines."""
    calls = counting(monkeypatch, RopeFunction)
    g = torch.Generator().manual_seed(1)
    cos, sin, d_out = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    x = head_major(B, T, H, D).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    want = x64 * cos.double() + rotate_half(x64) * sin.double()
    want.backward(d_out.double())
    got = rope(x, cos, sin)
    got.backward(d_out)
    assert calls, "the kernel did not run"
    assert (got.double() - want).abs().max().item() < 1e-6
    assert (x.grad.double() - x64.grad).abs().max().item() < 1e-6


@needs_kernel
def test_rope_at_a_hand_worked_point():
    """Position 1, angle 0.5, one pair (x1, x2) = (1, 2): (cos - 2 sin, 2 cos + sin)."""
    import math

    x = torch.zeros(1, 1, 2, 2)
    x[0, 0, 1] = torch.tensor([1.0, 2.0])
    cos = torch.tensor([[1.0, 1.0], [math.cos(0.5)] * 2])
    sin = torch.tensor([[0.0, 0.0], [math.sin(0.5)] * 2])
    y = rope(x, cos, sin)
    c, s = math.cos(0.5), math.sin(0.5)
    assert y[0, 0, 1].tolist() == pytest.approx([c - 2 * s, 2 * c + s], abs=1e-6)
    assert y[0, 0, 0].tolist() == [0.0, 0.0]


@needs_kernel
def test_rope_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    calls = counting(monkeypatch, RopeFunction)
    x, cos, sin = head_major(2, 5, 2, 8), torch.randn(5, 8), torch.randn(5, 8)
    want = x * cos + rotate_half(x) * sin
    assert torch.equal(rope(x, cos, sin.requires_grad_()), want)  # a table that learns
    x64, cos64, sin64 = x.double(), cos.double(), sin.detach().double()
    assert torch.equal(rope(x64, cos64, sin64), x64 * cos64 + rotate_half(x64) * sin64)  # not fp32
    assert torch.equal(rope(x[..., :7], cos[:, :7], sin.detach()[:, :7]),
                       x[..., :7] * cos[:, :7] + rotate_half(x[..., :7]) * sin.detach()[:, :7])  # odd D
    assert not calls


@needs_kernel
@pytest.mark.parametrize("scheme", ["rope", "xpos"])
def test_rope_schemes_rotate_through_the_kernel(monkeypatch, scheme):
    calls = counting(monkeypatch, RopeFunction)
    torch.manual_seed(0)
    model = TransformerLM(tiny(scheme))
    model(torch.randint(0, 256, (2, 16))).square().mean().backward()
    assert len(calls) == 2 * model.cfg.n_layer  # q and k in every layer


@needs_kernel
def test_kernels_write_fp32_whatever_the_default_dtype(monkeypatch):
    """Buffers the C fills are made fp32 explicitly: with float64 as torch's default dtype, fp32
    inputs still give fp32 outputs with the right values (the C would write fp32 into float64)."""
    x, cos, sin = head_major(2, 5, 2, 8), torch.randn(5, 8), torch.randn(5, 8)
    want_rope = x * cos + rotate_half(x) * sin
    q, k, v = (head_major(2, 6, 2, 8, seed=i) for i in range(3))
    want_att = native.attention(q, k, v, None, 0)
    torch.set_default_dtype(torch.float64)
    try:
        got_rope = rope(x, cos, sin)
        got_att = native.attention(q, k, v, None, 0)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got_rope.dtype == got_att.dtype == torch.float32
    assert torch.allclose(got_rope, want_rope, atol=1e-6) and torch.equal(got_att, want_att)


@needs_kernel
def test_mlp_with_frozen_weights_returns_only_the_gradients_asked_for():
    torch.manual_seed(0)
    mlp, ln = MLP(16, 64), nn.LayerNorm(16)
    for p in mlp.parameters():
        p.requires_grad_(False)
    x = torch.randn(3, 10, 16, requires_grad=True)
    mlp(x, ln).square().sum().backward()
    assert all(p.grad is None for p in mlp.parameters())
    x64 = x.detach().double().requires_grad_()
    ln64, plain64 = nn.LayerNorm(16).double(), torch_mlp(mlp).double()
    ln64.load_state_dict(ln.state_dict())
    plain64(ln64(x64)).square().sum().backward()
    for got, want in ((x.grad, x64.grad), (ln.weight.grad, ln64.weight.grad), (ln.bias.grad, ln64.bias.grad)):
        assert close(got.double(), want)


@needs_kernel
def test_gelu_is_accurate_into_the_tails_and_never_subnormal():
    """Within 3e-7 of float64 (relative above 1) in values and slopes, as torch's own erf. Below
    0 the GELU is x times a tiny tail, which 0.5 (1 + erf) loses to cancellation (all of it by
    x = -6); the kernel takes the tail directly, so it stays within 1% there, gives exact zeros
    past |x| = 10, and never a subnormal (a product with one is ~100x slower on x86)."""
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])]).double()
    (y, dx) = grads(GELU(), x.float(), upstream=torch.ones(x.shape))
    (ref, dref) = grads(nn.GELU(), x, upstream=torch.ones(x.shape, dtype=torch.float64))
    for got, want in ((y, ref), (dx, dref)):
        assert ((got.double() - want).abs() / want.abs().clamp(min=1)).max() < 3e-7
    tail = (x < -1) & (x > -6)
    assert ((y.double()[tail] - ref[tail]).abs() / ref[tail].abs()).max() < 1e-2
    tiny = torch.finfo(torch.float32).tiny
    for t in (y, dx):
        assert not ((t != 0) & (t.abs() < tiny)).any()
    assert (y[x < -10] == 0).all() and (dx[x < -10] == 0).all()


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[2:] + [(1600, 128)])
@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_layernorm_matches_torch(monkeypatch, shape, offset):
    calls = counting(monkeypatch, LayerNormFunction)
    C = shape[-1]
    ours, ref = LayerNorm(C), nn.LayerNorm(C)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(C, generator=g))
        ours.bias.copy_(torch.randn(C, generator=g))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(shape, generator=g) * 2 + offset
    got, want = grads(ours, x), grads(ref, x)
    assert calls, "the kernel did not run"
    for name, a, b in zip(["y", "dx", "dweight", "dbias"], got, want):
        assert close(a, b), (name, (a - b).abs().max().item())


@needs_kernel
@pytest.mark.parametrize("N,V", [(1, 7), (5, 300), (33, 17), (1600, 256)])
def test_cross_entropy_matches_torch(monkeypatch, N, V):
    calls = counting(monkeypatch, CrossEntropyFunction)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, generator=g) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    targets[1::4] = -100  # ignore_index rows leave the mean
    scale = torch.tensor(2.5)  # the loss scaled: the backward multiplies its saved gradient
    got = grads(lambda z: layers.cross_entropy(z, targets), logits, upstream=scale)
    want = grads(lambda z: F.cross_entropy(z, targets), logits, upstream=scale)
    assert calls, "the kernel did not run"
    for name, a, b in zip(["loss", "dlogits"], got, want):
        assert close(a, b), (name, (a - b).abs().max().item())


@needs_kernel
def test_cross_entropy_gradient_at_unit_upstream_survives_reuse():
    """loss.backward() hands back the saved gradient itself: it must equal torch's, and stay
    so through a second backward of the same graph and an accumulation into the same leaf."""
    g = torch.Generator().manual_seed(4)
    z = (torch.randn(40, 9, generator=g) * 2).requires_grad_()
    targets = torch.randint(0, 9, (40,), generator=g)
    loss = layers.cross_entropy(z, targets)
    loss.backward(retain_graph=True)
    first = z.grad.clone()
    (want,) = torch.autograd.grad(F.cross_entropy(z, targets), z)
    assert close(first, want)
    loss.backward(retain_graph=True)  # accumulates: twice the gradient; the saved one untouched
    assert close(z.grad, 2 * want)
    loss.backward(torch.tensor(-0.5))
    assert close(z.grad, 1.5 * want)


@needs_kernel
def test_cross_entropy_edge_cases_are_torchs():
    z = torch.randn(3, 5)
    for t in (torch.tensor([0, 1, 5]), torch.tensor([0, -5, 1])):
        with pytest.raises(IndexError, match=f"Target {t[t.ne(-100) & (t.lt(0) | t.ge(5))][0]} is out of bounds"):
            layers.cross_entropy(z, t)
    every_row_ignored = torch.full((3,), -100)
    (loss, dz) = grads(lambda z: layers.cross_entropy(z, every_row_ignored), z, upstream=torch.tensor(1.0))
    assert loss.isnan() and (dz == 0).all()  # as F.cross_entropy: 0/0, and no gradient


@needs_kernel
def test_the_kernels_give_the_same_bits_on_one_thread_and_two():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, 96, generator=g)  # 1000 rows: LayerNorm's chunks of rows split unevenly
    targets = torch.randint(0, 96, (1000,), generator=g)
    ln = LayerNorm(96)
    cos, sin = torch.randn(50, 12, generator=g), torch.randn(50, 12, generator=g)  # RoPE's tables
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        mlp = MLP(96, 200)
        nn.init.normal_(mlp[0].bias)
        y, dx, _, db1, _, db2 = grads(mlp, x)  # the weights' gradients are MKL's sums over rows,
        # split by thread count, in the MLP as in torch's own nn.Linear: not the kernel's to fix
        ny, ndx, dlw, dlb, _, ndb1, _, ndb2 = grads(_Fused(mlp, LayerNorm(96)), x)  # the LayerNorm fused in
        rot = grads(lambda z: rope(z.view(4, 50, 5, 12).transpose(1, 2), cos, sin), x[:200, :60].reshape(4, 50, 60))
        # the attention's fused sides: output, x's gradient, the LayerNorm's and the proj bias's
        sides = grads(_AttentionSides(96, 4, True, "head-major"), x.view(10, 100, 96))
        runs.append(grads(GELU(), x) + grads(ln, x) + grads(lambda z: layers.cross_entropy(z, targets), x)
                    + [y, dx, db1, db2, ny, ndx, dlw, dlb, ndb1, ndb2] + rot
                    + [sides[i] for i in (0, 1, 2, 3, 7)])  # fmt: skip
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_off_switch_and_other_dtypes_take_the_torch_path(monkeypatch):
    gelu, ce, ln, mlp = (counting(monkeypatch, f) for f in (GELUFunction, CrossEntropyFunction, LayerNormFunction,
                                                            MLPFunction))  # fmt: skip
    x = torch.randn(6, 8)
    t = torch.randint(0, 8, (6,))
    xb = x.bfloat16()
    assert torch.equal(GELU()(xb), nn.GELU()(xb))
    fused = MLP(8, 32).bfloat16()
    assert torch.equal(fused(xb), torch_mlp(fused)(xb))
    assert torch.equal(LayerNorm(8).bfloat16()(xb), nn.LayerNorm(8).bfloat16()(xb))
    assert torch.equal(layers.cross_entropy(xb, t), F.cross_entropy(xb, t))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        GELU()(x), LayerNorm(8)(x), layers.cross_entropy(x, t), MLP(8, 32)(x)
    # what the kernel does not cover: the tanh GELU, a LayerNorm without weight or bias or over
    # two dims, targets that are not int64 or logits that are not (N, V)
    assert torch.equal(GELU(approximate="tanh")(x), nn.GELU(approximate="tanh")(x))
    fused, norm = MLP(8, 32).bfloat16(), nn.LayerNorm(8).bfloat16()
    assert torch.equal(fused(xb, norm), torch_mlp(fused)(norm(xb)))
    tanh = MLP(8, 32)
    tanh[1].approximate = "tanh"
    plain = torch_mlp(tanh)
    plain[1].approximate = "tanh"
    assert torch.equal(tanh(x), plain(x))
    for kw in ({"elementwise_affine": False}, {"bias": False}):
        assert torch.equal(LayerNorm(8, **kw)(x), nn.LayerNorm(8, **kw)(x))
    assert torch.equal(LayerNorm((6, 8))(x), nn.LayerNorm((6, 8))(x))
    assert torch.equal(layers.cross_entropy(x, t.to(torch.uint8)), F.cross_entropy(x, t.to(torch.uint8)))
    x3, t3 = torch.randn(2, 8, 3), torch.randint(0, 8, (2, 3))
    assert torch.equal(layers.cross_entropy(x3, t3), F.cross_entropy(x3, t3))
    assert not gelu and not ce and not ln and not mlp
    for switch in ("off", "0"):
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setattr(native, "unavailable", {})
        monkeypatch.setenv("POSBENCH_NATIVE", switch)
        assert native.load("layers") is None
        assert f"POSBENCH_NATIVE={switch}" in native.unavailable["layers"]
        assert torch.equal(GELU()(x), nn.GELU()(x))
        assert torch.equal(LayerNorm(8)(x), nn.LayerNorm(8)(x))
        assert torch.equal(layers.cross_entropy(x, t), F.cross_entropy(x, t))
        fused, norm = MLP(8, 32), nn.LayerNorm(8)
        assert torch.equal(fused(x), torch_mlp(fused)(x))
        assert torch.equal(fused(x, norm), torch_mlp(fused)(norm(x)))
    assert not gelu and not ce and not ln and not mlp
    with pytest.raises(RuntimeError, match="layers kernel is unavailable: turned off"):
        GELUFunction.apply(x)


@needs_kernel
def test_mlp_runs_a_norm_the_kernel_does_not_cover_apart(monkeypatch):
    """A LayerNorm without bias, or another norm: applied by torch, then the fused MLP."""
    calls = []
    real = layers._mlp_forward
    monkeypatch.setattr(layers, "_mlp_forward", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    x = torch.randn(6, 8)
    for norm in (nn.LayerNorm(8, bias=False), nn.RMSNorm(8)):
        fused = MLP(8, 32)
        with torch.no_grad():
            assert torch.equal(fused(x, norm), fused(norm(x)))
            assert torch.equal(fused(x, norm, residual=True), x + fused(norm(x)))  # x, not norm(x)
    assert calls == [None] * 8  # all eight through the kernel, none with a LayerNorm inside


@needs_kernel
def test_mlp_in_evaluation_gives_the_training_path_s_bits_and_keeps_nothing(monkeypatch):
    """Without gradients the MLP is no autograd node and lets each buffer go once used: the
    same output bits, and the peak memory of torch's modules, not two (rows, C) tensors more."""
    from posbench.bench import eval_peak_memory_mb

    torch.manual_seed(0)
    mlp, ln = MLP(32, 128), nn.LayerNorm(32)
    x = torch.randn(4, 50, 32)
    with_grad = mlp(x, ln)
    assert with_grad.grad_fn is not None and with_grad.grad_fn.name() == "MLPFunctionBackward"
    with torch.no_grad():
        without = mlp(x, ln)
    assert without.grad_fn is None and torch.equal(with_grad.detach(), without)
    # with the residual: at most the hidden layer's product and the GELU's output at once, and
    # the LayerNorm's row statistics (its output goes before the GELU's comes, x + b2 after the
    # product goes)
    rows, hidden = x.numel() // 32, 128
    with torch.no_grad():
        assert close(mlp(x, ln, residual=True), with_grad.detach() + x)
        assert bench.peak_tensor_bytes(lambda: mlp(x, ln, residual=True)) <= (2 * hidden + 2) * rows * 4

    model = TransformerLM(tiny("nope")).eval()
    fused = eval_peak_memory_mb(model, 300)
    def torch_forward(self, z, norm, residual=False):
        out = torch_mlp(self)(norm(z))
        return z + out if residual else out

    monkeypatch.setattr(MLP, "forward", torch_forward)
    assert fused <= eval_peak_memory_mb(model, 300) * 1.001


@needs_kernel
def test_second_derivatives_are_refused_not_wrong():
    x = torch.randn(4, 8, requires_grad=True)
    for fn in (GELU(), LayerNorm(8), lambda z: layers.cross_entropy(z, torch.arange(4)), MLP(8, 16)):
        y = fn(x)
        (g,) = torch.autograd.grad(y, x, torch.ones_like(y, requires_grad=True), create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()


@needs_kernel
def test_the_model_runs_its_mlps_through_the_kernel_and_keeps_torchs_state_dict(monkeypatch):
    calls = counting(monkeypatch, MLPFunction)
    torch.manual_seed(0)
    model = TransformerLM(tiny("nope"))
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert len(calls) == model.cfg.n_layer
    # the same weights in a model built with torch's own modules: same keys, same logits
    class PlainMLP(nn.Sequential):  # torch's modules, and its LayerNorm apart
        def forward(self, x, norm, residual=False):
            return x + super().forward(norm(x)) if residual else super().forward(norm(x))

    monkeypatch.setattr("posbench.model.MLP", lambda c, h: PlainMLP(nn.Linear(c, h), nn.GELU(), nn.Linear(h, c)))
    plain = TransformerLM(tiny("nope"))
    assert not any(isinstance(m, (MLP, GELU)) for m in plain.modules())
    plain.load_state_dict(model.state_dict())  # strict: every key the same
    assert close(plain(tokens), logits)
    # and LayerNorm, which the model leaves to torch (see layers.py), loads torch's weights
    ln = LayerNorm(32)
    ln.load_state_dict(nn.LayerNorm(32).state_dict())
    assert list(ln.state_dict()) == ["weight", "bias"]


@needs_kernel
def test_training_and_the_bench_step_take_the_fused_loss(monkeypatch, tmp_path):
    calls = counting(monkeypatch, CrossEntropyFunction)
    torch.manual_seed(0)
    step = bench._train_step_fn(TransformerLM(tiny("nope")), 2, 16)
    step()
    assert len(calls) == 1
    smoke_experiment(tmp_path, "--schemes", "nope", "--set", "train.steps=3", "--set", "train.workers=1")
    assert len(calls) == 1 + 3  # run.py's training loss, once per step (evaluation sums with torch)


class _AttentionSides(nn.Module):
    """x + proj(f(qkv(ln(x)))) for a fixed f from the (B, T, 3 H D) projection to a (B, H, T, D)
    output: through norm_linear and linear_add (`fused`), or torch's modules. `layout`: f's
    output as attention.c writes it (a view of (B, T, H, D) memory) or contiguous (B, H, T, D)."""

    def __init__(self, C, H, fused, layout):
        super().__init__()
        torch.manual_seed(0)
        self.ln, self.qkv, self.proj = nn.LayerNorm(C), nn.Linear(C, 3 * C), nn.Linear(C, C)
        for p in (self.ln.weight, self.ln.bias, self.qkv.bias, self.proj.bias):
            nn.init.normal_(p)  # nonzero: a bias in the wrong place shows
        self.H, self.fused, self.layout = H, fused, layout

    def f(self, qkv):
        q, k, v = native.qkv_views(qkv, self.H)
        y = q * k.sigmoid() + v  # (B, H, T, D), as views: the memory of (B, T, H, D)
        return y if self.layout == "head-major" else y.contiguous()

    def forward(self, x):
        if not self.fused:
            B, T, C = x.shape
            return x + self.proj(self.f(self.qkv(self.ln(x))).transpose(1, 2).reshape(B, T, C))
        qkv, res = layers.norm_linear(x, self.ln, self.qkv, self.proj.bias)
        return layers.linear_add(self.f(qkv), self.proj, x, res)


@needs_kernel
@pytest.mark.parametrize("layout", ["head-major", "contiguous"])
@pytest.mark.parametrize("B,T,H,D", [(2, 50, 4, 8), (1, 1, 2, 8), (3, 37, 3, 16), (1, 130, 1, 24)])
def test_the_attention_s_fused_sides_match_torch_in_values_and_every_gradient(monkeypatch, B, T, H, D, layout):
    """norm_linear + linear_add against x + proj(f(qkv(ln(x)))): the output and the gradients of
    x and of all six parameters (the residual's gradient goes through the LayerNorm's backward,
    and its sum over rows is the proj bias's); without gradients, the training path's bits."""
    ins, outs = counting(monkeypatch, layers.NormLinearFunction), counting(monkeypatch, layers.LinearAddFunction)
    x = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(0)) * 2 + 0.5
    fused, ref = _AttentionSides(H * D, H, True, layout), _AttentionSides(H * D, H, False, layout)
    got, want = grads(fused, x), grads(ref, x)
    assert len(ins) == len(outs) == 1
    names = ["y", "dx", "d ln.w", "d ln.b", "d qkv.w", "d qkv.b", "d proj.w", "d proj.b"]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and close(a, b), (name, (a - b).abs().max().item())
    with torch.no_grad():
        assert torch.equal(fused(x), got[0])
    assert len(ins) == len(outs) == 1  # no autograd node without gradients


@needs_kernel
def test_the_fused_sides_fall_back_to_torch_where_the_kernel_does_not_apply(monkeypatch):
    ins, outs = counting(monkeypatch, layers.NormLinearFunction), counting(monkeypatch, layers.LinearAddFunction)
    x = torch.randn(2, 9, 16)
    fused, ref = _AttentionSides(16, 2, True, "head-major"), _AttentionSides(16, 2, False, "head-major")
    for norm in (nn.LayerNorm(16, bias=False), nn.RMSNorm(16)):  # norms the C does not cover
        fused.ln = ref.ln = norm
        assert torch.equal(fused(x), ref(x))
    fused.ln = ref.ln = nn.LayerNorm(16)
    assert torch.equal(fused.bfloat16()(x.bfloat16()), ref.bfloat16()(x.bfloat16()))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("POSBENCH_NATIVE", "0")
    fused, ref = fused.float(), ref.float()
    assert torch.equal(fused(x), ref(x))
    assert not ins and not outs


@needs_kernel
def test_the_model_runs_its_attention_sides_through_the_kernel(monkeypatch):
    """Once per layer each, the same logits and gradients as the blocks written with torch's
    modules, and with dropout in training the LayerNorm and residual apart, as before."""
    from posbench.model import Block

    ins, outs = counting(monkeypatch, layers.NormLinearFunction), counting(monkeypatch, layers.LinearAddFunction)
    torch.manual_seed(0)
    model = TransformerLM(tiny("nope"))
    for blk in model.blocks:  # nonzero biases: one added twice, or not at all, shows
        for p in (blk.ln1.bias, blk.attn.qkv.bias, blk.attn.proj.bias):
            nn.init.normal_(p)
    tokens = torch.randint(0, 256, (2, 16))
    upstream = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad()
        logits = model(tokens)
        logits.backward(upstream)
        return [logits.detach()] + [p.grad.clone() for p in model.parameters()]

    got = run()
    assert len(ins) == len(outs) == model.cfg.n_layer

    def plain_forward(self, x, pos, block):
        x = x + self.attn(self.ln1(x), pos, block)
        return x + self.mlp(x, self.ln2)

    monkeypatch.setattr(Block, "forward", plain_forward)
    want = run()
    assert len(ins) == len(outs) == model.cfg.n_layer  # the plain blocks took neither
    for (name, _), a, b in zip([("logits", None), *model.named_parameters()], got, want):
        assert close(a, b), (name, (a - b).abs().max().item())

    monkeypatch.undo()
    ins, outs = counting(monkeypatch, layers.NormLinearFunction), counting(monkeypatch, layers.LinearAddFunction)
    TransformerLM(tiny("nope", dropout=0.1)).train()(tokens).sum().backward()
    assert not ins and not outs


@needs_kernel
def test_the_fused_attention_sides_keep_evaluation_memory(monkeypatch):
    from posbench.bench import eval_peak_memory_mb
    from posbench.model import Block

    model = TransformerLM(tiny("nope")).eval()
    fused = eval_peak_memory_mb(model, 300)

    def plain_forward(self, x, pos, block):
        x = x + self.attn(self.ln1(x), pos, block)
        return self.mlp(x, self.ln2, residual=True)

    monkeypatch.setattr(Block, "forward", plain_forward)
    assert fused <= eval_peak_memory_mb(model, 300) * 1.001


@needs_kernel
def test_weights_whose_gradient_comes_transposed_are_stored_so_and_train_to_the_same_bits():
    """fc1's and qkv's (out > in) weights are stored as their gradients come from _weight_grad,
    so autograd keeps each gradient as it is (a contiguous weight would get a copy). The values
    and the training are a contiguous model's, bit for bit; the state_dict loads either way."""
    torch.manual_seed(0)
    model = TransformerLM(tiny("nope"))
    torch.manual_seed(0)
    plain = TransformerLM(tiny("nope"))
    for p in plain.parameters():
        p.data = p.data.contiguous()
    transposed = {n for n, p in model.named_parameters() if not p.is_contiguous()}
    layers_ = range(model.cfg.n_layer)
    assert transposed == {f"blocks.{i}.{w}.weight" for i in layers_ for w in ("mlp.0", "attn.qkv")}
    steps = [bench._train_step_fn(m, 2, 16) for m in (model, plain)]
    for _ in range(3):
        for step in steps:
            step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
        assert p.grad.stride() == p.stride(), name  # autograd kept the gradient as it came
    again = TransformerLM(tiny("nope"))
    again.load_state_dict(plain.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), model.parameters()))
    # with dropout, qkv's gradient comes from torch's Linear (contiguous): qkv stays contiguous
    dropped = TransformerLM(tiny("nope", dropout=0.1))
    assert {n for n, p in dropped.named_parameters() if not p.is_contiguous()} == {
        f"blocks.{i}.mlp.0.weight" for i in layers_
    }
