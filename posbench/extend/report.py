"""`posbench extend`'s part of a report: a row per method and the steps curve.

A line per method, and perplexity at L2 against fine-tuning steps (a table and steps.png),
read from the children's curve.csv."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from posbench.extend.methods import child_label, method_of, read_curve, trained_tokens


def describe(configs: list) -> list[str]:
    """A line per method fine-tuned: its settings, how many steps at which length (and so how
    many trained tokens), from which lr."""
    lines, seen = [], set()
    for c in configs:
        ext = c.model.extend
        method = method_of(ext["method"]) if ext else None
        if method is None or ext["method"] in seen:
            continue
        seen.add(ext["method"])
        t, m = c.train, c.model
        s = ext["to_len"] / ext["from_len"]
        settings = [f"base {m.options['base']:g}"] if method.base == "abf" else []
        settings += [f"scaled at s = {ext['factor']:g}"] if ext.get("factor", s) != s else []
        settings += [f"the {ext['keep_fast']} fastest frequencies unscaled"] if ext.get("keep_fast") else []
        settings += [f"{k} {ext[k]:g}" for k in ("beta_fast", "beta_slow") if k in ext]
        lines.append(
            f"- {child_label(m.scheme, ext['method'])}: {method.description}{''.join(', ' + x for x in settings)}; "
            f"s = {ext['to_len']}/{ext['from_len']} = {s:g}; {t.steps} steps x {t.batch_size} x {m.train_len} "
            f"= {trained_tokens(c):,} tokens from each seed's parent, {t.rate_said()}"
        )
    return lines


def curve_table(runs) -> Optional[tuple]:
    """Perplexity at L2 against fine-tuning steps, a view of the children's curve.csv through
    the comparison engine (compare.summarize): (the table, L2, {method: {step: [ppl per seed]}});
    None when no run has a curve."""
    import pandas as pd

    from posbench.compare.order import scheme_order
    from posbench.compare.table import summarize

    rows = [
        {
            "scheme": r["scheme"],
            "seed": int(r["seed"]),
            "column": int(r["step"]),
            "value": float(r["ppl"]),
            "status": "ok",
        }
        for run in runs
        for r in read_curve(run.folder)
    ]
    if not rows:
        return None
    long = pd.DataFrame(rows).assign(status="ok")  # a curve records the steps it scored
    L2 = next(int(r["length"]) for run in runs for r in read_curve(run.folder))
    by: dict = {}
    for r in rows:
        by.setdefault(r["scheme"], {}).setdefault(r["column"], []).append(r["value"])
    steps = sorted(set(long["column"]))
    return summarize(long, steps, scheme_order(set(long["scheme"])), higher_is_better=False), L2, by


def curve_section(table, L2: int):
    """The report's table of perplexity at L2 against fine-tuning steps: the best method at each
    step and every one not significantly different from it in bold. Its note says only that:
    the first table's, just above it, already says what a cell's interval is and which test
    decided the ties."""
    from posbench.compare.render import tex
    from posbench.compare.table import ALL_TIED, grid
    from posbench.measures.base import Section

    rows, best = grid(table, [str(s) for s in table.attrs["columns"]], digits=2)
    rows[0][0] = "method"
    several = int(table["seeds"].max()) > 1
    note = (
        ("mean ± 95% interval over seeds" if several else "1 seed")
        + "; bold: the best method at each step"
        + (" and every method not significantly different from it, by the test of the table above" if several else "")
        + ("; none at a step where every method ties" if ALL_TIED in table.attrs["tests"] else "")
    )
    return Section(
        heading=f"perplexity at {L2} after k fine-tuning steps",
        caption=f"perplexity at {L2} after k fine-tuning steps (columns); {tex(note)}.",
        rows=rows,
        best=best,
        title=f"perplexity at {L2} after k fine-tuning steps",
        legend=note,
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
