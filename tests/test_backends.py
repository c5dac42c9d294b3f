"""The attention switch: every backend equals the eager formula, for every scheme; runs record theirs."""

import dataclasses
import json

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench import attention, kernels, native
from posbench.check import BLOCK, tiny_model
from posbench.config import ATTENTION_BACKENDS, ModelConfig, load_config
from posbench.errors import PosbenchError
from posbench.schemes import SCHEMES, PositionalScheme
from posbench.schemes.alibi import ALiBi

CPU = torch.device("cpu")
NATIVE = native.why_not(8, CPU) is None  # the tiny model's head size
TRITON = kernels.why_not(CPU) is None  # Triton installed (the kernels extra); its interpreter on a CPU
OTHERS = ["sdpa", "flex"] + (["native"] if NATIVE else []) + (["triton"] if TRITON else [])


def run(model, backend, x, w, block, grad=True):
    """Logits and every parameter's gradient under `backend`, `block` queries at a time."""
    model.cfg = dataclasses.replace(model.cfg, attention=backend)
    model.attn_block = block
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        y = model(x)
    if grad:
        (y * w).sum().backward()  # a random projection: every gradient of order 1
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_backend_equals_eager_in_outputs_and_gradients(request, scheme, backend):
    if backend == "native":
        request.getfixturevalue("two_threads")  # the kernel's parallel loops, not one thread's
    torch.manual_seed(0)
    model = tiny_model(scheme).train()
    T = 40 if model.max_len is None or model.max_len >= 40 else model.max_len
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, T), generator=gen)
    w = torch.randn(2, T, 256, generator=gen)
    grad = backend != "flex"  # torch has FlexAttention's forward on a CPU, not its backward
    blocks = (T, BLOCK)  # whole, and in query blocks
    if backend == "triton" and whole_in_triton(model):
        blocks = (T,)  # its kernels take the whole sequence whatever the block: the same call twice
    for block in blocks:
        torch.manual_seed(2)  # randomized draws its training positions: the same draw for both
        y, g = run(model, backend, x, w, block, grad)
        torch.manual_seed(2)
        ref_y, ref_g = run(model, "eager", x, w, block, grad)
        assert (y - ref_y).abs().max().item() <= 1e-5, (scheme, backend, block)
        assert g.keys() == ref_g.keys()
        for n in ref_g:
            gap = (g[n] - ref_g[n]).abs().max().item()
            assert gap <= 1e-5 * (1 + ref_g[n].abs().max().item()), (scheme, backend, block, n, gap)


def whole_in_triton(model) -> bool:
    """Whether the triton backend takes this model's attention whole (attention.causal_attention):
    no bias, or one with a tiled form, and softmax kept."""
    scheme, pos = model.scheme, torch.arange(8)
    if scheme.replaces_softmax:
        return False
    return scheme.tiled_bias(pos, pos, 0, torch.float32) is not None or type(scheme).bias is PositionalScheme.bias


def test_flex_cannot_train_on_a_cpu_and_says_so():
    model = tiny_model("t5").train()
    model.cfg = dataclasses.replace(model.cfg, attention="flex")
    with pytest.raises(PosbenchError, match="no FlexAttention backward on a CPU"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_eager_is_the_formula_written_out():
    """A hand-worked case: one head, two keys, so the softmax can be checked by hand."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # (1, 1, 2, 2)
    k = torch.tensor([[[[1.0, 1.0], [2.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    bias = torch.tensor([[[[0.0, 0.0], [0.5, 0.0]]]])
    out = attention.eager(q, k, v, bias, 0)
    s = torch.tensor([2.0 / 2**0.5 + 0.5, 0.0])  # query 1 against keys 0 and 1
    p = s.softmax(0)
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0])  # query 0 sees key 0 alone
    assert torch.allclose(out[0, 0, 1], p[0] * v[0, 0, 0] + p[1] * v[0, 0, 1])


def test_auto_picks_native_on_a_cpu_where_it_builds_and_sdpa_where_it_cannot(monkeypatch):
    assert attention.backend_for("auto", CPU, 32) == ("native" if NATIVE else "sdpa")
    assert attention.backend_for("auto", CPU, 12) == "sdpa"  # not a multiple of 8
    assert attention.backend_for("auto", torch.device("cuda"), 32) == "sdpa"
    assert attention.backend_for("auto", CPU, 32, compiled=True) == "sdpa"
    monkeypatch.setattr(native, "_loaded", {"attention": None})
    monkeypatch.setitem(native.unavailable, "attention", "turned off by POSBENCH_NATIVE=0")
    assert attention.backend_for("auto", CPU, 32) == "sdpa"
    with pytest.raises(PosbenchError, match="model.attention=native cannot run here: the attention kernel"):
        attention.backend_for("native", CPU, 32)


@pytest.mark.parametrize(
    "scheme, on_a_gpu",
    [("alibi", "flex"), ("t5", "flex"), ("hybrid", "flex"), ("kerple_log", "flex"), ("kerple_power", "flex")]
    + [("nope", "sdpa"), ("rope", "sdpa"), ("fire", "sdpa"), ("xl", "sdpa"), ("cope", "sdpa"), ("rnope_swa", "sdpa")],
)
def test_auto_picks_flex_on_a_gpu_for_a_bias_read_as_a_table_over_distances(scheme, on_a_gpu, monkeypatch):
    """The schemes flex trains faster than sdpa on a GPU (docs/performance.md) are those it reads
    as a table; FIRE's dense bias, XL's and CoPE's, a window and no bias stay on sdpa. Never under
    train.compile (the bias is then the per-pair formula), below flex's least head dimension, on a
    CPU, or where this torch cannot compile flex with a learned bias's gradient."""
    monkeypatch.setattr(attention, "flex_learns_biases", lambda: True)
    cuda = torch.device("cuda")
    model = tiny_model(scheme, d_model=32, n_head=2)  # head dim 16: flex's least on CUDA
    assert model.backend(cuda) == on_a_gpu
    assert model.backend(cuda, compiled=True) == "sdpa"
    assert model.backend(CPU) == attention.backend_for("auto", CPU, model.cfg.head_dim)  # native or sdpa
    assert attention.backend_for("auto", cuda, 8, table=True) == "sdpa"
    assert attention.backend_for("sdpa", cuda, 16, table=True) == "sdpa"  # named outright, it runs
    monkeypatch.setattr(attention, "flex_learns_biases", lambda: False)  # torch < 2.6, or no Triton
    assert model.backend(cuda) == "sdpa"


def test_flex_learns_biases_from_torch_2_6_with_triton(monkeypatch):
    import importlib.util

    for version, triton, want in [("2.11.0+cu130", True, True), ("2.6.0", True, True), ("2.5.1", True, False)] + [
        ("2.13.0+cpu", False, False),
        ("3.0.0a0+git", True, True),
    ]:
        attention.flex_learns_biases.cache_clear()
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, t=triton: object() if t else None)
        assert attention.flex_learns_biases() is want, version
    attention.flex_learns_biases.cache_clear()


def test_a_window_on_a_table_scheme_overrides_its_bias_and_stays_on_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "flex_learns_biases", lambda: True)

    class Windowed(ALiBi):
        def bias(self, q, k, qpos, kpos, layer):
            return super().bias(q, k, qpos, kpos, layer)

    model = tiny_model("alibi", d_model=32, n_head=2)
    assert model.backend(torch.device("cuda")) == "flex"
    model.scheme.__class__ = Windowed
    assert model.backend(torch.device("cuda")) == "sdpa"


def test_native_named_outright_where_it_cannot_run_is_one_clear_error():
    with pytest.raises(PosbenchError, match="head size 12"):
        attention.backend_for("native", CPU, 12)
    with pytest.raises(PosbenchError, match="runs on a CPU, not cuda"):
        attention.backend_for("native", torch.device("cuda"), 32)


def test_flex_on_cuda_below_its_least_head_dimension_is_one_clear_error():
    """torch's inductor refuses to lower FlexAttention for a head dimension under 16 on CUDA,
    with a long traceback (seen on an H200); posbench says so first, and a CPU keeps flex."""
    with pytest.raises(
        PosbenchError, match="needs a head dimension of at least 16, and model.d_model / model.n_head is 8"
    ):
        attention.backend_for("flex", torch.device("cuda"), 8)
    assert attention.backend_for("flex", torch.device("cuda"), 16) == "flex"
    assert attention.backend_for("flex", CPU, 8) == "flex"


def test_an_unknown_backend_is_refused_by_the_config():
    with pytest.raises(PosbenchError, match="model.attention='fast': expected one of auto, eager, sdpa"):
        ModelConfig(attention="fast")
    with pytest.raises(PosbenchError, match="command line: model.attention"):
        load_config(None, values={"model.attention": "fast"})
    assert ATTENTION_BACKENDS == ("auto", "eager", "sdpa", "native", "flex", "triton")


# --- posbench's Triton kernels, beyond what the registry's schemes reach -----------------------

needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed (the kernels extra)")


def kernel_against_eager(form, bias, params, q0=0, Tq=100, T=100, seed=0):
    """The largest gaps between the Triton kernels and the eager formula: the output, then each
    gradient of q, k, v and `params`, each relative to its largest value; and the eager gradients."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, Tq, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 3, T, 16, generator=gen, requires_grad=True) for _ in range(2))
    w = torch.randn(2, 3, Tq, 16, generator=gen)
    inputs = [q, k, v, *params]
    out = kernels.attention(q, k, v, q0, form)
    ref = attention.eager(q, k, v, bias(), q0)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs)
    gaps = [(out - ref).abs().max().item()]
    gaps += [((g - r).abs().max() / (1 + r.abs().max())).item() for g, r in zip(grads, ref_grads)]
    return gaps, ref_grads


@needs_triton
@pytest.mark.parametrize("pattern", ["rnope_swa", "irope", "gemma3"])
def test_triton_equals_eager_for_patterns_whose_windows_hide_whole_tiles_from_a_query(pattern):
    """A window's or chunk's dense bias is -inf over whole tiles of keys for a late query: the
    running softmax must start from nothing there, not from exp(-inf + inf)."""
    torch.manual_seed(0)
    options = {"chunk": 4} if pattern == "irope" else {"window": 4}  # tiles of 32 and more: whole tiles hidden
    model = tiny_model(pattern, options=options).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 70), generator=gen)
    w = torch.randn(2, 70, 256, generator=gen)
    y, g = run(model, "triton", x, w, 70)
    ref_y, ref_g = run(model, "eager", x, w, 70)
    assert torch.isfinite(y).all() and (y - ref_y).abs().max().item() <= 1e-5
    assert g.keys() == ref_g.keys()
    for n in ref_g:
        assert (g[n] - ref_g[n]).abs().max().item() <= 1e-5 * (1 + ref_g[n].abs().max().item()), n


@needs_triton
@pytest.mark.parametrize("step", [1, 3])  # positions that run on by one (diagonals), and with gaps
@pytest.mark.parametrize("q0", [0, 60])  # all queries, and the last 40 as a block
def test_triton_sums_a_tables_gradient_by_distance_whatever_the_positions(step, q0):
    from posbench.schemes.distance import DistanceTable

    T = 100  # tiles of 32 (the interpreter's): diagonal, unmasked and partial ones
    pos = torch.arange(T) * step
    qpos = pos[q0:]
    lo = int(qpos.min() - pos.max())
    values = torch.randn(3, int(qpos.max() - pos.min()) - lo + 1, requires_grad=True)  # (H, n)

    def table():
        return DistanceTable(values, lo, qpos, pos, torch.float32)

    gaps, _ = kernel_against_eager(table(), lambda: table().dense(), [values], q0, T - q0, T)
    assert max(gaps) <= 1e-5, gaps


@needs_triton
@pytest.mark.parametrize("rows", [1, 2])  # a bias the batch shares (its gradient summed), one per row
def test_triton_reads_a_dense_bias_and_returns_its_gradient(rows):
    bias = torch.randn(rows, 3, 100, 100, requires_grad=True)
    gaps, _ = kernel_against_eager(bias, lambda: bias, [bias])
    assert max(gaps) <= 1e-5, gaps


@needs_triton
@pytest.mark.parametrize("L_mult", [1.0, 0.3])  # the threshold at a query's position (a tie), and between
def test_triton_computes_fires_bias_and_the_gradient_of_every_fire_parameter(L_mult):
    from posbench.check import tiny_config
    from posbench.schemes.fire import FIRE

    torch.manual_seed(0)
    fire = FIRE(tiny_config("fire", train_len=32, n_head=3, d_model=48))  # threshold 8 * L_mult
    with torch.no_grad():
        fire.L_mult.fill_(L_mult)
        fire.mlp[0][0].bias.add_(torch.randn(32))  # kinks inside [0, 1], so tiles meet several segments
    pos = torch.arange(100)
    params = [fire.c, fire.L_mult, *fire.mlp[0].parameters()]
    form = fire.tiled_bias(pos, pos, 0, torch.float32)
    assert form.threshold.item() == pytest.approx(8 * L_mult)
    gaps, ref = kernel_against_eager(form, lambda: fire.bias(torch.zeros(1), None, pos, pos, 0), params)
    # the kernel's x is log(1 + c d), torch's log1p(c d): an x within rounding of a kink can take
    # the neighbouring segment, whose line there is the same value but another cell's gradient
    assert max(gaps) <= 1e-4, gaps
    assert all(g.abs().max() > 1e-3 for g in ref[3:5])  # c's and the threshold's: the check reaches them


COMPILE_FOR_H200 = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from posbench import kernels
from posbench.kernels import triton_attention as K

tensors = ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV")
pointers = {"QPOS": "*i32", "KPOS": "*i32", **dict.fromkeys(tensors, "*bf16")}
scalars = dict.fromkeys(("H", "Tq", "Tk", "q0", "lo", "n_values", "sbb", "sbh", "sbt", "sbk"), "i32")
scalars.update(scale="fp32", eps="fp32")
options = {"num_warps": kernels.WARPS, "num_stages": kernels.STAGES}
# every form as training launches it (bf16), the backward's variants, and one form in exact fp32
variants = [(mode, "tf32", mode > 1, True) for mode in range(5)]
variants += [(mode, "tf32", False, True) for mode in (2, 3, 4)] + [(4, "tf32", True, False), (2, "ieee", True, True)]
for mode, dot, learned, shared in variants:
    constants = dict(D=64, BLOCK_D=64, BLOCK=kernels.BLOCK, BIAS=mode, S=33, KW=32, DOT=dot)
    for kernel in (K.forward_kernel, K.backward_q_kernel, K.backward_kv_kernel):
        given = dict(constants, LEARNED=learned, SHARED=shared) if kernel is K.backward_kv_kernel else constants
        names = kernel.arg_names
        types = {**pointers, **dict.fromkeys(tensors, "*fp32")} if dot == "ieee" else pointers
        signature = {a: "constexpr" if a in given else types.get(a, scalars.get(a, "*fp32")) for a in names}
        source = ASTSource(kernel, signature, constexprs=given)
        compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"]
        print("compiled", mode, dot, learned, shared, kernel.fn.__name__)
"""


@needs_triton
def test_every_triton_kernel_compiles_for_an_h200_without_one():
    """The interpreter runs what a GPU's compiler may refuse (a global that is not constexpr, a
    loop-carried type that changes): each kernel, for each form of bias, is compiled here for
    compute capability 9.0 with Triton's own ptxas, as posbench launches it, in a process of its
    own with the interpreter off (Triton decorates its own functions once, at import)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H200], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3 * 10, done.stdout


# --- the model is plain PyTorch: a researcher swaps its parts in model.py alone -------------


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = 8 * cfg.d_model // 3
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def test_a_swiglu_rmsnorm_model_trains_and_evaluates_through_the_normal_code(monkeypatch, tmp_path):
    import posbench.model
    from posbench.experiment.execute import run_experiment
    from posbench.progress import Reporter
    from posbench.resolve import resolve

    monkeypatch.setattr(posbench.model, "MLP", SwiGLU)
    monkeypatch.setattr(posbench.model, "Norm", nn.RMSNorm)
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = load_config(
        None,
        values={
            "out_dir": str(tmp_path / "results"),
            "name": "swiglu",
            "schemes": ["alibi", "rope"],
            "data.path": str(tmp_path / "text.txt"),
            "model.n_layer": 1,
            "model.d_model": 48,
            "model.train_len": 32,
            "train.steps": 20,
            "train.batch_size": 8,
            "train.warmup_steps": 2,
            "train.workers": 1,
            "eval.lengths": [32, 64],
            "eval.tokens": 256,
        },
    )
    exp = run_experiment(resolve(cfg), Reporter())
    for scheme in ("alibi", "rope"):
        rdir = exp / f"{scheme}-seed0"
        state = torch.load(rdir / "model.pt", weights_only=True)["model"]
        assert "blocks.0.mlp.gate.weight" in state and "blocks.0.ln1.bias" not in state  # RMSNorm: no bias
        log = [json.loads(line) for line in (rdir / "train_log.jsonl").read_text().splitlines()]
        assert log[-1]["loss"] < log[0]["loss"]  # it learned something
        rows = (rdir / "eval.csv").read_text().splitlines()
        assert len(rows) == 3 and all(",ok," in r for r in rows[1:])


def test_the_model_file_imports_no_kernel():
    import posbench.model

    source = open(posbench.model.__file__).read()
    assert "native" not in source and "ctypes" not in source
    assert "x = x + self.drop(self.attn(self.ln1(x)" in source


def test_the_package_has_no_import_circle():
    """Module-level imports between posbench's modules form no cycle."""
    import ast
    import pathlib

    import posbench

    root = pathlib.Path(posbench.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        mod = ".".join(("posbench", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posbench"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("posbench"))
        graph[mod] = deps
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph[m]:
            if state.get(d) == "open":
                raise AssertionError(" -> ".join(path[path.index(d) :] + [d]) if d in path else f"{m} -> {d}")
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    config_deps = graph["posbench.config"]
    assert config_deps <= {"posbench.errors"}, config_deps


# --- records ----------------------------------------------------------------------------------


def test_runs_record_their_backend_and_a_mixed_report_says_so(tmp_path, capsys):
    from posbench.experiment.execute import evaluate_run, run_experiment
    from posbench.progress import Reporter
    from posbench.report import write_summary
    from posbench.resolve import resolve

    (tmp_path / "text.txt").write_text("abcdefghij " * 400)
    values = {
        "out_dir": str(tmp_path),
        "name": "mixed",
        "schemes": ["nope", "alibi"],
        "data.path": str(tmp_path / "text.txt"),
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.train_len": 16,
        "train.steps": 3,
        "train.batch_size": 4,
        "train.warmup_steps": 1,
        "eval.lengths": [16, 32],
        "eval.tokens": 128,
        "model.attention": "eager",
    }
    exp = run_experiment(resolve(load_config(None, values=values)), Reporter())
    for run in ("nope-seed0", "alibi-seed0"):
        assert json.loads((exp / run / "train_log.jsonl").read_text().splitlines()[0])["attention"] == "eager"
        assert (exp / run / "eval.csv").read_text().splitlines()[1].rsplit(",", 1)[0].endswith(",ok,eager,bytes")
    write_summary(exp)
    df = pd.read_csv(exp / "summary.csv")
    assert set(df["attention"]) == {"eager"}
    assert "- attention: eager backend (model.attention)" in (exp / "summary.md").read_text()

    evaluate_run(
        exp / "alibi-seed0", {"eval.lengths": ("--lengths 16,32", [16, 32])}, attention="sdpa"
    )  # scored again another way
    write_summary(exp)
    text = (exp / "summary.md").read_text()
    assert "DIFFERENT backends across runs" in text
    assert "trained with eager; scored with sdpa (alibi seed 0), eager (the rest)" in text
    assert "summary.csv" and "sdpa" in (exp / "summary.csv").read_text()

    # a rerun asking for another backend rescores with it, and the checkpoints are reused
    values["model.attention"] = "sdpa"
    run_experiment(resolve(load_config(None, values=values)), Reporter())
    write_summary(exp)
    df = pd.read_csv(exp / "summary.csv")
    assert set(df["attention"]) == {"sdpa"}
    assert "trained with eager, scored with sdpa" in (exp / "summary.md").read_text()


@pytest.mark.parametrize(
    "backend,message",
    [
        ("flex", "model.attention=flex: torch has no FlexAttention backward on a CPU"),
        ("native", "model.attention=native cannot run here: the attention kernel is unavailable"),
        ("triton", "model.attention=triton cannot run here:"),
    ],
)
def test_a_backend_that_cannot_train_here_is_one_line_and_nothing_is_written(monkeypatch, tmp_path, backend, message):
    from conftest import SMOKE, invoke

    if backend == "native":
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setattr(native, "unavailable", {})
        monkeypatch.setenv("POSBENCH_NATIVE", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU runs the Triton kernels only under it
    res = invoke("extrapolate", "--config", SMOKE, "--attention", backend, "--set", f"out_dir={tmp_path / 'r'}")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) <= 3
    assert not (tmp_path / "r").exists()


def test_a_report_whose_schemes_each_ran_one_backend_says_which_and_not_that_runs_differ():
    """auto on a GPU trains ALiBi and T5 through flex and the rest through sdpa: summary.md names
    each backend's schemes. A scheme with two backends across its seeds, or trained with one and
    scored with another, is a mix again."""
    from posbench.measures.perplexity.views import backends_note

    rows = [(s, n, b) for s, b in (("nope", "sdpa"), ("alibi", "flex"), ("t5", "flex")) for n in (0, 1)]
    df = pd.DataFrame(rows, columns=["scheme", "seed", "attention"])
    df.attrs["trained_with"] = {f"{s}-seed{n}": b for s, n, b in rows}
    df.attrs["scheme_of"] = {f"{s}-seed{n}": s for s, n, _ in rows}
    said = "one backend a scheme, trained and scored: flex for alibi, t5; sdpa for nope (model.attention)"
    assert backends_note(df) == said
    assert backends_note(df, short=True) == "one backend a scheme, see summary.md"
    variant_rows = pd.DataFrame(
        [("t5+yarn", 0, "flex"), ("t5+rerope", 0, "eager"), ("nope+rerope", 0, "eager")], columns=df.columns
    )
    both = pd.concat([df, variant_rows], ignore_index=True)
    both.attrs = dict(df.attrs)  # t5+yarn's rows are t5's; a training-free variant's eager is its own
    assert backends_note(both) == f"{said}; nope+rerope, t5+rerope: eager, the training-free variants' own formula"
    df.attrs["trained_with"]["t5-seed1"] = "sdpa"  # trained one way, scored another
    assert backends_note(df).startswith("DIFFERENT backends across runs")
    df.attrs["trained_with"]["t5-seed1"] = "flex"
    df.loc[(df["scheme"] == "alibi") & (df["seed"] == 1), "attention"] = "sdpa"  # two backends in one scheme
    assert backends_note(df).startswith("DIFFERENT backends across runs")


def test_a_run_scored_by_two_backends_is_named_under_each_with_its_lengths():
    """`evaluate --lengths 96 --attention native` on an eager run: its 32 and 96 are native, its
    64 eager. The note names the run under both, with the lengths, never in eager's 'the rest'."""
    from posbench.measures.perplexity.views import backends_note

    rows = [("alibi", 0, L, "eager") for L in (32, 64)] + [("rope", 0, 32, "native"), ("rope", 0, 64, "eager")]
    rows += [("rope", 0, 96, "native"), ("nope", 0, 32, "eager"), ("nope", 0, 64, "eager")]
    df = pd.DataFrame(rows, columns=["scheme", "seed", "length", "attention"])
    df.attrs["trained_with"] = {"alibi-seed0": "eager", "rope-seed0": "eager", "nope-seed0": "eager"}
    said = backends_note(df)
    scored = "eager (alibi seed 0, nope seed 0, rope seed 0 at 64), native (rope seed 0 at 32, 96)"
    assert said.endswith(f"trained with eager; scored with {scored}"), said
    apart = df[df["scheme"] != "rope"].copy()  # each run one backend: the most used one is the rest
    apart.attrs = dict(df.attrs)
    apart.loc[apart["scheme"] == "nope", "attention"] = "native"
    assert backends_note(apart).endswith("scored with native (nope seed 0), eager (the rest)"), backends_note(apart)


def test_a_training_free_variants_rows_name_eager_which_computes_them_and_a_rerun_keeps_them(tmp_path, monkeypatch):
    """rope+rerope attends through its remap's own formula whatever model.attention says, so its
    rows record eager; rope's and rope+yarn's record the backend. A rerun finds every row and
    scores nothing again."""
    from posbench import evaluate
    from posbench.experiment.execute import run_experiment
    from posbench.progress import Reporter
    from posbench.resolve import resolve

    (tmp_path / "text.txt").write_text("abcdefghij " * 400)
    values = {
        "out_dir": str(tmp_path),
        "name": "variants",
        "schemes": ["rope"],
        "data.path": str(tmp_path / "text.txt"),
        "model.n_layer": 1,
        "model.d_model": 32,
        "model.train_len": 16,
        "model.attention": "sdpa",
        "train.steps": 2,
        "train.batch_size": 4,
        "train.warmup_steps": 1,
        "eval.lengths": [16, 32],
        "eval.tokens": 128,
        "eval.perplexity.rope_scaling": ["rerope", "yarn"],
    }
    exp = run_experiment(resolve(load_config(None, values=values)), Reporter())
    rows = pd.read_csv(exp / "rope-seed0" / "eval.csv")
    by_label = rows.groupby("scheme")["attention"].agg(set).to_dict()
    assert by_label == {"rope": {"sdpa"}, "rope+rerope": {"eager"}, "rope+yarn": {"sdpa"}}, by_label
    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: pytest.fail("scored again"))
    run_experiment(resolve(load_config(None, values=values)), Reporter())
    from posbench.report import write_summary

    write_summary(exp)  # one backend, and the variant's eager said apart, not as a mix
    said = "- attention: sdpa backend (model.attention); rope+rerope: eager, the training-free variants' own formula"
    assert said in (exp / "summary.md").read_text()
