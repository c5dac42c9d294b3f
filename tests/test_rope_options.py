"""RoPE's options (fraction, keep, hope) and SSMax, each against a slow reference written from
its formula on random inputs, or against transformers' own code for the same thing."""

import math

import pytest
import torch
from conftest import folded, invoke, tiny

from posbench.attention import causal_attention
from posbench.errors import PosbenchError
from posbench.rope_law import rotary
from posbench.schemes import SCHEMES, build_scheme


def scheme_with(name="rope", d=32, H=2, L=100, n_layer=2, **options):
    cfg = tiny(name, options=options, d_model=H * d, n_head=H, train_len=L, n_layer=n_layer)
    return build_scheme(cfg)


def slow_rotate(x, pos, thetas, attention=1.0):
    """Each pair (k, k + R/2) of the first R = 2 len(thetas) dims turned by pos * theta_k with a
    2x2 rotation, one pair and one position at a time; dims R.. unchanged. x (B, H, T, D)."""
    x = x.double()
    out = x.clone()
    R = 2 * len(thetas)
    for t, p in enumerate(pos.tolist()):
        for j, th in enumerate(thetas):
            a, b = x[:, :, t, j], x[:, :, t, j + R // 2]
            c, s = math.cos(p * th), math.sin(p * th)
            out[:, :, t, j] = attention * (a * c - b * s)
            out[:, :, t, j + R // 2] = attention * (a * s + b * c)
    return out


def paper_thetas(R, base, kept):
    """theta_k = base^(-2k/R) for the pairs in `kept`, 0 for the others, in plain floats."""
    return [base ** (-2 * j / R) if j in kept else 0.0 for j in range(R // 2)]


# --- fraction: transformers' partial rotary ----------------------------------------------------


@pytest.mark.parametrize("d,fraction", [(32, 0.25), (32, 0.5), (32, 0.75), (24, 0.25), (20, 0.5), (32, 1.0)])
def test_fraction_equals_gpt_neox_partial_rotary(d, fraction):
    """GPT-NeoX's rotary_pct through transformers' own rotary embedding and apply_rotary_pos_emb."""
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    H, T, base = 2, 40, 10000.0
    params = {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": fraction}
    hf = GPTNeoXRotaryEmbedding(GPTNeoXConfig(hidden_size=H * d, num_attention_heads=H, rope_parameters=params))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, H, T, d, generator=g), torch.randn(3, H, T, d, generator=g)
    pos = torch.arange(T)
    cos, sin = hf(q, pos[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    scheme = scheme_with(d=d, H=H, fraction=fraction)
    got_q, got_k = scheme.rotate(q, k, pos, 0)
    assert scheme.rotary_dim == int(fraction * d) == cos.size(-1)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    R = scheme.rotary_dim
    assert torch.equal(got_q[..., R:], q[..., R:])  # the rest passes unchanged


@pytest.mark.parametrize("kind,extra", [("linear", {}), ("yarn", {})])
def test_a_variant_scales_the_rotated_dims_as_transformers_does_with_partial_rotary_factor(kind, extra):
    """transformers' ROPE_INIT_FUNCTIONS with partial_rotary_factor 0.25, head dim 32, at s = 4."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d, L = 32, 100
    params = {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.25}
    params["original_max_position_embeddings"] = L
    cfg = LlamaConfig(
        hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=L, rope_parameters=params
    )
    want, want_att = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    scheme = scheme_with(d=d, L=L, fraction=0.25)
    with scheme.eval_variant(kind, L, 4 * L):
        inv, att = scheme.theta(4 * L)
    torch.testing.assert_close(inv, want.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att)


# --- keep (p-RoPE) and hope (HoPE): against a slow rotation of the paper's frequencies --------


@pytest.mark.parametrize("d,keep", [(32, 0.25), (32, 0.5), (32, 0.75), (16, 0.6), (32, 1.0)])
def test_keep_equals_transformers_proportional_rope(d, keep):
    """p-RoPE as transformers' `proportional` rope type (Gemma's): theta_k = base^(-2k/d) for
    the first int(keep * d // 2) pairs, 0 for the rest."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": keep}
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, None)
    inv, _ = scheme_with(d=d, keep=keep).theta(50)
    torch.testing.assert_close(inv, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "options",
    [{"keep": 0.25}, {"keep": 0.5}, {"hope": True}, {"fraction": 0.5, "keep": 0.5}, {"fraction": 0.5, "hope": True}],
)
def test_keep_and_hope_rotate_as_the_papers_write_it(options):
    d, L, base, T = 32, 100, 10000.0, 50
    scheme = scheme_with(d=d, L=L, **options)
    R = int(options.get("fraction", 1.0) * d)
    kept = set(range(int(options.get("keep", 1.0) * R // 2)))
    if options.get("hope"):  # HoPE: the pairs that turn whole within the training length
        kept &= {j for j in range(R // 2) if 2 * math.pi * base ** (2 * j / R) <= L}
    assert 0 < len(kept) < R // 2
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, T, d, generator=g), torch.randn(2, 2, T, d, generator=g)
    pos = torch.arange(T)
    got_q, got_k = scheme.rotate(q, k, pos, 0)
    thetas = paper_thetas(R, base, kept)
    torch.testing.assert_close(got_q.double(), slow_rotate(q, pos, thetas), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.double(), slow_rotate(k, pos, thetas), rtol=1e-5, atol=1e-5)


def test_hope_keeps_the_pairs_that_turn_whole_within_the_training_length():
    # d 32, base 10^4: wavelength 2 pi 10^(k/4) = 6.3, 11.2, 19.9, 35.3, 62.8, 111.7, 198.7, 353.3, ...
    assert scheme_with(hope=True, L=100).kept.tolist() == [True] * 5 + [False] * 11
    assert scheme_with(hope=True, L=200).kept.tolist() == [True] * 7 + [False] * 9
    with pytest.raises(PosbenchError, match="no pair's wavelength"):
        scheme_with(hope=True, L=6)


def test_zero_frequencies_stay_zero_under_every_variant_and_q_k_stays_relative():
    scheme = scheme_with(keep=0.5)
    for kind in ("linear", "ntk", "dynamic", "yarn", "llama3"):
        with scheme.eval_variant(kind, 100, 400):
            inv, _ = scheme.theta(400)
        assert (inv[8:] == 0).all() and (inv[:8] > 0).all(), kind
    # with pairs left unrotated, q_i.k_j still depends on i - j only
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g)
    scores = []
    for shift in (0, 7, 30):
        pos = torch.tensor([shift, shift + 5])
        qr, _ = scheme.rotate(q.expand(1, 2, 2, 32), k.expand(1, 2, 2, 32), pos, 0)
        _, kr = scheme.rotate(q.expand(1, 2, 2, 32), k.expand(1, 2, 2, 32), pos, 0)
        scores.append(float(qr[0, 0, 1] @ kr[0, 0, 0]))
    assert scores == pytest.approx([scores[0]] * 3, rel=1e-5)


def test_rope_law_takes_the_rotated_dims_and_refuses_keep_and_hope():
    class Cfg:
        def __init__(self, scheme, **options):
            self.model = tiny(scheme, options={"base": 10000.0, **options}, d_model=128, n_head=4)

    assert rotary(Cfg("rope")) == (32, 10000.0)
    assert rotary(Cfg("rope", fraction=0.25)) == (8, 10000.0)
    assert rotary(Cfg("ssmax", fraction=0.5)) == (16, 10000.0)
    assert rotary(Cfg("rope", keep=0.5)) is None and rotary(Cfg("rope", hope=True)) is None


@pytest.mark.parametrize(
    "options,says",
    [
        ({"fraction": 1.5}, "fraction=1.5 must be in (0, 1]"),
        ({"keep": 0.0}, "keep=0.0 must be positive"),
        ({"fraction": 0.03}, "rotates int(0.03 * 32) = 0 dims"),
        ({"fraction": 0.3}, "rotates int(0.3 * 32) = 9 dims"),
        ({"keep": 0.01}, "keeps int(0.01 * 32 // 2) = 0 pairs"),
        ({"hope": "yes"}, "hope: expected bool"),
    ],
)
def test_bad_options_are_one_line(options, says):
    with pytest.raises(PosbenchError, match=None) as e:
        scheme_with(**options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_check_scheme_and_a_pattern_carry_the_options():
    res = invoke("check-scheme", "rope", "--set", "fraction=2.0")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output  # the option, not the scheme
    assert "--set fraction=2.0: scheme_options.rope.fraction=2.0 must be in (0, 1]" in folded(res.output)
    res = invoke("check-scheme", "rope", "--set", "fraction=0.5", "--set", "keep=0.5")  # head dim 8: 4 dims, 1 pair
    assert res.exit_code == 0, res.output
    res = invoke("check-scheme", "ssmax", "--set", "bias=true")
    assert res.exit_code == 0, res.output
    layers = [{"scheme": "rope", "options": {"fraction": 0.25}}, {"scheme": "rope", "options": {"hope": True}}]
    pattern = scheme_with("pattern_mine", layers=layers)
    assert [s.rotary_dim for s in pattern.at] == [int(0.25 * 32), 32]
    assert pattern.at[1].kept.sum() == 5


# --- SSMax: the paper's logits, n = the keys a query sees --------------------------------------


def ssmax_reference(q, k, v, pos, thetas, s, b):
    """softmax_j((s_h log n_i + b_h) * (R_i q_i).(R_j k_j) / sqrt(d)) v_j over j <= i, n_i = i + 1,
    a query row at a time; q, k, v (B, H, T, D), s and b (H,)."""
    qr, kr = slow_rotate(q, pos, thetas), slow_rotate(k, pos, thetas)
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for i in range(T):
        factor = s.double()[:, None] * math.log(i + 1) + b.double()[:, None]  # (H, 1)
        logits = (qr[:, :, i : i + 1] @ kr[:, :, : i + 1].transpose(-1, -2))[:, :, 0] / math.sqrt(D)  # (B, H, i+1)
        out[:, :, i] = ((factor * logits).softmax(-1)[..., None] * v.double()[:, :, : i + 1]).sum(2)
    return out


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("options", [{}, {"bias": True, "fraction": 0.5}])
def test_ssmax_attention_is_the_papers_formula_also_on_blocks_of_queries(backend, options):
    d, H, T = 16, 2, 40
    scheme = scheme_with("ssmax", d=d, H=H, **options)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in scheme.parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.2)  # s_h, b_h away from their start
    q, k, v = (torch.randn(2, H, T, d, generator=g) * 2 for _ in range(3))
    pos = torch.arange(T)
    layer = 1
    s = scheme.s[layer].detach()
    b = scheme.b[layer].detach() if scheme.b is not None else torch.zeros(H)
    R = scheme.rotary_dim
    want = ssmax_reference(q, k, v, pos, paper_thetas(R, 10000.0, set(range(R // 2))), s, b)
    with torch.no_grad():
        qr, kr = scheme.rotate(q, k, pos, layer)
        for block in (None, 16):  # the model's blocks of queries, each seeing keys 0..its last
            got = causal_attention(qr, kr, v, pos, scheme, layer, backend, block)
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_ssmax_starts_as_rope_at_the_training_length_and_drops_yarn():
    scheme = scheme_with("ssmax", L=100)
    for s in scheme.s:
        assert torch.allclose(s, torch.full_like(s, 1 / math.log(100)))
    assert scheme_with("ssmax", s=0.43).s[0][0].item() == pytest.approx(0.43)
    assert "yarn" not in SCHEMES["ssmax"].eval_variants and "llama3" in SCHEMES["ssmax"].eval_variants
    with pytest.raises(PosbenchError, match="s=-1"):
        scheme_with("ssmax", s=-1)


def test_fraction_and_keep_differ_as_docs_schemes_md_works_them_at_d_32():
    """fraction 0.25: 8 dims, theta = 10000^(-k/4); keep 0.25: 4 of 16 pairs, theta = 10000^(-k/16)."""
    fraction, _ = scheme_with(fraction=0.25).theta(10)
    keep, _ = scheme_with(keep=0.25).theta(10)
    assert fraction.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-6)
    assert keep.tolist() == pytest.approx([10 ** (-k / 4) for k in range(4)] + [0.0] * 12, rel=1e-6)
    assert 2 * math.pi / keep[3].item() == pytest.approx(35.3, abs=0.05)


@pytest.mark.plots
def test_inspect_draws_rope_with_its_options_and_ssmax(tmp_path):
    """inspect --set draws the scheme with those options, in a folder of its own; the
    rotation's score curve differs from full RoPE's; a bad option is one line."""
    from posbench import plots

    full = plots.rotation_scores(scheme_with(), 64)[1]
    partial = plots.rotation_scores(scheme_with(fraction=0.25), 64)[1]
    assert not torch.allclose(full, partial)
    res = invoke("inspect", "rope", "--set", "fraction=0.25", "--length", "24", "--out", tmp_path / "r")
    assert res.exit_code == 0 and (tmp_path / "r" / "rotation.png").exists(), res.output
    res = invoke("inspect", "ssmax", "--set", "bias=true", "--length", "24", "--out", tmp_path / "s")
    assert res.exit_code == 0 and (tmp_path / "s" / "rotation.png").exists(), res.output
    res = invoke("inspect", "rope", "--set", "keep=2.0", "--out", tmp_path / "bad")
    assert res.exit_code != 0 and "keep=2.0 must be in (0, 1]" in folded(res.output) and "Traceback" not in res.output


def test_runs_recorded_before_the_options_keep_their_identity():
    """rope's fraction, keep and hope are left out of a run's record at their defaults, so a
    rope run recorded before them (results/reference) is the same run today; set, they are in it."""
    from conftest import ROOT

    from posbench.config import load_config
    from posbench.experiment.records import read_config
    from posbench.resolve import resolve

    old = read_config(ROOT / "results" / "reference" / "rope-seed0")
    today = resolve(load_config(None, ["schemes=[rope,ssmax,noisy_rope]"])).cfg
    assert today.for_run("rope", 0).model.options == old.model.options == {"base": 10000.0}
    assert (
        today.scheme_options["noisy_rope"]["base"] == 10000.0 and "fraction" not in today.scheme_options["noisy_rope"]
    )
    assert set(today.scheme_options["ssmax"]) == set(SCHEMES["ssmax"].options)  # a new scheme records all
    partial = resolve(load_config(None, ["schemes=[rope]", "scheme_options.rope.fraction=0.25"])).cfg
    assert partial.for_run("rope", 0).model.options == {"base": 10000.0, "fraction": 0.25}
