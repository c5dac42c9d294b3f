"""The GPU path, on a machine that has one (skipped elsewhere, so CI's CPU never runs these).

Every scheme's CUDA model must compute what its CPU twin does (the CPU path is checked against
plain attention in test_schemes.py), through SDPA's kernels and query blocks, and must train
under the bf16 autocast that run.py uses there.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import outputs_and_grads

from posbench import attention, check
from posbench.attention import BiasedAttention
from posbench.schemes import SCHEMES
from posbench.schemes.distance import DistanceTable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ALL = sorted(SCHEMES)


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("T", [24, 21])  # a multiple of the block and not
def test_cuda_fp32_matches_the_cpu(scheme, T):
    cpu = check.tiny_model(scheme, train_len=T)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    for block in (8, 10_000):
        y0, g0 = outputs_and_grads(cpu, x, block)
        y1, g1 = outputs_and_grads(gpu, x.cuda(), block)
        assert torch.allclose(y1, y0, atol=2e-5), (block, (y1 - y0).abs().max())
        assert torch.allclose(g1, g0, atol=2e-5), (block, (g1 - g0).abs().max())


@pytest.mark.parametrize("scheme", ALL)
def test_cuda_trains_under_bf16_autocast(scheme):
    model = check.tiny_model(scheme).cuda().train()
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x[:, :-1])
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("Tq,Tk", [(37, 37), (16, 53)])  # whole, and a later block of queries
@pytest.mark.parametrize("shared", [True, False])  # one bias for the batch (T5), or per row (XL)
def test_a_learned_bias_per_row_takes_sdpa_and_its_gradient_matches_the_math_path(Tq, Tk, shared):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 3, Tq, 16, device="cuda", generator=g, requires_grad=True)
    k, v = (torch.randn(2, 3, Tk, 16, device="cuda", generator=g, requires_grad=True) for _ in range(2))
    bias = torch.randn(1 if shared else 2, 3, Tq, Tk, device="cuda", generator=g, requires_grad=True)
    q0 = Tk - Tq
    calls = []
    real = BiasedAttention.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BiasedAttention, "apply", lambda *a: calls.append(1) or real(*a))
        got = attention.sdpa(q, k, v, bias, q0)
    # a bias per batch row goes to SDPA, which returns its gradient; a shared one (T5's) to the
    # hand-written math path, which measured faster for it
    assert calls == ([1] if shared else [])
    future = torch.arange(Tk, device="cuda")[None, :] > torch.arange(q0, Tk, device="cuda")[:, None]
    mask = torch.zeros(Tq, Tk, device="cuda").masked_fill_(future, float("-inf"))
    want = BiasedAttention.apply(q, k, v, bias, mask)
    assert torch.allclose(got, want, atol=2e-5)
    gots = torch.autograd.grad(got.square().sum(), (q, k, v, bias))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v, bias))
    for a, b in zip(gots, wants):  # a shared bias's gradient sums the batch: its rounding, twice
        assert torch.allclose(a, b, atol=5e-5), (a - b).abs().max()


@pytest.mark.parametrize("scheme", ["nope", "rope", "alibi", "t5", "hybrid", "kerple_log", "kerple_power", "fire"])
def test_cuda_flex_equals_eager_in_outputs_and_gradients(scheme):
    model = check.tiny_model(scheme, train_len=40, d_model=64).cuda().train()  # head_dim 16, flex's least on CUDA
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for backend in ("eager", "flex"):
        model.cfg = dataclasses.replace(model.cfg, attention=backend)
        results.append(outputs_and_grads(model, x, 16))
    (y0, g0), (y1, g1) = results
    assert torch.allclose(y1, y0, atol=2e-5), (y1 - y0).abs().max()
    assert torch.allclose(g1, g0, atol=2e-5), (g1 - g0).abs().max()


@pytest.mark.parametrize("scheme, runs_as", [("alibi", "flex"), ("t5", "flex"), ("fire", "sdpa"), ("nope", "sdpa")])
def test_cuda_auto_takes_flex_for_a_table_and_equals_eager(scheme, runs_as):
    """auto, the default, on a GPU at flex's least head dim: flex for a table over distances,
    sdpa for the rest, in outputs and gradients equal to eager under each."""
    model = check.tiny_model(scheme, train_len=40, d_model=64).cuda().train()  # head_dim 16
    assert model.cfg.attention == "auto" and model.backend(torch.device("cuda")) == runs_as
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    got = outputs_and_grads(model, x, 16)
    model.cfg = dataclasses.replace(model.cfg, attention="eager")
    want = outputs_and_grads(model, x, 16)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=2e-5), (a - b).abs().max()


@pytest.mark.parametrize("scheme", ["alibi", "t5", "kerple_log", "kerple_power"])
def test_cuda_flex_trains_a_distance_bias_from_its_table_whole_and_compiled_once(scheme, monkeypatch):
    """A bias of distance alone trains through flex's score_mod reading its table (ALiBi's computed
    from its slopes): no dense
    (Tq, Tk) bias, all queries in one call past the query block, and after the first step no
    recompilation (the table and the mask's offset are tensors, not constants)."""
    model = check.tiny_model(scheme, train_len=64, d_model=64).cuda().train()  # head_dim 16
    model.cfg = dataclasses.replace(model.cfg, attention="flex")
    model.attn_block = 16  # 64 queries would be 4 blocks on any other backend
    monkeypatch.setattr(DistanceTable, "dense", lambda *a: pytest.fail("flex built the dense bias"))
    calls = []
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a[0].size(2)) or real(*a))
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    outputs_and_grads(model, x, 16)
    assert set(calls) == {64}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            outputs_and_grads(model, x, 16)


def test_cuda_flex_stays_compiled_across_schemes_lengths_and_gradients():
    """The bench's and a study's mix in one process (six schemes, training and scoring at four
    lengths) stays under the compiled flex's recompile limit: past it dynamo would run flex
    uncompiled, whose (Tq, Tk) scores a long evaluation cannot hold; here it raises instead."""
    x = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for scheme in ("nope", "rope", "alibi", "t5", "kerple_log", "fire"):
            model = check.tiny_model(scheme, train_len=64, d_model=64).cuda()  # head_dim 16
            model.cfg = dataclasses.replace(model.cfg, attention="flex")
            outputs_and_grads(model.train(), x[:, :64], 16)
            with torch.no_grad():
                for T in (64, 128, 192, 256):
                    model.eval()(x[:, :T])


def test_cuda_eval_memory_under_flex_is_read_after_the_first_forward_which_is_timed_apart():
    from posbench.bench import eval_peak_memory_mb, first_forward_s

    model = check.tiny_model("t5", train_len=64, d_model=64).cuda().eval()
    model.cfg = dataclasses.replace(model.cfg, attention="flex")
    first = first_forward_s(model, 256)
    mb = eval_peak_memory_mb(model, 256)
    assert first > 0 and 0 < mb
    assert eval_peak_memory_mb(model, 256) == pytest.approx(mb, rel=0.05)  # compiled once: the same peak again
