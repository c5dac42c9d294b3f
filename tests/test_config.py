"""Configs: the defaults file, overrides, and one clear error for each kind of bad input."""

import dataclasses

import pytest
import torch
import yaml
from conftest import invoke

from posbench import kernels
from posbench.config import (
    ExperimentConfig,
    ModelConfig,
    apply_override,
    length_grid,
    load_config,
)
from posbench.errors import PosbenchError
from posbench.resolve import resolve

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_default_yaml_equals_dataclass_defaults():
    """configs/default.yaml is where users read the defaults; it must not drift from the code."""
    from_file = resolve(load_config(ROOT / "configs" / "default.yaml")).cfg
    defaults = resolve(ExperimentConfig()).cfg
    assert from_file == defaults
    raw = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert raw["schemes"] == defaults.schemes  # and it is explicit, not empty

    def keys(section, prefix=""):  # every key a user can set: the fields not derived from others
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                yield from keys(value, f"{prefix}{f.name}.")
            elif not f.metadata.get("derived"):
                yield f"{prefix}{f.name}"

    def listed(d, prefix=""):
        for k, v in d.items():
            yield from listed(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]

    assert set(keys(ExperimentConfig())) == set(listed(raw))  # every setting is there to read


def test_smoke_yaml_loads():
    cfg = load_config(ROOT / "configs" / "smoke.yaml")
    assert cfg.name == "smoke" and cfg.train.steps < 100


def test_an_empty_key_under_a_section_is_said_as_empty():
    with pytest.raises(PosbenchError, match=r"--set '=5': the key is empty"):
        apply_override({}, "=5", under="scheme_options.rope")


def test_set_overrides_parse_types_and_nest():
    raw = {}
    apply_override(raw, "train.steps=7")
    apply_override(raw, "eval.lengths=[16, 32]")
    apply_override(raw, "data.path=a/*.txt")
    apply_override(raw, "scheme_options.t5.max_distance=64")
    assert raw == {
        "train": {"steps": 7},
        "eval": {"lengths": [16, 32]},
        "data": {"path": "a/*.txt"},
        "scheme_options": {"t5": {"max_distance": 64}},
    }


def test_yaml_then_set_precedence(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: {steps: 5, lr: 0.01}\n")
    cfg = load_config(p, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.d_model) == (9, 0.01, 128)


def test_run_config_resolves_scheme_and_options():
    cfg = load_config(None, ["scheme_options.t5.max_distance=64"])
    rc = cfg.for_run("t5", 3)
    assert rc.model.scheme == "t5" and rc.model.options == {"max_distance": 64}
    assert rc.schemes == ["t5"] and rc.seeds == [3]
    assert cfg.for_run("alibi", 0).model.options == {}


@pytest.mark.parametrize(
    "train,test,grid", [(100, 200, [100, 125, 150, 200]), (100, 100, [100]), (64, 96, [64, 72, 80, 96])]
)
def test_length_grid(train, test, grid):
    assert length_grid(train, test) == grid


@pytest.mark.parametrize(
    "sets,message",
    [
        (["train.stpes=3"], "train.stpes: unknown key (did you mean 'train.steps'?)"),
        (["modle.n_layer=3"], "modle: unknown key (did you mean 'model'?)"),
        (["train.steps=many"], "train.steps: expected an integer, got 'many'"),
        (["train.lr=[1]"], "train.lr: expected a number"),
        (["train.lr=fast"], "train.lr: expected a number, got 'fast'"),
        (["train.lr=nan"], "train.lr: expected a finite number"),
        (["train.workers=0"], "train.workers=0 must be positive"),
        (["schemes=[alibi, ropee]"], "unknown scheme 'ropee' (did you mean 'rope'?); valid schemes: nope, "),
        (["schemes=[irop]"], "unknown scheme 'irop' (did you mean 'irope'?); valid schemes: nope, "),
        (["schemes=[x]"], "stickbreaking, the patterns over layers rnope_swa, irope, gemma3 and pattern_<label>"),
        (["model.n_head=3"], "model.d_model=128 is not divisible by model.n_head=3"),
        (["model.d_model=0"], "model.d_model=0 must be positive"),
        (["train.steps=-1"], "train.steps=-1 must be positive"),
        (["eval.lengths=[50, 200]"], "eval.lengths [50] are shorter than the training length"),
        (["scheme_options.t5.max_distanse=3"], "did you mean 'max_distance'"),
        (["scheme_options.t5.max_distance=far"], "scheme_options.t5.max_distance: expected int"),
        (["scheme_options.rope.bsae=1.0"], "scheme_options.rope.bsae: unknown option (did you mean 'base'?)"),
        (["scheme_options.ropey.base=1.0"], "unknown scheme 'ropey'"),
        (["train.steps"], "expected key=value"),
        (["scheme_options.t5.num_buckets=0"], "scheme_options.t5.num_buckets=0 must be positive"),
        (["scheme_options.t5.max_distance=8"], "need num_buckets >= 2 and max_distance > num_buckets/2"),
        (["schemes=[rope]", "scheme_options.rope.base=1.0"], "scheme_options.rope.base=1.0 must be > 1"),
        (["scheme_options.xpos.scale_base=0.0"], "scheme_options.xpos.scale_base=0.0 must be positive"),
    ],
)
def test_bad_values_name_the_culprit(sets, message):
    if sets[0].startswith("scheme_options.rope"):
        sets = sets + ["schemes=[alibi]"]  # options of a scheme that is not run are still checked
    with pytest.raises(PosbenchError) as e:
        resolve(load_config(None, sets))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(PosbenchError, match=r"bad.yaml: malformed YAML at line \d+"):
        load_config(p)


def test_an_alias_inside_itself_is_malformed_yaml_and_a_shared_one_reads(tmp_path):
    """`a: &x {b: *x}` is a value without end: one line, not a RecursionError; an anchor used
    twice is only shared and reads as written."""
    p = tmp_path / "loop.yaml"
    p.write_text("model: &a {n_layer: *a}\n")
    with pytest.raises(PosbenchError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: malformed YAML: an alias (*name) inside the value it names"
    p.write_bytes(b"name: x\x00\n")  # a character YAML does not allow: said, with where it is
    with pytest.raises(PosbenchError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: malformed YAML: character #x0000 at position 7: special characters are not allowed"
    p.write_text("scheme_options:\n  t5: &opts {max_distance: 64}\n  hybrid: *opts\n")
    cfg = load_config(p)
    assert cfg.scheme_options == {"t5": {"max_distance": 64}, "hybrid": {"max_distance": 64}}


def test_missing_yaml(tmp_path):
    with pytest.raises(PosbenchError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_must_be_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(PosbenchError, match="expected a mapping"):
        load_config(p)


def test_model_config_validates_directly():
    with pytest.raises(PosbenchError, match="not divisible"):
        ModelConfig(d_model=30, n_head=4)
    assert dataclasses.replace(ModelConfig(), n_head=8).head_dim == 16


def test_length_grid_rejects_short_test():
    with pytest.raises(PosbenchError, match="--test-len 50 is shorter than the training length, model.train_len=100"):
        length_grid(100, 50)


def test_exponent_notation_is_a_number(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string; a float field or a scheme's float option takes
    it as the number (RoPE's base=1e6 is how papers write it), and every other value keeps the
    string written, so a record's name or hash reads back as written."""
    from posbench.resolve import resolve
    from posbench.schemes import build_scheme

    assert load_config(None, ["train.lr=1e-3"]).train.lr == 0.001
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n  min_lr: 1E-5\nschemes: [rope]\nscheme_options:\n  rope: {base: 5e5}\n")
    cfg = load_config(path, [])
    assert (cfg.train.lr, cfg.train.min_lr) == (0.0003, 0.00001)
    assert build_scheme(cfg.model_for("rope")).opt["base"] == 500000.0
    assert resolve(cfg).cfg.scheme_options["rope"]["base"] == 500000.0  # recorded as the number
    cfg = load_config(None, ["scheme_options.rope.base=1e6", "schemes=[alibi]"])  # a scheme not run here
    assert resolve(cfg).cfg.scheme_options["rope"]["base"] == 1e6
    cfg = load_config(None, ["scheme_options.rope.base=inf", "schemes=[rope]"])
    with pytest.raises(PosbenchError, match="scheme_options.rope.base: expected float, got 'inf'"):
        resolve(cfg)
    assert load_config(None, ["name=1e3"]).name == "1e3"  # a string field keeps the string


def test_the_training_length_is_always_evaluated():
    """It is the base of every ratio; lengths that leave it out get it added when resolved."""
    from posbench.config import load_config

    assert resolve(load_config(None, ["eval.lengths=[150, 200]"])).cfg.eval.lengths == [100, 150, 200]


def test_a_key_from_a_file_is_blamed_on_the_file(tmp_path):
    """A bad value read from a config file is one line naming that file and the key, never the
    command line."""
    my = tmp_path / "my.yaml"
    my.write_text(f"out_dir: {tmp_path / 'r'}\nmodel: {{train_len: 32}}\n")
    res = invoke("extrapolate", "--task", "copy", "--config", my)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    said = " ".join(res.output.split())
    assert len(res.output.strip().splitlines()) == 1 and "my.yaml" in said and "model.train_len" in said, res.output
    assert "command line" not in said
    assert not (tmp_path / "r").exists()


def test_a_flag_s_bad_value_is_blamed_on_the_flag_as_typed(tmp_path):
    """A bad value given by --set is one line naming the flag as it was typed."""
    ok = tmp_path / "my_ok.yaml"
    ok.write_text(f"out_dir: {tmp_path / 'r'}\n")
    res = invoke("extrapolate", "--config", ok, "--set", "train.steps=0")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "--set train.steps=0" in res.output, res.output
    assert not (tmp_path / "r").exists()


def test_a_run_s_identity_is_every_field_not_declared_a_setting():
    """What makes two runs the same run is declared beside the fields: the name, the output
    folder, the evaluation settings and how fast a run goes are settings; every other field,
    a new one included, decides the weights."""
    from posbench.config import ExperimentConfig, identity

    part = identity(ExperimentConfig())
    assert {"name", "out_dir", "eval"}.isdisjoint(part)
    assert {"schemes", "seeds", "model", "train", "data", "task", "task_options"} <= set(part)
    assert "attention" not in part["model"] and {"train_len", "n_layer", "scheme"} <= set(part["model"])
    assert {"threads", "workers", "device", "compile", "log_every", "checkpoint_every"}.isdisjoint(part["train"])
    assert {"lr", "steps", "batch_size", "warmup_steps"} <= set(part["train"])


# --- a plugin's options: its name, module:Class, keeps its module's dots --------------------

PLUGIN = "examples.my_scheme:MyScheme"


def test_set_names_a_plugin_s_options_by_module_and_class():
    """`--set scheme_options.<module:Class>.<option>=v`: the name runs to the first dot after
    its colon, so the module's dots are not sections."""
    cfg = load_config(None, [f"scheme_options.{PLUGIN}.window=8", "scheme_options.t5.max_distance=64"])
    assert cfg.scheme_options == {PLUGIN: {"window": 8}, "t5": {"max_distance": 64}}
    assert cfg.origins[f"scheme_options.{PLUGIN}.window"] == f"--set scheme_options.{PLUGIN}.window=8"
    raw = {}
    apply_override(raw, f"scheme_options.{PLUGIN}={{window: 4}}")  # the whole mapping at once
    assert raw == {"scheme_options": {PLUGIN: {"window": 4}}}


def test_a_plugin_s_options_from_yaml_as_the_readme_writes_them(tmp_path):
    my = tmp_path / "my.yaml"
    my.write_text(f"schemes: [{PLUGIN}]\nscheme_options:\n  {PLUGIN}: {{window: 64}}\n")
    cfg = load_config(my, [f"scheme_options.{PLUGIN}.window=8"])  # the flag wins over the file
    assert cfg.scheme_options == {PLUGIN: {"window": 8}}


@pytest.mark.parametrize("option, said", [("window=-1", "must be a positive integer"), ("windw=8", "unknown option")])
def test_a_bad_plugin_option_is_blamed_on_its_flag(monkeypatch, option, said):
    monkeypatch.syspath_prepend(str(ROOT))  # examples/ imports from the repository root
    flag = f"scheme_options.{PLUGIN}.{option}"
    with pytest.raises(PosbenchError) as e:
        resolve(load_config(None, [f"schemes=[{PLUGIN}]", flag]))
    assert str(e.value).startswith(f"--set {flag}") and said in str(e.value), str(e.value)


def test_a_measure_s_options_are_its_own_section_and_eval_s_own_spelling_still_reads(tmp_path):
    """eval.perplexity holds perplexity's options, eval.exact_match a task's buckets. A config
    or a committed record that spells them as keys of eval itself (results/ holds such records)
    reads into the same sections, from a file, --set or a sweep; given both ways, one line."""
    from posbench.config import config_from_dict, load_sweep, read_record

    record = ROOT / "results" / "reference" / "alibi-seed0" / "config.yaml"
    raw = read_record(record)
    assert "protocol" in raw["eval"] and "perplexity" not in raw["eval"]  # the record's own spelling
    cfg = config_from_dict(raw)
    assert cfg.eval.perplexity.protocol == raw["eval"]["protocol"] == ["nonoverlapping", "sliding"]
    assert cfg.eval.perplexity.stride == raw["eval"]["stride"] == 25

    old = tmp_path / "old.yaml"
    old.write_text("eval:\n  protocol: [sliding]\n  stride: 7\n  buckets: [20, 10]\n")
    cfg = load_config(old, ["eval.rope_scaling=[yarn]"])
    assert cfg.eval.perplexity.protocol == ["sliding"] and cfg.eval.perplexity.stride == 7
    assert cfg.eval.exact_match.buckets == [10, 20] and cfg.eval.perplexity.rope_scaling == ["yarn"]
    assert cfg.origins["eval.perplexity.stride"] == str(old)
    assert cfg.origins["eval.perplexity.rope_scaling"] == "--set eval.rope_scaling=[yarn]"
    assert not hasattr(cfg.eval, "protocol")

    new = tmp_path / "new.yaml"
    new.write_text("eval:\n  perplexity: {protocol: [sliding], stride: 7}\n  exact_match: {buckets: [10, 20]}\n")
    assert load_config(new).eval == load_config(old).eval

    both = tmp_path / "both.yaml"
    both.write_text("eval:\n  stride: 7\n  perplexity: {stride: 9}\n")
    with pytest.raises(PosbenchError, match="eval.stride and eval.perplexity.stride both given: keep eval.perplexity"):
        load_config(both)

    swept = tmp_path / "sweep.yaml"
    swept.write_text("sweep:\n  eval.stride: [5, 10]\neval:\n  protocol: [sliding]\n")
    grid = load_sweep(swept)
    assert [(s, c.eval.perplexity.stride) for s, c in grid] == [
        ({"eval.perplexity.stride": 5}, 5),
        ({"eval.perplexity.stride": 10}, 10),
    ]
    flagged = load_sweep(swept, ["train.steps=7"], {"train.threads": ("--threads 1", 1), "train.device": None})
    assert [(c.train.threads, c.train.steps) for _, c in flagged] == [(1, 7), (1, 7)]
    assert flagged[1][1].origins["train.threads"] == "--threads 1"
    assert flagged[1][1].origins["train.steps"] == "--set train.steps=7"
    with pytest.raises(PosbenchError, match="--threads 1 and --set train.threads=2 both set train.threads; give one"):
        load_sweep(swept, ["train.threads=2"], {"train.threads": ("--threads 1", 1)})

    bad = tmp_path / "bad.yaml"
    bad.write_text("eval:\n  perplexity: {protocl: [sliding]}\n")
    with pytest.raises(
        PosbenchError, match="eval.perplexity.protocl: unknown key .*did you mean 'eval.perplexity.protocol'"
    ):
        load_config(bad)


def test_gpu_study_resolves_to_the_budget_its_docs_state():
    """configs/gpu-study.yaml, resolved without training anything: GPT-2-small's shape, the five
    schemes at 2 seeds, scored to 8x, and the tokens a run and the parameters that
    docs/performance.md's arithmetic is made of."""
    cfg = resolve(load_config(ROOT / "configs" / "gpu-study.yaml")).cfg
    m, t = cfg.model, cfg.train
    assert (m.n_layer, m.d_model, m.n_head, m.train_len) == (12, 768, 12, 1024)
    assert (cfg.data.corpus, cfg.data.tokenizer, m.vocab_size) == ("shakespeare-kjv", "bpe", 16384)
    assert cfg.schemes == ["nope", "rope", "alibi", "t5", "fire"] and cfg.seeds == [0, 1]
    assert cfg.eval.lengths == [m.train_len * k for k in (1, 2, 4, 8)]
    assert cfg.eval.perplexity.protocol == ["nonoverlapping"] and cfg.eval.tokens == 16 * 8 * m.train_len
    assert (t.device, t.compile, t.checkpoint_every) == ("cuda", False, 0)
    tokens = t.steps * t.batch_size * m.train_len
    section = (ROOT / "docs" / "performance.md").read_text().split("### A study at GPT-2-small's shape")[1]
    section = section.split("\n### ")[0]
    assert f"{t.steps} steps x {t.batch_size} x {m.train_len:,} = {tokens:,}" in section
    assert f"{m.params / 1e6:.1f}M parameters with NoPE" in section
    assert f"{cfg.eval.tokens:,} validation tokens" in section
    assert "posbench extrapolate --config configs/gpu-study.yaml" in section
    make = (ROOT / "Makefile").read_text().split("\nreproduce-gpu:")[1]
    assert "$(POSBENCH) extrapolate --config configs/gpu-study.yaml" in make.split("\n\n")[0]


def test_the_gpu_study_on_a_machine_without_a_gpu_is_one_line_and_trains_nothing(tmp_path):
    """The preset asks for cuda: where there is none it stops before the corpus is read or a
    folder is made, in one line naming the setting."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the preset would train GPT-2-small")
    res = invoke("extrapolate", "--config", ROOT / "configs" / "gpu-study.yaml", "--set", f"out_dir={tmp_path}")
    assert res.exit_code != 0
    assert res.output.strip().count("\n") == 0 and "train.device=cuda: no CUDA device is available" in res.output
    assert not any(tmp_path.iterdir())


STUB_PYTHON = """#!/usr/bin/env bash
echo "POSBENCH_CACHE=${POSBENCH_CACHE:-} PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-} $*" >> "$CALLS"
if [ "$1 $2 $3" = "-m posbench.cli extrapolate" ]; then  # a study's records and weights, where --set out_dir says
    out=${7#out_dir=}; mkdir -p "$out/reference-gpu/nope-seed0"
    echo records > "$out/reference-gpu/nope-seed0/eval.csv"; echo weights > "$out/reference-gpu/nope-seed0/model.pt"
fi
"""


@pytest.fixture
def gpu_script(tmp_path):
    """.ci/gpu run with a stand-in Python that logs each call and writes what a study would."""
    import os
    import subprocess

    stub = tmp_path / "python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)

    def run(*args, **env):
        calls = tmp_path / "calls.txt"
        calls.touch()
        full = {**os.environ, "PYTHON": str(stub), "CALLS": str(calls), "OUT": str(tmp_path / "out"), **env}
        done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu"), *args], env=full, capture_output=True, text=True)
        said = calls.read_text().splitlines()  # machine.txt's torch version aside
        return done, [c for c in said if "-c import torch" not in c]

    return run


def test_the_gpu_checks_run_sdpa_and_flex_side_by_side_at_gpt2_small_then_the_cuda_tests(gpu_script, tmp_path):
    done, calls = gpu_script("checks")
    assert done.returncode == 0, done.stderr
    assert all("PYTHONUNBUFFERED=1 " in c for c in calls)  # a part killed at its limit keeps what it printed
    bench = calls[0].split()
    assert bench[2:6] == ["-m", "posbench.cli", "bench", "--device"] and "--attention sdpa,flex" in calls[0]
    assert "--schemes nope,alibi,t5,kerple_log,fire" in calls[0] and f"--out {tmp_path}/out/bench.csv" in calls[0]
    for shape in ("model.n_layer=12", "model.d_model=768", "model.n_head=12", "model.train_len=1024"):
        assert f"--set {shape}" in calls[0]
    assert calls[1].endswith("-m pytest -p no:cacheprovider tests/test_cuda.py -k not flex")
    assert calls[2].endswith("-m pytest -p no:cacheprovider tests/test_cuda.py -k flex")
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"machine.txt", "cuda-tests.txt", "cuda-flex-tests.txt", "bench.txt"}
    assert "exit 0 after" in (out / "bench.txt").read_text()  # each part says how it ended


def test_the_gpu_triton_part_checks_the_kernels_then_benches_them_beside_sdpa_then_times_the_forms(
    gpu_script, tmp_path
):
    done, calls = gpu_script("triton")
    assert done.returncode == 0, done.stderr
    assert calls[0].endswith("-m pytest -p no:cacheprovider -vv tests/test_cuda_triton.py")
    assert " bench --device cuda --attention sdpa,triton " in calls[1]
    assert "--schemes nope,alibi,t5,kerple_log,fire" in calls[1] and f"--out {tmp_path}/out/bench.csv" in calls[1]
    for shape in ("model.n_layer=12", "model.d_model=768", "model.n_head=12", "model.train_len=1024"):
        assert f"--set {shape}" in calls[1]
    assert calls[2].endswith(".ci/attention_forms.py --only triton")
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"machine.txt", "cuda-triton-tests.txt", "bench.txt", "forms.txt"}
    part = (ROOT / ".ci" / "gpu").read_text().split("\ntriton)")[1].split(";;")[0]
    limits = [int(x) for x in part.split("timed ")[1:] for x in [x.split()[0]]]
    assert len(limits) == 3 and sum(limits) + 15 * 3 <= 600 - 40  # each limit and 15 s to stop, in a 10-minute job


def test_the_gpu_forms_time_one_attention_call_in_each_form(gpu_script, tmp_path):
    done, calls = gpu_script("forms")
    assert done.returncode == 0, done.stderr
    assert calls == ["POSBENCH_CACHE= PYTHONUNBUFFERED=1 .ci/attention_forms.py"]
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"machine.txt", "forms.txt"}


def test_the_attention_forms_run_here_small_and_each_candidate_equals_the_form_it_would_replace():
    """.ci/attention_forms.py --small on this CPU: a line for every form (flex forward only; SDPA's
    memory-efficient kernel has no CPU form, so it says why), and every candidate's output equals
    the one it would replace (a per-row table, ALiBi's slopes, FIRE's gathers and MLP, and
    posbench's Triton kernels in their interpreter, in outputs and gradients)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "attention_forms.py"), "--small", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu: B 2, H 2, T 64, D 16") and len(lines) == 23  # no warps or stages here
    assert "memory-efficient kernel, a learned dense bias: cannot run here" in done.stdout
    assert "DIFFERS" not in done.stdout
    candidates = ["table per batch row:", "and 128 queries:", "flex, ALiBi from its slopes:", "SegmentGather:"]
    candidates += ["its MLP:"]
    if kernels.why_not(torch.device("cpu")) is None:  # Triton's interpreter, as conftest sets it
        candidates += ["triton, no bias:", "triton, a learned table (T5, KERPLE):", "triton, FIRE's lines:"]
        candidates += ["triton, a learned dense bias:", "triton, ALiBi from its slopes:"]
    for candidate in [*candidates, "flex, no bias:", "memory-efficient kernel"]:
        (line,) = [x for x in lines if candidate in x]
        assert candidate == "memory-efficient kernel" or (" ms (" in line and "; equal to " in line), line
    (fire,) = [x for x in lines if "SegmentGather:" in x]
    assert "in the output and 4 gradients" in fire  # FIRE's MLP's weights and biases, compared
    if kernels.why_not(torch.device("cpu")) is None:  # q, k, v, FIRE's MLP, its c and threshold
        assert "in the output and 9 gradients" in [x for x in lines if "triton, FIRE's lines:" in x][0]


def test_the_gpu_study_brings_back_its_records_without_the_weights(gpu_script, tmp_path):
    done, _ = gpu_script("study", GPU_CACHE=str(tmp_path / "absent"))
    assert done.returncode == 2 and "run make gpu-cache" in done.stderr
    (tmp_path / "cache").mkdir()
    done, calls = gpu_script("study", GPU_CACHE=str(tmp_path / "cache"), STUDY_DIR=str(tmp_path / "study"))
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"POSBENCH_CACHE={tmp_path}/cache PYTHONUNBUFFERED=1 -m posbench.cli extrapolate "
        f"--config configs/gpu-study.yaml --set out_dir={tmp_path}/study"
    ]
    import tarfile

    with tarfile.open(tmp_path / "out" / "study-records.tar.gz") as records:  # one file, whatever the runs
        names = sorted(m.name for m in records.getmembers() if m.isfile())
        assert records.extractfile("./reference-gpu/nope-seed0/eval.csv").read() == b"records\n"
    assert names == ["./reference-gpu/nope-seed0/eval.csv"]  # model.pt stays on the machine
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"machine.txt", "study.txt", "study-records.tar.gz"}
    import os

    relative = os.path.relpath(tmp_path / "elsewhere", ROOT)  # $OUT as the checkout sees it, not the study folder
    done, _ = gpu_script("study", GPU_CACHE=str(tmp_path / "cache"), STUDY_DIR=str(tmp_path / "study"), OUT=relative)
    assert done.returncode == 0 and (tmp_path / "elsewhere" / "study-records.tar.gz").is_file(), done.stderr
    again = {"GPU_CACHE": str(tmp_path / "cache"), "STUDY_DIR": str(tmp_path / "study")}
    done, calls = gpu_script("study", "--set", "model.attention=sdpa", **again)  # what follows goes to extrapolate
    assert done.returncode == 0 and calls[-1].endswith(f"out_dir={tmp_path}/study --set model.attention=sdpa")
    assert (tmp_path / "study" / "reference-gpu" / "nope-seed0" / "model.pt").exists()


def test_an_error_line_over_its_limit_is_cut_at_a_word_and_says_so():
    from posbench.errors import first_line

    e = ValueError("the checkpoint could not be read by torch.load from the file\nsecond line")
    assert first_line(e, 200) == "the checkpoint could not be read by torch.load from the file"
    assert first_line(e, 40) == "the checkpoint could not be read by ..."
    path = ValueError("failed: /" + "x" * 300)  # no word to cut at near the end: cut where the limit falls
    assert first_line(path, 100) == "failed: /" + "x" * 91 + " ..."
    assert first_line(e, 200, last=True) == "second line" and first_line(ValueError()) == "ValueError"


@pytest.mark.parametrize(
    "sets, both",
    [
        (["model.n_layer=1", "model.n_layer=2"], "model.n_layer"),
        (["train={steps: 2}", "train.steps=3"], "train.steps"),  # a section, then a key in it
        (["train.steps=3", "train={steps: 2}"], "train.steps"),
        (["eval.stride=3", "eval.perplexity.stride=4"], "eval.perplexity.stride"),  # one key, two spellings
    ],
)
def test_two_sets_of_one_key_are_refused_not_the_last_taken(tmp_path, sets, both):
    """`--set k=1 --set k=2` kept 2 in silence, where a flag and a --set on one key are refused;
    a sweep's command line is held to the same. Two keys side by side are two settings."""
    from posbench.config import load_sweep

    said = f"--set {sets[0]} and --set {sets[1]} both set {both}; give one"
    with pytest.raises(PosbenchError) as e:
        load_config(None, sets)
    assert str(e.value) == said
    swept = tmp_path / "sweep.yaml"
    swept.write_text("sweep:\n  model.train_len: [32, 64]\n")
    with pytest.raises(PosbenchError) as e:
        load_sweep(swept, sets)
    assert str(e.value).endswith(f"sweep point model.train_len=32: {said}"), str(e.value)
    cfg = load_config(None, ["train.steps=3", "train.lr=0.01", "train.min_lr=0.001"])
    assert (cfg.train.steps, cfg.train.lr, cfg.train.min_lr) == (3, 0.01, 0.001)
