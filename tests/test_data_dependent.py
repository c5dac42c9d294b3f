"""The data-dependent schemes against their papers' formulas, written out as slow loops: FoX's
forget gates and stick-breaking attention, in every attention backend, whole and in query blocks."""

import math

import pytest
import torch

from posbench import native
from posbench.check import tiny_model
from posbench.errors import PosbenchError

CPU = torch.device("cpu")
BACKENDS = ["eager", "sdpa"] + (["native"] if native.why_not(8, CPU) is None else [])


def project(attn, x):
    """A layer's q, k, v as (B, H, T, D) lists of python rows, from its input x (B, T, C)."""
    B, T, C = x.shape
    H = attn.n_head
    q, k, v = attn.qkv(x).split(C, dim=2)
    return [t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v)]


def fox_reference(attn, gate, x):
    """Lin et al. 2025: o_i = sum_{j<=i} exp(q_i.k_j/sqrt(d) + D_ij) v_j / sum_j exp(...),
    D_ij = sum_{l=j+1..i} log f_l, f_l = sigmoid(w_h . x_l + b_h); a loop per query and key."""
    B, T, C = x.shape
    q, k, v = project(attn, x)
    H, D = q.size(1), q.size(3)
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            log_f = [math.log(torch.sigmoid(gate.weight[h] @ x[b, t] + gate.bias[h]).item()) for t in range(T)]
            for i in range(T):
                s = [(q[b, h, i] @ k[b, h, j]).item() / math.sqrt(D) + sum(log_f[j + 1 : i + 1]) for j in range(i + 1)]
                m = max(s)
                p = [math.exp(z - m) for z in s]
                for j in range(i + 1):
                    out[b, h, i] += p[j] / sum(p) * v[b, h, j].double()
    return attn.proj(out.float().transpose(1, 2).reshape(B, T, C))  # (B, T, C)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [None, 8])
@torch.no_grad()
def test_fox_attention_is_the_papers_formula(backend, block):
    """Past the training length (16) and in query blocks of 8: the gates are indexed by token,
    so a block's bias is those rows of the whole one."""
    model = tiny_model("fox")
    T = 24
    x = torch.randn(2, T, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    for layer in (0, 1):  # each layer its own gate
        attn = model.blocks[layer].attn
        got = attn(x, torch.arange(T), backend, block)
        want = fox_reference(attn, model.scheme.gates[layer], x)
        assert (got - want).abs().max().item() < 1e-5, (backend, block, layer)


def test_fox_gates_start_as_the_reference_and_learn():
    """Weight N(0, 0.02), bias 0: every gate starts near 1/2, and the gates get gradients."""
    model = tiny_model("fox", seed=0)
    fresh = type(model.scheme)(model.cfg)
    w = torch.cat([g.weight.flatten() for g in fresh.gates])
    assert all(bool((g.bias == 0).all()) for g in fresh.gates)
    assert abs(w.std().item() - 0.02) < 0.004 and len(fresh.gates) == model.cfg.n_layer
    x = torch.randint(0, 256, (2, 20))
    model.train()
    model(x).sum().backward()
    assert all(g.weight.grad.abs().sum() > 0 and g.bias.grad.abs().sum() > 0 for g in model.scheme.gates)


def test_fox_bias_without_its_input_is_one_clear_error():
    scheme = tiny_model("fox").scheme
    q = torch.zeros(1, 4, 5, 8)
    with pytest.raises(PosbenchError, match="observe\\(x, pos, layer\\) must see that input first"):
        scheme.bias(q, q, torch.arange(5), torch.arange(5), 0)


def stick_breaking_reference(attn, x, own=True):
    """Tan et al. 2025: for j < i, A_ij = beta_ij prod_{j<l<i} (1 - beta_il), beta_ij =
    sigmoid(q_i.k_j / sqrt(d)); o_i = sum_{j<i} A_ij v_j, plus (1 - sum_j A_ij) v_i as the
    authors' model adds it (`o + rem[..., None] * v`); a loop per query and key."""
    B, T, C = x.shape
    q, k, v = project(attn, x)
    H, D = q.size(1), q.size(3)
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                beta = [torch.sigmoid(q[b, h, i] @ k[b, h, j] / math.sqrt(D)).item() for j in range(i)]
                taken = 0.0
                for j in range(i):
                    a = beta[j] * math.prod(1 - beta[t] for t in range(j + 1, i))
                    out[b, h, i] += a * v[b, h, j].double()
                    taken += a
                if own:
                    out[b, h, i] += (1 - taken) * v[b, h, i].double()
    return attn.proj(out.float().transpose(1, 2).reshape(B, T, C))  # (B, T, C)


@pytest.mark.parametrize("backend", BACKENDS + ["flex"])
@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize("remainder", ["own", "drop"])
@torch.no_grad()
def test_stick_breaking_attention_is_the_papers_formula(backend, block, remainder):
    """Every backend computes the scheme's own formula, past the training length and in blocks."""
    model = tiny_model("stickbreaking", options={"remainder": remainder})
    T = 24
    # q.k of order 1, so the sticks are neither all taken by the nearest key nor all left over
    x = 3 * torch.randn(2, T, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    attn = model.blocks[0].attn
    got = attn(x, torch.arange(T), backend, block)
    want = stick_breaking_reference(attn, x, own=remainder == "own")
    assert (got - want).abs().max().item() < 1e-5, (backend, block)


def test_stick_breaking_is_stable_where_the_logits_are_large():
    """In log space no share underflows to NaN: logits of +-60 leave finite outputs and gradients,
    and a key with beta = 1 takes the whole stick from every key behind it."""
    q = torch.zeros(1, 1, 4, 2)
    q[..., 0] = 60.0 * 2**0.5
    k = torch.tensor([[[[1.0, 0], [1, 0], [-1, 0], [0, 0]]]], requires_grad=True)  # z = 60, 60, -60, 0
    v = torch.eye(4)[None, None, :, :2].clone().requires_grad_()  # (1, 1, 4, 2)
    from posbench.schemes.stickbreaking import stick_breaking

    out = stick_breaking(q, k, torch.eye(4)[None, None], own=False)  # (1, 1, 4, 4): row i is A_i.
    assert torch.allclose(out[0, 0, 2], torch.tensor([0.0, 1, 0, 0]), atol=1e-6)  # key 1 took it all
    assert torch.allclose(out[0, 0, 3, 2], torch.sigmoid(torch.tensor(-60.0)), rtol=1e-4)
    stick_breaking(q, k, v, own=True).sum().backward()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_stick_breaking_refuses_what_would_ignore_it():
    """A pattern's layers share softmax, and a modifier's positions mean nothing to it: both say so."""
    from posbench.check import tiny_config
    from posbench.model import TransformerLM

    with pytest.raises(PosbenchError, match="stickbreaking replaces softmax with attention of its own"):
        TransformerLM(tiny_config("pattern_sb", options={"layers": ["stickbreaking", "rope"]}))
    with pytest.raises(PosbenchError, match="the modifier's positions would change nothing"):
        TransformerLM(tiny_config("noisy_stickbreaking"))
    with pytest.raises(PosbenchError, match="remainder='keep': expected one of own, drop"):
        TransformerLM(tiny_config("stickbreaking", options={"remainder": "keep"}))


def test_inspect_draws_stick_breakings_weights_and_no_bias():
    """`posbench inspect` draws the weights that attend applies, since there is no bias to draw."""
    from posbench.check import tiny_config
    from posbench.plots import attention_maps, bias_maps
    from posbench.schemes.stickbreaking import StickBreaking, stick_breaking

    scheme = StickBreaking(tiny_config("stickbreaking"))
    maps = attention_maps(scheme, 12, seed=3)  # (H, 12, 12)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 4, 12, 8, generator=g)
    v = torch.randn(1, 4, 12, 8)
    assert torch.allclose(maps.nan_to_num() @ v[0], stick_breaking(q, k, v, own=True)[0], atol=1e-6)
    assert maps.isnan().sum() == 4 * 12 * 11 / 2 and torch.allclose(maps.nansum(-1), torch.ones(4, 12))
    assert bias_maps(scheme, 12) is None and attention_maps(tiny_model("nope").scheme, 12) is None


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("Tq,Tk", [(24, 24), (8, 24), (1, 5)])
def test_stick_breakings_hand_backward_equals_autograd_of_the_plain_formula(own, Tq, Tk):
    """attend's StickBreakingAttention against `stick_breaking` left to autograd: the same
    outputs and gradients, for whole sequences and for the last block of queries."""
    from posbench.schemes.stickbreaking import StickBreakingAttention, stick_breaking

    g = torch.Generator().manual_seed(Tq + Tk)
    q = (3 * torch.randn(2, 3, Tq, 8, generator=g)).requires_grad_()
    k, v = (torch.randn(2, 3, Tk, 8, generator=g).requires_grad_() for _ in range(2))
    d_out = torch.randn(2, 3, Tq, 8, generator=g)
    want = stick_breaking(q, k, v, own)
    got = StickBreakingAttention.apply(q, k, v, own)
    assert (got - want).abs().max().item() < 1e-5
    for a, b in zip(torch.autograd.grad(got, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        assert (a - b).abs().max().item() < 1e-5 * (1 + b.abs().max().item())


def test_a_pattern_passes_each_fox_layer_its_own_input():
    """In a pattern, a FoX layer's gates read that layer's input (observe is passed on by layer),
    with a window on top; every check-scheme check passes."""
    from posbench.check import run_checks

    layers = ["fox", {"scheme": "fox", "window": 4}, "rope"]
    results = run_checks("pattern_fox2_rope", {"layers": layers})
    assert all(r.ok for r in results), [(r.name, r.reason) for r in results if not r.ok]
    model = tiny_model("pattern_fox2_rope", options={"layers": layers})
    fox = model.scheme.at[0]
    assert model.scheme.at[1] is not fox and len(fox.gates) == 1  # the windowed layer has its own instance
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        model(x)
    h = model.blocks[0].ln1(model.tok(x))  # layer 0's input
    want = torch.nn.functional.logsigmoid(fox.gates[0](h)).cumsum(1).transpose(1, 2)
    assert torch.allclose(fox.decay[0].float(), want, atol=1e-5)


def test_fox_decay_bias_backward_is_its_derivative():
    """DecayBias's hand backward, by finite differences, for a whole sequence and a block."""
    from posbench.schemes.fox import DecayBias

    c = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    for Tq in (7, 3):
        assert torch.autograd.gradcheck(DecayBias.apply, (c, Tq, torch.float64))
        got = DecayBias.apply(c, Tq, torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, (c[:, :, 7 - Tq :, None] - c[:, :, None, :]).float())
