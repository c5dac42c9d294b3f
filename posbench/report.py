"""Tables and plots, built from the run folders on disk alone, so any of them can be rebuilt."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from posbench.config import config_from_dict, read_record
from posbench.errors import PosbenchError
from posbench.evaluate import PROTOCOL_NAMES, protocol_label
from posbench.files import atomic, lock_holder, write_atomic
from posbench.runs import (
    DIVERGED,
    EVAL_COLUMNS,
    POSITION_COLUMNS,
    SWEEP_RECORD,
    UNRECORDED,
    differences,
    diverged_step,
    experiment_part,
    flat,
    lock_file,
    read_eval,
    read_positions,
    read_train_log,
    trained_with,
)
from posbench.stats import mean_ci, tied_for_best


def collect(exp_dir: Path) -> tuple[pd.DataFrame, list]:
    """Every run's evaluation rows (long format) and every run's resolved config. A sweep's
    folder (it holds sweep.yaml) may hold runs trained under other settings: each row names
    its grid point in a `point` column, e.g. 'model.train_len=64'; elsewhere they are refused."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise PosbenchError(f"{exp_dir}: no such experiment directory")
    sweep = (exp_dir / SWEEP_RECORD).is_file()
    rows, configs, trained, runs, schemes, first, parts = [], [], {}, {}, {}, None, {}
    diverged, running = {}, []  # run folder name -> 'alibi seed 1 at step 12'; folders in progress
    for rdir in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        has = {f: (rdir / f).is_file() for f in ("config.yaml", "eval.csv", "model.pt")}
        if (rdir / DIVERGED).is_file() and not has["model.pt"]:  # no weights, no rows: named, not scored
            c = config_from_dict(read_record(rdir / "config.yaml"), source=str(rdir / "config.yaml"))
            diverged[rdir.name] = f"{c.schemes[0]} seed {c.seeds[0]} {diverged_step(rdir)}"
            continue
        if not any(has.values()):
            continue  # not a run folder
        if not (has["config.yaml"] and has["eval.csv"]) and lock_holder(lock_file(rdir)) is not None:
            running.append(rdir.name)  # another process is evaluating it
            continue
        if not (has["config.yaml"] and has["eval.csv"]):  # a run is never left out in silence
            lacks = " and ".join(f for f in ("config.yaml", "eval.csv") if not has[f])
            raise PosbenchError(
                f"{rdir}: a run folder without {lacks}; finish it with posbench evaluate {rdir} "
                f"or posbench extrapolate, or move it out of {exp_dir}"
            )
        raw = read_record(rdir / "config.yaml")  # malformed or not text: one line naming it
        configs.append(config_from_dict(raw, source=str(rdir / "config.yaml")))
        part = experiment_part(configs[-1].to_dict())
        parts[rdir] = part
        if first is None:
            first = (rdir, part)
        elif part != first[1] and not sweep:
            diff = differences(first[1], part, (first[0].name, f"in {rdir.name}"))
            raise PosbenchError(
                f"{exp_dir}: runs trained under different settings ({', '.join(diff)}); "
                f"a table compares runs that differ only in scheme and seed"
            )
        rows += [{**r, "point": rdir} for r in read_eval(rdir)]
        trained[rdir.name] = trained_with(rdir)
        runs[rdir] = configs[-1].seeds[0]
        schemes[rdir] = configs[-1].schemes
    if not rows and diverged:
        raise PosbenchError(f"{exp_dir}: every run diverged ({', '.join(diverged.values())}); lower train.lr")
    if not rows:
        raise PosbenchError(f"{exp_dir}: holds no evaluated runs (run folders with config.yaml and eval.csv)")
    points = point_labels(parts)
    columns = EVAL_COLUMNS + (["point"] if len(set(points.values())) > 1 else [])
    df = pd.DataFrame([{**r, "point": points[r["point"]]} for r in rows], columns=columns)
    for c in ("seed", "train_len", "length", "tokens"):
        df[c] = df[c].astype(int)
    for c in ("loss", "ppl"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    order = scheme_order(set(df["scheme"]))
    df["scheme"] = pd.Categorical(df["scheme"], categories=order, ordered=True)
    df = df.sort_values([c for c in ("point", "scheme", "seed", "length") if c in df]).reset_index(drop=True)
    df["scheme"] = df["scheme"].astype(str)
    df.attrs["trained_with"] = trained  # run folder -> the backend it trained with (None: unrecorded)
    df.attrs["runs"] = runs  # run folder -> its seed
    df.attrs["schemes"] = schemes  # run folder -> its scheme, as a list
    df.attrs["diverged"] = diverged
    df.attrs["running"] = running
    df.attrs["points"] = points if "point" in df else {}  # run folder -> its grid point
    return df, configs


def point_labels(parts: dict) -> dict:
    """Run folder -> 'model.train_len=64, train.lr=0.001': the settings in which its training
    differs from other runs' (all '' when they share them all)."""
    flats = {rdir: flat(part) for rdir, part in parts.items()}
    keys = sorted({k for f in flats.values() for k in f})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flats.values()}) > 1]
    return {rdir: ", ".join(f"{k}={f.get(k)}" for k in varying) for rdir, f in flats.items()}


def point_order(df: pd.DataFrame) -> list:
    """The grid points in order of their settings (numbers as numbers), or [None] for none."""
    if "point" not in df:
        return [None]
    first = df.groupby("point")["train_len"].first()
    return sorted(first.index, key=lambda p: (first[p], p))


def scheme_order(names: set) -> list[str]:
    """Registry order (the order of the paper tables), each scheme followed by its
    evaluation-time variants (rope, rope+ntk, rope+yarn, ...); plugins after."""
    from posbench.schemes import SCHEMES

    order = []
    for s in SCHEMES:
        order += [s] if s in names else []
        order += sorted(n for n in names if n.startswith(s + "+"))
    return order + sorted(names - set(order))


METRICS = {  # name -> (what a cell holds, how many decimals)
    "ppl": ("perplexity per byte", 2),
    "loss": ("loss in nats per byte", 3),
    "ratio": ("perplexity over its perplexity at the training length", 3),
}


def with_metric(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """df with a `value` column: each row's ppl, loss, or ppl over the same run's (scheme,
    seed, protocol) ppl at the training length."""
    if metric not in METRICS:
        raise PosbenchError(f"--metric {metric}: expected one of {', '.join(METRICS)}")
    df = df.copy()
    if metric != "ratio":
        df["value"] = df[metric]
        return df
    keys = ["scheme", "seed", "protocol", "stride"] + (["point"] if "point" in df else [])
    base = df[df["length"] == df["train_len"]].set_index(keys)["ppl"]
    df["value"] = df["ppl"].values / base.reindex(pd.MultiIndex.from_frame(df[keys])).values
    return df


def comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Schemes x lengths of one protocol: the mean `value` (ppl unless with_metric chose another)
    over seeds, its 95% interval, the schemes tied for best, and ppl(longest)/ppl(train)."""
    if "value" not in df:
        df = with_metric(df, "ppl")
    order = list(dict.fromkeys(df["scheme"]))
    ok = df[df["status"] == "ok"]
    lengths = sorted(df["length"].unique())
    mean = ok.pivot_table(index="scheme", columns="length", values="value", aggfunc="mean")
    mean = mean.reindex(index=order, columns=lengths)
    # a variant row (rope+yarn) counts against its base scheme's seeds: those are its checkpoints
    base_seeds = df.groupby(df["scheme"].str.split("+").str[0])["seed"].nunique()
    seeds = pd.Series([base_seeds[s.split("+")[0]] for s in order], index=order)
    train_len = df.groupby("scheme")["train_len"].first().reindex(order)
    status = df.pivot_table(index="scheme", columns="length", values="status", aggfunc="first")
    status = status.reindex(index=order, columns=lengths)
    scored = ok.pivot_table(index="scheme", columns="length", values="seed", aggfunc="nunique")
    scored = scored.reindex(index=order, columns=lengths)
    blown = df[df["status"] == "non-finite"]
    blown = blown.pivot_table(index="scheme", columns="length", values="seed", aggfunc="nunique")
    blown = blown.reindex(index=order, columns=lengths)
    out = pd.DataFrame(index=order)
    out.index.name = "scheme"
    tests = set()
    for L in lengths:
        at = ok[ok["length"] == L]
        by_scheme = {s: dict(zip(g["seed"], g["value"])) for s, g in at.groupby("scheme")}
        _, tied, test = tied_for_best(by_scheme)
        tests.add(test)
        out[L] = mean[L]
        out[f"ci {L}"] = [mean_ci(list(by_scheme[s].values()))[1] if s in by_scheme else math.nan for s in order]
        out[f"status {L}"] = status[L]
        out[f"n {L}"] = scored[L]  # seeds behind the mean, when fewer than the row's
        out[f"nonfinite {L}"] = blown[L]  # seeds whose loss blew up there
        out[f"best {L}"] = [s in tied for s in order]
    out["ratio"] = [
        math.nan
        if (blown.loc[s].reindex([train_len[s], lengths[-1]]).fillna(0) > 0).any()  # none hidden
        else _ratio(ok[ok["scheme"] == s], train_len[s], lengths[-1])
        for s in order
    ]
    out["seeds"] = seeds
    out.attrs["tests"] = tests - {"none"}
    out.attrs["train_len"] = int(df["train_len"].iloc[0])  # one per table: a grid point's
    return out


def _ratio(rows: pd.DataFrame, base: int, longest: int) -> float:
    """ppl(longest) / ppl(base) over the seeds scored at both, so that a length only some
    seeds reached is not divided by another set of seeds' mean."""
    a = rows[rows["length"] == base].set_index("seed")["ppl"]
    b = rows[rows["length"] == longest].set_index("seed")["ppl"]
    both = a.index.intersection(b.index)
    return b[both].mean() / a[both].mean() if len(both) else math.nan


def cell(table: pd.DataFrame, scheme: str, L: int, missing: str = "", digits: int = 2) -> str:
    """'12.34', or '12.34 ± 0.10' (the 95% interval over seeds), with '(1 of 3 seeds)' when
    fewer seeds than the row's reached the length and '; 1 non-finite' when some blew up there;
    'nan' when all did; the status (or `missing`) where the scheme could not be scored; blank
    where never evaluated."""
    v, ci, st = table.loc[scheme, L], table.loc[scheme, f"ci {L}"], table.loc[scheme, f"status {L}"]
    if not isinstance(st, str):
        return ""
    blown = table.loc[scheme, f"nonfinite {L}"]
    blown = 0 if blown != blown else int(blown)
    if v != v:  # no seed scored here
        return "nan" if blown else (missing or st)
    text = f"{v:.{digits}f} ± {ci:.{digits}f}" if ci == ci else f"{v:.{digits}f}"
    n, of = table.loc[scheme, f"n {L}"], table.loc[scheme, "seeds"]
    if blown:
        return f"{text} ({n:.0f} of {of} seeds; {blown} non-finite)"
    return text if n == of else f"{text} ({n:.0f} of {of} seeds)"


def is_best(table: pd.DataFrame, scheme: str, L: int) -> bool:
    return bool(table.loc[scheme, f"best {L}"])


def spread_note(tables: dict[str, pd.DataFrame]) -> str:
    """What a cell's ± and its bold mean, or why there is no interval."""
    seeds = max(int(t["seeds"].max()) for t in tables.values())
    if seeds < 2:
        return "1 seed: no interval; use --seeds 0,1,2. Bold: the best scheme at each length"
    tests = set().union(*(t.attrs.get("tests", set()) for t in tables.values()))
    how = {
        "paired": "a paired t-test over seeds (the same seeds: the same init and data order)",
        "welch": "Welch's t-test where the seed sets differ",
    }
    test = "; ".join(how[t] for t in sorted(tests)) or "no test (too few seeds)"
    return (
        f"mean ± 95% confidence interval over seeds (Student's t). Bold: the best scheme at each "
        f"length and every scheme not significantly different from it (p >= 0.05, {test})"
    )


def lengths_of(table: pd.DataFrame) -> list[int]:
    return [c for c in table.columns if isinstance(c, int) or str(c).isdigit()]


def trained_at(df: pd.DataFrame) -> str:
    """'32', or '32, 64' for a grid over training lengths."""
    return ", ".join(str(L) for L in sorted(set(df["train_len"])))


def describe(configs: list, df: pd.DataFrame) -> list[str]:
    """Corpus, model size, training budget and evaluation protocol, from the run configs."""
    from posbench.data import SHAKESPEARE_NAME
    from posbench.model import TransformerLM

    c = configs[0]
    m, t = c.model, c.train
    params = TransformerLM(c.model_for("nope")).num_params()
    corpus = SHAKESPEARE_NAME if c.data.path is None else f"{c.data.path} (bytes)"
    tokens = t.steps * t.batch_size * m.train_len
    lines = [
        f"- corpus: {corpus}; validation = last {c.data.val_fraction:.0%} of it",
        f"- model: {m.n_layer} layer{'s' if m.n_layer > 1 else ''}, d_model {m.d_model}, {m.n_head} heads, "
        f"{params / 1e6:.2f}M parameters with NoPE, vocab {m.vocab_size}",
        f"- training: {t.steps} steps x {t.batch_size} sequences x {m.train_len} tokens "
        f"= {tokens:,} tokens, AdamW lr {t.lr:g} (warmup {t.warmup_steps}, cosine "
        f"to {t.min_lr:g}), seeds {sorted(set(df['seed']))}",
        f"- evaluation: {_protocols_note(df)}, {_tokens_note(df)}",
    ]
    lines.append(f"- attention: {backends_note(df)}")
    if "point" in df:
        points = "; ".join(point_order(df))
        lines.append(f"- grid points (a table each; the lines above describe the first run): {points}")
    if df.attrs.get("diverged"):
        lines.append(f"- diverged, so not in the tables: {diverged_note(df)}")
    variants = sorted({s for s in df["scheme"] if "+" in s})
    if variants:
        lines.append(
            f"- {', '.join(variants)}: the same checkpoints evaluated with an evaluation-time "
            f"variant (`posbench schemes` describes each), no retraining; s = length / train "
            f"length, or the s after @"
        )
    return lines


def diverged_note(df: pd.DataFrame) -> str:
    """'alibi seed 1 at step 12, ...': the runs whose loss blew up in training."""
    return ", ".join(df.attrs.get("diverged", {}).values())


def protocols(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The (protocol, stride) pairs the rows were scored under, non-overlapping first."""
    pairs = {(p, str(st)) for p, st in zip(df["protocol"], df["stride"].fillna(""))}
    return sorted(pairs, key=lambda ps: (ps[0] != "nonoverlapping", ps[0], ps[1]))


def _protocols_note(df: pd.DataFrame) -> str:
    return "; ".join(f"{protocol_label(p, st)} ({PROTOCOL_NAMES[p]})" for p, st in protocols(df))


def backends_note(df: pd.DataFrame, short: bool = False) -> str:
    """Which attention backend trained and scored the runs. Backends differ in the last bits,
    so a table made with several names which runs used which (`short`: only that they differ)."""
    trained = {name: b or UNRECORDED for name, b in df.attrs.get("trained_with", {}).items()}
    scored = df.groupby("attention")[["scheme", "seed"]].apply(
        lambda g: sorted({f"{s} seed {n}" for s, n in zip(g["scheme"], g["seed"])})
    )
    train_set, score_set = set(trained.values()), set(scored.index)
    if len(score_set) == 1 and len(train_set) <= 1:
        how = scored.index[0]
        if train_set in (set(), {how}):
            return f"{how} backend (model.attention)"
        return f"trained with {train_set.pop()}, scored with {how}"
    if short:
        return "different backends across runs, see summary.md"
    by_train: dict[str, list[str]] = {}
    for name, b in sorted(trained.items()):
        by_train.setdefault(b, []).append(name)
    return (
        f"DIFFERENT backends across runs (they differ in the last bits): "
        f"trained with {_grouped(by_train)}; scored with {_grouped(scored.to_dict())}"
    )


def _grouped(runs_by_backend: dict[str, list[str]]) -> str:
    """'native', or 'flex (t5 seed 0), native (the rest)': the most used backend unlisted."""
    if len(runs_by_backend) == 1:
        return next(iter(runs_by_backend))
    most = max(runs_by_backend, key=lambda b: len(runs_by_backend[b]))
    parts = [f"{b} ({', '.join(runs)})" for b, runs in sorted(runs_by_backend.items()) if b != most]
    return ", ".join(parts + [f"{most} (the rest)"])


def _tokens_note(df: pd.DataFrame) -> str:
    """The evaluation tokens, or a warning naming rows scored on others."""
    counts = sorted(set(df["tokens"]))
    if len(counts) == 1:
        return f"the same {counts[0]} validation tokens at every length"
    odd = df[df["tokens"] != df["tokens"].mode()[0]]
    where = ", ".join(f"{r.scheme} seed {r.seed} at {r.length}" for r in odd.head(3).itertuples())
    return (
        f"NOT the same validation tokens everywhere ({', '.join(map(str, counts))}; e.g. {where}): "
        f"rerun extrapolate with one eval.tokens to score every run alike"
    )


def grid(table: pd.DataFrame, train_len: int, metric: str, transpose: bool = False, bold=lambda t: f"**{t}**"):
    """The table as rows of strings (a header first): schemes x lengths, the seed count and
    ppl(longest)/ppl(train); `transpose`: lengths x schemes. Best cells go through `bold`."""
    lengths = lengths_of(table)
    digits = METRICS[metric][1]
    head = ["scheme"] + [str(L) for L in lengths] + ["seeds", f"ppl({lengths[-1]})/ppl({train_len})"]
    rows = [head]
    for s in table.index:
        cells = [
            bold(c) if is_best(table, s, L) and c else c
            for L, c in ((L, cell(table, s, L, digits=digits)) for L in lengths)
        ]
        r = table.loc[s, "ratio"]
        rows.append([s] + cells + [str(int(table.loc[s, "seeds"])), f"{r:.2f}" if r == r else "—"])
    if transpose:
        rows = [list(col) for col in zip(*rows)]
        rows[0][0] = "length"
    return rows


def markdown(
    tables: dict[str, pd.DataFrame], configs: list, df: pd.DataFrame, metric: str = "ppl", transpose: bool = False
) -> str:
    """summary.md: what was run, then one table per protocol."""
    longest = max(int(L) for L in df["length"])
    out = [f"# Length extrapolation: trained at {trained_at(df)}, evaluated up to {longest}", ""]
    out += describe(configs, df)
    out.append(f"- cells: {METRICS[metric][0]}, {spread_note(tables)}")
    for label, table in tables.items():
        rows = grid(table, table.attrs["train_len"], metric, transpose)
        out += ["", f"## {label}", ""]
        out.append("| " + " | ".join(rows[0]) + " |")
        out.append("|" + "---|" * len(rows[0]))
        out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out) + "\n"


def latex(tables: dict[str, pd.DataFrame], df: pd.DataFrame, metric: str = "ppl", transpose: bool = False) -> str:
    """summary.tex: one booktabs table per protocol (and grid point), ready to \\input."""

    def tex(text: str) -> str:
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

    out = []
    for label, table in tables.items():
        train_len = table.attrs["train_len"]
        marked = grid(table, train_len, metric, transpose, bold=lambda t: "\0" + t)
        rows = [[f"\\textbf{{{tex(c[1:])}}}" if c.startswith("\0") else tex(c) for c in r] for r in marked]
        cols = "l" + "r" * (len(rows[0]) - 1)
        out += [
            "\\begin{table}[t]",
            "\\centering",
            f"\\begin{{tabular}}{{{cols}}}",
            "\\toprule",
            " & ".join(rows[0]) + " \\\\",
            "\\midrule",
        ]
        out += [" & ".join(r) + " \\\\" for r in rows[1:]]
        out += [
            "\\bottomrule",
            "\\end{tabular}",
            f"\\caption{{{tex(METRICS[metric][0])}, trained at {train_len}; {tex(label)}. "
            f"{tex(spread_note(tables))}.}}",
            "\\end{table}",
            "",
        ]
    return "\n".join(out)


def _pyplot():
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> bool:
    """Write the figure whole (atomically) and free it."""
    fig.tight_layout()
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return True


def _plain_log_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 6, 8, 10 rather than 6 x 10^0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot(tables: dict[str, pd.DataFrame], path: Path, metric: str = "ppl") -> bool:
    """The metric against length, one line per scheme with its 95% band over seeds, a dashed
    line at the training length, a panel per table (protocol, and grid point)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), sharey=True, squeeze=False)
    for ax, (label, table) in zip(axes[0], tables.items()):
        lengths = lengths_of(table)
        for s in table.index:
            mean = table.loc[s, lengths].astype(float).values
            ci = table.loc[s, [f"ci {L}" for L in lengths]].astype(float).fillna(0).values
            (line,) = ax.plot(lengths, mean, marker="o", markersize=3, label=s)
            ax.fill_between(lengths, mean - ci, mean + ci, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.axvline(table.attrs["train_len"], color="black", linestyle="--", linewidth=1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("evaluation length (bytes); dashed: the training length")
        values = table[lengths].astype(float).values
        finite = values[values == values]
        if metric != "loss" and finite.size and finite.max() / max(finite.min(), 1e-9) > 3:
            _plain_log_axis(ax)  # a wide range: a log axis, labelled 6, 8, 10
        if finite.size:  # a wide band (few seeds, one that blew up) must not squash the means
            ax.set_ylim(bottom=max(ax.get_ylim()[0], 0.8 * finite.min()))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(METRICS[metric][0])
    axes[0][0].legend(fontsize=8)
    return _save(plt, fig, path)


def plot_training(df: pd.DataFrame, path: Path) -> bool:
    """Every run's training loss against its step, from train_log.jsonl, one colour per scheme."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {}
    for rdir in df.attrs.get("runs", {}):
        log = read_train_log(rdir)
        if not log:
            continue
        scheme = next((s for s in df.attrs.get("schemes", {}).get(rdir, [])), rdir.name)
        kw = {"color": colours[scheme]} if scheme in colours else {"label": scheme}
        (line,) = ax.plot([r["step"] for r in log], [r["loss"] for r in log], linewidth=1, alpha=0.8, **kw)
        colours.setdefault(scheme, line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def position_losses(df: pd.DataFrame) -> pd.DataFrame:
    """Every run's loss per window position (its positions.csv), with its seed and grid point,
    in long format."""
    frames = []
    points = df.attrs.get("points", {})
    for rdir, seed in df.attrs.get("runs", {}).items():
        rows = read_positions(rdir)
        if rows:
            frames.append(pd.DataFrame(rows, columns=POSITION_COLUMNS).assign(seed=seed, point=points.get(rdir, "")))
    if not frames:
        return pd.DataFrame(columns=[*POSITION_COLUMNS, "seed", "point"])
    out = pd.concat(frames, ignore_index=True)
    out["stride"] = out["stride"].fillna("").astype(str)
    for c in ("length", "position", "tokens"):
        out[c] = out[c].astype(int)
    out["loss"] = out["loss"].astype(float)
    return out


def plot_positions(pos: pd.DataFrame, train_lens: dict, path: Path) -> bool:
    """Mean loss at each position of the longest windows, one line per scheme (mean over seeds),
    a panel per protocol (and grid point), a dashed line at the training length (`train_lens`:
    grid point -> its length): where a scheme breaks."""
    plt = _pyplot()
    if plt is None or pos.empty:
        return False
    longest = pos["length"].max()
    pos = pos[pos["length"] == longest]
    groups = sorted(
        pos.groupby(["point", "protocol", "stride"]).groups,
        key=lambda ps: (train_lens[ps[0]], ps[0], ps[1] != "nonoverlapping", ps[1:]),
    )
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), sharey=True, squeeze=False)
    for ax, (point, protocol, stride) in zip(axes[0], groups):
        part = pos[(pos["point"] == point) & (pos["protocol"] == protocol) & (pos["stride"] == stride)]
        train_len = train_lens[point]
        # the positions every window scores: all of them in chunks, a sliding window's last
        # `stride` (its first window alone scores the rest, too few tokens to draw)
        part = part[part["tokens"] >= part["tokens"].max() / 2]
        for s in scheme_order(set(part["scheme"])):
            line = part[part["scheme"] == s].groupby("position")["loss"].mean()
            ax.plot(line.index, line.values, label=s, linewidth=1)
        ax.axvline(train_len, color="black", linestyle="--", linewidth=1, label=f"training length {train_len}")
        where = f"{point}; " if point else ""
        ax.set_title(f"{where}{protocol_label(protocol, stride)}: windows of {longest}", fontsize=10)
        ax.set_xlabel("position in the window")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean loss (nats per byte)")
    axes[0][0].legend(fontsize=7)
    return _save(plt, fig, path)


def write_summary(exp_dirs, metric: str = "ppl", transpose: bool = False, out: Optional[Path] = None):
    """summary.csv (long), summary.md, summary.tex, summary.png, positions.png and training.png,
    from the run folders of one experiment, or of several joined into one comparison (written
    to `out`, by default a folder beside the first named after them all). Returns the rows,
    the configs and a comparison table per protocol."""
    dirs = _dirs(exp_dirs)
    df, configs = join([collect(d) for d in dirs], dirs)
    out = summary_dir(exp_dirs, out)
    out.mkdir(parents=True, exist_ok=True)
    df = with_metric(df, metric)
    tables = {}
    for point in point_order(df):
        rows = df if point is None else df[df["point"] == point]
        for protocol, stride in protocols(rows):
            part = rows[(rows["protocol"] == protocol) & (rows["stride"].fillna("").astype(str) == stride)]
            label = protocol_label(protocol, stride)
            tables[label if point is None else f"{point}; {label}"] = comparison(part)
    with atomic(out / "summary.csv") as tmp:
        df.to_csv(tmp, index=False, columns=EVAL_COLUMNS + (["point"] if "point" in df else []))
    write_atomic(out / "summary.md", markdown(tables, configs, df, metric, transpose))
    write_atomic(out / "summary.tex", latex(tables, df, metric, transpose))
    plot(tables, out / "summary.png", metric)
    if "point" in df:
        train_lens = df.groupby("point")["train_len"].first().to_dict()
    else:
        train_lens = {"": int(df["train_len"].iloc[0])}
    plot_positions(position_losses(df), train_lens, out / "positions.png")
    plot_training(df, out / "training.png")
    return df, configs, tables


def _dirs(exp_dirs) -> list[Path]:
    return [Path(d) for d in ([exp_dirs] if isinstance(exp_dirs, (str, Path)) else exp_dirs)]


def summary_dir(exp_dirs, out: Optional[Path] = None) -> Path:
    """Where write_summary writes: `out`, the one experiment's folder, or, for several joined,
    a folder beside the first named after them all (results/a+b)."""
    dirs = _dirs(exp_dirs)
    if out:
        return Path(out)
    return dirs[0] if len(dirs) == 1 else dirs[0].parent / "+".join(d.name for d in dirs)


def join(collected: list[tuple[pd.DataFrame, list]], dirs: list[Path]) -> tuple[pd.DataFrame, list]:
    """Several experiments' rows as one comparison: refused unless they share the training
    length and the protocols, so that every cell means the same thing."""
    if len(collected) == 1:
        return collected[0]
    (first, configs), name = collected[0], dirs[0].name
    for (df, cfgs), d in zip(collected[1:], dirs[1:]):
        for what, a, b in (
            ("training length", set(first["train_len"]), set(df["train_len"])),
            ("protocols", set(protocols(first)), set(protocols(df))),
        ):
            if a != b:
                raise PosbenchError(
                    f"cannot join {name} and {d.name}: their {what} differ ({_listed(a)} against {_listed(b)})"
                )
        clash = set(zip(first["scheme"], first["seed"])) & set(zip(df["scheme"], df["seed"]))
        if clash:
            s, n = sorted(clash)[0]
            raise PosbenchError(f"cannot join {name} and {d.name}: both hold {s} seed {n}")
        configs = configs + cfgs
    df = pd.concat([c[0] for c in collected], ignore_index=True)
    df.attrs = {
        k: {key: v for c in collected for key, v in c[0].attrs.get(k, {}).items()}
        for k in ("trained_with", "runs", "schemes", "diverged")
    }
    return df, configs


def _listed(values: set) -> str:
    return ", ".join(protocol_label(*v) if isinstance(v, tuple) else str(v) for v in sorted(values, key=str))
