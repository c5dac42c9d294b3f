"""The pieces every report shares: scheme and grid-point order, table rendering, plots.

A table is rows of text cells with a header first and the set of (row, column) cells to set
in bold; it renders to Markdown, LaTeX (one escaper) and the terminal (posbench/console.py).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from posbench.config import flat
from posbench.experiment.records import read_train_log
from posbench.files import atomic

BAND_SEEDS = 3  # a 95% band needs this many seeds: with two, Student's t is 12.7 and the band hides the means
UNRECORDED = "unrecorded"  # a run whose train_log.jsonl does not name its attention backend


def tex(text: str) -> str:
    """Text set literally in LaTeX."""
    for a, b in (
        ("\\", "\\textbackslash{}"),
        ("_", "\\_"),
        ("%", "\\%"),
        ("&", "\\&"),
        ("#", "\\#"),
        ("±", "$\\pm$"),
        ("—", "--"),
    ):
        text = text.replace(a, b)
    return text


def markdown_table(rows: list[list[str]], best: set) -> list[str]:
    """A Markdown table, best cells in bold."""
    marked = [[f"**{c}**" if (i, j) in best and c else c for j, c in enumerate(r)] for i, r in enumerate(rows)]
    return ["| " + " | ".join(marked[0]) + " |", "|" + "---|" * len(marked[0])] + [
        "| " + " | ".join(r) + " |" for r in marked[1:]
    ]


def latex_table(rows: list[list[str]], best: set, caption: str) -> list[str]:
    """A booktabs table, ready to \\input: every cell escaped, best cells in bold."""
    cells = [
        [f"\\textbf{{{tex(c)}}}" if (i, j) in best and c else tex(c) for j, c in enumerate(r)]
        for i, r in enumerate(rows)
    ]
    return [
        "\\begin{table}[t]",
        "\\centering",
        f"\\begin{{tabular}}{{l{'r' * (len(cells[0]) - 1)}}}",
        "\\toprule",
        " & ".join(cells[0]) + " \\\\",
        "\\midrule",
        *(" & ".join(r) + " \\\\" for r in cells[1:]),
        "\\bottomrule",
        "\\end{tabular}",
        f"\\caption{{{caption}}}",
        "\\end{table}",
        "",
    ]


def transposed(rows: list[list[str]], best: set, corner: str = "length") -> tuple[list[list[str]], set]:
    """Lengths as rows, schemes as columns."""
    out = [list(col) for col in zip(*rows)]
    out[0][0] = corner
    return out, {(j, i) for i, j in best}


def point_labels(parts: dict) -> dict:
    """Run folder -> 'model.train_len=64, train.lr=0.001': the settings in which its training
    differs from other runs' (all '' when they share them all). Where the task differs, what
    each task derives is left out: its train_len and the options it left at the task's default."""
    from posbench.tasks import task_derived

    flats = {rdir: flat(part) for rdir, part in parts.items()}
    keys = sorted({k for f in flats.values() for k in f})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flats.values()}) > 1]
    if "task" in varying:
        varying = [k for k in varying if not all(task_derived(f, k) for f in flats.values())]
    return {rdir: ", ".join(f"{k}={f.get(k)}" for k in varying) for rdir, f in flats.items()}


def point_order(df: pd.DataFrame) -> list:
    """The grid points in order of their settings (numbers as numbers), or [None] for none."""
    if "point" not in df:
        return [None]
    first = df.groupby("point")["train_len"].first()
    return sorted(first.index, key=lambda p: (first[p], p))


def scheme_order(names: set) -> list[str]:
    """Registry order (the order of the paper tables), each scheme followed by its
    evaluation-time variants (rope, rope+ntk, rope+yarn, ...) and its modified selves
    (noisy_rope, offset_rope); plugins after."""
    from posbench.extend.methods import METHODS
    from posbench.schemes import SCHEMES

    def method(n):  # a fine-tuned run's rows (rope:yarn) in the order of the methods
        m = n.partition(":")[2]
        return list(METHODS).index(m) if m in METHODS else len(METHODS), n

    order = []
    for s in SCHEMES:
        order += [s] if s in names else []
        order += sorted(n for n in names if n.startswith(s + "+"))
        order += sorted((n for n in names if n.startswith(s + ":")), key=method)
        order += sorted(n for n in names if base_of(n) == s and n != s and "+" not in n and ":" not in n)
    return order + sorted(names - set(order))


def base_of(name: str) -> str:
    """The trained scheme a row stands on: rope for rope, rope+yarn, noisy_rope and offset_rope."""
    from posbench.schemes import MODIFIERS

    name = name.partition("+")[0].partition(":")[0]
    for prefix in MODIFIERS:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


# A scheme's colour follows its name alone, so it is the same in every plot and does not move
# when rows come or go: a registered scheme takes its registry index's colour (matplotlib's
# tab10, then darker ones); a plugin a hue from a hash of its name; an evaluation-time variant
# (rope+yarn) or a modified scheme (noisy_rope) its base's colour with a dash pattern from a hash
# of its name.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
)  # fmt: skip
DASHES = ("--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3)))  # never solid


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


def style(name: str) -> dict:
    """matplotlib line keywords for scheme `name`: its colour, solid for a trained scheme and
    dashed (a pattern per variant) for an evaluation-time variant such as rope+yarn or a
    modified scheme such as noisy_rope."""
    if ":" in name:  # a fine-tuned run (rope:yarn): solid, a colour per method, from the palette's end
        from posbench.extend.methods import METHODS

        m = name.partition(":")[2]
        index = list(METHODS).index(m) if m in METHODS else _stable_hash(m) % len(METHODS)
        return {"color": PALETTE[-1 - index], "linestyle": "-"}
    variant = name.partition("+")[2] or (name if base_of(name) != name else "")
    dashes = DASHES[_stable_hash(variant) % len(DASHES)] if variant else "-"
    return {"color": colour(name), "linestyle": dashes}


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
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 6, 8, 10 rather than 6 x 10^0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot_training(runs, path: Path, unit: str = "byte") -> bool:
    """Every run's training loss against its step, from train_log.jsonl, one colour per scheme."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    labelled = set()
    for rdir, run in runs.items():
        log = read_train_log(rdir)
        if not log:
            continue
        scheme = run.cfg.schemes[0]
        kw = {} if scheme in labelled else {"label": scheme}  # one legend entry per scheme
        labelled.add(scheme)
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], linewidth=1, alpha=0.8, **style(scheme), **kw)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (nats per {unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(plt, fig, path)


def band(ax, xs, means, cis, seeds: int, name: str) -> None:
    """The 95% band around a scheme's line, drawn only with BAND_SEEDS seeds or more."""
    if seeds >= BAND_SEEDS:
        lo = [m - (c if c == c else 0) for m, c in zip(means, cis)]
        hi = [m + (c if c == c else 0) for m, c in zip(means, cis)]
        ax.fill_between(xs, lo, hi, color=colour(name), alpha=0.15, linewidth=0)
