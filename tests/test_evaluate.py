"""posbench evaluate on a trained run: new lengths, the run's own config, another device, a
process without the training loop; and the table of a length only some seeds reached."""

import csv
import json
import os
import shutil

import pytest
import torch
import yaml
from conftest import SMOKE, invoke


def test_evaluate_an_existing_run_at_new_lengths(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "rope-seed0"
    shutil.copytree(exp / "rope-seed0", run)
    res = invoke("evaluate", run, "--lengths", "32,96")
    assert res.exit_code == 0, res.output
    rows = {int(r["length"]): r for r in csv.DictReader((run / "eval.csv").open())}
    assert sorted(rows) == [32, 48, 64, 96]
    old = {int(r["length"]): r for r in csv.DictReader((exp / "rope-seed0" / "eval.csv").open())}
    assert rows[32]["loss"] == old[32]["loss"]  # evaluation is deterministic
    # each scoring is a line of eval_log.jsonl: what it scored, by which backend, where
    first, again = [json.loads(line) for line in (run / "eval_log.jsonl").read_text().splitlines()]
    assert (first["lengths"], again["lengths"], again["measure"]) == ([32, 48, 64], [32, 96], "perplexity")
    assert (again["device"], again["threads"], again["attention"]) == (
        "cpu",
        torch.get_num_threads(),
        rows[96]["attention"],
    )


def test_evaluate_of_a_run_another_process_holds_is_one_line_and_loses_no_row(smoke, tmp_path):
    """Each scoring reads a run's records and writes them back with its rows merged in: a second
    evaluate while another process holds the run (scoring it, or training it) is refused, so
    neither one's rows are lost; once the run is free, it scores."""
    from posbench.experiment.records import lock_file
    from posbench.files import exclusive

    exp, _, _ = smoke
    run = tmp_path / "exp" / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    before = (run / "eval.csv").read_text()
    for args in (["--lengths", "96"], ["--measure", "context_gain"]):
        with exclusive(lock_file(run)):
            res = invoke("evaluate", run, *args)
        said = f"{run}: another posbench process (pid {os.getpid()}) is training or scoring it"
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
        assert (run / "eval.csv").read_text() == before and not (run / "measures").exists()
    res = invoke("evaluate", run, "--lengths", "96")
    assert res.exit_code == 0 and not lock_file(run).exists(), res.output
    assert "96" in {r["length"] for r in csv.DictReader(open(run / "eval.csv"))}


def test_a_scoring_stopped_between_its_records_is_scored_whole_again(smoke, tmp_path, monkeypatch):
    """A run's three records of a length are written one after another; a process stopped after
    the first leaves eval.csv without the length, so the rerun scores it again and every file
    holds it (eval.csv first left positions without it for good, and report misread the break)."""
    import gzip

    from posbench.measures.perplexity import score

    exp, _, _ = smoke
    run = tmp_path / "rope-seed0"
    shutil.copytree(exp / "rope-seed0", run)
    writes, real = [], score.write_rows

    def stopped_after_one(path, *args):
        writes.append(path)
        if len(writes) == 2:
            raise KeyboardInterrupt
        return real(path, *args)

    monkeypatch.setattr(score, "write_rows", stopped_after_one)
    res = invoke("evaluate", run, "--lengths", "96")
    said = " ".join(res.output.split())
    assert res.exit_code == 130 and "interrupted: the records hold only what was scored in full" in said, said
    assert "96" not in {r["length"] for r in csv.DictReader(open(run / "eval.csv"))}
    monkeypatch.setattr(score, "write_rows", real)
    assert invoke("evaluate", run, "--lengths", "96").exit_code == 0
    assert "96" in {r["length"] for r in csv.DictReader(open(run / "eval.csv"))}
    assert "96" in {r["length"] for r in csv.DictReader(gzip.open(run / "positions.csv.gz", "rt"))}
    assert "96" in {r["length"] for r in csv.DictReader(open(run / "windows.csv"))}


def test_evaluate_with_the_runs_own_settings_finishes_a_scoring_that_was_stopped(smoke, tmp_path):
    """scoring.txt (a stop between two blocks of rows) stays through an evaluate of some lengths,
    and goes once evaluate has scored every row the run's own config asks for."""
    from posbench.experiment.status import run_status

    exp, _, _ = smoke
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    run = copy / "alibi-seed0"
    (run / "scoring.txt").write_text("scoring began (pid 1)\n")
    assert {r["run"]: r for r in run_status(copy)}["alibi-seed0"]["state"] == "partial"
    assert invoke("evaluate", run, "--lengths", "32").exit_code == 0 and (run / "scoring.txt").is_file()
    assert invoke("evaluate", run).exit_code == 0 and not (run / "scoring.txt").exists()
    assert {r["run"]: r for r in run_status(copy)}["alibi-seed0"]["state"] == "done"


def test_evaluate_reads_the_runs_config_and_rescores_rows_on_other_tokens(smoke, tmp_path):
    """The run's config.yaml is its record: evaluate scores with its eval.tokens, and rows left
    from other tokens are scored again, so one eval.csv never mixes token sets. A config.yaml
    that does not match the weights is refused; a missing one is restored."""
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    old = {r["length"]: r for r in csv.DictReader((run / "eval.csv").open())}
    assert len(old) >= 3 and {r["tokens"] for r in old.values()} != {"400"}
    rec = yaml.safe_load((run / "config.yaml").read_text())
    rec["eval"]["tokens"] = 400
    (run / "config.yaml").write_text(yaml.safe_dump(rec))
    assert invoke("evaluate", run, "--lengths", "32").exit_code == 0
    new = {r["length"]: r for r in csv.DictReader((run / "eval.csv").open())}
    assert set(new) == set(old) and {r["tokens"] for r in new.values()} == {"400"}

    rec["train"]["steps"] += 1
    (run / "config.yaml").write_text(yaml.safe_dump(rec))
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "config.yaml does not describe model.pt (train.steps: 30 in model.pt," in " ".join(
        res.output.split()
    )
    (run / "config.yaml").unlink()
    assert invoke("evaluate", run, "--lengths", "32").exit_code == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == rec["train"]["steps"] - 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_run_trained_on_a_gpu_is_scored_here_with_device_cpu(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    rec = yaml.safe_load((run / "config.yaml").read_text())
    rec["train"]["device"] = "cuda"  # as if trained on a GPU (the device does not decide weights)
    (run / "config.yaml").write_text(yaml.safe_dump(rec))
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "no CUDA device is available here (--device cpu runs on the CPU)" in res.output
    assert invoke("evaluate", run, "--lengths", "32", "--device", "cpu").exit_code == 0
    res = invoke("evaluate", run, "--lengths", "32", "--device", "tpu")
    assert res.exit_code == 2 and "--device tpu: expected auto, cpu, cuda or cuda:N" in res.output


def test_evaluate_scores_a_run_without_loading_the_training_loop(smoke, tmp_path):
    """Scoring is the measure's: `posbench evaluate` runs in a process where posbench.train
    cannot be imported, and adds the asked length to the run's eval.csv."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    code = (
        "import sys; sys.modules['posbench.train'] = None; from posbench.cli import main; "
        f"sys.argv = ['posbench', 'evaluate', {str(run)!r}, '--lengths', '48']; sys.exit(main())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "48" in {r["length"] for r in csv.DictReader((run / "eval.csv").open())}


def test_a_length_only_some_seeds_reached_says_so_and_its_ratio_uses_those_seeds(tmp_path, corpus_file):
    out = tmp_path / "r"
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--seeds",
        "0,1",
        "--set",
        "train.steps=3",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0, res.output
    exp = out / "smoke"
    assert invoke("evaluate", exp / "alibi-seed0", "--lengths", "80").exit_code == 0
    assert invoke("report", exp).exit_code == 0
    rows = {
        (r["seed"], int(r["length"])): float(r["ppl"])
        for r in csv.DictReader((exp / "alibi-seed0" / "eval.csv").open())
    }
    md = (exp / "summary.md").read_text()
    assert f"{rows['0', 80]:.2f} (1 of 2 seeds)" in md
    cells = [c.strip() for c in md.split("| alibi |")[1].splitlines()[0].split("|")]
    # the ratio column, before bpb: seed 0's own ratio, saying it stands on one of the two seeds
    assert cells[-4].strip("*") == f"{rows['0', 80] / rows['0', 32]:.2f} (1 of 2 seeds)"


def test_evaluate_decides_as_extrapolate_decides_and_names_its_flags(smoke, tmp_path):
    """evaluate's flags go through the run's measure, as a config's keys do (resolve.resolve_scoring):
    the training length, every ratio's base, is scored beside --lengths under the same backend;
    sliding takes a quarter of train_len as its stride; an error names the flag and writes nothing."""
    from posbench.experiment.execute import evaluate_run

    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    L = yaml.safe_load((run / "config.yaml").read_text())["model"]["train_len"]
    _, _, rows = evaluate_run(run, {"eval.lengths": ("--lengths 96", [96])})
    assert sorted(int(r["length"]) for r in rows) == [L, 96]
    _, _, rows = evaluate_run(run, {"eval.perplexity.protocol": ("--protocol sliding", ["sliding"])})
    assert {(r["protocol"], int(r["stride"])) for r in rows} == {("sliding", L // 4)}
    before = (run / "eval.csv").read_bytes()
    for args, said in (
        (
            ["--lengths", str(L // 2)],
            f"--lengths {L // 2}: eval.lengths [{L // 2}] are shorter than the training length",
        ),
        (
            ["--protocol", "sliding", "--stride", str(L + 1)],
            f"--stride {L + 1}: eval.perplexity.stride={L + 1} is longer than",
        ),
        (
            ["--protocol", "slidng"],
            "--protocol slidng: eval.perplexity.protocol: unknown protocol 'slidng' (did you mean 'sliding'?)",
        ),
    ):
        res = invoke("evaluate", run, *args)
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
        assert len(res.output.strip().splitlines()) == 1 and (run / "eval.csv").read_bytes() == before


def test_a_length_given_twice_is_one_line_not_two_rows(smoke, tmp_path):
    """evaluate --lengths 64,64 is refused in one line; the run's rows stay one per length."""
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    before = (run / "eval.csv").read_bytes()
    res = invoke("evaluate", run, "--lengths", "64,64")
    assert res.exit_code == 2 and "--lengths 64,64: eval.lengths: 64 listed more than once" in res.output
    assert (run / "eval.csv").read_bytes() == before


def test_flags_given_nothing_are_one_line_not_the_runs_own_settings(smoke, tmp_path):
    """--lengths , and --protocol , name nothing: refused, never read as "not given"."""
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    before = (run / "eval.csv").read_bytes()
    for args, message in (
        (("--lengths", ","), "--lengths ,: eval.lengths is empty"),
        (("--protocol", ","), "--protocol ',': name a protocol"),
    ):
        res = invoke("evaluate", run, *args)
        assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert (run / "eval.csv").read_bytes() == before


def test_evaluate_says_when_the_runs_own_tracker_cannot_be_sent_the_rows(smoke, tmp_path, monkeypatch):
    """A run whose recorded train.tracker has no library installed here is still scored, and
    a line says its rows are not sent to that tracker."""
    import posbench.trackers

    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    rec = yaml.safe_load((run / "config.yaml").read_text())
    rec["train"]["tracker"] = "trackio"
    (run / "config.yaml").write_text(yaml.safe_dump(rec))
    monkeypatch.setattr(posbench.trackers, "tracker_installed", lambda name: name != "trackio")
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "not sent to trackio (the run's train.tracker): its library is not installed here" in said
    assert "32" in {r["length"] for r in csv.DictReader((run / "eval.csv").open())}  # scored all the same
