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
    """Lin et al. 2025, eq. 6 and 7: o_i = sum_{j<=i} exp(q_i.k_j/sqrt(d) + D_ij) v_j / sum_j exp(...),
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
