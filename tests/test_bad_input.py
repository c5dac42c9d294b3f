"""Bad input (flags, config files, corpora, plugins, usage): one line that names where it came
from, a non-zero exit, and nothing left behind."""

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import SMOKE, invoke


def _assert_clean_failure(res, message, results: Path):
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    assert message in " ".join(res.output.split()), res.output
    assert not results.exists(), "a failed command left a results folder behind"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schemes", "alibi,ropee"], "unknown scheme 'ropee'"),
        (["--schemes", "alibi,,rope"], "--schemes alibi,,rope: an empty name between commas"),
        (["--rope-scaling", "linear,,yarn"], "--rope-scaling linear,,yarn: an empty name between commas"),
        (["--set", "modell.n_layer=1"], "did you mean 'model'?"),
        (["--set", "train.steps=abc"], "train.steps: expected an integer"),
        (["--set", "model.n_head=3"], "is not divisible by model.n_head=3"),
        (
            ["--train-len", "100", "--test-len", "50"],
            "--test-len 50 is shorter than the training length, model.train_len=100",
        ),
        (["--lengths", "10,64"], "eval.lengths [10] are shorter than the training length"),
        (["--set", "model.d_model=-8"], "model.d_model=-8 must be positive"),
        (["--set", "data.path=/no/such/*.txt"], "data.path '/no/such/*.txt' matches no file"),
        (["--lengths", "32,abc"], "expected comma-separated integers"),
        (["--lengths", ","], "--lengths ,: eval.lengths is empty"),
        (["--seeds", "0,,1"], "--seeds '0,,1': expected comma-separated integers"),  # not seeds 0 and 1
        (["--seeds", "0,0,"], "seeds: 0 listed more than once"),  # a trailing comma ends the list
        (["--protocol", ","], "--protocol ',': name a protocol"),
        (["--schemes", "alibi,alibi"], "schemes: alibi listed more than once"),
        (["--seeds", "0,0"], "seeds: 0 listed more than once"),
        (["--lengths", "32,48,48"], "eval.lengths: 48 listed more than once"),
        (["--seeds", "99999999999999999999"], "seeds: 99999999999999999999 is not a seed here: 0 to 2^63 - 1"),
        (["--seeds=9223372036854775808"], "seeds: 9223372036854775808 is not a seed here"),  # 2^63: no int64
        (["--seeds=-1"], "seeds: -1 is not a seed here"),  # torch's 2^64 - 1
        (["--set", "model.vocab_size=10"], "--set model.vocab_size=10: the corpus is bytes"),
        (["--set", "model.n_layer=99999999999999999999"], "GiB for its weights alone, more than the"),
        (["--set", "train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0"),
        (
            ["--set", "train.lr=1e-5"],
            "--set train.lr=1e-5: train.min_lr=0.0003 is above train.lr=1e-05, so the cosine would rise to it; "
            "set train.min_lr too",
        ),
        (["--set", "train.min_lr=1"], "--set train.min_lr=1 is above train.lr=0.003, so the cosine would rise to it"),
        (["--set", "model.scheme=rope"], "model.scheme='rope' is not read"),
        (["--rope-factor", "2"], "eval.perplexity.rope_factor is set but eval.perplexity.rope_scaling is empty"),
        (["--test-len", "64", "--lengths", "32,48"], "--test-len and --lengths both set"),
        (["--set", "eval.tokens=40"], "eval.tokens=40 is fewer than the longest eval length 64"),
        (["--train-len", "99999"], "--train-len 99999: model.train_len=99999 is more than eval.tokens="),
        (["--schemes", "alibi]"], "unknown scheme 'alibi]'"),  # given as typed, not read as YAML
        (["--threads", "-1"], "train.threads=-1 must be positive"),
        (["--threads", "100000"], "train.threads=100000: at most 4096 threads"),
        (["--set", "name=a/b"], "name='a/b' must be a plain folder name"),
        (["--set", "eval.measure_options={k: 8}"], "eval.measure_options is set but eval.measures is empty"),
        (["--set", "name=tab\there"], "name='tab\\there' must be a plain folder name"),  # a control character
        (
            ["--train-len", "32", "--set", "model.train_len=48"],
            "--train-len 32 and --set model.train_len=48 both set model.train_len; give one",
        ),
        (["--task", "copy", "--set", "task=reverse"], "--task copy and --set task=reverse both set task"),
        (["--stride", "8", "--set", "eval.stride=4"], "--set eval.stride=4 both set eval.perplexity.stride"),
        (["--test-len", "64", "--set", "eval.lengths=[32,48]"], "--test-len and --set eval.lengths=[32,48] both set"),
        (
            ["--stride", "8"],
            "--stride 8: a stride is the sliding windows' step, and the protocol here is nonoverlapping",
        ),
        (["--set", "eval.stride=8"], "--set eval.stride=8: a stride is the sliding windows' step"),
        (["--protocol", "sliding", "--stride", "nan"], "stride: expected a finite number, got nan"),
        (["--protocol", "sliding", "--stride", "inf"], "stride: expected a finite number, got inf"),
    ],
)
def test_extrapolate_errors_are_one_line_and_leave_nothing(tmp_path, corpus_file, args, message):
    out = tmp_path / "results"
    data = [] if any(str(a).startswith("data.path=") for a in args) else ["--set", f"data.path={corpus_file}"]
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={out}", *data, *args)
    _assert_clean_failure(res, message, out)


@pytest.mark.parametrize(
    "override, said",
    [
        ("model.n_head=3", "--set model.n_head=3: model.d_model=32 is not divisible by model.n_head=3"),
        ("eval.tokens=10", "--set eval.tokens=10: model.train_len=100 is more than eval.tokens=10"),
        ("scheme_options.ropee.base=5", "--set scheme_options.ropee.base=5: unknown scheme 'ropee'"),
        ("schemes=[nosuch:Cls]", "--set schemes=[nosuch:Cls]: scheme 'nosuch:Cls': cannot import module 'nosuch'"),
        ("model.d_model=36", "--set model.d_model=36: scheme"),  # the default schemes' rope cannot pair 9 dims
    ],
)
def test_an_error_between_a_files_key_and_a_flags_names_the_flag(tmp_path, override, said):
    """Two keys, one from the file and one from --set, clash: the line names the flag, which is
    the one the user just typed, not the file."""
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  d_model: 32\n  n_head: 4\n")
    _assert_clean_failure(invoke("extrapolate", "--config", config, "--set", override), said, tmp_path / "results")


def test_a_typo_in_the_file_is_the_files_even_beside_a_flag_on_the_key_it_meant(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  train_le: 100\n")
    said = f"{config}: model.train_le: unknown key (did you mean 'model.train_len'?)"
    _assert_clean_failure(invoke("extrapolate", "--config", config, "--train-len", "64"), said, tmp_path / "results")


def test_a_stride_on_a_task_says_the_task_takes_none_rather_than_ask_for_a_protocol(tmp_path):
    out = tmp_path / "results"
    res = invoke("extrapolate", "--task", "copy", "--stride", "8", "--set", f"out_dir={out}")
    _assert_clean_failure(res, "--stride 8: eval.perplexity.stride is an option of the perplexity measure", out)


@pytest.mark.parametrize(
    "setting, said",
    [
        ("data.path=mine.txt", "--set data.path=mine.txt: data.path='mine.txt': task copy draws its own instances"),
        ("data.val_fraction=0.1", "--set data.val_fraction=0.1: task copy draws its own instances and reads no corpus"),
        ("data.corpus=shakespeare-kjv", "task copy draws its own instances and reads no corpus; leave data out"),
    ],
)
def test_a_corpus_setting_on_a_task_is_refused_not_ignored(tmp_path, setting, said):
    out = tmp_path / "results"
    res = invoke("extrapolate", "--task", "copy", "--set", setting, "--set", f"out_dir={out}")
    _assert_clean_failure(res, said, out)


def test_a_clash_of_two_keys_is_blamed_on_the_one_the_command_line_changed(tmp_path):
    """The file's test_max was sound until --set raised train_max past it: the line names the
    --set, with both keys."""
    config = tmp_path / "task.yaml"
    config.write_text("task: copy\ntask_options: {test_max: 30}\n")
    out = tmp_path / "results"
    res = invoke("extrapolate", "--config", config, "--set", "task_options.train_max=40", "--set", f"out_dir={out}")
    said = "--set task_options.train_max=40: task_options.test_max=30 is shorter than task_options.train_max=40"
    _assert_clean_failure(res, said, out)


def test_a_folder_of_text_files_is_told_how_to_name_them_and_a_file_is_no_experiment(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("to be or not to be\n" * 100)
    out = tmp_path / "results"
    res = invoke("extrapolate", "--set", f"data.path={tmp_path / 'texts'}", "--set", f"out_dir={out}")
    texts = tmp_path / "texts"
    said = f"data.path '{texts}' matches no file; it is a folder: give its files, e.g. '{texts / '*.txt'}'"
    _assert_clean_failure(res, said, out)
    for command in ("report", "status"):
        res = invoke(command, tmp_path / "texts" / "a.txt")
        assert res.exit_code == 2 and "a.txt: is a file, not an experiment folder" in res.output, res.output


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
    _assert_clean_failure(
        invoke("extrapolate", "--config", tmp_path),
        f"{tmp_path}: is a folder; give a config file",
        tmp_path / "results",
    )
    _assert_clean_failure(
        invoke("extrapolate", "--seeds", "a,b", "--set", f"out_dir={tmp_path / 'results'}"),
        "--seeds 'a,b': expected comma-separated integers, e.g. 0,1,2",
        tmp_path / "results",
    )


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
        invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={empty}"),
        "is empty",
        out,
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
    assert res.exit_code == 2 and "--threads -1 must be positive" in res.output
    res = invoke("evaluate", exp / "alibi-seed0", "--threads", "100000")  # torch's allocator crashed at it
    assert res.exit_code == 2 and "--threads 100000: at most 4096 threads (this machine has" in res.output

    # a run folder whose records are not text: named, and the experiment's files are kept
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "config.yaml").write_bytes(b"\xff\xfe")
    res = invoke("report", copy)
    assert res.exit_code == 2 and "rope-seed0/config.yaml: not a text file" in " ".join(res.output.split())


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
        "class NanBias(PositionalScheme):\n"
        "    def bias(self, q, k, qpos, kpos, layer):\n"
        "        return q.new_full((1, 1, qpos.numel(), kpos.numel()), float('nan'))\n"
        "class EmbedsNothing(PositionalScheme):\n"
        "    def embed(self, x, pos):\n"
        "        x = x + 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "results"
    base = ["--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}"]
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:Raises")
    _assert_clean_failure(res, "scheme 'brokenplug:Raises' failed to build (ValueError: my constructor fails)", out)
    assert "`posbench check-scheme brokenplug:Raises` checks it step by step" in " ".join(res.output.split())
    res = invoke("check-scheme", "brokenplug:Raises")  # not told to run itself
    assert res.exit_code == 2 and "checks it step by step" not in res.output, res.output
    assert "scheme 'brokenplug:Raises' failed to build (ValueError: my constructor fails)" in res.output
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:BadBias")
    assert "Traceback" not in res.output
    assert res.exit_code == 1, "a bug, not a bad input: exit 1"
    error = res.output[res.output.index("error:") :]  # after any note on kernels that cannot run
    assert "scheme 'brokenplug:BadBias': its bias is (3, 3), expected None" in " ".join(error.split())
    assert len(error.strip().splitlines()) <= 2
    assert not list(out.rglob("*.partial")) and not list(out.rglob("model.pt"))
    # a hook that returns None fails in posbench's code: the plugin loaded is named beside it
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:EmbedsNothing", "--set", "name=none")
    error = " ".join(res.output[res.output.index("error:") :].split())
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert error.startswith("error: unexpected TypeError:") and "not NoneType" in error, error
    loaded = error.split("a plugin's code is loaded here (module ")[1].split(")")[0]  # this process's plugins
    assert "brokenplug" in loaded.split(", ") and "): a hook that returns the wrong thing (None, a str)" in error
    # a forward that is not finite from the first step is the scheme's, not the learning rate's
    res = invoke("extrapolate", *base, "--schemes", "brokenplug:NanBias", "--set", "name=nan")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "lower train.lr" not in said, res.output
    assert "diverged at step 0 (loss nan); the first loss, before any update: the model's forward is not finite" in said
    assert "every run diverged (brokenplug:NanBias seed 0 at step 0); their first loss, before any update" in said


@pytest.mark.parametrize(
    "hook, said",
    [
        ("raise RuntimeError('boom in bias')", "(crashing.py, line 5, in bias) raised RuntimeError: boom in bias"),
        ("sys.exit(0)", "(crashing.py, line 5, in bias) called sys.exit(0)"),
    ],
)
def test_a_plugin_that_fails_mid_training_is_named_with_its_line(tmp_path, corpus_file, monkeypatch, hook, said):
    """An error raised in a plugin's own code while it trains is said as that plugin's bug, at
    its file and line, with a bug's exit status; a sys.exit() there is not posbench's exit 0."""
    import sys

    (tmp_path / "crashing.py").write_text(
        "import sys\nfrom posbench.schemes import PositionalScheme\nclass Crash(PositionalScheme):\n"
        f"    def bias(self, q, k, qpos, kpos, layer):\n        {hook}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "crashing", raising=False)
    out = tmp_path / "results"
    base = ["--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}"]
    res = invoke("extrapolate", *base, "--schemes", "crashing:Crash")
    error = res.output[res.output.index("error:") :]
    assert res.exit_code == 1 and len(error.strip().splitlines()) == 1, res.output
    assert f"scheme 'crashing:Crash' {said}: a bug in that plugin" in error, res.output
    assert "Traceback" not in res.output and not (out / "smoke").exists(), "nothing of the run is left"


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


def test_bare_posbench_prints_its_help_once():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "posbench.cli"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.count("Usage: posbench") == 1, res.stdout


def _import_under_signal(tmp_path, module: str, body: str, after: str, patience: float = 10.0) -> str:
    """What a process prints that takes posbench's signals, then imports `module` (`body`, which
    signals the process itself first) and prints `after` once the interrupt lands."""
    import subprocess
    import sys

    (tmp_path / f"{module}.py").write_text(f"import os, signal, time\n{body}")
    script = f"import sys, time\nimport posbench.__main__ as entry\nentry.PATIENCE = {patience}\nentry.take_signals()\n"
    script += f"t = time.monotonic()\ntry:\n    import {module}\n    time.sleep(30)\nexcept KeyboardInterrupt:\n"
    script += f"    print({after})\n"
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    return res.stdout.strip() or res.stderr


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_an_import_waits_for_it_to_finish_then_interrupts(tmp_path, signum):
    """Commands import torch once they start, for seconds: a KeyboardInterrupt raised inside an
    import leaves the module half done (torch's numpy then swallows it, and the command ran on to
    exit 0, or fails later). posbench's handler lets the import finish and takes the signal
    50 ms later, where the command turns it into one line; an import that never finishes (a
    user's module waiting on something) is interrupted all the same, PATIENCE seconds on."""
    kill = f"os.kill(os.getpid(), signal.{signum})\n"
    said = _import_under_signal(tmp_path, "heavy", kill + "import json\nWHOLE = True\n", "sys.modules['heavy'].WHOLE")
    assert said == "True", said
    waited = "round(time.monotonic() - t, 1) >= 0.3, 'stuck' in sys.modules"
    said = _import_under_signal(tmp_path, "stuck", kill + "while True: time.sleep(0.01)\n", waited, patience=0.3)
    assert said == "True False", said


def test_a_signal_outside_a_commands_edge_is_one_line():
    """The entry takes Ctrl-C before the CLI imports: a signal that lands where no command's
    edge catches it (while arguments are parsed, say) is one line and exit 130, no traceback."""
    import subprocess
    import sys

    script = "import os, signal, sys\nimport posbench.__main__ as entry\nimport posbench.cli\n"
    script += "posbench.cli.main = lambda: os.kill(os.getpid(), signal.SIGINT) or 0\nsys.exit(entry.main())\n"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and res.stderr.strip() == "interrupted: rerun the same command", res.stderr
    # typer turns a KeyboardInterrupt raised in a command before its edge (a lazy import) into a
    # silent exit 130: the entry says it
    script = "import sys\nimport posbench.cli as cli\n\nclass Stop:\n"
    script += "    def find_spec(self, name, path, target=None):\n"
    script += "        if name == 'posbench.experiment.execute':\n            raise KeyboardInterrupt\n\n"
    script += "sys.meta_path.insert(0, Stop())\nsys.argv = ['posbench', 'extrapolate']\nsys.exit(cli.main())\n"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and res.stderr.strip() == "interrupted: rerun the same command", res.stderr


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


@pytest.mark.parametrize(
    "command, said",
    [
        (
            ["check-scheme", "fire", "--set", "mlp_width=1000000000000"],
            "scheme_options.fire (mlp_width=1000000000000): the scheme alone holds about 1.2e+13 parameters",
        ),
        (
            ["train", "--scheme", "learned", "--set", "scheme_options.learned.max_len=10000000000"],
            "scheme_options.learned (max_len=10000000000): the scheme alone holds about 1.3e+12 parameters",
        ),
    ],
)
def test_a_scheme_too_big_for_the_machine_is_refused_before_allocation(tmp_path, command, said):
    """A scheme's own options can make it terabytes (FIRE's MLP, a learned table): counted on the
    meta device and refused in one line, where allocating it would end in the kernel's kill."""
    out = tmp_path / "results"
    res = invoke(*command, "--set", f"out_dir={out}") if command[0] == "train" else invoke(*command)
    _assert_clean_failure(res, said, out)
    assert "GiB, more than the" in res.output


def test_a_model_too_big_to_train_is_refused_before_allocation():
    """16 bytes a parameter to train (weights, gradients, AdamW's moments), 4 to hold it."""
    from posbench.config import ModelConfig, check_trainable
    from posbench.errors import PosbenchError

    cfg = ModelConfig(n_layer=2, d_model=128)  # 12 * 2 * 128^2 + 256 * 128 = 425,984 parameters
    check_trainable(cfg, device_memory=16 * 425_984)
    with pytest.raises(PosbenchError, match="model.d_model=128, model.vocab_size=256: about 4.3e.05 parameters"):
        check_trainable(cfg, device_memory=16 * 425_984 - 1)
    check_trainable(cfg, device_memory=4 * 425_984, bytes_per_param=4)
    # a step of 16 x 100 tokens holds at least its logits and each layer's input, 2 bytes each
    held = 2 * 16 * 100 * (256 + 2 * 128)
    check_trainable(cfg, device_memory=16 * 425_984 + held, batch=16)
    with pytest.raises(PosbenchError, match="train.batch_size=17: a step holds at least"):
        check_trainable(cfg, device_memory=16 * 425_984 + held, batch=17)


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


def test_a_wrong_model_key_lists_the_keys_a_user_sets(tmp_path):
    """model.scheme, model.options and model.extend are posbench's (from schemes,
    scheme_options and extend): a wrong key's message lists the others, not those."""
    res = invoke("extrapolate", "--set", "model.schme=3", "--set", f"out_dir={tmp_path}")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "model.schme: unknown key" in said and "n_layer" in said
    keys = said.split("valid keys:")[1]
    assert all(k not in keys.replace(",", " ").split() for k in ("scheme", "options", "extend")), said


@pytest.mark.parametrize(
    "args,said",
    [  # the smaller cases: each is one line before anything runs
        (
            ["extrapolate", "--task", "copy", "--set", "task_options.alphabet=a"],
            "--set task_options.alphabet=a: task_options.alphabet: task copy has 1 distinct instance(s) of length 1",
        ),
        (
            ["prepare", "SOURCE", "--tokenizer", "bpe", "--vocab-size", "1000000000"],
            "--vocab-size 1000000000: data.vocab_size=1,000,000,000 is more tokens than a BPE trained here can have",
        ),
    ],
)
def test_what_would_fail_late_or_abort_is_one_line_first(tmp_path, args, said):
    (tmp_path / "small.txt").write_text("to be or not to be\n" * 50)
    args = [str(tmp_path / "small.txt") if a == "SOURCE" else a for a in args]
    out = ["--out", tmp_path / "out"] if args[0] == "prepare" else ["--set", f"out_dir={tmp_path / 'out'}"]
    res = invoke(*args, *out)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert said in " ".join(res.output.split()) and not (tmp_path / "out").exists()


def test_eval_tokens_are_checked_against_the_lengths_scored():
    """eval.tokens is held against the lengths a run is scored at, once they are decided: the
    default lengths (to 200) do not refuse 100 tokens for --train-len 25 --test-len 50."""
    from posbench.config import load_config
    from posbench.errors import PosbenchError
    from posbench.resolve import resolve

    def resolved(tokens):
        cfg = load_config(None, [f"eval.tokens={tokens}"], {"model.train_len": ("--train-len 25", 25)})
        return resolve(cfg, test_len=50).cfg

    assert resolved(100).eval.lengths == [25, 31, 38, 50]  # 25 + 25 * (0, 1/4, 1/2, 1), rounded
    with pytest.raises(PosbenchError, match="eval.tokens=40 is fewer than the longest eval length 50"):
        resolved(40)


def test_a_set_inside_a_plain_value_names_its_flag(tmp_path):
    """Over the defaults (no file sets model.n_layer), --set model.n_layer.x=3 makes a mapping
    where an integer belongs: the line names the flag, as any other bad value's does."""
    out = tmp_path / "results"
    res = invoke("extrapolate", "--set", f"out_dir={out}", "--set", "model.n_layer.x=3")
    _assert_clean_failure(res, "--set model.n_layer.x=3: model.n_layer: expected an integer, got {'x': 3}", out)


@pytest.mark.parametrize("under", ["", "deeper"])
def test_an_out_dir_that_is_a_file_is_one_line_naming_the_file(tmp_path, corpus_file, under):
    blocker = tmp_path / "results.txt"
    blocker.write_text("mine")
    out = blocker / under if under else blocker
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"{blocker} is a file, not a folder; give another path" in " ".join(res.output.split())
    assert blocker.read_text() == "mine"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["report", "results/reference", "--out", ""], "--out is given an empty value"),
        (["report", "results/reference", "--metric="], "--metric is given an empty value"),
        (["evaluate", "run", "--rope-scaling", " "], "--rope-scaling is given an empty value"),
        (["status", ""], "an empty argument ('')"),
    ],
)
def test_an_empty_value_is_refused_not_read_as_the_working_directory_or_the_default(
    monkeypatch, capfd, tmp_path, argv, said
):
    """`--out ""` wrote a report into the working directory and `--metric ""` took the default:
    no option or argument takes "", so the command line is refused before any command runs."""
    from posbench import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["posbench", *argv])
    assert cli.main() == 2
    err = capfd.readouterr().err
    assert f"error: {said}; give one, or leave it out for its default" in " ".join(err.split())
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


@pytest.mark.parametrize("split", ["the corpus's tail", "data.val_path"])
def test_a_validation_text_too_short_for_a_length_is_refused_before_anything_trains(tmp_path, split):
    """Every length scores the validation tokens: one shorter than the longest length (and its
    last target) is one line naming it, before a run trains, with nothing written."""
    text = tmp_path / "small.txt"
    text.write_text("to be or not to be, that is the question. " * 20)  # 840 bytes: a 42-byte tail
    out = tmp_path / "results"
    data = [f"data.path={text}"]
    said = f"the validation split of '{text} (bytes)' has 42 bytes, too few for eval length 64 (which needs 65)"
    if split == "data.val_path":
        val = tmp_path / "val.txt"
        val.write_bytes(text.read_bytes()[:40])
        data, said = [f"data.val_path={val}"], f"data.val_path '{val}' has 40 bytes, too few for eval length 64"
    sets = [x for kv in [*data, f"out_dir={out}", "train.steps=3", "model.n_layer=1"] for x in ("--set", kv)]
    res = invoke("extrapolate", "--schemes", "alibi", "--train-len", "32", "--test-len", "64", *sets)
    _assert_clean_failure(res, said, out)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
