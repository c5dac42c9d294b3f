"""The training-free variants (posbench/schemes/training_free.py) against their papers' formulas.

Each reference below writes the variant's remapped positions out pair by pair, from the paper
and its code, and scores attention by them with plain loops: RoPE rotated by hand, ALiBi's
penalty by hand. posbench's attention, computed in blocks of queries, must equal it.
"""

import math

import pytest
import torch

from posbench.check import tiny_model
from posbench.errors import PosbenchError
from posbench.schemes import SCHEMES, catalogue
from posbench.schemes.alibi import alibi_slopes
from posbench.schemes.training_free import SINKS, VARIANTS, remap
from tests.conftest import tiny

L, T, H, D = 16, 40, 4, 8  # trained at 16, scored at 40: every variant meets distances past L


def reference_positions(name: str, i: int, j: int, L: int, T: int):
    """(q position, k position, hidden) of query i and key j, as each paper's code writes them."""
    d = i - j
    if name == "self_extend":  # LongLM `self_extend_patch/Llama.py`: neighbour window W, group G
        W = L // 4
        G = math.ceil((T - W) / (L // 2 - W))  # LongLM's README's rule, W + (T - W)/G <= L/2
        return (i, j, False) if d < W else (i // G + W - W / G, j // G, False)
    if name == "rerope":  # bojone/rerope `rerope_patch.py`: q at w, k unrotated beyond the window
        w = L // 4
        return (i, j, False) if d < w else (w, 0, False)
    if name == "string":  # HKUNLP/STRING `string_for_llama.py`: q shifted by -S + local_value
        S = int(0.33 * L)
        W = min(128, S // 2)
        return (i, j, False) if d < S else (i - S + W, j, False)
    if name == "lm_infinite":  # LM-Infinite: distances capped at L; the Lambda mask keeps 10 + the last L
        hidden = d >= L and j >= 10
        return (i, j, hidden) if d < L else (L, 0, hidden)
    return i, j, False  # logn: positions as they are


def rope_rotate(x: torch.Tensor, p: float) -> torch.Tensor:
    """RoPE written out for one (D,) vector at position p: dims (k, k + D/2) turned by p base^(-2k/D)."""
    out = x.clone()
    for k in range(D // 2):
        a = p * 10000.0 ** (-2 * k / D)
        out[k] = x[k] * math.cos(a) - x[k + D // 2] * math.sin(a)
        out[k + D // 2] = x[k + D // 2] * math.cos(a) + x[k] * math.sin(a)
    return out


def reference_attention(name: str, scheme: str, q, k, v) -> torch.Tensor:
    """(H, T, D) attention outputs for one sequence, a pair at a time."""
    slopes = alibi_slopes(H)
    out = torch.zeros(H, T, D, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            scores = torch.full((T,), float("-inf"), dtype=torch.float64)
            for j in range(i + 1):
                a, b, hidden = reference_positions(name, i, j, L, T)
                if hidden:
                    continue
                if scheme == "rope":
                    s = rope_rotate(q[h, i], a) @ rope_rotate(k[h, j], b) / math.sqrt(D)
                else:  # alibi: -m_h times the remapped distance
                    s = q[h, i] @ k[h, j] / math.sqrt(D) - slopes[h].item() * (a - b)
                if name == "logn":  # Qwen's logn-attn: n = i + 1 keys seen, 1 inside L
                    s = s * max(1.0, math.log(i + 1) / math.log(L))
                scores[j] = s
            out[h, i] = scores.softmax(0) @ v[h]
    return out


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_is_its_papers_formula_across_query_blocks(name, scheme):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64) for _ in range(3))
    s = SCHEMES[scheme](tiny(scheme, train_len=L))
    pos = torch.arange(T)
    want = reference_attention(name, scheme, q[0], k[0], v[0])
    with s.eval_variant(name, L, T):
        for block in (None, 7):  # one block, and blocks of 7 queries (the last one short)
            got = s.remap.attention(q, k, v, pos, s, 0, block)
            torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)


def test_lm_infinite_never_lets_a_query_see_a_hidden_key():
    """Changing the values of the keys the Lambda mask hides from the last query (neither among the
    first 10 nor within the last L) leaves its output as it was; a visible key's value moves it."""
    torch.manual_seed(1)
    s = SCHEMES["rope"](tiny("rope", train_len=L))
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    pos, i = torch.arange(T), T - 1
    with s.eval_variant("lm_infinite", L, T):
        before = s.remap.attention(q, k, v, pos, s, 0, 8)
        hidden = v.clone()
        hidden[:, :, SINKS : i - L + 1] += 100.0  # keys 10 .. i-L: d >= L and past the sinks
        after = s.remap.attention(q, k, hidden, pos, s, 0, 8)
        torch.testing.assert_close(after[:, :, i], before[:, :, i])
        seen = v.clone()
        seen[:, :, SINKS - 1] += 100.0  # the last sink stays visible
        assert not torch.allclose(s.remap.attention(q, k, seen, pos, s, 0, 8)[:, :, i], before[:, :, i])


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5", "kerple_log", "fire"])
def test_a_model_inside_the_window_scores_as_trained_and_outside_it_does_not(scheme):
    """The model attends through the variant while it is active: within rerope's window w = L/4
    every distance is exact, so the logits are the scheme's own, by whatever backend; past it they change."""
    model = tiny_model(scheme, train_len=L)
    short, long = torch.randint(0, 32, (2, 4)), torch.randint(0, 32, (2, T))
    with torch.no_grad():
        plain = model(short), model(long)
        with model.eval_variant("rerope", T):
            varied = model(short), model(long)
    torch.testing.assert_close(varied[0], plain[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(varied[1], plain[1], atol=1e-4)
    assert model.scheme.remap is None  # the variant ends with its block


def test_a_model_scores_in_blocks_of_queries_as_in_one():
    """A 300-token forward attends in blocks of 256 queries; the variant's logits are the same."""
    model = tiny_model("rope", train_len=L)
    tokens = torch.randint(0, 32, (1, 300))
    with torch.no_grad(), model.eval_variant("self_extend", 300):
        whole = model(tokens)
        model.attn_block = 64
        blocks = model(tokens)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_bias_or_logit_beyond_one_block_of_queries_is_built(name, monkeypatch):
    """At 600 tokens the model attends in blocks of 256 queries: every bias the variant asks of the
    scheme, the plain one and the remapped one, is (Tq <= 256, Tk), never (600, 600)."""
    model = tiny_model("alibi", train_len=L)
    shapes = []
    bias = type(model.scheme).bias

    def recorded(self, q, k, qpos, kpos, layer):
        shapes.append((qpos.numel(), kpos.numel()))
        return bias(self, q, k, qpos, kpos, layer)

    monkeypatch.setattr(type(model.scheme), "bias", recorded)
    with torch.no_grad(), model.eval_variant(name, 600):
        model(torch.randint(0, 32, (1, 600)))
    assert shapes and max(tq for tq, _ in shapes) <= model.attn_block
    assert {tk for _, tk in shapes} == {256, 512, 600}


@pytest.mark.parametrize(
    "scheme,name,why",
    [
        ("sinusoidal", "rerope", "sinusoidal+rerope: rerope remaps distances in attention, and Sinusoidal adds"),
        ("learned", "self_extend", "adds absolute positions to the embeddings"),
        ("xl", "string", "its position term is built for positions 0..T-1"),
        ("xpos", "rerope", "its decay is centred on each call's positions"),
        ("cope", "lm_infinite", "its positions are counted by gates on q.k"),
        ("noisy_rope", "self_extend", "chooses its own positions"),
        ("nope", "rerope", "has none in attention (lm_infinite's mask and logn apply)"),
    ],
)
def test_a_scheme_that_cannot_take_a_variant_says_why_in_one_line(scheme, name, why):
    s = SCHEMES.build(scheme, tiny(scheme, train_len=L))
    with pytest.raises(PosbenchError, match=None) as e:
        with s.eval_variant(name, L, T):
            pass
    assert why in str(e.value) and "\n" not in str(e.value)
    assert name not in tiny_model(scheme, train_len=L).eval_variants
    with s.eval_variant("logn", L, T):  # a temperature suits every scheme's logits
        pass


def test_nope_takes_lm_infinites_mask():
    model = tiny_model("nope", train_len=L)
    assert {"lm_infinite", "logn"} <= set(model.eval_variants) and "rerope" not in model.eval_variants
    tokens = torch.randint(0, 32, (1, T))
    with torch.no_grad():
        plain = model(tokens)
        with model.eval_variant("lm_infinite", T):
            masked = model(tokens)
    torch.testing.assert_close(masked[:, : L + SINKS], plain[:, : L + SINKS])  # every key visible until then
    assert not torch.allclose(masked[:, -1], plain[:, -1])


def test_a_fixed_factor_sets_the_main_parameter_and_a_bad_one_is_one_line():
    assert remap("rerope", L, T, 6.0).far == 6 and remap("self_extend", L, T).far == L // 4
    assert remap("string", L, T, 3.0).far == 3 and remap("lm_infinite", L, T, 8.0).local == 8
    assert remap("logn", L, T, 32.0).log_base == 32.0
    with pytest.raises(PosbenchError, match="rerope's factor is the window w, a whole number of tokens >= 1; got 2.5"):
        remap("rerope", L, T, 2.5)


def test_patterns_take_them_unless_a_layer_cannot():
    irope = tiny_model("irope", train_len=L)
    assert set(VARIANTS) <= set(irope.eval_variants)
    mixed = tiny_model("pattern_xl_rope", train_len=L, options={"layers": ["xl", "rope"]})
    assert "rerope" not in mixed.eval_variants and "logn" in mixed.eval_variants
    with pytest.raises(PosbenchError, match="its xl layers cannot: rerope hands the hooks other positions"):
        with mixed.eval_variant("rerope", T):
            pass
    # a layer of ssmax leaves logn out: its own s log n is the temperature logn would add again
    scaled = tiny_model("pattern_ssmax_rope", train_len=L, options={"layers": ["ssmax", "rope"]})
    assert "logn" not in scaled.eval_variants and "rerope" in scaled.eval_variants
    with pytest.raises(PosbenchError, match="its ssmax layers cannot: logn's log n / log L is a second temperature"):
        with scaled.eval_variant("logn", T):
            pass
    tokens = torch.randint(0, 32, (1, T))
    with torch.no_grad():
        plain = irope(tokens)
        with irope.eval_variant("rerope", T):
            assert not torch.allclose(irope(tokens), plain)


def test_the_catalogue_lists_each_variant_once_with_the_schemes_that_take_it():
    rows = dict(catalogue())
    logn = rows["<scheme>+logn"]  # every scheme but ssmax, whose own temperature it would double
    assert logn.startswith("training-free variant of nope, sinusoidal,") and "ssmax" not in logn, logn
    takers = rows["<scheme>+rerope"]
    assert "rope, alibi" in takers and "sinusoidal" not in takers and "xpos" not in takers
    assert "rope+rerope" not in rows  # a scheme's own rows are its own variants


def test_an_experiment_skips_the_schemes_a_variant_refuses_and_says_so():
    """eval.perplexity.rope_scaling [rerope] with rope and sinusoidal resolves (rope gets rows), and
    the notes say in one line why sinusoidal gets none; a bad factor is refused before training."""
    from posbench.config import load_config
    from posbench.resolve import resolve

    exp = resolve(load_config(None, ["eval.perplexity.rope_scaling=[rerope]", "schemes=[rope,sinusoidal]"]))
    notes = exp.measure.notes(exp.cfg, None)
    said = "eval.perplexity.rope_scaling rerope: no sinusoidal+rerope rows, rerope remaps distances"
    assert any(n.startswith(said) for n in notes) and not any("no rope+rerope" in n for n in notes)
    with pytest.raises(PosbenchError, match="eval.perplexity.rope_factor: string's factor is the shift S"):
        resolve(load_config(None, ["eval.perplexity.rope_scaling=[string]", "eval.perplexity.rope_factor=1.5"]))


def test_check_scheme_runs_causality_under_every_variant_a_scheme_takes():
    from posbench import check

    said = check.variants_hold(tiny_model("alibi", train_len=L), 40)
    assert said.startswith("causal, with finite logits, under self_extend, rerope, string, lm_infinite, logn")
    assert "under logn (T=40" in check.variants_hold(tiny_model("sinusoidal", train_len=L), 40)


def test_check_scheme_says_a_variant_the_tiny_size_refuses_and_passes_the_rest():
    """rope at fraction 0.25 (the NoPE study's) rotates 2 of the tiny model's 8 head dims, which
    ntk and dynamic refuse: said with their reason, the row passing on the variants that hold."""
    from conftest import invoke

    res = invoke("check-scheme", "rope", "--set", "fraction=0.25")
    assert res.exit_code == 0, res.output
    row = " ".join(res.output.split("│ variants")[1].replace("│", " ").split())
    assert row.startswith("pass causal, with finite logits, under linear, yarn, llama3, self_extend"), row
    assert "refused at this size (ntk: ntk RoPE scaling needs a head dimension above 2, not 2; dynamic:" in row


def test_the_data_dependent_schemes_refuse_what_they_cannot_take_in_one_line():
    """Stick-breaking has no softmax for a variant to change; FoX's decay is summed by index, so a
    remap's other positions would leave it as it is and only logn's temperature applies."""
    stick, fox = tiny_model("stickbreaking", train_len=L), tiny_model("fox", train_len=L)
    for name in VARIANTS:
        with pytest.raises(PosbenchError, match=f"stickbreaking\\+{name}: .* has no softmax"):
            with stick.eval_variant(name, T):
                pass
    for name in set(VARIANTS) - {"logn"}:
        with pytest.raises(PosbenchError, match=f"fox\\+{name}: .* by index, not by position"):
            with fox.eval_variant(name, T):
                pass
    tokens = torch.randint(0, 32, (1, T))
    with torch.no_grad():
        plain = fox(tokens)
        with fox.eval_variant("logn", T):
            assert not torch.allclose(fox(tokens), plain)  # past L the far queries are sharpened


def test_logn_counts_the_keys_a_query_sees_so_a_window_layer_counts_its_window():
    """log-n's n is the keys a query sees: i + 1 under the causal mask, at most W in a layer with
    a window of W; against the formula written out with that window's mask."""
    from posbench.schemes import build_scheme
    from posbench.schemes.training_free import logits

    W = 24  # queries past index 23 see 24 keys, more than L = 16, fewer than i + 1
    scheme = build_scheme(tiny("pattern_rope_w", train_len=L, options={"layers": [{"scheme": "rope", "window": W}]}))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    pos = torch.arange(T)
    with torch.no_grad(), scheme.eval_variant("logn", L, T):
        got = scheme.remap.attention(q, k, v, pos, scheme, 0, None)
    qr, kr = scheme.rotate(q, k, pos, 0)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (j <= i) & (i - j < W)  # (T, T)
    n = seen.sum(-1).float()  # (T,): min(i + 1, W)
    assert n.max() == W and n[L - 1] == L
    scores = logits(qr, kr, pos, pos, scheme, 0).masked_fill(~seen, float("-inf"))
    scores = scores * (n.log() / math.log(L)).clamp(min=1)[:, None]
    want = scores.softmax(-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ssmax_is_refused_in_a_window_or_chunk_layer_whose_keys_it_would_miscount():
    from posbench.schemes import build_scheme

    for reach in ({"window": 8}, {"chunk": 8}):
        cfg = tiny("pattern_ss", train_len=L, options={"layers": [{"scheme": "ssmax", **reach}, "rope"]})
        with pytest.raises(PosbenchError, match="ssmax scales a query's logits by the log of the i \\+ 1 keys"):
            build_scheme(cfg)
    build_scheme(tiny("pattern_ss", train_len=L, options={"layers": ["ssmax", {"scheme": "rope", "window": 8}]}))


def test_the_variants_names_a_report_reads_without_torch_are_the_schemes_own():
    """A report sorts and draws +variant rows by the names posbench.schemes lists without
    importing a scheme: they are the training-free variants' and RoPE's scalings, in order."""
    from posbench.schemes import ROPE_SCALING_NAMES, TRAINING_FREE_NAMES

    assert tuple(VARIANTS) == TRAINING_FREE_NAMES
    assert tuple(v for v in SCHEMES["rope"].eval_variants if v not in VARIANTS) == ROPE_SCALING_NAMES
    from posbench.schemes.rope import ROPE_SCALINGS

    assert ROPE_SCALINGS == (None, *ROPE_SCALING_NAMES)
