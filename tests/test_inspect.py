"""`posbench inspect`: which pictures a scheme gets follows from its hooks, and the numbers
behind each picture are the scheme's own."""

import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import SMOKE, invoke  # noqa: E402

from posbench import plots
from posbench.check import tiny_config
from posbench.schemes import SCHEMES, PositionalScheme

PNG = b"\x89PNG\r\n\x1a\n"


def scheme(name: str, **kw) -> PositionalScheme:
    return SCHEMES[name](tiny_config(name, **kw)).eval()


def assert_pngs(folder: Path, names: set[str], output: str):
    """folder holds exactly these non-empty PNGs, and the command printed the path of each."""
    assert {p.name for p in folder.iterdir()} == names
    for n in names:
        data = (folder / n).read_bytes()
        assert data[:8] == PNG and len(data) > 1000, n
    printed = {Path(line.removeprefix("wrote ")).resolve() for line in output.splitlines() if line.startswith("wrote ")}
    assert printed == {(folder / n).resolve() for n in names}, output


@pytest.mark.plots
@pytest.mark.parametrize(
    "name,pictures",
    [
        ("sinusoidal", {"encoding.png", "similarity.png"}),  # embed changes x
        ("alibi", {"bias.png"}),  # bias returns a tensor
        ("rope", {"rotation.png"}),  # rotate changes q and k
        ("hybrid", {"encoding.png", "similarity.png", "bias.png"}),
    ],
)
def test_inspect_draws_what_the_hooks_do(tmp_path, name, pictures):
    res = invoke("inspect", name, "--out", tmp_path / name)
    assert res.exit_code == 0, res.output
    assert_pngs(tmp_path / name, pictures, res.output)


@pytest.mark.plots
def test_inspect_defaults_to_results_inspect(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("inspect", "alibi", "--length", "20")
    assert res.exit_code == 0, res.output
    assert_pngs(tmp_path / "results" / "inspect" / "alibi", {"bias.png"}, res.output)


def test_nope_has_nothing_to_draw(tmp_path):
    res = invoke("inspect", "nope", "--out", tmp_path / "n")
    assert res.exit_code == 0 and "nothing to draw" in res.output
    assert not (tmp_path / "n").exists()


# --- the numbers behind the pictures ---------------------------------------------------------


def test_rope_curves_coincide_across_offsets():
    dist, scores = plots.rotation_scores(scheme("rope"), 64)
    assert scores.shape == (len(plots.OFFSETS), 64) and torch.equal(dist, torch.arange(64))
    for row in scores[1:]:
        assert torch.allclose(row, scores[0], atol=1e-3 * scores[0].abs().max().item())
    assert scores[0].std() > 0.1 * scores[0].abs().max()  # the score does depend on m - n


class AbsoluteScale(PositionalScheme):
    """Scales q by its absolute position: q_m.k_n depends on m, not only on m - n."""

    def rotate(self, q, k, pos, layer):
        return q * (1 + pos[:, None].float() / 10), k


def test_rotation_curves_differ_when_the_score_is_not_relative():
    """The same check fails where it should: the curves split by offset."""
    dist, scores = plots.rotation_scores(AbsoluteScale(tiny_config("nope")), 64)
    assert not torch.allclose(scores[1], scores[0], atol=1e-3 * scores[0].abs().max().item())


def test_alibi_plotted_bias_is_minus_slope_times_distance():
    maps = plots.bias_maps(scheme("alibi"), 40)  # 4 heads: slopes 2^(-8h/4) = 1/4, 1/16, 1/64, 1/256
    assert maps.shape == (4, 40, 40)
    assert maps[0, 10, 3].item() == pytest.approx(-(2**-2) * 7)
    assert maps[1, 39, 0].item() == pytest.approx(-(2**-4) * 39)
    assert maps[3, 25, 5].item() == pytest.approx(-(2**-8) * 20)
    assert maps[2, 7, 7].item() == 0
    assert math.isnan(maps[0, 3, 10].item())  # the future is masked: nothing is drawn there


def test_sinusoidal_similarity_depends_on_distance_and_peaks_at_zero():
    pe = plots.encoding(scheme("sinusoidal"), 50)
    C = 32
    assert pe.shape == (50, C)
    dist, prof = plots.by_distance(plots.similarity(pe))
    assert torch.equal(dist, torch.arange(-49, 50))
    assert torch.allclose(prof, prof.flip(0), atol=1e-6)  # symmetric in i - j
    assert dist[prof.argmax()] == 0
    # C/2 (sin, cos) pairs with sin^2 + cos^2 = 1, scaled to a mean square of rms^2 each: |PE_i|^2 = C rms^2
    assert prof[dist == 0].item() == pytest.approx(C * 0.02**2, rel=1e-5)


def test_encoding_is_none_unless_embed_changes_x():
    assert plots.encoding(scheme("alibi"), 10) is None
    assert plots.bias_maps(scheme("sinusoidal"), 10) is None
    assert plots.rotation_scores(scheme("alibi"), 10) is None


def test_bias_maps_of_a_q_dependent_bias_are_repeatable():
    """Transformer-XL's bias reads q: random q, k with a fixed seed give the same map twice."""
    xl = scheme("xl")
    with torch.no_grad():
        for p in xl.parameters():
            p.normal_()
    a, b = plots.bias_maps(xl, 12), plots.bias_maps(xl, 12)
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and a.nan_to_num().abs().sum() > 0


def test_per_head_parameters_by_shape_not_by_name():
    t5 = scheme("t5")
    found = plots.per_head_parameters(t5)
    assert list(found) == ["table"] and torch.equal(found["table"], t5.table.T)  # (H, buckets)
    assert plots.per_head_parameters(scheme("learned")) == {}  # (max_len, C): not per head


# --- trained runs: what the model learned ----------------------------------------------------

KERPLE_LIKE = """
import torch
from posbench.schemes import PositionalScheme

class LogBias(PositionalScheme):
    '''-r1 * log(1 + r2 * |i - j|), r1 and r2 learned per head and kept positive.'''

    def __init__(self, cfg):
        super().__init__(cfg)
        self.r1 = torch.nn.Parameter(torch.ones(cfg.n_head))
        self.r2 = torch.nn.Parameter(torch.ones(cfg.n_head))

    def bias(self, q, k, qpos, kpos, layer):
        dist = (qpos[:, None] - kpos[None, :]).abs().float()  # (Tq, Tk)
        r1, r2 = self.r1.clamp(min=1e-2)[:, None, None], self.r2.clamp(min=1e-2)[:, None, None]
        return (-r1 * torch.log1p(r2 * dist)).unsqueeze(0)  # (1, H, Tq, Tk)
"""


@pytest.fixture
def trained(tmp_path, corpus_file, monkeypatch):
    """Train one tiny run of a scheme with the CLI; returns its run folder."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "kerple_like.py").write_text(textwrap.dedent(KERPLE_LIKE))
    monkeypatch.delitem(sys.modules, "kerple_like", raising=False)

    def train(spec: str) -> Path:
        out = tmp_path / "results"
        res = invoke(
            "train",
            SMOKE,
            "--scheme",
            spec,
            "--set",
            f"out_dir={out}",
            "--set",
            f"data.path={corpus_file}",
            "--set",
            "train.steps=5",
        )
        assert res.exit_code == 0, res.output
        (run,) = [p for p in (out / "smoke").iterdir() if p.is_dir() and p.name.startswith(spec.split(":")[0])]
        return run

    return train


@pytest.mark.plots
def test_inspect_a_trained_t5_run_draws_its_learned_buckets(trained, tmp_path):
    from posbench.experiment.checkpoint import load_run

    run = trained("t5")
    res = invoke("inspect", run, "--out", tmp_path / "t5")
    assert res.exit_code == 0, res.output
    assert_pngs(tmp_path / "t5", {"bias.png", "param-table.png"}, res.output)
    _, model = load_run(run)
    table = plots.per_head_parameters(model.scheme)["table"]  # (H, buckets), what was drawn
    assert table.shape == (2, 32) and table.abs().sum() > 0  # initialised to 0: it learned


@pytest.mark.plots
def test_inspect_a_trained_learned_run_draws_the_table_similarity(trained, tmp_path):
    run = trained("learned")
    res = invoke("inspect", run, "--out", tmp_path / "learned")
    assert res.exit_code == 0, res.output
    assert_pngs(tmp_path / "learned", {"encoding.png", "similarity.png"}, res.output)


@pytest.mark.plots
def test_inspect_a_trained_plugin_draws_every_per_head_parameter(trained, tmp_path, monkeypatch):
    run = trained("kerple_like:LogBias")
    assert run.name == "kerple_like_LogBias-seed0"
    monkeypatch.chdir(tmp_path)
    res = invoke("inspect", run)
    assert res.exit_code == 0, res.output
    assert_pngs(tmp_path / "results" / "inspect" / run.name, {"bias.png", "param-r1.png", "param-r2.png"}, res.output)


@pytest.mark.parametrize(
    "target,message",
    [
        ("alibbi", "unknown scheme 'alibbi' (did you mean 'alibi'?)"),
        ("results/none/alibi-seed0", "results/none/alibi-seed0: no such run directory"),
    ],
)
def test_inspect_errors_are_one_line(tmp_path, monkeypatch, target, message):
    monkeypatch.chdir(tmp_path)
    res = invoke("inspect", target)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert message in res.output and res.output.strip().count("\n") == 0, res.output


def test_inspect_a_folder_without_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    res = invoke("inspect", tmp_path / "empty")
    assert res.exit_code != 0 and "holds no checkpoint (model.pt)" in res.output


# --- what each picture says it draws (issue 30, item 11) ---------------------------------------


@pytest.fixture
def drawn(monkeypatch):
    """Every figure inspect writes, by file name, kept for its lines and texts."""
    figures = {}
    save = plots._save

    def keep(fig, path):
        figures[Path(path).name] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def texts(fig) -> str:
    """Every word a figure shows: titles, axis labels, legends, free text."""
    words = [fig._suptitle.get_text() if fig._suptitle else ""]
    for ax in fig.axes:
        words += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        if ax.get_legend():
            words += [t.get_text() for t in ax.get_legend().get_texts()]
    return " ".join(" ".join(words).split())


def test_inspect_a_trained_rope_run_draws_the_scores_its_weights_give(trained, tmp_path, drawn):
    """RoPE has no parameters: what training changes is q and k. The drawn score at distance d
    is layer 0's q.k (head 0), averaged over every pair of vocabulary tokens, query at d, key at 0."""
    from posbench.experiment.checkpoint import load_run

    run = trained("rope")
    res = invoke("inspect", run, "--out", tmp_path / "rope")
    assert res.exit_code == 0, res.output
    line = drawn["rotation.png"].axes[0].get_lines()[0]  # key at position 0
    curve = torch.tensor(line.get_ydata(), dtype=torch.float32)
    _, model = load_run(run)
    C, H = model.cfg.d_model, model.cfg.n_head
    with torch.no_grad():
        q, k, _ = model.blocks[0].attn.qkv(model.blocks[0].ln1(model.tok.weight)).split(C, dim=-1)  # (V, C)
        q, k = (t.view(-1, H, C // H).transpose(0, 1)[None] for t in (q, k))  # (1, H, V, D)
        V = q.size(2)
        _, k0 = model.scheme.rotate(q, k, torch.zeros(V, dtype=torch.long), 0)
        want = []
        for d in range(len(curve)):
            qd, _ = model.scheme.rotate(q, k, torch.full((V,), d), 0)
            want.append((qd[0, 0] @ k0[0, 0].T).mean())
    want = torch.stack(want)
    assert torch.allclose(curve, want, rtol=1e-3, atol=1e-4 * want.abs().max().item())
    untrained = plots.rotation_scores(SCHEMES["rope"](model.cfg).eval(), len(curve))[1][0]
    assert not torch.allclose(curve, untrained, atol=0.1 * untrained.abs().max().item())


def test_inspect_says_why_copes_bias_map_is_one_colour(tmp_path, drawn):
    res = invoke("inspect", "cope", "--length", "24", "--out", tmp_path / "cope")
    assert res.exit_code == 0, res.output
    words = texts(drawn["bias.png"])
    assert "depends on the content (q and k)" in words and "drawn for random q and k" in words, words
    assert "it is 0 at every (i, j)" in words and "parameters are all 0, as initialised" in words, words


def test_inspect_draws_t5s_learned_table_against_distance(trained, tmp_path, drawn):
    from posbench.experiment.checkpoint import load_run
    from posbench.schemes import t5_relative_bucket

    run = trained("t5")
    res = invoke("inspect", run, "--out", tmp_path / "t5")
    assert res.exit_code == 0, res.output
    _, model = load_run(run)
    T = 2 * model.cfg.train_len  # inspect's default length
    d = torch.arange(T)
    bucket = t5_relative_bucket(-d, False, 32, 128)  # key - query = -d
    ax = drawn["param-table.png"].axes[0]
    assert "distance" in ax.get_xlabel()
    heads = [line for line in ax.get_lines() if line.get_label().startswith("head")]
    assert len(heads) == model.cfg.n_head
    for h, line in enumerate(heads):
        assert list(line.get_xdata()) == d.tolist()
        want = model.scheme.table.detach()[bucket, h]  # (T,): the entry each distance reads
        assert torch.allclose(torch.tensor(line.get_ydata(), dtype=torch.float32), want)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_dashed_line_inspect_draws_is_explained(tmp_path, drawn, name):
    res = invoke("inspect", name, "--length", "24", "--out", tmp_path / name)
    assert res.exit_code == 0, res.output
    for fname, fig in drawn.items():
        for ax in fig.axes:
            legend = {t.get_text() for t in ax.get_legend().get_texts()} if ax.get_legend() else set()
            for line in ax.get_lines():
                if line.get_linestyle() == "--" and line.get_label() not in legend:
                    assert "training length" in texts(fig), (fname, texts(fig))


def test_inspect_draws_a_scheme_under_an_evaluation_time_variant(tmp_path):
    """--variant: yarn's rotation is yarn's, not rope's; a training-free variant's attention
    weights are a softmax over what it remaps, LM-Infinite's hidden keys weighted exactly 0;
    a variant the scheme refuses is one line and nothing is drawn."""
    from posbench.schemes import build_scheme
    from posbench.schemes.training_free import SINKS

    cfg = tiny_config("rope")
    rope, T = build_scheme(cfg), 4 * cfg.train_len
    plain = plots.rotation_scores(rope, T)[1]
    with rope.eval_variant("yarn", cfg.train_len, T):
        assert not torch.allclose(plots.rotation_scores(rope, T)[1], plain)
    assert plots.attention_maps(rope, T) is None  # plain softmax: nothing of its own to draw
    alibi = build_scheme(tiny_config("alibi"))
    with alibi.eval_variant("lm_infinite", cfg.train_len, T):
        w = plots.attention_maps(alibi, T)  # (H, T, T)
    seen = w.nan_to_num()
    assert torch.allclose(seen.sum(-1), torch.ones(w.shape[:2]), atol=1e-5)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    hidden = (i - j >= cfg.train_len) & (j >= SINKS)  # (T, T): past the local window, not a sink
    assert hidden.any() and bool((seen[:, hidden] == 0).all()) and bool((seen[:, ~hidden & (j <= i)] > 0).all())
    res = invoke("inspect", "rope", "--variant", "rerope", "--out", tmp_path / "r")
    said = [line.rsplit("/", 1)[-1] for line in res.output.splitlines() if line.startswith("wrote ")]
    assert res.exit_code == 0 and said == ["rotation.png", "attention.png"], res.output
    res = invoke("inspect", "sinusoidal", "--variant", "rerope", "--out", tmp_path / "s")
    assert res.exit_code == 2 and "sinusoidal+rerope: rerope remaps distances" in res.output
    assert not (tmp_path / "s").exists()


def test_out_of_memory_is_one_line_with_advice_for_inspect(tmp_path, monkeypatch):
    """inspect's memory follows its --length, so that is what its out-of-memory line advises,
    not the eval.* settings a run's would."""
    import posbench.plots

    def too_big(*args, **kwargs):
        raise MemoryError("can't allocate memory: you tried to allocate 4 PB")

    monkeypatch.setattr(posbench.plots, "inspect_target", too_big)
    res = invoke("inspect", "rope", "--length", "100000000", "--out", tmp_path / "i")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "out of memory" in res.output and "try a shorter --length" in res.output and "eval." not in res.output


@pytest.mark.parametrize("written", ["{run}", "./{name}", "../smoke/{name}"])  # dots in the path, or none
def test_an_option_for_a_run_folder_is_refused_however_its_path_is_written(trained, tmp_path, monkeypatch, written):
    run = trained("rope")
    monkeypatch.chdir(run.parent)
    res = invoke("inspect", written.format(run=run, name=run.name), "--set", "bogus=5", "--out", tmp_path / "x")
    assert res.exit_code == 2 and "is a run folder, whose scheme keeps the options it trained with" in res.output
    assert not (tmp_path / "x").exists()


def test_a_length_whose_maps_would_not_fit_in_memory_is_refused(tmp_path):
    """Its (heads, T, T) maps are counted first: ten million positions were the kernel's kill."""
    res = invoke("inspect", "rope", "--length", "10000000", "--out", tmp_path / "drawn")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--length 10000000: its (heads, T, T) maps take about" in " ".join(res.output.split())
    assert not (tmp_path / "drawn").exists()
