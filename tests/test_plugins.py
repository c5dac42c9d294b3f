"""User plugins: a module:Class scheme loads like a registered one, and check-scheme judges it."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMOKE, invoke  # noqa: E402

from posbench import check
from posbench.config import ModelConfig
from posbench.schemes import SCHEMES, PositionalScheme, resolve_scheme

EXAMPLE = "examples.my_scheme:MyScheme"


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Write a module into tmp_path, importable by name; returns a function that does it."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


@pytest.fixture
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # examples/ is found from the repo root, as documented


def row(output: str, check_name: str) -> str:
    """The result cell of one check in check-scheme's table."""
    m = re.search(rf"│ {re.escape(check_name)}\s*│ (\w+)", output)
    assert m, output
    return m.group(1)


# --- the worked example ----------------------------------------------------------------------


def test_example_loads_by_module_and_class(repo_on_path):
    cls = resolve_scheme(EXAMPLE)
    assert issubclass(cls, PositionalScheme) and cls.__name__ == "MyScheme"


def test_example_passes_check_scheme(repo_on_path):
    res = invoke("check-scheme", EXAMPLE)
    assert res.exit_code == 0, res.output
    for name in ("build", "causality", "forward", "backward", "beyond length"):
        assert row(res.output, name) == "pass", name


def test_example_is_alibi_inside_its_window(repo_on_path):
    """Within `window` keys the example's bias is ALiBi's; farther back it is -inf."""
    cfg = check.tiny_config(EXAMPLE, options={"window": 5})
    mine, alibi = resolve_scheme(EXAMPLE)(cfg), SCHEMES["alibi"](check.tiny_config("alibi"))
    T = 12
    q = k = torch.zeros(1, cfg.n_head, T, cfg.head_dim)
    pos = torch.arange(T)
    a, b = mine.bias(q, k, pos, pos, 0)[0], alibi.bias(q, k, pos, pos, 0)[0]  # (H, T, T)
    dist = pos[:, None] - pos[None, :]
    inside = (dist >= 0) & (dist < 5)
    assert torch.equal(a[:, inside], b[:, inside])
    assert torch.all(a[:, dist >= 5] == float("-inf"))


def test_example_window_defaults_to_the_training_length(repo_on_path):
    assert resolve_scheme(EXAMPLE)(check.tiny_config(EXAMPLE, train_len=24)).window == 24


def test_example_trains_from_yaml_into_a_safe_folder(repo_on_path, tmp_path, corpus_file):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(Path(SMOKE).read_text() + f"schemes: [{EXAMPLE}]\n")
    out = tmp_path / "r"
    res = invoke("train", cfg, "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}", "--set", "train.steps=5")
    assert res.exit_code == 0, res.output
    assert (out / "smoke" / "examples.my_scheme_MyScheme-seed0" / "model.pt").is_file()
    assert "examples.my_scheme:MyScheme" in (out / "smoke" / "summary.csv").read_text()


# --- broken plugins: one clear line each -----------------------------------------------------


BROKEN = {
    "missing module": ("no_such_module_xyz:Thing", None, "cannot import module 'no_such_module_xyz'"),
    "missing class": ("plug_noclass:Thing", "X = 1\n", "module 'plug_noclass' has no 'Thing'"),
    "not a scheme": (
        "plug_notscheme:Thing",
        "class Thing:\n    pass\n",
        "Thing is not a subclass of posbench.schemes.PositionalScheme",
    ),
    "module raises": ("plug_raises:Thing", "1 / 0\n", "importing module 'plug_raises' failed (ZeroDivisionError"),
    "module exits": ("plug_exits:Thing", "import sys\nsys.exit(3)\n", "module 'plug_exits' called sys.exit(3)"),
    "no class named": ("plug_noclass:", None, "expected module:Class"),
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("command", ["check-scheme", "inspect"])
def test_broken_plugin_is_one_clear_line(on_path, case, command):
    spec, source, message = BROKEN[case]
    if source is not None:
        on_path(spec.split(":")[0], source)
    res = invoke(command, spec)
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    assert res.output.strip().count("\n") == 0, res.output  # one line
    assert message in res.output, res.output


def test_an_option_the_scheme_refuses_at_the_checks_size_is_one_line():
    """learned with max_len=1 cannot hold check-scheme's train_len: the option is the user's to
    change, so it is one line naming the --set, not eight failed checks of the scheme."""
    res = invoke("check-scheme", "learned", "--set", "max_len=1")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--set max_len=1: scheme_options.learned.max_len=1 is shorter than model.train_len=16" in res.output
    assert "(check-scheme builds the scheme at train_len 16)" in " ".join(res.output.split())


def test_broken_plugin_stops_extrapolate_before_training(on_path, tmp_path, corpus_file):
    on_path("plug_notscheme2", "class Thing:\n    pass\n")
    out = tmp_path / "r"
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi,plug_notscheme2:Thing",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "is not a subclass of posbench.schemes.PositionalScheme" in res.output
    assert not out.exists()


# --- every check can fail: a scheme built to break each one ---------------------------------

LEAKY = """
import torch
from posbench.schemes import PositionalScheme

class Leaky(PositionalScheme):
    '''Adds the NEXT token's embedding at every position: position t sees token t+1.'''

    def embed(self, x, pos):
        ahead = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)  # (B, T, C), x[t+1] at t
        return x + ahead
"""

UNUSED = """
import torch
from posbench.schemes import PositionalScheme

class Unused(PositionalScheme):
    '''A parameter that no hook reads, so it never gets a gradient.'''

    def __init__(self, cfg):
        super().__init__(cfg)
        self.scale = torch.nn.Parameter(torch.ones(cfg.n_head))
"""

NAN = """
from posbench.schemes import PositionalScheme

class NaN(PositionalScheme):
    def embed(self, x, pos):
        return x * float("nan")
"""

CLIFF = """
import torch
from posbench.schemes import PositionalScheme

class Cliff(PositionalScheme):
    '''-log(1 + 3L - d): finite up to distance 3L, NaN past it.'''

    def bias(self, q, k, qpos, kpos, layer):
        dist = (qpos[:, None] - kpos[None, :]).clamp(min=0).float()  # (Tq, Tk)
        return -torch.log1p(3 * self.cfg.train_len - dist)[None, None]  # (1, 1, Tq, Tk)
"""

SKIPS_BIAS = """
import torch
import torch.nn.functional as F
from posbench.schemes import PositionalScheme

class SkipsBias(PositionalScheme):
    # a distance bias, and an attend hook that uses the slope wrongly instead of adding the bias

    def __init__(self, cfg):
        super().__init__(cfg)
        self.slope = torch.nn.Parameter(torch.tensor(0.5))

    def bias(self, q, k, qpos, kpos, layer):
        return -self.slope * (qpos[:, None] - kpos[None, :]).float()[None, None]

    def attend(self, q, k, v, qpos, kpos, layer):
        if q.size(2) != k.size(2):
            return None
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * (1 + self.slope)
"""

DROPS_K_GRAD = """
import torch.nn.functional as F
from posbench.schemes import PositionalScheme

class DropsKGrad(PositionalScheme):
    # the right attention values, but no gradient through k: only gradients can tell

    def attend(self, q, k, v, qpos, kpos, layer):
        if q.size(2) != k.size(2):
            return None
        return F.scaled_dot_product_attention(q, k.detach(), v, is_causal=True)
"""

WRONG_TILES = """
import torch
from posbench.schemes import PositionalScheme
from posbench.schemes.distance import DistanceTable

class WrongTiles(PositionalScheme):
    # a distance bias whose table for the triton backend is off by one distance

    def __init__(self, cfg):
        super().__init__(cfg)
        self.slope = torch.nn.Parameter(torch.tensor(0.5))

    def bias(self, q, k, qpos, kpos, layer):
        return -self.slope * (qpos[:, None] - kpos[None, :]).float()[None, None]

    def tiled_bias(self, qpos, kpos, layer, dtype):
        lo = int(qpos.min() - kpos.max())
        d = torch.arange(lo, int(qpos.max() - kpos.min()) + 1).float()
        values = -self.slope * (d + 1)  # (n,): the slope at the next distance
        return DistanceTable(values.expand(self.cfg.n_head, -1), lo, qpos, kpos, dtype)
"""

# scheme -> the checks it must fail (the others must pass), and a phrase of the reason
BREAKS = {
    "Leaky": (LEAKY, {"causality"}, "the future leaks into the past"),
    "Unused": (UNUSED, {"backward"}, "parameters with no gradient: scheme.scale"),
    "NaN": (NAN, {"causality", "forward", "backward", "beyond length"}, "non-finite logits"),
    "Cliff": (CLIFF, {"beyond length"}, "non-finite logits at length 64"),
    "SkipsBias": (SKIPS_BIAS, {"attend"}, "attend's logits differ from the eager formula's"),
    "DropsKGrad": (DROPS_K_GRAD, {"attend"}, "attend's gradient of tok.weight differs from the eager formula's"),
    "WrongTiles": (WRONG_TILES, {"tiled bias"}, "tiled_bias stands for a bias that differs from `bias`"),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_check_scheme_names_the_check_that_fails(on_path, name):
    source, failing, reason = BREAKS[name]
    module = on_path(f"plug_{name.lower()}", source)
    res = invoke("check-scheme", f"{module}:{name}")
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    order = ["build", "causality", "forward", "backward", "beyond length", "attend", "tiled bias"]
    for c in order:
        assert row(res.output, c) == ("FAIL" if c in failing else "pass"), c
    assert reason in " ".join(res.output.replace("│", " ").split()), res.output
    assert f"failed: {', '.join(c for c in order if c in failing)}" in res.output


def test_leaky_plugin_fails_the_same_causality_check_the_tests_use(on_path):
    module = on_path("plug_leaky2", LEAKY)
    model = check.tiny_model(f"{module}:Leaky")
    with pytest.raises(check.CheckFailed, match="changed the logits of earlier positions"):
        check.causality(model, 16)


def test_a_registered_name_passes_check_scheme():
    res = invoke("check-scheme", "rope")
    assert res.exit_code == 0, res.output
    assert row(res.output, "causality") == "pass"


# --- a console script does not have the working directory on sys.path -----------------------


def test_console_script_imports_a_plugin_from_the_working_directory(tmp_path):
    """Run as `posbench` (a script elsewhere on disk), not `python -m`, from a folder holding
    the plugin. main() puts the folder on sys.path; calling the typer app directly does not."""
    work, bindir = tmp_path / "work", tmp_path / "bin"
    work.mkdir(), bindir.mkdir()
    (work / "cwd_plugin.py").write_text(
        "from posbench.schemes import PositionalScheme\n\nclass Mine(PositionalScheme):\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outcome = {}
    for entry in ("main", "app"):  # as the console script does, and the bare app, without main()'s sys.path entry
        script = bindir / f"posbench_{entry}.py"
        script.write_text(f"import sys\nfrom posbench.cli import {entry}\nsys.exit({entry}())\n")
        res = subprocess.run(
            [sys.executable, str(script), "inspect", "cwd_plugin:Mine"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        outcome[entry] = (res.returncode, res.stdout + res.stderr)
    assert outcome["main"][0] == 0, outcome["main"][1]
    assert "nothing to draw" in outcome["main"][1]  # it loaded: the plugin is a no-op
    assert outcome["app"][0] != 0 and "cannot import module 'cwd_plugin'" in outcome["app"][1]


def test_an_attend_hook_of_the_wrong_shape_is_named(on_path):
    module = on_path(
        "plug_badshape",
        """
from posbench.schemes import PositionalScheme

class BadShape(PositionalScheme):
    def attend(self, q, k, v, qpos, kpos, layer):
        return q.sum(-1)
""",
    )
    res = invoke("check-scheme", f"{module}:BadShape")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "attend returned (2, 4, 16), expected None or shape (2, 4, 16, 8)" in " ".join(
        res.output.replace("│", " ").split()
    )


WRONG_BIAS = """
import torch
from posbench.schemes import PositionalScheme

class WrongBias(PositionalScheme):
    def bias(self, q, k, qpos, kpos, layer):
        return torch.zeros(1, 1, 3, 3, dtype=q.dtype)
"""


def test_a_bias_of_the_wrong_shape_is_named_in_training(on_path, tmp_path, corpus_file):
    """Not torch's shape error from inside a backend: the scheme, its bias's shape and the shape
    it must broadcast to, with a bug's exit status (the scheme's, not the input's), and nothing
    left on disk."""
    module = on_path("plug_wrongbias", WRONG_BIAS)
    out = tmp_path / "r"
    scheme = f"{module}:WrongBias"
    res = invoke("train", "--config", SMOKE, "--scheme", scheme, "--set", f"out_dir={out}", "--set", "train.steps=2")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    line = res.output.strip().splitlines()[-1]
    assert f"scheme '{module}:WrongBias': its bias is (1, 1, 3, 3), expected None or a tensor that broadcasts" in line
    assert not any((out / "smoke").glob("*-seed0"))


@pytest.mark.parametrize("shape", [(1, 4, 16, 16), (2, 1, 16, 16), (1, 1, 1, 16)])
def test_a_bias_that_broadcasts_is_taken(shape):
    """Every dimension of size 1 or the attention's own: the check refuses only what no backend
    could add, and gives every backend each head and query (flex and triton index them)."""
    from posbench.attention import scheme_bias

    class Broadcasts(PositionalScheme):
        def bias(self, q, k, qpos, kpos, layer):
            return torch.ones(shape)

    scheme = Broadcasts(ModelConfig(n_head=4, d_model=32, train_len=16))
    q = torch.zeros(2, 4, 16, 8)
    got = scheme_bias(q, q, torch.arange(16), torch.arange(16), scheme, 0)
    assert got.shape == (shape[0], 4, 16, 16) and (got == 1).all()


def test_a_tensor_a_plugin_module_makes_at_import_stays_on_the_cpu(on_path):
    """A scheme given options is first sized on the meta device; its module is imported before,
    so a tensor made at import is a real one, and the model built after it runs."""
    from posbench.model import TransformerLM

    module = on_path(
        "plug_module_tensor",
        """
import torch
from posbench.schemes import PositionalScheme

SLOPES = torch.ones(4)

class Sloped(PositionalScheme):
    options = {"scale": 1.0}

    def bias(self, q, k, qpos, kpos, layer):
        d = (qpos[:, None] - kpos[None, :]).to(q.dtype)  # (Tq, Tk)
        return (-self.opt["scale"] * SLOPES.to(q.dtype)[:, None, None] * d).unsqueeze(0)  # (1, H, Tq, Tk)
""",
    )
    cfg = ModelConfig(scheme=f"{module}:Sloped", n_head=4, d_model=32, train_len=16, options={"scale": 0.5})
    model = TransformerLM(cfg)
    assert sys.modules[module].SLOPES.device.type == "cpu"
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


# --- check-scheme takes a scheme's options; its rules and its imports are explained ----------


def test_check_scheme_passes_options_to_the_scheme(repo_on_path):
    """`check-scheme NAME --set option=value`: the scheme is built with them, and they are checked."""
    res = invoke("check-scheme", EXAMPLE, "--set", "window=3")
    assert res.exit_code == 0, res.output
    assert "window=3" in " ".join(res.output.replace("│", " ").split()), res.output
    results = check.run_checks(EXAMPLE, {"window": 3})
    assert all(r.ok for r in results) and "window=3" in results[0].reason
    res = invoke("check-scheme", EXAMPLE, "--set", "windw=3")  # refused before any check, blamed on the flag
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--set windw=3" in res.output and "did you mean 'window'" in res.output, res.output
    res = invoke("check-scheme", "rope", "--set", "base.x=5")  # an option given as a section of its own
    assert res.exit_code == 2 and "--set base.x=5: scheme_options.rope.base: expected float" in res.output


CACHED_TABLE = """
import torch
from posbench.schemes import PositionalScheme

class {name}(PositionalScheme):
    '''A distance bias read from a (T, T) table built for the length it first sees.'''

    def __init__(self, cfg):
        super().__init__(cfg)
        self.slope = torch.nn.Parameter(torch.tensor(0.5))

    def bias(self, q, k, qpos, kpos, layer):
        T = q.size(2)
        pos = torch.arange(T)
        table = (pos[:, None] - pos[None, :]).float()  # (T, T)
        {ret}
"""


@pytest.mark.parametrize(
    "name, ret",
    [
        ("WholeTable", "return -self.slope * table[None, None]  # (1, 1, T, T): wrong on blocks"),
        ("IndexedTable", "return -self.slope * table[qpos][:, kpos][None, None]  # out of range on blocks"),
    ],
)
def test_a_bias_from_a_cached_table_is_told_the_rule(on_path, name, ret):
    """A bias built from a (T, T) table works on the whole sequence and breaks on blocks of
    queries: check-scheme names the rule, not a RuntimeError."""
    module = on_path(f"plug_{name.lower()}", CACHED_TABLE.format(name=name, ret=ret))
    res = invoke("check-scheme", f"{module}:{name}")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert row(res.output, "causality") == "FAIL"
    said = " ".join(res.output.replace("│", " ").split())
    assert "bias is called on blocks of queries" in said and "never from a cached (T, T) table" in said, said


def test_a_plugin_module_not_found_hints_at_the_working_directory(on_path):
    res = invoke("check-scheme", "no_such_pkg_xyz.mine:Thing")
    assert res.exit_code == 2 and res.output.strip().count("\n") == 0, res.output
    assert "run posbench from the folder that holds no_such_pkg_xyz/mine.py" in res.output, res.output
    module = on_path("plug_needs_dep", "import no_such_dependency_xyz\n")  # found, but its import is not
    res = invoke("check-scheme", f"{module}:Thing")
    assert "No module named 'no_such_dependency_xyz'" in res.output and "run posbench from" not in res.output


def test_a_file_named_like_a_library_where_the_user_stands_never_runs(tmp_path):
    """The working directory is searched for a module:Class plugin after the installed
    packages: a tokenizers.py there does not replace the library that trains a BPE."""
    import subprocess
    import sys

    (tmp_path / "tokenizers.py").write_text("raise SystemExit('the local tokenizers.py ran')\n")
    (tmp_path / "small.txt").write_text("to be or not to be that is the question\n" * 200)
    # as the console script starts it: `python -c` would put the working directory first itself
    code = "import sys; from posbench.cli import main; sys.argv = ['posbench', *sys.argv[1:]]; main()"
    args = ["prepare", "small.txt", "--tokenizer", "bpe", "--vocab-size", "300", "--out", "prepared"]
    res = subprocess.run([sys.executable, "-P", "-c", code, *args], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0 and "local tokenizers.py ran" not in res.stderr, res.stderr
    assert (tmp_path / "prepared" / "tokens.json").is_file()


# --- a run folder's records name a user's module: report imports nothing, the rest say so -----

PLAIN = "from posbench.schemes import PositionalScheme\n\n\nclass Mine(PositionalScheme):\n    pass\n"


def test_a_module_that_only_a_run_folder_names_is_said_before_it_is_imported(on_path, tmp_path, corpus_file):
    """A results folder can name any module:Class. Named on the command line, it imports
    without a word; named only by a run's records, one line names the module and its file
    before it runs; report and status import none of it."""
    module = on_path("plug_recorded", PLAIN)
    out = tmp_path / "r"
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", f"{module}:Mine",
        "--set", f"out_dir={out}", "--set", f"data.path={corpus_file}", "--set", "train.steps=2",
    )  # fmt: skip
    assert res.exit_code == 0 and "importing module" not in res.output, res.output
    run = out / "smoke" / f"{module}_Mine-seed0"
    del sys.modules[module]
    (tmp_path / f"{module}.py").write_text("raise SystemExit('plug_recorded ran')\n")  # would end the command
    for command in ("report", "status"):
        res = invoke(command, out / "smoke")
        assert res.exit_code == 0 and "importing module" not in res.output, res.output
    sys.modules.pop(module, None)
    (tmp_path / f"{module}.py").write_text(PLAIN + "\nprint('plug_recorded ran')\n")
    res = invoke("inspect", run, "--out", tmp_path / "drawn")
    assert res.exit_code == 0, res.output
    said = res.output.splitlines()
    assert said[0] == (
        f"note: {run} names scheme '{module}:Mine', not one of posbench's: importing module '{module}' "
        f"({tmp_path / module}.py)"
    ), res.output
    assert said[1] == "plug_recorded ran"  # after the line, not before
