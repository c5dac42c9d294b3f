"""Tables and plots, built from the run folders on disk alone, so any of them can be rebuilt."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from posbench.config import config_from_dict, read_yaml
from posbench.errors import PosbenchError
from posbench.evaluate import PROTOCOL_NAMES, protocol_label
from posbench.files import atomic, write_atomic
from posbench.runs import (EVAL_COLUMNS, POSITION_COLUMNS, UNRECORDED, differences, experiment_part, read_eval,
                           read_positions, trained_with)


def collect(exp_dir: Path) -> tuple[pd.DataFrame, list]:
    """Every run's evaluation rows (long format) and every run's resolved config."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise PosbenchError(f"{exp_dir}: no such experiment directory")
    rows, configs, trained, runs, first = [], [], {}, {}, None
    for rdir in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        has = {f: (rdir / f).is_file() for f in ("config.yaml", "eval.csv", "model.pt")}
        if not any(has.values()):
            continue  # not a run folder
        if not (has["config.yaml"] and has["eval.csv"]):  # a run is never left out in silence
            lacks = " and ".join(f for f in ("config.yaml", "eval.csv") if not has[f])
            raise PosbenchError(
                f"{rdir}: a run folder without {lacks}; finish it with posbench evaluate {rdir} "
                f"or posbench extrapolate, or move it out of {exp_dir}"
            )
        raw = read_yaml(rdir / "config.yaml")  # malformed or not text: one line naming it
        configs.append(config_from_dict(raw, source=str(rdir / "config.yaml")))
        part = experiment_part(configs[-1].to_dict())
        if first is None:
            first = (rdir, part)
        elif part != first[1]:
            diff = differences(first[1], part, (first[0].name, f"in {rdir.name}"))
            raise PosbenchError(
                f"{exp_dir}: runs trained under different settings ({', '.join(diff)}); "
                f"a table compares runs that differ only in scheme and seed"
            )
        rows += read_eval(rdir)
        trained[rdir.name] = trained_with(rdir)
        runs[rdir] = configs[-1].seeds[0]
    if not rows:
        raise PosbenchError(
            f"{exp_dir}: holds no evaluated runs (run folders with config.yaml and eval.csv)"
        )
    df = pd.DataFrame(rows, columns=EVAL_COLUMNS)
    for c in ("seed", "train_len", "length", "tokens"):
        df[c] = df[c].astype(int)
    for c in ("loss", "ppl"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    order = scheme_order(set(df["scheme"]))
    df["scheme"] = pd.Categorical(df["scheme"], categories=order, ordered=True)
    df = df.sort_values(["scheme", "seed", "length"]).reset_index(drop=True)
    df["scheme"] = df["scheme"].astype(str)
    df.attrs["trained_with"] = trained  # run folder -> the backend it trained with (None: unrecorded)
    df.attrs["runs"] = runs  # run folder -> its seed
    return df, configs


def scheme_order(names: set) -> list[str]:
    """Registry order (the order of the paper tables), each scheme followed by its
    evaluation-time variants (rope, rope+ntk, rope+yarn, ...); plugins after."""
    from posbench.schemes import SCHEMES

    order = []
    for s in SCHEMES:
        order += [s] if s in names else []
        order += sorted(n for n in names if n.startswith(s + "+"))
    return order + sorted(names - set(order))


def comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Schemes x lengths: mean ppl over seeds, its std, and ppl(longest)/ppl(train length)."""
    order = list(dict.fromkeys(df["scheme"]))
    ok = df[df["status"] == "ok"]
    mean = ok.pivot_table(index="scheme", columns="length", values="ppl", aggfunc="mean")
    std = ok.pivot_table(index="scheme", columns="length", values="ppl", aggfunc="std")
    lengths = sorted(df["length"].unique())
    mean = mean.reindex(index=order, columns=lengths)
    std = std.reindex(index=order, columns=lengths)
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
    for L in lengths:
        out[L] = mean[L]
        out[f"std {L}"] = std[L]
        out[f"status {L}"] = status[L]
        out[f"n {L}"] = scored[L]  # seeds behind the mean, when fewer than the row's
        out[f"nonfinite {L}"] = blown[L]  # seeds whose loss blew up there
    out["ratio"] = [
        math.nan if (blown.loc[s].reindex([train_len[s], lengths[-1]]).fillna(0) > 0).any()  # none hidden
        else _ratio(ok[ok["scheme"] == s], train_len[s], lengths[-1])
        for s in order
    ]
    out["seeds"] = seeds
    return out


def _ratio(rows: pd.DataFrame, base: int, longest: int) -> float:
    """ppl(longest) / ppl(base) over the seeds scored at both, so that a length only some
    seeds reached is not divided by another set of seeds' mean."""
    a = rows[rows["length"] == base].set_index("seed")["ppl"]
    b = rows[rows["length"] == longest].set_index("seed")["ppl"]
    both = a.index.intersection(b.index)
    return b[both].mean() / a[both].mean() if len(both) else math.nan


def cell(table: pd.DataFrame, scheme: str, L: int, missing: str = "") -> str:
    """'12.34', '12.34 ± 0.10' over seeds, with '(1 of 3 seeds)' when fewer seeds than the row's
    reached the length and '; 1 non-finite' when some blew up there; 'nan' when all did; the
    status (or `missing`) where the scheme could not be scored; blank where never evaluated."""
    v, sd, st = table.loc[scheme, L], table.loc[scheme, f"std {L}"], table.loc[scheme, f"status {L}"]
    if not isinstance(st, str):
        return ""
    blown = table.loc[scheme, f"nonfinite {L}"]
    blown = 0 if blown != blown else int(blown)
    if v != v:  # no seed scored here
        return "nan" if blown else (missing or st)
    text = f"{v:.2f} ± {sd:.2f}" if sd == sd else f"{v:.2f}"
    n, of = table.loc[scheme, f"n {L}"], table.loc[scheme, "seeds"]
    if blown:
        return f"{text} ({n:.0f} of {of} seeds; {blown} non-finite)"
    return text if n == of else f"{text} ({n:.0f} of {of} seeds)"


def lengths_of(table: pd.DataFrame) -> list[int]:
    return [c for c in table.columns if isinstance(c, int) or str(c).isdigit()]


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
        f"- evaluation: {_protocols_note(df)}, {_tokens_note(df)}; cells are perplexity per byte "
        f"(mean ± std over seeds when there are several)",
    ]
    lines.append(f"- attention: {backends_note(df)}")
    variants = sorted({s for s in df["scheme"] if "+" in s})
    if variants:
        lines.append(
            f"- {', '.join(variants)}: the same checkpoints evaluated with an evaluation-time "
            f"variant (`posbench schemes` describes each), no retraining; s = length / train "
            f"length, or the s after @"
        )
    return lines


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
    return (f"DIFFERENT backends across runs (they differ in the last bits): "
            f"trained with {_grouped(by_train)}; scored with {_grouped(scored.to_dict())}")  # fmt: skip


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
    return (f"NOT the same validation tokens everywhere ({', '.join(map(str, counts))}; e.g. {where}): "
            f"rerun extrapolate with one eval.tokens to score every run alike")


def markdown(tables: dict[str, pd.DataFrame], configs: list, df: pd.DataFrame) -> str:
    """summary.md: what was run, then one table per protocol."""
    train_len = int(df["train_len"].iloc[0])
    longest = max(int(L) for L in df["length"])
    out = [f"# Length extrapolation: trained at {train_len}, evaluated up to {longest}", ""]
    out += describe(configs, df)
    for label, table in tables.items():
        lengths = lengths_of(table)
        head = ["scheme"] + [str(L) for L in lengths] + [f"ppl({lengths[-1]})/ppl({train_len})"]
        out += ["", f"## {label}", ""]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for s in table.index:
            r = table.loc[s, "ratio"]
            cells = [cell(table, s, L) for L in lengths] + [f"{r:.2f}" if r == r else "—"]
            out.append("| " + " | ".join([s] + cells) + " |")
    return "\n".join(out) + "\n"


def _pyplot():
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plain_log_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 6, 8, 10 rather than 6 x 10^0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def plot(tables: dict[str, pd.DataFrame], path: Path) -> bool:
    """Perplexity against length, one line per scheme, a panel per protocol."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), sharey=True, squeeze=False)
    for ax, (label, table) in zip(axes[0], tables.items()):
        lengths = lengths_of(table)
        for s in table.index:
            ax.plot(lengths, [table.loc[s, L] for L in lengths], marker="o", label=s)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("evaluation length (bytes)")
        _plain_log_axis(ax)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity per byte")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return True


def position_losses(df: pd.DataFrame) -> pd.DataFrame:
    """Every run's loss per window position (its positions.csv), with its seed, in long format."""
    frames = []
    for rdir, seed in df.attrs.get("runs", {}).items():
        rows = read_positions(rdir)
        if rows:
            frames.append(pd.DataFrame(rows, columns=POSITION_COLUMNS).assign(seed=seed))
    if not frames:
        return pd.DataFrame(columns=[*POSITION_COLUMNS, "seed"])
    out = pd.concat(frames, ignore_index=True)
    out["stride"] = out["stride"].fillna("").astype(str)
    for c in ("length", "position", "tokens"):
        out[c] = out[c].astype(int)
    out["loss"] = out["loss"].astype(float)
    return out


def plot_positions(pos: pd.DataFrame, train_len: int, path: Path) -> bool:
    """Mean loss at each position of the longest windows, one line per scheme (mean over seeds),
    a panel per protocol, a dashed line at the training length: where a scheme breaks."""
    plt = _pyplot()
    if plt is None or pos.empty:
        return False
    longest = pos["length"].max()
    pos = pos[pos["length"] == longest]
    groups = sorted(pos.groupby(["protocol", "stride"]).groups, key=lambda ps: (ps[0] != "nonoverlapping", ps))
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), sharey=True, squeeze=False)
    for ax, (protocol, stride) in zip(axes[0], groups):
        part = pos[(pos["protocol"] == protocol) & (pos["stride"] == stride)]
        for s in scheme_order(set(part["scheme"])):
            line = part[part["scheme"] == s].groupby("position")["loss"].mean()
            ax.plot(line.index, line.values, label=s, linewidth=1)
        ax.axvline(train_len, color="black", linestyle="--", linewidth=1, label=f"training length {train_len}")
        ax.set_title(f"{protocol_label(protocol, stride)}: windows of {longest}", fontsize=10)
        ax.set_xlabel("position in the window")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean loss (nats per byte)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return True


def write_summary(exp_dir: Path) -> tuple[pd.DataFrame, list, dict[str, pd.DataFrame]]:
    """summary.csv (long), summary.md, summary.png and positions.png in exp_dir, from the run
    folders; returns the rows, the configs and a comparison table per protocol."""
    exp_dir = Path(exp_dir)
    df, configs = collect(exp_dir)
    tables = {}
    for protocol, stride in protocols(df):
        part = df[(df["protocol"] == protocol) & (df["stride"].fillna("").astype(str) == stride)]
        tables[protocol_label(protocol, stride)] = comparison(part)
    with atomic(exp_dir / "summary.csv") as tmp:
        df.to_csv(tmp, index=False, columns=EVAL_COLUMNS)
    write_atomic(exp_dir / "summary.md", markdown(tables, configs, df))
    plot(tables, exp_dir / "summary.png")
    plot_positions(position_losses(df), int(df["train_len"].iloc[0]), exp_dir / "positions.png")
    return df, configs, tables
