"""Retrieval by likelihood (posbench/measures/retrieval.py) on models whose answer is known: one
that copies what followed the last occurrence of its context retrieves every planted key; one that
ignores its context ranks the true key as chance does. And its records' second axis (depth), its
tables per depth and its heatmap (posbench/measures/plugin.py)."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import random
import shutil
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import invoke

from posbench.config import ExperimentConfig
from posbench.measures.base import ScoringRun
from posbench.measures.plugin import KEYS, score_into
from posbench.measures.retrieval import Retrieval, candidate_losses, summary

V = 256  # bytes
SPEC = "posbench.measures.retrieval:Retrieval"


class Copier(torch.nn.Module):
    """An exact induction model: where the last K tokens occurred before, it gives the token that
    followed them probability P (the rest share 1 - P); elsewhere every token 1/V."""

    K, P = 8, 0.9
    max_len = None

    def backend(self, device) -> str:
        return "copy"

    def token_losses(self, win: torch.Tensor) -> torch.Tensor:
        out = torch.full((win.size(0), win.size(1) - 1), math.log(V))  # (b, T)
        for b, seq in enumerate(win.tolist()):
            last = {}  # a K-gram -> where it last ended
            for t in range(len(seq) - 1):  # predicting seq[t + 1] from seq[: t + 1]
                if t + 1 < self.K:
                    continue
                gram = tuple(seq[t + 1 - self.K : t + 1])
                if gram in last:
                    hit = seq[t + 1] == seq[last[gram] + 1]
                    out[b, t] = -math.log(self.P if hit else (1 - self.P) / (V - 1))
                last[gram] = t
        return out


class Unigram(torch.nn.Module):
    """Ignores its context: each token's loss is its own, from a fixed table (uniform: log V)."""

    max_len = None

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table  # (V,)

    def backend(self, device) -> str:
        return "unigram"

    def token_losses(self, win: torch.Tensor) -> torch.Tensor:
        return self.table[win[:, 1:]]  # (b, T)


def filler(n: int = 20000) -> torch.Tensor:
    """Pseudo-English bytes that never say "key": the validation split the filler is drawn from."""
    rng = random.Random(0)
    words = "the king and queen of a castle to be or not that is question my lord".split()
    return torch.frombuffer(bytearray(" ".join(rng.choice(words) for _ in range(n // 4)).encode()), dtype=torch.uint8)


def scoring_run(model, lengths=(200, 400)) -> ScoringRun:
    cfg = ExperimentConfig()
    cfg.eval.lengths = list(lengths)
    return ScoringRun(cfg, model, torch.device("cpu"), types.SimpleNamespace(val=filler()))


def by_depth(rows: list[dict]) -> dict:
    return {(r["length"], r["depth"]): r for r in rows}


def test_a_model_that_copies_retrieves_the_key_at_every_depth_and_length():
    """Each distractor differs from the true key in some digit; at the first one the copier gives
    the true digit P and the distractor's (1 - P) / (V - 1), and after it the distractor's context
    never occurred (1/V, less than P): so the margin is at least log(P (V - 1) / (1 - P))."""
    measure = Retrieval(trials=4, distractors=5)
    rows = measure.score(scoring_run(Copier()))
    assert sorted(by_depth(rows)) == [(L, d) for L in (200, 400) for d in (0, 25, 50, 75, 100)]
    floor = math.log(Copier.P * (V - 1) / (1 - Copier.P))
    for r in rows:
        assert r["retrieval_accuracy"] == 1.0 and r["retrieval_rank"] == 1.0, r
        assert r["retrieval_margin"] >= floor - 1e-9, r


def test_each_cell_carries_its_interval_over_the_trials():
    """Two trials, the true key first in one and last of three in the other: accuracy 1 and 0,
    mean 0.5, sd sqrt(1/2); with t(0.975, 1) = 12.706 the half-width is 12.706 / 2. Ranks 1 and 3,
    twice that; margins 1 and -2 (the best distractor 2 nats above), 3/2 of it."""
    got = summary([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])])
    assert got["retrieval_accuracy"] == 0.5 and got["retrieval_rank"] == 2.0 and got["retrieval_margin"] == -0.5
    t = 12.706205
    assert got["ci"] == pytest.approx(
        {"retrieval_accuracy": t / 2, "retrieval_rank": t, "retrieval_margin": 1.5 * t}, rel=1e-6
    )
    (one,) = Retrieval(trials=1, depths=[50], lengths=[200]).score(scoring_run(Copier()))
    assert all(math.isnan(v) for v in one["ci"].values())  # one trial: no interval


def test_a_model_that_ignores_its_context_is_exactly_at_chance_when_every_key_is_as_likely():
    """Every candidate ties: first place is split N + 1 ways, the rank is the mean of 1..N+1."""
    N = 4
    rows = Retrieval(trials=3, distractors=N).score(scoring_run(Unigram(torch.full((V,), math.log(V)))))
    for r in rows:
        assert r["retrieval_accuracy"] == pytest.approx(1 / (N + 1))
        assert r["retrieval_rank"] == pytest.approx((N + 2) / 2)
        assert r["retrieval_margin"] == pytest.approx(0.0, abs=1e-9)


def test_a_model_that_ignores_its_context_is_at_chance_on_average_whatever_it_prefers():
    """The true key and its distractors are a uniform draw of distinct keys, the true one picked
    at random among them: so a model blind to the needle ranks it first with probability
    1/(N + 1) and at (N + 2)/2 on average, whatever each digit's loss. Within 4 standard errors
    over the independent trials."""
    N, trials = 4, 40
    table = torch.rand(V, generator=torch.Generator().manual_seed(0)) * 3  # (V,) a preference per byte
    rows = Retrieval(trials=trials, distractors=N).score(scoring_run(Unigram(table)))
    n = trials * len(rows)
    p = 1 / (N + 1)
    acc = sum(r["retrieval_accuracy"] for r in rows) / len(rows)
    assert abs(acc - p) < 4 * math.sqrt(p * (1 - p) / n)
    rank = sum(r["retrieval_rank"] for r in rows) / len(rows)
    sd = math.sqrt((N + 1) ** 2 - 1) / math.sqrt(12)  # a uniform rank on 1..N+1
    assert abs(rank - (N + 2) / 2) < 4 * sd / math.sqrt(n)


def test_the_short_texts_leave_a_byte_run_at_its_training_length_most_of_its_window():
    """ShortRetrieval's needle, question and answer take 36 bytes: at posbench's default
    training length (100 bytes) the copier still retrieves every key, where Retrieval's take 104."""
    from posbench.measures.retrieval import ShortRetrieval

    rows = ShortRetrieval(trials=2).score(scoring_run(Copier(), lengths=(100,)))
    assert [r["retrieval_accuracy"] for r in rows] == [1.0] * 5
    assert [r.get("status") for r in Retrieval(trials=1).score(scoring_run(Copier(), lengths=(100,)))] == [
        "too-short"
    ] * 5


def test_a_variant_scores_within_the_models_variant_at_each_length_into_records_of_its_own():
    class Scaled(Copier):
        def __init__(self):
            super().__init__()
            self.asked = []

        @contextlib.contextmanager
        def eval_variant(self, name, length, factor=None):
            self.asked.append((name, length, factor))
            yield

    model = Scaled()
    measure = Retrieval(trials=1, depths=(50,), variant="yarn")
    measure.score(scoring_run(model))
    assert model.asked == [("yarn", 200, None), ("yarn", 400, None)] and measure.name == "retrieval_yarn"
    assert measure.options["variant"] == "yarn" and Retrieval().name == "retrieval"


def test_the_same_run_gives_the_same_table_and_another_seed_another_draw():
    table = torch.rand(V, generator=torch.Generator().manual_seed(1))
    run = scoring_run(Unigram(table), lengths=(200,))
    a, b = Retrieval(trials=3).score(run), Retrieval(trials=3).score(run)
    assert a == b
    assert Retrieval(trials=3, seed=1).score(run) != a


def test_a_length_too_short_for_the_needle_and_question_says_so():
    rows = Retrieval(trials=1, depths=(50,)).score(scoring_run(Copier(), lengths=(60, 200)))
    assert [r.get("status", "ok") for r in rows] == ["too-short", "ok"]


def test_the_records_keep_the_depth_column_and_the_options(tmp_path):
    rows = score_into(Retrieval(trials=2, depths=(0, 100)), SPEC, scoring_run(Copier(), lengths=(200,)), tmp_path)
    with open(tmp_path / "measures" / "retrieval.csv") as f:
        reader = csv.DictReader(f)
        got = list(reader)
    cis = [f"ci_{m}" for m in Retrieval.metrics]  # each metric's interval over the trials
    assert reader.fieldnames == KEYS[:4] + ["depth"] + KEYS[4:] + list(Retrieval.metrics) + cis
    assert [(r["length"], r["depth"], r["status"]) for r in got] == [("200", "0", "ok"), ("200", "100", "ok")]
    # the copier ranks the true key first in every trial: no spread in either
    assert all(float(r["ci_retrieval_accuracy"]) == float(r["ci_retrieval_rank"]) == 0.0 for r in got)
    meta = json.loads((tmp_path / "measures" / "retrieval.json").read_text())
    assert meta["measure"] == SPEC and meta["axis"] == "depth" and meta["samples"] == "trials"
    assert meta["options"]["depths"] == [0, 100] and meta["options"]["trials"] == 2
    assert meta["options"]["distractors"] == 9 and meta["options"]["key_digits"] == 5
    assert len(rows) == 2
    from posbench.trackers import _measure_points

    sent = _measure_points(tmp_path)  # a tracker's series per depth, the length as its step
    assert set(sent) == {f"eval/{m}.depth{d}@200" for m in Retrieval.metrics for d in (0, 100)}


def test_a_pretrained_model_reading_the_prompt_once_scores_the_candidates_as_whole_windows_do():
    """PretrainedLM.continuation_losses (the prompt's keys and values kept) against token_losses
    on each candidate's whole window, on a tiny random Llama; one candidate of another length."""
    transformers = pytest.importorskip("transformers")
    from posbench.pretrained import PretrainedLM

    torch.manual_seed(0)
    shape = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = PretrainedLM(transformers.LlamaForCausalLM(shape), None, Path("tiny"))
    prompt, cands = torch.randint(64, (40,)), [torch.randint(64, (5,)) for _ in range(4)] + [torch.randint(64, (3,))]
    with torch.no_grad():
        once = candidate_losses(model, "cpu", [(prompt, cands)], 16)[0]
        whole = candidate_losses(types.SimpleNamespace(token_losses=model.token_losses), "cpu", [(prompt, cands)], 2)[0]
    assert torch.allclose(once, whole, atol=1e-4), (once, whole)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_the_prompt_is_encoded_as_the_runs_corpus_was_cut(tmp_path, monkeypatch, tokenizer):
    """data.tokenizer_of finds the run's tokenizer (a BPE: the one cached when the corpus was
    cut, never trained again): the validation text it encodes is the corpus's validation split."""
    pytest.importorskip("tokenizers")
    from posbench.config import DataConfig
    from posbench.data import load_corpus, tokenizer_of
    from posbench.text import split_point

    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "words.txt"
    path.write_bytes(bytes(filler(6000)) + b"\n")
    size = 300 if tokenizer == "bpe" else None
    cfg = DataConfig(path=str(path), tokenizer=tokenizer, vocab_size=size, val_fraction=0.1)
    corpus = load_corpus(cfg)

    def cached() -> dict:
        return {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.json")}

    trained = cached()
    tok = tokenizer_of(cfg)
    assert cached() == trained
    text = path.read_bytes()  # ASCII: the split falls where the last 10% of its bytes begin
    assert tok.name == corpus.tokenizer
    assert np.array_equal(tok.encode(text[split_point(len(text), 0.1) :]), np.asarray(corpus.val))


SHORT = """
from posbench.measures.retrieval import Retrieval

class Short(Retrieval):
    '''Retrieval whose needle and question fit the smoke runs' 32 to 64 bytes.'''

    options = {
        **Retrieval.options, "needle": "\\nkey {key}.\\n", "question": "\\nkey", "key_digits": 3, "trials": 3,
        "depths": [0, 50, 100],
    }
"""


@pytest.mark.plots
def test_evaluate_scores_smoke_runs_and_the_report_tables_each_depth_and_draws_a_heatmap(smoke, tmp_path, monkeypatch):
    """posbench evaluate --measure on two trained runs (a copy of the suite's smoke experiment),
    then posbench report: a table of schemes x lengths per depth and metric, the long rows with
    their depth, and retrieval.png."""
    exp = tmp_path / "smoke"
    shutil.copytree(smoke[0], exp)
    (tmp_path / "short_retrieval.py").write_text(textwrap.dedent(SHORT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "short_retrieval", raising=False)
    for run in ("nope-seed0", "learned-seed0"):
        res = invoke("evaluate", exp / run, "--measure", "short_retrieval:Short")
        assert res.exit_code == 0, res.output
        # a table per metric, a row per depth: 15 columns of one row would not fit a terminal
        heads = [line for line in res.output.splitlines() if line.startswith("┃ depth \\ length")]
        assert len(heads) == 3 and all(h.split("┃")[2].strip() == "32" for h in heads), res.output
        assert "needle='\\nkey {key}.\\n'" in res.output  # a text option as Python writes it
    with open(exp / "learned-seed0" / "measures" / "retrieval.csv") as f:
        status = {(r["length"], r["depth"]): r["status"] for r in csv.DictReader(f)}
    assert status[("64", "50")] == "beyond-max-len" and status[("32", "50")] == "ok"  # learned's table ends at 48
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    md = (exp / "summary.md").read_text()
    for d in (0, 50, 100):
        assert f"## retrieval: % keys ranked first by length at depth {d}\n" in md
        assert f"## retrieval: margin over the best distractor (nats) by length at depth {d}\n" in md
    assert "by depth and length; scored with depths 0,50,100, trials 3, distractors 9, key_digits 3" in md
    with open(exp / "retrieval.csv") as f:
        long = list(csv.DictReader(f))
    assert {r["depth"] for r in long} == {"0", "50", "100"} and {r["scheme"] for r in long} == {"nope", "learned"}
    assert (exp / "retrieval.png").stat().st_size > 0


def test_a_task_run_has_no_corpus_to_draw_filler_from_and_says_so_in_one_line(task_smoke, tmp_path):
    run = tmp_path / "nope-seed0"
    shutil.copytree(task_smoke / "nope-seed0", run)
    res = invoke("evaluate", run, "--measure", SPEC)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "a run of task copy has no corpus to draw filler from" in " ".join(res.output.split())
    assert not (run / "measures").exists()


@pytest.mark.parametrize("cls", ["Retrieval", "ShortRetrieval"])
def test_a_trial_fills_the_window_to_exactly_l_and_plants_the_needle_at_its_depth(cls):
    """The model reads L tokens in all (prompt and answer, less the last), and the needle starts
    `depth` percent of the way into the filler: at its start, middle and end."""
    import posbench.measures.retrieval as retrieval

    measure = getattr(retrieval, cls)(trials=1)
    val = np.full(5000, ord("x"), dtype=np.uint8)  # filler the needle's first byte is not

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode()), dtype=torch.int64)

    for L in (150, 200):  # Retrieval's needle, question and answer are 104 bytes
        for depth in (0, 50, 100):
            prompt, cands = measure.trial(encode, val, L, depth, 0)
            assert {len(prompt) + len(c) for c in cands} == {L + 1}
            needle = len(encode(measure.needle.format(key="0" * measure.key_digits)))
            filler = len(prompt) - needle - len(encode(measure.question))
            start = next(i for i, t in enumerate(prompt.tolist()) if t != ord("x"))
            assert start == round(depth / 100 * filler), (L, depth)
            assert bytes(prompt[start : start + needle].tolist()).decode().startswith(measure.needle.split("{")[0])
