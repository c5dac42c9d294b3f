"""Does a model use its far context (posbench/measures/context.py)? Context gain and key tokens on
models whose answer is known: one that ignores its context gains nothing and has no key tokens,
one that copies from far back gains exactly what copying saves, one whose positions break past
its training length loses; then both measures through `evaluate` and `pretrained`."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import SMOKE, folded, invoke

from posbench.config import ExperimentConfig
from posbench.data import Corpus
from posbench.errors import PosbenchError
from posbench.measures.base import ScoringRun, ratio_over_samples
from posbench.measures.context import ContextGain, KeyTokens, context_losses
from posbench.stats import mean_ci

K = 16  # the stubs' training length
HIGH, LOW = 3.0, 0.25  # a stub's loss without and with what it needs


def _run(model, text: bytes, lengths=(16, 32, 48), tokens: int = 480) -> ScoringRun:
    cfg = ExperimentConfig()
    cfg.model.train_len, cfg.eval.lengths, cfg.eval.tokens, cfg.eval.batch_size = K, list(lengths), tokens, 4
    val = torch.tensor(list(text), dtype=torch.uint8)
    return ScoringRun(cfg, model, torch.device("cpu"), Corpus("stub", val, val))


def _text(n: int = 600, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(97, 123, (n,), generator=g).tolist())


class Unigram(nn.Module):
    """Logits from the current token alone: its context is worth nothing, near or far."""

    max_len = None

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(256, 256)

    def token_losses(self, win):
        logits = self.emb(win[:, :-1])  # (b, T, V)
        return F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="none").view(win.size(0), -1)


class Stub:
    """token_losses from a rule on each target: `loss(win, i)` for target i (its context: win[:, : i + 1])."""

    max_len = None

    def __init__(self, loss):
        self.loss = loss

    def token_losses(self, win):
        T = win.size(1) - 1
        return torch.stack([self.loss(win, i) for i in range(T)], dim=1)  # (b, T)


def _copier(distance: int) -> Stub:
    """Sure of a target that is the token `distance` back, where that token is visible."""

    def loss(win, i):
        seen = i + 1 - distance  # the index of the input `distance` before the target, if any
        hit = win[:, i + 1] == win[:, seen] if seen >= 0 else torch.zeros(win.size(0), dtype=torch.bool)
        return torch.where(hit, LOW, HIGH)

    return Stub(loss)


def test_a_model_that_ignores_its_context_gains_nothing_and_has_no_key_tokens():
    run = _run(Unigram(), _text())
    gains = {r["length"]: r for r in ContextGain().score(run)}
    keys = {r["length"]: r for r in KeyTokens(alpha=1e-3, beta=100.0).score(run)}
    assert gains[16]["status"] == "not-past-k" and keys[16]["status"] == "not-past-k"  # K >= L: nothing lies beyond
    for L in (32, 48):
        assert gains[L]["gain"] == pytest.approx(0.0, abs=1e-5)
        assert keys[L]["key_fraction"] == 0.0 and math.isnan(keys[L]["key_ppl"])


def test_a_model_that_copies_from_beyond_k_gains_what_copying_saves():
    """Text repeating every 24 tokens: the copier is sure of each token whose copy 24 back is
    visible. The last K/2 targets of a window of 64 see it; with only the last 16 tokens visible
    they do not. With K = 48 they see it either way (their context is 24 to 48): no gain, since
    what they need lies within K."""
    period = 24
    run = _run(_copier(period), _text(period) * 25, lengths=(64,))
    (row,) = ContextGain(k=[48]).score(run)
    assert row["gain"] == pytest.approx(HIGH - LOW) and row["gain_k48"] == pytest.approx(0.0)
    (keys,) = KeyTokens(k=[48], alpha=1.0, beta=1.0).score(run)
    assert keys["key_fraction"] == 1.0 and keys["key_ppl"] == pytest.approx(math.exp(LOW))
    assert keys["key_fraction_k48"] == 0.0 and math.isnan(keys["key_ppl_k48"])


def test_a_key_token_gains_more_than_alpha_and_has_a_full_context_loss_below_beta_both_strictly():
    """LongPPL's rule, (short - full) > alpha and full < beta: the copier's key targets gain
    HIGH - LOW = 2.75 nats at a full loss of LOW = 0.25. Thresholds apart tell the two tests from
    each other (swapped, each of these would flip), and a threshold met exactly does not count."""
    period = 24
    run = _run(_copier(period), _text(period) * 25, lengths=(64,))
    gain = HIGH - LOW
    for alpha, beta, key in [
        (0.2, 2.8, 1.0),  # both hold
        (2.8, 0.2, 0.0),  # neither: the gain is below alpha, the loss above beta
        (gain, 1.0, 0.0),  # a gain of exactly alpha is not more than it
        (1.0, LOW, 0.0),  # a loss of exactly beta is not below it
        (gain - 1e-3, LOW + 1e-3, 1.0),
    ]:
        (row,) = KeyTokens(alpha=alpha, beta=beta).score(run)
        assert row["key_fraction"] == key, (alpha, beta)


def test_any_context_helping_is_not_counted_as_far_context():
    """A model that needs only the last 3 tokens: every scored target sees them in the short
    pass too (its context is K/2 to K), so the gain is 0, where comparing all K targets, the first
    with a context of one token, would not be."""
    run = _run(Stub(lambda win, i: torch.full((win.size(0),), LOW if i >= 2 else HIGH)), _text(), lengths=(48,))
    (row,) = ContextGain().score(run)
    assert row["gain"] == 0.0
    short, full = context_losses(run, 48, K)
    assert short.shape == full.shape and full.shape[1] == K // 2
    plain = (None, None)  # as trained: no variant
    all_k = run.memo["short", 48, K, plain].mean() - run.memo["full", 48, plain][:, -K:].mean()  # all K targets
    assert all_k > 0


def test_positions_past_the_training_length_that_break_make_the_gain_negative():
    """A model whose loss doubles at every position past K, whatever it sees: the full pass scores
    the last targets there, the short pass within K."""
    run = _run(Stub(lambda win, i: torch.full((win.size(0),), 1.0 if i < K else 2.0)), _text(), lengths=(32, 48))
    rows = {r["length"]: r["gain"] for r in ContextGain().score(run)}
    assert rows == {32: pytest.approx(-1.0), 48: pytest.approx(-1.0)}


def test_each_row_carries_its_interval_over_the_windows():
    """A model has no seeds; its windows are its samples. Equal windows: no spread, an interval
    of 0. Windows that differ: the interval of their means, a window's gain each (every window
    scores K/2 targets), and for the perplexity on key tokens the ratio estimator's over the
    windows' key-token losses, through exp's slope."""
    same = _run(Stub(lambda win, i: torch.full((win.size(0),), 1.0 if i < K else 2.0)), _text(), lengths=(48,))
    (row,) = ContextGain().score(same)
    assert row["gain"] == pytest.approx(-1.0) and row["ci"] == {"gain": 0.0}

    def copier(win, i):  # sure of a target whose copy lies 24 back, the surer the smaller its byte
        hit = win[:, i + 1] == win[:, i - 23] if i >= 23 else torch.zeros(win.size(0), dtype=torch.bool)
        return torch.where(hit, 0.1 * (win[:, i + 1] % 3 + 1), HIGH)

    run = _run(Stub(copier), _text(24) * 10 + _text(260, seed=1), lengths=(48,))  # periodic, then not
    (row,) = ContextGain().score(run)
    short, full = context_losses(run, 48, K)
    per_window = (short - full).mean(1)  # (n,)
    assert len(per_window) == 10 and per_window.min() < per_window.max()
    assert (row["gain"], row["ci"]["gain"]) == pytest.approx(mean_ci(per_window.tolist()))
    assert row["ci"]["gain"] > 0

    (keys,) = KeyTokens(alpha=1.0, beta=1.0).score(run)
    is_key = ((short - full) > 1.0) & (full < 1.0)
    n = is_key.sum(1).double()
    loss = (full * is_key).sum(1).double()
    R = float(loss.sum() / n.sum())
    assert keys["key_ppl"] == pytest.approx(math.exp(R))
    half = mean_ci((loss - R * n).tolist())[1] / float(n.mean())
    assert keys["ci"]["key_ppl"] == pytest.approx(math.exp(R) * half) and half > 0
    share = mean_ci(is_key.double().mean(1).tolist())
    assert (keys["key_fraction"], keys["ci"]["key_fraction"]) == pytest.approx(share)


def test_the_ratio_estimators_interval_is_the_plain_one_when_every_sample_counts_alike():
    """sums 2, 4, 9 over counts 1, 2, 3: the ratio 15/6 = 2.5; residuals -0.5, -1, 1.5 (sd
    sqrt(1.75)), t(0.975, 2) = 4.3027: a half-width of 4.3027 sqrt(1.75) / sqrt(3) / 2."""
    ratio, half = ratio_over_samples([2, 4, 9], [1, 2, 3])
    assert ratio == 2.5 and half == pytest.approx(4.302653 * math.sqrt(1.75) / math.sqrt(3) / 2, rel=1e-6)
    sums = [3.0, 5.0, 4.0, 9.0]
    assert ratio_over_samples(sums, [4] * 4) == pytest.approx(mean_ci([v / 4 for v in sums]))
    assert all(math.isnan(v) for v in ratio_over_samples([0.0, 0.0], [0, 0]))  # no sample counts a token
    ratio, half = ratio_over_samples([3.0, 0.0, 0.0], [2, 0, 0])  # one sample holds them all: no spread to see
    assert ratio == 1.5 and math.isnan(half)


def test_a_length_the_model_cannot_encode_is_a_status_as_for_perplexity():
    model = Unigram()
    model.max_len = 32  # learned positions end there
    rows = {r["length"]: r for r in ContextGain().score(_run(model, _text(), lengths=(32, 48)))}
    assert rows[48] == {"length": 48, "status": "beyond-max-len"} and "status" not in rows[32]


def test_the_two_measures_share_their_passes_on_one_run():
    calls = []
    model = Unigram()
    losses = model.token_losses
    model.token_losses = lambda win: calls.append(win.size(1) - 1) or losses(win)
    run = _run(model, _text(), lengths=(48,))
    ContextGain().score(run)
    n = len(calls)
    KeyTokens().score(run)
    assert len(calls) == n and sorted(set(calls)) == [K, 48]  # one pass at L and one at K, once


def test_byte_thresholds_scale_longppls_by_bytes_per_token_and_are_recorded():
    run = _run(Unigram(), _text(), lengths=(32,))
    m = KeyTokens()
    m.score(run)
    assert m.options == {  # 2 nats over 4 bytes
        "k": [], "alpha": 0.5, "beta": 0.5, "variant": None, "factor": None, "bytes_per_token": 1.0
    }  # fmt: skip
    m = KeyTokens(alpha=1.5)
    m.score(run)
    assert (m.options["alpha"], m.options["beta"]) == (1.5, 0.5)


# --- through the command line ------------------------------------------------------------------


def test_evaluate_scores_both_measures_into_the_run_and_the_report_shows_them(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "smoke"
    copy.mkdir()
    for name in ("rope-seed0", "alibi-seed0", "learned-seed0"):
        shutil.copytree(exp / name, copy / name)
    for name in ("rope-seed0", "alibi-seed0", "learned-seed0"):
        res = invoke("evaluate", copy / name, "--measure", "context_gain,key_tokens", "--measure-option", "k=24")
        assert res.exit_code == 0, res.output
        text = " ".join(res.output.split())
        said = "key_tokens options: k=[24], alpha=0.5, beta=0.5, variant=None, factor=None, bytes_per_token=1.0"
        assert said in text, text
    with open(copy / "rope-seed0" / "measures" / "context_gain.csv") as f:
        rows = {int(r["length"]): r for r in csv.DictReader(f)}
    assert rows[32]["status"] == "ok" and rows[32]["gain"] == ""  # the training length: K = L, no gain to take
    assert all(math.isfinite(float(rows[L]["gain_k24"])) for L in (32, 48, 64))
    with open(copy / "learned-seed0" / "measures" / "context_gain.csv") as f:
        assert {int(r["length"]): r["status"] for r in csv.DictReader(f)}[64] == "beyond-max-len"
    meta = json.loads((copy / "rope-seed0" / "measures" / "key_tokens.json").read_text())
    assert meta["measure"] == "key_tokens" and meta["options"]["alpha"] == 0.5
    scored = [json.loads(line) for line in (copy / "rope-seed0" / "eval_log.jsonl").read_text().splitlines()]
    assert [s["measure"] for s in scored[-2:]] == ["context_gain", "key_tokens"] and scored[-1]["device"] == "cpu"
    assert scored[-1]["lengths"] == [32, 48, 64]

    # the records hold what the measure computes on the run's model
    from posbench.data import load_corpus
    from posbench.experiment.checkpoint import load_run

    rc, model = load_run(copy / "rope-seed0")
    run = ScoringRun(rc, model.eval(), torch.device("cpu"), load_corpus(rc.data))
    (again,) = [r for r in ContextGain().score(run) if r["length"] == 64]
    assert float(rows[64]["gain"]) == pytest.approx(again["gain"], abs=1e-6)

    res = invoke("report", copy)
    assert res.exit_code == 0, res.output
    md = (copy / "summary.md").read_text()
    assert "## context_gain: context gain in nats (K = train_len) by length" in md
    assert "## key_tokens: % key tokens (K = 24) by length" in md


@pytest.mark.parametrize(
    "args,says",
    [
        (["--measure", "context_gian"], "unknown measure 'context_gian' (did you mean 'context_gain'?)"),
        (["--measure", "nope"], "valid measures: context_gain, key_tokens, retrieval, retrieval_short, or module"),
        (
            ["--measure", "context_gain", "--measure-option", "alpha=1"],
            "--measure-option alpha: no option of context_gain",
        ),
        (
            ["--measure", "key_tokens", "--measure-option", "beta=-1"],
            "--measure-option beta: -1 is not a positive number of nats",
        ),
        (["--measure", "context_gain", "--measure-option", "k=1"], "--measure-option k: 1 is not a length"),
        (["--measure-option", "k=8"], "--measure-option sets an option of a measure named by --measure"),
    ],
)
def test_a_bad_measure_name_or_option_is_one_line_and_writes_nothing(smoke, tmp_path, args, says):
    exp, _, _ = smoke
    run = tmp_path / "nope-seed0"
    shutil.copytree(exp / "nope-seed0", run)
    shutil.rmtree(run / "measures", ignore_errors=True)
    res = invoke("evaluate", run, *args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says in " ".join(res.output.split()), res.output
    assert not (run / "measures").exists()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (RoPE, context 32) saved as a transformers folder with its tokenizer, and a corpus."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_pretrained import CONTEXT, TEXT, _tokenizer, tiny_llama

    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tiny_llama(root / "llama")
    _tokenizer(320).save_pretrained(root / "llama")
    (root / "corpus.txt").write_text(TEXT * 3)
    return root, CONTEXT


def test_pretrained_scores_the_measures_into_its_run_folder_and_its_report(llama, tmp_path):
    root, context = llama
    out = tmp_path / "r"
    lengths = f"{context},{2 * context}"
    args = ["--data", root / "corpus.txt", "--set", f"out_dir={out}", "--set", "eval.tokens=512", "--lengths", lengths]
    res = invoke("pretrained", root / "llama", *args, "--measure", "context_gain,key_tokens", "--measure-option", "k=8")
    assert res.exit_code == 0, res.output
    run = out / "pretrained" / "llama"
    with open(run / "measures" / "context_gain.csv") as f:
        rows = {int(r["length"]): r for r in csv.DictReader(f)}
    assert rows[context]["status"] == "ok" and rows[context]["gain"] == "" and rows[context]["gain_k8"] != ""
    assert rows[2 * context]["scheme"] == "llama" and math.isfinite(float(rows[2 * context]["gain"]))
    meta = json.loads((run / "measures" / "key_tokens.json").read_text())
    assert meta["options"]["bytes_per_token"] > 1  # a BPE: thresholds above a byte's 0.5 nats
    assert meta["options"]["alpha"] == pytest.approx(2.0 * meta["options"]["bytes_per_token"] / 4, abs=1e-3)
    md = (out / "pretrained" / "summary.md").read_text()
    assert "## context_gain: context gain in nats (K = train_len) by length" in md
    # no seeds: each cell's interval is over the model's windows, from its records
    assert json.loads((run / "measures" / "context_gain.json").read_text())["samples"] == "windows"
    gain, ci = float(rows[2 * context]["gain_k8"]), float(rows[2 * context]["ci_gain_k8"])
    assert ci > 0 and rows[context]["ci_gain"] == ""  # not scored there: no interval either
    table = md.split("## context_gain: context gain in nats (K = 8) by length")[1].split("##")[0]
    assert f"{gain:.3f} ± {ci:.3f}" in table
    assert "a pretrained model's ± is over its windows" in folded(md)

    # a pretrained run's folder is scored by measures through pretrained, not evaluate
    res = invoke("evaluate", run, "--measure", "context_gain")
    assert res.exit_code == 2 and "--measure context_gain" in " ".join(res.output.split()), res.output


def test_a_configs_eval_measures_are_scored_after_training_and_not_again_on_a_rerun(tmp_path):
    from conftest import smoke_experiment

    more = ["--schemes", "alibi", "--set", "eval.measures=[context_gain]", "--set", "eval.measure_options.k=16"]
    exp, _, _ = smoke_experiment(tmp_path, *more)
    records = exp / "alibi-seed0" / "measures" / "context_gain.csv"
    with open(records) as f:
        assert {int(r["length"]): r["status"] for r in csv.DictReader(f)} == {32: "ok", 48: "ok", 64: "ok"}
    assert "## context_gain: context gain in nats (K = 16) by length" in (exp / "summary.md").read_text()
    before = records.stat().st_mtime_ns
    smoke_experiment(tmp_path, *more)  # the same command: nothing lacks
    assert records.stat().st_mtime_ns == before
    smoke_experiment(tmp_path, *more[:-1], "eval.measure_options.k=8")  # another K: scored anew
    with open(records) as f:
        assert "gain_k8" in next(csv.reader(f))
    # a bad name is one line before anything trains
    bad = ["--set", f"out_dir={tmp_path / 'x'}", "--set", "eval.measures=[gian]"]
    res = invoke("extrapolate", "--config", SMOKE, *bad)
    assert res.exit_code == 2 and not (tmp_path / "x").exists(), res.output
    # blamed on the --set that named it, not on the config file beside it
    assert " ".join(res.output.split()).startswith("error: --set eval.measures=[gian]: unknown measure 'gian'")


def test_the_help_of_evaluate_and_pretrained_names_every_measure_posbench_has():
    from conftest import folded

    from posbench.measures.plugin import MEASURES

    for command in ("evaluate", "pretrained"):
        text = folded(invoke(command, "--help").output)
        assert all(name in text for name in MEASURES), (command, list(MEASURES))


def test_a_variant_scores_both_passes_as_the_model_at_that_length_into_records_of_its_own():
    """variant=yarn: each length's two passes run inside the model's eval_variant(yarn, L), the
    short one too (the model as deployed at L, shown less), into context_gain_yarn."""

    class Scaled(Stub):
        def __init__(self):
            super().__init__(lambda win, i: torch.full((win.size(0),), HIGH if self.now else LOW))
            self.now, self.asked = None, []

        @contextlib.contextmanager
        def eval_variant(self, name, length, factor=None):
            self.asked.append((name, length, factor))
            self.now = name
            yield
            self.now = None

    model = Scaled()
    gain = ContextGain(variant="yarn")
    rows = gain.score(_run(model, _text(), lengths=(16, 32)))
    assert gain.name == "context_gain_yarn" and ContextGain().name == "context_gain"
    assert model.asked == [("yarn", 32, None), ("yarn", 32, None)]  # the full pass and the short, at L
    assert rows[1]["gain"] == 0.0  # both passes scaled alike: HIGH - HIGH
    keys = KeyTokens(variant="linear", factor=2.0)
    keys.score(_run(model, _text(), lengths=(32,)))
    assert keys.name == "key_tokens_linear" and model.asked[-1] == ("linear", 32, 2.0)
    with pytest.raises(PosbenchError, match="not a variant's name"):
        ContextGain(variant="yarn@2")


def test_the_committed_context_study_rebuilds_and_says_what_the_docs_say(tmp_path):
    """results/reference-context (make reproduce-context): the defaults, 3 seeds, to 800, under
    every measure. It rebuilds byte for byte; no scheme gains from the tokens beyond the last 100
    (the flat ones by a hair below zero, RoPE by more than a nat); retrieval of a 5-digit key
    among 10 stays near chance (10%) at every length, the training length's included."""
    from conftest import rebuilds_byte_for_byte

    committed = rebuilds_byte_for_byte("reference-context", tmp_path)
    gain, acc = {}, {}
    for run in sorted(p for p in committed.iterdir() if p.is_dir()):
        scheme = run.name.rsplit("-seed", 1)[0]
        for r in csv.DictReader((run / "measures" / "context_gain.csv").open()):
            if r["length"] == "800":
                gain.setdefault(scheme, []).append(float(r["gain"]))
        for r in csv.DictReader((run / "measures" / "retrieval_short.csv").open()):
            if r["status"] == "ok":
                acc.setdefault(scheme, []).append(float(r["retrieval_accuracy"]))
    assert len(gain) == 10 and all(len(v) == 3 for v in gain.values())
    assert all(sum(v) / 3 < 0 for v in gain.values()), gain
    assert sum(gain["rope"]) / 3 < -1.0 and -0.01 < sum(gain["alibi"]) / 3 < 0
    for scheme, values in acc.items():  # 5 depths x 4 lengths x 3 seeds, 20 trials each
        assert 0.05 < sum(values) / len(values) < 0.16, (scheme, sum(values) / len(values))
    summary = (committed / "summary.md").read_text()
    assert "| eff. length |" in summary
    # each measure says whose it is and how many runs it scored; a default option left unsaid
    assert (
        "- context_gain: context gain in nats (K = train_len), posbench's measure context_gain, on 30 runs\n" in summary
    )


def test_the_far_context_table_is_the_committed_context_study():
    """Every cell of docs/results.md's far-context table is results/reference-context's summary:
    perplexity at 100 and its ratio at 800, the context gain and % key tokens at 800, and the
    effective length."""
    from conftest import RESULTS_DOC, ROOT, markdown_table

    md = (ROOT / "results" / "reference-context" / "summary.md").read_text()

    def table(text, after):  # intervals kept: the docs show them
        return markdown_table(text, after, intervals=True)

    main = table(md, "## nonoverlapping")  # 100, 200, 400, 800, seeds, ratio, bpb, bpb, eff. length
    gain = table(md, "## context_gain: context gain in nats")  # 100, 200, 400, 800, seeds
    key = table(md, "## key_tokens: % key tokens")
    docs = table(RESULTS_DOC.read_text(), "| scheme | ppl(100) | ppl(800)/ppl(100) | context gain at 800")
    assert len(docs) == 7
    for row, cells in docs.items():
        scheme = row.split(" ")[0]  # "irope (1:1)"
        want = [main[scheme][0], main[scheme][5], gain[scheme][3], f"{key[scheme][3].split(' ± ')[0]}%"]
        assert cells == [*want, main[scheme][8].split(" ± ")[0]], row


def test_the_committed_smollm2_context_study_rebuilds_and_shows_a_model_that_uses_its_context(tmp_path):
    """results/reference-context-smollm2: a real model gives the measures their clear signal, a
    positive gain at K = 256 at every length from 1k to 8k, and every planted key ranked first
    but the one at the very start of an 8k window, its context's edge; scaled by 2 within its
    context, linear makes the far context hurt and yarn uses it as the plain model does and
    finds that key too. One model, no seeds: each cell's interval is over its windows (trials)."""
    from conftest import rebuilds_byte_for_byte

    committed = rebuilds_byte_for_byte("reference-context-smollm2", tmp_path)
    (run,) = [p for p in committed.iterdir() if p.is_dir()]

    def read(name):
        return list(csv.DictReader((run / "measures" / f"{name}.csv").open()))

    def gains(name):
        return [float(r["gain_k256"]) for r in read(name)]

    plain, linear, yarn = gains("context_gain"), gains("context_gain_linear"), gains("context_gain_yarn")
    assert len(plain) == 4 and all(g > 0.1 for g in plain), plain
    assert all(lin < 0 < g for lin, g in zip(linear, plain)), (linear, plain)
    assert all(y >= g for y, g in zip(yarn, plain)), (yarn, plain)

    def accuracy(name):
        return {(r["length"], r["depth"]): float(r["retrieval_accuracy"]) for r in read(name)}

    acc = accuracy("retrieval")
    assert len(acc) == 20 and acc.pop(("8192", "0")) == 0.0 and set(acc.values()) == {1.0}, acc
    assert set(accuracy("retrieval_yarn").values()) == {1.0}

    # each cell's ± is its windows' (its trials'), as its records hold it
    md = (committed / "summary.md").read_text()
    assert "| scheme | 1024 | 2048 | 4096 | 8192 | seeds | bpb(8192) | eff. length |" in md  # no ratio to itself
    ci = float(read("context_gain")[0]["ci_gain_k256"])
    table = md.split("## context_gain: context gain in nats (K = 256) by length")[1].split("##")[0]
    assert ci > 0 and f"{plain[0]:.3f} ± {ci:.3f}" in table
    said = {line.split(":")[0]: line for line in md.splitlines() if line.startswith("- ")}
    assert said["- context_gain_yarn"].endswith("; a pretrained model's ± is over its windows")
    assert said["- retrieval_linear"].endswith("; a pretrained model's ± is over its trials")


def test_the_committed_catalogue_rebuilds_and_holds_what_the_docs_say(tmp_path):
    """results/reference-catalogue (make reproduce-catalogue): it rebuilds byte for byte, every cell
    of docs/results.md's table is the summary's, the RoPE-window/NoPE pattern beats both its parts at 800
    by more than their intervals, the full-attention pattern does not beat RoPE, FoX's context
    gain is exactly zero, and no scheme retrieves a key above twice chance."""
    from conftest import RESULTS_DOC, rebuilds_byte_for_byte

    committed = rebuilds_byte_for_byte("reference-catalogue", tmp_path)
    md = (committed / "summary.md").read_text()
    main = {line.split("|")[1].strip(): [c.strip().strip("*") for c in line.split("|")[2:-1]]
            for line in md.split("## nonoverlapping")[1].split("\n\n")[1].splitlines()[2:]}  # fmt: skip
    gain = {line.split("|")[1].strip(): line.split("|")[5].strip().strip("*")
            for line in md.split("## context_gain")[1].split("\n\n")[1].splitlines()[2:]}  # fmt: skip
    readme = RESULTS_DOC.read_text()
    table = readme[readme.index("| scheme | ppl(100) | ppl(800) | context gain at 800") :].split("\n\n")[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert len(rows) == 7
    for scheme, ppl100, ppl800, g, eff in ([c.strip() for c in r] for r in rows):
        scheme = scheme.split(" ")[0]
        assert (ppl100, ppl800, eff) == (main[scheme][0], main[scheme][3], main[scheme][-1]), scheme
        assert g == gain[scheme], scheme

    def mean_ci(cell):
        mean, ci = cell.split(" ± ")
        return float(mean), float(ci)

    (swa, swa_ci), (rope, rope_ci), (nope, nope_ci) = (mean_ci(main[s][3]) for s in ("rnope_swa", "rope", "nope"))
    assert swa + swa_ci < rope - rope_ci and swa + swa_ci < nope - nope_ci
    assert mean_ci(main["irope"][3])[0] >= rope - rope_ci
    gains = [float(r["gain"]) for run in committed.glob("fox-seed*") for r in csv.DictReader(
        (run / "measures" / "context_gain.csv").open()) if r["gain"]]  # fmt: skip
    assert len(gains) == 9 and set(gains) == {0.0}  # 200, 400 and 800 (100 is K: no gain there)
    for run in committed.glob("*-seed*"):
        acc = [
            float(r["retrieval_accuracy"]) for r in csv.DictReader((run / "measures" / "retrieval_short.csv").open())
        ]
        assert len(acc) == 20 and sum(acc) / len(acc) < 0.2, run.name


def test_a_measure_scored_under_a_training_free_variant_records_eager_and_otherwise_the_backend(tmp_path):
    """context_gain with variant=rerope attends through the remap's own formula: its rows say
    eager; as trained and with yarn they say the model's backend."""
    from posbench.check import tiny_model
    from posbench.measures.plugin import score_into

    model = tiny_model("rope", train_len=K, d_model=32, n_head=2)
    model.cfg.attention = "sdpa"
    for variant, want in ((None, "sdpa"), ("yarn", "sdpa"), ("rerope", "eager")):
        gain = ContextGain(k=[8], variant=variant)
        (tmp_path / str(variant)).mkdir()
        rows = score_into(gain, "context_gain", _run(model, _text(), lengths=(32,)), tmp_path / str(variant))
        assert {r["attention"] for r in rows} == {want}, variant
