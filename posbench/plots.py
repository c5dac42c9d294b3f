"""Pictures of what a scheme does to attention, for `posbench inspect`: data first, then plots.

What to draw is decided from what the hooks do, never from a scheme's name: an `embed` that
changes x gets its encoding and similarity drawn, a `rotate` that changes q or k gets its
score against distance, a `bias` that returns a tensor gets its map per head. The functions
that compute the drawn arrays return tensors, so tests check the numbers behind each picture.
"""

from __future__ import annotations

import textwrap
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from posbench.compare.plot import pyplot, save
from posbench.config import ModelConfig, physical_memory
from posbench.errors import PosbenchError
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme

OFFSETS = (0, 100, 1000)  # absolute positions of the key in the rotation plot
MAP_COPIES = 12  # (H, T, T) fp32 maps inspect holds at its peak (measured: 11 for ALiBi, T5 and FIRE)


# --- the data behind each picture ------------------------------------------------------------


@torch.no_grad()
def encoding(scheme: PositionalScheme, T: int, seed: int = 0) -> Optional[torch.Tensor]:
    """What `embed` adds at each position, embed(0) - 0, (T, C); None if embed leaves x as is."""
    C = scheme.cfg.d_model
    pos = scheme.positions(T, "cpu")  # (T,)
    x = torch.randn(1, T, C, generator=torch.Generator().manual_seed(seed))
    if torch.equal(scheme.embed(x, pos), x):
        return None
    zeros = torch.zeros(1, T, C)
    return (scheme.embed(zeros, pos) - zeros)[0].float()  # (T, C)


def similarity(pe: torch.Tensor) -> torch.Tensor:
    """PE_i . PE_j for every pair of positions, (T, T)."""
    return pe @ pe.T


def by_distance(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of a (T, T) map over each diagonal: distances i-j from -(T-1) to T-1, and values."""
    T = m.size(0)
    dist = torch.arange(-(T - 1), T)  # (2T-1,)
    return dist, torch.stack([torch.diagonal(m, offset=-int(d)).mean() for d in dist])


@torch.no_grad()
def model_qk(model, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A trained model's own q and k: a layer's projections of every token of the vocabulary,
    averaged, (H, D) each. q.k is linear in each, so a score drawn with them is the score
    averaged over every (query token, key token) pair."""
    attn, C = model.blocks[layer].attn, model.cfg.d_model
    q, k, _ = attn.qkv(model.blocks[layer].ln1(model.tok.weight)).split(C, dim=-1)  # (V, C) each
    H = model.cfg.n_head
    return q.mean(0).view(H, C // H).float(), k.mean(0).view(H, C // H).float()  # (H, D) each


def _probe(scheme: PositionalScheme, T: int, layer: int, seed: int, qk=None):
    """Unrotated q and k, (1, H, T, D) each, and the scheme's positions (T,) for drawing layer
    `layer`: random with a fixed seed, or `qk`, (H, D) each (a trained model's, `model_qk`), the
    same at every position. A scheme that reads the layer's input (`observe`, FoX) has seen a
    random one, fixed by the seed."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    if qk is not None:
        q, k = (t[None, :, None, :].expand(1, H, T, D) for t in qk)  # (1, H, T, D) each
    pos = scheme.positions(T, "cpu")  # (T,)
    scheme.observe(torch.randn(1, T, scheme.cfg.d_model, generator=g), pos, layer)  # a random input, for FoX's gates
    return q, k, pos


@torch.no_grad()
def bias_maps(scheme: PositionalScheme, T: int, layer: int = 0, seed: int = 0, qk=None) -> Optional[torch.Tensor]:
    """What `bias` adds to the logits of layer `layer`, per head, (H, T, T), NaN where j > i
    (the future is masked); None if the scheme has no bias. q and k go through `rotate`
    first, as in the model, for schemes whose bias reads them: random with a fixed seed, or
    `qk`, (H, D) each (a trained model's, `model_qk`), the same at every position. A scheme
    that reads the layer's input (`observe`, FoX) sees a random one, fixed by the seed."""
    H = scheme.cfg.n_head
    q, k, pos = _probe(scheme, T, layer, seed, qk)
    q, k = scheme.rotate(q, k, pos, layer)
    b = scheme.bias(q, k, pos, pos, layer)  # None or (1, H, T, T)
    if b is None:
        return None
    b = b[0].float().expand(H, T, T).clone()  # (H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return b.masked_fill(future, float("nan"))


@torch.no_grad()
def attention_maps(scheme: PositionalScheme, T: int, layer: int = 0, seed: int = 0, qk=None) -> Optional[torch.Tensor]:
    """For a scheme that replaces softmax (`replaces_softmax`, stick-breaking), or one scored under
    a training-free variant (its `remap`): the weight each query gives each key, per head,
    (H, T, T), NaN where j > i; None for any other. Attention with the identity for values
    returns exactly those weights; q and k as in `bias_maps`."""
    if not scheme.replaces_softmax and scheme.remap is None:
        return None
    H = scheme.cfg.n_head
    q, k, pos = _probe(scheme, T, layer, seed, qk)
    v = torch.eye(T).expand(1, H, T, T)  # (1, H, T, T): the values are the keys' indices
    if scheme.remap is not None:  # softmax over the logits as the variant remaps them (it rotates q and k)
        w = scheme.remap.attention(q, k, v, pos, scheme, layer, None)[0].float()  # (H, T, T)
    else:
        q, k = scheme.rotate(q, k, pos, layer)
        w = scheme.attend(q, k, v, pos, pos, layer)[0].float()  # (H, T, T)
    return w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("nan"))


@torch.no_grad()
def reads_content(scheme: PositionalScheme, T: int) -> bool:
    """Whether the bias reads q and k: two random draws of them give two different maps, on a
    copy whose parameters are random too (a table that starts at zero would hide it)."""
    import copy

    probe = copy.deepcopy(scheme)
    g = torch.Generator().manual_seed(0)
    for p in probe.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    a, b = bias_maps(probe, T, seed=0), bias_maps(probe, T, seed=1)
    return a is not None and not torch.equal(a.nan_to_num(), b.nan_to_num())


def distance_index(scheme: PositionalScheme, name: str, T: int) -> Optional[torch.Tensor]:
    """For a per-head parameter (H, K) that the bias reads one entry of per head at each
    distance (T5's bucket table): the entry read at distance d = 0..T-1, (H, T); None for any
    other. Found from the gradient of the bias of the last query towards each key, so it
    follows from what `bias` does, not from the scheme's name."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    param = dict(scheme.named_parameters())[name]
    pos = scheme.positions(T, "cpu")  # (T,)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, T, D, generator=g)
    with torch.enable_grad():
        b = scheme.bias(q, k, pos[-1:], pos, 0)  # None or (1, H or 1, 1, T)
        if b is None or not b.requires_grad:
            return None
        index = torch.zeros(H, T, dtype=torch.long)
        for d in range(T):  # the key at distance d is at column T-1-d
            (grad,) = torch.autograd.grad(b[..., T - 1 - d].sum(), param, retain_graph=True, allow_unused=True)
            if grad is None:
                return None
            grad = grad.squeeze()
            heads = [a for a, n in enumerate(grad.shape) if n == H]
            if grad.dim() != 2 or not heads:
                return None
            read = grad.movedim(heads[-1], 0) != 0  # (H, K), as per_head_parameters lays it out
            if not bool((read.sum(1) == 1).all()):
                return None
            index[:, d] = read.float().argmax(1)
    return index


@torch.no_grad()
def rotation_scores(
    scheme: PositionalScheme, span: int, offsets=OFFSETS, seed: int = 0, qk=None
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """q_m . k_n after `rotate`, against m - n = 0..span-1, with the key at each absolute
    position n in `offsets`: distances (span,) and scores (len(offsets), span), head 0 of
    layer 0. One q and one k are used at every position, so the curves can differ only
    through the positions: random, or `qk`, (H, D) each (a trained model's, `model_qk`).
    None if rotate leaves q and k as they are."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, 1, D, generator=g).expand(1, H, span, D)  # (1, H, span, D)
    k = torch.randn(1, H, 1, D, generator=g).expand(1, H, span, D)
    if qk is not None:
        q, k = (t[None, :, None, :].expand(1, H, span, D) for t in qk)  # (1, H, span, D) each
    qr, kr = scheme.rotate(q, k, torch.arange(span), 0)
    if torch.equal(qr, q) and torch.equal(kr, k):
        return None
    rows = []
    for n in offsets:
        qr, kr = scheme.rotate(q, k, n + torch.arange(span), 0)  # positions n..n+span-1
        rows.append((qr[0, 0] @ kr[0, 0, 0]).float())  # (span,): query at n+d, key at n
    return torch.arange(span), torch.stack(rows)


def per_head_parameters(scheme: PositionalScheme) -> dict[str, torch.Tensor]:
    """The scheme's parameters with a head axis, by name: (H,) for one value per head (KERPLE's
    r1, r2), (H, K) for K values per head (T5's bucket table, K buckets); others are left out."""
    H = scheme.cfg.n_head
    found = {}
    for name, p in scheme.named_parameters():
        t = p.detach().float()
        if t.numel() == H:
            found[name] = t.reshape(H)
            continue
        t = t.squeeze()
        heads = [a for a, d in enumerate(t.shape) if d == H]
        if t.dim() == 2 and heads:
            found[name] = t.movedim(heads[-1], 0)  # (H, K)
    return found


# --- the pictures ----------------------------------------------------------------------------


def _pyplot():
    plt = pyplot()
    if plt is None:
        raise PosbenchError("inspect draws with matplotlib, which is not installed: pip install matplotlib")
    return plt


def _save(fig, path: Path) -> Path:
    save(_pyplot(), fig, path, dpi=110)
    return path


def _mark_train_len(ax, train_len, axis="y") -> str:
    """A dashed line after the last trained position; returns the words that say so, for a title."""
    if train_len is None:
        return ""
    line = ax.axhline if axis == "y" else ax.axvline
    line(train_len - 0.5, color="white", lw=0.8, ls="--", label=f"training length {train_len}")
    return f"dashed line: the training length ({train_len})"


def plot_encoding(pe: torch.Tensor, path: Path, title: str, train_len=None) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 5))
    im = ax.imshow(pe.numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
    note = _mark_train_len(ax, train_len)
    ax.set(xlabel="dimension", ylabel="position", title=f"{title}: embed(0) - 0" + (f"\n{note}" if note else ""))
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def plot_similarity(sim: torch.Tensor, path: Path, title: str, train_len=None) -> Path:
    dist, prof = by_distance(sim)
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(11, 4.5))
    im = a.imshow(sim.numpy(), cmap="viridis", interpolation="nearest")
    note = _mark_train_len(a, train_len)
    a.set(xlabel="position j", ylabel="position i", title=f"{title}: PE_i . PE_j" + (f"\n{note}" if note else ""))
    fig.colorbar(im, ax=a)
    b.plot(dist.numpy(), prof.numpy())
    b.set(xlabel="distance i - j", ylabel="mean PE_i . PE_j", title="against distance")
    b.grid(alpha=0.3)
    return _save(fig, path)


def plot_bias(
    maps: torch.Tensor, path: Path, title: str, train_len=None, notes=(), layer=0, what="bias added to the logits"
) -> Path:
    """A map per head; `notes`: lines under the title that say how to read it; `what`: what the maps are."""
    import numpy as np

    H = maps.size(0)
    drawn = maps[~maps.isnan()]
    constant = drawn.numel() > 0 and bool((drawn == drawn[0]).all())  # one colour: say so in the panel
    note = ""
    cols = min(H, 4)
    rows = -(-H // cols)
    fig, axes = _pyplot().subplots(rows, cols, figsize=(3.2 * cols, 3 * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        im = ax.imshow(np.ma.masked_invalid(maps[h].numpy()), cmap="magma", interpolation="nearest")
        note = _mark_train_len(ax, train_len)
        ax.set(title=f"head {h}", xlabel="key j", ylabel="query i")
        if constant:
            ax.text(0.3, 0.15, f"{drawn[0].item():g} everywhere", transform=ax.transAxes, ha="center", color="white")
        fig.colorbar(im, ax=ax, fraction=0.046)
    lines = [f"{title}: {what}, layer {layer} (blank: future or -inf)", *notes] + ([note] if note else [])
    fig.suptitle("\n".join(textwrap.fill(line, int(13 * 3.2 * cols)) for line in lines), fontsize=10)
    return _save(fig, path)


def plot_rotation(
    dist: torch.Tensor, scores: torch.Tensor, path: Path, title: str, offsets=OFFSETS, what="random q and k"
) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for n, row, style in zip(offsets, scores, ("-", "--", ":", "-.")):
        ax.plot(dist.numpy(), row.numpy(), ls=style, label=f"key at position {n}")
    ax.set(xlabel="m - n", ylabel="q_m . k_n", title=f"{title}: score after rotate, head 0\n{what}")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_per_head(name: str, values: torch.Tensor, path: Path, title: str, index=None, train_len=None) -> Path:
    """values (H,) as bars, or (H, K) as a line per head: against the distance where `index`
    (H, T) says which entry each distance i - j reads (`distance_index`), else against K."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    if values.dim() == 1:
        ax.bar(range(len(values)), values.numpy())
        ax.set(xlabel="head", ylabel=name)
    elif index is not None:
        dist = torch.arange(index.size(1))  # (T,)
        for h, row in enumerate(values):
            ax.plot(dist.numpy(), row[index[h]].numpy(), drawstyle="steps-mid", label=f"head {h}")
        if train_len is not None:
            ax.axvline(train_len - 0.5, color="black", lw=0.8, ls="--", label=f"training length {train_len}")
        ax.set(xlabel="distance i - j (query minus key)", ylabel=f"{name}, the entry read at that distance")
        ax.legend(fontsize="small")
    else:
        for h, row in enumerate(values):
            ax.plot(row.numpy(), marker=".", label=f"head {h}")
        ax.set(xlabel=f"index along {name} (bucket, layer, ...)", ylabel=name)
        ax.xaxis.set_major_locator(_pyplot().MaxNLocator(integer=True))  # indices, not fractions
        ax.legend(fontsize="small")
    ax.set_title(f"{title}: learned {name} per head")
    ax.grid(alpha=0.3)
    return _save(fig, path)


# --- inspect ---------------------------------------------------------------------------------


def inspect_scheme(
    scheme: PositionalScheme, out_dir: Path, T: int, title: str, train_len=None, learned=False, qk=None, layer=0
) -> list[Path]:
    """Every picture the scheme's hooks call for, written into out_dir; the paths written.
    `qk`: a trained model's q and k (`model_qk`), drawn instead of random ones; `layer`: the
    layer they are drawn for (a pattern's view answers for its own layer whatever it is asked)."""
    scheme = scheme.eval()
    out_dir = Path(out_dir)
    drawings = []  # (file name, draw(path)); computed first, so a scheme with none writes nothing
    pe = encoding(scheme, T)
    if pe is not None:
        drawings.append(("encoding.png", lambda p: plot_encoding(pe, p, title, train_len)))
        drawings.append(("similarity.png", lambda p: plot_similarity(similarity(pe), p, title, train_len)))
    what = "random q and k" if qk is None else f"layer {layer}'s q and k, averaged over the vocabulary"
    rot = rotation_scores(scheme, T, qk=qk)
    if rot is not None:
        drawings.append(("rotation.png", lambda p: plot_rotation(*rot, p, title, what=what)))
    maps = bias_maps(scheme, T, qk=qk)
    if maps is not None:
        notes = []
        if reads_content(scheme, T):
            same = "" if qk is None else ", the same at every position"
            notes.append(f"it depends on the content (q and k), not only on positions: drawn for {what}{same}")
        drawn = maps[~maps.isnan()]
        if drawn.numel() and bool((drawn == drawn[0]).all()):
            params = list(scheme.parameters())
            zero = bool(params) and all(bool((p == 0).all()) for p in params)
            why = "; its parameters are all 0, as initialised: inspect a trained run" if zero else ""
            notes.append(f"it is {drawn[0].item():g} at every (i, j), so it changes no attention weight{why}")
        drawings.append(("bias.png", lambda p: plot_bias(maps, p, title, train_len, notes, layer)))
    weights = attention_maps(scheme, T, qk=qk)
    if weights is not None:
        how = (
            f"softmax of the logits as {scheme.remap.name} remaps them"
            if scheme.remap
            else "its own formula in place of softmax"
        )
        notes = [f"{how}, drawn for {what}"]
        what_maps = "attention weights"
        drawings.append(("attention.png", lambda p: plot_bias(weights, p, title, train_len, notes, layer, what_maps)))
    if learned:
        for name, values in per_head_parameters(scheme).items():
            index = distance_index(scheme, name, T) if values.dim() == 2 else None
            draw = partial(plot_per_head, name, values, title=title, index=index, train_len=train_len)
            drawings.append((f"param-{name}.png", draw))
    if drawings:
        out_dir.mkdir(parents=True, exist_ok=True)
    return [draw(out_dir / fname) for fname, draw in drawings]


def inspect_target(
    target: str,
    out_dir: Optional[Path] = None,
    length: Optional[int] = None,
    options: Optional[dict] = None,
    variant: Optional[str] = None,
) -> tuple[list[Path], list[str]]:
    """`posbench inspect TARGET`: a scheme (name or module:Class) at its defaults or with
    `options`, or a trained run folder, whose scheme is drawn with its learned parameters and
    its model's own q and k; under an evaluation-time `variant` (rope's yarn, a training-free
    remap such as rerope) at the drawn length, its rotation, bias and attention weights are the
    variant's.
    A pattern over layers is drawn a layer at a time, each distinct layer in a folder layer<i>.
    Returns the paths written and, for a pattern, a line per layer."""
    from posbench.check import layers_needed
    from posbench.experiment.checkpoint import load_run
    from posbench.files import safe_name
    from posbench.schemes.pattern import Pattern, layer_views

    if length is not None and length < 2:
        raise PosbenchError(f"--length {length}: draw at least 2 positions")
    as_path = Path(target)
    model = None
    if target not in SCHEMES and (as_path.is_dir() or ("/" in target or target.startswith("."))):
        if options:
            raise PosbenchError(f"--set: {target} is a run folder, whose scheme keeps the options it trained with")
        _, model = load_run(as_path)  # says what is wrong with a folder that is not a run
        scheme, name, learned = model.scheme, as_path.resolve().name, True
    else:
        options = options or {}
        cfg = ModelConfig(scheme=target, options=options, n_layer=layers_needed(target, options))  # a pattern: a period
        given = "".join(f"_{k}-{v}" for k, v in options.items())  # rope_fraction-0.25 beside plain rope
        scheme, name, learned = build_scheme(cfg), safe_name(target + given), False
    train_len = scheme.cfg.train_len
    T = length or 2 * train_len
    if scheme.max_len is not None:
        T = min(T, scheme.max_len)
    need, have = MAP_COPIES * 4 * scheme.cfg.n_head * T * T, physical_memory()  # (H, T, T) maps in fp32
    if have and need > have:
        raise PosbenchError(
            f"--length {T}: its (heads, T, T) maps take about {need / 2**30:.3g} GiB, more than the "
            f"{have / 2**30:.0f} GiB here; draw fewer positions"
        )
    name = name if variant is None else f"{name}+{variant}"
    title = f"{name} (trained)" if learned else name
    out = out_dir or Path("results") / "inspect" / name
    with scheme.eval_variant(variant, train_len, T):
        if not isinstance(scheme, Pattern):
            qk = model_qk(model) if model is not None else None  # q.k's parts are learned too
            return inspect_scheme(scheme, out, T, title, train_len, learned, qk), []
        paths = []
        for view in layer_views(scheme):
            qk = model_qk(model, view.i) if model is not None else None
            where, label = out / f"layer{view.i}", f"{title}, layer {view.i}: {view.spec.label()}"
            paths += inspect_scheme(view, where, T, label, train_len, learned, qk, layer=view.i)
        return paths, scheme.describe()
