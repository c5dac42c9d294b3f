"""Per-layer patterns: each layer gets its own scheme's hooks, a window layer never reads past its
window, presets expand to their documented layers, and a pattern is one row named as itself."""

import csv
import dataclasses

import pytest
import torch
import yaml
from conftest import SMOKE, invoke, tiny

from posbench import check, native
from posbench.config import dump_yaml, load_config
from posbench.errors import PosbenchError
from posbench.experiment.records import read_config
from posbench.model import TransformerLM
from posbench.resolve import resolve
from posbench.schemes import PATTERNS, SCHEMES, catalogue, run_label, variant_label
from posbench.schemes.pattern import PRESETS, chunk_mask, window_mask
from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

MINE = [{"scheme": "rope", "window": 4}, {"scheme": "rope", "options": {"base": 500.0}}, "nope"]


def model_of(name: str, seed: int = 0, **kw) -> TransformerLM:
    return check.tiny_model(name, seed, **kw)


def logits(scheme, layer: int, T: int, shift: int = 0) -> torch.Tensor:
    """Layer `layer`'s attention logits, q.k / sqrt(d) after its rotate plus its bias, (H, T, T),
    for one random q and one random k at every position, at positions shift..shift+T-1."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 1, D, generator=g).expand(1, H, T, D)
    k = torch.randn(1, H, 1, D, generator=g).expand(1, H, T, D)
    pos = torch.arange(shift, shift + T)
    q, k = scheme.rotate(q, k, pos, layer)
    out = (q @ k.transpose(-1, -2))[0] * D**-0.5  # (H, T, T)
    b = scheme.bias(q, k, pos, pos, layer)
    return out if b is None else out + b[0]


# --- each layer its own hooks ------------------------------------------------------------------


def test_each_layer_of_irope_gets_its_own_hooks():
    """irope: layers 0-2 rotate (their logits vary with i - j and match plain RoPE's), layer 3 is
    NoPE (its logits are the same at every (i, j) and under any shift of the positions)."""
    scheme = model_of("irope").scheme
    rope = SCHEMES["rope"](tiny("rope", n_layer=4))
    T = 12
    for layer in range(3):
        got = logits(scheme, layer, T)
        assert not torch.allclose(got, got[:, :1, :1].expand_as(got))
        torch.testing.assert_close(got, logits(rope, layer, T))
    nope = logits(scheme, 3, T)
    torch.testing.assert_close(nope, nope[:, :1, :1].expand_as(nope))
    torch.testing.assert_close(nope, logits(scheme, 3, T, shift=7))


def test_gemma3_layers_rotate_at_their_own_base_and_window():
    """gemma3: the local layers are RoPE at base 10k with -inf past the window; the global
    layer is RoPE at base 1M, full attention: each equals plain RoPE at its base."""
    scheme = model_of("gemma3", options={"window": 5}).scheme
    T = 12
    local = SCHEMES["rope"](tiny("rope", options={"base": 10000.0}))
    wide = SCHEMES["rope"](tiny("rope", options={"base": 1e6}))
    far = torch.ones(T, T, dtype=torch.bool).tril(-5)  # j <= i - 5: five or more keys back
    for layer in range(5):
        got = logits(scheme, layer, T)
        assert bool(got[:, far].isneginf().all()) and bool(got[:, ~far].isfinite().all())
        torch.testing.assert_close(got[:, ~far], logits(local, layer, T)[:, ~far])
    torch.testing.assert_close(logits(scheme, 5, T), logits(wide, 5, T))
    assert not torch.allclose(logits(wide, 0, T), logits(local, 0, T))


def test_layers_naming_one_scheme_share_one_instance_and_its_parameters():
    """Layers that name the same scheme with the same options share one instance, as a plain
    run's layers share its scheme; other options make another."""
    scheme = model_of("pattern_t5", options={"layers": ["t5", "t5", {"scheme": "t5", "window": 3}]}).scheme
    assert scheme.at[0] is scheme.at[1] and scheme.at[2] is not scheme.at[0]
    assert len(scheme.schemes) == 2
    model = model_of("pattern_t5", options={"layers": ["t5", "nope"]})
    assert sum(p.numel() for p in model.scheme.parameters()) == sum(
        p.numel() for p in SCHEMES["t5"](tiny("t5")).parameters()
    )


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "xl", "fire", "cope", "kerple_log", "xpos"])
def test_a_pattern_of_one_scheme_is_that_scheme(name):
    """A period of one layer is the scheme itself: the same parameters (per-layer ones too, one
    per layer) and, with the same weights, the same logits."""
    plain = model_of(name, n_layer=3)
    mine = TransformerLM(tiny("pattern_one", n_layer=3, options={"layers": [name]})).eval()
    state = {k.replace("scheme.", "scheme.schemes.0.", 1): v for k, v in plain.state_dict().items()}
    mine.load_state_dict(state)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mine(x), plain(x))


def test_a_scheme_shared_by_some_layers_has_parameters_for_those_only():
    """FIRE's MLP per layer: in [fire, nope] over 4 layers there are two, one for each FIRE
    layer, and every one gets a gradient."""
    model = model_of("pattern_fn", n_layer=4, options={"layers": ["fire", "nope"]})
    fire = model.scheme.at[0]
    assert model.scheme.at[2] is fire and len(fire.mlp) == 2 and model.scheme.rank == [0, 0, 1, 1]
    check.backward(model.train(), check.forward(model, 16))


def test_a_plugin_is_a_layer_of_a_pattern():
    """A user's module:Class works inside a pattern, with its own options, and passes the checks."""
    layers = [{"scheme": "examples.my_scheme:MyScheme", "options": {"window": 6}}, "rope"]
    model = model_of("pattern_plug", options={"layers": layers})
    assert type(model.scheme.at[0]).__name__ == "MyScheme" and model.scheme.at[0].window == 6
    check.causality(model, 24)
    check.backward(model.train(), check.forward(model, 16))


@pytest.mark.parametrize("name", [*PRESETS, "pattern_mine"])
def test_every_check_of_check_scheme_passes_on_a_pattern(name):
    """Causality (whole and blocked), forward, backward, past the training length, the window
    and attend: the checks every registered scheme passes, on a whole period of layers."""
    results = check.run_checks(name, {"layers": MINE} if name == "pattern_mine" else {})
    assert [r.name for r in results if not r.ok] == [], results


# --- the window --------------------------------------------------------------------------------


def test_window_mask_counts_keys_back_from_each_query():
    m = window_mask(3, 6, 2, "cpu", torch.float32)  # queries 3, 4, 5 of keys 0..5
    assert (m == 0).tolist() == [
        [False, False, True, True, True, True],  # the future is the causal mask's, not the window's
        [False, False, False, True, True, True],
        [False, False, False, False, True, True],
    ]


def test_chunk_mask_keeps_each_query_in_its_own_chunk():
    m = chunk_mask(4, 6, 3, "cpu", torch.float32)  # queries 2..5 of keys 0..5, chunks {0,1,2} {3,4,5}
    assert (m == 0).tolist() == [
        [True, True, True, False, False, False],
        [False, False, False, True, True, True],  # query 3 starts a chunk: it sees itself alone
        [False, False, False, True, True, True],
        [False, False, False, True, True, True],
    ]


BACKENDS = ["eager", "sdpa", "native"]


LEARNED = [{"scheme": "t5", "window": 4}, {"scheme": "kerple_log", "chunk": 6}, "alibi"]  # biases with gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["rnope_swa", "gemma3", "irope_chunked", "pattern_mine", "pattern_learned"])
def test_a_window_layer_never_reads_past_its_window(name, backend):
    """Change a layer's input W or more keys back: its output at the query stays exactly as it
    was; change it W - 1 back: it moves (a chunk layer: the key before the query's chunk, and
    the chunk's first). Whole and blocked, on every backend."""
    if backend == "native" and native.why_not(8, torch.device("cpu")):
        pytest.skip(native.why_not(8, torch.device("cpu")))
    options = {"pattern_mine": {"layers": MINE}, "pattern_learned": {"layers": LEARNED}, "irope_chunked": {"chunk": 7}}
    model = model_of(name.removesuffix("_chunked"), options=options.get(name, {}))
    model.cfg = dataclasses.replace(model.cfg, attention=backend)
    assert "no query reads a key past" in check.window_holds(model, 40)


def test_the_attention_weights_past_the_window_are_zero():
    """In the eager formula, a window layer's softmax weights are exactly 0 W or more keys back,
    and the full layer's are not."""
    scheme = model_of("rnope_swa", options={"window": 3}).scheme
    T = 10
    weights = [logits(scheme, layer, T).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")) for layer in (0, 3)]
    window, full = (w.softmax(-1) for w in weights)
    far = torch.ones(T, T, dtype=torch.bool).tril(-3)
    assert bool((window[:, far] == 0).all()) and bool((full[:, far] > 0).all())


@pytest.mark.parametrize("backend", ["sdpa", "native"])
@pytest.mark.parametrize("layers", [MINE, LEARNED])
def test_backends_equal_eager_on_a_pattern(backend, layers):
    """Logits and gradients, windows and learned biases among the layers, whole and blocked."""
    if backend == "native" and native.why_not(8, torch.device("cpu")):
        pytest.skip("the C kernels do not build here")
    model = model_of("pattern_b", options={"layers": layers}).train()
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    for block in (256, 8):  # one block of queries, and five
        model.attn_block = block
        outs = []
        for b in ("eager", backend):
            model.cfg = dataclasses.replace(model.cfg, attention=b)
            model.zero_grad(set_to_none=True)
            y = model(x)
            y.square().mean().backward()
            outs.append((y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        for n, g in outs[0][1].items():
            torch.testing.assert_close(outs[1][1][n], g, atol=1e-5 * (1 + g.abs().max().item()), rtol=1e-4)


def test_full_attention_nope_layers_keep_sdpas_causal_path(monkeypatch):
    """A NoPE layer without a window hands SDPA no bias, so it runs with is_causal."""
    model = model_of("rnope_swa")
    model.cfg = dataclasses.replace(model.cfg, attention="sdpa")
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append(attn_mask is None and is_causal)
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    assert seen == [False, False, False, True]  # three window layers with a mask, the NoPE layer without


# --- presets, labels, variants -----------------------------------------------------------------


def test_presets_expand_to_their_documented_layers():
    def period(name, **options):
        return [x.label() for x in model_of(name, options=options).scheme.period]

    assert period("rnope_swa") == ["rope@4(base=10000)"] * 3 + ["nope"]  # window: train_len 16 / 4
    assert period("rnope_swa", window=8, every=2, base=500.0) == ["rope@8(base=500)", "nope"]
    assert period("irope") == ["rope(base=10000)"] * 3 + ["nope"]
    assert period("irope", chunk=8) == ["rope@c8(base=10000)"] * 3 + ["nope"]  # Llama 4's chunked RoPE layers
    assert period("gemma3") == ["rope@4(base=10000)"] * 5 + ["rope(base=1e+06)"]
    assert period("pattern_mine", layers=MINE) == ["rope@4", "rope(base=500)", "nope"]
    scheme = model_of("irope", n_layer=6).scheme  # the period repeats, its tail cut at n_layer
    assert [x.label() for x in scheme.layers] == ["rope(base=10000)"] * 3 + ["nope"] + ["rope(base=10000)"] * 2
    assert set(PATTERNS) == set(PRESETS)  # the registry's names, known without importing the module
    assert set(PATTERNS) <= set(dict(catalogue())) and "pattern_<label>" in dict(catalogue())


def test_a_pattern_is_one_row_named_as_itself():
    cfg = tiny("irope", n_layer=4)
    assert run_label(cfg) == "irope" and variant_label(run_label(cfg), "yarn") == "irope+yarn"


def test_rope_variants_scale_the_full_attention_rope_layers_only():
    """gemma3+yarn scales the global layer; the local (window) layers keep their frequencies.
    irope+yarn scales every RoPE layer and leaves NoPE as it is. rnope_swa has none to scale
    and says why in one line."""
    T = 48
    g3 = model_of("gemma3").scheme
    before = [logits(g3, layer, T) for layer in (0, 5)]
    with g3.eval_variant("yarn", 16, T):
        after = [logits(g3, layer, T) for layer in (0, 5)]
    torch.testing.assert_close(after[0], before[0])
    assert not torch.allclose(after[1], before[1])
    ir = model_of("irope").scheme
    before = [logits(ir, layer, T) for layer in (0, 3)]
    with ir.eval_variant("linear", 16, T):
        after = [logits(ir, layer, T) for layer in (0, 3)]
    assert not torch.allclose(after[0], before[0])
    torch.testing.assert_close(after[1], before[1])
    chunked = model_of("irope", options={"chunk": 8}).scheme
    assert set(chunked.eval_variants) == set(TRAINING_FREE)  # its RoPE layers never meet a distance of 8
    swa = model_of("rnope_swa").scheme
    assert set(swa.eval_variants) == set(TRAINING_FREE)  # no RoPE scaling: those remap every layer
    with pytest.raises(PosbenchError, match="attend within a window and keep their trained frequencies") as e:
        with swa.eval_variant("yarn", 16, T):
            pass
    assert "\n" not in str(e.value)
    with pytest.raises(PosbenchError, match="longrope needs short_factor"):
        with ir.eval_variant("longrope", 16, T):
            pass


# --- the config: spelling, round trip, one-line refusals -----------------------------------------

BAD = {
    "not a list": ({"layers": "rope"}, "scheme_options.pattern_x.layers: expected a non-empty list of layers"),
    "empty": ({"layers": []}, "expected a non-empty list"),
    "missing": ({}, "scheme_options.pattern_x.layers: a pattern needs its layers"),
    "key": ({"layers": [{"scheme": "rope", "windw": 4}]}, "layers[0].windw: unknown key; a layer takes scheme"),
    "window 0": ({"layers": ["nope", {"scheme": "rope", "window": 0}]}, "layers[1].window=0: expected a positive"),
    "window text": ({"layers": [{"scheme": "rope", "window": "far"}]}, "layers[0].window='far'"),
    "chunk 0": ({"layers": [{"scheme": "rope", "chunk": 0}]}, "layers[0].chunk=0: expected a positive"),
    "both": (
        {"layers": [{"scheme": "rope", "window": 4, "chunk": 8}]},
        "layers[0]: a layer attends within a window or",
    ),
    "no scheme": ({"layers": [{"window": 4}]}, "layers[0]: needs scheme"),
    "unknown": ({"layers": ["ropee"]}, "layers[0]: unknown scheme 'ropee' (did you mean 'rope'?)"),
    "nested": ({"layers": ["irope"]}, "layers[0]: irope is itself a pattern"),
    "embed": ({"layers": ["sinusoidal", "rope"]}, "layers[0]: sinusoidal adds to the token embeddings"),
    "positions": ({"layers": ["noisy_rope"]}, "layers[0]: noisy_rope chooses its own positions"),
    "option": ({"layers": [{"scheme": "rope", "options": {"bas": 2.0}}]}, "layers[0].options.bas: unknown option"),
    "option value": ({"layers": [{"scheme": "rope", "options": {"base": 0.5}}]}, "base=0.5 must be > 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_pattern_is_one_line(case):
    options, phrase = BAD[case]
    with pytest.raises(PosbenchError) as e:
        TransformerLM(tiny("pattern_x", options=options))
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_too_few_layers_for_a_preset_says_what_to_change():
    with pytest.raises(PosbenchError) as e:
        TransformerLM(tiny("rnope_swa", n_layer=2))
    assert str(e.value) == (
        "rnope_swa repeats a period of 4 layers (rope@4(base=10000), rope@4(base=10000), rope@4(base=10000), "
        "nope); model.n_layer=2 does not hold one: raise model.n_layer to 4 or lower scheme_options.rnope_swa.every"
    )
    with pytest.raises(PosbenchError, match="every=1: a period needs at least 2 layers"):
        TransformerLM(tiny("irope", options={"every": 1}))
    with pytest.raises(PosbenchError, match=r"scheme_options.gemma3.window=-3: expected a positive"):
        TransformerLM(tiny("gemma3", options={"window": -3}))
    with pytest.raises(PosbenchError, match=r"scheme_options.irope.chunk=0: expected a positive"):
        TransformerLM(tiny("irope", options={"chunk": 0}))


def test_a_pattern_round_trips_through_yaml(tmp_path):
    """A config that spells a pattern loads, resolves, dumps and loads again to the same config,
    and both build the same layers."""
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "schemes": ["rnope_swa", "pattern_mine"],
                "model": {"n_layer": 4, "train_len": 16},
                "eval": {"lengths": [16, 32]},
                "scheme_options": {"pattern_mine": {"layers": MINE}, "rnope_swa": {"window": 6}},
            }
        )
    )
    cfg = resolve(load_config(path)).cfg
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(cfg))
    cfg2 = load_config(again)
    assert cfg2.to_dict() == cfg.to_dict()
    for s in cfg.schemes:
        a, b = (TransformerLM(c.model_for(s)).scheme for c in (cfg, cfg2))
        assert a.describe() == b.describe()
    assert cfg.scheme_options["rnope_swa"] == {"window": 6, "every": 4, "base": 10000.0}


def test_a_bad_pattern_is_refused_before_training_naming_its_flag(tmp_path):
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "nope,pattern_x",
        "--set",
        "scheme_options.pattern_x.layers=[rope, {scheme: nope, window: 0}]",
        "--set",
        f"out_dir={tmp_path}",
    )
    assert res.exit_code == 2
    line = "--set scheme_options.pattern_x.layers=[rope, {scheme: nope, window: 0}]: scheme_options.pattern_x.layers[1]"
    assert line in res.output and "Traceback" not in res.output and not (tmp_path / "smoke").exists()


# --- the commands ------------------------------------------------------------------------------


def test_a_preset_trains_and_scores_as_one_row_each(tmp_path, corpus_file):
    """extrapolate with a preset and the user's own pattern at a tiny size: one row each (and
    irope+yarn for the RoPE variant), the run folder's config.yaml builds the same layers."""
    out = tmp_path / "r"
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "irope,pattern_mine",
        "--rope-scaling",
        "yarn",
        "--set",
        f"scheme_options.pattern_mine.layers={MINE}",
        "--set",
        "model.n_layer=4",
        "--set",
        "train.steps=2",
        "--set",
        "eval.tokens=256",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader((out / "smoke" / "summary.csv").open()))
    assert {r["scheme"] for r in rows} == {"irope", "irope+yarn", "pattern_mine", "pattern_mine+yarn"}
    res = invoke("inspect", out / "smoke" / "irope-seed0", "--out", tmp_path / "drawn")
    assert res.exit_code == 0 and "layer 3: nope, full attention" in res.output, res.output
    rc = read_config(out / "smoke" / "pattern_mine-seed0")
    assert rc.scheme_options["pattern_mine"]["layers"] == MINE
    assert TransformerLM(rc.model).scheme.describe() == [
        "layer 0: rope, a window of 4 keys",
        "layer 1: rope (base=500.0), full attention",
        "layer 2: nope, full attention",
        "layer 3: rope, a window of 4 keys",
    ]


def test_check_scheme_checks_a_preset_and_a_users_pattern():
    res = invoke("check-scheme", "gemma3")
    assert res.exit_code == 0, res.output
    assert "6 layers" in res.output and "no query reads a key past" in " ".join(res.output.replace("│", " ").split())
    res = invoke("check-scheme", "pattern_mine", "--set", "layers=[{scheme: alibi, window: 5}, nope]")
    assert res.exit_code == 0, res.output
    res = invoke("check-scheme", "pattern_mine", "--set", "layers=[{scheme: alibi, window: -5}]")
    assert res.exit_code == 2 and "layers[0].window=-5: expected a positive number of keys" in res.output
    assert len(res.output.strip().splitlines()) == 1  # the user's option, not a failed check of the scheme


@pytest.mark.plots
def test_inspect_prints_each_layer_and_draws_each_distinct_one(tmp_path):
    res = invoke("inspect", "rnope_swa", "--out", tmp_path / "p", "--length", "24")
    assert res.exit_code == 0, res.output
    assert "layer 0: rope (base=10000.0), a window of 25 keys" in res.output
    assert "layer 3: nope, full attention" in res.output
    assert {p.name for p in (tmp_path / "p").iterdir()} == {"layer0"}  # the NoPE layer draws nothing
    assert {p.name for p in (tmp_path / "p" / "layer0").iterdir()} == {"rotation.png", "bias.png"}


def test_a_patterns_lines_look_unlike_every_other_schemes():
    """In a plot, each preset, a user's pattern and their +variant rows are lines of their own
    (a colour from the name, rope's dashes for the variant)."""
    from posbench.compare.plot import style

    names = list(SCHEMES) + [f"rope+{v}" for v in SCHEMES["rope"].eval_variants] + list(PATTERNS)
    names += ["irope+yarn", "gemma3+yarn", "gemma3+linear", "pattern_mine", "pattern_mine+yarn"]
    looks = {n: (style(n)["color"], repr(style(n)["linestyle"]), style(n)["marker"]) for n in names}
    assert len(set(looks.values())) == len(names), looks
    assert style("irope+yarn")["linestyle"] == style("rope+yarn")["linestyle"]


def test_extend_scores_a_parent_with_the_variants_its_own_layers_take():
    """posbench extend scores the parent with its evaluation-time variants: a pattern's as built
    (none where every RoPE layer has a window), not every variant a pattern may take."""
    from posbench.config import ExperimentConfig
    from posbench.extend.run import _variants

    def parent(layers):
        model = tiny("pattern_p", options={"layers": layers})
        return ExperimentConfig(schemes=["pattern_p"], scheme_options={"pattern_p": model.options}, model=model)

    assert _variants(parent([{"scheme": "rope", "window": 4}, "nope"])) == []
    assert _variants(parent(["rope", "nope"])) == ["linear", "ntk", "dynamic", "yarn", "llama3"]


def test_a_scaling_a_patterns_layers_cannot_take_is_a_note_naming_why_not_a_row():
    """A pattern takes an evaluation-time variant only where a full-attention layer's scheme has it:
    asked for one none of its layers take, the run gets no row and the plan says why in one line; a
    pattern with a full-attention RoPE layer, and plain RoPE, get no such line."""
    from posbench.config import load_config
    from posbench.measures.perplexity import Perplexity

    layers = {"windowed": "[{scheme: rope, window: 8}, nope]", "full": "[rope, {scheme: rope, window: 8}]"}
    sets = ["schemes=[pattern_windowed, pattern_full, rope]", "eval.perplexity.rope_scaling=[yarn]"]
    sets += [f"scheme_options.pattern_{k}={{layers: {v}}}" for k, v in layers.items()]
    notes = Perplexity().notes(load_config(None, sets), corpus=None)
    assert notes == [
        "eval.perplexity.rope_scaling yarn: no pattern_windowed+yarn rows, its rope layers attend within a window "
        "and keep their trained frequencies; its nope layers have no such variant"
    ]
