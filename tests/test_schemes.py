"""The science of each scheme: causality, relative invariances, reference slopes and buckets."""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny

import posbench.attention
import posbench.model
from posbench import check, native
from posbench.attention import causal_attention
from posbench.errors import PosbenchError
from posbench.schemes import SCHEMES, PositionalScheme, alibi_slopes, sinusoid, t5_relative_bucket

ALL = sorted(SCHEMES)
build = check.tiny_model  # a tiny model, its scheme's parameters perturbed so zero-init biases bite
supports = check.supports

# The registry-wide checks are the ones `posbench check-scheme` runs (posbench/check.py); each
# raises CheckFailed, an AssertionError, with its reason. tests/test_plugins.py shows that each
# of them fails on a scheme built to break it.


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("T", [16, 40])
def test_causality(scheme, T):
    """Changing token t changes no logit before t, in and beyond the training length, and in
    the blocked attention path (block 8 < T) as well as the whole-sequence one."""
    model = build(scheme)
    if not supports(model, T):
        pytest.skip(f"{scheme} does not encode length {T}")
    check.causality(model, T)


@pytest.mark.parametrize("scheme", ALL)
def test_forward_backward_at_train_len(scheme):
    model = build(scheme).train()
    loss = check.forward(model, 16)
    check.backward(model, loss)


@pytest.mark.parametrize("scheme", ALL)
def test_attend_hook_agrees_with_the_bias_path(scheme):
    """A scheme's own faster attention (CoPE's C kernel) equals the generic path with its bias."""
    model = build(scheme).train()
    check.attend_agrees(model, 40 if supports(model, 40) else 16)


@pytest.mark.parametrize("scheme", ALL)
def test_beyond_train_len(scheme):
    """Schemes that encode any length give finite logits at 4x; the others refuse clearly."""
    check.beyond_length(build(scheme), 64)


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("T", [24, 21])  # a multiple of the block and not
def test_blocked_attention_matches_whole(scheme, T):
    """Query-blocked attention equals one-shot attention, values and gradients."""
    model = build(scheme)
    if not supports(model, T):
        model = build(scheme, train_len=T)
    x = torch.randint(0, 256, (2, T))
    outs, grads = [], []
    for block in (None, 8):
        model.zero_grad()
        model.attn_block = block or 10_000
        y = check.restarted(model)(x)  # the same positions both times, for a scheme that draws them
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_rope_scores_depend_only_on_distance():
    """q_m.k_n after rotation is a function of m-n: equal along every diagonal."""
    scheme = SCHEMES["rope"](tiny("rope"))
    T, D = 48, 8
    q = torch.randn(1, 1, 1, D).expand(1, 1, T, D)  # the same q and k at every position
    k = torch.randn(1, 1, 1, D).expand(1, 1, T, D)
    qr, kr = scheme.rotate(q, k, torch.arange(T), 0)
    s = (qr @ kr.transpose(-1, -2))[0, 0]  # (T, T)
    for d in range(-T + 1, T):
        diag = torch.diagonal(s, offset=d)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-4), d
    assert s[10, 0] != pytest.approx(s[10, 9].item(), abs=1e-3)  # it does depend on distance


def test_rope_preserves_norms():
    scheme = SCHEMES["rope"](tiny("rope"))
    q, k = torch.randn(2, 4, 30, 8), torch.randn(2, 4, 30, 8)
    qr, kr = scheme.rotate(q, k, torch.arange(30), 0)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(qr[:, :, 0], q[:, :, 0])  # position 0 is the identity


def _unmasked(q, k, v, pos, scheme, layer, backend, block):
    b = scheme.bias(q, k, pos, pos, layer)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=b)


@pytest.mark.parametrize("scheme,equivariant", [("nope", True), ("sinusoidal", False), ("alibi", False)])
def test_permutation_equivariance_without_mask(monkeypatch, scheme, equivariant):
    """Without the causal mask NoPE cannot tell order: permuting tokens permutes the logits.
    Any real positional scheme breaks this, which shows the test can fail."""
    monkeypatch.setattr(posbench.model, "causal_attention", _unmasked)
    model = build(scheme)
    x = torch.randint(0, 256, (2, 16))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(x)[:, perm], model(x[:, perm])
    assert torch.allclose(a, b, atol=1e-5) == equivariant


def reference_alibi_slopes(n):
    """Verbatim from ofirpress/attention_with_linear_biases, fairseq/models/transformer.py."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + reference_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


# 1..16, and larger head counts: 20 (GPT-2 large), and 24 and 48, which take every other slope
# of 32 and 64 past their power of two
@pytest.mark.parametrize("n", [*range(1, 17), 20, 24, 32, 48, 64])
def test_alibi_slopes_match_reference(n):
    assert torch.allclose(alibi_slopes(n).double(), torch.tensor(reference_alibi_slopes(n)).double())


def test_alibi_slopes_six_heads_by_hand():
    assert alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]


def test_alibi_bias_is_minus_slope_times_distance():
    scheme = SCHEMES["alibi"](tiny("alibi"))
    b = scheme.bias(torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8), torch.arange(5), torch.arange(5), 0)[
        0
    ]  # (H, 5, 5)
    assert b[0, 4, 1].item() == pytest.approx(-(2**-2) * 3)  # head 1 of 4: m = 2^-2
    assert b[3, 2, 0].item() == pytest.approx(-(2**-8) * 2)
    assert torch.all(torch.diagonal(b, dim1=1, dim2=2) == 0)


# Worked by hand from T5's formula: distance n < 16 is its own bucket; otherwise
# 16 + floor(log(n/16) / log(128/16) * 16), capped at 31. n=20: 16+floor(1.717)=17;
# n=32: 16+floor(5.33)=21; n=64: 16+floor(10.67)=26; n=127: 16+floor(15.94)=31.
@pytest.mark.parametrize(
    "rel,bucket",
    [
        (0, 0),
        (-1, 1),
        (-15, 15),
        (-16, 16),
        (-20, 17),
        (-32, 21),
        (-64, 26),
        (-127, 31),
        (-128, 31),
        (-1000, 31),
        (3, 0),
        (50, 0),
    ],
)
def test_t5_buckets_unidirectional(rel, bucket):
    assert t5_relative_bucket(torch.tensor([rel])).item() == bucket


# bidirectional: 16 buckets a side, 8 exact; n=20: 8 + floor(log(20/8)/log(16)*8) = 8+2 = 10
@pytest.mark.parametrize("rel,bucket", [(-3, 3), (3, 19), (-20, 10), (20, 26), (0, 0)])
def test_t5_buckets_bidirectional(rel, bucket):
    assert t5_relative_bucket(torch.tensor([rel]), bidirectional=True).item() == bucket


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (8, 20), (64, 256), (10, 50), (33, 100)])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_are_transformers_at_every_setting(num_buckets, max_distance, bidirectional):
    """Every whole distance to 300 either way, against transformers' own T5 bucketing."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 301)
    want = t5.T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(t5_relative_bucket(rel, bidirectional, num_buckets, max_distance), want)


@pytest.mark.parametrize("scale,times", [("none", 1.0), ("sqrt_head_dim", 8**0.5)])  # head_dim 8
def test_t5_bias_reads_the_table_by_bucket(scale, times):
    scheme = SCHEMES["t5"](tiny("t5", options={"scale": scale}))
    with torch.no_grad():
        scheme.table.copy_(torch.arange(32 * 4, dtype=torch.float).view(32, 4))
    b = scheme.bias(torch.zeros(1, 4, 40, 8), torch.zeros(1, 4, 40, 8), torch.arange(40), torch.arange(40), 0)[0]
    assert b[2, 39, 19].item() == pytest.approx((17 * 4 + 2) * times)  # distance 20 -> bucket 17, head 2
    assert b[0, 5, 5].item() == 0


@pytest.mark.parametrize("name", ["t5", "hybrid"])
def test_t5_default_is_x_transformers_relative_position_bias(name):
    """The default T5 bias is the one x-transformers' Decoder builds (RelativePositionBias,
    scale dim_head ** 0.5, causal), value for value given the same table, whole (T, T) map
    included, at distances past max_distance too; and its table starts N(0, 1) as that
    nn.Embedding does. `scale: none` and `init: zeros` give the table as is, from zero."""
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    H, D, NB, far, T = 16, 4, 16, 40, 60
    cfg = tiny(name, n_head=H, d_model=H * D, options={"num_buckets": NB, "max_distance": far})
    scheme = SCHEMES[name](cfg)
    table = dict(scheme.named_parameters())["relative.table" if name == "hybrid" else "table"]  # (NB, H)
    assert 0.85 < table.std().item() < 1.15 and abs(table.mean().item()) < 0.15  # N(0, 1), 256 draws
    ref = xt.Decoder(
        dim=H * D,
        depth=1,
        heads=H,
        attn_dim_head=D,
        rel_pos_bias=True,
        rel_pos_num_buckets=NB,
        rel_pos_max_distance=far,
    ).rel_pos
    with torch.no_grad():
        ref.relative_attention_bias.weight.copy_(table)
        want = ref(T, T)  # (H, T, T): [h, i, j] is query i against key j
        pos = torch.arange(T)
        got = scheme.bias(torch.zeros(1, H, T, D), torch.zeros(1, H, T, D), pos, pos, 0)  # (1, H, T, T)
    assert got.shape == (1, H, T, T)
    assert (got[0] - want).abs().max().item() < 1e-6

    plain = SCHEMES[name](dataclasses.replace(cfg, options={**cfg.options, "scale": "none", "init": "zeros"}))
    plain_table = dict(plain.named_parameters())["relative.table" if name == "hybrid" else "table"]
    assert torch.all(plain_table == 0)
    with torch.no_grad():
        plain_table.copy_(table)
        got = plain.bias(torch.zeros(1, H, T, D), torch.zeros(1, H, T, D), pos, pos, 0)
    assert (got[0] * D**0.5 - want).abs().max().item() < 1e-6


def test_xl_score_matches_formula():
    """(q_i+u).k_j + (q_i+v).W_r r(i-j), over sqrt(d), from the hooks, against the formula."""
    torch.manual_seed(0)
    cfg = tiny("xl")
    scheme = SCHEMES["xl"](cfg)
    with torch.no_grad():
        for p in scheme.parameters():
            p.normal_()
    T, D = 6, cfg.head_dim
    q, k = torch.randn(1, 4, T, D), torch.randn(1, 4, T, D)
    pos = torch.arange(T)
    q2, k2 = scheme.rotate(q, k, pos, 1)
    got = (q2 @ k2.transpose(-1, -2)) / math.sqrt(D) + scheme.bias(q2, k2, pos, pos, 1)
    r = sinusoid(torch.arange(T), cfg.d_model)
    W = scheme.w_r[1].weight
    u, v = scheme.u[:, 0], scheme.v[:, 0]  # (H, D)
    for h in range(4):
        for i in range(T):
            for j in range(i + 1):
                rel = (W @ r[i - j]).view(4, D)[h]
                want = (q[0, h, i] + u[h]) @ k[0, h, j] + (q[0, h, i] + v[h]) @ rel
                assert got[0, h, i, j].item() == pytest.approx(want.item() / math.sqrt(D), abs=1e-4)


def test_xl_u_and_v_start_as_in_transformer_xl():
    """u, v start N(0, 0.02) as kimiyoung/transformer-xl's r_w_bias, r_r_bias (its weights_init,
    init_std 0.02), and so does W_r, through the model's init of every nn.Linear;
    `uv_init: zeros` starts u, v at zero."""
    torch.manual_seed(0)
    model = posbench.model.TransformerLM(tiny("xl", n_head=8, d_model=256))
    s = model.scheme
    uv = torch.cat([s.u.flatten(), s.v.flatten()])  # 512 draws
    assert s.u.shape == s.v.shape == (8, 1, 32) and not torch.equal(s.u, s.v)
    assert 0.016 < uv.std().item() < 0.024 and abs(uv.mean().item()) < 0.004
    w = torch.cat([m.weight.flatten() for m in s.w_r])
    assert 0.019 < w.std().item() < 0.021
    zeros = SCHEMES["xl"](tiny("xl", options={"uv_init": "zeros"}))
    assert torch.all(zeros.u == 0) and torch.all(zeros.v == 0)
    with pytest.raises(PosbenchError, match="uv_init='uniform': expected one of normal, zeros"):
        SCHEMES["xl"](tiny("xl", options={"uv_init": "uniform"}))


def test_sinusoid_formula():
    pe = sinusoid(torch.arange(5), 8)
    assert pe[3, 2].item() == pytest.approx(math.sin(3 / 10000 ** (2 / 8)))
    assert pe[3, 3].item() == pytest.approx(math.cos(3 / 10000 ** (2 / 8)))
    assert pe[4, 0].item() == pytest.approx(math.sin(4))


@pytest.mark.parametrize("rms", [0.02, 0.5])
def test_sinusoidal_adds_the_sinusoid_at_its_rms(rms):
    """Each position's added vector is the sinusoid, its root mean square over the width `rms`
    (sin^2 + cos^2 = 1 in every pair, so exactly, at every position)."""
    model = build("sinusoidal", options={"rms": rms} if rms != 0.02 else {})
    x, pos = torch.zeros(1, 50, model.cfg.d_model), torch.arange(50)
    added = model.scheme.embed(x, pos)[0]
    assert added.pow(2).mean(-1).sqrt() == pytest.approx(torch.full((50,), rms), rel=1e-5)
    pe = sinusoid(pos, model.cfg.d_model)
    assert torch.allclose(added / added[3, 2], pe / pe[3, 2])
    with pytest.raises(PosbenchError, match=r"scheme_options.sinusoidal.rms=0 must be positive"):
        build("sinusoidal", options={"rms": 0})


def test_learned_refuses_beyond_its_table_instead_of_clamping():
    model = build("learned", options={"max_len": 16})
    assert model.max_len == 16
    with pytest.raises(PosbenchError, match="at most 16 positions"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_function_matches_plain_softmax():
    """The one attention function is softmax(qk/sqrt(d) + bias + mask) v, blocked or not."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 8) for _ in range(3))
    bias = torch.randn(1, 3, 13, 13)
    pos = torch.arange(13)

    class Fixed(PositionalScheme):
        def __init__(self):
            nn.Module.__init__(self)

        def bias(self, qb, kb, qp, kp, layer):
            return bias[:, :, qp][:, :, :, kp]

    s = q @ k.transpose(-1, -2) / 8**0.5 + bias
    s = s.masked_fill(torch.ones(13, 13, dtype=torch.bool).triu(1), float("-inf"))
    want = s.softmax(-1) @ v
    backends = ["eager", "sdpa", "flex"] + (["native"] if native.why_not(8, torch.device("cpu")) is None else [])
    for backend in backends:
        for block in (None, 4, 13):
            got = causal_attention(q, k, v, pos, Fixed(), 0, backend, block)
            assert torch.allclose(got, want, atol=1e-5), (backend, block)


def test_xl_bias_of_a_query_block_equals_those_rows_of_the_whole_bias():
    """The shifted bias of queries 5..9 against keys 0..9 is rows 5..9 of the (10, 10) bias,
    everywhere a query can see (the shift leaves the future undefined; it is masked)."""
    torch.manual_seed(0)
    scheme = SCHEMES["xl"](tiny("xl"))
    with torch.no_grad():
        for p in scheme.parameters():
            p.normal_()
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    pos = torch.arange(10)
    whole = scheme.bias(q, k, pos, pos, 0)  # (2, 4, 10, 10)
    part = scheme.bias(q[:, :, 5:], k, pos[5:], pos, 0)  # (2, 4, 5, 10)
    past = ~torch.ones(10, 10, dtype=torch.bool).triu(1)[5:]  # (5, 10)
    assert torch.allclose(part[..., past], whole[:, :, 5:][..., past], atol=1e-6)
    assert whole[0, 1, 7, 7] != whole[0, 1, 7, 6]  # distances differ, so values do


@pytest.mark.parametrize("scheme", ALL)
def test_trains_under_bf16_autocast(scheme):
    """The GPU path (run.py: bf16 autocast for the forward, backward outside it), tried with
    CPU autocast: no scheme may mix bf16 and fp32 in a backward matmul (xl's fp32 u must not
    promote q), and every gradient is finite."""
    model = build(scheme).train()
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x[:, :-1])
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_cope_positions_stay_exact_from_bf16_gates():
    """CoPE sums its gates in fp32 whatever their dtype: summed in bf16, a position is off by up
    to 0.5. The bias from bf16 inputs must equal the formula in fp64 on the same bf16 gates and
    logits (flipped cumsum, two gathers) to bf16's rounding of that row's logits. The backward
    then mixes fp32 weights with bf16 gradients, as under CUDA autocast (cumsum in fp32)."""
    from posbench.schemes import cope_bias

    gen = torch.Generator().manual_seed(0)
    B, H, T, D, P = 2, 2, 64, 8, 64
    q, k = (torch.randn(B, H, T, D, generator=gen).bfloat16() for _ in range(2))
    table = torch.randn(D, P, generator=gen).bfloat16()
    keep = torch.ones(T, T).tril().bfloat16()
    g = torch.matmul(q * D**-0.5, k.transpose(-1, -2)).sigmoid_().mul_(keep)  # the same bf16 gates
    pos = g.double().flip(-1).cumsum(-1).flip(-1).clamp(max=P - 1)  # sum_{t>=j} g_it
    lo = pos.floor().long()
    w = pos - lo
    by_pos = torch.matmul(q, table).double()
    want = by_pos.gather(-1, lo) * (1 - w) + by_pos.gather(-1, (lo + 1).clamp(max=P - 1)) * w

    q.requires_grad_(), k.requires_grad_(), table.requires_grad_()
    got = cope_bias(q, k, table, torch.arange(T), torch.arange(T))
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs() / by_pos.abs().amax(-1, keepdim=True)  # per query row
    assert err.max() < 0.01, err.max()  # bf16 rounds to 2^-8 = 0.004; a position off by 0.5 is ~0.1
    got.float().square().sum().backward()
    for t in (q, k, table):
        assert t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all()


@pytest.mark.parametrize(
    "scheme,size,what",
    [
        ("rope", dict(d_model=18, n_head=2), "head size model.d_model / model.n_head=9"),
        ("xpos", dict(d_model=18, n_head=2), "head size model.d_model / model.n_head=9"),
        ("sinusoidal", dict(d_model=15, n_head=3), "model.d_model=15"),
        ("hybrid", dict(d_model=15, n_head=3), "model.d_model=15"),
        ("xl", dict(d_model=15, n_head=3), "model.d_model=15"),
        ("randomized", dict(d_model=15, n_head=3), "model.d_model=15"),
    ],
)
def test_odd_widths_are_refused_by_name(scheme, size, what):
    """Sin/cos pairs and rotations need even widths; an odd one is a one-line config error,
    not a shape mismatch deep in a forward pass."""
    from posbench.model import TransformerLM

    with pytest.raises(PosbenchError, match=f"scheme '{scheme}'.*{re.escape(what)} must be even"):
        TransformerLM(tiny(scheme, **size))
    TransformerLM(tiny(scheme, d_model=16, n_head=2))  # and an even one builds


def test_biased_attention_zeroes_subnormal_probabilities_and_nothing_else():
    """A steep bias (-d per step of distance) puts some probabilities in fp32's subnormal range,
    where every product is ~100x slower; they become exact zeros, every other value is kept."""
    from posbench.attention import TINY_PROB, BiasedAttention

    T, D = 120, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, D, generator=g) * 0.1 for _ in range(3))
    d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0).float()
    bias = (-1.0 * d)[None, None].expand(1, 2, T, T).clone().requires_grad_()
    mask = torch.zeros(T, T).masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = BiasedAttention.apply(q, k, v, bias, mask)
    probs = out.grad_fn.saved_tensors[3]
    want = (q @ k.transpose(-1, -2) * D**-0.5 + bias.detach() + mask).softmax(-1)
    tiny = (want > 0) & (want < torch.finfo(torch.float32).tiny)
    assert tiny.any()  # the case does make subnormals
    assert torch.equal(probs[want <= TINY_PROB], torch.zeros_like(probs[want <= TINY_PROB]))
    assert torch.equal(probs[want > TINY_PROB], want[want > TINY_PROB])
    assert torch.allclose(out, want @ v, atol=1e-7)
    out.sum().backward()
    assert torch.isfinite(bias.grad).all()
