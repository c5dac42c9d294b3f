"""Runs that survive: exact resume after a kill, no orphaned workers, one trainer per run."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, SMOKE, invoke

from posbench.experiment.records import planned


def _text(tmp: Path) -> Path:
    text = tmp / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    return text


def _args(out: Path, text: Path, *more) -> list[str]:
    """configs/smoke.yaml, one run, long enough to be killed in the middle."""
    return [
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.threads=1",
        *more,
    ]


def _cli(*args) -> subprocess.Popen:
    """The worktree's posbench in a process of its own, as a user starts it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "posbench.cli", *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(check, timeout: float = 120, what: str = "") -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def kill_after_two_checkpoints(args, partial: Path) -> None:
    """Start posbench with `args`, and SIGKILL it once `partial` holds two checkpoints."""
    proc = _cli(*args)
    try:
        _wait_for(lambda: (partial / "checkpoint.prev.pt").is_file(), what="two checkpoints")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()


def _weights(run: Path) -> dict:
    return torch.load(run / "model.pt", weights_only=True)["model"]


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_kill_9_then_rerun_resumes_to_the_weights_of_an_unbroken_run(tmp_path):
    """A real process killed with SIGKILL after a checkpoint: the same command (here, in this
    process) resumes from it, and the weights and evaluation rows are bit-identical to a run
    never interrupted."""
    text = _text(tmp_path)
    more = ("--set", "train.steps=400", "--set", "train.checkpoint_every=25")
    killed = tmp_path / "killed"
    partial = killed / "smoke" / ".alibi-seed0.partial"
    kill_after_two_checkpoints(_args(killed, text, *more), partial)
    assert not (killed / "smoke" / "alibi-seed0").exists(), "it finished before it was killed"
    res = invoke(*_args(killed, text, *more))
    assert res.exit_code == 0, res.output
    assert "alibi seed 0: resuming from its checkpoint at step" in " ".join(res.output.split())
    res = invoke(*_args(tmp_path / "whole", text, *more))
    assert res.exit_code == 0, res.output
    run, whole = killed / "smoke" / "alibi-seed0", tmp_path / "whole" / "smoke" / "alibi-seed0"
    assert _same_weights(run, whole)
    assert (run / "eval.csv").read_text() == (whole / "eval.csv").read_text()
    steps = [line.split(",")[0] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert steps == [line.split(",")[0] for line in (whole / "train_log.jsonl").read_text().splitlines()]
    assert not partial.exists() and not list(run.glob("checkpoint*"))


def _interrupt_at(monkeypatch, at: int) -> None:
    """Ctrl-C as the progress bar passes step `at`, as a user at the keyboard would. A shell
    starts its background jobs with Ctrl-C ignored (`make test &`), where it would never arrive:
    the keyboard's default is set back first."""
    from posbench.cli import BarReporter

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    step = BarReporter.step

    def press(self, label, n, loss):
        step(self, label, n, loss)
        if n == at:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(BarReporter, "step", press)


def test_ctrl_c_saves_a_checkpoint_and_a_damaged_one_falls_back_to_the_previous(tmp_path, monkeypatch):
    """Ctrl-C stops at the end of a step with a checkpoint and says how to resume. A truncated
    checkpoint is named in one line and the one before it used: the weights still match an
    unbroken run. With no good checkpoint left it is an error, and nothing is retrained over."""
    text = _text(tmp_path)
    more = ("--set", "train.steps=60", "--set", "train.checkpoint_every=10", "--set", "train.log_every=1")
    args = _args(tmp_path / "r", text, *more)
    partial = tmp_path / "r" / "smoke" / ".alibi-seed0.partial"
    with monkeypatch.context() as m:
        _interrupt_at(m, 25)
        res = invoke(*args)
    assert res.exit_code == 130 and "rerun the same command to resume" in res.output
    assert torch.load(partial / "checkpoint.pt", weights_only=True)["step"] == 25
    assert torch.load(partial / "checkpoint.prev.pt", weights_only=True)["step"] == 20
    data = (partial / "checkpoint.pt").read_bytes()
    (partial / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "checkpoint.pt: corrupt or truncated checkpoint" in said and "resuming from the previous one" in said
    assert "resuming from its checkpoint at step 20 of 60" in said
    assert invoke(*_args(tmp_path / "whole", text, *more)).exit_code == 0
    assert _same_weights(tmp_path / "r" / "smoke" / "alibi-seed0", tmp_path / "whole" / "smoke" / "alibi-seed0")

    args = _args(tmp_path / "again", text, *more)
    partial = tmp_path / "again" / "smoke" / ".alibi-seed0.partial"
    with monkeypatch.context() as m:
        _interrupt_at(m, 25)
        assert invoke(*args).exit_code == 130
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (partial / name).write_bytes(b"not a checkpoint")
    res = invoke(*args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "no good checkpoint is left; delete" in " ".join(res.output.split())
    assert (partial / "checkpoint.pt").read_bytes() == b"not a checkpoint"  # kept for the user to decide
    assert "no good checkpoint is left" in (partial / "failed.txt").read_text()  # what status shows


def _children(pid: int) -> list[int]:
    from conftest import processes

    return [p for p, (ppid, _) in processes().items() if ppid == pid]


def _alive(pids: list[int]) -> list[int]:
    from conftest import processes

    now = processes()
    return [p for p in pids if p in now and now[p][1] != "Z"]  # a zombie is dead, unreaped


def test_no_worker_outlives_a_parent_killed_with_sigkill(tmp_path):
    """extrapolate with two workers, its parent killed with kill -9: within a few seconds no
    process it started is left."""
    text = _text(tmp_path)
    out = tmp_path / "r"
    proc = _cli(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "nope,alibi",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.steps=100000",
        "--set",
        "train.workers=2",
        "--set",
        "train.checkpoint_every=0",
    )
    workers = []
    try:
        logs = lambda: [p for p in (out / "smoke").glob(".*.partial/train_log.jsonl") if p.stat().st_size]  # noqa: E731
        _wait_for(lambda: len(logs()) == 2, what="two workers training")
        workers = _children(proc.pid)
        assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 5
        while _alive(workers) and time.time() < deadline:
            time.sleep(0.1)
        assert _alive(workers) == [], f"left running {time.time() - deadline + 5:.1f} s after the parent died"
    finally:
        proc.kill()
        for pid in _alive(workers):  # a failed check must not leave them running
            os.kill(pid, signal.SIGKILL)


def test_two_processes_on_one_experiment_never_train_a_run_twice(tmp_path):
    """A second real process started while the first trains, on the same config and folder:
    each run is trained by exactly one of them, the second says in one line which run it left
    to the first, and every run ends whole."""
    text = _text(tmp_path)
    args = [
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "nope,alibi,rope,t5",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.steps=400",
        "--set",
        "train.threads=1",
    ]
    first = _cli(*args)
    log = tmp_path / "smoke" / ".nope-seed0.partial" / "train_log.jsonl"
    _wait_for(lambda: log.is_file() and log.stat().st_size, what="the first process training")
    second = _cli(*args)
    outs = [p.communicate(timeout=300)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    for scheme in ("nope", "alibi", "rope", "t5"):
        assert sum(f"{scheme} seed 0" in o for o in outs) == 1, (scheme, outs)  # its progress bar: trained there
        run = tmp_path / "smoke" / f"{scheme}-seed0"
        assert (run / "model.pt").is_file() and (run / "eval.csv").is_file()
    said = " ".join(outs[1].split())
    assert f"another posbench process (pid {first.pid}) is running it; skipped here" in said
    assert "Traceback" not in " ".join(outs) and "error" not in " ".join(outs)
    assert not list((tmp_path / "smoke").glob(".*.partial"))


SWEEP = """
name: grid
out_dir: {out}
data: {{path: {text}}}
model: {{n_layer: 1, n_head: 2, d_model: 32, train_len: 16}}
train: {{steps: 20, batch_size: 8, warmup_steps: 5, log_every: 5, grad_clip: {clip}, threads: 1}}
eval: {{lengths: [32, 48], tokens: 2048}}
sweep:
  schemes: [alibi]
  seeds: {seeds}
  {key}: {values}
"""


def _sweep(tmp: Path, seeds="[0]", key="model.train_len", values="[16, 24]", clip=1.0) -> Path:
    path = tmp / "sweep.yaml"
    path.write_text(SWEEP.format(out=tmp / "r", text=_text(tmp), seeds=seeds, key=key, values=values, clip=clip))
    return path


def test_a_sweep_trains_its_grid_once_and_a_new_seed_alone(tmp_path):
    """The grid's runs go to one experiment, a readable name and a config hash each, with a
    table per grid point; a rerun trains nothing; a new seed trains only its own runs."""
    import pandas as pd

    config = _sweep(tmp_path)
    res = invoke("sweep", config)
    assert res.exit_code == 0, res.output
    exp = tmp_path / "r" / "grid"
    runs = sorted(p.name for p in exp.iterdir() if p.is_dir())
    assert [r[: -len("-12345678")] for r in runs] == ["alibi-seed0-train_len16", "alibi-seed0-train_len24"]
    summary = pd.read_csv(exp / "summary.csv")
    assert sorted(set(zip(summary["point"], summary["train_len"]))) == [
        ("model.train_len=16", 16),
        ("model.train_len=24", 24),
    ]
    md = (exp / "summary.md").read_text()
    assert "## model.train_len=16; nonoverlapping" in md and "## model.train_len=24; nonoverlapping" in md
    assert "trained at 16, 24" in md

    logs = {run: (exp / run / "eval_log.jsonl").read_text() for run in runs}
    res = invoke("sweep", config)
    assert res.exit_code == 0 and res.output.count("already trained, reusing its checkpoint") == 2
    assert "alibi seed 0" not in res.output  # no progress bar: nothing trained
    assert logs == {run: (exp / run / "eval_log.jsonl").read_text() for run in runs}  # and nothing scored

    config = _sweep(tmp_path, seeds="[0, 1]")
    res = invoke("sweep", config, "--dry-run")
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and said.count("skip: trained") == 2 and said.count("│ train │") == 2
    res = invoke("sweep", config)
    assert res.exit_code == 0 and res.output.count("already trained") == 2 and "alibi seed 1" in res.output
    assert len([p for p in exp.iterdir() if p.is_dir()]) == 4
    # sweep.yaml is the grid asked last; the first one, whose runs are still here, is kept beside it
    assert (exp / "sweep.yaml").read_text() == config.read_text() and "seeds: [0, 1]" in config.read_text()
    assert "seeds: [0]\n" in (exp / "sweep.1.yaml").read_text() and not (exp / "sweep.2.yaml").exists()
    assert invoke("sweep", config).exit_code == 0 and not (exp / "sweep.2.yaml").exists()  # the same grid
    # a grid that never trained a run (a sweep stopped before its first) is replaced, not kept
    stray = tmp_path / "r" / "stray"
    stray.mkdir()
    (stray / "sweep.yaml").write_text("sweep: {seeds: [[5]]}\n")
    from posbench.experiment.execute import keep_earlier_grid

    keep_earlier_grid(stray, config.read_text())
    assert sorted(p.name for p in stray.iterdir()) == ["sweep.yaml"]


def test_a_sweep_into_an_experiment_that_is_not_a_sweep_is_refused(tmp_path):
    """extrapolate's runs differ only in scheme and seed; a sweep may not make their folder a
    sweep's (the other way round is refused as well): one line, nothing written."""
    exp = tmp_path / "r" / "grid"
    (exp / "alibi-seed0").mkdir(parents=True)
    res = invoke("sweep", _sweep(tmp_path))
    said = f"{exp} holds an experiment that is not a sweep (alibi-seed0, no sweep.yaml)"
    assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    assert sorted(p.name for p in exp.iterdir()) == ["alibi-seed0"]


def test_a_run_an_earlier_sweep_named_by_other_keys_is_reused_not_trained_again(tmp_path):
    """A run's folder names the keys its sweep listed; another sweep into the same experiment
    that lists others (grad_clip, not train_len) but resolves to the same run finds it by its
    hash: nothing trains twice, and the report holds one run, not two of one (scheme, seed)."""
    assert invoke("sweep", _sweep(tmp_path, values="[16]")).exit_code == 0
    exp = tmp_path / "r" / "grid"
    (first,) = [p.name for p in exp.iterdir() if p.is_dir()]
    assert first.startswith("alibi-seed0-train_len16-")
    res = invoke("sweep", _sweep(tmp_path, key="train.grad_clip", values="[1.0]"))
    assert res.exit_code == 0 and "already trained, reusing its checkpoint" in res.output, res.output
    assert [p.name for p in exp.iterdir() if p.is_dir()] == [first]
    assert invoke("report", exp).exit_code == 0

    from posbench.config import load_sweep
    from posbench.experiment.plan import _named_before, run_digest
    from posbench.tasks import task_for

    (_, cfg), *_ = load_sweep(tmp_path / "sweep.yaml")
    rc = cfg.for_run("alibi", 0)
    digest = run_digest(rc, task_for(rc))
    assert first.endswith(digest) and _named_before(exp, rc, digest) == exp / first
    (exp / first).rename(exp / f".{first}.partial")  # still training under the first sweep: resumed there
    assert _named_before(exp, rc, digest) == exp / first
    assert _named_before(exp, cfg.for_run("alibi", 1), digest) is None  # another seed's run is not it


def test_a_reused_run_keeps_the_record_of_how_it_was_trained(tmp_path):
    """A rerun that reuses a finished run scores it under the eval settings asked now and
    records those, but keeps the training side of its config.yaml as it was trained: a rerun
    from another folder or with more workers does not make a record claim them."""
    config = _sweep(tmp_path, values="[16]")
    assert invoke("sweep", config).exit_code == 0
    (run,) = [p for p in (tmp_path / "r" / "grid").iterdir() if p.is_dir()]
    before = yaml.safe_load((run / "config.yaml").read_text())
    assert before["train"]["workers"] is None and before["eval"]["lengths"] == [16, 32, 48]

    res = invoke("sweep", config, "--set", "train.workers=2", "--set", "eval.lengths=[32, 64]")
    assert res.exit_code == 0 and "already trained, reusing its checkpoint" in res.output, res.output
    after = yaml.safe_load((run / "config.yaml").read_text())
    assert after["eval"]["lengths"] == [16, 32, 64] and after["train"] == before["train"]
    assert {k: v for k, v in after.items() if k != "eval"} == {k: v for k, v in before.items() if k != "eval"}
    assert {int(r["length"]) for r in csv.DictReader((run / "eval.csv").open())} >= {32, 48, 64}


@pytest.mark.parametrize(
    "key, values, message",
    [
        ("model.n_head", "[2, 3]", "sweep.model.n_head=3: model.d_model=32 is not divisible by model.n_head=3"),
        (
            "model.n_layers",
            "[1]",
            "sweep.model.n_layers=1: model.n_layers: unknown key (did you mean 'model.n_layer'?)",
        ),
        ("schemes", "[alibi, nosuch]", "sweep.schemes='nosuch'"),
        ("model.train_len", "[]", "sweep.model.train_len: expected a non-empty list"),
        (
            "eval.lengths",
            "[[32], [48]]",
            "eval.lengths=[32] and schemes=alibi, seeds=0, eval.lengths=[48] train the same run",
        ),
        ("train.threads", "[1, 2]", "train.threads=1 and schemes=alibi, seeds=0, train.threads=2 train the same run"),
        pytest.param(
            "train.lr",
            str(list(range(1, 10002))),
            "makes 10,001 points (1 x 1 x 10001 over schemes, seeds, train.lr); one sweep takes at most 10,000",
            id="too-many-points",
        ),
    ],
)
def test_a_bad_value_anywhere_in_the_grid_is_one_line_and_nothing_runs(tmp_path, key, values, message):
    config = _sweep(tmp_path)
    config.write_text(
        config.read_text().replace("  schemes: [alibi]\n", "") + f"  {key}: {values}\n"
        if key == "schemes"
        else config.read_text().replace("model.train_len: [16, 24]", f"{key}: {values}")
    )
    res = invoke("sweep", config)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) <= 2
    assert not (tmp_path / "r").exists()


def test_a_point_that_fails_only_at_resolution_is_named_by_its_settings(tmp_path):
    """train_len 40 builds on its own but is longer than the eval lengths (32, 48) beside it:
    the line names the grid point, and nothing runs."""
    config = _sweep(tmp_path, values="[16, 40]")
    res = invoke("sweep", config, "--dry-run")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    said = " ".join(res.output.split())
    assert f"{config}: sweep point schemes='alibi', seeds=0, model.train_len=40: eval.lengths [32] are shorter" in said
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, swept", [("seeds=[7]", "seeds"), ("model={n_layer: 2}", "model.train_len")])
def test_a_set_of_a_swept_key_is_one_line_and_nothing_runs(tmp_path, override, swept):
    config = _sweep(tmp_path, seeds="[0, 1]")
    res = invoke("sweep", config, "--set", override)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"--set {override}: {swept} is swept" in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("swept", ["eval.stride", "eval.perplexity.stride"])
@pytest.mark.parametrize("override", ["eval.stride=4", "eval.perplexity.stride=4"])
def test_a_set_of_a_swept_measure_key_is_refused_however_either_is_spelled(tmp_path, swept, override):
    res = invoke("sweep", _sweep(tmp_path, key=swept, values="[4, 8]"), "--set", override)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"--set {override}: eval.perplexity.stride is swept" in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override", ["train.tracker=mlflow", "train={tracker: mlflow}"])
def test_tracker_and_a_set_of_train_tracker_are_one_line_and_nothing_runs(tmp_path, override):
    res = invoke("sweep", _sweep(tmp_path), "--tracker", "tensorboard", "--set", override)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    said = " ".join(res.output.split())
    assert f"--tracker tensorboard and --set {override} both set train.tracker; give one" in said
    assert not (tmp_path / "r").exists()
    res = invoke("sweep", _sweep(tmp_path), "--tracker", "tensorboard", "--set", "train.steps=5", "--dry-run")
    assert res.exit_code == 0, res.output  # another train.* key is no clash


def test_tracker_on_a_sweep_of_train_tracker_is_one_line_and_nothing_runs(tmp_path):
    config = _sweep(tmp_path, key="train.tracker", values="[tensorboard, mlflow]")
    res = invoke("sweep", config, "--tracker", "tensorboard")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--tracker tensorboard: train.tracker is swept" in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


def test_a_diverged_point_is_recorded_the_grid_goes_on_and_status_shows_every_state(tmp_path, monkeypatch):
    from posbench.experiment.records import lock_file
    from posbench.experiment.status import run_status
    from posbench.files import exclusive

    config = _sweep(tmp_path, key="train.lr", values="[0.003, 1000000000.0]", clip=0)
    res = invoke("sweep", config)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "diverged at step" in said and "the other runs go on" in said
    assert "diverged, so not in the table: alibi seed 0 at step" in said
    exp = tmp_path / "r" / "grid"
    assert "diverged, so not in the tables: alibi seed 0 at step" in (exp / "summary.md").read_text()

    rows = run_status(exp)
    assert sorted(r["state"] for r in rows) == ["diverged", "done"]
    assert [r["detail"] for r in rows if r["state"] == "diverged"][0].startswith("at step ")

    # a partial run (stopped by Ctrl-C at step 10), a failed one, and one another process holds
    exp = tmp_path / "r" / "st"
    more = (
        "--set",
        "train.steps=40",
        "--set",
        "train.checkpoint_every=5",
        "--set",
        "train.log_every=1",
        "--set",
        f"out_dir={tmp_path / 'r'}",
        "--set",
        "name=st",
        "--set",
        f"data.path={tmp_path / 'tiny.txt'}",
    )
    with monkeypatch.context() as m:
        _interrupt_at(m, 10)
        assert invoke("extrapolate", "--config", SMOKE, "--schemes", "nope", *more).exit_code == 130
        assert invoke("extrapolate", "--config", SMOKE, "--schemes", "t5", *more).exit_code == 130
    (exp / ".t5-seed0.partial" / "failed.txt").write_text("out of memory\n")
    with exclusive(lock_file(exp / "rope-seed0")):
        (exp / ".rope-seed0.partial").mkdir()
        (exp / ".rope-seed0.partial" / "config.yaml").write_text(
            (exp / ".nope-seed0.partial" / "config.yaml").read_text()
        )
        rows = {r["run"]: r for r in run_status(exp)}
        res = invoke("status", exp)
    assert res.exit_code == 0 and "partial" in res.output and "running" in res.output, res.output
    assert (rows["nope-seed0"]["state"], rows["nope-seed0"]["detail"]) == (
        "partial",
        "at step 10 of 40; rerun to resume",
    )
    assert (rows["t5-seed0"]["state"], rows["t5-seed0"]["detail"]) == ("failed", "out of memory (at step 10 of 40)")
    assert rows["rope-seed0"]["state"] == "running"
    assert rows["rope-seed0"]["detail"] == f"training, no checkpoint yet (pid {os.getpid()})"
    # a run in training is at the step its log last reached, not at its last checkpoint's
    partial = exp / ".nope-seed0.partial"
    with exclusive(lock_file(exp / "nope-seed0")):
        with open(partial / "train_log.jsonl", "a") as log:
            log.write('{"step": 13, "loss": 2.0, "lr": 0.001, "seconds": 1.0, "attention": "native"}\n')
        detail = {r["run"]: r for r in run_status(exp)}["nope-seed0"]["detail"]
    assert detail == f"training, at step 14 of 40 (pid {os.getpid()})"


def test_a_sweep_on_a_local_ray_instance_gives_the_records_a_local_sweep_gives(tmp_path, monkeypatch):
    """Each run a Ray task on a local instance (2 CPUs): the driver writes the run folders from
    what the tasks return, and they hold the weights and rows a local sweep makes."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # Ray's workers import this checkout's posbench
    config = _sweep(tmp_path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    try:
        res = invoke(
            "sweep", config, "--executor", "ray", "--storage", tmp_path / "store", "--set", "train.threads=1",
            "--tracker", "tensorboard",
        )  # fmt: skip
    finally:
        ray.shutdown()
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert said.count("sent to the cluster (1 CPU, 0 GPU)") == 2 and said.count(": trained on ") == 2
    assert "(1 of 2): sent" in said and "(2 of 2): sent" in said
    assert "; 1 of 2 back" in said and "; 2 of 2 back" in said
    assert invoke("sweep", config, "--set", "train.threads=1", "--set", f"out_dir={tmp_path / 'here'}").exit_code == 0
    runs = sorted(p.parent.name for p in (tmp_path / "r" / "grid").glob("*/config.yaml"))
    assert runs == sorted(p.parent.name for p in (tmp_path / "here" / "grid").glob("*/config.yaml")) and len(runs) == 2
    for run in runs:
        there, here = tmp_path / "r" / "grid" / run, tmp_path / "here" / "grid" / run
        assert _same_weights(there, here)
        assert (there / "eval.csv").read_text() == (here / "eval.csv").read_text()
    assert (tmp_path / "r" / "grid" / "summary.md").is_file()
    assert sorted(planned(tmp_path / "r" / "grid")) == runs  # so status names a run not back yet
    # the driver sent each run to the tracker, from the records it wrote; no task did
    sent = {p.name for p in (tmp_path / "r" / "grid" / "tensorboard").iterdir()}
    assert sent == {*runs, "grid"}, sent
    assert not list((tmp_path / "store").rglob("events.out.tfevents*"))


def test_without_ray_the_ray_executor_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    res = invoke("sweep", _sweep(tmp_path), "--executor", "ray")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--executor ray needs Ray, an optional extra: pip install -e '.[ray]'" in " ".join(res.output.split())


@pytest.mark.parametrize(
    "address,message",
    [
        ("127.0.0.1:1", "--address 127.0.0.1:1: no Ray head answers there"),
        ("ray://127.0.0.1:1", "--address ray://127.0.0.1:1: no Ray head answers there"),
        ("nowhere", "--address nowhere: expected auto, HOST:PORT or ray://HOST:PORT"),
    ],
)
def test_a_ray_address_that_does_not_answer_is_one_line_and_writes_nothing(tmp_path, address, message):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    res = invoke("sweep", _sweep(tmp_path), "--executor", "ray", "--address", address)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()


def test_a_ray_cluster_that_refuses_the_driver_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """A head that answers but will not take this driver (another Ray version, say) fails at
    ray.init: one line, and no experiment folder is left behind holding only a grid."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

    def refuse(*args, **kwargs):
        raise RuntimeError("Version mismatch: the cluster runs Ray 2.0.0\nmore detail")

    monkeypatch.setattr(ray, "init", refuse)
    res = invoke("sweep", _sweep(tmp_path), "--executor", "ray", "--address", "auto")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    said = " ".join(res.output.split())
    assert "--address auto: cannot join a Ray cluster (Version mismatch: the cluster runs Ray 2.0.0)" in said
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("scheme, rate", [("alibi", []), ("t5", ["--set", "train.scheme_lr_mult=10"])])
def test_a_task_run_interrupted_resumes_to_the_weights_of_an_unbroken_run(tmp_path, monkeypatch, scheme, rate):
    """A task's instance stream is part of the checkpoint: a copy run stopped by Ctrl-C and rerun
    ends bit-identical to one never stopped (drawing fresh instances after the resume would not).
    So do the optimiser's groups: T5's table resumes at its own multiple of the rate."""
    args = lambda out: [
        "extrapolate",
        "--task",
        "copy",
        "--schemes",
        scheme,
        *rate,
        "--set",
        f"out_dir={out}",  # noqa: E731
        "--set",
        "task_options.train_max=5",
        "--set",
        "task_options.test_count=4",
        "--set",
        "model.n_layer=1",
        "--set",
        "model.d_model=32",
        "--set",
        "model.n_head=2",
        "--set",
        "train.steps=40",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.warmup_steps=5",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "train.log_every=1",
    ]
    with monkeypatch.context() as m:
        _interrupt_at(m, 15)
        assert invoke(*args(tmp_path / "r")).exit_code == 130
    res = invoke(*args(tmp_path / "r"))
    assert res.exit_code == 0 and "resuming from its checkpoint at step 15 of 40" in " ".join(res.output.split())
    assert invoke(*args(tmp_path / "whole")).exit_code == 0
    assert _same_weights(tmp_path / "r" / "copy" / f"{scheme}-seed0", tmp_path / "whole" / "copy" / f"{scheme}-seed0")


def test_a_sweep_over_tasks_reports_each_task_as_its_own_grid_point(tmp_path):
    """task is a sweep key like any other: each task trains at its own derived train_len, and
    the report has a table per task, with summary.csv naming each row's task and point."""
    path = tmp_path / "tasks.yaml"
    path.write_text(f"""
name: tgrid
out_dir: {tmp_path / "r"}
model: {{n_layer: 1, n_head: 2, d_model: 32}}
train: {{steps: 10, batch_size: 8, warmup_steps: 2, threads: 1}}
task_options: {{train_max: 3, test_count: 2}}
sweep: {{schemes: [alibi], task: [copy, reverse]}}
""")
    res = invoke("sweep", str(path))
    assert res.exit_code == 0, res.output
    exp = tmp_path / "r" / "tgrid"
    text = (exp / "summary.md").read_text()
    assert text.startswith("# copy, reverse: exact-match accuracy by length\n")
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == [
        "## copy",
        "## reverse",
        "## mean reciprocal rank past N over 2 (grid point, seed) pairs",
    ]
    with open(exp / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["task"], r["point"].split("task=")[1]) for r in rows} == {("copy", "copy"), ("reverse", "reverse")}
    from posbench.tasks import build_task

    trained = {}
    for d in exp.iterdir():
        if (d / "config.yaml").is_file():
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            trained[cfg["task"]] = cfg["model"]["train_len"]
    assert trained == {t: build_task(t, {"train_max": 3}).train_len for t in ("copy", "reverse")}


@pytest.mark.parametrize(
    "name, tasks, message",
    [
        ("name: mixed\n", "[lm, copy]", "sweep: task mixes lm with the tasks"),
        ("", "[copy, reverse]", "cannot be swept; each task names its own folder unless the config sets name"),
    ],
)
def test_a_task_sweep_that_cannot_make_one_report_is_one_line_before_anything_trains(tmp_path, name, tasks, message):
    path = tmp_path / "tasks.yaml"
    path.write_text(f"{name}out_dir: {tmp_path / 'r'}\nsweep: {{schemes: [alibi], task: {tasks}}}\n")
    for args in ([], ["--dry-run"]):
        res = invoke("sweep", path, *args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) <= 2
    assert not (tmp_path / "r").exists()


def test_status_reads_a_failed_txt_that_is_not_text(tmp_path):
    from posbench.experiment.status import run_status

    partial = tmp_path / ".alibi-seed0.partial"
    partial.mkdir()
    (partial / "failed.txt").write_bytes(b"\xff\xfe out of memory\n")
    res = invoke("status", tmp_path)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    rows = run_status(tmp_path)
    assert [(r["state"], r["detail"]) for r in rows] == [("failed", "\ufffd\ufffd out of memory (no checkpoint yet)")]


def test_a_grid_point_over_tasks_is_named_by_what_was_chosen_not_what_each_task_derives():
    """copy and sort derive other train_lens and alphabets; a point names the task alone, and an
    option set away from its task's default besides."""
    from posbench.tables import point_labels
    from posbench.tasks import build_task

    def run(task, **options):
        made = build_task(task, options)
        resolved = {**type(made).options, **options, "test_max": made.test_max}
        return {"task": task, "model": {"scheme": "nope", "train_len": made.train_len}, "task_options": resolved}

    labels = point_labels({"a": run("copy"), "b": run("sort")})
    assert labels == {"a": "task=copy", "b": "task=sort"}
    labels = point_labels({"a": run("copy"), "b": run("sort"), "c": run("copy", train_max=10)})
    assert labels["c"] == "task=copy, task_options.train_max=10"  # test_max follows it: 2 train_max
    assert labels["b"] == "task=sort, task_options.train_max=20"


def test_a_sweep_of_thousands_of_runs_says_so_before_the_first_starts(tmp_path, monkeypatch):
    """A sweep of thousands of runs never starts without a word: past LARGE_SWEEP (1,000) runs to
    train, one line says how many, the work in all, and how to stop and resume; not at or below."""
    from posbench.experiment import execute

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C before the first run trains

    monkeypatch.setattr(execute, "run_jobs", stopped)
    said = {}
    for points in (250, 251):  # 1 scheme x 4 seeds x points: 1,000 and 1,004 runs
        lrs = [round(0.001 + i * 1e-5, 5) for i in range(points)]
        res = invoke("sweep", _sweep(tmp_path, seeds="[0, 1, 2, 3]", key="train.lr", values=str(lrs)))
        assert res.exit_code == 130 and "Traceback" not in res.output, res.output
        said[points] = " ".join(res.output.split())
    assert "this sweep trains" not in said[250], said[250]
    assert said[251].startswith(
        "this sweep trains 1,004 runs (1 scheme x 4 seeds x 251 train.lr), 2,570,240 tokens in all; Ctrl-C stops "
        "it, keeping finished runs and checkpoints, and the same command resumes it "
    ), said[251]
