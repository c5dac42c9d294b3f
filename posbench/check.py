"""The registry-wide scheme checks, shared by `posbench check-scheme` and the tests.

Each check takes a tiny model, returns quietly when the scheme behaves and raises
CheckFailed with a one-line reason when it does not. The tests call them directly, so a
broken scheme fails its test; `check-scheme` runs them all and reports each as a table row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posbench import native
from posbench.attention import future_mask
from posbench.config import ModelConfig
from posbench.errors import PosbenchError, first_line
from posbench.model import TransformerLM
from posbench.schemes import SCHEMES, PositionalScheme, check_hint

TINY = dict(n_layer=2, n_head=4, d_model=32, train_len=16)
BLOCK = 8  # the query block of the blocked attention path: smaller than every checked length
BLOCKS_RULE = (
    "bias is called on blocks of queries: build the (Tq, Tk) bias from the positions given, never "
    "from a cached (T, T) table (docs/extending.md; PositionalScheme in posbench/schemes/base.py)"
)


class CheckFailed(AssertionError):
    """A scheme broke a check; the message is the one-line reason. An AssertionError, so a
    test that calls a check fails with that reason."""


@dataclass
class CheckResult:
    name: str
    ok: bool
    reason: str


def tiny_config(scheme: str, **kw) -> ModelConfig:
    """TINY, with `kw` on top; a pattern over layers gets a whole period of layers."""
    return ModelConfig(**{**TINY, "scheme": scheme, "n_layer": layers_needed(scheme, kw.get("options")), **kw})


def layers_needed(scheme: str, options: dict | None) -> int:
    """TINY's layers, or more for a pattern (posbench/schemes/pattern.py) whose period is longer.
    A name that does not resolve gets TINY's: building it says what is wrong."""
    try:
        return max(TINY["n_layer"], SCHEMES.lookup(scheme).layers_needed(options or {}))
    except PosbenchError:
        return TINY["n_layer"]


def tiny_model(scheme: str, seed: int = 0, **kw) -> TransformerLM:
    """A tiny model with its scheme's parameters perturbed, so zero-initialised biases bite."""
    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(scheme, **kw)).eval()
    with torch.no_grad():
        for p in model.scheme.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def restarted(model: TransformerLM) -> TransformerLM:
    """The model, its mode entered again: a scheme that draws positions at evaluation
    (randomized) starts its draws over, so the first forward after each restart sees the same
    positions."""
    return model.train(model.training)


def supports(model: TransformerLM, T: int) -> bool:
    return model.max_len is None or T <= model.max_len


@contextlib.contextmanager
def on_blocks(T: int):
    """Hooks that ran on the whole sequence and break on blocks of queries broke one rule
    (BLOCKS_RULE): say which, not the tensor error it led to."""
    try:
        yield
    except CheckFailed:
        raise
    except PosbenchError as e:
        if e.exit_code != 1:  # the user's input, not the scheme's broken hook
            raise
        raise CheckFailed(f"on blocks of {BLOCK} of {T} queries, {first_line(e, 200)}: {BLOCKS_RULE}") from None
    except Exception as e:
        raise CheckFailed(
            f"{type(e).__name__} on blocks of {BLOCK} of {T} queries ({first_line(e, 100)}): {BLOCKS_RULE}"
        ) from None


@torch.no_grad()
def causality(model: TransformerLM, T: int) -> str:
    """Changing token t changes no logit before t, and does change some logit from t on, both
    in the whole-sequence attention path and the blocked one."""
    V = model.cfg.vocab_size
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(T))
    t = T // 2
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % V
    saved = model.attn_block
    try:
        for block, path in ((T, "whole"), (BLOCK, "blocked")):
            model.attn_block = block  # T itself: one block, the whole-sequence path
            with on_blocks(T) if path == "blocked" else contextlib.nullcontext():
                a = restarted(model)(x)
                b = restarted(model)(y)  # the same positions as a, for a scheme that draws them
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise CheckFailed(f"non-finite logits at length {T}, so causality cannot be judged")
            leak = (a[:, :t] - b[:, :t]).abs().max().item()
            if not leak <= 1e-5:
                raise CheckFailed(
                    f"changing token {t} of {T} changed the logits of earlier positions by up to "
                    f"{leak:.2g} ({path} attention): the future leaks into the past"
                )
            if torch.allclose(a[:, t:], b[:, t:], atol=1e-5):
                raise CheckFailed(f"changing token {t} of {T} changed no logit at all ({path} attention)")
    finally:
        model.attn_block = saved
    return f"earlier logits unchanged when a later token changes (T={T}, whole and blocked)"


def forward(model: TransformerLM, T: int, batch: int = 3) -> torch.Tensor:
    """Logits of the right shape, finite, at the training length; returns the LM loss."""
    V = model.cfg.vocab_size
    x = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    if tuple(logits.shape) != (batch, T, V):
        raise CheckFailed(f"logits have shape {tuple(logits.shape)}, expected {(batch, T, V)}")
    if not torch.isfinite(logits).all():
        raise CheckFailed(f"non-finite logits at the training length {T}")
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    if not (math.isfinite(loss.item()) and loss.item() > 0):
        raise CheckFailed(f"the loss is {loss.item()}, expected a finite positive number")
    return loss


def backward(model: TransformerLM, loss: torch.Tensor) -> str:
    """Every parameter, the scheme's included, gets a finite, non-zero gradient."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    if missing:
        raise CheckFailed(f"parameters with no gradient: {', '.join(missing)}")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    if bad:
        raise CheckFailed(f"parameters with non-finite gradients: {', '.join(bad)}")
    return "every parameter gets a finite, non-zero gradient"


@torch.no_grad()
def beyond_length(model: TransformerLM, T: int) -> str:
    """Past the training length, finite logits; past the scheme's max_len, a clean refusal."""
    x = torch.randint(0, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    if not supports(model, T):
        try:
            model(x)
        except PosbenchError as e:
            if "cannot represent position" in str(e):
                return f"refuses length {T} cleanly (max_len={model.max_len})"
            raise
        raise CheckFailed(f"max_len={model.max_len}, yet length {T} ran instead of being refused")
    if not torch.isfinite(model(x)).all():
        raise CheckFailed(f"non-finite logits at length {T}")
    return f"finite logits at length {T}"


@torch.no_grad()
def window_holds(model: TransformerLM, T: int) -> str:
    """Each layer with an attention window W (a pattern's, `windows`) never reads a key W or more
    back: changing the layer's input at the token W back leaves its output at the last query as
    it was, and changing it W - 1 back does not. A chunk layer (`chunks`) likewise never reads
    the key just before the last query's chunk, and does read its chunk's first. Whole and
    blocked; other schemes pass."""
    q = T - 1  # the last query
    windows = getattr(model.scheme, "windows", None) or []
    chunks = getattr(model.scheme, "chunks", None) or []
    # (layer, its reach in words, a key past it, the farthest key within it)
    checked = [(i, f"window of {W} keys", q - W, q - W + 1) for i, W in enumerate(windows) if W and W < T]
    checked += [(i, f"chunk of {C} keys", q // C * C - 1, q // C * C) for i, C in enumerate(chunks) if C and C <= q]
    if not checked:
        return "no layer has an attention window or chunk shorter than the sequence"
    C, backend = model.cfg.d_model, model.backend(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    pos = model.scheme.positions(T, "cpu")
    for i, reach, unseen, seen in sorted(checked):
        attn = model.blocks[i].attn
        x = torch.randn(2, T, C, generator=gen)
        for block, path in ((None, "whole"), (BLOCK, "blocked")):
            with on_blocks(T) if block else contextlib.nullcontext():
                y = attn(x, pos, backend, block)[:, -1]  # (B, C): the last query's output
                for key, changes in ((unseen, False), (seen, True)):
                    x2 = x.clone()
                    x2[:, key] += torch.randn(2, C, generator=gen)
                    gap = (attn(x2, pos, backend, block)[:, -1] - y).abs().max().item()
                    if not changes and gap > 0:
                        raise CheckFailed(
                            f"layer {i} has a {reach}, yet key {key} changed query {q}'s output by {gap:.2g} "
                            f"(T={T}, {path} attention)"
                        )
                    if changes and gap == 0:
                        raise CheckFailed(f"layer {i}: key {key}, within its {reach} of query {q}, changed nothing")
    where = ", ".join(f"layer {i}: {reach}" for i, reach, _, _ in sorted(checked))
    return f"no query reads a key past its layer's window or chunk ({where}; T={T}, whole and blocked)"


def attend_agrees(model: TransformerLM, T: int) -> str:
    """A scheme's own `attend`, which the native backend tries first, gives the logits and
    gradients of the eager formula with its `bias`, within 1e-5 (relative to the largest, for
    gradients), whole and blocked. Schemes without one pass trivially."""
    scheme = model.scheme
    if type(scheme).attend is PositionalScheme.attend:
        return "no attend hook: every backend uses its bias"
    if scheme.replaces_softmax:
        return "attend replaces softmax under every backend: there is no bias to check it against"
    why_not = native.why_not(model.cfg.head_dim, torch.device("cpu"))
    if why_not:
        return f"attend is tried by the native backend only, which cannot run here ({why_not})"
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, model.cfg.vocab_size, (2, T), generator=gen)
    # a random projection of the logits: every path gets a gradient of order 1 (a mean of
    # squares would leave them near 1e-4, under any absolute tolerance)
    w = torch.randn(2, T, model.cfg.vocab_size, generator=gen)
    saved_block, saved_cfg = model.attn_block, model.cfg
    own = type(scheme).attend.__get__(scheme)
    answered = []  # did attend ever compute the attention itself, rather than decline?

    def counted(*args):
        out = own(*args)
        answered.append(out is not None)
        return out

    def run(block, backend):
        model.attn_block = block
        model.cfg = dataclasses.replace(saved_cfg, attention=backend)
        model.zero_grad(set_to_none=True)
        scheme.attend = counted  # an instance attribute hides the method
        try:
            y = model(x)
            (y * w).sum().backward()
        finally:
            scheme.__dict__.pop("attend", None)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return y.detach(), grads

    try:
        for block, path in ((T, "whole"), (BLOCK, "blocked")):
            with on_blocks(T) if path == "blocked" else contextlib.nullcontext():
                (y, g), (ref_y, ref_g) = run(block, "native"), run(block, "eager")
            gap = (y - ref_y).abs().max().item()
            if not gap <= 1e-5:
                raise CheckFailed(
                    f"attend's logits differ from the eager formula's by up to {gap:.2g} (T={T}, {path} attention)"
                )
            for n in ref_g:
                gap = (g[n] - ref_g[n]).abs().max().item() if n in g else math.inf
                if not gap <= 1e-5 * (1 + ref_g[n].abs().max().item()):
                    raise CheckFailed(
                        f"attend's gradient of {n} differs from the eager formula's by up "
                        f"to {gap:.2g} of {ref_g[n].abs().max().item():.2g} "
                        f"(T={T}, {path} attention)"
                    )
    finally:
        model.attn_block, model.cfg = saved_block, saved_cfg
        model.zero_grad(set_to_none=True)
    if not any(answered):
        return (
            f"attend declined every call here (a scheme may, e.g. where its kernel cannot run), "
            f"so the native kernel ran with its bias (T={T})"
        )
    return f"attend agrees with the eager formula and the bias within 1e-5 (T={T}, whole and blocked)"


@torch.no_grad()
def tiled_agrees(model: TransformerLM, T: int) -> str:
    """A scheme's `tiled_bias`, the form the triton backend computes inside its tiles, stands for
    its `bias` within 1e-5 at every pair a query sees, in every layer, for all queries and for a
    later block of them."""
    scheme = model.scheme
    if type(scheme).tiled_bias is PositionalScheme.tiled_bias:
        return "no tiled_bias hook: the triton backend reads its bias as a dense tensor"
    H, D = model.cfg.n_head, model.cfg.head_dim
    pos = scheme.positions(T, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(1, H, T, D, generator=gen)
    took = 0
    for q0 in (0, T - BLOCK):
        qpos, q = pos[q0:], torch.randn(1, H, T - q0, D, generator=gen)
        seen = ~future_mask(T - q0, T, q0, q.device)  # (Tq, Tk)
        for layer in range(model.cfg.n_layer):
            form = scheme.tiled_bias(qpos, pos, layer, torch.float32)
            if form is None:
                continue
            took += 1
            want = scheme.bias(q, k, qpos, pos, layer).float().expand(1, H, *seen.shape)
            gap = (form.dense().float() - want)[..., seen].abs().max().item()
            if not gap <= 1e-5 * (1 + want[..., seen].abs().max().item()):
                raise CheckFailed(
                    f"tiled_bias stands for a bias that differs from `bias` by up to {gap:.2g} "
                    f"(layer {layer}, queries from {q0}, T={T})"
                )
    if not took:
        return f"tiled_bias declined every call here, so the triton backend reads its bias dense (T={T})"
    return f"tiled_bias stands for its bias within 1e-5 in every layer (T={T}, whole and a block)"


@torch.no_grad()
def variants_hold(model: TransformerLM, T: int) -> str:
    """Under each evaluation-time variant the model takes (its scheme's own and the training-free
    ones of posbench/schemes/training_free.py), earlier logits stay unchanged when a later token
    changes and every logit is finite, whole and blocked. A variant that refuses the tiny
    model's size (ntk with a head rotating 2 dims) is said with its reason, not failed: the
    options that shrank it may leave room at a real size."""
    took = [v for v in model.eval_variants if not model.scheme.refuses(v)]
    if not took:
        return "no evaluation-time variant applies"
    held, refused = [], []
    for name in took:
        try:
            with model.eval_variant(name, T):
                causality(model, T)
        except CheckFailed as e:
            raise CheckFailed(f"{name}: {e}") from None
        except PosbenchError as e:
            refused.append(f"{name}: {e}")
            continue
        held.append(name)
    said = f"causal, with finite logits, under {', '.join(held)} (T={T}, whole and blocked)" if held else ""
    if refused:
        said += f"{'; ' if said else ''}refused at this size ({'; '.join(refused)})"
    return said


def run_checks(spec: str, options: dict | None = None) -> list[CheckResult]:
    """Every check on `spec` (a registered name or module:Class) at a tiny size, built with
    `options` (its scheme_options). A scheme that cannot be loaded, options it does not take,
    or options it refuses at this size raise PosbenchError; anything else that goes wrong is a
    failed row."""
    options = options or {}
    SCHEMES.lookup(spec).validate_options(options, where=f"scheme_options.{spec}")
    L = TINY["train_len"]
    got: dict = {}
    try:  # an option that cannot hold at the check's size is the user's to change: one line
        built = tiny_model(spec, options=options)
    except PosbenchError as e:  # check-scheme is what the build error would tell the user to run
        text = str(e).replace(check_hint(spec), "")
        size = f" (check-scheme builds the scheme at train_len {L})" if "train_len" in text else ""
        raise PosbenchError(f"{text}{size}", e.key) from None
    except Exception as e:  # anything else is the build row's reason, below
        built = e

    def build():
        if isinstance(built, Exception):
            raise built
        got["model"] = model = built
        n = sum(p.numel() for p in model.scheme.parameters())
        c = model.cfg
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        per_layer = getattr(model.scheme, "period", None)  # a pattern: its layers, one label each
        return (
            f"{type(model.scheme).__name__}: {c.n_layer} layers, {c.n_head} heads, "
            f"d_model {c.d_model}, train_len {c.train_len}; {n} scheme parameters"
            + (f"; options {given}" if given else "")
            + (f"; layers {' '.join(x.label() for x in per_layer)}" if per_layer else "")
        )

    def causal():
        lengths = [T for T in (L, L * 5 // 2) if supports(got["model"], T)]
        for T in lengths:
            causality(got["model"], T)
        return f"earlier logits unchanged when a later token changes (T={lengths}, whole and blocked)"

    def fwd():
        got["model"].train()
        got["loss"] = loss = forward(got["model"], L)
        return f"finite logits at the training length {L}, loss {loss.item():.3f}"

    def bwd():
        return backward(got["model"], got["loss"])

    def beyond():
        return beyond_length(got["model"].eval(), 4 * L)

    def window():
        return window_holds(got["model"].eval(), L * 5 // 2 if supports(got["model"], L * 5 // 2) else L)

    def attend():
        return attend_agrees(got["model"].train(), L * 5 // 2 if supports(got["model"], L * 5 // 2) else L)

    def tiled():
        return tiled_agrees(got["model"].eval(), L * 5 // 2 if supports(got["model"], L * 5 // 2) else L)

    def variants():
        return variants_hold(got["model"].eval(), L * 5 // 2 if supports(got["model"], L * 5 // 2) else L)

    steps = [  # (name, check, the checks it needs)
        ("build", build, ()),
        ("causality", causal, ("build",)),
        ("forward", fwd, ("build",)),
        ("backward", bwd, ("forward",)),
        ("beyond length", beyond, ("build",)),
        ("window", window, ("build",)),
        ("attend", attend, ("build",)),
        ("tiled bias", tiled, ("build",)),
        ("variants", variants, ("build",)),
    ]
    passed: dict[str, bool] = {}
    results = []
    for name, check, needs in steps:
        blocked = [n for n in needs if not passed[n]]
        if blocked:
            reason = f"not run: {blocked[0]} failed"
            passed[name] = False
        else:
            try:
                reason, passed[name] = check(), True
            except CheckFailed as e:
                reason, passed[name] = str(e), False
            except Exception as e:  # a user's hook may raise anything: that is the reason
                first = first_line(e, 160) if str(e).strip() else ""
                reason, passed[name] = f"{type(e).__name__}: {first}".rstrip(": "), False
        results.append(CheckResult(name, passed[name], reason))
    return results
