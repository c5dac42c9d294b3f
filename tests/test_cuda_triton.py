"""posbench's Triton kernels (model.attention=triton) as a GPU runs them: against eager in fp32
and under bf16 autocast, per parameter, at the GPU's tiles. Skipped without CUDA; with
POSBENCH_TRITON_ON_CPU=1 they run on a CPU under Triton's interpreter at the same tiles, fp16
standing in for bf16 (the interpreter multiplies bf16 wrongly): about 4 minutes on 2 cores, a
check of a change to the kernels before a GPU sees it.
"""

import dataclasses
import importlib.util
import os

import pytest
import torch
from conftest import outputs_and_grads

from posbench import attention, check, kernels
from posbench.schemes import SCHEMES
from posbench.schemes.distance import DistanceTable

ON_CPU = os.environ.get("POSBENCH_TRITON_ON_CPU") == "1"
DEVICE, HALF = ("cpu", torch.float16) if ON_CPU else ("cuda", torch.bfloat16)
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU and importlib.util.find_spec("triton")),
    reason="needs a CUDA device (or POSBENCH_TRITON_ON_CPU=1 and Triton)",
)
ALL = sorted(SCHEMES)


@pytest.fixture(autouse=True)
def _gpu_tiles(monkeypatch):
    """The interpreter's tiles as the GPU's, so a CPU run meets the same tile edges."""
    monkeypatch.setattr(kernels, "INTERPRETED_BLOCK", kernels.BLOCK)


def _per_parameter(model, x, backend, block, half=False):
    """Logits and each parameter's gradient of a random projection of them (every gradient of
    order 1), under `backend`; with `half`, the forward under bf16 autocast, as training runs it
    (fp16 on a CPU)."""
    model.cfg = dataclasses.replace(model.cfg, attention=backend)
    model.attn_block = block
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=HALF, enabled=half):
        y = model(x)
    w = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(1), device=y.device)
    (y.float() * w).sum().backward()
    return y.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _largest_gaps(model, x, block):
    """The triton backend against eager: the logits' largest gap, and each parameter's gradient's
    largest gap relative to 1 + its own largest value (a gradient that is zero but for rounding,
    FIRE's last bias, is read against 1)."""
    torch.manual_seed(2)  # randomized and offset draw their training positions: the same draw for both
    y1, g1 = _per_parameter(model, x, "triton", block)
    torch.manual_seed(2)
    y0, g0 = _per_parameter(model, x, "eager", block)
    assert g1.keys() == g0.keys() and all(torch.isfinite(g).all() for g in g1.values())
    gaps = {n: ((g1[n] - g0[n]).abs().max() / (1 + g0[n].abs().max())).item() for n in g0}
    return (y1 - y0).abs().max().item(), gaps


# in the order pytest runs them: a run its limit cuts (.ci/gpu triton) keeps the quick and head-64 checks


@pytest.mark.parametrize("scheme", ["alibi", "t5", "kerple_log", "fire"])
def test_cuda_triton_takes_a_table_or_fires_lines_whole_and_never_dense(scheme, monkeypatch):
    from posbench.schemes.fire import FIRE

    model = check.tiny_model(scheme, train_len=64, d_model=64).to(DEVICE).train()
    model.cfg = dataclasses.replace(model.cfg, attention="triton")
    monkeypatch.setattr(DistanceTable, "dense", lambda *a: pytest.fail("triton built a table's dense bias"))
    monkeypatch.setattr(FIRE, "bias", lambda *a: pytest.fail("triton built FIRE's dense bias"))
    calls = []
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a) or real(*a))
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outputs_and_grads(model, x, 16)
    assert not calls  # all 64 queries in one call of the kernels, never in blocks through _attend


@pytest.mark.parametrize("scheme", ["nope", "alibi", "t5", "kerple_log", "fire", "xl"])
def test_cuda_triton_trains_under_bf16_autocast_as_eager_does(scheme):
    """At a head of 64 and 300 tokens (five tiles), in bf16: the logits and every parameter's
    gradient as near fp32's as eager's own bf16 run comes, within twice its worst. Rounding alone
    moves a direction softmax ignores (FIRE's last bias, whose fp32 gradient is zero but for
    rounding) by 10% of 1 under eager in bf16, so each kernel is held to eager's rounding, not to
    a fixed tolerance (with fp16 under the interpreter, triton's worst is 0.5x to 1.1x eager's)."""
    model = check.tiny_model(scheme, train_len=300, d_model=256, n_head=4).to(DEVICE).train()
    x = torch.randint(0, 256, (4, 300), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.manual_seed(2)
    y32, g32 = _per_parameter(model, x, "eager", 10_000)
    errors = {}
    for backend in ("eager", "triton"):
        torch.manual_seed(2)
        y, g = _per_parameter(model, x, backend, 10_000, half=True)
        assert g.keys() == g32.keys() and all(torch.isfinite(t).all() for t in g.values()), backend
        rel = {n: ((g[n] - g32[n]).abs().max() / (1 + g32[n].abs().max())).item() for n in g32}
        errors[backend] = (y - y32).abs().max().item(), rel
    (y_eager, eager), (y_triton, triton) = errors["eager"], errors["triton"]
    assert y_triton <= 2 * y_eager, (y_triton, y_eager)
    worst = max(eager.values())
    assert all(e <= 2 * worst for e in triton.values()), ({n: e for n, e in triton.items() if e > 2 * worst}, worst)


@pytest.mark.parametrize("scheme", ALL + ["rnope_swa", "irope"])
@pytest.mark.parametrize("T", [40, 150])  # within one tile of 64, and across three
def test_cuda_triton_equals_eager_in_outputs_and_gradients(scheme, T):
    model = check.tiny_model(scheme, train_len=T, d_model=64).to(DEVICE).train()  # head_dim 16
    x = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits, gaps = _largest_gaps(model, x, 48)
    assert logits <= 2e-5 and max(gaps.values()) <= 1e-4, (logits, gaps)
