"""A user's measure (posbench/measures/plugin.py): one file, scored on an existing run with
`posbench evaluate RUN --measure module:Class`, reported beside the run's own measure."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
from conftest import ROOT, invoke, smoke_experiment

SPEC = "examples.my_measure:NextByteAccuracy"


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """The smoke experiment, nope and alibi at seeds 0 and 1, each run scored by the example
    measure, then reported."""
    tmp = tmp_path_factory.mktemp("measures")
    exp, _, _ = smoke_experiment(tmp, "--schemes", "nope,alibi", "--seeds", "0,1", "--tracker", "tensorboard")
    for run in sorted(p for p in exp.glob("*-seed*") if p.is_dir()):
        res = invoke("evaluate", run, "--measure", SPEC)
        assert res.exit_code == 0, res.output
        assert f"wrote {run / 'measures' / 'next_byte.csv'}" in " ".join(res.output.split())
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    return exp, res.output


def _records(run) -> dict[int, float]:
    with open(run / "measures" / "next_byte.csv") as f:
        return {int(r["length"]): float(r["next_byte_accuracy"]) for r in csv.DictReader(f)}


def test_a_users_measure_scores_what_it_says_on_the_runs_own_windows(scored):
    """The records hold, at each length, the share of non-overlapping windows' next bytes the
    model's top guess gets right, recomputed here from the checkpoint."""
    import torch

    from posbench.data import load_corpus
    from posbench.evaluate import eval_tokens
    from posbench.experiment.checkpoint import load_run

    exp, _ = scored
    run = exp / "alibi-seed1"
    rc, model = load_run(run)
    model.eval()
    tokens = eval_tokens(load_corpus(rc.data), rc, rc.eval.lengths).long()
    got = _records(run)
    assert sorted(got) == rc.eval.lengths
    for L in rc.eval.lengths:
        n = (len(tokens) - 1) // L  # whole windows
        x = tokens[: n * L].view(n, L)
        y = tokens[1 : n * L + 1].view(n, L)
        with torch.no_grad():
            want = (model(x).argmax(-1) == y).sum().item() / y.numel()
        assert got[L] == pytest.approx(want, abs=1e-9), L


def test_a_run_scored_by_two_measures_reports_both_with_intervals_a_plot_and_latex(scored):
    from posbench.stats import mean_ci

    exp, output = scored
    md = (exp / "summary.md").read_text()
    assert "## nonoverlapping" in md and "## next_byte: % next bytes guessed by length" in md
    assert f"a user's measure ({SPEC}), on " in md
    table = md.split("## next_byte: % next bytes guessed by length\n\n")[1].strip().splitlines()
    row = next(r for r in table if r.startswith("| alibi |")).strip("|").split("|")
    L = int(table[0].strip("|").split("|")[1])
    mean, ci = mean_ci([_records(exp / f"alibi-seed{s}")[L] for s in (0, 1)])
    assert row[1].strip().strip("*") == f"{100 * mean:.1f} ± {100 * ci:.1f}"
    assert "next\\_byte: \\% next bytes guessed by length" in (exp / "summary.tex").read_text()
    assert (exp / "next_byte.png").stat().st_size > 0 and (exp / "next_byte.csv").is_file()
    assert "next_byte: % next bytes guessed by length" in " ".join(output.split())  # the terminal too


def test_a_users_measure_is_sent_to_the_runs_tracker_as_its_own_series(scored):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    exp, _ = scored
    run = exp / "nope-seed0"
    events = EventAccumulator(str(exp / "tensorboard" / run.name))
    events.Reload()
    sent = {e.step: e.value for e in events.Scalars("eval_by_length/next_byte_accuracy")}  # the step: the length
    assert sent == pytest.approx(_records(run), rel=1e-6)


def test_its_records_name_their_metrics_so_a_report_needs_no_import_of_the_users_code(scored, tmp_path):
    """A report of a copy, where the measure's module cannot be imported, still shows it."""
    import subprocess
    import sys

    exp, _ = scored
    meta = json.loads((exp / "nope-seed0" / "measures" / "next_byte.json").read_text())
    assert meta["measure"] == SPEC and meta["metrics"]["next_byte_accuracy"]["higher_is_better"] is True
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    (copy / "summary.md").unlink()
    code = "import sys; sys.modules['examples'] = None; from posbench.cli import main; main()"
    res = subprocess.run(
        [sys.executable, "-c", code, "report", str(copy)], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "## next_byte" in (copy / "summary.md").read_text()


@pytest.mark.parametrize(
    "args,says",
    [
        (["--measure", "examples.nothing_here:X"], "measure 'examples.nothing_here:X': cannot import module"),
        (["--measure", "examples.my_measure:Missing"], "module 'examples.my_measure' has no 'Missing'"),
        (["--measure", "examples.my_scheme:MyScheme"], "examples.my_scheme:MyScheme"),
        (["--measure", SPEC, "--lengths", "64"], "--lengths applies to the run's own measure, not to --measure"),
    ],
)
def test_a_bad_measure_is_one_line_and_writes_nothing(scored, tmp_path, args, says):
    exp, _ = scored
    run = tmp_path / "nope-seed0"
    shutil.copytree(exp / "nope-seed0", run)
    shutil.rmtree(run / "measures")
    res = invoke("evaluate", run, *args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says in " ".join(res.output.split()), res.output
    assert not (run / "measures").exists()


@pytest.mark.parametrize(
    "name,says",
    [
        ("summary", "is a file a report writes"),
        ("summary_md", "is a file a report writes"),
        ("eval", "is a file a report writes"),  # eval.csv would make the experiment folder look like a run
        ("retrieval", "is posbench's own measure"),
    ],
)
def test_a_measure_named_as_a_reports_file_or_posbenchs_own_measure_is_refused(
    scored, tmp_path, monkeypatch, name, says
):
    """A report writes a measure's table as <name>.csv beside summary.csv: a measure named as
    one of posbench's files or measures would overwrite them, so it is refused before scoring."""
    module = f"clash_{name}"
    code = f"from examples.my_measure import NextByteAccuracy\n\nclass Clash(NextByteAccuracy):\n    name = {name!r}\n"
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    exp, _ = scored
    run = tmp_path / "nope-seed0"
    shutil.copytree(exp / "nope-seed0", run)
    shutil.rmtree(run / "measures")
    res = invoke("evaluate", run, "--measure", f"{module}:Clash")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"measure '{module}:Clash': its name '{name}' {says}; give the measure another name" in res.output
    assert not (run / "measures").exists()


def test_a_malformed_measure_record_is_one_line(scored, tmp_path):
    exp, _ = scored
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    (copy / "alibi-seed0" / "measures" / "next_byte.csv").write_text("length,oops\n1,2\n")
    res = invoke("report", copy)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "next_byte.csv: malformed measure records" in " ".join(res.output.split())


@pytest.mark.parametrize("damage", ["cut", "json", "no csv"])
def test_a_damaged_measure_record_names_the_file_that_is_damaged(scored, tmp_path, damage):
    """A row cut mid-write is refused, not read as unscored cells; a bad description names the
    .json, and a table that is gone is called missing."""
    exp, _ = scored
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    folder = copy / "alibi-seed0" / "measures"
    table, described = folder / "next_byte.csv", folder / "next_byte.json"
    if damage == "cut":
        text = table.read_text()
        table.write_text(text[: text.rindex(",")] + "\n")  # the last row loses its last cell
        says = f"{table}: malformed measure records"
    elif damage == "json":
        described.write_text("{")
        says = f"{described}: malformed measure description"
    else:
        table.unlink()
        says = f"{table}: missing, though next_byte.json describes it"
    res = invoke("report", copy)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert says in " ".join(res.output.split())


def test_the_example_measure_is_documented_where_plugins_are():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert SPEC in doc and "Scorer" in doc
