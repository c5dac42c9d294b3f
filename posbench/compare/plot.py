"""The plots: a metric against length (or bucket, or step) with 95% bands, and the training curves.

The one band plot (a metric against length, bucket or fine-tuning step, a line per scheme
with its 95% band over seeds) and the training curves, with a look per scheme name that is the
same in every plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from posbench.compare.order import base_of
from posbench.files import atomic

BAND_SEEDS = 3  # a 95% band needs this many seeds: with two, Student's t is 12.7 and the band hides the means

# A scheme's colour follows its name alone, so it is the same in every plot and does not move
# when rows come or go: a registered scheme takes its registry index's colour (matplotlib's
# tab10, then darker ones); a plugin a hue from a hash of its name. A line drawn from the same
# checkpoints (an evaluation-time variant, rope+yarn) or from a modified scheme (noisy_rope)
# keeps its base's colour with dashes of its own; a model fine-tuned from it (rope:yarn) a shade
# of that colour with a marker of its own. No two lines of a plot look the same.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
)  # fmt: skip
# never solid: a scheme's variants take dashes from the front (rope's six first), a modifier from the end
DASHES = (
    "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (10, 2, 2, 2)), (0, (3, 3, 1, 3, 1, 3)),
    (0, (1, 3)), (0, (8, 3)),
)  # fmt: skip
MARKERS = ("s", "^", "v", "D", "P", "X", "*", "h")  # a fine-tuned child's; "o" is a trained scheme's
SHADES = (-0.55, 0.3, -0.3, 0.5, -0.7, 0.15, -0.15, 0.6)  # toward black (<0) or white (>0)


def _stable_hash(text: str) -> int:
    import hashlib

    return int(hashlib.md5(text.encode()).hexdigest(), 16)  # not hash(): that changes per process


def colour(name: str) -> str:
    """The colour of scheme `name` (or of the scheme `name` is a variant of) in every plot."""
    import colorsys

    from posbench.schemes import SCHEMES

    base = base_of(name)
    names = list(SCHEMES)  # names only: no scheme module (and no torch) is imported
    if base in names and names.index(base) < len(PALETTE):
        return PALETTE[names.index(base)]
    r, g, b = colorsys.hsv_to_rgb((_stable_hash(base) % 360) / 360, 0.7, 0.7)
    return f"#{round(255 * r):02x}{round(255 * g):02x}{round(255 * b):02x}"


def _shade(hex_colour: str, f: float) -> str:
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [c + (255 - c) * f if f > 0 else c * (1 + f) for c in rgb]
    return "#" + "".join(f"{round(c):02x}" for c in mixed)


def _index(name: str, known: list[str], size: int) -> int:
    """Its place among the names known for its kind, else one from a hash of it; below `size`."""
    if name in known:
        return known.index(name) % size
    return (len(known) + _stable_hash(name) % max(1, size - len(known))) % size


def style(name: str) -> dict:
    """matplotlib line keywords for scheme `name`: colour, line style and marker."""
    from posbench.extend.methods import METHODS, base_method
    from posbench.schemes import MODIFIERS, ROPE_SCALING_NAMES, TRAINING_FREE_NAMES

    base = base_of(name)
    trained, _, method = name.partition(":")
    if method and base_method(method) in METHODS:  # a fine-tuned run (rope:yarn), not a module:Class:
        # a shade of its base's colour and a marker per method,
        # solid, or dashed for a spelled variant of it (rope:pi@2 beside rope:pi)
        i = _index(base_method(method), list(METHODS), len(MARKERS))
        dashes = "-" if method == base_method(method) else DASHES[_stable_hash(method) % len(DASHES)]
        return {"color": _shade(colour(base), SHADES[i % len(SHADES)]), "linestyle": dashes, "marker": MARKERS[i]}
    plain, _, variant = trained.partition("+")
    modifier = next((m for m in MODIFIERS if plain.startswith(m) and plain != base), None)
    free = False  # a training-free variant: dashes of its own among them, marked x
    if variant:  # the same checkpoints, evaluated another way: dashes per variant, the same for every scheme
        kind = variant.partition("@")[0]
        free = kind in TRAINING_FREE_NAMES
        # a variant of neither list (a user's scheme's own) takes dashes from a hash of its name
        own = list(TRAINING_FREE_NAMES if free else ROPE_SCALING_NAMES)
        dashes = DASHES[_index(kind, own, len(DASHES) - len(MODIFIERS))]
    elif modifier:  # a modified scheme: dashes from the end, one per modifier
        dashes = DASHES[-1 - list(MODIFIERS).index(modifier)]
    else:
        dashes = "-"
    marker = "s" if modifier and variant else "d" if "@" in variant else "o"  # rope+yarn@4 beside rope+yarn
    if free:
        marker = "P" if modifier else "+" if "@" in variant else "x"
    return {"color": colour(name), "linestyle": dashes, "marker": marker}


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt, fig, path: Path, dpi: int = 100) -> bool:
    """Write the figure whole (atomically) and free it."""
    fig.tight_layout()
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    return True


def plain_log_axis(ax) -> None:
    """A log y axis whose ticks read as numbers (6, 8, 10 rather than 6 x 10^0), minor ones too,
    so a range within one decade is labelled."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def legend_outside(axes, x: float = 1.02) -> None:
    """One legend for every panel, right of the last, where it covers no data; `x`, in the last
    panel's widths from its left edge, moves it past a right-hand axis's ticks and label."""
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:
        axes[-1].legend(
            handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(x, 1), borderaxespad=0, fontsize=8
        )


@dataclass
class Line:
    name: str  # a scheme label: its look (style) and legend entry
    xs: list
    means: list
    cis: list  # half-widths of the 95% intervals (nan: none)
    seeds: int  # the band is drawn with BAND_SEEDS or more


def lines(table, scale: float = 1.0, xs: Optional[dict] = None) -> list[Line]:
    """A line per scheme of a compare.summarize table: its columns as x (or, with `xs`, those
    columns it names, each at its x), each mean and interval times `scale`, and the row's seeds
    (which decide whether a band is drawn)."""
    xs = xs or {c: c for c in table.attrs["columns"]}
    return [
        Line(s, list(xs.values()), [scale * float(table.loc[s, c]) for c in xs],
             [scale * float(table.loc[s, f"ci {c}"]) for c in xs], int(table.loc[s, "seeds"]))
        for s in table.index
    ]  # fmt: skip


@dataclass
class Panel:
    title: str
    lines: list[Line] = field(default_factory=list)
    mark: Optional[int] = None  # an x to mark with a dashed line: the training length
    beside: Optional[Line] = None  # a series of another unit, grey on a right-hand axis of its own


def band_plot(
    panels: list[Panel],
    path: Path,
    ylabel: str,
    xlabel: str,
    log: Optional[bool] = None,
    ylim: Optional[tuple] = None,
    share_y: bool = True,
    markers: bool = True,
) -> bool:
    """A panel per table, a line per scheme with its 95% band, a dashed line at each panel's
    mark. `log`: a log y axis (None: where the values span more than 3x); without `ylim`, a wide
    band (few seeds, one that blew up) does not squash the means; `markers`: a mark at each
    point (off for a dense axis such as window positions)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 2, 4), sharey=share_y, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        finite = []
        for line in panel.lines:
            look = style(line.name) if markers else {**style(line.name), "marker": None, "linewidth": 1}
            ax.plot(line.xs, line.means, markersize=3, label=line.name, **look)
            if line.seeds >= BAND_SEEDS:
                lo = [m - (c if c == c else 0) for m, c in zip(line.means, line.cis)]
                hi = [m + (c if c == c else 0) for m, c in zip(line.means, line.cis)]
                ax.fill_between(line.xs, lo, hi, color=style(line.name)["color"], alpha=0.15, linewidth=0)
            finite += [m for m in line.means if m == m and not math.isinf(m)]
        if panel.mark is not None:
            ax.axvline(panel.mark, color="black", linestyle="--", linewidth=1)
        if panel.beside is not None:
            right = ax.twinx()
            right.plot(panel.beside.xs, panel.beside.means, color="grey", linestyle=":", linewidth=1.5)
            right.set_ylabel(panel.beside.name, color="grey", fontsize=8)
            right.set_ylim(bottom=0)
            right.tick_params(axis="y", colors="grey", labelsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(xlabel)
        if log or (log is None and finite and max(finite) / max(min(finite), 1e-9) > 3):
            plain_log_axis(ax)
        if ylim is not None:
            ax.set_ylim(*ylim)
        elif finite:
            ax.set_ylim(bottom=max(ax.get_ylim()[0], 0.8 * min(finite)))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    legend_outside(list(axes[0]), x=1.15 if panels[-1].beside is not None else 1.02)
    return save(plt, fig, path)


@dataclass
class Heat:
    """One heatmap panel: a scheme's means over seeds at each value of an axis (rows, `ys`) and
    length (columns, `xs`), times the metric's scale; nan where it was not scored."""

    title: str  # the scheme
    xs: list
    ys: list
    values: list  # (len(ys), len(xs)) rows of means
    label: str  # the metric (and grid point): a row of panels shares it and its colour scale
    ylabel: str  # the axis
    higher_is_better: bool = True  # the colour scale runs so that better is always the same end
    digits: int = 2
    mark: Optional[int] = None  # the training length: a dashed line after the last column within it


def heatmap(rows: list[list[Heat]], path: Path) -> bool:
    """A row of panels per metric, a panel per scheme, each cell's mean written in it; one colour
    scale per row, better toward yellow whatever the metric's direction; a dashed line between
    the lengths within the training length and those past it."""
    import numpy as np

    plt = pyplot()
    if plt is None:
        return False
    width = max(len(r) for r in rows)
    cells = max(len(h.xs) for r in rows for h in r)
    fig, axes = plt.subplots(
        len(rows), width, figsize=(1.0 + (1.2 + 0.6 * cells) * width, 0.6 + 2.8 * len(rows)), squeeze=False
    )
    for row, heats in zip(axes, rows):
        finite = [v for h in heats for line in h.values for v in line if v == v and not math.isinf(v)]
        lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
        lo, hi = (lo - 1, hi + 1) if lo == hi else (lo, hi)
        for ax in row[len(heats) :]:
            ax.axis("off")
        for ax, h in zip(row, heats):
            grid = np.array(h.values, dtype=float)  # (ys, xs)
            cmap = "viridis" if h.higher_is_better else "viridis_r"
            image = ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", origin="upper")
            for i in range(grid.shape[0]):
                for j in range(grid.shape[1]):
                    if grid[i, j] == grid[i, j]:
                        shade = (grid[i, j] - lo) / (hi - lo)  # 0: the colour scale's dark end
                        dark = shade < 0.5 if h.higher_is_better else shade > 0.5
                        ax.text(j, i, f"{grid[i, j]:.{h.digits}f}", ha="center", va="center", fontsize=7,
                                color="white" if dark else "black")  # fmt: skip
            ax.set_xticks(range(len(h.xs)), [str(x) for x in h.xs], fontsize=7, rotation=45)
            ax.set_yticks(range(len(h.ys)), [f"{y:g}" for y in h.ys], fontsize=7)
            within = sum(1 for x in h.xs if h.mark is not None and x <= h.mark)
            if 0 < within < len(h.xs):
                ax.axvline(within - 0.5, color="white", linestyle="--", linewidth=1.5)
            ax.set_title(h.title, fontsize=10)
            ax.set_xlabel("evaluation length")
            ax.set_ylabel(h.ylabel)
            fig.colorbar(image, ax=ax, label=h.label if ax is row[len(heats) - 1] else None, fraction=0.08)
    return save(plt, fig, path)


def plot_training(runs, path: Path, unit: str = "byte") -> bool:
    """Every run's training loss against its step, from train_log.jsonl, one colour per scheme."""
    from posbench.experiment.records import read_train_log

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    labelled = set()
    for rdir, run in runs.items():
        log = read_train_log(rdir)
        if not log:
            continue
        scheme = run.cfg.schemes[0]
        kw = {} if scheme in labelled else {"label": scheme}  # one legend entry per scheme
        labelled.add(scheme)
        look = {**style(scheme), "marker": None}
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], linewidth=1, alpha=0.8, **look, **kw)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (nats per {unit})")
    ax.grid(alpha=0.3)
    legend_outside([ax])
    return save(plt, fig, path)
