"""One seam per concept: the kind of run is asked of its task or measure, never compared outside them.

Trackers, bench, extend, plans and the tables ask the run's task (its throughput unit, whether
its batches can be cut by length, whether extend fine-tunes it, which settings decide its weights,
which it derived); only posbench/tasks/ and posbench/measures/ may name the kind.
"""

import ast
from pathlib import Path

import pytest

from posbench.config import dump_yaml, flat, identity, load_config
from posbench.errors import PosbenchError
from posbench.measures import measure_for
from posbench.measures.exact_match import ExactMatch
from posbench.measures.perplexity import Perplexity
from posbench.resolve import resolve
from posbench.tasks import CorpusTask, TrainingTask, task_derived, task_for
from posbench.tasks.synthetic import SyntheticTask

PACKAGE = Path(__file__).resolve().parents[1] / "posbench"
KIND_OWNERS = ("tasks", "measures")  # the task and measure packages


def _kind_classes(package: Path) -> set[str]:
    """Every class the task and measure packages define, their interfaces included."""
    names = set()
    for owner in KIND_OWNERS:
        for path in (package / owner).rglob("*.py"):
            names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return names - {"Metric", "Section"}  # what a measure reports, not a kind


def _named(node) -> str:
    """The name a Name or Attribute node ends in ('' for anything else)."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def kind_comparisons(package: Path) -> list[str]:
    """'path:line: what' for every comparison with "lm" or LM and every isinstance (or `is`)
    on a task or measure class in `package`, outside its task and measure packages."""
    kinds = _kind_classes(package)
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in KIND_OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op in list(operands):
                    if isinstance(op, (ast.Tuple, ast.List, ast.Set)):
                        operands += op.elts
                if any(isinstance(o, ast.Constant) and o.value == "lm" or _named(o) == "LM" for o in operands):
                    found.append(f"{rel}:{node.lineno}: compares with the kind lm")
                if any(_named(o) in kinds for o in operands):
                    found.append(f"{rel}:{node.lineno}: compares with a task or measure class")
            elif (
                isinstance(node, ast.Call) and _named(node.func) in ("isinstance", "issubclass") and len(node.args) == 2
            ):
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(_named(c) in kinds for c in classes):
                    found.append(f"{rel}:{node.lineno}: isinstance on a task or measure class")
    return found


def test_no_code_outside_the_task_and_measure_packages_asks_the_kind_of_run():
    assert kind_comparisons(PACKAGE) == []


def test_the_scan_finds_each_way_of_asking_the_kind(tmp_path):
    """The scan above sees a fork on the kind however it is spelled: by name, by class or by attribute."""
    (tmp_path / "measures").mkdir()
    (tmp_path / "measures" / "mine.py").write_text("class Perplexity: ...\nclass ExactMatch: ...\nclass Mine: ...\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "corpus.py").write_text("class CorpusTask: ...\n")
    (tmp_path / "measures" / "ok.py").write_text("x = task == 'lm'\n")  # the measures' own: allowed
    (tmp_path / "forks.py").write_text(
        "a = task == 'lm'\n"
        "b = run.get('task') in (None, LM)\n"
        "c = isinstance(measure, Perplexity)\n"
        "d = isinstance(m, (int, mine.Mine))\n"
        "e = type(m) is ExactMatch\n"
        "f = task == 'copy' and isinstance(x, dict)\n"  # neither: not a fork on the kind
        "g = isinstance(t, CorpusTask)\n"
    )
    assert kind_comparisons(tmp_path) == [
        "forks.py:1: compares with the kind lm",
        "forks.py:2: compares with the kind lm",
        "forks.py:3: isinstance on a task or measure class",
        "forks.py:4: isinstance on a task or measure class",
        "forks.py:5: compares with a task or measure class",
        "forks.py:7: isinstance on a task or measure class",
    ]


def _resolved(task=None, *sets):
    values = {"task": (f"--task {task}", task)} if task else {}
    return resolve(load_config(None, list(sets), values))


@pytest.mark.parametrize(
    "task,sets,want",
    [
        (None, ["train.batch_size=8", "model.train_len=32"], (8 * 32, "tokens_per_s")),
        ("copy", ["train.batch_size=8"], (8, "instances_per_s")),
        ("reverse", [], (64, "instances_per_s")),  # the task's own batch size
    ],
)
def test_a_task_names_what_one_training_step_processes_and_its_unit(task, sets, want):
    exp = _resolved(task, *sets)
    assert exp.task.throughput(exp.cfg) == want


class _Recorded:
    def __init__(self):
        self.points = []

    def scalars(self, axis, x, values):
        self.points.append((axis, x, values))


@pytest.mark.parametrize(
    "task,per_step,unit", [(None, 8 * 32, "train/tokens_per_s"), ("copy", 8, "train/instances_per_s")]
)
def test_trackers_send_the_throughput_the_runs_task_names(task, per_step, unit):
    import yaml

    from posbench.trackers import _send_training

    cfg = _resolved(task, "train.batch_size=8", *(["model.train_len=32"] if task is None else [])).cfg
    config = yaml.safe_load(dump_yaml(cfg))  # as send_run reads a run's config.yaml
    log = [
        {"step": 0, "loss": 3.0, "lr": 1e-3, "seconds": 1.0},
        {"step": 10, "loss": 2.0, "lr": 1e-3, "seconds": 5.0},
        {"step": 20, "loss": 1.5, "lr": 5e-4, "seconds": 5.0},  # no time passed: no rate
    ]
    run = _Recorded()
    _send_training(run, config, log)
    assert [(axis, x) for axis, x, _ in run.points] == [("step", 0), ("step", 10), ("step", 20)]
    assert run.points[0][2] == {"train/loss": 3.0, "train/lr": 1e-3}
    assert run.points[1][2] == {"train/loss": 2.0, "train/lr": 1e-3, unit: per_step * 10 / 4.0}
    assert run.points[2][2] == {"train/loss": 1.5, "train/lr": 5e-4}


def test_bench_task_asks_the_task_whether_its_batches_can_be_cut():
    assert CorpusTask().padding_benchmark() == "a corpus's batches are all one length; give a task, e.g. --task copy"
    assert task_for(_resolved("copy").cfg).padding_benchmark() is None

    class Other(TrainingTask):
        name = "other"

    assert (
        Other().padding_benchmark() == "a run of task other has no batches cut by length; give a task, e.g. --task copy"
    )


def test_extend_asks_the_task_whether_it_fine_tunes_its_runs():
    lm, copy = _resolved().cfg, _resolved("sort").cfg
    assert CorpusTask().not_extendable(lm) is None
    assert isinstance(task_for(copy), SyntheticTask)
    assert task_for(copy).not_extendable(copy) == "a run of task 'sort'; extend fine-tunes language models (task lm)"


def test_a_task_names_the_measure_its_runs_are_scored_by():
    lm, copy = _resolved().cfg, _resolved("sort").cfg
    assert isinstance(measure_for(lm), Perplexity) and isinstance(task_for(lm).measure(), Perplexity)
    assert isinstance(measure_for(copy), ExactMatch) and measure_for(copy).task.name == "sort"


def test_extend_refuses_a_task_run_in_the_tasks_words(tmp_path):
    from posbench.extend.methods import METHODS
    from posbench.extend.run import plan_extension

    rdir = tmp_path / "sort" / "nope-seed0"
    rdir.mkdir(parents=True)
    cfg = _resolved("sort", "schemes=[nope]").cfg.for_run("nope", 0)
    (rdir / "config.yaml").write_text(dump_yaml(cfg))
    (rdir / "model.pt").write_bytes(b"")  # finished, as parents_in reads it; refused before it is loaded
    with pytest.raises(PosbenchError) as e:
        plan_extension(rdir, 100, [METHODS["plain"]], steps=10)
    assert str(e.value) == f"{rdir}: a run of task 'sort'; extend fine-tunes language models (task lm)"


def _flat(task, **options):
    cfg = _resolved(task, *[f"task_options.{k}={v}" for k, v in options.items()]).cfg
    return flat(identity(cfg))


@pytest.mark.parametrize(
    "task,options,key,derived",
    [
        ("copy", {}, "model.train_len", True),  # a task's train_len is its longest training instance
        ("copy", {}, "task_options.test_max", True),  # None resolves to 2 train_max = 40
        ("copy", {"train_max": 10}, "task_options.test_max", True),  # 20: still 2 train_max
        ("copy", {"test_max": 50}, "task_options.test_max", False),  # chosen
        ("copy", {}, "task_options.train_max", True),  # the default, 20
        ("copy", {"train_max": 10}, "task_options.train_max", False),
        ("copy", {"test_count": 50}, "task_options.test_count", True),  # given, but the default
        ("copy", {}, "train.lr", False),  # a recipe key: not a task option
        (None, {}, "model.train_len", False),  # lm's train_len is the user's
        ("copy", {}, "task_options.no_such", False),  # not in the run
    ],
)
def test_a_task_says_which_of_a_runs_settings_it_derived(task, options, key, derived):
    run = _flat(task, **options)
    assert key in run or key == "task_options.no_such"
    assert task_derived(run, key) is derived


def test_test_max_derived_is_checked_against_the_runs_own_train_max():
    run = _flat("copy", train_max=10)
    assert run["task_options.test_max"] == 20 and run["task_options.train_max"] == 10
    assert task_derived({**run, "task_options.test_max": 40}, "task_options.test_max") is False


def test_bench_resolves_what_a_config_trains_and_not_how_it_is_scored():
    """bench times training and scoring at lengths of its own: a train_len past the config's
    eval.lengths is no error there, and its eval section is left as given."""
    from posbench.resolve import resolve_training

    sets = ["model.train_len=1024"]
    with pytest.raises(PosbenchError, match=r"eval.lengths \[100, 125, 150, 200\] are shorter"):
        resolve(load_config(None, sets, {}))
    exp = resolve_training(load_config(None, sets, {}))
    assert (exp.cfg.model.train_len, exp.cfg.train.steps, exp.cfg.eval.lengths) == (1024, 500, [100, 125, 150, 200])


def test_every_module_opens_with_one_line_on_what_room_it_is():
    """Each module opens with a docstring whose first line, a sentence of its own, says what room
    the module is; detail follows after a blank line."""
    for path in sorted((Path(__file__).parent.parent / "posbench").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert doc, f"{path}: no module docstring"
        first = doc.split("\n\n")[0].strip()
        assert "\n" not in first and first[-1] in ".?", f"{path}: its first line is not a sentence of its own"
