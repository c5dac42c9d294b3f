"""The command line end to end on configs/smoke.yaml and a tiny corpus: files, tables, errors."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SMOKE, invoke, report_rebuilt, smoke_experiment  # noqa: E402

from posbench.schemes import SEED_SCHEMES


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke experiment over every seed scheme, shared by the tests that only read it."""
    return smoke_experiment(tmp_path_factory.mktemp("smoke"))


def test_extrapolate_writes_every_promised_file(smoke):
    exp, res, _ = smoke
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (exp / name).stat().st_size > 0, name
    for scheme in SEED_SCHEMES:
        run = exp / f"{scheme}-seed0"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["model"]["scheme"] == scheme and cfg["seeds"] == [0]
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        assert set(log[0]) == {"step", "loss", "lr", "seconds", "attention"}
        assert log[-1]["step"] == cfg["train"]["steps"] - 1
        ckpt = torch.load(run / "model.pt", weights_only=True)
        assert ckpt["config"] == cfg  # the checkpoint carries its own resolved config
        rows = list(csv.DictReader((run / "eval.csv").open()))
        assert [int(r["length"]) for r in rows] == [32, 48, 64]
    assert not list(exp.glob(".*partial"))


def test_summary_csv_is_long_format_with_status(smoke):
    exp, _, _ = smoke
    rows = list(csv.DictReader((exp / "summary.csv").open()))
    assert list(rows[0]) == [
        "scheme",
        "seed",
        "train_len",
        "length",
        "protocol",
        "stride",
        "loss",
        "ppl",
        "bpb",
        "tokens",
        "status",
        "attention",
        "tokenizer",
    ]
    assert len(rows) == len(SEED_SCHEMES) * 3
    by = {(r["scheme"], int(r["length"])): r for r in rows}
    assert by[("learned", 32)]["status"] == "ok"
    assert by[("learned", 64)]["status"] == "beyond-max-len" and by[("learned", 64)]["ppl"] == ""
    assert by[("alibi", 64)]["status"] == "ok"
    ok = [r for r in rows if r["status"] == "ok"]
    assert len({r["tokens"] for r in rows}) == 1  # the same tokens at every length
    for r in ok:
        assert float(r["ppl"]) == pytest.approx(2.718281828 ** float(r["loss"]), rel=1e-6)
        assert 1 < float(r["ppl"]) < 256  # better than uniform over bytes after training


def test_summary_md_names_corpus_model_budget_protocol(smoke):
    exp, res, text = smoke
    md = (exp / "summary.md").read_text()
    assert f"corpus: {text}" in md
    assert "1 layer, d_model 32, 2 heads" in md
    assert "30 steps x 8 sequences x 32 tokens" in md
    assert "nonoverlapping" in md
    for scheme in SEED_SCHEMES:
        assert f"| {scheme} |" in md
    assert "beyond-max-len" in md
    assert "ppl(64)/ppl(32)" in md
    assert "alibi" in res.output and "ppl(64)/ppl(train)" in res.output  # the terminal table


def test_report_rebuilds_the_same_summary_from_disk(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    res = report_rebuilt(exp, copy, ("summary.csv", "summary.md", "summary.png"))
    assert res.exit_code == 0, res.output
    assert (copy / "summary.csv").read_text() == (exp / "summary.csv").read_text()
    assert (copy / "summary.md").read_text() == (exp / "summary.md").read_text()


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


def test_train_one_run(tmp_path, corpus_file):
    out = tmp_path / "r"
    res = invoke(
        "train",
        SMOKE,
        "--scheme",
        "alibi",
        "--seed",
        "2",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=5",
    )
    assert res.exit_code == 0, res.output
    assert (out / "smoke" / "alibi-seed2" / "model.pt").is_file()
    assert sorted(p.name for p in (out / "smoke").iterdir() if p.is_dir()) == ["alibi-seed2"]


def test_train_with_no_config_trains_the_defaults_and_one_run_on_request(tmp_path, corpus_file):
    quick = [
        "--set",
        f"out_dir={tmp_path / 'r'}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=2",
        "--set",
        "eval.tokens=400",
        "--set",
        "train.workers=1",
    ]
    res = invoke("train", "--scheme", "alibi", *quick)
    assert res.exit_code == 0, res.output
    runs = sorted(p.name for p in (tmp_path / "r" / "default").iterdir() if p.is_dir())
    assert runs == ["alibi-seed0"]
    cfg = yaml.safe_load((tmp_path / "r" / "default" / "alibi-seed0" / "config.yaml").read_text())
    assert cfg["model"]["d_model"] == 128 and cfg["eval"]["lengths"] == [100, 125, 150, 200]  # the defaults
    res = invoke(
        "train",
        SMOKE,
        "--set",
        f"out_dir={tmp_path / 's'}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "schemes=[nope, alibi]",
    )
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "s" / "smoke").iterdir() if p.is_dir()) == ["alibi-seed0", "nope-seed0"]


def test_schemes_lists_every_registered_scheme_with_a_description():
    res = invoke("schemes")
    assert res.exit_code == 0
    for s in SEED_SCHEMES:
        assert s in res.output


def _assert_clean_failure(res, message, results: Path):
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    assert message in " ".join(res.output.split()), res.output
    assert not results.exists(), "a failed command left a results folder behind"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schemes", "alibi,ropee"], "unknown scheme 'ropee'"),
        (["--set", "modell.n_layer=1"], "did you mean 'model'?"),
        (["--set", "train.steps=abc"], "train.steps: expected an integer"),
        (["--set", "model.n_head=3"], "is not divisible by model.n_head=3"),
        (["--train-len", "100", "--test-len", "50"], "--test-len 50 is shorter than --train-len 100"),
        (["--lengths", "10,64"], "eval.lengths [10] are shorter than the training length"),
        (["--set", "model.d_model=-8"], "model.d_model=-8 must be positive"),
        (["--set", "data.path=/no/such/*.txt"], "data.path '/no/such/*.txt' matches no file"),
        (["--lengths", "32,abc"], "expected comma-separated integers"),
        (["--schemes", "alibi,alibi"], "schemes: alibi listed more than once"),
        (["--seeds", "0,0"], "seeds: 0 listed more than once"),
        (["--lengths", "32,48,48"], "eval.lengths: 48 listed more than once"),
        (["--seeds", "99999999999999999999"], "is not a seed torch takes"),
        (["--set", "model.vocab_size=10"], "--set model.vocab_size=10: the corpus is bytes"),
        (["--set", "model.n_layer=99999999999999999999"], "GiB for its weights alone, more than the"),
        (["--set", "train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0"),
        (["--set", "model.scheme=rope"], "model.scheme='rope' is not read"),
        (["--rope-factor", "2"], "eval.rope_factor is set but eval.rope_scaling is empty"),
        (["--test-len", "64", "--lengths", "32,48"], "--test-len and --lengths both set"),
        (["--set", "eval.tokens=40"], "eval.tokens=40 is fewer than the longest eval length 64"),
        (["--schemes", "alibi]"], "unknown scheme 'alibi]'"),  # given as typed, not read as YAML
        (["--threads", "-1"], "train.threads=-1 must be positive"),
    ],
)
def test_extrapolate_errors_are_one_line_and_leave_nothing(tmp_path, corpus_file, args, message):
    out = tmp_path / "results"
    res = invoke(
        "extrapolate", "--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}", *args
    )
    _assert_clean_failure(res, message, out)


def test_malformed_and_missing_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {n_layer: 2\n")
    _assert_clean_failure(
        invoke("extrapolate", "--config", bad), "bad.yaml: malformed YAML at line", tmp_path / "results"
    )
    _assert_clean_failure(
        invoke("extrapolate", "--config", tmp_path / "gone.yaml"),
        "gone.yaml: config file not found",
        tmp_path / "results",
    )


def test_run_dir_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    res = invoke("evaluate", tmp_path / "empty")
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "holds no checkpoint (model.pt)" in res.output


def test_corrupt_checkpoint_keeps_what_is_on_disk(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    (run / "model.pt").write_bytes(b"not a checkpoint at all")
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "corrupt or not a posbench checkpoint" in res.output
    assert (run / "eval.csv").read_text() == before


def test_weights_of_another_version_of_a_scheme_are_one_line(smoke, tmp_path):
    """A checkpoint whose tensors do not fit the scheme (KERPLE's r1 saved as one per head where
    the scheme holds one per head and layer) says so, instead of calling a good file corrupt."""
    exp, _, _ = smoke
    run = tmp_path / "t5-seed0"
    shutil.copytree(exp / "t5-seed0", run)
    ckpt = torch.load(run / "model.pt", weights_only=True)
    ckpt["model"]["scheme.table"] = ckpt["model"]["scheme.table"][:, :1]
    torch.save(ckpt, run / "model.pt")
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "its weights do not fit scheme 't5'" in res.output and "retrain it" in res.output


def test_report_of_an_empty_folder(tmp_path):
    res = invoke("report", tmp_path)
    assert res.exit_code != 0 and "holds no evaluated runs" in res.output


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


def test_schemes_all_runs_every_registered_scheme_with_rope_rows(tmp_path, corpus_file):
    from posbench.schemes import SCHEMES

    out = tmp_path / "r"
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "all",
        "--rope-scaling",
        "yarn,linear",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=3",
    )
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader((out / "smoke" / "summary.csv").open()))
    assert {r["scheme"] for r in rows} == set(SCHEMES) | {"rope+yarn", "rope+linear"}
    assert len(SCHEMES) >= 14


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


def test_damaged_records_are_one_line(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "eval.csv").write_text("scheme,length\nrope,abc\n")
    res = invoke("report", copy)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "eval.csv: malformed evaluation rows" in " ".join(res.output.split())


def test_an_empty_config_yaml_is_a_damaged_record_not_the_defaults(smoke, tmp_path):
    """A run's config.yaml left empty (a full disk, a crash) would read as the default config:
    a report would make it a grid point of its own, status would show the default train_len."""
    from posbench.experiment.status import run_status

    exp, _, text = smoke
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "config.yaml").write_text("")
    before = (copy / "summary.csv").read_text()
    for args in (
        ["report", copy],
        ["evaluate", copy / "rope-seed0"],
        ["extrapolate", "--config", SMOKE, "--set", f"out_dir={tmp_path}", "--set", f"data.path={text}"],
    ):
        res = invoke(*args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        said = " ".join(res.output.split())
        assert "rope-seed0/config.yaml: empty" in said and len(res.output.strip().splitlines()) <= 2
    assert (copy / "summary.csv").read_text() == before and (copy / "rope-seed0" / "model.pt").is_file()
    row = {r["run"]: r for r in run_status(copy)}["rope-seed0"]
    assert (row["scheme"], row["train_len"]) == ("?", "?")


def test_unwritable_out_dir_is_one_line(tmp_path, corpus_file):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--set",
        f"out_dir={blocker}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code != 0 and "Traceback" not in res.output and "error:" in res.output


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


# --- several runs at once (train.workers) ----------------------------------------------------


def test_runs_in_worker_processes_equal_runs_in_this_process(tmp_path):
    """Two workers with one thread each give the table one process with one thread gives:
    a run's numbers depend on its thread count, never on which process trained it."""
    schemes = ("--schemes", "nope,t5,alibi", "--threads", "1")
    (tmp_path / "par").mkdir(), (tmp_path / "one").mkdir()
    par, res, _ = smoke_experiment(tmp_path / "par", *schemes, "--set", "train.workers=2")
    one, _, _ = smoke_experiment(tmp_path / "one", *schemes, "--set", "train.workers=1")
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
        pids = [pid for pid, (ppid, _) in _processes().items() if ppid == proc.pid]
        assert len(pids) >= 2  # the two workers (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted" in out and "rerun the same command to resume" in out and "Traceback" not in out
        assert sorted(p.name for p in exp.iterdir() if not p.name.endswith(".lock")) == [
            ".alibi-seed0.partial",
            ".nope-seed0.partial",
            "runs.txt",
        ]
        assert all((p / "checkpoint.pt").is_file() for p in exp.glob(".*.partial"))
        assert not list(exp.rglob("tmp-*"))
        time.sleep(1)
        now = _processes()
        running = [pid for pid in pids if pid in now and now[pid][1] != "Z"]  # a zombie is dead, unreaped
        assert running == [], f"left running: {running}"
    finally:
        proc.kill()  # a failed check must not leave it running


def _training(exp: Path) -> list[Path]:
    """The partial folders whose training has logged a step."""
    return [
        p
        for p in exp.glob(".*.partial")
        if (p / "train_log.jsonl").is_file() and (p / "train_log.jsonl").stat().st_size
    ]


def _processes() -> dict:
    """pid -> (parent pid, state letter), from /proc (Linux, where CI runs; no `ps` needed)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it exited while we looked
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        found[int(stat.parent.name)] = (int(ppid), state)
    return found


def test_bad_files_and_evaluate_flags_are_one_line_and_keep_what_is_on_disk(tmp_path, smoke, corpus_file):
    """An empty corpus, a config with a key twice, a config path that does not exist, a negative
    --threads for evaluate, a run's config.yaml that is not text: each is one line that names the
    culprit, exit 2, and what is on disk is kept. `alibi:` with nothing under it is no options."""
    exp, _, text = smoke
    out = tmp_path / "results"
    base = ["--set", f"out_dir={out}", "--set", f"data.path={corpus_file}"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _assert_clean_failure(
        invoke("extrapolate", "--config", SMOKE, *base, "--set", f"data.path={empty}"), "is empty", out
    )
    twice = tmp_path / "twice.yaml"
    twice.write_text("name: a\nname: b\n")
    _assert_clean_failure(invoke("extrapolate", "--config", twice), "key 'name' appears twice", out)
    marked = tmp_path / "x[b].yaml"
    _assert_clean_failure(invoke("extrapolate", "--config", marked), "x[b].yaml: config file not found", out)
    null_options = tmp_path / "null.yaml"  # `alibi:` with nothing under it means no options
    null_options.write_text(
        yaml.safe_dump({**yaml.safe_load(open(SMOKE)), "schemes": ["alibi"], "scheme_options": {"alibi": None}})
    )
    assert invoke("extrapolate", "--config", null_options, *base).exit_code == 0
    res = invoke("evaluate", exp / "alibi-seed0", "--threads", "-1")
    assert res.exit_code == 2 and "--threads -1: the thread count must be positive" in res.output

    # a run folder whose records are not text: named, and the experiment's files are kept
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "config.yaml").write_bytes(b"\xff\xfe")
    res = invoke("report", copy)
    assert res.exit_code == 2 and "rope-seed0/config.yaml: not a text file" in " ".join(res.output.split())


def test_report_never_drops_a_run_in_silence(smoke, tmp_path):
    """A run whose eval.csv is garbage, empty or only a header is an error naming that file,
    and the summary that was there stays, instead of a summary rewritten without the run."""
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    summary = (copy / "summary.csv").read_text()
    header = (copy / "alibi-seed0" / "eval.csv").read_text().splitlines()[0] + "\n"
    for damage in [
        'garbage,,,"\n',
        "",
        header,
        header + "alibi,0,32,32,2.9,18.1,799,weird\n",
        header + "alibi,0,32,32,abc,18.1,799,ok\n",
        b"\xff\xfe",
    ]:
        target = copy / "alibi-seed0" / "eval.csv"
        target.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
        res = invoke("report", copy)
        assert res.exit_code == 2, (damage, res.output)
        assert "alibi-seed0/eval.csv: malformed evaluation rows" in " ".join(res.output.split()), damage
        assert (copy / "summary.csv").read_text() == summary


def test_a_checkpoint_with_nan_weights_is_refused(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    ckpt = torch.load(run / "model.pt", weights_only=True)
    ckpt["model"]["tok.weight"][0, 0] = float("nan")
    torch.save(ckpt, run / "model.pt")
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "holds non-finite weights" in res.output
    assert (run / "eval.csv").read_text() == before


def test_a_broken_plugin_is_one_line(tmp_path, corpus_file, monkeypatch):
    """A user's class that raises when built names itself and check-scheme; one that breaks
    mid-forward still gets one line (the catch-all), not a traceback."""
    (tmp_path / "brokenplug.py").write_text(
        "from posbench.schemes import PositionalScheme\n"
        "class Raises(PositionalScheme):\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__(cfg)\n"
        "        raise ValueError('my constructor fails')\n"
        "class BadBias(PositionalScheme):\n"
        "    def bias(self, q, k, qpos, kpos, layer):\n"
        "        return q.new_zeros(3, 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "results"
    base = ["--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}"]
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:Raises")
    _assert_clean_failure(res, "scheme 'brokenplug:Raises' failed to build (ValueError: my constructor fails)", out)
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:BadBias")
    assert "Traceback" not in res.output
    assert res.exit_code == 1, "a bug, not a bad input: exit 1"
    error = res.output[res.output.index("error:") :]  # after any note on kernels that cannot run
    assert "unexpected RuntimeError" in error and len(error.strip().splitlines()) <= 2
    assert not list(out.rglob("*.partial")) and not list(out.rglob("model.pt"))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bogus"], "error: No such option: --bogus (see 'posbench --help')"),
        (["extrapolate", "--test-len", "abc"], "Invalid value for '--test-len'"),
        (["evaluate"], "Missing argument"),
    ],
)
def test_usage_errors_are_one_line_from_the_console_script(args, message):
    """typer prints usage errors in a boxed panel; posbench's entry point prints one line."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "posbench.cli", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_yaml_merge_keys_and_a_runs_own_config_with_another_scheme(tmp_path, smoke):
    """Anchors and `<<:` merges still load under the duplicate-key check; a run's config.yaml
    (which names its scheme twice) takes --schemes without complaint."""
    from posbench.config import load_config

    merged = tmp_path / "merge.yaml"
    merged.write_text(
        "model: {n_layer: 1, d_model: 32, n_head: 2}\n"
        "scheme_options:\n"
        "  hybrid: &t5 {max_distance: 64, num_buckets: 16}\n"
        "  t5: {<<: *t5, num_buckets: 8}\n"
    )
    cfg = load_config(merged, [])
    assert cfg.model.n_layer == 1 and cfg.scheme_options["t5"] == {"max_distance": 64, "num_buckets": 8}
    exp, _, _ = smoke
    cfg = load_config(exp / "rope-seed0" / "config.yaml", ['schemes=["alibi"]'])
    assert cfg.schemes == ["alibi"] and cfg.model_for("alibi").scheme == "alibi"


def test_a_model_too_big_to_train_is_refused_before_allocation():
    """16 bytes a parameter to train (weights, gradients, AdamW's moments), 4 to hold it."""
    from posbench.config import ModelConfig, check_trainable
    from posbench.errors import PosbenchError

    cfg = ModelConfig(n_layer=2, d_model=128)  # 12 * 2 * 128^2 + 256 * 128 = 425,984 parameters
    check_trainable(cfg, device_memory=16 * 425_984)
    with pytest.raises(PosbenchError, match="model.n_layer=2, model.d_model=128: about 4.3e.05 parameters"):
        check_trainable(cfg, device_memory=16 * 425_984 - 1)
    check_trainable(cfg, device_memory=4 * 425_984, bytes_per_param=4)


def test_bare_posbench_prints_its_help_once():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "posbench.cli"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.count("Usage: posbench") == 1, res.stdout


def test_blame_names_the_flag_not_a_file_with_a_fault_of_its_own(tmp_path):
    """The file alone fails (train.steps is fine there, eval lengths are not); the flags add
    another fault: each message names its own source."""
    from posbench.config import load_config
    from posbench.errors import PosbenchError
    from posbench.resolve import resolve

    partial = tmp_path / "partial.yaml"
    partial.write_text("model: {train_len: 64}\neval: {lengths: [32, 64]}\n")
    with pytest.raises(PosbenchError, match=r"partial.yaml: eval.lengths \[32\] are shorter"):
        resolve(load_config(partial, []))
    with pytest.raises(PosbenchError, match="^--set train.steps=0 must be positive"):
        load_config(partial, ["model.train_len=32", "train.steps=0"])


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


def test_report_names_a_run_folder_missing_its_records(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "eval.csv").unlink()
    res = invoke("report", copy)
    assert res.exit_code == 2 and "rope-seed0: a run folder without eval.csv" in " ".join(res.output.split())


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_run_trained_on_a_gpu_is_scored_here_with_device_cpu(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    rec = yaml.safe_load((run / "config.yaml").read_text())
    rec["train"]["device"] = "cuda"  # as if trained on a GPU (the device does not decide weights)
    (run / "config.yaml").write_text(yaml.safe_dump(rec))
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "no CUDA device is available here (evaluate takes --device cpu)" in res.output
    assert invoke("evaluate", run, "--lengths", "32", "--device", "cpu").exit_code == 0
    res = invoke("evaluate", run, "--lengths", "32", "--device", "tpu")
    assert res.exit_code == 2 and "--device tpu: expected auto, cpu, cuda or cuda:N" in res.output


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
    assert cells[-4] == f"{rows['0', 80] / rows['0', 32]:.2f}"  # the ratio column, over seed 0, before bpb


def test_the_table_shows_seeds_that_blew_up_and_hides_no_ratio_behind_them():
    """Seed 0 blew up at 64, seed 1 did not: the cell shows seed 1's value and says one seed
    blew up, and the ratio is not taken from the seed that survived."""
    import pandas as pd

    from posbench.measures.perplexity import cell, comparison

    rows = [
        ("alibi", s, 32, L, ppl, st)
        for s, L, ppl, st in [
            (0, 32, 10.0, "ok"),
            (0, 64, float("nan"), "non-finite"),
            (1, 32, 12.0, "ok"),
            (1, 64, 13.0, "ok"),
        ]
    ]
    rows += [("rope", s, 32, L, ppl, "ok") for s, L, ppl in [(0, 32, 5.0), (0, 64, 6.0), (1, 32, 7.0)]]
    df = pd.DataFrame(rows, columns=["scheme", "seed", "train_len", "length", "ppl", "status"])
    table = comparison(df)
    assert cell(table, "alibi", 64) == "13.00 (1 of 2 seeds; 1 non-finite)"
    assert table.loc["alibi", "ratio"] != table.loc["alibi", "ratio"]  # NaN, not 13/12
    assert cell(table, "rope", 64) == "6.00 (1 of 2 seeds)"
    assert table.loc["rope", "ratio"] == 6.0 / 5.0  # over seed 0, the one scored at both


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


def test_a_run_records_every_scheme_option_and_a_checkpoint_without_them_is_refused(smoke, tmp_path):
    """A checkpoint that does not say how its scheme was set up cannot be scored as trained:
    the defaults may have moved (t5's scale did). One line, and nothing is changed."""
    exp, _, _ = smoke
    run = tmp_path / "t5-seed0"
    shutil.copytree(exp / "t5-seed0", run)
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["model"]["options"]["scale"] == "sqrt_head_dim" and record["model"]["options"]["init"] == "normal"
    ckpt = torch.load(run / "model.pt", weights_only=True)
    for key in ("scale", "init"):
        del ckpt["config"]["model"]["options"][key]
        del ckpt["config"]["scheme_options"]["t5"][key]
    torch.save(ckpt, run / "model.pt")
    (run / "config.yaml").unlink()
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "does not record scheme 't5''s option(s) init, scale" in " ".join(res.output.split())
    assert (run / "eval.csv").read_text() == before


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


def _flat(text: str) -> str:
    """Help or README text with its line breaks and rich's box edges folded into single spaces."""
    import re

    return re.sub(r"[\s│]+", " ", text)


def test_train_and_sweep_take_the_config_as_a_flag_and_train_takes_seeds(tmp_path, corpus_file):
    """#30.6: every command takes `--config FILE`; `train --seeds 0,1,2`, as the tables' footer advises."""
    from conftest import ROOT

    out = tmp_path / "results"
    sets = ["--set", f"out_dir={out}", "--set", f"data.path={corpus_file}", "--set", "train.steps=2"]
    res = invoke("train", "--config", SMOKE, "--scheme", "nope", "--seeds", "0,1", *sets)
    assert res.exit_code == 0, res.output
    assert all((out / "smoke" / f"nope-seed{n}" / "model.pt").exists() for n in (0, 1))
    res = invoke("train", SMOKE, "--config", SMOKE)
    assert res.exit_code == 2 and "config given twice" in _flat(res.output), res.output
    res = invoke("train", "--seed", "1", "--seeds", "0,1")
    assert res.exit_code == 2 and "--seed and --seeds both pick the seeds" in _flat(res.output), res.output
    res = invoke("sweep", "--config", ROOT / "configs" / "sweep-example.yaml", "--dry-run")
    assert res.exit_code == 0 and "grid point" in res.output, res.output
    res = invoke("sweep")
    assert res.exit_code == 2 and "posbench sweep needs a config" in _flat(res.output), res.output


def test_help_offers_only_input_that_is_taken_and_names_the_length_defaults():
    """#30.12: --protocol takes a comma list (no `both`), --compile is a flag and says so when
    given a value, and extrapolate's help names where its lengths come from."""
    import subprocess
    import sys

    from posbench.config import EvalConfig, ModelConfig, length_grid

    text = _flat(invoke("extrapolate", "--help").output)
    assert "or both" not in text and "nonoverlapping,sliding" in text
    L, grid = ModelConfig().train_len, ",".join(map(str, length_grid(100, 200)))
    assert f"(default: model.train_len, {L})" in text
    assert f"(default: eval.lengths, {','.join(map(str, EvalConfig().lengths))})" in text
    assert f"scores L and 1/4, 1/2 and all of the way to N (--test-len 200 from 100: {grid})" in text
    for command in ("extrapolate", "train"):
        help_lines = invoke(command, "--help").output.splitlines()
        compile_line = next(line for line in help_lines if "--compile" in line)
        assert "<bool>" not in compile_line and "no value" in _flat("\n".join(help_lines)), compile_line
    args = [sys.executable, "-m", "posbench.cli", "train", "--compile", "true"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--compile take no value" in lines[0], res.stderr


def test_readme_says_what_a_run_folder_holds(smoke):
    """#30.13: the files the README lists in a run folder are the ones a run writes;
    positions.png is the experiment's, never a run's."""
    import re

    from conftest import ROOT

    from posbench.measures.exact_match import ExactMatch

    readme = (ROOT / "README.md").read_text()
    exp, _, _ = smoke
    written = {p.name for p in (exp / "alibi-seed0").iterdir() if not p.name.startswith(".")}
    listed = readme[readme.index("a folder per run") :].split("\n\n")[0]
    named = set(re.findall(r"`(\w+\.\w+)`", listed))
    assert written <= named and named - written == set(ExactMatch.records) - written, (named, written)
    for at in [m.start() for m in re.finditer(r"`positions\.png`", readme)]:
        before = readme[max(0, at - 60) : at]
        assert "experiment's" in before or "run" not in before, before


def test_docs_count_the_hooks_name_the_interval_and_state_the_length_rule():
    """#30.13: the hook table and its sentence agree, default.yaml names the interval the tables
    print, and the README states how --test-len picks lengths, not only an example."""
    import pandas as pd
    from conftest import ROOT

    from posbench.config import length_grid
    from posbench.measures.perplexity import spread_note
    from posbench.schemes import PositionalScheme

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Write your own scheme") :].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    hooks = [line.split("`")[1].split("(")[0] for line in rows]
    assert all(callable(getattr(PositionalScheme, h, None)) for h in hooks), hooks
    intro = _flat(section.split("| hook |")[0])
    required = [r for r in rows if "optional" not in r]
    words = {3: "three", 4: "four"}
    assert f" {words[len(required)]} hooks" in intro and "up to" not in intro, intro
    assert ("optional" in intro) == (len(required) < len(rows)), intro
    seeds_line = next(line for line in (ROOT / "configs" / "default.yaml").read_text().splitlines() if "seeds:" in line)
    assert "mean ± 95%" in spread_note({"x": pd.DataFrame({"seeds": [2]})})
    assert "mean ± 95% interval" in seeds_line and "std" not in seeds_line, seeds_line
    assert length_grid(100, 200) == [100, 125, 150, 200]
    text = _flat(readme)
    assert "`--test-len N` scores the training length L" in text and "1/4, 1/2 and all of the way from L to N" in text
    assert "`--test-len 200` scores 100, 125, 150, 200" in text


def test_bench_quick_says_its_timings_are_rough(tmp_path):
    """#30.13: one round cannot be compared; the README and the command both say so."""
    from conftest import ROOT

    res = invoke("bench", "--quick", "--schemes", "nope", "--out", tmp_path / "bench.csv")
    assert res.exit_code == 0, res.output
    assert "note: --quick timed 1 round at batch 4" in _flat(res.output), res.output
    readme = _flat((ROOT / "README.md").read_text())
    assert "`--quick` times one round, too few to compare schemes" in readme


def test_make_installs_the_test_extra_only_for_test_and_lint():
    """#30.13: `make extrapolate` (and smoke) install the package alone; test and lint add `.[test]`."""
    import subprocess

    from conftest import ROOT

    if shutil.which("make") is None:
        pytest.skip("no make")

    def dry(target):
        res = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    for target in ("extrapolate", "smoke"):
        assert "[test" not in dry(target) and "pip install -q -e ." in dry(target)
    for target in ("test", "lint"):
        assert "'.[test" in dry(target)
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(f"make {t}" in ci for t in ("lint", "test", "smoke"))


# --- #30.3: tables in 80 columns (output redirected) cut no number; #30.8: progress in logs ---------


def _whole(number: str, text: str) -> bool:
    """`number` appears in `text` as a whole token, not cut short nor run into another."""
    import re

    return re.search(rf"(?<![\w.]){re.escape(number)}(?![\w.])", text) is not None


def _rendered(table, width: int = 80) -> str:
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue()


def test_the_report_in_80_columns_cuts_no_number_and_no_header(tmp_path):
    """#30.3: two seeds and five lengths, redirected (CliRunner is 80 wide): every number of the
    table is there in full, and no header ends in "…" (ppl(64)/ppl(train) breaks after its "/")."""
    import re

    more = ("--schemes", "learned,alibi", "--seeds", "0,1", "--set", "eval.lengths=[32,40,48,56,64]")
    exp, _, _ = smoke_experiment(tmp_path, *more)
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    table = [line.split("|") for line in (exp / "summary.md").read_text().splitlines() if line.startswith("| ")]
    shown = [i for i, head in enumerate(table[0]) if not head.strip().startswith("bpb(")]  # bpb: files only
    numbers = {n for cells in table for i in shown for n in re.findall(r"\d+\.\d+", cells[i])}
    assert numbers and all(_whole(n, res.output) for n in numbers), res.output
    assert "ppl(64)/" in res.output and "ppl(train)" in res.output, res.output


def test_bench_tables_in_80_columns_tell_100_from_1600(tmp_path):
    """#30.3: with the peer's columns, eval memory at 100 and 1600 is headed by its length in
    full, never "mem@1…" twice, and every number is there in full."""
    from posbench.config import ModelConfig
    from posbench.console import bench_table

    rows, where = [], {"device": "cpu (AMD EPYC 7B13, 2 threads)", "attention": "native"}
    for i, s in enumerate(("nope", "sinusoidal", "learned", "alibi")):
        speed = {"tokens_per_s": 61234.4 - 997 * i, "ratio_vs_nope": 1 - 0.03 * i, "mfu": 0.0734}
        peer = {"peer_tokens_per_s": 50876.0 + i, "peer_ratio": 1.21 + 0.01 * i}
        rows.append({"scheme": s, "measurement": "train", **speed, **peer, **where})
        for L, mb in ((100, 3.1 + i), (1600, 655.4 + i)):
            mb = None if s == "learned" and L > 100 else mb  # beyond its table
            rows.append({"scheme": s, "measurement": "eval", "eval_len": L, "peak_mem_mb": mb, **where})
    text = _rendered(bench_table(rows, 1.2e11, ModelConfig(), torch.device("cpu"), "x-transformers"))
    assert "…" not in text, text
    head = next(line for line in text.splitlines() if "scheme" in line and "100" in line)
    assert _whole("100", head) and _whole("1600", head), text
    formats = {"tokens_per_s": ".0f", "ratio_vs_nope": ".2f", "peer_tokens_per_s": ".0f", "peer_ratio": ".2f"}
    for r in rows:
        for key, fmt in {**formats, "peak_mem_mb": ".1f"}.items():
            if r.get(key) is not None:
                assert _whole(format(r[key], fmt), text), (key, r[key], text)


def test_status_in_80_columns_spends_a_line_or_two_a_run(tmp_path):
    """#30.3: a run is a line, with its state and whole detail beside it; a sweep's runs, whose
    folder names are long, at most two; no number is cut and nothing ends in "…"."""
    import re

    from posbench.console import status_table

    runs = [
        ("alibi-seed0-train_len64-3f9c2a1e", "running", "training, at step 120 of 500 (pid 4242)"),
        ("rope-seed1-train_len128-0c613c13", "partial", "at step 250 of 500; rerun to resume"),
        ("sinusoidal-seed2-train_len64-85eaff04", "done", "trained and evaluated"),
        ("t5-seed0-train_len128-12ab34cd", "diverged", "at step 37 (loss nan)"),
    ]
    rows = []  # as run_status gives them
    for run, state, detail in runs:
        scheme, seed = run.split("-")[:2]
        rows.append({"run": run, "scheme": scheme, "seed": int(seed[4:]), "train_len": 64})
        rows[-1].update(state=state, detail=detail)
    text = _rendered(status_table(tmp_path / "sweep", rows))
    assert "…" not in text, text
    body = [line for line in text.splitlines() if line.startswith("│")]
    assert len(body) <= 2 * len(rows), text
    for r in rows:
        assert r["run"] in text and all(_whole(n, text) for n in re.findall(r"\d+", r["detail"])), text
    short = [{**r, "run": r["run"].rsplit("-", 2)[0]} for r in rows]  # an experiment's: alibi-seed0
    text = _rendered(status_table(tmp_path / "default", short))
    assert len([line for line in text.splitlines() if line.startswith("│")]) == len(rows), text
    for r in short:
        line = next(line for line in text.splitlines() if f"│ {r['run']} " in line)
        assert r["state"] in line and r["detail"] in line, text


def test_without_a_terminal_progress_lines_come_while_a_run_trains():
    """#30.8: output redirected (nohup, CI, tee): a line every tenth of a run, with its loss and
    time left, before the run finishes, not a bar drawn only at its end."""
    import io

    from rich.console import Console

    from posbench.console import BarReporter

    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    reporter = BarReporter(console)
    reporter.start("alibi seed 0", 100)
    for step in range(1, 51):
        reporter.step("alibi seed 0", step, 3.0 - step / 100)
    during = console.file.getvalue()
    assert "alibi seed 0: step 50/100, loss 2.500, eta" in during, during
    assert "alibi seed 0: step 10/100" in during and "step 11/100" not in during, during  # a tenth, not every step
    for step in range(51, 101):
        reporter.step("alibi seed 0", step, 2.0)
    reporter.finish("alibi seed 0")
    assert "alibi seed 0: step 100/100, loss 2.000, took" in console.file.getvalue()


def test_progress_counts_the_runs_in_logs_and_on_a_terminal(tmp_path):
    """#30.8: each run says which of the runs to train it is ("2 of 2"), in a log and in a bar,
    and a bar shows the time left."""
    import io

    from rich.console import Console

    from posbench.console import BarReporter

    _, res, _ = smoke_experiment(tmp_path, "--schemes", "nope,alibi")
    said = " ".join(res.output.split())
    assert "nope seed 0 (1 of 2)" in said and "alibi seed 0 (2 of 2)" in said, res.output
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    reporter = BarReporter(console)
    reporter.plan(3)
    reporter.start("rope seed 1", 100)
    reporter.step("rope seed 1", 50, 2.5)
    reporter.finish("rope seed 1")
    drawn = console.file.getvalue()
    assert "rope seed 1 (1 of 3)" in drawn and "50/100" in drawn and "eta" in drawn, drawn


def test_a_sweeps_progress_names_each_grid_point(tmp_path):
    """#30.8: two grid points train "alibi seed 0" each; their progress is told apart by the
    grid point, as the run folder names it (train_len16-<hash>)."""
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    config = tmp_path / "sweep.yaml"
    config.write_text(
        f"name: grid\nout_dir: {tmp_path / 'r'}\ndata: {{path: {text}}}\n"
        "model: {n_layer: 1, n_head: 2, d_model: 32, train_len: 16}\n"
        "train: {steps: 10, batch_size: 4, warmup_steps: 2, log_every: 5, threads: 1}\n"
        "eval: {lengths: [32], tokens: 1024}\n"
        "sweep:\n  schemes: [alibi]\n  model.train_len: [16, 24]\n"
    )
    res = invoke("sweep", config)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    runs = sorted(p.name for p in (tmp_path / "r" / "grid").iterdir() if p.is_dir())
    assert len(runs) == 2
    for k, run in enumerate(runs, start=1):
        assert f"alibi seed 0, {run.removeprefix('alibi-seed0-')} ({k} of 2)" in said, res.output
