"""A bias of distance alone is a per-head table over distances: equal to its formula at every
(query, key), read by flex inside its score_mod without a (Tq, Tk) bias, its mask built once."""

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import flex_attention as flex_module

from posbench import attention
from posbench.check import tiny_model
from posbench.schemes.alibi import ALiBi, alibi_slopes
from posbench.schemes.distance import DistanceBias, DistanceTable
from posbench.schemes.t5 import t5_relative_bucket

CPU = torch.device("cpu")
SCHEMES = ["alibi", "t5", "hybrid", "kerple_log", "kerple_power"]


def formula(scheme, qpos, kpos, layer):
    """Each scheme's bias written out over the whole (Tq, Tk) grid, as the papers give it: (1, H, Tq, Tk)."""
    d = (qpos[:, None] - kpos[None, :]).float()  # (Tq, Tk)
    name = scheme.cfg.scheme
    if name == "alibi":
        return (-alibi_slopes(scheme.cfg.n_head)[:, None, None] * d)[None]
    if name in ("t5", "hybrid"):
        t5 = scheme.relative if name == "hybrid" else scheme
        b = t5_relative_bucket(-d, False, t5.opt["num_buckets"], t5.opt["max_distance"])  # (Tq, Tk)
        return (t5.table[b] * t5.scale).permute(2, 0, 1)[None]
    r1, r2 = (scheme.r1[layer], scheme.r2[layer]) if scheme.per_layer else (scheme.r1, scheme.r2)
    r1 = r1.clamp(min=scheme.eps)[:, None, None]
    r2 = r2.clamp(min=scheme.eps, max=scheme.r2_max)[:, None, None]
    dist = d.clamp(min=0)
    power = name == "kerple_power"
    return (-r1 * (dist.pow(r2) if power else torch.log1p(r2 * dist)))[None]


def _positions(kind: str):
    """(qpos, kpos): a whole window, a block of its later queries, and a remap's fractional ones."""
    if kind == "whole":
        return torch.arange(12), torch.arange(12)
    if kind == "block":
        return torch.arange(8, 12), torch.arange(12)
    return torch.arange(12) * 0.75, torch.arange(12) * 0.75


@pytest.mark.parametrize("kind", ["whole", "block", "fractional"])
@pytest.mark.parametrize("options", [{}, {"per_layer": True}])
@pytest.mark.parametrize("name", SCHEMES)
def test_the_table_equals_the_formula_and_passes_its_gradient(name, options, kind):
    if options and not name.startswith("kerple"):
        pytest.skip("per_layer is KERPLE's")
    model = tiny_model(name, options=options).train()
    scheme, layer = model.scheme, 1
    assert isinstance(scheme, DistanceBias)
    qpos, kpos = _positions(kind)
    params = list(scheme.parameters())
    got = scheme_bias(scheme, qpos, kpos, layer)
    want = formula(scheme, qpos, kpos, layer)
    assert got.shape == want.shape == (1, scheme.cfg.n_head, len(qpos), len(kpos))
    if name.startswith("kerple"):  # log1p and pow over a vector round apart from over a grid, by an ulp
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # a product or a lookup: the very values
        assert torch.equal(got, want), (got - want).abs().max()
    if params:  # learned: the same gradient reaches each parameter through the table
        w = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
        g_got = torch.autograd.grad((got * w).sum(), params)
        g_want = torch.autograd.grad((formula(scheme, qpos, kpos, layer) * w).sum(), params)
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def scheme_bias(scheme, qpos, kpos, layer):
    q = torch.zeros(1, scheme.cfg.n_head, len(qpos), scheme.cfg.head_dim)
    k = torch.zeros(1, scheme.cfg.n_head, len(kpos), scheme.cfg.head_dim)
    return scheme.bias(q, k, qpos, kpos, layer)


def test_the_table_holds_each_distance_once():
    """Tq + Tk - 1 columns for a window's queries and keys, not Tq x Tk values."""
    scheme = tiny_model("kerple_log").scheme
    table = scheme.distance_table(torch.arange(100, 164), torch.arange(164), 0, torch.float32)
    assert table.values.shape == (scheme.cfg.n_head, 64 + 164 - 1) and table.lo == 100 - 163
    assert scheme.distance_table(torch.arange(4) * 0.5, torch.arange(4) * 0.5, 0, torch.float32) is None


@pytest.mark.parametrize("name", SCHEMES)
def test_flex_reads_the_table_in_its_score_mod_and_never_the_dense_bias(name, monkeypatch):
    """flex equals eager, whole and in query blocks, with the dense (Tq, Tk) form of the table
    never built: FlexAttention on a CPU runs forward only."""
    model = tiny_model(name)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        monkeypatch.setattr(DistanceTable, "dense", lambda *a: pytest.fail("flex built the dense bias"))
        model.cfg.attention = "flex"
        for block in (40, 16):
            model.attn_block = block
            got = model(x)
            assert (got - want).abs().max().item() <= 1e-5, (name, block)


def test_flex_builds_its_causal_block_mask_once_per_shape(monkeypatch):
    calls = []
    real = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **kw: calls.append(a[3:5]) or real(*a, **kw))
    attention._causal_block_mask.cache_clear()
    model = tiny_model("t5")  # 2 layers
    model.cfg.attention = "flex"
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(3):
            model(x)
    assert calls == [(24, 24)]  # one mask for 3 forward passes of 2 layers
    with torch.no_grad():
        model(x[:, :16])
    assert calls == [(24, 24), (16, 16)]


@pytest.mark.parametrize(
    "name,flex,sdpa",
    [("nope", True, True), ("rope", True, True), ("alibi", True, False), ("t5", True, False)]
    + [("kerple_log", True, False), ("fire", False, False), ("xl", False, False), ("cope", False, False)]
    + [("stickbreaking", False, False), ("rnope_swa", False, False)],
)
def test_on_a_gpu_all_queries_go_at_once_only_where_no_dense_bias_is_held(name, flex, sdpa):
    """Decided from the scheme, the backend and the positions; a CPU keeps its blocks."""
    scheme = tiny_model(name).scheme
    gpu, cpu = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16), SimpleNamespace(is_cuda=False)
    pos = torch.arange(40)
    assert attention.whole_window(gpu, pos, scheme, "flex") is flex
    assert attention.whole_window(gpu, pos, scheme, "sdpa") is sdpa
    fp32 = SimpleNamespace(is_cuda=True, dtype=torch.float32)  # SDPA may fall back to its math kernel
    assert attention.whole_window(fp32, pos, scheme, "flex") is flex
    assert not attention.whole_window(fp32, pos, scheme, "sdpa")
    for backend in ("flex", "sdpa", "eager", "native"):
        assert not attention.whole_window(cpu, pos, scheme, backend)
    assert not attention.whole_window(gpu, pos, scheme, "eager")
    if flex and not sdpa:  # a table needs whole-number positions, one row for the batch
        assert not attention.whole_window(gpu, pos * 0.5, scheme, "flex")
        assert not attention.whole_window(gpu, pos.expand(2, 40), scheme, "flex")


class WindowedALiBi(ALiBi):
    """A user's scheme: ALiBi's `bias` overridden to hide keys 4 or more back, a bias no table over
    distances holds."""

    def bias(self, q, k, qpos, kpos, layer):
        far = (qpos[:, None] - kpos[None, :]) >= 4  # (Tq, Tk)
        return super().bias(q, k, qpos, kpos, layer).masked_fill(far, float("-inf"))  # (1, H, Tq, Tk)


def test_a_subclass_that_overrides_bias_keeps_its_bias_under_flex():
    """flex reads the table only where `bias` is the table's own; an override is read dense,
    and on a GPU keeps its blocks of queries."""
    model = tiny_model("alibi")
    model.scheme = WindowedALiBi(model.cfg)
    for blk in model.blocks:
        blk.attn.scheme[0] = model.scheme
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        model.cfg.attention = "flex"
        for block in (40, 16):
            model.attn_block = block
            assert (model(x) - want).abs().max().item() <= 1e-5, block
    gpu = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert not attention.whole_window(gpu, torch.arange(40), model.scheme, "flex")


@pytest.mark.parametrize("options", [{}, {"per_layer": True}])
@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log"])
def test_torch_compile_traces_a_distance_bias_in_one_graph(name, options):
    """train.compile: the table's extent is read from the positions' values (`.tolist()`), which
    would break the graph in every layer that builds one; while tracing, the per-pair formula
    takes its place."""
    if options and not name.startswith("kerple"):
        pytest.skip("per_layer is KERPLE's")
    torch._dynamo.reset()
    model = tiny_model(name, options=options).train()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason)[:120] for r in explained.break_reasons]


def test_flex_computes_a_linear_bias_from_its_slopes_the_very_values_of_its_table():
    """ALiBi's table carries its slopes, and flex computes -slope * distance in its score_mod
    instead of reading the table: the same logits bit for bit (one product of the same fp32
    numbers), whole and for a block of later queries, and the table's values are never read."""
    scheme = tiny_model("alibi").scheme
    assert torch.equal(scheme.linear_slopes(0), alibi_slopes(scheme.cfg.n_head))
    assert tiny_model("t5").scheme.linear_slopes(0) is None and tiny_model("kerple_log").scheme.linear_slopes(0) is None
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(0)
    for qpos, kpos in ((torch.arange(24), torch.arange(24)), (torch.arange(16, 24), torch.arange(24))):
        q, k, v = (torch.randn(2, H, n, D, generator=g) for n in (len(qpos), len(kpos), len(kpos)))
        table = scheme.distance_table(qpos, kpos, 0, torch.float32)
        with torch.no_grad():
            read = attention.flex(
                q, k, v, None, int(qpos[0]), DistanceTable(table.values, table.lo, qpos, kpos, q.dtype)
            )
            table.values = torch.full_like(table.values, float("nan"))  # read, it would show
            computed = attention.flex(q, k, v, None, int(qpos[0]), table)
        assert torch.equal(computed, read)


def test_a_subclass_that_changes_alibis_function_of_distance_is_read_from_its_table():
    """The slopes describe ALiBi's own function: a subclass whose distance_bias is not linear (a
    cap, say) carries none, and flex reads its table, equal to eager."""

    class Capped(ALiBi):
        def distance_bias(self, d, layer):
            return super().distance_bias(d.clamp(max=5), layer)

    model = tiny_model("alibi")
    model.scheme.__class__ = Capped
    assert model.scheme.linear_slopes(0) is None
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        model.cfg.attention = "flex"
        assert (model(x) - want).abs().max().item() <= 1e-5
