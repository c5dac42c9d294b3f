"""A run folder's state (done, diverged, running, unfinished) is read once, by
posbench.experiment.records.run_state, and status, report, plan and extend each say it in their words."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from posbench.errors import PosbenchError
from posbench.experiment import records
from posbench.experiment.records import lock_file, partial_dir, run_state
from posbench.files import exclusive

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"


def _run(rdir: Path, *files: str) -> Path:
    rdir.mkdir(parents=True, exist_ok=True)
    for name in files:
        (rdir / name).write_text("{}\n")
    return rdir


@pytest.mark.parametrize(
    "files,partial,state,facts",
    [
        ((), False, "none", dict(trained=False, diverged=False, scored=False, here=False)),
        (("config.yaml", "eval.csv", "model.pt"), False, "done", dict(trained=True, scored=True, here=True)),
        (("model.pt",), False, "done", dict(trained=True, scored=False, here=True)),  # not scored yet
        (("config.yaml", "diverged.json"), False, "diverged", dict(trained=False, diverged=True, here=True)),
        (("diverged.json", "model.pt"), False, "done", dict(trained=True, diverged=False)),  # a later success
        (("config.yaml", "eval.csv"), False, "unfinished", dict(trained=False, scored=True)),  # a reference
        (("eval.csv",), False, "unfinished", dict(scored=False, here=True)),
        ((), True, "unfinished", dict(here=False, partial=True)),  # training began, no one holds it
    ],
)
def test_a_run_folder_is_read_as_one_state(tmp_path, files, partial, state, facts):
    rdir = _run(tmp_path / "alibi-seed0", *files) if files else tmp_path / "alibi-seed0"
    if partial:
        partial_dir(rdir).mkdir()
    run = run_state(rdir)
    assert run.state == state and run.holder is None
    assert {k: getattr(run, k) for k in facts} == facts


def test_a_run_another_process_holds_is_running_until_its_files_say_it_is_finished(tmp_path):
    rdir = tmp_path / "rope-seed1"
    with exclusive(lock_file(rdir)):  # held by this process through another file: as another's
        assert run_state(rdir).state == "running" and run_state(rdir).holder == os.getpid()
        partial_dir(rdir).mkdir()
        assert run_state(rdir).state == "running"
        _run(rdir, "config.yaml", "model.pt")  # trained, now being scored
        assert (run_state(rdir).state, run_state(rdir).holder) == ("done", os.getpid())
        (rdir / "model.pt").unlink()
        _run(rdir, "diverged.json")
        assert run_state(rdir).state == "diverged"
    assert run_state(rdir).holder is None and run_state(rdir).state == "diverged"


def test_a_finished_run_is_classified_without_reading_its_lock(tmp_path, monkeypatch):
    """A look at a lock can turn away a process taking it that instant: planning never looks."""
    from posbench.config import dump_yaml, load_config
    from posbench.experiment.plan import plan_state
    from posbench.resolve import resolve

    def looked(path):
        raise AssertionError(f"read the lock {path}")

    monkeypatch.setattr(records, "lock_holder", looked)
    assert run_state(_run(tmp_path / "a", "model.pt")).state == "done"
    assert run_state(_run(tmp_path / "b", "config.yaml", "diverged.json")).state == "diverged"
    with pytest.raises(AssertionError, match="read the lock"):
        assert run_state(_run(tmp_path / "c", "config.yaml")).state

    exp = resolve(load_config(None, ["schemes=[nope]", f"out_dir={tmp_path}"]))
    rc = exp.cfg.for_run("nope", 0)
    for name, files, want in [("t", ("model.pt",), "done"), ("d", ("diverged.json",), "diverged"), ("r", (), "todo")]:
        rdir = _run(tmp_path / name, *files)
        (rdir / "config.yaml").write_text(dump_yaml(rc))
        assert plan_state(rc, exp.task, rdir) == want
    assert plan_state(rc, exp.task, tmp_path / "absent") == "todo"


@pytest.fixture
def experiment(tmp_path):
    """A reference run with weights (done), one that diverged, one without weights (a committed
    reference's records) and one another process is training (held, in its partial folder)."""
    exp = tmp_path / "exp"
    exp.mkdir()
    shutil.copytree(REFERENCE / "alibi-seed0", exp / "alibi-seed0")
    torch.save({}, exp / "alibi-seed0" / "model.pt")  # whole, as far as status looks
    (exp / "alibi-seed1").mkdir()
    shutil.copy(REFERENCE / "alibi-seed1" / "config.yaml", exp / "alibi-seed1")
    (exp / "alibi-seed1" / "diverged.json").write_text(json.dumps({"status": "diverged", "step": 12}) + "\n")
    shutil.copytree(REFERENCE / "rope-seed0", exp / "rope-seed0")
    partial_dir(exp / "rope-seed1").mkdir()
    shutil.copy(REFERENCE / "rope-seed1" / "config.yaml", partial_dir(exp / "rope-seed1"))
    with exclusive(lock_file(exp / "rope-seed1")):
        yield exp


def test_status_report_and_extend_read_one_experiment_alike(experiment):
    from posbench.experiment.status import run_status
    from posbench.extend.run import parents_in
    from posbench.report import collect

    pid = os.getpid()
    rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(experiment)}
    assert rows == {
        "alibi-seed0": ("done", "trained and evaluated"),
        "alibi-seed1": ("diverged", "at step 12"),
        "rope-seed0": ("records", "evaluated, no model.pt: tabled as is; a rerun trains it"),
        "rope-seed1": ("running", f"training, no checkpoint yet (pid {pid})"),
    }
    got = collect(experiment)
    assert [r.folder.name for r in got.runs] == ["alibi-seed0", "rope-seed0"]  # the records are what it tables
    assert got.diverged == {"alibi-seed1": "alibi seed 1 at step 12"} and got.running == ["rope-seed1"]
    with pytest.raises(PosbenchError, match="rope-seed0: an unfinished run \\(no model.pt\\)"):
        parents_in(experiment)
    shutil.rmtree(experiment / "rope-seed0")
    with pytest.raises(PosbenchError, match="rope-seed1: an unfinished run; finish"):
        parents_in(experiment)  # its partial folder, held
    shutil.rmtree(partial_dir(experiment / "rope-seed1"))
    assert parents_in(experiment) == [experiment / "alibi-seed0"]  # the diverged run is left out


def test_status_calls_a_run_with_its_weights_or_scores_cut_short_damaged_not_done(experiment):
    """A model.pt or eval.csv cut short (a copy stopped halfway) is what report and evaluate
    refuse: status says so, as report would, instead of "done"."""
    from posbench.experiment.status import run_status

    scores = experiment / "alibi-seed0" / "eval.csv"
    kept = scores.read_bytes()
    scores.write_bytes(kept[:150])
    rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(experiment)}
    assert rows["alibi-seed0"] == ("damaged", f"{scores}: malformed evaluation rows; delete it and run evaluate again")
    scores.write_bytes(kept)
    weights = experiment / "alibi-seed0" / "model.pt"
    kept_weights = weights.read_bytes()
    kept_positions = (experiment / "alibi-seed0" / "positions.csv.gz").read_bytes()
    weights.write_bytes(kept_weights[:-30])
    rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(experiment)}
    assert rows["alibi-seed0"] == ("damaged", "model.pt is damaged: delete it to train the run again")
    weights.write_bytes(kept_weights)
    positions = experiment / "alibi-seed0" / "positions.csv.gz"  # the report's positions plot reads it
    positions.write_bytes(kept_positions[:100])
    rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(experiment)}
    said = f"{positions}: malformed loss-per-position rows; delete it and run evaluate again"
    assert rows["alibi-seed0"] == ("damaged", said)
    from conftest import invoke

    assert said in " ".join(invoke("report", experiment).output.split())  # what report refuses it with
    positions.write_bytes(kept_positions)
    assert {r["run"]: r["state"] for r in run_status(experiment)}["alibi-seed0"] == "done"


def test_status_of_a_partial_run_whose_config_cannot_be_read_still_says_its_step(experiment, monkeypatch):
    """One damaged run never stops the listing: a partial run whose config.yaml is empty says the
    step it is at, of a total it cannot read, from its training log or its checkpoint."""
    from posbench.experiment import status

    held = partial_dir(experiment / "rope-seed1")
    (held / "config.yaml").write_text("")
    (held / "train_log.jsonl").write_text(json.dumps({"step": 1233, "loss": 2.0}) + "\n")
    row = {r["run"]: r for r in status.run_status(experiment)}["rope-seed1"]
    assert (row["state"], row["scheme"]) == ("running", "?") and "training, at step 1,234 of ?" in row["detail"]
    os.remove(held / "train_log.jsonl")
    monkeypatch.setattr(status, "checkpoint_step", lambda folder: 1200)
    row = {r["run"]: r for r in status.run_status(experiment)}["rope-seed1"]
    assert "training, at step 1,200 of ?" in row["detail"]


def test_extend_names_a_diverged_run_given_to_it(experiment):
    from posbench.extend.run import parents_in

    with pytest.raises(PosbenchError) as e:
        parents_in(experiment / "alibi-seed1")
    assert str(e.value) == f"{experiment / 'alibi-seed1'}: a run that diverged at step 12; it has no model.pt to extend"
    assert parents_in(experiment / "alibi-seed0") == [experiment / "alibi-seed0"]


def test_plan_skips_a_run_another_process_holds(experiment):
    from posbench.experiment.plan import Job, plan_note

    job = Job(None, None, None, experiment / "rope-seed1", "todo")
    assert plan_note(job) == f"skip: another process (pid {os.getpid()}) holds it"
    assert plan_note(Job(None, None, None, experiment / "alibi-seed1", "diverged")) == "skip: diverged at step 12"


def test_a_diverged_run_is_diverged_to_status_and_report_whoever_holds_it(experiment):
    """Its files are final: a process that takes its lock (to find it diverged) does not make it running."""
    from posbench.experiment.status import run_status
    from posbench.report import collect

    with exclusive(lock_file(experiment / "alibi-seed1")):
        rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(experiment)}
        assert rows["alibi-seed1"] == ("diverged", "at step 12")
        assert collect(experiment).diverged == {"alibi-seed1": "alibi seed 1 at step 12"}


def test_status_names_what_it_cannot_read_and_a_folder_that_is_no_experiment(tmp_path):
    """A finished run whose config.yaml is damaged, and a partial one whose checkpoints are
    both damaged, each say so (a rerun cannot resume either); a run folder or an empty folder
    given to status is one line, not an empty table."""
    from conftest import invoke

    from posbench.experiment.status import run_status

    exp = tmp_path / "exp"
    shutil.copytree(REFERENCE / "alibi-seed0", exp / "alibi-seed0")
    torch.save({}, exp / "alibi-seed0" / "model.pt")  # whole, as far as status looks
    (exp / "alibi-seed0" / "config.yaml").write_text("model: {n_layer: 2\n")
    partial = partial_dir(exp / "rope-seed0")
    partial.mkdir()
    shutil.copy(REFERENCE / "rope-seed0" / "config.yaml", partial)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (partial / name).write_bytes(b"not a checkpoint")
    rows = {r["run"]: (r["state"], r["detail"]) for r in run_status(exp)}
    assert rows["alibi-seed0"][0] == "damaged" and "config.yaml: malformed YAML" in rows["alibi-seed0"][1]
    assert rows["rope-seed0"] == ("partial", f"no readable checkpoint: delete {partial} to train it anew")
    for folder, message in (
        (exp / "alibi-seed0", f"a run folder; status reads its experiment folder, {exp}"),
        (tmp_path / "empty", "holds no runs, finished, partial or planned"),
    ):
        folder.mkdir(exist_ok=True)
        res = invoke("status", folder)
        assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
        assert len(res.output.strip().splitlines()) == 1


def test_runs_are_planned_seed_by_seed_so_a_study_stopped_early_compares_whole_seeds(tmp_path):
    """Every scheme at seed 0, then every scheme at seed 1: a study killed by a time limit after
    its first few runs holds a full comparison at the seeds it finished, not every seed of a few
    schemes. A sweep's points plan their runs the same way."""
    from conftest import SMOKE

    from posbench.config import load_config, load_sweep
    from posbench.experiment.plan import plan_runs, plan_sweep
    from posbench.resolve import resolve, resolve_sweep

    sets = [f"out_dir={tmp_path}", "schemes=[nope, alibi, rope]", "seeds=[0, 1]"]
    jobs = plan_runs(resolve(load_config(SMOKE, sets)))
    order = [(j.cfg.schemes[0], j.cfg.seeds[0]) for j in jobs]
    assert order == [("nope", 0), ("alibi", 0), ("rope", 0), ("nope", 1), ("alibi", 1), ("rope", 1)]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(Path(SMOKE).read_text() + "\nsweep:\n  model.n_layer: [1, 2]\n")
    _, jobs = plan_sweep(resolve_sweep(load_sweep(sweep, sets), sweep))
    per_point = [(j.cfg.model.n_layer, j.cfg.schemes[0], j.cfg.seeds[0]) for j in jobs]
    assert per_point[:6] == [(1, s, n) for n in (0, 1) for s in ("nope", "alibi", "rope")]
