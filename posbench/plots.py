"""Pictures of what a scheme does to attention, for `posbench inspect`: data first, then plots.

What to draw is decided from what the hooks do, never from a scheme's name: an `embed` that
changes x gets its encoding and similarity drawn, a `rotate` that changes q or k gets its
score against distance, a `bias` that returns a tensor gets its map per head. The functions
that compute the drawn arrays return tensors, so tests check the numbers behind each picture.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import torch

from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.schemes import SCHEMES, PositionalScheme, build_scheme

OFFSETS = (0, 100, 1000)  # absolute positions of the key in the rotation plot


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
def bias_maps(scheme: PositionalScheme, T: int, layer: int = 0, seed: int = 0) -> Optional[torch.Tensor]:
    """What `bias` adds to the logits of layer `layer`, per head, (H, T, T), NaN where j > i
    (the future is masked); None if the scheme has no bias. q and k are random with a fixed
    seed and go through `rotate` first, as in the model, for schemes whose bias reads them."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    pos = scheme.positions(T, "cpu")  # (T,)
    q, k = scheme.rotate(q, k, pos, layer)
    b = scheme.bias(q, k, pos, pos, layer)  # None or (1, H, T, T)
    if b is None:
        return None
    b = b[0].float().expand(H, T, T).clone()  # (H, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return b.masked_fill(future, float("nan"))


@torch.no_grad()
def rotation_scores(
    scheme: PositionalScheme, span: int, offsets=OFFSETS, seed: int = 0
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """q_m . k_n after `rotate`, against m - n = 0..span-1, with the key at each absolute
    position n in `offsets`: distances (span,) and scores (len(offsets), span), head 0 of
    layer 0. One random q and one random k are used at every position, so the curves can
    differ only through the positions. None if rotate leaves q and k as they are."""
    H, D = scheme.cfg.n_head, scheme.cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, 1, D, generator=g).expand(1, H, span, D)  # (1, H, span, D)
    k = torch.randn(1, H, 1, D, generator=g).expand(1, H, span, D)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _mark_train_len(ax, train_len, axis="y"):
    if train_len is not None:
        line = ax.axhline if axis == "y" else ax.axvline
        line(train_len - 0.5, color="white", lw=0.8, ls="--", label=f"train_len {train_len}")


def plot_encoding(pe: torch.Tensor, path: Path, title: str, train_len=None) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 5))
    im = ax.imshow(pe.numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
    _mark_train_len(ax, train_len)
    ax.set(xlabel="dimension", ylabel="position", title=f"{title}: embed(0) - 0")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def plot_similarity(sim: torch.Tensor, path: Path, title: str, train_len=None) -> Path:
    dist, prof = by_distance(sim)
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(11, 4.5))
    im = a.imshow(sim.numpy(), cmap="viridis", interpolation="nearest")
    _mark_train_len(a, train_len)
    a.set(xlabel="position j", ylabel="position i", title=f"{title}: PE_i . PE_j")
    fig.colorbar(im, ax=a)
    b.plot(dist.numpy(), prof.numpy())
    b.set(xlabel="distance i - j", ylabel="mean PE_i . PE_j", title="against distance")
    b.grid(alpha=0.3)
    return _save(fig, path)


def plot_bias(maps: torch.Tensor, path: Path, title: str, train_len=None) -> Path:
    import numpy as np

    H = maps.size(0)
    cols = min(H, 4)
    rows = -(-H // cols)
    fig, axes = _pyplot().subplots(rows, cols, figsize=(3.2 * cols, 3 * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        im = ax.imshow(np.ma.masked_invalid(maps[h].numpy()), cmap="magma", interpolation="nearest")
        _mark_train_len(ax, train_len)
        ax.set(title=f"head {h}", xlabel="key j", ylabel="query i")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{title}: bias added to the logits, layer 0 (blank: future or -inf)")
    return _save(fig, path)


def plot_rotation(dist: torch.Tensor, scores: torch.Tensor, path: Path, title: str, offsets=OFFSETS) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for n, row, style in zip(offsets, scores, ("-", "--", ":", "-.")):
        ax.plot(dist.numpy(), row.numpy(), ls=style, label=f"key at position {n}")
    ax.set(xlabel="m - n", ylabel="q_m . k_n", title=f"{title}: score after rotate, random q and k")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_per_head(name: str, values: torch.Tensor, path: Path, title: str) -> Path:
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    if values.dim() == 1:
        ax.bar(range(len(values)), values.numpy())
        ax.set(xlabel="head", ylabel=name)
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
    scheme: PositionalScheme, out_dir: Path, T: int, title: str, train_len=None, learned=False
) -> list[Path]:
    """Every picture the scheme's hooks call for, written into out_dir; the paths written."""
    scheme = scheme.eval()
    out_dir = Path(out_dir)
    drawings = []  # (file name, draw(path)); computed first, so a scheme with none writes nothing
    pe = encoding(scheme, T)
    if pe is not None:
        drawings.append(("encoding.png", lambda p: plot_encoding(pe, p, title, train_len)))
        drawings.append(("similarity.png", lambda p: plot_similarity(similarity(pe), p, title, train_len)))
    rot = rotation_scores(scheme, T)
    if rot is not None:
        drawings.append(("rotation.png", lambda p: plot_rotation(*rot, p, title)))
    maps = bias_maps(scheme, T)
    if maps is not None:
        drawings.append(("bias.png", lambda p: plot_bias(maps, p, title, train_len)))
    if learned:
        for name, values in per_head_parameters(scheme).items():
            drawings.append((f"param-{name}.png", partial(plot_per_head, name, values, title=title)))
    if drawings:
        out_dir.mkdir(parents=True, exist_ok=True)
    return [draw(out_dir / fname) for fname, draw in drawings]


def inspect_target(target: str, out_dir: Optional[Path] = None, length: Optional[int] = None) -> list[Path]:
    """`posbench inspect TARGET`: a scheme (name or module:Class) at its defaults, or a trained
    run folder, whose scheme is drawn with its learned parameters."""
    from posbench.experiment.checkpoint import load_run
    from posbench.experiment.records import safe_name

    if length is not None and length < 2:
        raise PosbenchError(f"--length {length}: draw at least 2 positions")
    as_path = Path(target)
    if target not in SCHEMES and (as_path.is_dir() or ("/" in target or target.startswith("."))):
        _, model = load_run(as_path)  # says what is wrong with a folder that is not a run
        scheme, name, learned = model.scheme, as_path.resolve().name, True
    else:
        scheme, name, learned = build_scheme(ModelConfig(scheme=target)), safe_name(target), False
    train_len = scheme.cfg.train_len
    T = length or 2 * train_len
    if scheme.max_len is not None:
        T = min(T, scheme.max_len)
    title = f"{name} (trained)" if learned else name
    return inspect_scheme(scheme, out_dir or Path("results") / "inspect" / name, T, title, train_len, learned)
