"""What a report tables: only runs that compare, only what the command asked for, and never an
error for runs that are merely still running elsewhere."""

import json
import shutil

from conftest import SMOKE, invoke

from posbench.files import exclusive


def _smoke(out, name, *more, schemes="alibi,rope"):
    text = out / "tiny.txt"
    if not text.exists():
        text.write_text("to be or not to be that is the question\n" * 400)
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        schemes,
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
        "--set",
        f"name={name}",
        *more,
    )
    assert res.exit_code == 0, res.output
    return out / name, res


def test_a_join_of_experiments_trained_under_other_budgets_is_refused(tmp_path):
    """Joined rows share one header that names one budget: experiments that differ in anything
    but scheme and seed (here train.steps) do not join, and nothing is written."""
    a, _ = _smoke(tmp_path, "a", schemes="alibi")
    b, _ = _smoke(tmp_path, "b", "--set", "train.steps=20", schemes="rope")
    res = invoke("report", a, b)
    assert res.exit_code == 2 and "Traceback" not in res.output
    text = " ".join(res.output.split())
    assert "cannot join a and b: they were trained under different settings" in text
    assert "train.steps: 30 in a, 20 in b" in text
    assert not (tmp_path / "a+b").exists()


def test_a_training_command_tables_what_it_asked_for_not_what_evaluate_added(tmp_path):
    """After evaluate scores a run at another length and with a RoPE scaling, rerunning the
    same extrapolate shows the lengths and rows it asks for; `report` shows everything."""
    exp, first = _smoke(tmp_path, "s")
    res = invoke("evaluate", exp / "rope-seed0", "--lengths", "32,96", "--rope-scaling", "yarn")
    assert res.exit_code == 0, res.output
    _, again = _smoke(tmp_path, "s")
    table = again.output.split("wrote")[0]
    assert " 96 " not in table and "rope+yarn" not in table and " 64 " in table
    md = (exp / "summary.md").read_text()
    assert "| scheme | 32 | 48 | 64 | seeds | ppl(64)/ppl(32) |" in md and "rope+yarn" not in md
    assert invoke("report", exp).exit_code == 0
    md = (exp / "summary.md").read_text()
    # the headline ratio stays at the longest length every scheme was scored at
    assert "| scheme | 32 | 48 | 64 | 96 | seeds | ppl(64)/ppl(32) |" in md and "| rope+yarn |" in md


def test_the_headline_ratio_stays_where_every_scheme_was_scored(tmp_path):
    """ppl(longest)/ppl(train) is — where the scheme cannot encode the longest length
    (learned's table of 48 at 64); after evaluate scores alibi alone at 96, the ratio stays at 64,
    where every scheme was scored, with the same cells, rather than moving to 96 and going blank
    for the others."""

    def ratios(exp):
        lines = [r.split("|") for r in (exp / "summary.md").read_text().splitlines() if r.startswith("| ")]
        at = next(i for i, c in enumerate(lines[0]) if c.strip().startswith("ppl("))  # the ratio's column
        return lines[0][at].strip(), {r[1].strip(): r[at].strip() for r in lines[1:]}

    exp, _ = _smoke(tmp_path, "s", schemes="alibi,learned")
    head, before = ratios(exp)
    assert head == "ppl(64)/ppl(32)" and before["learned"] == "—" and before["alibi"] not in ("", "—")
    assert invoke("evaluate", exp / "alibi-seed0", "--lengths", "96").exit_code == 0
    assert invoke("report", exp).exit_code == 0
    assert " 96 |" in (exp / "summary.md").read_text() and ratios(exp) == (head, before)


def test_report_transpose_transposes_the_terminal_table_too(tmp_path):
    """--transpose puts lengths in rows on the terminal as in the files."""
    exp, _ = _smoke(tmp_path, "s")
    res = invoke("report", exp, "--transpose")
    assert res.exit_code == 0, res.output
    # the scheme x length tables (the rope law's has no length axis to transpose)
    heads = [line for line in res.output.splitlines() if line.startswith("┃") and "predicted break" not in line]
    assert heads and all(h.split("┃")[1].strip() == "length" for h in heads)
    assert any(line.startswith("│ 48 ") for line in res.output.splitlines())


def test_evaluate_and_inspect_of_an_experiment_folder_name_one_of_its_runs(tmp_path):
    """An experiment folder is not a run: the advice names one of its runs, not 'train it first'."""
    exp, _ = _smoke(tmp_path, "s")
    for args in (("evaluate", exp), ("inspect", exp)):
        res = invoke(*args)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and "train it first" not in text, text
        assert "an experiment folder, not a run; give one of its runs, e.g." in text and "alibi-seed0" in text


def test_the_same_command_while_another_process_trains_every_run_ends_cleanly(tmp_path):
    """A second extrapolate whose runs another process holds skips them and says there is
    nothing to report yet, exit 0; report of the folder says the same."""
    out = tmp_path / "r"
    exp = out / "s"
    exp.mkdir(parents=True)
    locks = [exclusive(exp / f".{run}.lock") for run in ("alibi-seed0", "rope-seed0")]
    held = [lock.__enter__() for lock in locks]
    try:
        assert all(held)
        shutil.copy(SMOKE, tmp_path / "smoke.yaml")
        text = tmp_path / "tiny.txt"
        text.write_text("to be or not to be that is the question\n" * 400)
        res = invoke(
            "extrapolate",
            "--config",
            tmp_path / "smoke.yaml",
            "--schemes",
            "alibi,rope",
            "--set",
            f"out_dir={out}",
            "--set",
            f"data.path={text}",
            "--set",
            "name=s",
        )
        flat = " ".join(res.output.split())
        assert res.exit_code == 0, res.output
        assert "is running it; skipped here" in flat and "nothing to report yet" in flat and "error" not in flat
        res = invoke("report", exp)
        assert res.exit_code == 0 and "every run is still running in another process" in " ".join(res.output.split())
    finally:
        for lock in locks:
            lock.__exit__(None, None, None)


def test_status_lists_a_run_asked_for_but_never_started(tmp_path):
    """An experiment folder records the runs it was asked to hold: status names a missing one
    as pending, beside the done ones."""
    exp, _ = _smoke(tmp_path, "s")
    shutil.rmtree(exp / "rope-seed0")  # as if the command had been stopped before it
    res = invoke("status", exp)
    assert res.exit_code == 0, res.output
    lines = {line.split("│")[1].strip(): line for line in res.output.splitlines() if line.startswith("│")}
    assert "pending" in lines["rope-seed0"] and "done" in lines["alibi-seed0"]
    assert (exp / "runs.txt").read_text() == "alibi-seed0\nrope-seed0\n"


def test_a_copied_run_folder_is_one_line_naming_both_and_a_bad_log_line_is_passed_over(tmp_path):
    """A run copied within its experiment (a backup) would give (scheme, seed) two rows; a line
    of train_log.jsonl cut off or edited by hand is no step, and the rest still plot."""
    exp, _ = _smoke(tmp_path, "s", schemes="alibi")
    log = exp / "alibi-seed0" / "train_log.jsonl"
    kept = log.read_text()
    with log.open("a") as f:
        f.write('[1, 2]\n5\n{"step": 5}\n{"loss": 5}\n{"step": 5, "loss": [1]}\n{"step": "x", "loss": 1}\n{bad\n')
    res = invoke("report", str(exp))
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output

    from posbench.experiment.records import read_train_log

    assert read_train_log(exp / "alibi-seed0") == [json.loads(x) for x in kept.splitlines()]

    shutil.copytree(exp / "alibi-seed0", exp / "backup")
    res = invoke("report", str(exp))
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "alibi-seed0 and backup both hold alibi seed 0; move one of them out" in res.output


def test_a_folder_named_dot_or_the_root_is_the_folder_it_stands_for(tmp_path, monkeypatch):
    exp, _ = _smoke(tmp_path, "s", schemes="alibi")
    monkeypatch.chdir(exp)
    res = invoke("report", ".")
    assert res.exit_code == 0 and f"wrote {exp / 'summary.md'}" in res.output, res.output
    res = invoke("status", "/")
    assert res.exit_code == 2 and "Traceback" not in res.output and "/: holds no runs" in res.output, res.output
    monkeypatch.chdir(exp / "alibi-seed0")
    res = invoke("extend", ".", "--to", "64", "--steps", "1", "--lengths", "64")
    assert res.exit_code == 0, res.output
    assert (exp / "alibi-seed0-extend64" / "summary.md").is_file()


def test_a_table_that_cannot_be_written_is_named_not_its_temporary_file(tmp_path):
    """Tables are written under a temporary name and renamed: an error names the table."""
    from conftest import ROOT

    exp = tmp_path / "reference-bytes"
    shutil.copytree(ROOT / "results" / "reference-bytes", exp)
    (exp / "summary.csv").unlink()
    (exp / "summary.csv").mkdir()
    (exp / "summary.md").write_text("an earlier report's")
    res = invoke("report", exp)
    assert res.exit_code == 2, res.output
    assert f"{exp / 'summary.csv'}: Is a directory" in " ".join(res.output.split())
    assert "tmp-" not in res.output and not list(exp.glob("tmp-*")) and not list(exp.glob(".together-*"))
    assert (exp / "summary.md").read_text() == "an earlier report's"  # none of the report's files moved in
