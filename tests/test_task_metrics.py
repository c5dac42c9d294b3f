"""A task's two metrics at every test length: exact match of the whole answer (the NoPE study's)
and per-token accuracy, the answer bytes right teacher-forced (Ruoss et al.'s), from scoring to
eval.csv to the report's tables."""

import csv
import math

import pytest
import torch
import torch.nn as nn
from conftest import invoke, task_experiment

from posbench.accuracy import decode, score
from posbench.errors import PosbenchError
from posbench.measures.exact_match import ExactMatch
from posbench.measures.exact_match.records import read_task_eval
from posbench.tasks import END, build_task

SMALL = {"train_max": 4, "test_max": 7, "test_count": 6}


class Teacher(nn.Module):
    """Predicts the true next byte of whichever test instance it reads, given the true bytes
    before it, except at answer byte `wrong` (0: the first, -1: END), where it says a byte no
    answer holds."""

    def __init__(self, test, wrong=None):
        super().__init__()
        self.answers = {p: a for _, p, a in test}
        self.wrong = wrong

    def forward(self, tokens):
        B, T = tokens.shape
        logits = torch.zeros(B, T, 256)  # (B, T, V)
        for b in range(B):
            row = bytes(tokens[b].tolist())
            prompt = next(p for p in self.answers if row.startswith(p))
            answer = bytearray(self.answers[prompt] + b"#" * 4)
            if self.wrong is not None:
                answer[self.wrong % len(self.answers[prompt])] = 1  # \x01: in no alphabet
            for t in range(len(prompt) - 1, T):
                logits[b, t, answer[t - len(prompt) + 1]] = 1.0
        return logits


@pytest.mark.parametrize("wrong", [None, -1, 0], ids=["oracle", "all-but-END", "all-but-the-first"])
def test_one_wrong_answer_byte_costs_the_whole_instance_and_one_byte_of_n_plus_1(wrong):
    """copy of length n answers n bytes and END. An oracle scores 100% on both metrics; a model
    wrong at one byte (END, or the first) is never exact, yet right on n of n+1 bytes, since each
    byte is predicted given the true ones before it (the first wrong byte derails greedy decoding,
    not the per-token count)."""
    test = build_task("copy", SMALL).test_set()
    model = Teacher(test, wrong)
    rows = score(model, test, "cpu")
    assert [r["length"] for r in rows] == list(range(1, SMALL["test_max"] + 1))
    for r in rows:
        n, count = r["length"], r["instances"]
        assert r["status"] == "ok" and count > 0 and r["tokens"] == (n + 1) * count
        if wrong is None:
            assert r["correct"] == count and r["accuracy"] == 1.0
            assert r["tokens_correct"] == r["tokens"] and r["token_accuracy"] == 1.0
        else:
            assert r["correct"] == 0 and r["accuracy"] == 0.0
            assert r["tokens_correct"] == n * count and r["token_accuracy"] == pytest.approx(n / (n + 1))
    answers = decode(model, [(p, a) for _, p, a in test], "cpu")
    assert (answers == [a for _, _, a in test]) == (wrong is None)  # greedy agrees with exact match
    if wrong == -1:
        assert all(
            ans[:-1] == a[:-1] and a.endswith(END) and not ans.endswith(END) for ans, (_, _, a) in zip(answers, test)
        )


def test_both_metrics_are_registered_higher_is_better():
    m = ExactMatch.metrics
    assert list(m) == ["exact_match", "token_accuracy"]
    assert (m["exact_match"].label, m["token_accuracy"].label) == ("% exact match", "% answer bytes right")
    assert all(x.higher_is_better and x.name == name for name, x in m.items())


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """copy, nope and alibi seed 0, trained enough that some answer bytes are right and some wrong."""
    return task_experiment(tmp_path_factory.mktemp("metrics"), "nope,alibi", "--set", "train.steps=40")


def eval_rows(run):
    with (run / "eval.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def md_table(text: str, heading: str) -> dict:
    """The Markdown table under `heading`: scheme -> {column: cell}, bold marks removed."""
    lines = text.split(f"## {heading}\n\n")[1].split("\n\n")[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip().replace("**", "") for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {r[0]: dict(zip(head, r)) for r in rows}


def test_eval_csv_holds_both_metrics_per_length_and_evaluate_shows_both(experiment):
    for scheme in ("nope", "alibi"):
        rows = eval_rows(experiment / f"{scheme}-seed0")
        assert list(rows[0]) == [
            "task", "metric", "scheme", "seed", "train_max", "length", "correct", "instances", "accuracy",
            "tokens_correct", "tokens", "token_accuracy", "status", "attention", "weights",
        ]  # fmt: skip
        for r in rows:
            n, count = int(r["length"]), int(r["instances"])
            assert r["metric"] == "exact_match" and int(r["tokens"]) == (n + 1) * count  # copy: n bytes and END
            assert float(r["token_accuracy"]) == pytest.approx(int(r["tokens_correct"]) / int(r["tokens"]))
            assert int(r["correct"]) * (n + 1) <= int(r["tokens_correct"])  # an exact instance has every byte right
    res = invoke("evaluate", experiment / "nope-seed0")
    assert res.exit_code == 0, res.output
    shown = [ln.split() for ln in res.output.splitlines()]
    assert any("exact" in ln and "per-token" in ln for ln in shown), res.output
    for r in eval_rows(experiment / "nope-seed0"):
        want = [r["length"], f"{100 * float(r['accuracy']):.1f}%", f"{100 * float(r['token_accuracy']):.1f}%"]
        assert any([c for c in ln if c not in "│┃|"][:3] == want for ln in shown), (want, res.output)


def test_report_metric_token_accuracy_tables_answer_bytes_right_over_answer_bytes(experiment):
    """Each cell equals the bytes right over the bytes, summed over the bucket's lengths straight
    from eval.csv; summary.csv holds the rows of both metrics whichever is tabled."""
    res = invoke("report", experiment, "--metric", "token_accuracy")
    assert res.exit_code == 0, res.output
    md = (experiment / "summary-token_accuracy.md").read_text()  # a view, beside the summary
    assert md.startswith("# copy: per-token accuracy by length")
    heading = "copy: % answer bytes right by length (trained on 1..3)"
    table = md_table(md, heading)
    assert "% answer bytes right by length" in (experiment / "summary-token_accuracy.tex").read_text().replace(
        "\\%", "%"
    )
    cells = set()
    for scheme in ("nope", "alibi"):
        rows = eval_rows(experiment / f"{scheme}-seed0")
        for column, lengths in [("in-dist", range(1, 4)), ("out-of-dist", range(4, 6))] + [
            (str(n), [n]) for n in range(1, 6)
        ]:
            at = [r for r in rows if int(r["length"]) in lengths]
            right, of = sum(int(r["tokens_correct"]) for r in at), sum(int(r["tokens"]) for r in at)
            assert table[scheme][column] == f"{100 * right / of:.1f}", (scheme, column, table)
            cells.add(table[scheme][column])
    assert len(cells) > 2, table  # partly learned: the cells tell bytes right from instances exact
    summary = list(csv.DictReader((experiment / "summary.csv").open()))
    assert {r["metric"] for r in summary} == {"exact_match", "token_accuracy"}
    for r in summary:
        right, of = ("tokens_correct", "tokens") if r["metric"] == "token_accuracy" else ("correct", "instances")
        assert float(r["value"]) == pytest.approx(int(r[right]) / int(r[of]))
    before = (experiment / "summary.csv").read_text()

    res = invoke("report", experiment)  # the default stays exact match
    assert res.exit_code == 0, res.output
    md = (experiment / "summary.md").read_text()
    assert md.startswith("# copy: exact-match accuracy by length")
    assert "## copy: % exact match by length (trained on 1..3)" in md and "answer bytes right" not in md
    assert (experiment / "summary.csv").read_text() == before


def test_an_unknown_metric_is_one_line_naming_both(experiment):
    res = invoke("report", experiment, "--metric", "bits")
    assert res.exit_code == 2 and "Traceback" not in res.output
    said = " ".join(res.output.split())
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert "--metric bits" in said and "exact_match or token_accuracy" in said, res.output
    assert not (experiment / "summary.md").exists() or "bits" not in (experiment / "summary.md").read_text()


def test_an_eval_csv_without_an_ok_length_s_byte_count_is_malformed(experiment, tmp_path):
    run = experiment / "alibi-seed0"
    rows = eval_rows(run)
    assert "tokens_correct" in rows[0] and read_task_eval(run) == rows
    rows[0]["tokens_correct"] = ""  # an ok length must say how many of its answer bytes were right
    bad = tmp_path / "alibi-seed0"
    bad.mkdir()
    with (bad / "eval.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(PosbenchError, match="malformed task evaluation rows"):
        read_task_eval(bad)


def _out(point, seed, values):
    import pandas as pd

    return pd.DataFrame(
        [
            {"metric": "exact_match", "bucket": "out", "point": point, "seed": seed, "scheme": s, "value": v}
            for s, v in values.items()
        ]
    )


def test_mean_reciprocal_rank_ranks_each_point_and_seed_and_shares_ties():
    """Two tasks x two seeds, as the NoPE study ranks them: per (task, seed), 1 / rank past N."""
    import pandas as pd

    from posbench.measures.exact_match.views import ranks_section, reciprocal_ranks

    long = pd.concat(
        [
            _out("task=copy", 0, {"nope": 0.9, "alibi": 0.5, "rope": 0.0}),  # ranks 1, 2, 3
            _out("task=copy", 1, {"nope": 0.2, "alibi": 0.7, "rope": 0.0}),  # 2, 1, 3
            _out("task=sort", 0, {"nope": 0.4, "alibi": 0.0, "rope": 0.0}),  # 1, 2.5, 2.5
            _out("task=sort", 1, {"nope": 0.1, "alibi": math.nan, "rope": 0.3}),  # alibi unscored: left out
        ]
    )
    rr = reciprocal_ranks(long, "exact_match")
    assert len(rr) == 9
    mrr = rr.groupby("scheme")["rr"].mean()
    assert mrr["nope"] == pytest.approx((1 + 1 / 2 + 1) / 3)
    assert mrr["alibi"] == pytest.approx((1 / 2 + 1 + 1 / 2.5) / 3)
    assert mrr["rope"] == pytest.approx((1 / 3 + 1 / 3 + 1 / 2.5) / 3)
    section = ranks_section(long, "exact_match")
    assert section.rows[0] == ["scheme", "mean reciprocal rank", "task=copy", "task=sort"]
    # through the engine's cells: the mean and its 95% interval over the pairs (t = 4.303 at 2
    # degrees of freedom), and over a point's seeds, with the seeds a point lacks named
    rope = [1 / 3, 1 / 3, 1 / 2.5]
    sd = math.sqrt(sum((x - sum(rope) / 3) ** 2 for x in rope) / 2)
    assert section.rows[3][:2] == ["rope", f"0.36 ± {4.303 * sd / math.sqrt(3):.2f}"]
    assert [(r[0], r[1].split(" ± ")[0]) for r in section.rows[1:]] == [("nope", "0.83"), ("alibi", "0.63")] + [
        ("rope", "0.36")
    ]
    assert [r[2:] for r in section.rows[1:]] == [
        ["0.75 ± 3.18", "1.00 (1 of 2 seeds)"],  # copy: 1 and 1/2 (t = 12.71 at 1 degree of freedom)
        ["0.75 ± 3.18", "0.40 (1 of 2 seeds)"],
        ["0.33 ± 0.00", "0.40 (1 of 2 seeds)"],
    ]
    # the pairs cannot tell the three apart at p < 0.05, nor copy's two seeds: no bold there;
    # sort's one seed has a best, as any one-seed column does
    assert section.best == {(1, 3)}
    assert "none at a column where every scheme ties" in section.caption
    assert "3 (grid point, seed) pairs" in section.heading
