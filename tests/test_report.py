"""Reports: the tables, intervals and marks they hold, their LaTeX, joined experiments, and
reports rebuilt from the records on disk."""

import json
import math
import re
import shutil
import socket
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import RESULTS_DOC, ROOT, SMOKE, invoke, markdown_table, rebuilds_byte_for_byte, report_refused

from posbench.compare.render import latex_table, transposed
from posbench.measures.perplexity.views import comparison, grid, with_metric
from posbench.schemes import SEED_SCHEMES
from posbench.stats import t_quantile

FIVE_TASKS = ("repeat", "replace", "copy", "reverse", "sort")  # the task reference's, in its order


def _rows():
    rows = []
    for scheme, base in (("alibi", 6.0), ("rope", 6.2)):
        for seed in (0, 1, 2):
            for L, grow in ((100, 1.0), (200, 1.3 if scheme == "rope" else 0.99)):
                ppl = base * grow + 0.01 * seed
                rows.append(
                    {
                        "scheme": scheme,
                        "seed": seed,
                        "train_len": 100,
                        "length": L,
                        "protocol": "nonoverlapping",
                        "stride": "",
                        "loss": math.log(ppl),
                        "ppl": ppl,
                        "tokens": 1000,
                        "status": "ok",
                        "attention": "native",
                    }
                )
    return pd.DataFrame(rows)


def test_the_table_holds_means_intervals_marks_and_the_chosen_metric():
    table = comparison(with_metric(_rows(), "ppl"))
    assert table.loc["alibi", 100] == pytest.approx(6.01) and table.loc["alibi", "ci 100"] == pytest.approx(
        t_quantile(0.975, 2) * 0.01 / math.sqrt(3)
    )
    assert table.loc["alibi", "best 200"] and not table.loc["rope", "best 200"]
    ratio = comparison(with_metric(_rows(), "ratio"))
    assert ratio.loc["rope", 200] == pytest.approx(1.3, abs=0.01) and ratio.loc["alibi", 100] == pytest.approx(1.0)
    loss = comparison(with_metric(_rows(), "loss"))
    assert loss.loc["alibi", 100] == pytest.approx(sum(math.log(6.0 + 0.01 * s) for s in range(3)) / 3)


@pytest.mark.parametrize("transpose", [False, True])
def test_latex_is_booktabs_with_balanced_environments_and_the_right_columns(transpose):
    df = with_metric(_rows(), "ppl")
    rows, best = grid(comparison(df), 100, "ppl")
    if transpose:
        rows, best = transposed(rows, best)
    text = "\n".join(latex_table(rows, best, "perplexity per byte, mean $\\pm$ 95\\% interval"))
    assert text.count("\\begin{") == text.count("\\end{") == 2
    for word in ("\\toprule", "\\midrule", "\\bottomrule"):
        assert text.count(word) == 1
    spec = re.search(r"\\begin\{tabular\}\{(\w+)\}", text).group(1)
    body = [line for line in text.splitlines() if line.endswith("\\\\")]
    assert all(line.count(" & ") == len(spec) - 1 for line in body)
    assert len(spec) == (1 + 2 if transpose else 1 + 2 + 2)  # length, 2 schemes; or scheme, 2 lengths, seeds, ratio
    assert "\\textbf{5.99" not in text and "\\textbf{" in text and "$\\pm$" in text


@pytest.mark.plots
def test_report_joins_experiments_and_refuses_ones_that_do_not_compare(tmp_path, corpus_file):
    common = ["--config", SMOKE, "--set", f"out_dir={tmp_path}", "--set", f"data.path={corpus_file}"]
    assert invoke("extrapolate", *common, "--schemes", "alibi", "--set", "name=a").exit_code == 0
    assert invoke("extrapolate", *common, "--schemes", "rope", "--set", "name=b").exit_code == 0
    res = invoke("report", tmp_path / "a", tmp_path / "b", "--metric", "ratio", "--transpose")
    assert res.exit_code == 0, res.output
    joined = tmp_path / "a+b"
    text = (joined / "summary-ratio-transposed.md").read_text()  # a view, named for what it shows
    assert "| length | alibi | rope |" in text and "perplexity over its perplexity at the training length" in text
    for name in ("summary-ratio-transposed.csv", "summary-ratio-transposed.tex", "summary-ratio-transposed.png"):
        assert (joined / name).is_file(), name
    assert invoke("report", tmp_path / "a", tmp_path / "b").exit_code == 0
    for name in ("summary.md", "summary.csv", "summary.tex", "summary.png", "positions.png", "training.png"):
        assert (joined / name).is_file(), name
    # another training length, or other protocols: one line, nothing written
    assert (
        invoke(
            "extrapolate",
            *common,
            "--schemes",
            "rope",
            "--set",
            "name=c",
            "--set",
            "model.train_len=24",
            "--lengths",
            "24,48",
        ).exit_code
        == 0
    )
    assert (
        invoke("extrapolate", *common, "--schemes", "rope", "--set", "name=d", "--protocol", "sliding").exit_code == 0
    )
    for other, what in (("c", "training lengths differ (32 against 24)"), ("d", "protocols differ")):
        res = invoke("report", tmp_path / "a", tmp_path / other)
        assert res.exit_code == 2 and "Traceback" not in res.output
        assert f"cannot join a and {other}: their {what}" in " ".join(res.output.split())
        assert not (tmp_path / f"a+{other}").exists()
    res = invoke("report", tmp_path / "a", "--metric", "bits")
    assert res.exit_code == 2 and "--metric bits: expected one of ppl, loss, ratio" in res.output


def test_one_seed_says_there_is_no_interval(tmp_path, corpus_file):
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0
    assert "1 seed: no interval; use --seeds 0,1,2" in (tmp_path / "smoke" / "summary.md").read_text()


def test_the_committed_reference_rebuilds_to_its_committed_summary(tmp_path):
    """results/reference holds the records of configs/reproduce-alibi.yaml (no weights): a fresh
    report of them gives the committed tables, digit for digit."""

    committed = rebuilds_byte_for_byte("reference", tmp_path)
    runs = sorted(p.name for p in committed.iterdir() if p.is_dir())
    assert runs == [f"{s}-seed{n}" for s in ("alibi", "rope", "sinusoidal", "t5") for n in (0, 1, 2)]
    for run in runs:
        assert {"config.yaml", "eval.csv", "positions.csv.gz", "train_log.jsonl"} <= {
            p.name for p in (committed / run).iterdir()
        }


def _recipe(config: dict, keys) -> dict:
    """The training keys of a run's config.yaml named in `keys` (a task's budget: train.* and
    the model's n_layer)."""
    trained = {**config["train"], "n_layer": config["model"]["n_layer"]}
    return {k: trained[k] for k in keys}


def test_the_committed_task_reference_rebuilds_to_its_committed_summary(tmp_path):
    """results/reference-tasks holds the records of configs/reproduce-tasks.yaml (no weights):
    five schemes x three seeds x five tasks, each at its task's default recipe and T5 setup, RoPE
    rotating a quarter of each head, all on one device class (a CPU in fp32: the native backend),
    and a fresh report of them gives the committed tables digit for digit, the mean reciprocal
    rank included."""
    import yaml

    from posbench.tasks import TASKS

    committed = rebuilds_byte_for_byte("reference-tasks", tmp_path)
    assert "## mean reciprocal rank past N over 15 (grid point, seed) pairs" in (committed / "summary.md").read_text()
    runs = [p for p in committed.iterdir() if p.is_dir()]
    configs = [yaml.safe_load((p / "config.yaml").read_text()) for p in runs]
    made = {(c["task"], c["model"]["scheme"], c["seeds"][0]) for c in configs}
    for c in configs:
        budget, setup = TASKS[c["task"]].budget, TASKS[c["task"]].scheme_setup.get(c["model"]["scheme"], {})
        assert _recipe(c, budget) == budget, c["task"]
        assert {k: c["model"]["options"][k] for k in setup} == setup, c["model"]["scheme"]  # T5's as tasks set it
    schemes = ("nope", "t5", "alibi", "rope", "sinusoidal")
    assert len(runs) == 75 and made == {(t, s, n) for t in FIVE_TASKS for s in schemes for n in (0, 1, 2)}
    for run in runs:
        assert {"config.yaml", "eval.csv", "samples.txt", "train_log.jsonl"} <= {p.name for p in run.iterdir()}
    assert all(c["model"]["options"]["fraction"] == 0.25 for c in configs if c["model"]["scheme"] == "rope")
    backends = {r["attention"] for run in runs for r in pd.read_csv(run / "eval.csv").to_dict("records")}
    assert backends == {"native"} and {c["train"]["device"] for c in configs} == {"auto"}


def test_the_task_reference_config_plans_the_committed_runs():
    """`make reproduce-tasks` plans the committed folders, hash for hash: the committed runs were
    trained at each task's default recipe, which the config leaves to the tasks."""
    from conftest import ROOT

    from posbench.config import load_sweep
    from posbench.experiment.plan import plan_sweep
    from posbench.resolve import resolve

    grid = [(settings, resolve(cfg)) for settings, cfg in load_sweep(ROOT / "configs" / "reproduce-tasks.yaml")]
    _, jobs = plan_sweep(grid)
    committed = {p.name for p in (ROOT / "results" / "reference-tasks").iterdir() if p.is_dir()}
    assert {job.folder.name for job in jobs} == committed


def test_the_recipe_check_config_plans_every_seed_scheme_seed_and_task_at_each_tasks_recipe():
    """configs/recipe-check.yaml: 8 schemes x 3 seeds x 4 tasks, each run at its task's own
    recipe, as a run that sets nothing gets it."""
    from conftest import ROOT

    from posbench.config import load_sweep
    from posbench.experiment.plan import plan_sweep
    from posbench.resolve import resolve
    from posbench.tasks import TASKS

    grid = [(settings, resolve(cfg)) for settings, cfg in load_sweep(ROOT / "configs" / "recipe-check.yaml")]
    _, jobs = plan_sweep(grid)
    assert len(jobs) == 96 and len({job.folder.name for job in jobs}) == 96
    for _, exp in grid:
        cfg, budget = exp.cfg, TASKS.lookup(exp.cfg.task).budget
        got = {**vars(cfg.train), "n_layer": cfg.model.n_layer}
        assert {k: got[k] for k in budget} == budget, cfg.task
    assert {exp.cfg.task for _, exp in grid} == {"repeat", "replace", "copy", "reverse"}
    assert sorted(grid[0][1].cfg.schemes) == sorted(SEED_SCHEMES) and grid[0][1].cfg.seeds == [0, 1, 2]


RECIPE_SEARCH = ROOT / "results" / "recipe-search"
RECIPES = yaml.safe_load((RECIPE_SEARCH / "recipes.yaml").read_text())  # what each folder there holds


def test_every_folder_of_runs_in_the_recipe_search_has_its_entry():
    """results/recipe-search/recipes.yaml names every folder there that holds runs, and only
    those: a folder committed without an entry fails here rather than going unchecked."""
    folders = {run.parent.parent.relative_to(RECIPE_SEARCH).as_posix() for run in RECIPE_SEARCH.rglob("config.yaml")}
    assert folders == set(RECIPES["tasks"]) | set(RECIPES["language_models"])


@pytest.mark.parametrize("name", list(RECIPES["tasks"]))
def test_the_committed_recipe_search_rebuilds_and_was_trained_at_its_recipe(tmp_path, name):
    """results/recipe-search holds the runs that chose the tasks' recipe (docs/tasks.md), each
    folder described by its entry in recipes.yaml: gpu-* on a GPU, cpu-* on this CPU; copy at
    2,000 to 8,000 steps, reverse at 4,000 to 8,000, repeat and replace at theirs, a higher and a
    lower lr (gpu-b, gpu-c-replace-lr), T5 and hybrid with their table started at zero where and
    only where the entry says so (cpu-flat/*, and the runs since tasks set T5 up), and the
    reference's T5 runs at the language model's T5 setup (gpu-t5-xtransformers). Their tables
    rebuild from the records, and each record was trained at the recipe its entry names."""
    entry = RECIPES["tasks"][name]
    committed = rebuilds_byte_for_byte(f"recipe-search/{name}", tmp_path)
    configs = [yaml.safe_load((p / "config.yaml").read_text()) for p in committed.iterdir() if p.is_dir()]
    made, seeds = entry["made"], entry["seeds"]
    assert {(c["task"], c["model"]["scheme"], c["seeds"][0]) for c in configs} == {
        (t, s, n) for t, schemes in made.items() for s in schemes for n in seeds
    }
    bias_tables = {"t5", "hybrid"} & {s for schemes in made.values() for s in schemes}
    assert ("flat_start" in entry) == bool(bias_tables)  # said where, and only where, it applies
    for c in configs:
        want = entry["by_task"][c["task"]] if "by_task" in entry else entry["recipe"]
        assert _recipe(c, want) == want and c["train"]["device"] == ("cuda" if name.startswith("gpu-") else "auto")
        scheme, options = c["model"]["scheme"], c["model"]["options"]
        flat = options.get("init") == "zeros"  # the T5 table started at zero
        if scheme in bias_tables:  # as cpu-flat set it, and as the tasks' setup gives it
            assert flat == entry["flat_start"], scheme
        assert not flat or options["scale"] == "none"
        if scheme in entry.get("options", {}):  # the options it recorded, e.g. sinusoidal's scale then
            assert options == entry["options"][scheme], scheme


@pytest.mark.parametrize("name", list(RECIPES["language_models"]))
def test_the_committed_flat_start_language_models_rebuild_and_record_their_start(tmp_path, name):
    """results/recipe-search/lm-flat: T5 and hybrid on the default language model with the bias
    table started at zero (docs/tasks.md, "The recipe"); each rebuilds, records that start at the
    scale its entry in recipes.yaml names, and trained as the reference it names did, but for the
    scheme's options."""
    entry = RECIPES["language_models"][name]
    committed = rebuilds_byte_for_byte(f"recipe-search/{name}", tmp_path)
    for run in (p for p in committed.iterdir() if p.is_dir()):
        c = yaml.safe_load((run / "config.yaml").read_text())
        ref = yaml.safe_load((ROOT / "results" / entry["reference"] / run.name / "config.yaml").read_text())
        assert c["model"]["options"]["init"] == "zeros" and ref["model"]["options"]["init"] == "normal"
        assert c["model"]["options"]["scale"] == entry["scale"]
        recipe = ("steps", "batch_size", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip")
        assert [c["train"][k] for k in recipe] == [ref["train"][k] for k in recipe]
        assert c["data"] == ref["data"] and c["eval"] == ref["eval"]


@pytest.mark.parametrize("name,tokenizer", [("reference-bytes", "bytes"), ("reference-bpe", "bpe-2048")])
def test_the_committed_tokenizer_references_rebuild_to_their_committed_summary(tmp_path, name, tokenizer):
    """results/reference-bytes and -bpe hold docs/results.md's tokenizer table: the defaults on bytes
    and on a BPE of 2048 tokens, eight schemes, seed 0; their tables rebuild from the records."""
    import csv

    committed = rebuilds_byte_for_byte(name, tmp_path)
    with (committed / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["tokenizer"] for r in rows} == {tokenizer} and len({r["scheme"] for r in rows}) == 8


def test_the_committed_gpu_reference_rebuilds_and_is_the_presets_study(tmp_path):
    """results/reference-gpu holds the records of configs/gpu-study.yaml as it stands (no
    weights): five schemes x its seeds, each run's config the preset's, trained and scored on
    CUDA through the backend `auto` gives its scheme there (flex for a table over distances);
    every run learned (perplexity at the training length far below the 16,384 of guessing) and
    a fresh report gives the committed tables digit for digit."""
    import dataclasses

    from posbench.config import config_from_dict, load_config, read_record
    from posbench.schemes import SCHEMES

    committed = rebuilds_byte_for_byte("reference-gpu", tmp_path)
    preset = load_config(ROOT / "configs" / "gpu-study.yaml", [])
    runs = sorted(p.name for p in committed.iterdir() if p.is_dir())
    assert runs == sorted(f"{s}-seed{n}" for s in preset.schemes for n in preset.seeds)
    want = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(preset)))
    for run in runs:  # read as posbench reads a record: a key added since, at its default
        config = dataclasses.asdict(config_from_dict(read_record(committed / run / "config.yaml")))
        for part in ("train", "data", "eval"):
            assert config[part] == want[part], (run, part)
        resolved = {**want["model"], "scheme": config["model"]["scheme"], "vocab_size": preset.data.vocab_size}
        assert {**config["model"], "options": {}} == resolved, run  # options: the scheme's defaults
        assert config["model"]["options"].items() <= SCHEMES[config["model"]["scheme"]].options.items(), run
        rows = pd.read_csv(committed / run / "eval.csv")
        runs_as = "flex" if config["model"]["scheme"] in ("alibi", "t5") else "sdpa"
        assert set(rows.attention) == {runs_as} and set(rows.status) == {"ok"}, run
        assert rows.set_index("length").ppl[preset.model.train_len] < 200, run
    assert "GPU: one NVIDIA H200" in (committed / "command.txt").read_text()
    readme = _table(RESULTS_DOC.read_text(), "## GPT-2-small's shape on one GPU")
    summary = _table((committed / "summary.md").read_text(), "## nonoverlapping")
    assert len(readme) == 5 and readme == {s: cells[:4] + cells[5:6] for s, cells in summary.items()}


def _tokens_per_s(run: Path) -> float:
    """A run's training speed from its log: the tokens of the steps after step 10 over their seconds."""
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    config = yaml.safe_load((run / "config.yaml").read_text())
    tokens = config["train"]["batch_size"] * config["model"]["train_len"]  # a step's
    (first,), last = [r for r in log if r["step"] == 10], log[-1]
    return (last["step"] - 10) * tokens / (last["seconds"] - first["seconds"])


def test_the_gpu_speeds_in_the_docs_are_the_studies_training_logs(tmp_path):
    """docs/performance.md's table of the GPU study's speeds (each study's NoPE the ratios' base,
    the mean of its seeds) and docs/results.md's sentence on them come from the committed training
    logs of results/reference-gpu (auto) and -sdpa (every scheme through sdpa), which also
    rebuilds; the two studies' perplexities differ as the docs say."""
    rebuilds_byte_for_byte("reference-gpu-sdpa", tmp_path)
    speed, backend = {}, {}
    for name in ("reference-gpu-sdpa", "reference-gpu"):
        folder = ROOT / "results" / name
        for scheme in ("nope", "rope", "alibi", "t5", "fire"):
            runs = [folder / f"{scheme}-seed{n}" for n in (0, 1)]
            speed[name, scheme] = sum(map(_tokens_per_s, runs)) / 2
            backend[name, scheme] = pd.read_csv(runs[0] / "eval.csv").attention[0]
    docs = _table((ROOT / "docs" / "performance.md").read_text(), "| scheme | all sdpa: tokens/s")
    want = {}
    for scheme in ("nope", "rope", "alibi", "t5", "fire"):
        cells = []
        for name in ("reference-gpu-sdpa", "reference-gpu"):
            cells += [backend[name, scheme]] if name == "reference-gpu" else []
            cells += [f"{speed[name, scheme]:,.0f}", f"{speed[name, scheme] / speed[name, 'nope']:.2f}"]
        want[scheme] = cells
    assert docs == want and {backend["reference-gpu-sdpa", s] for s in want} == {"sdpa"}
    readme = " ".join(RESULTS_DOC.read_text().split())
    x = {s: f"{speed['reference-gpu', s] / speed['reference-gpu', 'nope']:.2f}x" for s in want}
    assert f"NoPE trains at {speed['reference-gpu', 'nope'] / 1000:.0f}k tokens/s through sdpa" in readme
    assert f"ALiBi at {x['alibi']} of that and T5 at {x['t5']} through flex" in readme
    assert f"RoPE at {x['rope']} and FIRE at {x['fire']} through sdpa" in readme
    a, b = (
        pd.read_csv(ROOT / "results" / n / "summary.csv").set_index(["scheme", "seed", "length"])
        for n in ("reference-gpu", "reference-gpu-sdpa")
    )
    apart = sorted(((a.ppl / b.ppl - 1).abs() * 100).items(), key=lambda kv: kv[1])
    (scheme, seed, length), most = apart[-1]
    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    assert f"by at most {most:.1f}% in one run at one length ({scheme}, seed {seed}, {length:,})" in text.lower()
    assert f"and by at most {apart[-2][1]:.1f}% everywhere else" in text


def test_the_gpu_schedule_at_toy_scale_rebuilds_and_is_what_the_docs_read(tmp_path):
    """results/reference-gpu-toy: the defaults, the GPU study's schedule, and that with the
    schemes' own parameters at 10x the rate, 5 schemes x 3 seeds each, and T5 and FIRE at 30x and
    100x; each rebuilds from its
    records, each ran the schedule it is named for, and the perplexities at 100 bytes that
    docs/performance.md tabulates and docs/results.md quotes are theirs."""
    from types import SimpleNamespace

    from posbench.config import TrainConfig, load_config
    from posbench.train import lr_at

    gpu = load_config(ROOT / "configs" / "gpu-study.yaml", []).train
    schedule = ("lr", "min_lr", "steps", "warmup_steps")
    at_100, rates = {}, {}
    for name, mult in (("defaults", 1), ("gpu-schedule", 1), ("gpu-schedule-scheme-lr10", 10)):
        committed = rebuilds_byte_for_byte(f"reference-gpu-toy/{name}", tmp_path)
        runs = sorted(p.name for p in committed.iterdir() if p.is_dir())
        assert runs == sorted(f"{s}-seed{n}" for s in ("nope", "t5", "rope", "alibi", "fire") for n in (0, 1, 2))
        for run in runs:
            train = yaml.safe_load((committed / run / "config.yaml").read_text())["train"]
            ran = [train[k] for k in schedule]
            assert (ran == [getattr(gpu, k) for k in schedule]) == (name != "defaults"), run
            if name == "defaults":
                assert (
                    [train[k] for k in ("lr", "min_lr", "warmup_steps")]
                    == [3e-3, 3e-4, 50]
                    == [getattr(TrainConfig(), k) for k in ("lr", "min_lr", "warmup_steps")]
                )
            assert train.get("scheme_lr_mult", 1) == mult, run
            rates[name] = sum(lr_at(n, SimpleNamespace(**train)) for n in range(train["steps"]))
        summary = (committed / "summary.md").read_text()
        assert ("the scheme's own parameters at 10x" in summary) == (mult == 10)  # said beside the rate
        at_100[name] = {s: cells[0] for s, cells in _table(summary, "## ").items()}
    header = f"| scheme | defaults (lr 3e-3, 500 steps; rates add to {rates['defaults']:.2f}) | "
    header += f"the GPU study's schedule ({rates['gpu-schedule']:.3f}) |"
    assert header in (ROOT / "docs" / "performance.md").read_text()
    docs = _table((ROOT / "docs" / "performance.md").read_text(), "| scheme | defaults (lr 3e-3")
    assert docs == {s: [at_100[n][s] for n in at_100] for s in at_100["defaults"]}
    readme = " ".join(RESULTS_DOC.read_text().split())
    fire, t5, nope = (at_100["gpu-schedule"][s] for s in ("fire", "t5", "nope"))
    assert f"FIRE {fire} against NoPE's {nope}" in readme and f"T5 {t5} ± " in readme
    assert f"give FIRE {at_100['defaults']['fire']} and T5 {at_100['defaults']['t5']}" in readme
    faster = at_100["gpu-schedule-scheme-lr10"]
    assert f"FIRE reaches {faster['fire']} and T5 {faster['t5']}" in readme
    assert f"whose rates add to {rates['gpu-schedule']:.3f}" in readme
    # more rate, for the two schemes with parameters of their own: the cells docs read are theirs
    perf = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    for mult, said in ((30, "at 30 times T5 reaches {t5} and FIRE {fire}"), (100, "at 100 times {t5} and {fire}")):
        committed = rebuilds_byte_for_byte(f"reference-gpu-toy/gpu-schedule-scheme-lr{mult}", tmp_path)
        runs = sorted(p.name for p in committed.iterdir() if p.is_dir())
        assert runs == sorted(f"{s}-seed{n}" for s in ("t5", "fire") for n in (0, 1, 2))
        for run in runs:
            train = yaml.safe_load((committed / run / "config.yaml").read_text())["train"]
            assert [train[k] for k in schedule] == [getattr(gpu, k) for k in schedule] and train[
                "scheme_lr_mult"
            ] == mult
        cells = {s: c[0] for s, c in markdown_table((committed / "summary.md").read_text(), "## ", True).items()}
        assert said.format(**cells) in perf
        if mult == 30:
            assert f"and at 30× {cells['fire'].split(' ±')[0]} and {cells['t5'].split(' ±')[0]}" in readme


def test_the_committed_extension_reference_rebuilds_to_its_committed_summary(tmp_path):
    """results/reference-extend holds the records of `make reproduce-extend` (no weights): rope
    trained at 100, 3 seeds, each copied and fine-tuned at 400 with twelve methods (the spelled
    sweeps and the continue control among them); a fresh report gives the committed tables, the
    curve against fine-tuning steps included."""
    import yaml

    committed = rebuilds_byte_for_byte("reference-extend", tmp_path)
    assert "## perplexity at 400 after k fine-tuning steps" in (committed / "summary.md").read_text()
    runs = [p for p in committed.iterdir() if p.is_dir()]
    made = {
        (c["model"]["scheme"], (c["model"]["extend"] or {}).get("method"), c["seeds"][0])
        for c in (yaml.safe_load((p / "config.yaml").read_text()) for p in runs)
    }
    methods = (None, "pi", "pi@2", "pi-keep2", "ntk", "yarn", "yarn-fast8", "abf", "abf-base100000")
    methods += ("abf-base20000", "pose", "plain", "continue")
    assert len(runs) == 39 and made == {("rope", m, n) for m in methods for n in (0, 1, 2)}
    for run in runs:
        assert {"config.yaml", "eval.csv", "parent.txt", "train_log.jsonl"} <= {p.name for p in run.iterdir()}
        child = not run.name.endswith(("seed0", "seed1", "seed2"))  # rope-seed0-yarn, not rope-seed0
        assert (run / "curve.csv").is_file() == child


def test_the_committed_long_extension_rebuilds_and_pi_flattens_inside_it(tmp_path):
    """results/reference-extend-long: pi, pi-keep2 and continue for 400 steps on the same parents.
    PI's curve at 400 has flattened by its end (its last 100 steps gain under 5%), it stays
    behind pi-keep2 at every step, and continuing at 100 leaves 400 where the parent was."""
    committed = rebuilds_byte_for_byte("reference-extend-long", tmp_path)
    md = (committed / "summary.md").read_text()
    curve = {
        line.split("|")[1].strip(): [float(c.strip().strip("*").split(" ± ")[0]) for c in line.split("|")[2:-1]]
        for line in md.split("## perplexity at 400 after k fine-tuning steps")[1].split("\n\n")[1].splitlines()[2:]
    }
    assert set(curve) == {"rope:pi", "rope:pi-keep2", "rope:continue"} and len(curve["rope:pi"]) == 10
    pi, keep, cont = curve["rope:pi"], curve["rope:pi-keep2"], curve["rope:continue"]
    assert pi[-1] < pi[-2] < 1.05 * pi[-1] and all(k < p for k, p in zip(keep, pi))
    assert abs(cont[-1] - cont[0]) < 0.05 * cont[0]
    runs = [p for p in committed.iterdir() if p.is_dir()]
    assert len(runs) == 12 and all((p / "eval.csv").is_file() for p in runs)


@pytest.mark.parametrize("args", [["--seeds", ""], ["--seeds", ","], ["--set", "seeds=[]"]])
def test_an_empty_seed_list_is_one_line_and_writes_nothing(tmp_path, args):
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={tmp_path / 'r'}", *args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "seeds is empty" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def _report_without_torch(folder):
    """`posbench report folder` in a process where `import torch` fails."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import sys; sys.modules['torch'] = None; from posbench.cli import main; "
        f"sys.argv = ['posbench', 'report', {str(folder)!r}]; sys.exit(main())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# the seed schemes; extension's parents, children and their +variants; a pretrained model's +variants
@pytest.mark.parametrize("name", ["reference", "reference-extend", "reference-smollm2"])
def test_the_committed_references_report_without_torch(tmp_path, name):
    """A report is built from the records on disk alone: without torch, a committed reference's
    records give its committed summary.md, rows of evaluation-time variants included."""
    from conftest import ROOT

    committed = ROOT / "results" / name
    copy = tmp_path / name
    shutil.copytree(committed, copy)
    for name in ("summary.csv", "summary.md", "summary.tex"):
        (copy / name).unlink()
    res = _report_without_torch(copy)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (copy / "summary.md").read_text() == (committed / "summary.md").read_text()


def test_an_edge_without_torch_still_knows_memory_errors():
    """The CLI's edge names torch's out-of-memory error only where torch is imported: without
    it (a report), an unexpected error is still its one line, not a failed import."""
    import subprocess
    import sys

    import torch

    from posbench.cli import torch_oom

    assert torch_oom() is torch.OutOfMemoryError
    code = "import sys; sys.modules['torch'] = None; from posbench.cli import torch_oom; print(torch_oom().__name__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "MemoryError", res.stdout + res.stderr


def test_a_task_experiment_reports_without_torch(tmp_path, task_smoke):
    """Without torch, a task's records give the summary.md a report with torch gives."""
    exp = shutil.copytree(task_smoke, tmp_path / "copy")
    with_torch = (exp / "summary.md").read_text()
    for name in ("summary.csv", "summary.md", "summary.tex"):
        (exp / name).unlink()
    res = _report_without_torch(exp)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (exp / "summary.md").read_text() == with_torch


# --- one colour per scheme name, in every plot (issue 30, item 7) -----------------------------


@pytest.fixture
def figures(monkeypatch):
    """Every figure a report writes, by file name, kept for its lines."""
    from posbench.compare import plot

    kept, save = {}, plot.save

    def keep(plt, fig, path):
        kept[path.name] = fig
        return save(plt, fig, path)

    monkeypatch.setattr(plot, "save", keep)  # every figure is drawn there
    return kept


def line_styles(fig) -> dict:
    """label -> (colour, line style) of every labelled line."""
    from matplotlib.colors import to_hex

    return {
        line.get_label(): (to_hex(line.get_color()), line.get_linestyle())
        for ax in fig.axes
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def test_a_scheme_has_one_colour_in_summary_positions_and_training_png(tmp_path, figures):
    from conftest import ROOT

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    res = invoke("report", copy)
    assert res.exit_code == 0, res.output
    summary, positions, training = (line_styles(figures[n]) for n in ("summary.png", "positions.png", "training.png"))
    for s in ("sinusoidal", "t5", "rope", "alibi"):
        assert summary[s][0] == positions[s][0] == training[s][0], (s, summary, positions, training)
    from posbench.compare.plot import colour

    assert summary["alibi"][0] == colour("alibi") and summary["rope"][0] == colour("rope")


def test_positions_png_draws_a_long_window_as_means_of_its_positions_with_the_legend_clear_of_the_right_axis(
    tmp_path, figures
):
    """16,384 positions are drawn as 200 points, each the mean of 82 neighbours at their mean
    position (losses 0, 1, 0, 1...: each bin's mean is 0.5 where it holds as many of each); a
    sliding window's last 25 positions, 775-799 of 800, stay one point each; the legend sits
    right of the grey axis of training pairs, not on its ticks."""
    from posbench.measures.perplexity.views import POSITION_POINTS, plot_positions

    n, seeds = 16384, (0, 1, 2)
    rows = [("alibi", n, "nonoverlapping", "", p, float(p % 2), 8, seed, "") for seed in seeds for p in range(n)]
    pos = pd.DataFrame(
        rows, columns=["scheme", "length", "protocol", "stride", "position", "loss", "tokens", "seed", "point"]
    )
    assert plot_positions(pos, {"": 1024}, tmp_path / "positions.png")
    fig = figures["positions.png"]
    line = next(line for line in fig.axes[0].get_lines() if line.get_label() == "alibi")
    width = math.ceil(n / POSITION_POINTS)
    assert width == 82 and len(line.get_xdata()) == math.ceil(n / width) <= POSITION_POINTS
    assert list(line.get_xdata()[:2]) == [40.5, 122.5] and set(line.get_ydata()[:-1]) == {0.5}
    assert fig.axes[0].get_title().endswith("windows of 16384, means of 82 positions")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the saved figure's canvas is closed
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = fig.axes[0].get_legend() or next(ax.get_legend() for ax in fig.axes if ax.get_legend())
    right = [ax for ax in fig.axes if ax is not fig.axes[0]][-1]  # the grey axis
    assert legend.get_window_extent(renderer).x0 > right.get_tightbbox(renderer).x1

    # sliding, stride 25 over windows of 800: the first window's other positions are too few to draw
    rows = [
        ("alibi", 800, "sliding", "25", p, float(p), 1 if p < 775 else 30, seed, "")
        for seed in seeds
        for p in range(800)
    ]
    pos = pd.DataFrame(
        rows, columns=["scheme", "length", "protocol", "stride", "position", "loss", "tokens", "seed", "point"]
    )
    assert plot_positions(pos, {"": 100}, tmp_path / "positions.png")
    line = next(line for line in figures["positions.png"].axes[0].get_lines() if line.get_label() == "alibi")
    assert list(line.get_xdata()) == list(range(775, 800)) == list(line.get_ydata())


def test_a_task_report_colours_its_schemes_as_a_perplexity_report_does(tmp_path, task_smoke, figures):
    res = invoke("report", shutil.copytree(task_smoke, tmp_path / "copy"))  # draws what extrapolate drew
    assert res.exit_code == 0, res.output
    summary, training = line_styles(figures["summary.png"]), line_styles(figures["training.png"])
    for s in ("nope", "alibi"):
        assert summary[s][0] == training[s][0], (s, summary, training)
    from posbench.compare.plot import colour

    assert summary["alibi"][0] == colour("alibi")  # as in a perplexity report's plots


def test_adding_rope_yarn_recolours_no_other_scheme(tmp_path, figures):
    from posbench.measures.perplexity.views import plot, plot_positions

    def drawn(df):
        table = comparison(with_metric(df, "ppl"))
        plot({"nonoverlapping": table}, tmp_path / "summary.png")
        pos = df.assign(position=df["length"] - 1, point="")  # one position per length will do
        plot_positions(pos, {"": 100}, tmp_path / "positions.png")
        return line_styles(figures["summary.png"]), line_styles(figures["positions.png"])

    before = drawn(_rows())
    rows = _rows()
    yarn = rows[rows["scheme"] == "rope"].assign(scheme="rope+yarn", ppl=lambda r: r["ppl"] * 0.9)
    after = drawn(pd.concat([rows, yarn], ignore_index=True))
    for b, a in zip(before, after):
        assert {s: a[s] for s in ("rope", "alibi")} == {s: b[s] for s in ("rope", "alibi")}, (b, a)
        assert a["rope+yarn"] != a["rope"] and a["rope+yarn"] != a["alibi"]

    import os
    import subprocess
    import sys

    from posbench.compare.plot import colour, style

    assert colour("rope+yarn") == colour("rope") and style("rope+yarn")["linestyle"] != style("rope")["linestyle"]
    kinds = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
    looks = {repr((style(f"rope+{v}"), colour(f"rope+{v}"))) for v in kinds}
    looks |= {repr((style(f"{m}rope"), colour(f"{m}rope"))) for m in ("noisy_", "offset_")}
    assert len(looks) == 8  # each rope variant and modifier looks its own
    plugin = "examples.my_scheme:MyScheme"  # a colour from its name, the same in every process
    for seed in ("1", "2"):
        other = subprocess.run(
            [sys.executable, "-c", f"from posbench.compare.plot import colour; print(colour({plugin!r}))"],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
        )
        assert other.stdout.strip() == colour(plugin), other.stderr


def test_a_95_band_is_drawn_from_three_seeds_not_two(tmp_path, figures):
    """With two seeds Student's t is 12.7 and a band would hide the means: summary.png draws
    each scheme's band with three seeds (the committed reference) and none with two."""
    from conftest import ROOT

    def bands(fig):
        return sum(len(ax.collections) for ax in fig.axes)

    three = tmp_path / "three"
    shutil.copytree(ROOT / "results" / "reference", three)
    assert invoke("report", three).exit_code == 0
    assert bands(figures["summary.png"]) == 2 * 4  # two protocols, four schemes
    two = tmp_path / "two"
    shutil.copytree(three, two)
    for run in two.glob("*-seed2"):
        shutil.rmtree(run)
    assert invoke("report", two).exit_code == 0
    assert bands(figures["summary.png"]) == 0


def _table(text: str, after: str) -> dict[str, list[str]]:
    """The first Markdown table after the line that starts with `after`, intervals stripped."""
    return markdown_table(text, after)


def test_the_language_model_tables_are_the_committed_records():
    """Every number in the three language-model tables is a committed summary's: the README's
    defaults (results/reference-bytes), and docs/results.md's ALiBi reproduction
    (results/reference, both protocols) and bytes against BPE (reference-bytes, reference-bpe)."""
    readme, results = (ROOT / "README.md").read_text(), RESULTS_DOC.read_text()
    summary = {
        n: (ROOT / "results" / n / "summary.md").read_text() for n in ("reference", "reference-bytes", "reference-bpe")
    }
    nonoverlapping = {n: _table(s, "## nonoverlapping") for n, s in summary.items()}
    defaults = _table(readme, "## What the defaults show")
    by_bytes = nonoverlapping["reference-bytes"]
    assert len(defaults) == 8 and defaults == {s: cells[:4] + cells[5:6] for s, cells in by_bytes.items()}
    alibi = _table(results, "## The ALiBi paper's shape")
    sliding = _table(summary["reference"], "## sliding")
    assert len(alibi) == 4 and alibi == {
        s: [f"{a} / {b}" for a, b in zip(cells[:4], sliding[s][:4])] for s, cells in nonoverlapping["reference"].items()
    }
    tokenizers = _table(results, "| scheme | bytes | BPE |")
    bpe = nonoverlapping["reference-bpe"]
    assert len(tokenizers) == 8 and tokenizers == {
        s: [f"{cells[6]} / {cells[7]}", f"{bpe[s][6]} / {bpe[s][7]}", f"{cells[5]} / {bpe[s][5]}"]
        for s, cells in by_bytes.items()
    }


def test_the_task_table_is_the_committed_task_reference():
    """Every number of docs/results.md's task table, the study's in brackets aside, is
    results/reference-tasks' summary: in-distribution / past-N exact match per task, and the mean
    reciprocal rank."""
    readme = _table(RESULTS_DOC.read_text(), "| scheme | repeat | replace | copy | reverse | sort |")
    summary = (ROOT / "results" / "reference-tasks" / "summary.md").read_text()
    by_task = {t: _table(summary, f"## {t}: % exact match by length") for t in FIVE_TASKS}
    rank = _table(summary, "## mean reciprocal rank")
    assert sorted(readme) == sorted(rank) and len(readme) == 5
    for scheme, cells in readme.items():
        ours = [c.split(" [")[0] for c in cells]
        assert ours == [f"{by_task[t][scheme][0]} / {by_task[t][scheme][1]}" for t in FIVE_TASKS] + [rank[scheme][0]]


def test_the_task_docs_reciprocal_rank_table_is_the_committed_task_reference():
    """docs/tasks.md's mean reciprocal rank, "here", is results/reference-tasks' summary, scheme
    for scheme."""
    docs = _table((ROOT / "docs" / "tasks.md").read_text(), "| scheme | here, 5 tasks |")
    summary = (ROOT / "results" / "reference-tasks" / "summary.md").read_text()
    rank = _table(summary, "## mean reciprocal rank")
    assert len(docs) == 5 and {s: cells[0] for s, cells in docs.items()} == {s: rank[s][0] for s in docs}


def _task_reference_runs() -> dict:
    """(task, scheme, seed) -> % exact match of results/reference-tasks' run: in distribution,
    past N, and at each length past N, from its eval.csv alone."""
    runs = {}
    for path in (ROOT / "results" / "reference-tasks").glob("*/eval.csv"):
        d = pd.read_csv(path)
        n = int(d["train_max"].iloc[0])
        pct = lambda part: 100 * part["correct"].sum() / part["instances"].sum()  # noqa: E731
        runs[d["task"].iloc[0], d["scheme"].iloc[0], int(d["seed"].iloc[0])] = {
            "in": pct(d[d["length"] <= n]),
            "out": pct(d[d["length"] > n]),
            **{int(k): pct(g) for k, g in d[d["length"] > n].groupby("length")},
        }
    return runs


def test_the_task_docs_tables_are_the_committed_task_reference_run_by_run():
    """docs/tasks.md's reference tables, derived here from each run's eval.csv: in distribution
    per seed, and past N length by length, the mean of the seeds (the study's brackets aside); a
    row for every task and scheme of the records."""
    runs = _task_reference_runs()
    seeds = sorted({k for _, _, k in runs})
    schemes = {s for _, s, _ in runs}
    docs = (ROOT / "docs" / "tasks.md").read_text()
    per_seed = _table(docs, "| scheme | repeat | replace | copy | reverse | sort |")
    assert set(per_seed) == schemes
    for scheme, cells in per_seed.items():
        assert cells == [" / ".join(f"{runs[t, scheme, k]['in']:.1f}" for k in seeds) for t in FIVE_TASKS]
    by_length = _table(docs, "| task, scheme | in (1-20) |")
    head = docs[docs.index("| task, scheme | in (1-20) |") :].splitlines()[0].strip("|").split("|")[1:]
    columns = ["in" if "in" in h else "out" if "out" in h else int(h) for h in (c.strip() for c in head)]
    assert len(by_length) == len(FIVE_TASKS) * len(schemes)
    for row, cells in by_length.items():
        task, scheme = row.split()
        for column, cell in zip(columns, cells):
            mean = sum(runs[task, scheme, k][column] for k in seeds) / len(seeds)
            assert cell.split(" [")[0] == f"{mean:.1f}", (row, column, cell)


@pytest.mark.plots
def test_a_report_of_another_view_is_written_beside_the_experiments_summary_never_over_it(tmp_path):
    """report --metric bpb (or --buckets, --transpose) writes summary-bpb.* beside the
    experiment's own summary, which stays byte for byte; --out puts a view where it says."""
    from conftest import ROOT

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    res = invoke("report", copy, "--metric", "bpb")
    assert res.exit_code == 0, res.output
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name in before} == before
    assert (copy / "summary-bpb.md").read_text().count("bits per byte") >= 2
    new = {p.name for p in copy.iterdir() if p.is_file()} - set(before)
    assert new == {f"summary-bpb.{x}" for x in ("md", "csv", "tex", "png")}
    assert "summary-bpb.md" in "".join(res.output.split())  # said where it went
    res = invoke("report", copy, "--metric", "bpb", "--out", tmp_path / "bpb")
    assert res.exit_code == 0 and (tmp_path / "bpb" / "summary.md").read_text() == (copy / "summary-bpb.md").read_text()


@pytest.mark.plots
def test_a_report_stopped_part_way_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """The tables and plots take their places together once all are drawn: a report stopped
    while it draws (Ctrl-C, kill) leaves every earlier file as it was, never new tables beside
    old plots, says so, and leaves no staging folder; one that a kill -9 left is removed later."""
    from posbench.measures import plugin

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    for name in ("summary.md", "summary.csv", "positions.png"):
        (copy / name).write_bytes(b"an earlier report's")
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}

    drawn = []

    def stopped(panels, folder):  # the last drawing, after summary.* and positions.png are drawn
        drawn.extend(p.name for p in folder.iterdir())
        raise KeyboardInterrupt

    monkeypatch.setattr(plugin, "write_plots", stopped)
    res = invoke("report", copy)
    assert res.exit_code == 130 and "interrupted: nothing was written" in " ".join(res.output.split()), res.output
    assert {"summary.md", "positions.png"} <= set(drawn), drawn
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()} == before
    assert not list(copy.glob(".together-*"))
    monkeypatch.undo()
    (copy / f".together-{socket.gethostname()}-999999999").mkdir()  # a killed report's, its process long gone
    assert invoke("report", copy).exit_code == 0
    after = {p.name: p.read_bytes() for p in copy.iterdir() if p.is_file()}
    assert set(after) == set(before) and not list(copy.glob(".together-*"))
    assert all(after[name] != b"an earlier report's" for name in ("summary.md", "summary.csv", "positions.png"))
    assert after["summary.md"] == (ROOT / "results" / "reference" / "summary.md").read_bytes()


def test_a_run_whose_config_says_another_training_length_than_its_rows_is_refused(tmp_path):
    """A config.yaml that names another train_len than the run's eval.csv was scored at (a hand
    edit) would title a table with one length and compute its ratios at another: one line, and
    no summary is written."""
    from conftest import ROOT

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    for record in copy.glob("*/config.yaml"):  # every run alike, so that the runs still compare
        record.write_text(record.read_text().replace("train_len: 100", "train_len: 120", 1))
    before = (copy / "summary.md").read_bytes()
    res = invoke("report", copy)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "scored at train_len 100, but its config.yaml says 120; restore config.yaml's model.train_len" in text
    assert (copy / "summary.md").read_bytes() == before


def test_another_runs_rows_in_a_run_folder_are_a_damaged_record(tmp_path):
    """eval.csv copied from another run (alibi's rows in rope's folder) would table alibi's
    numbers under rope, or crash the report where two runs then hold one scheme: report refuses
    in one line naming the folder, and status calls it damaged; so for another seed's rows."""
    from posbench.experiment.status import run_status

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    for source, said in (("alibi-seed0", "scheme alibi"), ("rope-seed1", "seed 1")):
        shutil.copy2(copy / source / "eval.csv", copy / "rope-seed0" / "eval.csv")
        text = report_refused(copy)
        assert f"{copy / 'rope-seed0'}: its rows are of {said}, but its config.yaml says rope seed 0" in text
        row = {r["run"]: r for r in run_status(copy)}["rope-seed0"]
        assert row["state"] == "damaged" and f"its rows are of {said}" in row["detail"]


def test_a_config_yaml_whose_training_its_log_does_not_show_is_a_damaged_record(tmp_path):
    """config.yaml is what a table says of the training ("500 steps, 64,000 tokens"): one edited
    by hand to a budget its train_log.jsonl never reached is refused by report and called damaged
    by status, as evaluate refuses it against model.pt."""
    from posbench.experiment.status import run_status

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    steps = yaml.safe_load((copy / "alibi-seed0" / "config.yaml").read_text())["train"]["steps"]
    for record in copy.glob("*/config.yaml"):  # every run alike, so that the runs still compare
        record.write_text(record.read_text().replace(f"  steps: {steps}\n", "  steps: 500\n", 1))
    text = report_refused(copy)
    assert f"its config.yaml says train.steps 500, but its train_log.jsonl ends at step {steps}" in text
    assert {r["state"] for r in run_status(copy)} == {"damaged"}


def test_a_report_of_one_run_folder_names_its_experiment(tmp_path):
    """A run folder is not called a folder without runs: the line names its experiment."""
    from conftest import ROOT

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    res = invoke("report", copy / "rope-seed0")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"is one run; its table is its experiment's: posbench report {copy}" in text, text
    assert "holds no evaluated runs" not in text and not (copy / "rope-seed0" / "summary.md").exists()


def test_the_bytes_against_bpe_table_is_one_report_in_bits_per_byte(tmp_path):
    """The two tokenizers' references join in bits per byte, a table per tokenizer, and
    give docs/results.md's bytes-against-BPE cells; in perplexity, which does not compare across
    tokenizers, the join is refused with one line that names the metric that does. A terminal
    table of a BPE experiment shows bits per byte beside perplexity."""
    refs = [ROOT / "results" / "reference-bytes", ROOT / "results" / "reference-bpe"]
    res = invoke("report", *refs, "--out", tmp_path / "ppl")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1 and not (tmp_path / "ppl").exists()
    assert "in bpb they compare: --metric bpb" in " ".join(res.output.split())
    res = invoke("report", *refs, "--metric", "bpb", "--out", tmp_path / "bpb")
    assert res.exit_code == 0, res.output
    md = (tmp_path / "bpb" / "summary.md").read_text()
    by = {t: _table(md, f"## data.tokenizer={t},") for t in ("bytes", "bpe")}
    readme = _table(RESULTS_DOC.read_text(), "| scheme | bytes | BPE |")
    assert len(readme) == 8 and readme == {
        s: [f"{by['bytes'][s][0]} / {by['bytes'][s][3]}", f"{by['bpe'][s][0]} / {by['bpe'][s][3]}", cells[2]]
        for s, cells in readme.items()
    }
    shown = invoke("report", refs[1], "--out", tmp_path / "one").output
    assert "bpb(100)" in shown and "bpb(200)" in shown


def test_the_pretrained_table_is_the_committed_reference():
    """Every cell of docs/results.md's SmolLM2 table is results/reference-smollm2's summary, both protocols
    (± over the windows kept)."""
    md = (ROOT / "results" / "reference-smollm2" / "summary.md").read_text()

    def rows(section: str) -> dict:
        body = md.split(section)[1].split("\n\n")[1].splitlines()[2:]
        cells = [[c.strip().strip("*") for c in r.strip("|").split("|")] for r in body]
        return {(c[0].partition("+")[2] or "none"): dict(zip(("1024", "2048", "4096", "8192", "16384"), c[1:6]))
                for c in cells}  # fmt: skip

    plain, sliding = rows("## nonoverlapping"), rows("## sliding, stride 0.5 x length")
    readme = RESULTS_DOC.read_text()
    table = readme[readme.index("| | 1024 | 8192 | 16384 | sliding 1024 |") :].split("\n\n")[0].splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")][1:]
    assert len(table) == 7
    for line in table[2:]:
        variant, *cells = [c.strip() for c in line.strip("|").split("|")]
        for column, cell in zip(head, cells):
            source = sliding if column.startswith("sliding") else plain
            assert cell == source[variant][column.split()[-1]], (variant, column)


def test_the_committed_pretrained_reference_rebuilds_and_holds_the_published_shape_where_it_does(tmp_path):
    """results/reference-smollm2 (make reproduce-smollm2): SmolLM2-135M, context 8,192, scored to
    16,384 with transformers' RoPE scalings at factor 2, non-overlapping and sliding by half of
    each length. Under both protocols: without scaling perplexity rises steeply past the context;
    YaRN and llama3 stay flat to 2x; dynamic equals none inside the context; linear (PI without
    its fine-tuning) costs about 3x everywhere, not the little the papers lead one to
    expect. Sliding gives every token past the first window half a window of context: lower
    perplexity inside the context, and without scaling higher at 16k, where more of the scored
    tokens lie past it."""
    import csv

    committed = rebuilds_byte_for_byte("reference-smollm2", tmp_path)
    (run,) = [p for p in committed.iterdir() if p.is_dir()]
    with (run / "eval.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["protocol"], r["stride"]) for r in rows} == {("nonoverlapping", ""), ("sliding", "0.5")}
    ppl = {  # (protocol, variant, length); variant "" is the model as trained
        (r["protocol"], r["scheme"].partition("+")[2].partition("@")[0], int(r["length"])): float(r["ppl"])
        for r in rows
    }
    assert len(ppl) == len(rows) == 2 * 5 * 5  # protocols x (none, yarn, linear, llama3, dynamic) x lengths
    lengths = [1024, 2048, 4096, 8192, 16384]
    inside = lengths[:-1]  # within the context of 8,192
    for p in ("nonoverlapping", "sliding"):
        plain = {L: ppl[p, "", L] for L in lengths}
        assert plain[16384] > 1.5 * plain[8192] and plain[8192] < plain[1024], p  # context helps, to the context
        for kind in ("yarn", "llama3"):
            mine = [ppl[p, kind, L] for L in lengths]
            assert max(mine) / min(mine) < 1.25 and ppl[p, kind, 16384] < plain[16384] / 1.5, (p, kind)
        assert all(ppl[p, "linear", L] > 2.5 * plain[L] for L in inside), p
        # dynamic NTK scales only past the context: inside it, the same windows score the same loss
        assert all(ppl[p, "dynamic", L] == plain[L] for L in inside), p
        assert ppl[p, "dynamic", 16384] < plain[16384] / 1.5, p
    assert all(ppl["sliding", "", L] < ppl["nonoverlapping", "", L] for L in inside)
    assert ppl["sliding", "", 16384] > ppl["nonoverlapping", "", 16384]
    assert (run / "windows.csv").is_file() and "over its windows" in (committed / "summary.md").read_text()


def test_report_out_is_refused_over_a_file_a_run_or_another_experiment_and_nothing_is_written(tmp_path):
    """--out is a folder of the report's own: a file, a file's name, a run's folder and an
    experiment holding other runs each get one line, and what is there stays as it was."""
    ref = ROOT / "results" / "reference-bytes"
    other = tmp_path / "other"
    shutil.copytree(ROOT / "results" / "reference", other)
    before = (other / "summary.md").read_bytes()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("kept")
    for out, said in [
        (a_file, "is a file; the report's tables and plots go into a folder"),
        (tmp_path / "table.md", "names a folder for summary.md, .csv, .tex and the plots, not a file"),
        (other / "alibi-seed0", "is a run's folder; give a folder of its own for the report"),
        (other, "holds another experiment's runs, whose summary it would replace"),
    ]:
        res = invoke("report", ref, "--out", out)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert f"--out {out}: {said}" in " ".join(res.output.split()) and len(res.output.strip().splitlines()) <= 2
    assert a_file.read_text() == "kept" and not (tmp_path / "table.md").exists()
    assert (other / "summary.md").read_bytes() == before and not (other / "alibi-seed0" / "summary.md").exists()
    res = invoke("report", other, "--out", other)  # its own folder is where its report lives
    assert res.exit_code == 0, res.output


def test_the_extension_table_is_the_committed_extension_reference():
    """Every cell of docs/results.md's context-extension table is results/reference-extend's
    summary: perplexity at 100, 400 and 1,600, and a child's at 400 after 0, 10 and 40 steps."""
    md = (ROOT / "results" / "reference-extend" / "summary.md").read_text()
    main = _table(md, "## nonoverlapping")  # 100, 200, 400, 800, 1600, ...
    curve = _table(md, "## perplexity at 400 after k fine-tuning steps")  # 0, 1, 2, 3, 5, 7, 10, ..., 40
    docs = markdown_table(RESULTS_DOC.read_text(), "| rows | 100 | 400 | 1600 |", intervals=True)
    assert len(docs) == 13 and "rope:yarn-fast8" not in docs  # the spelled sweeps stay in the summary
    for row, cells in docs.items():
        assert cells[:3] == [main[row][0], main[row][2], main[row][4]], row
        if ":" in row:  # a child: its curve, the parent's scaled start at step 0
            columns = ["0", "1", "2", "3", "5", "7", "10", "15", "20", "30", "40"]
            assert len(curve[row]) == len(columns)
            want = " / ".join(curve[row][columns.index(k)] for k in ("0", "10", "40"))
            assert cells[3] == want, row
        else:
            assert cells[3] == "", row


def test_summary_says_where_its_runs_were_trained_and_scored(smoke, tmp_path):
    """From the runs' logs: one place for all, or each place with its runs (a GPU computes in bf16
    autocast, so a run scored there again is named); records written before the logs said it
    (every committed reference) get no line, so they rebuild as they were."""
    import torch

    exp = shutil.copytree(smoke[0], tmp_path / "smoke")
    here = f"cpu in fp32 with torch {torch.__version__}"
    assert invoke("report", exp).exit_code == 0
    assert f"- computed: on {here} (every run, trained and scored)\n" in (exp / "summary.md").read_text()

    log = exp / "alibi-seed0" / "eval_log.jsonl"  # as if evaluate had scored it again on a GPU
    line = json.loads(log.read_text().splitlines()[0]) | {"device": "cuda:0", "torch": "2.11.0+cu130"}
    log.write_text(log.read_text() + json.dumps(line) + "\n")
    assert invoke("report", exp).exit_code == 0
    others = ", ".join(sorted(p.name for p in exp.iterdir() if (p / "eval_log.jsonl").is_file()))
    said = (
        f"- computed: trained on {here} (every run); scored on cpu in fp32 with torch {torch.__version__} "
        f"({others}) and on cuda:0 in bf16 autocast with torch 2.11.0+cu130 (alibi-seed0)\n"
    )
    assert said in (exp / "summary.md").read_text()

    for run in exp.iterdir():  # logs from before they named the device
        for name in ("eval_log.jsonl", "train_log.jsonl"):
            if (run / name).is_file():
                lines = [json.loads(x) for x in (run / name).read_text().splitlines()]
                (run / name).write_text(
                    "".join(json.dumps({k: v for k, v in x.items() if k != "device"}) + "\n" for x in lines)
                )
    assert invoke("report", exp).exit_code == 0
    assert "- computed:" not in (exp / "summary.md").read_text()
