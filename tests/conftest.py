"""Shared fixtures and helpers: a tiny model config, a tiny corpus, and a smoke experiment trained
once for the whole suite; no test needs the network."""

import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from posbench.check import tiny_config as tiny  # noqa: F401  (the tests' tiny model size)
from posbench.cli import app

# without a GPU, posbench's Triton kernels (model.attention=triton) run under Triton's
# interpreter, so the tests check them on a CPU as they check every other backend
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
RESULTS_DOC = ROOT / "docs" / "results.md"  # every reference study's tables, which the tests hold to the records
_runner = CliRunner()


def invoke(*args):
    """Run the posbench CLI in-process, as a user would type it."""
    return _runner.invoke(app, [str(a) for a in args])


def outputs_and_grads(model, x, block):
    """A model's logits and its parameters' gradients (of their squares' mean), `block` queries
    at a time, on the CPU: what the GPU tests compare across backends and devices."""
    model.zero_grad()
    model.attn_block = block
    y = model(x)
    y.square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return y.detach().cpu(), grads.cpu()


def folded(text: str) -> str:
    """Help or README text with its line breaks and rich's box edges folded into single spaces."""
    return re.sub(r"[\s│]+", " ", text)


def report_rebuilt(exp: Path, copy: Path, removed: tuple):
    """`posbench report` on a copy of the experiment `exp` whose `removed` files are deleted."""
    shutil.copytree(exp, copy)
    for name in removed:
        (copy / name).unlink()
    return invoke("report", copy)


def report_refused(exp: Path) -> str:
    """`posbench report exp`, refused: exit 2, one line, the experiment's summary.md as it was.
    Returns the line, its breaks folded into spaces."""
    before = (exp / "summary.md").read_bytes() if (exp / "summary.md").is_file() else None
    res = invoke("report", exp)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert ((exp / "summary.md").read_bytes() if before is not None else None) == before
    return " ".join(res.output.split())


def rebuilds_byte_for_byte(name: str, tmp_path: Path) -> Path:
    """results/<name> reported afresh from a copy of its records gives its committed
    summary.csv, .md and .tex; returns the committed folder."""
    committed = ROOT / "results" / name
    copy = tmp_path / name
    res = report_rebuilt(committed, copy, ("summary.csv", "summary.md", "summary.tex"))
    assert res.exit_code == 0, res.output
    for summary in ("summary.csv", "summary.md", "summary.tex"):
        assert (copy / summary).read_text() == (committed / summary).read_text(), summary
    return committed


def smoke_experiment(tmp: Path, *args):
    """configs/smoke.yaml on a tiny repeated text in tmp: (experiment folder, result, text file).
    On one torch thread, as every test runs (`_threads`): a session fixture is set up before the
    test's own fixtures, and a run on two threads sums in another order (the last digits differ)."""
    torch.set_num_threads(1)
    text = tmp / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    out = tmp / "results"
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={text}", *args)
    assert res.exit_code == 0, res.output
    return out / "smoke", res, text


# a task run of seconds: one layer, two steps, strings of 1..3 trained, 1..5 tested
QUICK_TASK = [
    "--set",
    "model.n_layer=1",
    "--set",
    "model.d_model=32",
    "--set",
    "model.n_head=2",
    "--set",
    "train.steps=2",
    "--set",
    "train.warmup_steps=1",
    "--set",
    "task_options.train_max=3",
    "--set",
    "task_options.test_max=5",
    "--set",
    "task_options.test_count=4",
]


def task_experiment(out: Path, schemes: str, *more, task: str = "copy", name: str = "") -> Path:
    """`posbench extrapolate --task copy` at QUICK_TASK's size (a --set in `more` over its own),
    seed 0 of each scheme, under `out`: its experiment folder (out/<name>, or out/<task> without one)."""
    named = ["--set", f"name={name}"] if name else []
    given = {m.split("=", 1)[0] for m in more if "=" in m}  # a key of QUICK_TASK's that `more` sets instead
    quick = [x for pair in zip(QUICK_TASK[::2], QUICK_TASK[1::2]) if pair[1].split("=")[0] not in given for x in pair]
    res = invoke("extrapolate", "--task", task, "--schemes", schemes, "--set", f"out_dir={out}", *quick, *named, *more)
    assert res.exit_code == 0, res.output
    return out / (name or task)


def processes() -> dict:
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


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
    """One smoke experiment over every seed scheme, trained once for the whole suite: (experiment
    folder, result, text file). Tests only read it; a test that changes it works on a copy."""
    return smoke_experiment(tmp_path_factory.mktemp("smoke"))


@pytest.fixture(scope="session")
def task_smoke(tmp_path_factory) -> Path:
    """One copy-task experiment of nope and alibi at QUICK_TASK's size (task_experiment), trained
    once for the whole suite: its experiment folder, named `copy`. Tests only read it; a test that
    changes it (deletes a file, reports into it) works on a copy:
    `shutil.copytree(task_smoke, tmp_path / "copy")`."""
    return task_experiment(tmp_path_factory.mktemp("task"), "nope,alibi")


@pytest.fixture(scope="session")
def worker_smoke(tmp_path_factory):
    """nope, t5 and alibi of configs/smoke.yaml trained by two worker processes of one thread
    each, every finished run sent to TensorBoard by this, the driving process; trained once for
    the suite, since each worker starts by importing torch: (experiment folder, result, text
    file). Tests only read it."""
    more = ("--schemes", "nope,t5,alibi", "--threads", "1", "--set", "train.workers=2", "--tracker", "tensorboard")
    return smoke_experiment(tmp_path_factory.mktemp("workers"), *more)


@pytest.fixture(autouse=True)
def _threads():
    """One torch thread for every test (a command's --threads may have changed it): the suite's
    models are so small that a second thread only adds OpenMP's hand-offs, which cost seconds a
    run on a busy machine. Tests of code whose threads matter (the C kernels) ask for `two_threads`."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _figures_unwritten(request, monkeypatch):
    """Every figure is drawn, but none is laid out and written as a PNG: rendering one is most of
    a small report's time, and most tests read its tables. A test that reads a PNG, or a figure's
    layout as saved, is marked `@pytest.mark.plots` and gets the files."""
    if request.node.get_closest_marker("plots"):
        return
    from posbench import plots
    from posbench.compare import plot

    def unwritten(plt, fig, path, dpi=100):
        plt.close(fig)
        return True  # as written, so every command says and lists what it would have written

    monkeypatch.setattr(plot, "save", unwritten)
    monkeypatch.setattr(plots, "save", unwritten)


@pytest.fixture
def two_threads():
    """Two torch threads, as on the 2-core machines the suite runs on, for a test whose code
    splits its work across threads (the C kernels' OpenMP loops): that path is the one checked."""
    torch.set_num_threads(2)


@pytest.fixture
def small_peak(monkeypatch):
    """A 256 x 256 matmul for `bench`'s FLOP/s peak, where a test reads no MFU: the 2048 x 2048
    one is most of a quick bench's time. test_bench_quick_writes_every_row times the real one."""
    from posbench import bench

    monkeypatch.setattr(bench, "peak_size", lambda device: 256)


@pytest.fixture
def corpus_file(tmp_path):
    """~40 kB of deterministic pseudo-English, enough for a 16-token model to learn something."""
    rng = random.Random(0)
    words = "the king and queen of a castle to be or not that is question my lord".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(800)]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def markdown_table(text: str, after: str, intervals: bool = False) -> dict[str, list[str]]:
    """The first Markdown table after the line that starts with `after`: first cell -> the rest,
    bold stripped, and intervals too unless `intervals` (`6.54 ± 0.50` -> `6.54`)."""
    lines = text[text.index(after) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:] if intervals else [c.split(" ± ")[0] for c in cells[1:]]
    return rows
