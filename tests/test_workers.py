"""How runs are shared out over processes: one per core, or one after another, said."""

from posbench.config import ExperimentConfig
from posbench.resolve import resolve
from posbench.workers import SMALL_RUN_TOKENS, worker_plan


def _plan(monkeypatch, cores: int, steps: int, to_train: int) -> tuple[tuple, list[str]]:
    monkeypatch.setattr("posbench.workers.cpu_cores", lambda: cores)
    cfg = resolve(ExperimentConfig()).cfg
    cfg.train.device, cfg.train.steps = "cpu", steps
    said: list[str] = []
    return worker_plan(cfg, to_train, said.append), said


def test_runs_too_small_for_a_worker_train_one_after_another_and_say_so(monkeypatch):
    """The README says one run per core; runs under SMALL_RUN_TOKENS train one at a time,
    and one line says so, with their size and how to train them side by side."""
    cfg = resolve(ExperimentConfig()).cfg
    per_step = cfg.train.batch_size * cfg.model.train_len
    small = SMALL_RUN_TOKENS // per_step - 1  # steps of a run just under the line
    plan, said = _plan(monkeypatch, cores=2, steps=small, to_train=3)
    assert plan == (1, None) and len(said) == 1
    assert said[0].startswith(f"3 runs train one after another: each is {small * per_step:,} tokens")
    assert f"under the {SMALL_RUN_TOKENS:,}" in said[0] and "--set train.workers=2 trains them side by side" in said[0]


def test_nothing_is_said_where_runs_go_side_by_side_or_nothing_could(monkeypatch):
    cfg = resolve(ExperimentConfig()).cfg
    big = SMALL_RUN_TOKENS // (cfg.train.batch_size * cfg.model.train_len) + 1
    assert _plan(monkeypatch, cores=2, steps=big, to_train=3) == ((2, 1), [])
    assert _plan(monkeypatch, cores=2, steps=10, to_train=1) == ((1, None), [])  # one run: nothing to share
    assert _plan(monkeypatch, cores=1, steps=10, to_train=3) == ((1, None), [])  # one core: nothing to share


def test_extrapolate_says_when_its_runs_go_one_after_another_and_leaves_no_lock_file(tmp_path, monkeypatch):
    """End to end: two smoke runs on two cores train in sequence, which the
    command says in a line; a finished run leaves no .SCHEME-seedN.lock behind."""
    from conftest import smoke_experiment

    import posbench.workers

    monkeypatch.setattr(posbench.workers, "cpu_cores", lambda: 2)
    exp, res, _ = smoke_experiment(tmp_path, "--schemes", "nope,alibi")
    assert "2 runs train one after another" in " ".join(res.output.split())
    assert sorted(p.name for p in exp.iterdir() if p.name.endswith(".lock")) == []


def test_a_worker_ignores_ctrl_c_from_its_first_import(tmp_path, monkeypatch):
    """Ctrl-C is the parent's: a worker that is still importing (torch takes seconds) when it
    comes must not print a KeyboardInterrupt traceback of its own. The module that holds the
    work is imported in the worker before any of posbench's worker code runs: it sees the
    disposition the worker started with."""
    import signal

    from posbench.progress import Reporter
    from posbench.workers import run_in_workers

    at_import = _module(
        tmp_path,
        monkeypatch,
        "at_import",
        "import signal\n"
        "SIGINT_AT_IMPORT = signal.getsignal(signal.SIGINT)\n"
        "def work(out, reporter):\n"
        "    open(out, 'w').write(str(SIGINT_AT_IMPORT))\n",
    )
    before = signal.getsignal(signal.SIGINT)
    run_in_workers(at_import.work, [("job", (str(tmp_path / "said"),))], lambda: None, Reporter(), 1, 1)
    assert (tmp_path / "said").read_text() == str(signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is before  # this process takes Ctrl-C again


def test_a_workers_error_keeps_its_exit_status_and_key(tmp_path, monkeypatch):
    """A bad input in a worker exits 2 as in this process, with the config key it names; a bug
    there (any other exception) exits 1, as the catch-all here does."""
    import pickle

    import pytest

    from posbench.errors import PosbenchError
    from posbench.progress import Reporter
    from posbench.registry import PLUGIN_MODULES
    from posbench.workers import run_in_workers

    said = pickle.loads(pickle.dumps(PosbenchError("m", "train.lr", exit_code=1)))
    assert (str(said), said.key, said.exit_code) == ("m", "train.lr", 1)
    failing = _module(
        tmp_path,
        monkeypatch,
        "failing",
        "from posbench.errors import PosbenchError\n"
        "def bad_input(reporter):\n"
        "    raise PosbenchError('train.lr=-1 must be positive', 'train.lr')\n"
        "def bug(reporter):\n"
        "    raise ValueError('oops')\n"
        "def exits(reporter):\n"
        "    raise SystemExit(0)\n"
        "def vanishes(reporter):\n"
        "    import os\n"
        "    os._exit(0)\n",
    )

    for name in list(PLUGIN_MODULES):  # none loaded by an earlier test in this process: no plugin to name
        monkeypatch.delitem(PLUGIN_MODULES, name)
    for work, message, key, code in [
        (failing.bad_input, "train.lr=-1 must be positive", "train.lr", 2),
        (failing.bug, "the-run: unexpected ValueError: oops", None, 1),
        (failing.exits, "the-run: unexpected called sys.exit(0)", None, 1),
        (
            failing.vanishes,
            "a worker process died (exit code 0), perhaps out of memory; rerun with "
            "--set train.workers=1 to see the error",
            None,
            2,
        ),
    ]:
        with pytest.raises(PosbenchError) as raised:
            run_in_workers(work, [("the-run", ())], lambda: None, Reporter(), 1, 1)
        assert (str(raised.value), raised.value.key, raised.value.exit_code) == (message, key, code)
    # the parent's plugins are the workers' too: an error in one's code is said as its own
    monkeypatch.setitem(PLUGIN_MODULES, "failing", "scheme 'failing:Bug'")
    with pytest.raises(PosbenchError) as raised:
        run_in_workers(failing.bug, [("the-run", ())], lambda: None, Reporter(), 1, 1)
    said = "the-run: scheme 'failing:Bug' (failing.py, line 5, in bug) raised ValueError: oops: a bug in that plugin"
    assert str(raised.value) == said


def _module(tmp_path, monkeypatch, name: str, source: str):
    """A module written to tmp_path and imported by name, as a spawned worker imports it too."""
    import importlib
    import sys

    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)
