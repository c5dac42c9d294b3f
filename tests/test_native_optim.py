"""optim.c's clipped AdamW step against torch's clip_grad_norm_ and torch.optim.AdamW."""

import copy

import pytest
import torch

from posbench import bench, native
from posbench.model import TransformerLM
from posbench.native import optim
from posbench.native.optim import clip_and_step

from conftest import smoke_experiment, tiny

needs_kernel = pytest.mark.skipif(
    native.load("optim") is None, reason=f"no optim kernel here: {native.unavailable.get('optim')}"
)

# sizes off the kernel's chunks (8192) and off vector widths; a 0-d scalar; one with no gradient
SHAPES = [(300, 70), (8192,), (20000,), (7,), (), (33, 5), (4,)]


def setup(kind=torch.optim.AdamW, dtype=torch.float32, **kw):
    """Parameters in two groups (weight decay and none), and the optimizer over them."""
    torch.manual_seed(0)
    ps = [torch.randn(s, dtype=dtype, requires_grad=True) for s in SHAPES]
    groups = [{"params": ps[:4], "weight_decay": 0.1}, {"params": ps[4:], "weight_decay": 0.0}]
    defaults = {"lr": 3e-3, "betas": (0.9, 0.95)} if kind is torch.optim.AdamW else {"lr": 3e-3}
    return ps, kind(groups, **{**defaults, **kw})


def give_grads(ps, step, scale, skip=(6,)):
    g = torch.Generator().manual_seed(step)
    for i, p in enumerate(ps):
        p.grad = None if i in skip else (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def torch_step(opt, ps, max_norm):
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(ps, max_norm)
    opt.step()


def close(a, b, tol=2e-6):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def counting(monkeypatch):
    calls = []
    real = optim._step_in_c
    monkeypatch.setattr(optim, "_step_in_c", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@needs_kernel
@pytest.mark.parametrize("max_norm", [1.0, 0.0, 1e6])  # clipping at the large steps; none; never binding
def test_the_step_matches_torchs_clip_and_adamw(monkeypatch, max_norm):
    """Ten steps, grads large and small in turn (the clip binds on some), lr changed every step,
    one parameter without a gradient: the parameters and the whole state as torch's."""
    calls = counting(monkeypatch)
    (a, oa), (b, ob) = setup(), setup()
    for step in range(10):
        scale = 5.0 if step % 2 else 0.01
        for group_a, group_b in zip(oa.param_groups, ob.param_groups):
            group_a["lr"] = group_b["lr"] = 3e-3 * (1 - step / 20)
        give_grads(a, step, scale)
        give_grads(b, step, scale)
        clip_and_step(oa, a, max_norm)
        torch_step(ob, b, max_norm)
    assert calls == [True] * 10
    for i, (x, y) in enumerate(zip(a, b)):
        assert close(x, y), (i, (x - y).abs().max().item())
        if i == 6:
            assert torch.equal(x, y) and x not in oa.state  # never had a gradient: untouched, no state
            continue
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys() and torch.equal(sa["step"], sb["step"]) and sa["step"].dtype == torch.float32
        assert close(sa["exp_avg"], sb["exp_avg"]) and close(sa["exp_avg_sq"], sb["exp_avg_sq"])


@needs_kernel
def test_the_state_is_torchs_so_the_two_paths_take_turns():
    """Three steps in C then three through torch equal six through torch: the same state
    format, read and written alike; and a state_dict saved from one loads into the other."""
    (a, oa), (b, ob) = setup(), setup()
    for step in range(6):
        give_grads(a, step, 2.0)
        give_grads(b, step, 2.0)
        (clip_and_step if step < 3 else torch_step)(oa, a, 1.0)
        torch_step(ob, b, 1.0)
    for x, y in zip(a, b):
        assert close(x, y)
    (c, oc) = setup()
    oc.load_state_dict(copy.deepcopy(oa.state_dict()))  # its own tensors: .to() would share them
    with torch.no_grad():
        for x, y in zip(c, a):
            x.copy_(y)
    give_grads(c, 6, 2.0)
    give_grads(a, 6, 2.0)
    clip_and_step(oc, c, 1.0)
    torch_step(oa, a, 1.0)
    for x, y in zip(c, a):
        assert close(x, y)


@needs_kernel
def test_a_non_finite_gradient_spreads_as_in_torch():
    """A NaN in one gradient makes the norm NaN, and torch's clip then scales every gradient by
    NaN: every parameter that had a gradient becomes NaN, in both (the run then stops on the loss)."""
    (a, oa), (b, ob) = setup(), setup()
    for ps in (a, b):
        give_grads(ps, 0, 1.0)
        ps[1].grad[5] = float("nan")
    clip_and_step(oa, a, 1.0)
    torch_step(ob, b, 1.0)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.isnan(), y.isnan()), i
        assert x.isnan().all() == (i != 6)


@needs_kernel
def test_the_step_gives_the_same_bits_on_one_thread_and_two():
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ps, opt = setup()
            for step in range(3):
                give_grads(ps, step, 3.0)
                clip_and_step(opt, ps, 1.0)
            runs.append([p.detach().clone() for p in ps])
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@needs_kernel
def test_torch_runs_where_the_kernel_does_not_apply(monkeypatch):
    """Other optimizers, AdamW's options the C leaves out, other dtypes, a clipping set other
    than the optimizer's, the kernel switched off: torch's two calls, the same bits as them."""
    calls = counting(monkeypatch)
    cases = [
        (dict(kind=torch.optim.SGD), None),
        ({}, lambda ps: ps + ps[:1]),  # a parameter listed twice: torch's clip counts it twice
        (dict(amsgrad=True), None),
        (dict(maximize=True), None),
        (dict(dtype=torch.float64), None),
        (dict(lr=torch.tensor(3e-3)), None),
        ({}, lambda ps: ps[:3]),  # clipping only some of the optimizer's parameters
    ]
    for kw, subset in cases:
        (a, oa), (b, ob) = setup(**kw), setup(**kw)
        state_at_torchs_step = []
        real_step = oa.step
        oa.step = lambda *x, **k: state_at_torchs_step.append(len(oa.state)) or real_step(*x, **k)
        for step in range(2):
            give_grads(a, step, 3.0)
            give_grads(b, step, 3.0)
            clip_and_step(oa, subset(a) if subset else a, 1.0)
            torch_step(ob, subset(b) if subset else b, 1.0)
        for x, y in zip(a, b):
            assert torch.equal(x, y), kw
        # the fallback left the state for torch to make (a GPU's fused AdamW puts its step on
        # the device; one made here first, on the CPU, would reach its kernel)
        assert state_at_torchs_step[:1] == [0], kw
        for x, y in zip(a, b):
            if x in ob.state or y in ob.state:
                assert {k: (v.dtype, v.device) for k, v in oa.state[x].items()} == \
                       {k: (v.dtype, v.device) for k, v in ob.state[y].items()}
    assert calls and not any(calls)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("POSBENCH_NATIVE", "0")
    (a, oa), (b, ob) = setup(), setup()
    give_grads(a, 0, 3.0)
    give_grads(b, 0, 3.0)
    clip_and_step(oa, a, 1.0)
    torch_step(ob, b, 1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not any(calls)


@needs_kernel
def test_training_and_the_bench_step_update_through_the_kernel(monkeypatch, tmp_path):
    calls = counting(monkeypatch)
    torch.manual_seed(0)
    step = bench._train_step_fn(TransformerLM(tiny("nope")), 2, 16)
    step()
    assert calls == [True]
    smoke_experiment(tmp_path, "--schemes", "nope", "--set", "train.steps=3", "--set", "train.workers=1")
    assert calls == [True] * 4  # and run.py's, once per step


@needs_kernel
def test_a_build_for_no_particular_cpu_steps_alike(monkeypatch, tmp_path):
    """optim.c built without -march (plain vector code, as for another CPU) gives the same step."""
    monkeypatch.setattr(native, "FLAG_SETS", (["-O3", "-fopenmp"],))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path))
    calls = counting(monkeypatch)
    (a, oa), (b, ob) = setup(), setup()
    for step in range(3):
        give_grads(a, step, 3.0)
        give_grads(b, step, 3.0)
        clip_and_step(oa, a, 1.0)
        torch_step(ob, b, 1.0)
    assert calls == [True] * 3 and list(tmp_path.glob("native/*/optim.so"))
    for x, y in zip(a, b):
        assert close(x, y)


@needs_kernel
def test_the_fused_adamw_training_uses_is_matched_too():
    (a, oa), (b, ob) = setup(fused=True), setup(fused=True)
    for step in range(5):
        give_grads(a, step, 3.0)
        give_grads(b, step, 3.0)
        clip_and_step(oa, a, 1.0)
        torch_step(ob, b, 1.0)
    for x, y in zip(a, b):
        assert close(x, y)


@needs_kernel
def test_a_state_the_c_cannot_update_and_step_hooks_go_to_torch(monkeypatch):
    """A state of the wrong size (say, loaded from another model) reaches torch, which refuses
    it, not the C, which would write past its end; hooks run, as torch's step runs them."""
    calls = counting(monkeypatch)
    ps, opt = setup()
    give_grads(ps, 0, 1.0)
    clip_and_step(opt, ps, 1.0)
    opt.state[ps[0]]["exp_avg_sq"] = torch.zeros(3)
    give_grads(ps, 1, 1.0)
    with pytest.raises(RuntimeError):
        clip_and_step(opt, ps, 1.0)
    assert calls == [True, False]
    ps, opt = setup()
    seen = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(1))
    give_grads(ps, 0, 1.0)
    clip_and_step(opt, ps, 1.0)
    assert seen == [1] and calls[-1] is False


def transposed(t):
    """The same values, stored as the transpose of a contiguous tensor (grad_layout's layout)."""
    return t.detach().t().contiguous().t().requires_grad_(t.requires_grad)


@needs_kernel
def test_weights_stored_transposed_step_in_c_as_torch_does(monkeypatch):
    """A parameter stored transposed, with its gradient and state alike (as the model's fc1 and
    qkv weights train): the C takes the step, element by element the same as torch's; a
    gradient or a state laid out otherwise than its parameter goes to torch, the same bits."""
    calls = counting(monkeypatch)
    (a, oa), (b, ob) = setup(), setup()
    for ps, opt in ((a, oa), (b, ob)):
        ps[0].data = transposed(ps[0]).data  # (300, 70) with strides (1, 300)
        ps[5].data = transposed(ps[5]).data
    for step in range(4):
        give_grads(a, step, 3.0)
        give_grads(b, step, 3.0)
        for ps in (a, b):
            ps[0].grad, ps[5].grad = transposed(ps[0].grad), transposed(ps[5].grad)
        clip_and_step(oa, a, 1.0)
        torch_step(ob, b, 1.0)
    assert calls == [True] * 4
    assert oa.state[a[0]]["exp_avg"].stride() == a[0].stride() == (1, 300)
    for x, y in zip(a, b):
        assert close(x, y)
    give_grads(a, 9, 3.0)  # contiguous gradients for transposed parameters: torch's step
    give_grads(b, 9, 3.0)
    clip_and_step(oa, a, 1.0)
    torch_step(ob, b, 1.0)
    assert calls[-1] is False and all(close(x, y) for x, y in zip(a, b))
    for ps in (a, b):
        ps[0].grad, ps[5].grad = transposed(ps[0].grad), transposed(ps[5].grad)
    oa.state[a[0]]["exp_avg"] = oa.state[a[0]]["exp_avg"].contiguous()  # say, from an older checkpoint
    ob.state[b[0]]["exp_avg"] = ob.state[b[0]]["exp_avg"].contiguous()
    clip_and_step(oa, a, 1.0)
    torch_step(ob, b, 1.0)
    assert calls[-1] is False and all(close(x, y) for x, y in zip(a, b))


def test_plain_is_dense_and_alike_is_laid_out_like_its_parameter():
    x = torch.zeros(4, 6)
    assert optim._plain(x) and optim._plain(x.t()) and optim._plain(torch.zeros(3, 4, 5).permute(2, 0, 1))
    assert not optim._plain(x[:, :3]) and not optim._plain(x[::2]) and not optim._plain(torch.zeros(6).expand(4, 6))
    assert not optim._plain(x.double()) and not optim._plain(x.to_sparse()) and not optim._plain(None)
    assert optim._alike(transposed(x), transposed(x)) and not optim._alike(x, transposed(x))
    assert optim._alike(torch.zeros(()), optim._SCALAR) and not optim._alike(torch.zeros(1), optim._SCALAR)
    assert not optim._alike(x.double(), x) and not optim._alike(torch.zeros(6, 4), x) and not optim._alike(None, x)
