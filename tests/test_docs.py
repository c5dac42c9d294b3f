"""The help, the README and the Makefile say what the code does."""

import shutil

import pytest
from conftest import folded, invoke


def test_help_offers_only_input_that_is_taken_and_names_the_length_defaults():
    """--protocol takes a comma list (no `both`), --compile is a flag and says so when
    given a value, and extrapolate's help names where its lengths come from."""
    import subprocess
    import sys

    from posbench.config import EvalConfig, ModelConfig, length_grid

    text = folded(invoke("extrapolate", "--help").output)
    assert "or both" not in text and "nonoverlapping,sliding" in text
    L, grid = ModelConfig().train_len, ",".join(map(str, length_grid(100, 200)))
    assert f"(default: model.train_len, {L})" in text
    assert f"(default: eval.lengths, {','.join(map(str, EvalConfig().lengths))})" in text
    assert f"scores L and 1/4, 1/2 and all of the way to N (--test-len 200 from 100: {grid})" in text
    for command in ("extrapolate", "train"):
        help_lines = invoke(command, "--help").output.splitlines()
        compile_line = next(line for line in help_lines if "--compile" in line)
        assert "<bool>" not in compile_line and "no value" in folded("\n".join(help_lines)), compile_line
    args = [sys.executable, "-m", "posbench.cli", "train", "--compile", "true"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--compile take no value" in lines[0], res.stderr


def test_readme_says_what_a_run_folder_holds(smoke):
    """The files the README lists in a run folder are the ones a run writes;
    positions.png is the experiment's, never a run's."""
    import re

    from conftest import ROOT

    from posbench.measures.exact_match import ExactMatch

    readme = (ROOT / "README.md").read_text()
    exp, _, _ = smoke
    written = {p.name for p in (exp / "alibi-seed0").iterdir() if not p.name.startswith(".")}
    listed = readme[readme.index("a folder per run") :].split("\n\n")[0]
    named = set(re.findall(r"`(\w+(?:\.\w+)+)`", listed))
    assert written <= named and named - written == set(ExactMatch.records) - written, (named, written)
    for at in [m.start() for m in re.finditer(r"`positions\.png`", readme)]:
        before = readme[max(0, at - 60) : at]
        assert "experiment's" in before or "run" not in before, before


def test_docs_count_the_hooks_name_the_interval_and_state_the_length_rule():
    """The hook table and its sentence agree, default.yaml names the interval the tables
    print, and the README states how --test-len picks lengths, not only an example."""
    import pandas as pd
    from conftest import ROOT

    from posbench.config import length_grid
    from posbench.measures.perplexity.views import spread_note
    from posbench.schemes import PositionalScheme

    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs" / "extending.md").read_text()
    section = guide[guide.index("## Write your own scheme") :].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    hooks = [line.split("`")[1].split("(")[0] for line in rows]
    assert all(callable(getattr(PositionalScheme, h, None)) for h in hooks), hooks
    intro = folded(section.split("| hook |")[0])
    required = [r for r in rows if "optional" not in r]
    words = {3: "three", 4: "four"}
    assert f" {words[len(required)]} hooks" in intro and "up to" not in intro, intro
    assert ("optional" in intro) == (len(required) < len(rows)), intro
    seeds_line = next(line for line in (ROOT / "configs" / "default.yaml").read_text().splitlines() if "seeds:" in line)
    assert "mean ± 95%" in spread_note({"x": pd.DataFrame({"seeds": [2]})})
    assert "mean ± 95% interval" in seeds_line and "std" not in seeds_line, seeds_line
    assert length_grid(100, 200) == [100, 125, 150, 200]
    text = folded(readme)
    assert "`--test-len N` scores the training length L" in text and "1/4, 1/2 and all of the way from L to N" in text
    assert "`--test-len 200` scores 100, 125, 150, 200" in text


def test_bench_quick_says_its_timings_are_rough(tmp_path, small_peak):
    """One round cannot be compared; the README and the command both say so."""
    from conftest import ROOT

    from posbench.bench import BenchSettings

    res = invoke("bench", "--quick", "--schemes", "nope", "--out", tmp_path / "bench.csv")
    assert res.exit_code == 0, res.output
    quick = BenchSettings.quick()
    assert f"note: --quick timed {quick.rounds} rounds at batch {quick.batch_size}" in folded(res.output), res.output
    readme = folded((ROOT / "README.md").read_text())
    assert f"`--quick` times {quick.rounds} short rounds, too few to compare schemes" in readme


def test_make_installs_the_test_extra_only_for_test_and_lint():
    """`make extrapolate` (and smoke) install the package alone; test and lint add `.[test]`."""
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


def test_extrapolate_help_names_every_registered_task():
    """--task's help is the registry's list, so a task added is a task listed."""
    from conftest import invoke

    from posbench.tasks import TASKS

    res = invoke("extrapolate", "--help")
    text = "".join(res.output.split())
    assert res.exit_code == 0 and all(name in text for name in TASKS), res.output


def test_readme_counts_the_built_in_schemes_patterns_and_scalings():
    """The README's opening counts are the registries': every built-in scheme, every preset
    pattern, and the evaluation-time scalings a posbench run can take (longrope is a pretrained
    model's only)."""
    from conftest import ROOT

    from posbench.schemes import PATTERNS, SCHEMES
    from posbench.schemes.rope import ROPE_SCALINGS

    words = dict(enumerate("zero one two three four five six seven eight nine ten eleven twelve".split()))
    words |= {13: "thirteen", 14: "fourteen", 15: "fifteen", 16: "sixteen", 17: "seventeen", 18: "eighteen"}
    words |= {19: "nineteen", 20: "twenty"}
    opening = folded((ROOT / "README.md").read_text().split("## Quick start")[0]).lower()
    scalings = [v for v in ROPE_SCALINGS if v not in (None, "longrope")]
    assert f"{words[len(SCHEMES)]} schemes and {words[len(PATTERNS)]} layer patterns are built in" in opening
    assert f"rope has {words[len(scalings)]} evaluation-time scalings (and longrope for pretrained" in opening


def test_the_benchmark_table_is_the_committed_bench():
    """Every number in docs/results.md's benchmark table is results/reference-bench/bench.csv's,
    rounded as the table shows it, and the range of the rest spans the other schemes."""
    import csv

    from conftest import RESULTS_DOC, ROOT

    rows = list(csv.DictReader(open(ROOT / "results" / "reference-bench" / "bench.csv")))
    train = {r["scheme"]: r for r in rows if r["measurement"] == "train"}
    memory = {
        r["scheme"]: float(r["peak_mem_mb"]) for r in rows if r["measurement"] == "eval" and r["eval_len"] == "6400"
    }
    section = RESULTS_DOC.read_text().split("## Speed and memory")[1]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    shown = {cells[0]: cells for cells in table[1:]}
    for scheme, cells in shown.items():
        if scheme == "(the rest)":
            continue
        r = train[scheme]
        assert cells[1:] == [
            f"{float(r['tokens_per_s']):.0f}",
            f"{float(r['ratio_vs_nope']):.2f}",
            f"{float(r['peer_tokens_per_s']):.0f}",
            f"{float(r['peer_ratio']):.2f}",
            f"{memory[scheme]:.0f}",
        ], scheme
    rest = [s for s in train if s not in shown]
    low = min(rest, key=lambda s: float(train[s]["ratio_vs_nope"]))
    high = max(rest, key=lambda s: float(train[s]["ratio_vs_nope"]))
    most = max(rest, key=lambda s: memory[s])
    r = shown["(the rest)"]
    ratio = lambda s: f"{float(train[s]['ratio_vs_nope']):.2f}"  # noqa: E731
    assert r[2] == f"{ratio(low)} ({low}) to {ratio(high)} ({high})"
    assert r[5] == f"at most {memory[most]:.0f} ({most})"
