"""Exact match and per-token accuracy on a synthetic task: a run's records (eval.csv, samples.txt)
and its tables by length bucket.

A run of a task trains on instances of lengths 1..train_max, the loss on the answer bytes
alone, and is scored on a fixed test set of every length 1..test_max (posbench/accuracy.py
holds the torch side) by two metrics: exact match of the whole answer under greedy decoding
(the NoPE study's), and the answer bytes right, each predicted given the true bytes before it
(Ruoss et al.'s per-token accuracy). Its eval.csv holds a row per test length with both
(correct, instances, accuracy; tokens_correct, tokens, token_accuracy); samples.txt a few test
instances of each length bucket with the model's answers. Tables show one metric (--metric),
lengths grouped into buckets, each in or out of distribution, plus the in- and
out-of-distribution totals.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pandas as pd

from posbench.compare.order import scheme_order
from posbench.compare.plot import BAND_SEEDS, Panel, band_plot, lines, plot_training
from posbench.compare.render import tex, transposed
from posbench.compare.table import OK, cell, seeds_said, spread_note, summarize
from posbench.compare.table import grid as compare_grid
from posbench.errors import PosbenchError
from posbench.files import write_atomic, write_rows
from posbench.measures.base import Measure, Metric, Section, only_own_section
from posbench.tasks.generators import Task, build_task


class ExactMatch(Measure):
    name = "exact_match"
    records = ("eval.csv", "samples.txt")
    metrics = {
        "exact_match": Metric(
            "exact_match", "% exact match", True, 1, column="accuracy", aggregate="pooled",
            pooled=("correct", "instances"), scale=100, title="exact-match accuracy",
            how="greedy decoding, exact match of the whole answer",
        ),
        "token_accuracy": Metric(
            "token_accuracy", "% answer bytes right", True, 1, column="token_accuracy", aggregate="pooled",
            pooled=("tokens_correct", "tokens"), scale=100, title="per-token accuracy",
            how="per-token accuracy: the answer bytes (END included) right over all of them, each predicted given "
            "the true bytes before it (teacher-forced), summed over a bucket's lengths",
        ),
    }  # fmt: skip

    def __init__(self, task: Task):
        self.task = task

    def decide(self, cfg, test_len) -> None:
        if test_len is not None:
            raise PosbenchError(
                "--test-len sets perplexity lengths; a task's are task_options.train_max and test_max, "
                "e.g. --set task_options.test_max=60"
            )
        own = [self.task.train_len]
        # a task run's own record holds the lengths it derived: those are no choice of the user's
        if "eval.lengths" in cfg.origins and cfg.eval.lengths != own:
            raise PosbenchError(
                f"eval.lengths={cfg.eval.lengths}: a task derives it (task {cfg.task}: train_len "
                f"{self.task.train_len}, its longest training instance); lengths are perplexity's, a task's are "
                f"task_options.train_max and test_max",
                "eval.lengths",
            )
        cfg.eval.lengths = own  # perplexity lengths: a task is scored at its own lengths
        only_own_section(cfg, self.name)

    def score(self, rc, rdir: Path, model, test, device, backend: str) -> None:
        try:
            scored = {r["attention"] for r in read_task_eval(rdir)} == {backend}
        except PosbenchError:
            scored = False
        if not scored:
            evaluate_task_into(rc, rdir, model.to(device), self.task, test, device, backend)

    def rescore(self, cfg, rdir: Path, model, test, device) -> list[dict]:
        return evaluate_task_into(cfg, rdir, model, self.task, test, device, model.backend(device))

    def evaluation(self, rc, rows: list[dict]) -> tuple[str, list[list[str]]]:
        table = [["length", "exact", "per-token", "instances", "answer bytes", "status"]]
        for r in rows:
            ok = r["status"] == "ok"
            table.append(
                [
                    str(r["length"]),
                    f"{100 * r['accuracy']:.1f}%" if ok else "—",
                    f"{100 * r['token_accuracy']:.1f}%" if ok else "—",
                    str(r["instances"]),
                    str(r["tokens"]),
                    r["status"],
                ]
            )
        return f"{rc.task}: {rc.model.scheme} seed {rc.seeds[0]}; attention {rows[0]['attention']}", table

    def read(self, rdir: Path) -> list[dict]:
        return read_task_eval(rdir)

    def report(self, collected, metric, transpose: bool, buckets) -> dict:
        if metric not in (None, *self.metrics):
            raise PosbenchError(f"--metric {metric}: a task's runs report {' or '.join(self.metrics)}")
        return report(collected, metric or "exact_match", transpose, buckets)

    def join_checks(self, rows: list[dict]) -> list[tuple[str, set]]:
        return [("tasks", {r["task"] for r in rows}), ("training lengths", {int(r["train_max"]) for r in rows})]


METRIC = "exact_match"  # eval.csv's `metric`: the measure that scored the row (each row holds both metrics)

EVAL_COLUMNS = [
    "task",
    "metric",
    "scheme",
    "seed",
    "train_max",
    "length",
    "correct",
    "instances",
    "accuracy",
    "tokens_correct",
    "tokens",
    "token_accuracy",
    "status",
    "attention",
]


SAMPLES_PER_BUCKET = 3


def evaluate_task_into(rc, rdir: Path, model, task: Task, test: list, device, backend: str) -> list[dict]:
    """Score a run on its task's test set; write eval.csv and samples.txt. Returns the rows."""
    from posbench.accuracy import score

    rows = score(model, test, device)
    ident = {
        "task": rc.task,
        "metric": METRIC,
        "scheme": rc.model.scheme,
        "seed": rc.seeds[0],
        "train_max": task.train_max,
        "attention": backend,
    }
    rows = [{**ident, **r} for r in rows]
    write_rows(rdir / "eval.csv", rows, EVAL_COLUMNS)
    write_atomic(rdir / "samples.txt", samples(rc, task, test, model, device, rows))
    return rows


def samples(rc, task: Task, test: list, model, device, rows: list[dict]) -> str:
    """samples.txt: for each length bucket, its first few test instances (the same ones in
    every run, so two schemes' files compare line by line) and the model's greedy answers."""
    acc = {r["length"]: r for r in rows}
    spans = buckets(task.train_max, task.test_max, rc.eval.exact_match.buckets)
    shown = [[(p, a) for n, p, a in test if lo <= n <= hi][:SAMPLES_PER_BUCKET] for lo, hi in spans]
    flat = [inst for group in shown for inst in group]
    from posbench.accuracy import decode, show

    answers = iter(decode(model, flat, device))
    out = [
        f"# {rc.task}, {rc.model.scheme} seed {rc.seeds[0]}: the first {SAMPLES_PER_BUCKET} test instances "
        f"of each length bucket; trained on lengths 1..{task.train_max}",
        "",
    ]
    for (lo, hi), group in zip(spans, shown):
        scored = [acc[n] for n in range(lo, hi + 1) if n in acc and acc[n]["status"] == "ok"]
        right = sum(r["correct"] for r in scored)
        total = sum(r["instances"] for r in scored)
        right_bytes = sum(r["tokens_correct"] for r in scored)
        total_bytes = sum(r["tokens"] for r in scored)
        split = "in distribution" if hi <= task.train_max else "out of distribution"
        out.append(
            f"## lengths {bucket_name(lo, hi)} ({split}): {right} of {total} exact, "
            f"{right_bytes} of {total_bytes} answer bytes right"
        )
        for (p, a), ans in zip(group, answers):
            mark = "ok" if ans == a else "WRONG"
            out += [f"prompt  {show(p)}", f"target  {show(a)}", f"answer  {show(ans)}  {mark}", ""]
    return "\n".join(out).rstrip() + "\n"


def read_task_eval(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "eval.csv"
    bad = PosbenchError(
        f"{path}: malformed task evaluation rows, or not all the columns a task run records "
        f"({', '.join(EVAL_COLUMNS)}); score the run again with posbench evaluate {run_dir}"
    )
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != EVAL_COLUMNS or not rows:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r["instances"]), int(r["seed"]), int(r["tokens"])
            if r["status"] == "ok":
                int(r["correct"]), int(r["tokens_correct"]), float(r["token_accuracy"])
    except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        raise bad from None
    return rows


def buckets(train_max: int, test_max: int, edges: list[int] = ()) -> list[tuple[int, int]]:
    """(lo, hi) length buckets covering 1..test_max, or ending at the given `edges`. By default:
    one per length up to 12; else the training lengths in two halves, each of N+1..N+5 alone
    (where extrapolation shows or fails first), and the rest in three of equal width: ten
    columns. train_max always ends a bucket, so none straddles in and out of distribution."""
    if edges:
        ends = {e for e in edges if e < test_max}
    elif test_max <= 12:
        ends = set(range(1, test_max + 1))
    else:
        N = train_max
        near = set(range(N + 1, min(N + 5, test_max) + 1))
        rest = test_max - max(near, default=N)
        ends = {math.ceil(N / 2), *near, *(test_max - rest + math.ceil(rest * k / 3) for k in range(1, 4) if rest)}
    ends = sorted(ends | {train_max, test_max})
    return [(lo, hi) for lo, hi in zip([1] + [e + 1 for e in ends[:-1]], ends)]


def bucket_name(lo: int, hi: int) -> str:
    return str(hi) if lo == hi else f"{lo}-{hi}"


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
    for metric, (right, of) in ((m.name, m.pooled) for m in ExactMatch.metrics.values()):
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
    return summarize(
        long.rename(columns={"bucket": "column"}), cols, order, ExactMatch.metrics[metric].higher_is_better
    )


def grid(table: pd.DataFrame, metric: str) -> tuple[list[list[str]], set]:
    """The table as rows of strings (a header first), percent, and the (row, column) cells that are best."""
    heads = [{"in": "in-dist", "out": "out-of-dist"}.get(b, b) for b in table.attrs["columns"]]
    m = ExactMatch.metrics[metric]
    return compare_grid(table, heads, m.digits, m.scale, missing="—", seeds=True)


def report(collected, metric: str, transpose: bool, edges) -> dict:
    """The parts of a task report of one metric: a section per grid point (buckets of lengths as
    columns), the per-bucket rows of both metrics for summary.csv (the same whichever is
    tabled), and a function that draws the plots."""
    df = frame(collected)
    points: dict[str, list] = {}
    for run in collected.runs:
        points.setdefault(collected.points[run.folder], []).append(run.cfg)
    parts = []  # (point, its configs, its task, its rows by bucket, its table)
    for point in sorted(points):
        configs = points[point]
        task = build_task(configs[0].task, configs[0].task_options)  # a sweep's points may differ in it
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
        label = ExactMatch.metrics[metric].label
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
        "title": f"{names}: {ExactMatch.metrics[metric].title} by length"
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
    label = ExactMatch.metrics[metric].label
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
        f"loss on the answer bytes only, AdamW lr {t.lr:g}, {seeds_said(long)}",
        f"- evaluation: up to {task.opt['test_count']} fixed test instances per length 1..{task.test_max}, "
        f"never trained on; {ExactMatch.metrics[metric].how}",
        f"- cells: {ExactMatch.metrics[metric].label}, {note}; — : the scheme cannot encode those lengths",
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
        title = f"{configs[0].task}: {ExactMatch.metrics[metric].title} by length" + (f"\n{point}" if point else "")
        panels.append(Panel(title, lines(table, 100, xs), mark=task.train_max))
    xlabel = f"instance length; dashed: the longest trained; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, ExactMatch.metrics[metric].label, xlabel, log=False, ylim=(-2, 102), share_y=False)
