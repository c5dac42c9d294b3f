"""Where RoPE breaks: the scaling law's bound beside the measured break, in a report.

Each rotary run's scaling-law bound (posbench/rope_law.py) beside the position where its loss
per position rises past the in-window level, as a report section, and the two against the
base as a plot where runs differ in base (a rope.base sweep)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from posbench.compare.plot import colour, plain_log_axis, pyplot, save
from posbench.compare.render import tex
from posbench.compare.table import mean_cell
from posbench.measures.base import Section
from posbench.rope_law import MARGIN, break_position, critical_dim, extrapolation_bound, rotary
from posbench.schemes import run_label
from posbench.stats import mean_ci

HOW = (
    f"predicted: T_extra = 2 pi base^(d_extra/d), d_extra = 2 ceil((d/2) log_base(L / 2 pi)) (Liu et al. 2024); "
    f"measured: the first position past L whose mean loss over L/10 positions exceeds the mean over "
    f"[L/2, L) by {MARGIN:.0%}, in the longest non-overlapping windows"
)


def breaks(runs: list, pos: pd.DataFrame, points: dict) -> pd.DataFrame:
    """A row per rotary run (rope_law.rotary) with positions scored past its training length:
    its label, grid point, seed, d, base, L, the law's d_extra and T_extra, the longest window
    and the measured break (NaN where no bin rises that far). `pos`: views.position_losses of
    `runs`, with `points` (a run folder's grid point, where there are several)."""
    rows = []
    for run in runs:
        law = rotary(run.cfg)
        label, L = run_label(run.cfg.model), run.cfg.model.train_len
        if law is None or pos.empty:
            continue
        own = pos[(pos["scheme"] == label) & (pos["protocol"] == "nonoverlapping") & (pos["seed"] == run.cfg.seeds[0])]
        point = points.get(run.folder, "")
        own = own[own["point"] == point]
        if own.empty or own["length"].max() <= L:
            continue
        longest = int(own["length"].max())
        loss = own[own["length"] == longest].set_index("position")["loss"].sort_index()
        at = break_position(loss, L)
        d, base = law
        rows.append(
            {
                "scheme": label,
                "point": point,
                "seed": run.cfg.seeds[0],
                "d": d,
                "base": base,
                "train_len": L,
                "d_extra": critical_dim(d, base, L),
                "predicted": extrapolation_bound(d, base, L),
                "longest": longest,
                "measured": math.nan if at is None else float(at),
            }
        )
    return pd.DataFrame(rows)


def section(found: pd.DataFrame) -> Optional[Section]:
    """The report's table: a row per rotary scheme (and grid point), the measured break as a
    mean with its 95% interval over the seeds that broke."""
    if found.empty:
        return None
    head = ["scheme", "d", "base", "trained at", "d_extra", "predicted break", "measured break", "seeds"]
    rows = [head]
    for (point, scheme), part in found.groupby(["point", "scheme"], sort=False):
        first = part.iloc[0]
        broke = [v for v in part["measured"] if v == v]
        if broke:
            measured = mean_cell(broke)
            if len(broke) < len(part):
                measured += f" ({len(broke)} of {len(part)} seeds)"
        else:
            measured = f"none by {int(part['longest'].min())}"
        predicted = "none" if math.isinf(first["predicted"]) else f"{first['predicted']:.0f}"
        rows.append(
            [
                f"{scheme} ({point})" if point else scheme,
                str(int(first["d"])),
                f"{first['base']:g}",
                str(int(first["train_len"])),
                str(int(first["d_extra"])),
                predicted,
                measured,
                str(len(part)),
            ]
        )
    heading = "where RoPE breaks: the scaling law against the loss per position"
    return Section(heading, f"{tex(heading)}. {tex(HOW)}.", rows, title=heading, legend=HOW)


def plot(found: pd.DataFrame, path: Path) -> bool:
    """rope_law.png where the runs differ in base: the law's bound (a triangle at the top where it
    has none) and the measured break (mean and 95% interval over seeds) against the base, a line
    per training length."""
    plt = pyplot()
    if plt is None or found.empty or found["base"].nunique() < 2:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for L, part in found.groupby("train_len"):
        by = part.groupby("base")
        bases = sorted(by.groups)
        law = [by.get_group(b)["predicted"].iloc[0] for b in bases]
        ax.plot(bases, law, color=colour("law"), linestyle="--", marker="x", label=f"predicted, trained at {L}")
        unbounded = [b for b, t in zip(bases, law) if math.isinf(t)]  # every dim seen whole: no bound
        ax.plot(unbounded, [1] * len(unbounded), color=colour("law"), linestyle="", marker="^", markersize=9,
                transform=ax.get_xaxis_transform(), clip_on=False, label="predicted: no bound")  # fmt: skip
        xs, ys, cis = [], [], []
        for b in bases:
            broke = [v for v in by.get_group(b)["measured"] if v == v]
            if broke:
                mean, ci = mean_ci(broke)
                xs.append(b), ys.append(mean), cis.append(0 if ci != ci else ci)
        ax.errorbar(xs, ys, yerr=cis, color=colour("rope"), marker="o", capsize=3, label=f"measured, trained at {L}")
        ax.axhline(L, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    plain_log_axis(ax)
    ax.set_xlabel("RoPE base")
    ax.set_ylabel("length (positions)")
    ax.set_title("where RoPE breaks: the scaling law against the loss per position", fontsize=9)
    ax.legend(fontsize=8)
    return save(plt, fig, path)
