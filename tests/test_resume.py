"""An experiment run again: it resumes, moves and grows, and never mixes runs trained under
other settings."""

import csv
import shutil

import yaml
from conftest import SMOKE, invoke


def test_rerun_resumes_and_is_reproducible(smoke, tmp_path):
    """Same config and seed, fresh folder: the same numbers. Same folder: nothing retrained."""
    exp, _, text = smoke
    out = tmp_path / "again"
    args = [
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi,rope",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
    ]
    assert invoke(*args).exit_code == 0
    fresh = list(csv.DictReader((out / "smoke" / "summary.csv").open()))
    first = [r for r in csv.DictReader((exp / "summary.csv").open()) if r["scheme"] in ("alibi", "rope")]
    assert fresh == first
    stamp = (out / "smoke" / "alibi-seed0" / "model.pt").stat().st_mtime_ns
    res = invoke(*args)
    assert res.exit_code == 0 and "already trained" in res.output
    assert (out / "smoke" / "alibi-seed0" / "model.pt").stat().st_mtime_ns == stamp


def test_a_moved_experiment_still_resumes(smoke, tmp_path):
    """Where the results live is not part of what was trained."""
    exp, _, text = smoke
    out = tmp_path / "moved"
    shutil.copytree(exp, out / "smoke")
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={out}", "--set", f"data.path={text}"
    )
    assert res.exit_code == 0, res.output
    assert "already trained" in res.output


def test_rerun_with_other_threads_resumes(smoke, tmp_path):
    exp, _, text = smoke
    out = tmp_path / "t"
    shutil.copytree(exp, out / "smoke")
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "rope",
        "--threads",
        "1",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
    )
    assert res.exit_code == 0 and "already trained" in res.output


def test_a_run_that_lost_its_config_yaml_resumes_from_the_checkpoints_copy(smoke, tmp_path):
    exp, _, text = smoke
    out = tmp_path / "results"
    shutil.copytree(exp, out / "smoke")
    (out / "smoke" / "alibi-seed0" / "config.yaml").unlink()
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={out}", "--set", f"data.path={text}"
    )
    assert res.exit_code == 0 and "already trained" in res.output, res.output
    assert (out / "smoke" / "alibi-seed0" / "config.yaml").is_file()


def test_growing_the_lengths_scores_only_the_new_one(smoke, tmp_path, monkeypatch):
    import posbench.evaluate

    exp, _, text = smoke
    out = tmp_path / "grow"
    shutil.copytree(exp, out / "smoke")
    scored = []
    real = posbench.evaluate.evaluate_model

    def spy(model, tokens, lengths, *a, **kw):
        scored.append(list(lengths))
        return real(model, tokens, lengths, *a, **kw)

    monkeypatch.setattr(posbench.evaluate, "evaluate_model", spy)
    lengths = yaml.safe_load(open(SMOKE))["eval"]["lengths"]
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--lengths",
        ",".join(map(str, lengths + [56])),
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
    )
    assert res.exit_code == 0, res.output
    assert scored == [[56]]


def test_a_run_stopped_while_it_is_scored_is_said_to_be_scored_in_part_until_the_rerun(smoke, tmp_path, monkeypatch):
    """A run's rows are written a (variant, protocol) at a time: a stop between two leaves
    scoring.txt, so status calls the run partial (not done) and the report names it as scored in
    part beside the rows it has; the rerun scores the rest and removes it."""
    import posbench.evaluate
    from posbench.experiment.status import run_status

    exp, _, text = smoke
    out = tmp_path / "stopped"
    shutil.copytree(exp, out / "smoke")
    calls, real = [], posbench.evaluate.evaluate_model

    def stopped_at_the_second(*a, **kw):
        calls.append(a[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    lengths = yaml.safe_load(open(SMOKE))["eval"]["lengths"]
    args = ["extrapolate", "--config", SMOKE, "--schemes", "rope", "--lengths", ",".join(map(str, lengths + [56]))]
    args += ["--protocol", "nonoverlapping,sliding", "--set", f"out_dir={out}", "--set", f"data.path={text}"]
    monkeypatch.setattr(posbench.evaluate, "evaluate_model", stopped_at_the_second)
    assert invoke(*args).exit_code == 130 and calls[0] == [56]
    run = out / "smoke" / "rope-seed0"
    assert "56" in {r["length"] for r in csv.DictReader(open(run / "eval.csv"))}  # the first block's rows are kept
    row = {r["run"]: r for r in run_status(out / "smoke")}["rope-seed0"]
    assert (row["state"], row["detail"]) == (
        "partial",
        "scored in part: a stop left scoring.txt; rerun to score the rest",
    )
    res = invoke("report", out / "smoke")
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "scored in part, so some of their rows are missing" in said and "rope-seed0" in said
    assert "scored in part" in (out / "smoke" / "summary.md").read_text()
    monkeypatch.undo()
    assert invoke(*args).exit_code == 0 and not (run / "scoring.txt").exists()
    assert {r["run"]: r for r in run_status(out / "smoke")}["rope-seed0"]["state"] == "done"
    assert {r["protocol"] for r in csv.DictReader(open(run / "eval.csv"))} == {"nonoverlapping", "sliding"}
    assert "scored in part" not in (out / "smoke" / "summary.md").read_text()


def test_an_experiment_grows_by_a_scheme_with_its_own_options_and_other_threads(smoke, tmp_path):
    """What an experiment's runs must share leaves out scheme options, threads and workers."""
    exp, _, text = smoke
    out = tmp_path / "results"
    shutil.copytree(exp, out / "smoke")
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "randomized",
        "--threads",
        "1",
        "--set",
        "scheme_options.randomized.max_pos=256",
        "--set",
        "train.workers=1",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
    )
    assert res.exit_code == 0, res.output
    assert (out / "smoke" / "randomized-seed0" / "model.pt").is_file()


def test_failure_keeps_earlier_results(smoke, tmp_path, corpus_file):
    """A bad rerun into an existing experiment fails cleanly and leaves the old runs as they were."""
    exp, _, text = smoke
    out = tmp_path / "results"
    shutil.copytree(exp, out / "smoke")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.steps=7",
    )
    assert res.exit_code != 0 and "holds runs trained under other settings" in res.output
    assert "train.steps: 30 in alibi-seed0, 7 here" in " ".join(res.output.split())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_an_unfinished_run_begun_under_other_settings_is_refused_and_its_checkpoints_kept(smoke, tmp_path):
    """A rerun with a setting changed does not start an unfinished run anew over its checkpoints:
    one line names what differs and the folder that holds them, and nothing on disk changes."""
    exp, _, text = smoke
    out = tmp_path / "results"
    partial = out / "smoke" / ".rope-seed0.partial"
    partial.mkdir(parents=True)
    record = yaml.safe_load((exp / "rope-seed0" / "config.yaml").read_text())
    record["train"]["steps"] = 7
    (partial / "config.yaml").write_text(yaml.safe_dump(record))
    (partial / "checkpoint.pt").write_bytes(b"a checkpoint")
    before = {p: p.read_bytes() for p in partial.iterdir()}
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "rope", "--set", f"out_dir={out}", "--set", f"data.path={text}"
    )
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "rope-seed0 was begun under other settings (train.steps: 7 in its unfinished rope-seed0, 30 here)" in said
    assert f"its checkpoints wait in {partial}" in said and len(res.output.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in partial.iterdir()} == before
    assert sorted(p.name for p in (out / "smoke").iterdir()) == [".rope-seed0.partial"]
    (partial / "checkpoint.pt").unlink()  # no checkpoint, nothing to resume: trained anew
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "rope", "--set", f"out_dir={out}", "--set", f"data.path={text}"
    )
    assert res.exit_code == 0, res.output
    assert (out / "smoke" / "rope-seed0" / "model.pt").is_file() and not partial.exists()


def test_an_experiment_never_mixes_training_settings(smoke, tmp_path):
    """A run trained at another length joins no experiment (it would be averaged as a seed),
    and report refuses a folder assembled from two, naming the setting."""
    exp, _, text = smoke
    out = tmp_path / "results"
    shutil.copytree(exp, out / "smoke")
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--seeds",
        "1",
        "--train-len",
        "48",
        "--lengths",
        "48,64",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
    )
    assert res.exit_code == 2 and "model.train_len: 32 in alibi-seed0, 48 here" in " ".join(res.output.split())
    assert not (out / "smoke" / "alibi-seed1").exists()
    other = tmp_path / "other"
    assert (
        invoke(
            "extrapolate",
            "--config",
            SMOKE,
            "--schemes",
            "alibi",
            "--seeds",
            "1",
            "--set",
            "train.steps=4",
            "--set",
            f"out_dir={other}",
            "--set",
            f"data.path={text}",
        ).exit_code
        == 0
    )
    shutil.copytree(other / "smoke" / "alibi-seed1", out / "smoke" / "alibi-seed1")
    summary = (out / "smoke" / "summary.csv").read_text()
    res = invoke("report", out / "smoke")
    assert res.exit_code == 2 and "train.steps: 30 in alibi-seed0, 4 in alibi-seed1" in " ".join(res.output.split())
    assert (out / "smoke" / "summary.csv").read_text() == summary


def _race(tmp_path, text, steps: int, schemes: str):
    """Process B's plan, made while the experiment folder was still empty."""
    from posbench.config import load_config
    from posbench.experiment.plan import plan_runs
    from posbench.resolve import resolve

    sets = [f"out_dir={tmp_path / 'r'}", f"data.path={text}", f"train.steps={steps}", f"schemes=[{schemes}]"]
    exp = resolve(load_config(SMOKE, sets))
    return exp, plan_runs(exp)


def _run_b(exp, jobs):
    from posbench.experiment.execute import prepare, run_jobs
    from posbench.progress import Reporter

    folder = jobs[0].folder.parent
    run_jobs(exp.cfg, jobs, folder, Reporter(), prepare(exp, jobs, Reporter()))


def test_two_processes_started_at_once_with_other_settings_never_mix_their_runs(tmp_path):
    """Two commands with other settings, started into the same new experiment folder: each
    planned it empty. A run the other has finished since is not reused as if it were this one,
    and none is trained beside a run the other finished or is training now; nothing of the
    second is written, and the first's runs are kept."""
    import pytest

    from posbench.config import dump_yaml
    from posbench.errors import PosbenchError
    from posbench.experiment.records import CONFIG, lock_file, partial_dir
    from posbench.files import exclusive

    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    exp_a, jobs_a = _race(tmp_path, text, 4, "rope")
    reuse, jobs_reuse = _race(tmp_path, text, 5, "rope,alibi")
    beside, jobs_beside = _race(tmp_path, text, 5, "alibi,rope")
    folder = jobs_a[0].folder.parent
    # the first process has begun rope: its record written, its lock held, no checkpoint yet
    with exclusive(lock_file(folder / "rope-seed0")):
        partial_dir(folder / "rope-seed0").mkdir(parents=True)
        (partial_dir(folder / "rope-seed0") / CONFIG).write_text(dump_yaml(jobs_a[0].cfg))
        with pytest.raises(PosbenchError) as e:
            _run_b(beside, jobs_beside)
        assert "holds runs begun under other settings (train.steps: 4 in rope-seed0, 5 here)" in str(e.value)
        assert not (folder / "alibi-seed0").exists() and not partial_dir(folder / "alibi-seed0").exists()
    shutil.rmtree(partial_dir(folder / "rope-seed0"))
    _run_b(exp_a, jobs_a)  # the first process finishes rope at 4 steps
    with pytest.raises(PosbenchError) as e:
        _run_b(reuse, jobs_reuse)  # rope first: reused only if it is this run
    assert "rope-seed0 was trained under a different config (train.steps: 4 in rope-seed0, 5 here)" in str(e.value)
    with pytest.raises(PosbenchError) as e:
        _run_b(beside, jobs_beside)  # alibi first: not trained beside it
    assert "holds runs trained under other settings (train.steps: 4 in rope-seed0, 5 here)" in str(e.value)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["rope-seed0", "runs.txt"]
    assert yaml.safe_load((folder / "rope-seed0" / CONFIG).read_text())["train"]["steps"] == 4
