"""The scheme catalogue against its formulas: RoPE scalings, xPos, KERPLE, FIRE, randomized
positions, CoPE, and RoPE scaled at evaluation time from the command line.

Expected numbers are worked by hand in the comments, or recomputed here from the published
formula with plain Python floats, never by calling the code under test."""

import csv
import math
import shutil

import pytest
import torch
import yaml
from conftest import SMOKE, invoke, smoke_experiment, tiny

from posbench import native
from posbench.config import load_config
from posbench.errors import PosbenchError
from posbench.evaluate import evaluate_model
from posbench.model import TransformerLM
from posbench.resolve import resolve
from posbench.schemes import SCHEMES, catalogue, resolve_scheme, rope_frequencies
from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

# the schemes whose formulas this file works by hand, each in a section of its own below
HAND_WORKED = ["xpos", "kerple_log", "kerple_power", "fire", "randomized", "cope"]


def close(got, want, tol=1e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=tol, abs=1e-12), (list(got), list(want))


# --- rope_frequencies: transformers' ROPE_INIT_FUNCTIONS at hand-worked points -------------


# head_dim 8, base 10000: theta_k = 10000^(-2k/8) = 10^-k.
def test_default_frequencies():
    inv, att = rope_frequencies(8)
    close(inv.tolist(), [1.0, 0.1, 0.01, 0.001])
    assert att == 1.0


def test_linear_divides_every_frequency_by_s():
    inv, att = rope_frequencies(8, scaling="linear", factor=4.0)
    close(inv.tolist(), [0.25, 0.025, 0.0025, 0.00025])
    assert att == 1.0


# ntk, s=4, d=8: base' = 10000 * 4^(8/6), so theta'_k = 10^-k * 4^(-k/3):
# k=1: 0.1 / 4^(1/3) = 0.0629961; k=2: 0.01 / 4^(2/3) = 0.00396850; k=3: 0.001 / 4 (exactly
# linear's: the slowest frequency is interpolated by s, the fastest kept).
def test_ntk_changes_the_base():
    inv, att = rope_frequencies(8, scaling="ntk", factor=4.0)
    close(inv.tolist(), [1.0, 0.0629961, 0.00396850, 0.00025], tol=1e-5)
    assert att == 1.0


# dynamic, s=2, L=16, d=8: base' = 10000 * (2*n/16 - 1)^(4/3) once n > 16.
# n=32: (4 - 1)^(4/3), theta'_k = 10^-k * 3^(-k/3): k=3 -> 0.001/3.
# n <= 16: (2 - 1) = 1, the default frequencies.
def test_dynamic_grows_with_the_sequence_length():
    inv, _ = rope_frequencies(8, scaling="dynamic", factor=2.0, original_max_len=16, seq_len=32)
    close(inv.tolist(), [1.0, 0.1 * 3 ** (-1 / 3), 0.01 * 3 ** (-2 / 3), 0.001 / 3])
    for n in (None, 10, 16):
        inv, _ = rope_frequencies(8, scaling="dynamic", factor=2.0, original_max_len=16, seq_len=n)
        close(inv.tolist(), [1.0, 0.1, 0.01, 0.001])
    # factor 1 at n = 4L is NTK with s = 4: (1*64/16 - 0)^(4/3) = 4^(4/3)
    dyn, _ = rope_frequencies(8, scaling="dynamic", factor=1.0, original_max_len=16, seq_len=64)
    ntk, _ = rope_frequencies(8, scaling="ntk", factor=4.0)
    close(dyn.tolist(), ntk.tolist())


# yarn, d=8, L=16, s=4: dim(r) = 8 ln(16 / (2 pi r)) / (2 ln 10000)
# low = dim(32) = 8 * ln(0.0795775) / 18.4207 = -1.099 -> floor -2 -> clipped to 0
# high = dim(1) = 8 * ln(2.546479) / 18.4207 = 0.406 -> ceil 1
# ramp_k = clamp((k - 0) / (1 - 0), 0, 1) = [0, 1, 1, 1]: dim 0 keeps theta_0, the rest / 4.
# attention factor 0.1 ln 4 + 1 = 1.1386294
def test_yarn_small_head():
    inv, att = rope_frequencies(8, scaling="yarn", factor=4.0, original_max_len=16)
    close(inv.tolist(), [1.0, 0.025, 0.0025, 0.00025])
    assert att == pytest.approx(1.1386294, rel=1e-7)


# yarn, d=32, L=100, s=2 (posbench's default model):
# low = 32 ln(100 / (64 pi)) / 18.4207 = 32 * (-0.698450) / 18.4207 = -1.213 -> 0
# high = 32 ln(100 / (2 pi)) / 18.4207 = 32 * 2.767293 / 18.4207 = 4.807 -> ceil 5
# ramp_k = k/5 up to 1, so theta'_k = 10^(-k/4) * (1 - ramp_k) + 10^(-k/4) / 2 * ramp_k
#        = 10^(-k/4) * (1 - k/10) for k <= 5, 10^(-k/4) / 2 beyond.
# k=2: 10^-0.5 * 0.8 = 0.2529822; k=5: 10^-1.25 / 2 = 0.0281171. Attention: 0.1 ln 2 + 1.
def test_yarn_ramp_is_fractional_between_the_ends():
    inv, att = rope_frequencies(32, scaling="yarn", factor=2.0, original_max_len=100)
    want = [10 ** (-k / 4) * (1 - min(k / 5, 1) / 2) for k in range(16)]
    close(inv.tolist(), want)
    assert inv[2].item() == pytest.approx(0.2529822, rel=1e-6)
    assert inv[5].item() == pytest.approx(0.0281171, rel=1e-5)
    assert att == pytest.approx(1.0693147, rel=1e-7)
    # without truncation the ramp ends are the raw dims: max(-1.213, 0) = 0 and 4.807
    inv, _ = rope_frequencies(32, scaling="yarn", factor=2.0, original_max_len=100, truncate=False)
    high = 32 * math.log(100 / (2 * math.pi)) / (2 * math.log(10000))
    assert inv[2].item() == pytest.approx(10**-0.5 * (1 - (2 / high) / 2), rel=1e-6)


def yarn_by_hand(d, base, s, L):
    """transformers' _compute_yarn_parameters restated with Python floats (truncate=True)."""

    def dim(r):
        return d * math.log(L / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), d - 1)
    if low == high:
        high += 0.001
    out = []
    for k in range(d // 2):
        theta = 1.0 / base ** (2 * k / d)
        extrapolate = 1 - min(max((k - low) / (high - low), 0.0), 1.0)
        out.append(theta / s * (1 - extrapolate) + theta * extrapolate)
    return out, 0.1 * math.log(s) + 1.0


@pytest.mark.parametrize("d,base,s,L", [(64, 10000.0, 8.0, 4096), (128, 500000.0, 4.0, 8192), (16, 10000.0, 3.0, 32)])
def test_yarn_matches_the_reference_formula(d, base, s, L):
    # d=64, L=4096: low = floor(10.47) = 10, high = ceil(22.51) = 23, a ramp inside the head
    want, want_att = yarn_by_hand(d, base, s, L)
    inv, att = rope_frequencies(d, base, "yarn", s, L)
    close(inv.tolist(), want, tol=1e-6)
    assert att == pytest.approx(want_att)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
@pytest.mark.parametrize("d,base,L", [(8, 10000.0, 100), (32, 10000.0, 100), (128, 500000.0, 2048)])
def test_rope_frequencies_agree_with_transformers(kind, d, base, L):
    """transformers itself (the test extra installs it; it brings no torch of its own). Its
    ROPE_INIT_FUNCTIONS have no static NTK entry, so ntk is checked by hand above."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for s in (1.0, 1.5, 4.0, 16.0):
        params = {"rope_type": kind, "rope_theta": base, "factor": s, "original_max_position_embeddings": L}
        cfg = LlamaConfig(
            hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=L, rope_parameters=params
        )
        for seq in (None, L // 2, 3 * L) if kind == "dynamic" else (None,):
            want, want_att = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq)
            inv, att = rope_frequencies(d, base, kind, s, L, seq_len=seq)
            assert torch.allclose(inv, want.float(), rtol=1e-5, atol=0), (kind, s, seq)
            assert att == pytest.approx(want_att, abs=1e-12)


# llama3, d=32, L=100, s=4: dimension k makes r_k = L theta_k / (2 pi) = 15.9155 * 10^(-k/4)
# turns in L: k=0..2 make 15.9, 8.95, 5.03 (> 4: kept), k=3, 4 make 2.830, 1.592 (between 1 and
# 4: g = (r - 1)/3 = 0.6100, 0.1972), k >= 5 make 0.895 and fewer (< 1: theta_k / 4).
# k=3: 10^-0.75 * (0.3899 / 4 + 0.6101) = 0.1258230; k=4: 0.1 * (0.8028 / 4 + 0.1972) = 0.0397887
def llama3_by_hand(d, base, s, L):
    """transformers' _compute_llama3_parameters restated with Python floats (factors 1 and 4)."""
    out = []
    for k in range(d // 2):
        theta = 1.0 / base ** (2 * k / d)
        r = L * theta / (2 * math.pi)
        g = (r - 1) / (4 - 1)
        out.append(theta if r > 4 else theta / s if r < 1 else (1 - g) * theta / s + g * theta)
    return out


def test_llama3_keeps_fast_dims_divides_slow_ones_and_blends_between():
    inv, att = rope_frequencies(32, 10000.0, "llama3", 4.0, 100)
    close(inv.tolist(), llama3_by_hand(32, 10000.0, 4.0, 100))
    assert inv[3].item() == pytest.approx(0.1258230, rel=1e-6)
    assert inv[4].item() == pytest.approx(0.0397887, rel=1e-5)
    close(inv[:3].tolist(), rope_frequencies(32)[0][:3].tolist())  # the fast dims as trained
    close(inv[5:].tolist(), [10 ** (-k / 4) / 4 for k in range(5, 16)])
    assert att == 1.0


def hf_frequencies(kind, d, base, L, seq=None, **params):
    """transformers' own ROPE_INIT_FUNCTIONS[kind] for a Llama-shaped config with head dim d."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": base, "original_max_position_embeddings": L, **params}
    cfg = LlamaConfig(
        hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=L, rope_parameters=params
    )
    return ROPE_INIT_FUNCTIONS[kind](cfg, None, seq)


# posbench's model has d_head 32 at L 100 (and 64 in the tests' tiny runs); Llama's 64 and 128
LLAMA_LIKE = [(32, 10000.0, 100), (32, 10000.0, 64), (64, 10000.0, 4096), (128, 500000.0, 8192), (128, 10000.0, 256)]
FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 400 / 100, 96 / 64)


@pytest.mark.parametrize("d,base,L", LLAMA_LIKE)
def test_llama3_equals_transformers_to_the_last_bit(d, base, L):
    pytest.importorskip("transformers")
    for s in FACTORS:
        want, want_att = hf_frequencies("llama3", d, base, L, factor=s, low_freq_factor=1.0, high_freq_factor=4.0)
        inv, att = rope_frequencies(d, base, "llama3", s, L)
        assert torch.equal(inv, want), (s, (inv - want).abs().max())
        assert att == want_att
        close(inv.tolist(), llama3_by_hand(d, base, s, L), tol=1e-6)  # and the formula, to float32's precision


def searched(d, seed):
    """Factors shaped like a LongRoPE search's: short ones near 1, long ones growing to the slow dims."""
    g = torch.Generator().manual_seed(seed)
    short = (1 + 0.1 * torch.rand(d // 2, generator=g, dtype=torch.float64)).tolist()
    long = (1 + torch.linspace(0, 30, d // 2, dtype=torch.float64) * torch.rand(d // 2, generator=g)).tolist()
    return short, long


@pytest.mark.parametrize("d,base,L", LLAMA_LIKE)
def test_longrope_equals_transformers_to_the_last_bit(d, base, L):
    """Short factors up to the training length, long ones past it; attention sqrt(1 + ln s / ln L)."""
    pytest.importorskip("transformers")
    for i, s in enumerate(FACTORS):
        short, long = searched(d, i)
        for seq in (None, L // 2, L, L + 1, 4 * L):
            want, want_att = hf_frequencies("longrope", d, base, L, seq, factor=s, short_factor=short, long_factor=long)
            inv, att = rope_frequencies(d, base, "longrope", s, L, seq_len=seq, longrope=(short, long))
            assert torch.equal(inv, want), (s, seq, (inv - want).abs().max())
            assert att == want_att
        plain = rope_frequencies(d, base)[0].double()
        f = long if seq > L else short
        close(inv.tolist(), (plain / torch.tensor(f, dtype=torch.float64)).tolist(), tol=1e-6)
        assert att == pytest.approx(math.sqrt(1 + math.log(s) / math.log(L)) if s > 1 else 1.0, rel=1e-15)


@pytest.mark.parametrize("kind", ["linear", "ntk", "dynamic", "yarn", "llama3", "longrope"])
def test_every_scaling_is_the_identity_at_s_1(kind):
    ones = ([1.0] * 16, [1.0] * 16)  # longrope's factors at 1 too
    inv, att = rope_frequencies(32, 10000.0, kind, 1.0, 100, seq_len=100, longrope=ones)
    if kind in ("llama3", "longrope"):  # transformers' formulas, 1 / (f base^(2k/d)): within an ulp
        close(inv.tolist(), rope_frequencies(32)[0].tolist())
    else:  # posbench's own: s = 1 is plain RoPE to the last bit
        assert torch.equal(inv, rope_frequencies(32)[0])
    assert att == 1.0


def test_rope_frequencies_errors():
    with pytest.raises(PosbenchError, match="unknown RoPE scaling 'yarm'"):
        rope_frequencies(8, scaling="yarm")
    with pytest.raises(PosbenchError, match="needs the training length"):
        rope_frequencies(8, scaling="yarn", factor=2.0)
    with pytest.raises(PosbenchError, match="llama3 RoPE scaling needs the training length"):
        rope_frequencies(8, scaling="llama3", factor=2.0)
    with pytest.raises(PosbenchError, match="longrope needs short_factor and long_factor, d_head/2 factors each"):
        rope_frequencies(8, 10000.0, "longrope", 2.0, 16)
    with pytest.raises(PosbenchError, match="longrope's factors: 3 given, one per rotated pair is 4"):
        rope_frequencies(8, 10000.0, "longrope", 2.0, 16, seq_len=32, longrope=([1.0] * 4, [1.0] * 3))


# --- RoPE under an evaluation-time variant ---------------------------------------------------


def rope_scheme(**kw):
    return SCHEMES["rope"](tiny("rope", **kw))  # head_dim 8, train_len 16


def test_linear_variant_is_rope_at_positions_over_s():
    scheme = rope_scheme()
    q, k = torch.randn(1, 4, 64, 8), torch.randn(1, 4, 64, 8)
    pos = torch.arange(64)
    with scheme.eval_variant("linear", train_len=16, length=64):  # s = 64/16 = 4
        got = scheme.rotate(q, k, pos, 0)
    want = scheme.rotate(q, k, pos.float() / 4, 0)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    after = scheme.rotate(q, k, torch.arange(64), 0)  # the variant ends with the block
    assert torch.allclose(after[0], scheme.rotate(q, k, pos, 0)[0])
    assert not torch.allclose(after[0], got[0], atol=1e-3)


@pytest.mark.parametrize("variant", ["linear", "ntk", "dynamic", "yarn", "llama3"])
def test_a_variant_leaves_rope_as_trained_up_to_its_training_length(variant):
    """s = L'/L is at least 1: at L' = L / 2 every scaling is the trained rotation (a factor of
    0.5 would read every distance as twice what it is)."""
    scheme = rope_scheme()
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    pos = torch.arange(8)
    plain = scheme.rotate(q, k, pos, 0)
    with scheme.eval_variant(variant, train_len=16, length=8):
        got = scheme.rotate(q, k, pos, 0)
    assert torch.allclose(got[0], plain[0], atol=1e-6) and torch.allclose(got[1], plain[1], atol=1e-6)


@pytest.mark.parametrize("variant,base", [(None, 10000.0), (None, 500.0), ("yarn", 10000.0), ("ntk", 10000.0)])
def test_rotate_turns_each_pair_by_position_times_its_frequency(variant, base):
    """A unit vector in dim k comes out of `rotate` at position p as a (cos, sin) pair in dims
    (k, k + d/2), scaled by the attention factor: the angle is p * theta_k with theta_k from
    rope_frequencies (the default, or the variant's at s = 48 / 16 = 3)."""
    scheme = rope_scheme(options={"base": base})
    D, T = 8, 48
    pos = torch.arange(T)
    q = torch.eye(D)[: D // 2].view(1, D // 2, 1, D).expand(1, D // 2, T, D)  # head k holds e_k
    with scheme.eval_variant(variant, 16, T):
        qr, _ = scheme.rotate(q, q, pos, 0)
    inv, att = rope_frequencies(D, base, variant, 3.0, 16) if variant else rope_frequencies(D, base)
    for k in range(D // 2):
        ang = pos.double() * inv[k].double()
        assert torch.allclose(qr[0, k, :, k].double(), att * ang.cos(), atol=1e-5), k
        assert torch.allclose(qr[0, k, :, k + D // 2].double(), att * ang.sin(), atol=1e-5), k
    if variant is None:  # and theta_k = base^(-2k/d), by hand
        assert torch.allclose(inv.double(), base ** (-torch.arange(0, D, 2).double() / D))


def test_yarn_variant_scales_norms_by_its_attention_factor():
    """A rotation keeps norms, so YaRN's q and k each have norm (0.1 ln s + 1) times their own
    (s = 48/16 = 3): the logits (0.1 ln s + 1)^2 times, as transformers' scaled cos and sin give."""
    scheme = rope_scheme()
    q, k = torch.randn(2, 4, 48, 8), torch.randn(2, 4, 48, 8)
    with scheme.eval_variant("yarn", 16, 48):
        qr, kr = scheme.rotate(q, k, torch.arange(48), 0)
    for x, xr in ((q, qr), (k, kr)):
        assert torch.allclose(xr.norm(dim=-1), x.norm(dim=-1) * (0.1 * math.log(3) + 1), atol=1e-5)
    with scheme.eval_variant("yarn", 16, 48, factor=2.0):  # a fixed factor wins over L'/L
        qr, _ = scheme.rotate(q, q, torch.arange(48), 0)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1) * (0.1 * math.log(2) + 1), atol=1e-5)


def test_dynamic_variant_follows_each_forward_length():
    """Factor 1 by default: at T = L' it is NTK with s = L'/L; a shorter last chunk gets less."""
    scheme = rope_scheme()
    q = torch.randn(1, 1, 64, 8)
    outs = {}
    for kind in ("dynamic", "ntk"):
        with scheme.eval_variant(kind, 16, 64):
            outs[kind, 64] = scheme.rotate(q, q, torch.arange(64), 0)[0]
            outs[kind, 40] = scheme.rotate(q[:, :, :40], q[:, :, :40], torch.arange(40), 0)[0]
    assert torch.allclose(outs["dynamic", 64], outs["ntk", 64], atol=1e-6)
    assert not torch.allclose(outs["dynamic", 40], outs["ntk", 40], atol=1e-4)
    with scheme.eval_variant("ntk", 16, 40):  # dynamic's 40-token forward is NTK at s = 40/16
        ntk40 = scheme.rotate(q[:, :, :40], q[:, :, :40], torch.arange(40), 0)[0]
    assert torch.allclose(outs["dynamic", 40], ntk40, atol=1e-6)


def test_variants_are_declared_by_the_scheme():
    with pytest.raises(PosbenchError, match="scheme 'alibi' has no evaluation-time variant 'yarn'"):
        with SCHEMES["alibi"](tiny("alibi")).eval_variant("yarn", 16, 32):
            pass
    own = {"linear", "ntk", "dynamic", "yarn", "llama3", "longrope"}
    assert set(SCHEMES["rope"].eval_variants) == own | set(TRAINING_FREE)
    with pytest.raises(PosbenchError, match="evaluation-time variant of rope, not a scheme to train"):
        resolve_scheme("rope+yarn")


def test_rope_variants_take_transformers_names_but_ntk():
    """One vocabulary with `posbench pretrained`: every rope variant but static ntk is a
    transformers RoPE type, and posbench/pretrained.py offers each of those."""
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posbench.pretrained import VARIANTS

    own = set(SCHEMES["rope"].eval_variants) - set(TRAINING_FREE)
    assert own - set(ROPE_INIT_FUNCTIONS) == {"ntk"} and own - {"ntk"} == set(VARIANTS)


def test_llama3_variant_is_transformers_at_s_length_over_train_len():
    """Scored at 48 after training at 16: transformers' llama3 at factor 3, original context 16
    (to the last bit), or at the fixed factor."""
    pytest.importorskip("transformers")
    scheme = rope_scheme()
    for factor, s in ((None, 3.0), (2.0, 2.0)):
        with scheme.eval_variant("llama3", 16, 48, factor=factor):
            inv, att = scheme.frequencies(8, 48)
        want, want_att = hf_frequencies("llama3", 8, 10000.0, 16, factor=s, low_freq_factor=1.0, high_freq_factor=4.0)
        assert torch.equal(inv, want) and att == want_att


class SearchedRoPE(SCHEMES["rope"]):
    """rope with LongRoPE factors, as a subclass given a model's searched ones would hold them."""

    longrope = ([1.0, 1.02, 1.1, 1.3], [1.0, 1.5, 3.0, 6.5])


def test_longrope_is_refused_in_one_line_without_searched_factors():
    assert SCHEMES["rope"].refuses("longrope").startswith("longrope needs short_factor and long_factor")
    assert SCHEMES["rope"].refuses("yarn") is None and SearchedRoPE.refuses("longrope") is None
    with pytest.raises(PosbenchError, match="searched for each model"):
        with rope_scheme().eval_variant("longrope", 16, 48):
            pass
    with pytest.raises(PosbenchError, match="eval.perplexity.rope_scaling: longrope needs short_factor"):
        resolve(load_config(None, ["eval.perplexity.rope_scaling=[longrope]", "schemes=[rope,alibi]"]))


def test_longrope_with_searched_factors_is_transformers_short_to_l_and_long_past_it():
    pytest.importorskip("transformers")
    scheme = SearchedRoPE(tiny("rope"))  # head_dim 8, train_len 16
    short, long = SearchedRoPE.longrope
    params = {"factor": 3.0, "short_factor": short, "long_factor": long}
    q = torch.randn(1, 2, 48, 8)
    with scheme.eval_variant("longrope", 16, 48):  # s = 3
        for T in (16, 48):
            inv, att = scheme.frequencies(8, T)
            want, want_att = hf_frequencies("longrope", 8, 10000.0, 16, T, **params)
            assert torch.equal(inv, want) and att == want_att == math.sqrt(1 + math.log(3) / math.log(16))
        qr, _ = scheme.rotate(q, q, torch.arange(48), 0)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1) * math.sqrt(1 + math.log(3) / math.log(16)), atol=1e-5)


def test_catalogue_lists_at_least_16_entries_with_rope_variants_marked():
    rows = dict(catalogue())
    assert len(rows) >= 16 and set(HAND_WORKED) <= set(rows)
    for kind in ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope"):
        assert rows[f"rope+{kind}"].startswith("evaluation-time variant of rope")
        assert "\n" not in rows[f"rope+{kind}"]
    assert "transformers has no static type" in rows["rope+ntk"] and "transformers' dynamic" in rows["rope+dynamic"]
    for name, cls in SCHEMES.items():
        assert cls.description and cls.description != SCHEMES["nope"].description or name == "nope"


def test_rope_scaling_config_is_checked_by_name():
    with pytest.raises(PosbenchError) as e:
        resolve(load_config(None, ["eval.perplexity.rope_scaling=[yarm]"]))
    assert "eval.perplexity.rope_scaling: unknown kind 'yarm' (did you mean 'yarn'?)" in str(e.value)
    with pytest.raises(PosbenchError, match="eval.perplexity.rope_factor=0.5 must be >= 1"):
        load_config(None, ["eval.perplexity.rope_factor=0.5"])
    assert load_config(None, ["eval.perplexity.rope_scaling=yarn"]).eval.perplexity.rope_scaling == ["yarn"]


# --- xPos --------------------------------------------------------------------------------------


# q = k = e_0 pairs with dim 4 (the half pairing) at frequency theta_0 = 1, so after RoPE
# q_i.k_j = cos(i)cos(j) + sin(i)sin(j) = cos(i-j); xPos multiplies it by zeta_0^((i-j)/gamma),
# zeta_0 = (0 + 0.4*8) / (1.4*8) = 3.2/11.2. With gamma = 8, i=12, j=2:
# cos(10) * (3.2/11.2)^(10/8) = -0.839072 * 0.208889 = -0.175273.
@pytest.mark.parametrize("T", [16, 40])  # the centring depends on T and must cancel
def test_xpos_score_is_rope_times_zeta_power(T):
    scheme = SCHEMES["xpos"](tiny("xpos", options={"scale_base": 8.0}))
    e0 = torch.zeros(1, 1, T, 8)
    e0[..., 0] = 1.0
    q, k = scheme.rotate(e0, e0, torch.arange(T), 0)
    s = (q @ k.transpose(-1, -2))[0, 0]  # (T, T)
    assert s[12, 2].item() == pytest.approx(-0.175273, abs=1e-5)
    assert s[12, 2].item() == pytest.approx(math.cos(10) * (3.2 / 11.2) ** (10 / 8), rel=1e-5)
    assert s[7, 7].item() == pytest.approx(1.0, abs=1e-6)  # no decay at distance 0
    # dim 3 has frequency 10^-3 (nearly still) and zeta_3 = (6 + 3.2)/11.2: almost pure decay
    e3 = torch.zeros(1, 1, T, 8)
    e3[..., 3] = 1.0
    q, k = scheme.rotate(e3, e3, torch.arange(T), 0)
    got = (q[0, 0, 12] @ k[0, 0, 2]).item()
    assert got == pytest.approx(math.cos(10 * 1e-3) * (9.2 / 11.2) ** (10 / 8), rel=1e-5)


def test_xpos_default_scale_base_is_512():
    assert SCHEMES["xpos"].options["scale_base"] == 512.0


# --- KERPLE ------------------------------------------------------------------------------------


def kerple(name, r1, r2, per_layer=False):
    """A model whose r1, r2 are these (H,) values; with per_layer, those of layer 1, and layer 0
    gets others, which the bias of layer 1 must ignore."""
    model = TransformerLM(tiny(name, options={"per_layer": per_layer})).eval()
    r1, r2 = torch.tensor(r1), torch.tensor(r2)
    if per_layer:
        r1, r2 = torch.stack([torch.full((4,), 7.0), r1]), torch.stack([torch.full((4,), 0.3), r2])
    with torch.no_grad():
        model.scheme.r1.copy_(r1)
        model.scheme.r2.copy_(r2)
    return model


def kerple_bias(model, layer=1):
    z = torch.zeros(1, model.cfg.n_head, 6, 8)
    return model.scheme.bias(z, z, torch.arange(6), torch.arange(6), layer)[0]  # (H, 6, 6)


# at i=5, j=2 (distance 3), with r2 = 0.001 clamped to the reference's floor 0.01:
# log:   -1*ln(1+3) = -1.386294; -2*ln(1+1.5) = -1.832581; -0.5*ln(1+6) = -0.972955;
#        -3*ln(1+0.03) = -0.088677
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("i,j,want", [(5, 2, [-1.386294, -1.832581, -0.972955, -0.088677]), (4, 4, [0, 0, 0, 0])])
def test_kerple_log_formula(i, j, want, per_layer):
    b = kerple_bias(kerple("kerple_log", [1.0, 2.0, 0.5, 3.0], [1.0, 0.5, 2.0, 0.001], per_layer))
    close(b[:, i, j].tolist(), want, tol=1e-5)


# power: -r1 * 3^r2 with r2 = 3 clamped to 2 and 0.001 to 0.01:
# -1*3 = -3; -2*sqrt(3) = -3.464102; -0.5*3^2 = -4.5; -3*3^0.01 = -3*1.011047 = -3.033140
@pytest.mark.parametrize("per_layer", [False, True])
def test_kerple_power_formula(per_layer):
    b = kerple_bias(kerple("kerple_power", [1.0, 2.0, 0.5, 3.0], [1.0, 0.5, 3.0, 0.001], per_layer))
    close(b[:, 5, 2].tolist(), [-3.0, -3.464102, -4.5, -3.033140], tol=1e-5)
    assert torch.all(torch.diagonal(b, dim1=1, dim2=2) == 0)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_is_one_kernel_for_the_whole_model_as_the_reference(name):
    """chijames/KERPLE builds one kernel module and hands it to every layer: by default one
    (H,) pair r1, r2 serves all layers, 2 x n_head parameters in all, every layer the same bias.
    per_layer: true gives each layer its own pair, n_layer x n_head each."""
    torch.manual_seed(0)
    shared = TransformerLM(tiny(name, n_layer=3, n_head=6, d_model=48))
    assert SCHEMES[name].options["per_layer"] is False
    assert {n: tuple(p.shape) for n, p in shared.scheme.named_parameters()} == {"r1": (6,), "r2": (6,)}
    assert sum(p.numel() for p in shared.scheme.parameters()) == 2 * 6
    assert torch.equal(kerple_bias(shared, 0), kerple_bias(shared, 2))
    own = TransformerLM(tiny(name, n_layer=3, n_head=6, d_model=48, options={"per_layer": True}))
    assert {n: tuple(p.shape) for n, p in own.scheme.named_parameters()} == {"r1": (3, 6), "r2": (3, 6)}
    assert sum(p.numel() for p in own.scheme.parameters()) == 2 * 3 * 6
    assert not torch.equal(kerple_bias(own, 0), kerple_bias(own, 2))


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("name,r1_max,r2_max", [("kerple_log", 2.0, 1.0), ("kerple_power", 1.0, 2.0)])
def test_kerple_parameters_names_init_and_clamp(name, r1_max, r2_max, per_layer):
    torch.manual_seed(0)
    model = TransformerLM(tiny(name, n_head=6, d_model=48, options={"per_layer": per_layer}))
    params = dict(model.named_parameters())
    r1, r2 = params["scheme.r1"], params["scheme.r2"]
    assert r1.shape == r2.shape == ((2, 6) if per_layer else (6,))
    assert 0 <= r1.min() and r1.max() < r1_max and 0 <= r2.min() and r2.max() < r2_max  # reference init
    with torch.no_grad():
        r1.fill_(-1.0)
        r2.fill_(5.0)
    model.train()(torch.randint(0, 256, (1, 8)))  # training clamps the stored values, as the reference
    assert torch.all(r1 == 0.01)
    assert torch.all(r2 == (2.0 if name == "kerple_power" else 5.0))


# --- FIRE --------------------------------------------------------------------------------------


# With the MLP set to b_h(x) = (h+1) * relu(x), c = 0.5 and L_thr = 4 (init_L 4, multiplier 1):
# (10, 3): psi(7)/psi(max(4, 10)) = ln(4.5)/ln(6) = 1.504077/1.791759 = 0.839442
# (2, 1):  psi(1)/psi(max(4, 2)) = ln(1.5)/ln(3) = 0.405465/1.098612 = 0.369070 (the threshold)
# (9, 9):  psi(0) = 0
def test_fire_formula():
    scheme = SCHEMES["fire"](tiny("fire", options={"init_L": 4.0}))
    mlp = scheme.mlp[1]
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp[0].weight[0, 0] = 1.0
        mlp[2].weight[:, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        scheme.c[1] = 0.5
    z = torch.zeros(1, 4, 12, 8)
    b = scheme.bias(z, z, torch.arange(12), torch.arange(12), 1)[0]  # (H, 12, 12)
    close(b[:, 10, 3].tolist(), [h * 0.839442 for h in (1, 2, 3, 4)], tol=1e-5)
    close(b[:, 2, 1].tolist(), [h * 0.369070 for h in (1, 2, 3, 4)], tol=1e-5)
    close(b[:, 9, 9].tolist(), [0, 0, 0, 0])
    assert b[0, 11, 0].item() == pytest.approx(1.0, abs=1e-5)  # i-j = i past L_thr: psi(i)/psi(i)


@pytest.mark.parametrize("case", ["trained", "flat units", "shared kinks", "far kinks", "no kinks"])
def test_fire_reads_its_mlp_as_lines_equal_to_the_mlp_with_its_gradients(case):
    """FIRE's bias takes its 1 -> 32 -> H MLP as the line it is between two kinks: values and the
    gradients of x and of every weight equal the MLP's own forward and backward, whatever the
    kinks (units with w1 = 0 on or off, two units turning at one x, kinks far outside [0, 1]).
    At an x on a kink (x = 0 with b1 = 0) only values are compared: the MLP has no gradient
    there (torch takes relu's as 0, the lines take the segment's below)."""
    from posbench.schemes.fire import as_lines

    torch.manual_seed(3)
    mlp = SCHEMES["fire"](tiny("fire")).mlp[0]
    with torch.no_grad():
        w1, b1 = mlp[0].weight[:, 0], mlp[0].bias
        if case == "flat units":
            w1[:6], b1[:3], b1[3:6] = 0, 0.5, -0.5
        elif case == "shared kinks":
            w1[8:12], b1[8:12] = torch.tensor([1.0, 2.0, -1.0, -3.0]), -0.25 * torch.tensor([1.0, 2.0, -1.0, -3.0])
            b1[12] = 0.0  # a kink at x = 0, which the diagonal hits
        elif case == "far kinks":
            w1.mul_(1e-4)
        elif case == "no kinks":
            w1.zero_()
    x = torch.rand(24, 40).clamp(max=0.999)
    x[:, 0] = 0.0
    x.requires_grad_(True)
    ref = mlp(x.unsqueeze(-1)).permute(2, 0, 1)  # (H, 24, 40)
    got = as_lines(mlp, x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation's path: gathered in the model's dtype, added in place
        torch.testing.assert_close(as_lines(mlp, x), ref, rtol=1e-5, atol=1e-6)
        half = as_lines(mlp, x, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref.detach(), rtol=0.02, atol=0.02)
    g = torch.randn_like(ref)
    g[:, :, 0] = 0  # x = 0 may sit on a kink
    params = [x, *mlp.parameters()]
    want = torch.autograd.grad((ref * g).sum(), params)
    for mine, theirs in zip(torch.autograd.grad((got * g).sum(), params), want):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_fire_traces_in_one_graph_runs_another_mlp_as_it_is_and_takes_an_empty_block():
    """train.compile: the lines have one segment per unit whatever the weights, so FIRE traces
    without a graph break; an MLP of another shape (a subclass's) is run as it is; a block with
    no queries gives (H, 0, Tk)."""
    import torch.nn as nn

    from posbench.check import tiny_model
    from posbench.schemes.fire import as_lines

    torch._dynamo.reset()
    model = tiny_model("fire").train()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason)[:120] for r in explained.break_reasons]
    torch.manual_seed(0)
    deeper = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.rand(5, 7)
    assert torch.equal(as_lines(deeper, x), deeper(x.unsqueeze(-1)).permute(2, 0, 1))
    mlp = SCHEMES["fire"](tiny("fire")).mlp[0]
    assert as_lines(mlp, torch.rand(0, 7)).shape == (4, 0, 7)
    with torch.no_grad():
        assert as_lines(mlp, torch.rand(0, 7)).shape == (4, 0, 7)


def test_fire_default_threshold_is_a_quarter_of_train_len():
    scheme = SCHEMES["fire"](tiny("fire", train_len=64))
    assert scheme.init_L.item() == 16.0 and scheme.c.tolist() == pytest.approx([0.1, 0.1])
    with pytest.raises(PosbenchError, match="init_L='far' must be a positive number"):
        SCHEMES["fire"](tiny("fire", options={"init_L": "far"}))


# --- randomized positions ------------------------------------------------------------------


def test_randomized_positions_while_training():
    scheme = SCHEMES["randomized"](tiny("randomized", options={"max_pos": 200})).train()
    torch.manual_seed(3)
    a = scheme.positions(50, "cpu")
    torch.manual_seed(3)
    b = scheme.positions(50, "cpu")
    c = scheme.positions(50, "cpu")
    assert torch.equal(a, b) and not torch.equal(b, c)  # deterministic under a seed, fresh per call
    for p in (a, c):
        assert p.shape == (50,) and p.min() >= 0 and p.max() < 200
        assert torch.all(p[1:] > p[:-1])  # sorted, distinct
    assert a.max() >= 50  # not just 0..T-1


def test_randomized_bases_and_consecutive_positions_at_evaluation():
    model = TransformerLM(tiny("randomized", options={"base": "rope", "eval_positions": "consecutive"})).eval()
    assert torch.equal(model.scheme.positions(30, "cpu"), torch.arange(30)) and model.max_len is None
    assert SCHEMES["randomized"].options["max_pos"] == 1024
    rope = SCHEMES["rope"](tiny("rope"))
    q = torch.randn(1, 4, 5, 8)
    pos = torch.tensor([3, 40, 41, 90, 700])
    assert torch.allclose(model.scheme.rotate(q, q, pos, 0)[0], rope.rotate(q, q, pos, 0)[0])
    with pytest.raises(PosbenchError, match="base='noisy_rope': a modifier's base is a scheme, not another modifier"):
        SCHEMES["randomized"](tiny("randomized", options={"base": "noisy_rope"}))
    with pytest.raises(PosbenchError, match="base='ropee': unknown scheme 'ropee'"):
        SCHEMES["randomized"](tiny("randomized", options={"base": "ropee"}))
    with pytest.raises(PosbenchError, match="max_pos=8 is shorter than model.train_len=16"):
        SCHEMES["randomized"](tiny("randomized", options={"max_pos": 8}))
    with pytest.raises(PosbenchError, match="eval_positions='sampled': expected one of fresh, fixed, consecutive"):
        SCHEMES["randomized"](tiny("randomized", options={"eval_positions": "sampled"}))


def sorted_draw(p, T, M):
    return p.shape == (T,) and p.min() >= 0 and p.max() < M and bool(torch.all(p[1:] > p[:-1]))


def test_randomized_draws_fresh_positions_for_every_batch_at_evaluation_as_the_reference():
    """google-deepmind/randomized_positional_encodings draws sorted random positions at
    evaluation too, a new draw for every batch: that is the default. The k-th draw at a length
    is the same for every model built from the config, again after eval() or restart_draws(),
    and whatever other lengths were drawn in between, so an evaluation repeats exactly."""
    assert SCHEMES["randomized"].options["eval_positions"] == "fresh"
    scheme = SCHEMES["randomized"](tiny("randomized", options={"max_pos": 200})).eval()
    a = [scheme.positions(50, "cpu") for _ in range(3)]
    assert all(sorted_draw(p, 50, 200) for p in a) and max(p.max() for p in a) >= 50
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])  # fresh for every batch
    scheme.eval()
    b = [scheme.positions(50, "cpu"), scheme.positions(60, "cpu"), scheme.positions(50, "cpu")]
    assert torch.equal(b[0], a[0]) and torch.equal(b[2], a[1])  # the 60 in between changes nothing
    assert sorted_draw(b[1], 60, 200)
    scheme.restart_draws()
    assert torch.equal(scheme.positions(50, "cpu"), a[0])
    other = SCHEMES["randomized"](tiny("randomized", options={"max_pos": 200})).eval()
    assert torch.equal(other.positions(50, "cpu"), a[0])
    assert scheme.max_len == 200

    torch.manual_seed(0)
    model = TransformerLM(tiny("randomized", options={"max_pos": 20}))
    tokens = torch.randint(0, 256, (60,))
    rows = [evaluate_model(model, tokens, [16, 20, 24], 2, torch.device("cpu"))[0] for _ in range(2)]
    assert [r["status"] for r in rows[0]] == ["ok", "ok", "beyond-max-len"]
    assert [r["loss"] for r in rows[0][:2]] == [r["loss"] for r in rows[1][:2]]  # the same table again
    plain = TransformerLM(tiny("randomized", options={"max_pos": 20, "eval_positions": "consecutive"}))
    plain.load_state_dict(model.state_dict())  # the same weights scored at 0..T-1: another loss
    assert evaluate_model(plain, tokens, [16], 2, torch.device("cpu"))[0][0]["loss"] != rows[0][0]["loss"]


def test_randomized_can_draw_once_per_length_at_evaluation():
    """eval_positions: fixed gives one sorted draw from [0, max_pos) per length, the same for
    every batch and every time, and makes max_pos the longest length it can score."""
    scheme = SCHEMES["randomized"](tiny("randomized", options={"max_pos": 200, "eval_positions": "fixed"})).eval()
    a, b, c = scheme.positions(50, "cpu"), scheme.positions(50, "cpu"), scheme.positions(60, "cpu")
    assert torch.equal(a, b) and a.max() >= 50 and sorted_draw(a, 50, 200)
    assert c.shape == (60,) and not torch.equal(c[:50], a)
    assert torch.equal(a, torch.randperm(200, generator=torch.Generator().manual_seed(50))[:50].sort().values)
    assert scheme.max_len == 200
    model = TransformerLM(tiny("randomized", options={"max_pos": 20, "eval_positions": "fixed"}))
    rows, _ = evaluate_model(model, torch.randint(0, 256, (60,)), [16, 20, 24], 4, torch.device("cpu"))
    assert [r["status"] for r in rows] == ["ok", "ok", "beyond-max-len"]


def test_randomized_trains_on_its_positions():
    """The model really uses them: the same tokens give different logits in train and eval."""
    torch.manual_seed(0)
    model = TransformerLM(tiny("randomized"))
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert not torch.allclose(model.train()(x), model.eval()(x), atol=1e-4)


@pytest.mark.parametrize("base", ["nope", "sinusoidal", "learned", "t5", "xl", "rope", "alibi", "hybrid"])
def test_noisy_scheme_feeds_its_base_sorted_random_positions_and_offset_a_random_start(base):
    """noisy_<scheme> (Ruoss et al.'s NOISY_) trains the base scheme on a sorted random subset of
    [0, max_pos), fresh per batch; offset_<scheme> on k..k+T-1 for a random k <= max_pos - T,
    and 0..T-1 at evaluation. The base's hooks see those positions: its bias at them equals the
    modified scheme's."""
    noisy = TransformerLM(tiny(f"noisy_{base}", options={"max_pos": 200})).train()
    offset = TransformerLM(tiny(f"offset_{base}", options={"max_pos": 200})).train()
    torch.manual_seed(5)
    a = noisy.scheme.positions(16, "cpu")
    b = offset.scheme.positions(16, "cpu")
    assert sorted_draw(a, 16, 200) and a.max() >= 16
    assert torch.equal(b, torch.arange(b[0].item(), b[0].item() + 16)) and 0 <= b[0] <= 200 - 16
    starts = {offset.scheme.positions(16, "cpu")[0].item() for _ in range(20)}
    assert len(starts) > 1 and torch.equal(offset.eval().scheme.positions(16, "cpu"), torch.arange(16))
    q = torch.randn(1, 4, 16, 8)  # (B, H, T, D)
    got = noisy.scheme.bias(q, q, a, a, 0)
    want = noisy.scheme.inner.bias(q, q, a, a, 0)
    assert (got is None and want is None) or torch.equal(got, want)
    x = torch.randint(0, 256, (2, 16))
    for model in (noisy, offset):  # trains: a finite loss with gradients
        loss = torch.nn.functional.cross_entropy(model.train()(x).flatten(0, 1), x.flatten())
        loss.backward()
        assert torch.isfinite(loss)


def test_a_modifier_takes_its_base_s_options_and_randomized_takes_any_base():
    """noisy_rope's options are the modifier's and rope's (its own `base`, the RoPE base, stays
    rope's); randomized with base alibi is noisy_alibi; a modifier of a modifier is refused."""
    scheme = TransformerLM(tiny("noisy_rope", options={"max_pos": 200, "base": 500.0})).scheme
    assert scheme.inner.opt == {**SCHEMES["rope"].options, "base": 500.0} and scheme.opt["max_pos"] == 200
    torch.manual_seed(1)
    via_option = TransformerLM(tiny("randomized", options={"base": "alibi", "max_pos": 200}))
    torch.manual_seed(1)
    by_name = TransformerLM(tiny("noisy_alibi", options={"max_pos": 200}))
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(via_option.eval()(x), by_name.eval()(x))
    with pytest.raises(PosbenchError, match="scheme 'noisy_noisy_rope': its base 'noisy_rope' is itself a modifier"):
        SCHEMES.lookup("noisy_noisy_rope")  # refused by name, before any model is built
    with pytest.raises(PosbenchError, match="scheme 'offset_randomized': its base 'randomized' is itself a modifier"):
        SCHEMES.lookup("offset_randomized")
    with pytest.raises(PosbenchError, match="scheme 'noisy_ropee': unknown scheme 'ropee'"):
        SCHEMES.lookup("noisy_ropee")
    # positions 0..T-1 at evaluation reach as far as the base encodes: learned's 64 rows, not past
    consecutive = TransformerLM(
        tiny("noisy_learned", options={"max_len": 64, "max_pos": 64, "eval_positions": "consecutive"})
    )
    assert consecutive.max_len == 64
    assert SCHEMES["offset"].options["base"] == "sinusoidal"  # NoPE would ignore the positions it draws
    with pytest.raises(PosbenchError, match="encodes at most 48 positions"):
        TransformerLM(tiny("noisy_learned", options={"max_len": 48}))
    assert {"noisy_<scheme>", "offset_<scheme>"} <= set(dict(catalogue()))


def test_a_scheme_and_its_noisy_self_are_two_rows_of_one_experiment(tmp_path):
    """rope and noisy_rope train in one experiment, each a row of the table."""
    exp, res, _ = smoke_experiment(
        tmp_path, "--schemes", "rope,noisy_rope", "--set", "scheme_options.noisy_rope.max_pos=128"
    )
    md = (exp / "summary.md").read_text()
    assert "| rope |" in md and "| noisy_rope |" in md
    cfg = yaml.safe_load((exp / "noisy_rope-seed0" / "config.yaml").read_text())
    assert cfg["model"]["options"] == {"max_pos": 128, "eval_positions": "fresh", "base": 10000.0}


# --- CoPE --------------------------------------------------------------------------------------


def sig(x):
    return 1 / (1 + math.exp(-x))


def cope_bias(table):
    """One head, d = 2, queries q = (1,0), (1,1), (1,-1) and keys k = (0,0), (2,0), (0,2)."""
    scheme = SCHEMES["cope"](tiny("cope", n_head=1, d_model=2, options={"npos_max": 4}))
    with torch.no_grad():
        scheme.pos_emb[0].copy_(torch.tensor([table, [0.0] * 4]))  # e[p] = (table[p], 0)
    q = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]]).view(1, 1, 3, 2)
    k = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]]).view(1, 1, 3, 2)
    return scheme.bias(q, k, torch.arange(3), torch.arange(3), 0)[0, 0]  # (3, 3)


# gates g_it = sigmoid(q_i.k_t / sqrt 2): q_i.k_0 = 0 -> 1/2; q_1.k_1 = 2 and q_2.k_1 = 2 ->
# sigmoid(sqrt 2) = 0.804429; q_2.k_2 = -2 -> sigmoid(-sqrt 2) = 0.195571.
# p_ij = sum_{t=j..i} g_it: p_00 = 0.5; p_10 = 1.304429, p_11 = 0.804429;
# p_20 = 1.5, p_21 = 1.0, p_22 = 0.195571.
P = {
    (0, 0): 0.5,
    (1, 0): 0.5 + sig(math.sqrt(2)),
    (1, 1): sig(math.sqrt(2)),
    (2, 0): 0.5 + sig(math.sqrt(2)) + sig(-math.sqrt(2)),
    (2, 1): sig(math.sqrt(2)) + sig(-math.sqrt(2)),
    (2, 2): sig(-math.sqrt(2)),
}


def test_cope_positions_are_gate_sums():
    """With e[p] = (p, 0) and q_i[0] = 1, the bias is q_i.e[p_ij] = p_ij (linear interpolation of
    a linear table is exact)."""
    b = cope_bias([0.0, 1.0, 2.0, 3.0])
    assert P[1, 0] == pytest.approx(1.304429, abs=1e-6) and P[2, 2] == pytest.approx(0.195571, abs=1e-6)
    for (i, j), p in P.items():
        assert b[i, j].item() == pytest.approx(p, abs=1e-5), (i, j)


def test_cope_interpolates_between_floor_and_ceil_and_clamps():
    # e[p] = p^2 at integers: p_10 = 1.304429 -> 1 + 0.304429 * (4 - 1) = 1.913287
    b = cope_bias([0.0, 1.0, 4.0, 9.0])
    assert b[1, 0].item() == pytest.approx(1 + (P[1, 0] - 1) * 3, abs=1e-5)
    assert b[2, 2].item() == pytest.approx(P[2, 2] * 1.0, abs=1e-5)  # between e[0]=0 and e[1]=1
    # npos_max = 4: positions clamp at 3. Gates of 1 for 6 keys would count 6; clamped -> e[3].
    scheme = SCHEMES["cope"](tiny("cope", n_head=1, d_model=2, options={"npos_max": 4}))
    with torch.no_grad():
        scheme.pos_emb[0].copy_(torch.tensor([[0.0, 1.0, 4.0, 9.0], [0.0] * 4]))
    q = torch.tensor([1.0, 0.0]).expand(1, 1, 6, 2)
    k = torch.tensor([100.0, 0.0]).expand(1, 1, 6, 2)  # q.k / sqrt 2 = 70.7: every gate is 1
    b = scheme.bias(q, k, torch.arange(6), torch.arange(6), 0)[0, 0]
    assert b[5, 0].item() == pytest.approx(9.0) and b[5, 4].item() == pytest.approx(4.0)


def test_cope_ignores_keys_after_the_query():
    b1 = cope_bias([0.0, 1.0, 4.0, 9.0])
    scheme = SCHEMES["cope"](tiny("cope", n_head=1, d_model=2, options={"npos_max": 4}))
    with torch.no_grad():
        scheme.pos_emb[0].copy_(torch.tensor([[0.0, 1.0, 4.0, 9.0], [0.0] * 4]))
    q = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]]).view(1, 1, 3, 2)
    k = torch.tensor([[0.0, 0.0], [2.0, 0.0], [5.0, -7.0]]).view(1, 1, 3, 2)  # k_2 changed
    b2 = scheme.bias(q, k, torch.arange(3), torch.arange(3), 0)[0, 0]
    assert torch.allclose(b1[:2, :2], b2[:2, :2]) and not torch.isclose(b1[2, 0], b2[2, 0])


@pytest.mark.skipif(native.load("cope") is None, reason=f"no CoPE kernel here: {native.unavailable.get('cope')}")
@pytest.mark.parametrize("q0,npos", [(0, 64), (0, 5), (7, 5)])
def test_cope_kernel_matches_attention_with_the_paper_bias(q0, npos):
    """cope.c's attention equals softmax(q.k / sqrt(d) + CoPE.bias, future masked) v, CoPE.bias
    being the paper's listing left to autograd: the output and the gradients of q, k, v and
    the table, with (npos 5) and without clamping, for a whole square and for a block of
    queries 7..19 against keys 0..19."""
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 20, 8
    scheme = SCHEMES["cope"](tiny("cope", n_head=H, d_model=H * D, options={"npos_max": npos}))
    table = scheme.pos_emb[0]  # (D, npos)
    with torch.no_grad():
        table.normal_()
    q = torch.randn(B, H, T - q0, D, requires_grad=True)
    k = torch.randn(B, H, T, D, requires_grad=True)
    v = torch.randn(B, H, T, D, requires_grad=True)
    qpos, kpos = torch.arange(q0, T), torch.arange(T)
    d_out = torch.randn(B, H, T - q0, D)

    def by_bias():
        logits = q @ k.transpose(-1, -2) * D**-0.5 + scheme.bias(q, k, qpos, kpos, 0)  # (B, H, Tq, T)
        future = kpos[None, :] > qpos[:, None]
        return logits.masked_fill(future, float("-inf")).softmax(-1) @ v  # (B, H, Tq, D)

    results = []
    for attention in (lambda: native.cope_attention(q, k, v, table, qpos, kpos), by_bias):
        out = attention()
        assert out is not None  # the kernel took these inputs rather than decline
        results.append((out, *torch.autograd.grad(out, (q, k, v, table), d_out)))
    for what, got, want in zip(("output", "q", "k", "v", "table"), *results):
        assert torch.allclose(got, want, atol=1e-5), (what, (got - want).abs().max())
    if npos == 5:
        bias = scheme.bias(q, k, qpos, kpos, 0).detach()
        assert (bias == (q @ table)[..., -1:].detach()).any()  # some positions did clamp


# --- RoPE scaled at evaluation time, from the command line -----------------------------------


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """rope and alibi trained as configs/smoke.yaml says (30 steps, L = 32) on a tiny corpus."""
    exp, _, text = smoke_experiment(tmp_path_factory.mktemp("catalogue"), "--schemes", "rope,alibi")
    return exp, text


def read_rows(path):
    return list(csv.DictReader(open(path)))


def test_evaluate_rope_scaling_adds_rows_and_report_rebuilds_them(tiny_runs, tmp_path):
    exp0, _ = tiny_runs
    exp = tmp_path / "smoke"
    shutil.copytree(exp0, exp)
    run = exp / "rope-seed0"
    res = invoke("evaluate", run, "--rope-scaling", "yarn,linear,llama3", "--lengths", "32,64")
    assert res.exit_code == 0, res.output
    assert "rope+yarn" in res.output and "rope+llama3" in res.output
    rows = {(r["scheme"], int(r["length"])): r for r in read_rows(run / "eval.csv")}
    assert {(f"rope+{kind}", L) for kind in ("yarn", "linear", "llama3") for L in (32, 64)} <= set(rows)
    assert {L for s, L in rows if s == "rope"} == {32, 48, 64}  # the plain rows are kept
    # at the training length s = 1, and every scaling is the identity: the same loss as rope
    for kind in ("yarn", "linear", "llama3"):
        assert float(rows[f"rope+{kind}", 32]["loss"]) == pytest.approx(float(rows["rope", 32]["loss"]), rel=1e-6)
        assert float(rows[f"rope+{kind}", 64]["loss"]) != pytest.approx(float(rows["rope", 64]["loss"]), rel=1e-6)
    # report rebuilds the rows from the run folders' eval.csv alone
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    summary = read_rows(exp / "summary.csv")
    assert list(summary[0]) == [
        "scheme",
        "seed",
        "train_len",
        "length",
        "protocol",
        "stride",
        "loss",
        "ppl",
        "bpb",
        "tokens",
        "status",
        "attention",
        "tokenizer",
    ]
    schemes = list(dict.fromkeys(r["scheme"] for r in summary))
    assert schemes == ["rope", "rope+linear", "rope+llama3", "rope+yarn", "alibi"]  # variants follow their scheme
    md = (exp / "summary.md").read_text()
    assert "| rope+yarn |" in md and "evaluation-time variant" in md
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "summary.csv").unlink()
    assert invoke("report", copy).exit_code == 0
    assert (copy / "summary.csv").read_text() == (exp / "summary.csv").read_text()


@pytest.mark.parametrize("kind", ["ntk", "llama3"])
def test_evaluate_with_a_fixed_factor_labels_it(tiny_runs, tmp_path, kind):
    exp0, _ = tiny_runs
    run = tmp_path / "rope-seed0"
    shutil.copytree(exp0 / "rope-seed0", run)
    res = invoke("evaluate", run, "--rope-scaling", kind, "--rope-factor", "2", "--lengths", "32")
    assert res.exit_code == 0, res.output
    rows = {(r["scheme"], int(r["length"])): r for r in read_rows(run / "eval.csv")}
    assert (f"rope+{kind}@2", 32) in rows and (f"rope+{kind}", 32) not in rows
    # s = 2 even at the training length, so it is no longer the identity there
    assert float(rows[f"rope+{kind}@2", 32]["loss"]) != pytest.approx(float(rows["rope", 32]["loss"]), rel=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["alibi-seed0", "--rope-scaling", "yarn"], "scheme 'alibi' has no evaluation-time variant 'yarn'"),
        (["rope-seed0", "--rope-scaling", "yarm"], "has no evaluation-time variant 'yarm'"),
        (["rope-seed0", "--rope-factor", "2"], "--rope-factor needs --rope-scaling"),
        (["rope-seed0", "--rope-scaling", "yarn", "--rope-factor", "0.5"], "must be >= 1"),
        (["rope-seed0", "--rope-scaling", "yarn,longrope"], "longrope needs short_factor and long_factor"),
    ],
)
def test_evaluate_rope_scaling_errors_are_one_line(tiny_runs, args, message):
    exp, _ = tiny_runs
    before = (exp / "rope-seed0" / "eval.csv").read_text()
    res = invoke("evaluate", exp / args[0], *args[1:])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert message in " ".join(res.output.split()), res.output
    assert "its options leave no part" not in res.output  # options explain a pattern's lack, not alibi's
    assert (exp / "rope-seed0" / "eval.csv").read_text() == before


def test_evaluate_adds_training_free_rows_for_rope_and_alibi(tiny_runs, tmp_path):
    """--rope-scaling takes the training-free variants (docs/schemes.md) for any relative scheme:
    rows rope+self_extend, rope+logn, alibi+rerope. logn is 1 up to the training length, so it
    scores rope there exactly; rerope clips distances past L/4, so it changes rope at 64."""
    exp0, _ = tiny_runs
    for run, kinds in (("rope-seed0", "self_extend,rerope,logn"), ("alibi-seed0", "rerope")):
        shutil.copytree(exp0 / run, tmp_path / run)
        res = invoke("evaluate", tmp_path / run, "--rope-scaling", kinds, "--lengths", "32,64")
        assert res.exit_code == 0, res.output
    rows = {(r["scheme"], int(r["length"])): r for r in read_rows(tmp_path / "rope-seed0" / "eval.csv")}
    assert {(f"rope+{kind}", L) for kind in ("self_extend", "rerope", "logn") for L in (32, 64)} <= set(rows)
    assert float(rows["rope+logn", 32]["loss"]) == pytest.approx(float(rows["rope", 32]["loss"]), rel=1e-5)
    assert float(rows["rope+rerope", 64]["loss"]) != pytest.approx(float(rows["rope", 64]["loss"]), rel=1e-5)
    alibi = {(r["scheme"], int(r["length"])) for r in read_rows(tmp_path / "alibi-seed0" / "eval.csv")}
    assert {("alibi+rerope", 32), ("alibi+rerope", 64)} <= alibi


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rope-scaling", "rerope", "--rope-factor", "2.5"], "rerope's factor is the window w, a whole number"),
        (["--rope-scaling", "self_extnd"], "has no evaluation-time variant 'self_extnd'"),
    ],
)
def test_evaluate_training_free_errors_are_one_line(tiny_runs, args, message):
    exp, _ = tiny_runs
    before = (exp / "rope-seed0" / "eval.csv").read_text()
    res = invoke("evaluate", exp / "rope-seed0", *args)
    assert res.exit_code != 0 and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert message in " ".join(res.output.split()), res.output
    assert (exp / "rope-seed0" / "eval.csv").read_text() == before


def test_extrapolate_rope_scaling_adds_rows_without_retraining(tiny_runs, tmp_path):
    _, text = tiny_runs
    out = tmp_path / "results"
    args = [
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "rope,alibi",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.steps=5",
    ]
    assert invoke(*args).exit_code == 0
    stamp = (out / "smoke" / "rope-seed0" / "model.pt").stat().st_mtime_ns
    res = invoke(*args, "--rope-scaling", "dynamic")
    assert res.exit_code == 0, res.output
    assert "already trained" in res.output and "rope+dynamic" in res.output
    assert (out / "smoke" / "rope-seed0" / "model.pt").stat().st_mtime_ns == stamp
    summary = read_rows(out / "smoke" / "summary.csv")
    assert {int(r["length"]) for r in summary if r["scheme"] == "rope+dynamic"} == {32, 48, 64}
    assert not any(r["scheme"].startswith("alibi+") for r in summary)
    assert "alibi+" not in (out / "smoke" / "alibi-seed0" / "eval.csv").read_text()


def test_extrapolate_refuses_longrope_before_training(tiny_runs, tmp_path):
    _, text = tiny_runs
    out = tmp_path / "results"
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "rope,alibi", "--set", f"out_dir={out}",
        "--set", f"data.path={text}", "--rope-scaling", "longrope",
    )  # fmt: skip
    assert res.exit_code != 0 and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert "longrope needs short_factor and long_factor" in " ".join(res.output.split()), res.output
    assert not (out / "smoke" / "rope-seed0").exists()


def test_evaluate_with_a_variant_scores_plain_rope_and_the_training_length_too(tiny_runs, tmp_path):
    """So that `report` gives both rows a ratio: each ratio needs its scheme's row at the
    training length, and rope+yarn is compared with plain rope at every length."""
    exp, _ = tiny_runs
    run = tmp_path / "rope-seed0"
    shutil.copytree(exp / "rope-seed0", run)
    train_len = yaml.safe_load((run / "config.yaml").read_text())["model"]["train_len"]
    res = invoke("evaluate", run, "--lengths", str(2 * train_len), "--rope-scaling", "yarn")
    assert res.exit_code == 0, res.output
    have = {(r["scheme"], int(r["length"])) for r in csv.DictReader((run / "eval.csv").open())}
    for scheme in ("rope", "rope+yarn"):
        assert {(scheme, train_len), (scheme, 2 * train_len)} <= have


def test_fire_gathers_on_a_gpu_sum_their_gradient_by_a_bincount_equal_to_index_selects():
    """SegmentGather (FIRE's gathers where a gradient is taken on a GPU) is index_select forward;
    backward, each (head, segment) cell's sum by one bincount equals index_select's index_add,
    an unused segment's gradient included (zero), in the table's dtype."""
    from posbench.schemes.fire import SegmentGather

    torch.manual_seed(0)
    table = torch.randn(3, 7, requires_grad=True)  # (H, S): segment 6 is never read
    seg = torch.randint(0, 6, (500,))
    grad = torch.randn(3, 500)
    out = SegmentGather.apply(table, seg)
    assert torch.equal(out, table.index_select(1, seg))
    (mine,) = torch.autograd.grad((out * grad).sum(), table)
    (theirs,) = torch.autograd.grad((table.index_select(1, seg) * grad).sum(), table)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert mine.dtype == table.dtype and torch.equal(mine[:, 6], torch.zeros(3))
    by_hand = torch.zeros(3, 7).index_put_((torch.arange(3)[:, None], seg[None, :]), grad, accumulate=True)
    torch.testing.assert_close(mine, by_hand, rtol=1e-5, atol=1e-5)
