"""Seeds and spread: Student's t intervals, ties for best, and the tables reports write."""

import math
import re

import pandas as pd
import pytest
from conftest import SMOKE, invoke

from posbench.report import comparison, latex, with_metric
from posbench.stats import mean_ci, paired_p, t_quantile, tied_for_best, welch_p

# two-sided 95% critical values of Student's t, df = 1..9 (2 to 10 seeds), from the printed tables
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262]


@pytest.mark.parametrize("df", range(1, 10))
def test_the_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df - 1], abs=5e-4)


def test_identical_seeds_give_an_interval_of_zero_width_and_one_seed_none():
    assert mean_ci([6.5, 6.5, 6.5]) == (6.5, 0.0)
    mean, half = mean_ci([6.0])
    assert mean == 6.0 and math.isnan(half)
    mean, half = mean_ci([1.0, 3.0])  # sd = sqrt(2), n = 2: 12.706 * sqrt(2) / sqrt(2)
    assert mean == 2.0 and half == pytest.approx(12.706, abs=1e-3)


def test_a_paired_test_sees_a_consistent_gap_that_welch_cannot():
    """Seeds vary a lot between them, but one scheme is 0.1 better on every seed."""
    a = [5.0, 7.0, 9.0, 6.0]
    b = [x + 0.1 + 0.001 * i for i, x in enumerate(a)]
    assert paired_p(a, b) < 0.001 and welch_p(a, b) > 0.5
    assert paired_p(a, a) == 1.0 and welch_p(a, a) == 1.0


def test_tied_for_best_marks_the_best_and_whoever_cannot_be_told_apart():
    values = {
        "alibi": {0: 6.0, 1: 6.2, 2: 5.9},
        "t5": {0: 6.05, 1: 6.15, 2: 5.95},  # no consistent gap to alibi
        "rope": {0: 7.0, 1: 7.2, 2: 6.9},  # 1.0 worse on every seed
    }
    best, tied, test = tied_for_best(values)
    assert best == "alibi" and tied == {"alibi", "t5"} and test == "paired"
    best, tied, test = tied_for_best({"alibi": {0: 6.0}, "rope": {0: 7.0}})
    assert best == "alibi" and tied == {"alibi"} and test == "none"
    _, _, test = tied_for_best({"alibi": {0: 6.0, 1: 6.1}, "rope": {3: 7.0, 4: 7.2}})
    assert test == "welch"


def _rows():
    rows = []
    for scheme, base in (("alibi", 6.0), ("rope", 6.2)):
        for seed in (0, 1, 2):
            for L, grow in ((100, 1.0), (200, 1.3 if scheme == "rope" else 0.99)):
                ppl = base * grow + 0.01 * seed
                rows.append(
                    {
                        "scheme": scheme,
                        "seed": seed,
                        "train_len": 100,
                        "length": L,
                        "protocol": "nonoverlapping",
                        "stride": "",
                        "loss": math.log(ppl),
                        "ppl": ppl,
                        "tokens": 1000,
                        "status": "ok",
                        "attention": "native",
                    }
                )
    return pd.DataFrame(rows)


def test_the_table_holds_means_intervals_marks_and_the_chosen_metric():
    table = comparison(with_metric(_rows(), "ppl"))
    assert table.loc["alibi", 100] == pytest.approx(6.01) and table.loc["alibi", "ci 100"] == pytest.approx(
        t_quantile(0.975, 2) * 0.01 / math.sqrt(3)
    )
    assert table.loc["alibi", "best 200"] and not table.loc["rope", "best 200"]
    ratio = comparison(with_metric(_rows(), "ratio"))
    assert ratio.loc["rope", 200] == pytest.approx(1.3, abs=0.01) and ratio.loc["alibi", 100] == pytest.approx(1.0)
    loss = comparison(with_metric(_rows(), "loss"))
    assert loss.loc["alibi", 100] == pytest.approx(sum(math.log(6.0 + 0.01 * s) for s in range(3)) / 3)


@pytest.mark.parametrize("transpose", [False, True])
def test_latex_is_booktabs_with_balanced_environments_and_the_right_columns(transpose):
    df = with_metric(_rows(), "ppl")
    text = latex({"nonoverlapping": comparison(df)}, df, "ppl", transpose)
    assert text.count("\\begin{") == text.count("\\end{") == 2
    for word in ("\\toprule", "\\midrule", "\\bottomrule"):
        assert text.count(word) == 1
    spec = re.search(r"\\begin\{tabular\}\{(\w+)\}", text).group(1)
    body = [line for line in text.splitlines() if line.endswith("\\\\")]
    assert all(line.count(" & ") == len(spec) - 1 for line in body)
    assert len(spec) == (1 + 2 if transpose else 1 + 2 + 2)  # length, 2 schemes; or scheme, 2 lengths, seeds, ratio
    assert "\\textbf{5.99" not in text and "\\textbf{" in text and "$\\pm$" in text


def test_report_joins_experiments_and_refuses_ones_that_do_not_compare(tmp_path, corpus_file):
    common = ["--config", SMOKE, "--set", f"out_dir={tmp_path}", "--set", f"data.path={corpus_file}"]
    assert invoke("extrapolate", *common, "--schemes", "alibi", "--set", "name=a").exit_code == 0
    assert invoke("extrapolate", *common, "--schemes", "rope", "--set", "name=b").exit_code == 0
    res = invoke("report", tmp_path / "a", tmp_path / "b", "--metric", "ratio", "--transpose")
    assert res.exit_code == 0, res.output
    joined = tmp_path / "a+b"
    text = (joined / "summary.md").read_text()
    assert "| length | alibi | rope |" in text and "perplexity over its perplexity at the training length" in text
    for name in ("summary.csv", "summary.tex", "summary.png", "positions.png", "training.png"):
        assert (joined / name).is_file(), name
    # another training length, or other protocols: one line, nothing written
    assert (
        invoke(
            "extrapolate",
            *common,
            "--schemes",
            "rope",
            "--set",
            "name=c",
            "--set",
            "model.train_len=24",
            "--lengths",
            "24,48",
        ).exit_code
        == 0
    )
    assert (
        invoke("extrapolate", *common, "--schemes", "rope", "--set", "name=d", "--protocol", "sliding").exit_code == 0
    )
    for other, what in (("c", "training length differ (32 against 24)"), ("d", "protocols differ")):
        res = invoke("report", tmp_path / "a", tmp_path / other)
        assert res.exit_code == 2 and "Traceback" not in res.output
        assert f"cannot join a and {other}: their {what}" in " ".join(res.output.split())
        assert not (tmp_path / f"a+{other}").exists()
    res = invoke("report", tmp_path / "a", "--metric", "bits")
    assert res.exit_code == 2 and "--metric bits: expected one of ppl, loss, ratio" in res.output


def test_one_seed_says_there_is_no_interval(tmp_path, corpus_file):
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0
    assert "1 seed: no interval; use --seeds 0,1,2" in (tmp_path / "smoke" / "summary.md").read_text()


def test_the_committed_reference_rebuilds_to_its_committed_summary(tmp_path):
    """results/reference holds the records of configs/reproduce-alibi.yaml (no weights): a fresh
    report of them gives the committed tables, digit for digit."""

    from conftest import ROOT, report_rebuilt

    committed = ROOT / "results" / "reference"
    copy = tmp_path / "reference"
    res = report_rebuilt(committed, copy, ("summary.csv", "summary.md", "summary.tex"))
    assert res.exit_code == 0, res.output
    for name in ("summary.csv", "summary.md", "summary.tex"):
        assert (copy / name).read_text() == (committed / name).read_text(), name
    runs = sorted(p.name for p in committed.iterdir() if p.is_dir())
    assert runs == [f"{s}-seed{n}" for s in ("alibi", "rope", "sinusoidal", "t5") for n in (0, 1, 2)]
    for run in runs:
        assert {"config.yaml", "eval.csv", "positions.csv", "train_log.jsonl"} <= {
            p.name for p in (committed / run).iterdir()
        }


@pytest.mark.parametrize("args", [["--seeds", ""], ["--seeds", ","], ["--set", "seeds=[]"]])
def test_an_empty_seed_list_is_one_line_and_writes_nothing(tmp_path, args):
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={tmp_path / 'r'}", *args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "seeds is empty" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
