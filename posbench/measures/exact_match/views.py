"""Exact match's tables and plots.

Exact match's tables and plots: lengths grouped into buckets, each in or out of distribution,
plus the in- and out-of-distribution totals, schemes x buckets of one metric per grid point
through the comparison engine, the mean reciprocal rank past N over grid points and seeds, the
description, and the plot of the metric by length."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from posbench.compare.order import scheme_order
from posbench.compare.plot import BAND_SEEDS, Panel, band_plot, lines, plot_training
from posbench.compare.render import tex, transposed
from posbench.compare.table import OK, cell, seeds_said, spread_note, summarize
from posbench.compare.table import grid as compare_grid
from posbench.errors import PosbenchError
from posbench.measures.base import Section
from posbench.measures.exact_match.records import EVAL_COLUMNS, METRICS, bucket_name, buckets
from posbench.tasks.generators import Task, build_task

SUMMARY_COLUMNS = [
    "task",
    "metric",
    "scheme",
    "seed",
    "train_max",
    "bucket",
    "lo",
    "hi",
    "split",
    "value",
    "correct",
    "instances",
    "tokens_correct",
    "tokens",
    "status",
    "attention",
]


def by_bucket(df: pd.DataFrame, spans: list[tuple[int, int]], train_max: int) -> pd.DataFrame:
    """One row per (metric, scheme, seed, bucket): the fraction of the bucket's instances exact,
    or of its answer bytes right, summed over its lengths (so a long length weighs its bytes);
    no value where some length of it could not be scored. Every row carries both counts."""
    out = []
    for metric, (right, of) in ((m.name, m.pooled) for m in METRICS.values()):
        for (scheme, seed), g in df.groupby(["scheme", "seed"], sort=False):
            totals = [(1, train_max, "in"), (train_max + 1, 10**9, "out")]
            for lo, hi, name in [(lo, hi, bucket_name(lo, hi)) for lo, hi in spans] + totals:
                part = g[(g["length"] >= lo) & (g["length"] <= hi)]
                if part.empty:
                    continue
                ok = (part["status"] == "ok").all()
                sums = {c: part[c].sum() for c in ("correct", "instances", "tokens_correct", "tokens")}
                out.append(
                    {
                        "task": g["task"].iloc[0],
                        "metric": metric,
                        "scheme": scheme,
                        "seed": seed,
                        "train_max": train_max,
                        "bucket": name,
                        "lo": lo,
                        "hi": int(part["length"].max()),
                        "split": "in" if hi <= train_max else "out",
                        "value": sums[right] / sums[of] if ok else math.nan,
                        "correct": int(sums["correct"]) if ok else "",
                        "instances": int(sums["instances"]),
                        "tokens_correct": int(sums["tokens_correct"]) if ok else "",
                        "tokens": int(sums["tokens"]),
                        "status": "ok" if ok else part.loc[part["status"] != "ok", "status"].iloc[0],
                        "attention": ",".join(sorted(set(part["attention"]))),
                    }
                )
    return pd.DataFrame(out, columns=SUMMARY_COLUMNS)


def comparison(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Schemes x buckets of one metric (compare.summarize): its mean over seeds, its 95%
    interval, seeds, and the schemes tied for best at each bucket; in and out of distribution first."""
    long = long[long["metric"] == metric]
    cols = list(dict.fromkeys(long["bucket"]))
    cols = [b for b in ("in", "out") if b in cols] + [b for b in cols if b not in ("in", "out")]
    order = scheme_order(set(long["scheme"]))
    return summarize(long.rename(columns={"bucket": "column"}), cols, order, METRICS[metric].higher_is_better)


def grid(table: pd.DataFrame, metric: str) -> tuple[list[list[str]], set]:
    """The table as rows of strings (a header first), percent, and the (row, column) cells that are best."""
    heads = [{"in": "in-dist", "out": "out-of-dist"}.get(b, b) for b in table.attrs["columns"]]
    m = METRICS[metric]
    return compare_grid(table, heads, m.digits, m.scale, missing="—", seeds=True)


def report(collected, metric: str, transpose: bool, edges) -> dict:
    """The parts of a task report of one metric: a section per grid point (buckets of lengths as
    columns), the per-bucket rows of both metrics for summary.csv (the same whichever is
    tabled), and a function that draws the plots."""
    df = frame(collected)
    points: dict[str, list] = {}
    for run in collected.runs:
        points.setdefault(collected.points[run.folder], []).append(run.cfg)
    # a sweep's points may differ in their task
    tasks = {point: build_task(configs[0].task, configs[0].task_options) for point, configs in points.items()}
    longest = max(task.test_max for task in tasks.values())
    past = [e for e in edges or [] if e > longest]
    if past:  # an end no point's lengths reach would be dropped in silence
        raise PosbenchError(f"--buckets: {past[0]} is past the longest test length, {longest}")
    parts = []  # (point, its configs, its task, its rows by bucket, its table)
    for point in sorted(points):
        configs, task = points[point], tasks[point]
        ends = edges if edges is not None else configs[0].eval.exact_match.buckets
        spans = buckets(task.train_max, task.test_max, ends)
        long = by_bucket(df[df["point"] == point], spans, task.train_max).assign(point=point)
        parts.append((point, configs, task, long, comparison(long, metric)))
    sections = []
    for point, configs, task, _, table in parts:
        rows, best = grid(table, metric)
        if transpose or len(table.attrs["columns"]) > 12:
            rows, best = transposed(rows, best)
        where = f" ({point})" if point else ""
        trained = f"trained on 1..{task.train_max}" + (f"; {point}" if point else "")
        label = METRICS[metric].label
        name = f"{configs[0].task}: {label} by length ({trained})"
        sections.append(
            Section(
                heading=name,
                caption=f"{tex(configs[0].task)}: {tex(label)} by length{tex(where)}; {tex(spread(table))}.",
                rows=rows,
                best=best,
                title=name,
            )
        )
    long = pd.concat([long for *_, long, _ in parts])
    if len(parts) > 1:
        sections.append(ranks_section(long, metric))
    task = parts[0][2]
    names = ", ".join(dict.fromkeys(c.task for _, configs, *_ in parts for c in configs))

    def plots(folder: Path, stem: str = "summary") -> list[str]:
        """The metric's plot as <stem>.png; training.png, which no view changes, with the summary."""
        plot(parts, folder / f"{stem}.png", metric)
        if stem != "summary":
            return [f"{stem}.png"]
        plot_training({run.folder: run for run in collected.runs}, folder / "training.png")
        return ["summary.png", "training.png"]

    return {
        "title": f"{names}: {METRICS[metric].title} by length"
        + (f", trained on 1..{task.train_max}, tested to {task.test_max}" if len(parts) == 1 else ""),
        "describe": describe(parts[0][1], task, long, metric, spread(*(table for *_, table in parts)))
        + (
            [f"- grid points (a table each; the lines above describe the first): {'; '.join(p for p, *_ in parts)}"]
            if len(parts) > 1
            else []
        ),
        "sections": sections,
        "legend": spread(*(table for *_, table in parts)),
        "csv": (long, SUMMARY_COLUMNS + (["point"] if len(parts) > 1 else [])),
        "plots": plots,
    }


def reciprocal_ranks(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The NoPE study's ranking: for each grid point and seed, the schemes ranked by the metric
    past N (rank 1 the highest; tied schemes share their mean rank), one over the rank. Rows:
    point, seed, scheme, rr. A (point, seed) with a scheme unscored is left out, as the study
    leaves out a query some scheme lacks."""
    out = long[(long["metric"] == metric) & (long["bucket"] == "out")]
    schemes = set(out["scheme"])
    rows = []
    for (point, seed), g in out.groupby(["point", "seed"], sort=False):
        if set(g["scheme"]) != schemes or g["value"].isna().any():
            continue
        for scheme, rank in zip(g["scheme"], g["value"].rank(method="average", ascending=False)):
            rows.append({"point": point, "seed": seed, "scheme": scheme, "rr": 1 / rank})
    return pd.DataFrame(rows, columns=["point", "seed", "scheme", "rr"])


def ranks_section(long: pd.DataFrame, metric: str) -> Section:
    """Mean reciprocal rank past N over every (grid point, seed), and its mean at each point,
    each with its 95% interval and the schemes tied for best (compare.summarize); the schemes
    by their mean reciprocal rank, highest first."""
    rr = reciprocal_ranks(long, metric).assign(status=OK, value=lambda d: d["rr"])
    points = list(dict.fromkeys(rr["point"]))
    queries = rr.groupby(["point", "seed"]).ngroups
    pairs = rr.assign(seed=rr["point"] + "|" + rr["seed"].astype(str), column="all")  # each pair a sample
    everywhere = summarize(pairs, ["all"], scheme_order(set(rr["scheme"])), True)
    order = list(everywhere.sort_values("all", ascending=False, kind="stable").index)
    at_points = summarize(rr.rename(columns={"point": "column"}), points, order, True)
    rows, best = [["scheme", "mean reciprocal rank", *points]], set()
    for i, s in enumerate(order, start=1):
        rows.append([s, cell(everywhere, s, "all", 2), *(cell(at_points, s, p, 2) for p in points)])
        best |= {(i, 1)} if everywhere.loc[s, "best all"] else set()
        best |= {(i, j) for j, p in enumerate(points, start=2) if at_points.loc[s, f"best {p}"]}
    label = METRICS[metric].label
    name = f"mean reciprocal rank past N over {queries} (grid point, seed) pairs"
    seeds = int(at_points["seeds"].max()) if len(order) else 0
    note = spread_note(seeds, everywhere.attrs["tests"] | at_points.attrs["tests"], at="column")
    return Section(
        heading=name,
        caption=f"the schemes ranked by {tex(label)} past N at each grid point and seed (tied schemes share "
        f"their mean rank), one over the rank, averaged over the {queries} pairs (their interval and test "
        f"pair by grid point and seed) and, a column per grid point, over its {seeds} seeds; {tex(note)}.",
        rows=rows,
        best=best,
        title=name,
    )


def frame(collected) -> pd.DataFrame:
    """Every run's per-length rows as one long DataFrame, typed, each naming its grid point."""
    rows = [{**r, "point": collected.points[run.folder]} for run in collected.runs for r in run.rows]
    df = pd.DataFrame(rows, columns=[*EVAL_COLUMNS, "point"])
    for c in ("seed", "train_max", "length", "instances", "tokens"):
        df[c] = df[c].astype(int)
    for c in ("correct", "tokens_correct"):  # blank where a length is beyond the scheme's positions
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def describe(configs: list, task: Task, long: pd.DataFrame, metric: str, note: str) -> list[str]:
    c, m, t = configs[0], configs[0].model, configs[0].train
    params = m.params
    # a long alphabet is counted, not printed: its backquotes and stars would break the Markdown
    options = ", ".join(
        f"{k}={len(v)} symbols (config.yaml lists them)" if isinstance(v, str) and len(v) > 26 else f"{k}={v}"
        for k, v in c.task_options.items()
    )
    return [
        f"- task: {c.task} ({type(task).description}); {options}",
        f"- model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, {params / 1e6:.2f}M parameters "
        f"with NoPE; train_len {m.train_len} (the longest training instance)",
        f"- training: {t.steps} steps x {t.batch_size} instances, lengths uniform in 1..{task.train_max}, "
        f"loss on the answer bytes only, {t.rate_said(schedule=False)}, {seeds_said(long)}",
        f"- evaluation: up to {task.opt['test_count']} fixed test instances per length 1..{task.test_max}, "
        f"never trained on; {METRICS[metric].how}",
        f"- cells: {METRICS[metric].label}, {note}; — : the scheme cannot encode those lengths",
    ]


def spread(*tables: pd.DataFrame) -> str:
    """What a cell's ± and its bold mean over these tables (compare.table.spread_note)."""
    return spread_note(max(int(t["seeds"].max()) for t in tables), set().union(*(t.attrs["tests"] for t in tables)))


def plot(sections: list, path: Path, metric: str) -> bool:
    """The metric against length (compare.band_plot), each bucket at its longest length: a line
    per scheme of its table with its 95% band over seeds, a dashed line at the longest training
    length; a panel per grid point."""
    panels = []
    for point, configs, task, long, table in sections:
        at = dict(zip(long["bucket"], long["hi"]))  # a bucket's longest length: its x
        xs = {c: at[c] for c in table.attrs["columns"] if c not in ("in", "out")}
        title = f"{configs[0].task}: {METRICS[metric].title} by length" + (f"\n{point}" if point else "")
        panels.append(Panel(title, lines(table, 100, xs), mark=task.train_max))
    xlabel = f"instance length; dashed: the longest trained; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, METRICS[metric].label, xlabel, log=False, ylim=(-2, 102), share_y=False)
