"""Tables and plots of a task's runs, from the run folders alone: accuracy by length bucket.

Lengths are grouped into buckets (eval.buckets, or `report --buckets`), each in or out of
distribution, plus the in- and out-of-distribution totals; cells are the mean ± 95% interval
over seeds, and the best schemes are marked by the same tests as perplexity's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from posbench.accuracy import EVAL_COLUMNS, METRIC, bucket_name, buckets, read_task_eval, task_of
from posbench.config import config_from_dict, read_record, read_yaml
from posbench.errors import PosbenchError
from posbench.files import atomic, write_atomic
from posbench.report import _pyplot, _save, plot_training, point_labels, scheme_order
from posbench.runs import SWEEP_RECORD, differences, experiment_part, trained_with
from posbench.stats import mean_ci, tied_for_best

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
    "status",
    "attention",
]


def is_task_experiment(exp_dirs) -> bool:
    """Whether the run folders record a task other than lm. Runs of both kinds are one error:
    perplexity and exact match share no table, and each kind's eval.csv would read as malformed
    to the other's reader. A record that cannot be read is left to the collector to name."""
    first: dict[bool, Path] = {}  # is a task -> the first run folder of that kind
    for d in exp_dirs:
        for cfg_file in sorted(Path(d).glob("*/config.yaml")):
            if not cfg_file.parent.name.startswith("."):
                try:
                    first.setdefault(read_yaml(cfg_file).get("task", "lm") != "lm", cfg_file.parent)
                except PosbenchError:
                    continue
    if len(first) > 1:
        raise PosbenchError(
            f"this report mixes perplexity runs (task lm, e.g. {first[False]}) with task runs "
            f"(e.g. {first[True]}); report them apart"
        )
    return True in first


def collect(exp_dirs: list[Path]) -> tuple[pd.DataFrame, list]:
    """Every run's per-length rows and its config, refused unless all runs share a task and
    settings; in a sweep's folder (it holds sweep.yaml) each row names its grid point in a
    `point` column instead, and df.attrs["points"] maps each point to its runs' configs."""
    rows, configs, first, runs, schemes, trained, parts, of = [], [], None, {}, {}, {}, {}, {}
    for exp_dir in map(Path, exp_dirs):
        if not exp_dir.is_dir():
            raise PosbenchError(f"{exp_dir}: no such experiment directory")
        sweep = (exp_dir / SWEEP_RECORD).is_file()
        for rdir in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if not (rdir / "config.yaml").is_file() and not (rdir / "model.pt").is_file():
                continue
            if not (rdir / "config.yaml").is_file() or not (rdir / "eval.csv").is_file():
                raise PosbenchError(
                    f"{rdir}: a run folder without config.yaml or eval.csv; finish it with "
                    f"posbench evaluate {rdir}, or move it out of {exp_dir}"
                )
            cfg = config_from_dict(read_record(rdir / "config.yaml"), source=str(rdir / "config.yaml"))
            part = experiment_part(cfg.to_dict())
            if first is None:
                first = (rdir, part)
            elif part != first[1] and not sweep:
                diff = differences(first[1], part, (first[0].name, f"in {rdir.name}"))
                raise PosbenchError(
                    f"{exp_dir}: runs trained under different settings ({', '.join(diff)}); "
                    f"a table compares runs that differ only in scheme and seed"
                )
            configs.append(cfg)
            parts[rdir], of[rdir] = part, cfg
            rows += [{**r, "point": rdir} for r in read_task_eval(rdir)]
            runs[rdir], schemes[rdir], trained[rdir.name] = cfg.seeds[0], cfg.schemes, trained_with(rdir)
    if not rows:
        raise PosbenchError(f"{', '.join(map(str, exp_dirs))}: holds no evaluated runs")
    labels = point_labels(parts)
    df = pd.DataFrame([{**r, "point": labels[r["point"]]} for r in rows], columns=[*EVAL_COLUMNS, "point"])
    for c in ("seed", "train_max", "length", "instances"):
        df[c] = df[c].astype(int)
    df["correct"] = pd.to_numeric(df["correct"], errors="coerce")
    points: dict[str, list] = {}
    for rdir, label in labels.items():
        points.setdefault(label, []).append(of[rdir])
    df.attrs.update(runs=runs, schemes=schemes, trained_with=trained, points=points)
    return df, configs


def by_bucket(df: pd.DataFrame, spans: list[tuple[int, int]], train_max: int) -> pd.DataFrame:
    """One row per (scheme, seed, bucket): accuracy over the bucket's instances; no value where
    some length of it could not be scored."""
    out = []
    for (scheme, seed), g in df.groupby(["scheme", "seed"], sort=False):
        totals = [(1, train_max, "in"), (train_max + 1, 10**9, "out")]
        for lo, hi, name in [(lo, hi, bucket_name(lo, hi)) for lo, hi in spans] + totals:
            part = g[(g["length"] >= lo) & (g["length"] <= hi)]
            if part.empty:
                continue
            ok = (part["status"] == "ok").all()
            correct, n = part["correct"].sum(), part["instances"].sum()
            out.append(
                {
                    "task": g["task"].iloc[0],
                    "metric": METRIC,
                    "scheme": scheme,
                    "seed": seed,
                    "train_max": train_max,
                    "bucket": name,
                    "lo": lo,
                    "hi": int(part["length"].max()),
                    "split": "in" if hi <= train_max else "out",
                    "value": correct / n if ok else math.nan,
                    "correct": int(correct) if ok else "",
                    "instances": int(n),
                    "status": "ok" if ok else part.loc[part["status"] != "ok", "status"].iloc[0],
                    "attention": ",".join(sorted(set(part["attention"]))),
                }
            )
    return pd.DataFrame(out, columns=SUMMARY_COLUMNS)


def comparison(long: pd.DataFrame) -> pd.DataFrame:
    """Schemes x buckets: the mean accuracy over seeds, its 95% interval, seeds, and the schemes
    tied for best at each bucket (the same paired/Welch tests as perplexity)."""
    order = scheme_order(set(long["scheme"]))
    cols = list(dict.fromkeys(long["bucket"]))
    cols = [b for b in ("in", "out") if b in cols] + [b for b in cols if b not in ("in", "out")]
    table = {}
    for b in cols:
        at = long[(long["bucket"] == b) & long["value"].notna()]
        by_scheme = {s: dict(zip(g["seed"], -g["value"])) for s, g in at.groupby("scheme")}  # lower is better
        _, tied, _ = tied_for_best(by_scheme)
        values = {s: [-v for v in by_scheme[s].values()] for s in by_scheme}
        top = max((sum(v) / len(v) for v in values.values()), default=math.nan)
        tied |= {s for s, v in values.items() if sum(v) / len(v) == top}  # equal means: no test tells them apart
        table[b] = [mean_ci(values[s])[0] if s in values else math.nan for s in order]
        table[f"ci {b}"] = [mean_ci(values[s])[1] if s in values else math.nan for s in order]
        table[f"best {b}"] = [s in tied for s in order]
    table["seeds"] = [long[long["scheme"] == s]["seed"].nunique() for s in order]
    table = pd.DataFrame(table, index=order)
    table.attrs["buckets"] = cols
    return table


def cell(table: pd.DataFrame, scheme: str, b: str) -> str:
    """'97.3 ± 1.2' (percent exact, with the 95% interval over seeds), or — where not scored."""
    v, ci = table.loc[scheme, b], table.loc[scheme, f"ci {b}"]
    if v != v:
        return "—"
    return f"{100 * v:.1f} ± {100 * ci:.1f}" if ci == ci else f"{100 * v:.1f}"


def grid(table: pd.DataFrame, transpose: bool, bold=lambda t: f"**{t}**") -> list[list[str]]:
    cols = table.attrs["buckets"]
    head = ["scheme"] + [{"in": "in-dist", "out": "out-of-dist"}.get(b, b) for b in cols] + ["seeds"]
    rows = [head]
    for s in table.index:
        cells = [bold(cell(table, s, b)) if table.loc[s, f"best {b}"] else cell(table, s, b) for b in cols]
        rows.append([s] + cells + [str(int(table.loc[s, "seeds"]))])
    if transpose:
        rows = [list(r) for r in zip(*rows)]
        rows[0][0] = "length"
    return rows


def describe(configs: list, long: pd.DataFrame) -> list[str]:
    from posbench.model import TransformerLM

    c = configs[0]
    task, m, t = task_of(c), c.model, c.train
    params = TransformerLM(c.model_for("nope")).num_params()
    options = ", ".join(f"{k}={v}" for k, v in c.task_options.items())
    return [
        f"- task: {c.task} ({type(task).description}); {options}",
        f"- model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, {params / 1e6:.2f}M parameters "
        f"with NoPE; train_len {m.train_len} (the longest training instance)",
        f"- training: {t.steps} steps x {t.batch_size} instances, lengths uniform in 1..{task.train_max}, "
        f"loss on the answer bytes only, AdamW lr {t.lr:g}, seeds {sorted(set(long['seed']))}",
        f"- evaluation: up to {task.opt['test_count']} fixed test instances per length 1..{task.test_max}, "
        f"never trained on; greedy decoding, exact match of the whole answer",
        "- cells: % exact match, mean ± 95% interval over seeds (Student's t); bold: the best and every scheme "
        "not significantly different from it; — : the scheme cannot encode those lengths",
    ]


def markdown(configs, long, table, transpose, point: str = "") -> str:
    c = configs[0]
    task = task_of(c)
    out = [
        f"# {c.task}: exact-match accuracy by length, trained on 1..{task.train_max}, tested to {task.test_max}"
        + (f" ({point})" if point else ""),
        "",
    ]
    out += describe(configs, long)
    rows = grid(table, transpose or len(table.attrs["buckets"]) > 12)
    out += ["", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out) + "\n"


def latex(configs, table, transpose, point: str = "") -> str:
    def tex(text: str) -> str:
        for a, b in (("_", "\\_"), ("%", "\\%"), ("±", "$\\pm$"), ("—", "--")):
            text = text.replace(a, b)
        return text

    marked = grid(table, transpose or len(table.attrs["buckets"]) > 12, bold=lambda t: "\0" + t)
    rows = [[f"\\textbf{{{tex(x[1:])}}}" if x.startswith("\0") else tex(x) for x in r] for r in marked]
    return "\n".join(
        [
            "\\begin{table}[t]",
            "\\centering",
            f"\\begin{{tabular}}{{l{'r' * (len(rows[0]) - 1)}}}",
            "\\toprule",
            " & ".join(rows[0]) + " \\\\",
            "\\midrule",
            *(" & ".join(r) + " \\\\" for r in rows[1:]),
            "\\bottomrule",
            "\\end{tabular}",
            f"\\caption{{{tex(configs[0].task)}: \\% exact match by length, mean $\\pm$ 95\\% interval "
            f"over seeds{tex(f' ({point})' if point else '')}.}}",
            "\\end{table}",
            "",
        ]
    )


def plot(sections: list, path: Path) -> bool:
    """Accuracy against length (each bucket at its longest length), one line per scheme with its
    95% band over seeds, a dashed line at the longest training length; a panel per grid point."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(sections), figsize=(7 * len(sections), 4), squeeze=False)
    for ax, (point, configs, long, _) in zip(axes[0], sections):
        train_max = task_of(configs[0]).train_max
        part = long[~long["bucket"].isin(["in", "out"])]
        for s in scheme_order(set(part["scheme"])):
            g = part[part["scheme"] == s]
            xs, means, cis = [], [], []
            for hi, at in g.groupby("hi"):
                vals = at["value"].dropna().tolist()
                if vals:
                    mean, ci = mean_ci(vals)
                    xs.append(hi), means.append(100 * mean), cis.append(0 if ci != ci else 100 * ci)
            (line,) = ax.plot(xs, means, marker="o", markersize=3, label=s)
            lo = [m - c for m, c in zip(means, cis)]
            ax.fill_between(
                xs, lo, [m + c for m, c in zip(means, cis)], color=line.get_color(), alpha=0.15, linewidth=0
            )
        ax.axvline(train_max, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{configs[0].task}: exact match by length" + (f"\n{point}" if point else ""), fontsize=10)
        ax.set_xlabel(f"instance length; dashed: the longest trained ({train_max})")
        ax.set_ylabel("% exact match")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_summary(exp_dirs, out: Path, transpose: bool = False, edges: Optional[list[int]] = None) -> list:
    """summary.csv (task, metric, scheme, seed, bucket... one row per run and bucket, and its
    in- and out-of-distribution totals; a `point` column in a sweep), summary.md, summary.tex,
    summary.png and training.png. Returns (grid point, configs, rows, table) per grid point."""
    df, _ = collect(exp_dirs)
    sections = []
    for point in sorted(df.attrs["points"]):
        configs = df.attrs["points"][point]
        task = task_of(configs[0])
        spans = buckets(task.train_max, task.test_max, edges if edges is not None else configs[0].eval.buckets)
        long = by_bucket(df[df["point"] == point], spans, task.train_max).assign(point=point)
        sections.append((point, configs, long, comparison(long)))
    columns = SUMMARY_COLUMNS + (["point"] if len(sections) > 1 else [])
    out.mkdir(parents=True, exist_ok=True)
    with atomic(out / "summary.csv") as tmp:
        pd.concat([long for _, _, long, _ in sections]).to_csv(tmp, index=False, columns=columns)
    write_atomic(out / "summary.md", "\n".join(markdown(c, long, t, transpose, p) for p, c, long, t in sections))
    write_atomic(out / "summary.tex", "\n".join(latex(c, t, transpose, p) for p, c, _, t in sections))
    plot(sections, out / "summary.png")
    plot_training(df, out / "training.png")
    return sections
