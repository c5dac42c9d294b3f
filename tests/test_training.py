"""How runs train: several at once in worker processes, one whose loss blows up, under
--compile, and a SIGTERM that stops them."""

from pathlib import Path

import torch
import yaml
from conftest import SMOKE, invoke, processes, smoke_experiment


def test_runs_in_worker_processes_equal_runs_in_this_process(tmp_path, worker_smoke):
    """Two workers with one thread each give the table one process with one thread gives:
    a run's numbers depend on its thread count, never on which process trained it."""
    par, res, _ = worker_smoke
    one, _, _ = smoke_experiment(tmp_path, "--schemes", "nope,t5,alibi", "--threads", "1", "--set", "train.workers=1")
    assert (par / "summary.csv").read_text() == (one / "summary.csv").read_text()
    for s in ("nope", "t5", "alibi"):  # every bar was relayed from its worker
        assert f"{s} seed 0" in res.output
    assert not list(par.glob(".*partial"))


def test_a_diverged_run_is_recorded_at_its_step_and_the_others_go_on(tmp_path):
    """Runs in workers whose loss blows up: each is recorded as diverged at the step it happened,
    with no weights; the other run still trains; the report names them; a rerun keeps them."""
    import json

    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    args = (
        "extrapolate",
        "--config",
        SMOKE,
        "--set",
        f"out_dir={tmp_path / 'r'}",
        "--set",
        f"data.path={text}",
        "--schemes",
        "nope,t5",
        "--set",
        "train.workers=2",
        "--set",
        "train.lr=1000000000.0",
        "--set",
        "train.grad_clip=0",
    )
    res = invoke(*args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "every run diverged (nope seed 0 at step" in " ".join(res.output.split())
    for run in ("nope-seed0", "t5-seed0"):
        record = json.loads((tmp_path / "r" / "smoke" / run / "diverged.json").read_text())
        log = [
            json.loads(line) for line in (tmp_path / "r" / "smoke" / run / "train_log.jsonl").read_text().splitlines()
        ]
        assert record["status"] == "diverged" and 0 < record["step"] < 30
        assert all(r["step"] < record["step"] for r in log)  # the log stops before it
        assert not (tmp_path / "r" / "smoke" / run / "model.pt").exists()
    res = invoke(*args)
    assert "nope-seed0: diverged in an earlier attempt" in " ".join(res.output.split())


def test_worker_plan(monkeypatch):
    """One process per core when runs are big enough to repay a worker's start, never more
    processes than runs to train, and the cores shared out as threads."""
    from posbench.config import ExperimentConfig
    from posbench.resolve import resolve
    from posbench.workers import worker_plan

    monkeypatch.setattr("posbench.workers.cpu_cores", lambda: 4)
    cfg = resolve(ExperimentConfig()).cfg  # the default budget: 500 steps of 16
    cfg.train.device = "cpu"
    assert worker_plan(cfg, 8) == (4, 1)
    assert worker_plan(cfg, 2) == (2, 2)
    assert worker_plan(cfg, 1) == (1, None)
    cfg.train.steps = 10  # 10 x 16 x 100 tokens: a run shorter than a worker's start
    assert worker_plan(cfg, 8) == (1, None)
    cfg.train.workers, cfg.train.threads = 3, 2
    assert worker_plan(cfg, 8) == (3, 2)


def test_compile_wraps_the_training_forward_and_its_failure_is_one_line(tmp_path, corpus_file, monkeypatch):
    """--compile hands the model to torch.compile for training (a spy stands in for the slow
    real compile); a compile that fails names the flag instead of a traceback."""
    calls = []

    def spy(model):
        calls.append(model)
        return model

    monkeypatch.setattr(torch, "compile", spy)
    args = (
        "train",
        SMOKE,
        "--scheme",
        "alibi",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=3",
        "--compile",
    )
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert len(calls) == 1 and type(calls[0]).__name__ == "TransformerLM"
    cfg = yaml.safe_load((tmp_path / "smoke" / "alibi-seed0" / "config.yaml").read_text())
    assert cfg["train"]["compile"] is True

    def broken(model):
        def fail(x):
            raise RuntimeError("InductorError: no working C++ compiler found\nmore detail")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    res = invoke(*args[:5], f"out_dir={tmp_path / 'b'}", *args[6:])
    assert res.exit_code == 2
    assert "train.compile: torch.compile failed (InductorError: no working C++ compiler found)" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "b" / "smoke").exists()


def test_sigterm_stops_the_workers_and_leaves_nothing_half_written(tmp_path):
    """A real process, as a user or a scheduler would stop it: exit 130, saying how to resume;
    each run's checkpoint saved in its hidden partial folder, no run folder that could pass for
    a finished one, no temporary file, and no worker left behind."""
    import signal
    import subprocess
    import sys
    import time

    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    exp = tmp_path / "r" / "smoke"
    cmd = [
        sys.executable,
        "-m",
        "posbench.cli",
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "nope,alibi",
        "--set",
        f"out_dir={tmp_path / 'r'}",
        "--set",
        f"data.path={text}",
        "--set",
        "train.steps=100000",
        "--set",
        "train.workers=2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while len(_training(exp)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(_training(exp)) == 2, "the two workers never started"
        pids = [pid for pid, (ppid, _) in processes().items() if ppid == proc.pid]
        assert len(pids) >= 2  # the two workers (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted" in out and "rerun the same command to resume" in out and "Traceback" not in out
        assert sorted(p.name for p in exp.iterdir() if not p.name.endswith(".lock")) == [
            ".alibi-seed0.partial",
            ".claiming",  # the lock a run takes to check the experiment as it starts
            ".nope-seed0.partial",
            "runs.txt",
        ]
        assert all((p / "checkpoint.pt").is_file() for p in exp.glob(".*.partial"))
        assert not list(exp.rglob("tmp-*"))
        deadline = time.time() + 1
        while True:
            now = processes()
            running = [pid for pid in pids if pid in now and now[pid][1] != "Z"]  # a zombie is dead, unreaped
            if not running or time.time() > deadline:
                break
            time.sleep(0.05)
        assert running == [], f"left running 1 s after the parent exited: {running}"
    finally:
        proc.kill()  # a failed check must not leave it running


def _training(exp: Path) -> list[Path]:
    """The partial folders whose training has logged a step."""
    return [
        p
        for p in exp.glob(".*.partial")
        if (p / "train_log.jsonl").is_file() and (p / "train_log.jsonl").stat().st_size
    ]


def test_a_schemes_parameters_take_their_multiple_of_the_rate_and_the_rest_train_as_before(tmp_path):
    """train.scheme_lr_mult: after one step (AdamW's first update is the rate times g / (|g| +
    eps), the same at any rate), T5's table has moved 4 times as far at 4 as at 1, and every
    other weight exactly as far; at 1 the optimiser's groups are the two they always were
    (matrices decayed, the rest not) and the key is left out of a run's identity, so the runs
    made before it keep their folders."""
    from posbench.config import identity
    from posbench.experiment.checkpoint import load_run
    from posbench.model import TransformerLM
    from posbench.train import make_optimizer

    weights = {}
    for mult in (1, 4):
        (tmp_path / str(mult)).mkdir()
        exp, _, _ = smoke_experiment(
            tmp_path / str(mult), "--schemes", "t5", "--set", "train.steps=1", "--set", f"train.scheme_lr_mult={mult}"
        )
        cfg, trained = load_run(exp / "t5-seed0")
        assert cfg.train.scheme_lr_mult == mult and ("scheme_lr_mult" in identity(cfg)["train"]) == (mult != 1)
        weights[mult] = trained.state_dict()
    torch.manual_seed(0)
    model = TransformerLM(cfg.model)
    start = model.state_dict()
    (table,) = [k for k in start if k.startswith("scheme.")]
    for name, w0 in start.items():
        moved1, moved4 = weights[1][name] - w0, weights[4][name] - w0
        if name == table:
            assert moved1.abs().min() > 0
            torch.testing.assert_close(moved4, 4 * moved1, rtol=1e-3, atol=1e-7)
        else:
            assert torch.equal(weights[4][name], weights[1][name]), name
    plain = make_optimizer(model, 1e-3, 0.1)
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    assert [(g["weight_decay"], g["lr_mult"]) for g in plain.param_groups] == [(0.1, 1.0), (0.0, 1.0)]
    assert [id(p) for p in plain.param_groups[0]["params"]] == [id(p) for p in decayed]
    fast = make_optimizer(model, 1e-3, 0.1, 4.0)
    mults = {id(p): g["lr_mult"] for g in fast.param_groups for p in g["params"]}
    assert sum(len(g["params"]) for g in fast.param_groups) == len(list(model.parameters())) == len(mults)
    assert {n: mults[id(p)] for n, p in model.named_parameters() if mults[id(p)] != 1.0} == {table: 4.0}
