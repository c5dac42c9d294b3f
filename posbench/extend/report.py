"""`posbench extend`'s part of a report: a line per method, and perplexity at L2 against
fine-tuning steps (a table and steps.png), read from the children's curve.csv."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from posbench.extend.methods import METHODS, child_label, read_curve


def describe(configs: list) -> list[str]:
    """A line per method fine-tuned: how many steps at which length, from which lr."""
    lines, seen = [], set()
    for c in configs:
        ext = c.model.extend
        if not ext or ext["method"] in seen or ext["method"] not in METHODS:
            continue
        seen.add(ext["method"])
        t, m = c.train, c.model
        s = ext["to_len"] / ext["from_len"]
        base = f", base {m.options['base']:g}" if ext["method"] == "abf" else ""
        lines.append(
            f"- {child_label(m.scheme, ext['method'])}: {METHODS[ext['method']].description}{base}; "
            f"s = {ext['to_len']}/{ext['from_len']} = {s:g}; {t.steps} steps x {t.batch_size} x {m.train_len} "
            f"from each seed's parent, AdamW lr {t.lr:g} (warmup {t.warmup_steps}, cosine to {t.min_lr:g})"
        )
    return lines


def curve_table(runs) -> Optional[tuple]:
    """(rows of strings, the L2) for perplexity at L2 against fine-tuning steps, mean ± 95%
    interval over seeds; None when no run has a curve."""
    from posbench.stats import mean_ci

    by = {}
    L2 = None
    for run in runs:
        for r in read_curve(run.folder):
            by.setdefault(r["scheme"], {}).setdefault(int(r["step"]), []).append(float(r["ppl"]))
            L2 = int(r["length"])
    if not by:
        return None
    steps = sorted({s for v in by.values() for s in v})
    rows = [["method"] + [str(s) for s in steps]]
    for label in sorted(
        by, key=lambda x: list(METHODS).index(x.partition(":")[2]) if x.partition(":")[2] in METHODS else 99
    ):
        cells = []
        for s in steps:
            vals = by[label].get(s, [])
            if not vals:
                cells.append("")
                continue
            mean, ci = mean_ci(vals)
            cells.append(f"{mean:.2f}" + (f" ± {ci:.2f}" if len(vals) > 1 and math.isfinite(ci) else ""))
        rows.append([label] + cells)
    return rows, L2, by


def curve_section(rows: list[list[str]], L2: int):
    """The report's table of perplexity at L2 against fine-tuning steps."""
    from posbench.measures.base import Section

    return Section(
        heading=f"perplexity at {L2} after k fine-tuning steps",
        caption=f"perplexity at {L2} after k fine-tuning steps (columns), mean and 95\\% interval over seeds",
        rows=rows,
        title=f"perplexity at {L2} after k fine-tuning steps (mean ± 95% over seeds)",
    )


def plot_curve(by: dict, L2: int, path: Path) -> bool:
    """Perplexity at L2 against fine-tuning steps (compare.band_plot), a line per method with its
    95% band, on a log axis labelled in plain numbers."""
    from posbench.compare.plot import Line, Panel, band_plot
    from posbench.stats import mean_ci

    panel = Panel(f"perplexity at {L2} while fine-tuning")
    for label, points in by.items():
        steps = sorted(points)
        stats = [mean_ci(points[s]) for s in steps]
        seeds = min(len(points[s]) for s in steps)
        panel.lines.append(Line(label, steps, [m for m, _ in stats], [c for _, c in stats], seeds))
    return band_plot([panel], path, f"perplexity at {L2}", "fine-tuning steps; band: 95% over seeds", log=True)
