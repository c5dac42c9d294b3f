"""Perplexity's tables and plots.

Perplexity's tables and plots: schemes x lengths per protocol (and grid point) through the
comparison engine, the ratio ppl(longest)/ppl(train), bits per byte, the description, and the
plots of perplexity by length and loss by position."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from posbench.compare.order import point_order, scheme_order
from posbench.compare.plot import BAND_SEEDS, Line, Panel, band_plot, lines, plot_training
from posbench.compare.render import tex, transposed
from posbench.compare.table import cell, seeds_said, summarize
from posbench.compare.table import grid as compare_grid
from posbench.compare.table import spread_note as compare_spread
from posbench.data import corpus_name
from posbench.errors import PosbenchError
from posbench.extend import report as extend
from posbench.measures.base import Section
from posbench.measures.effective import cells as effective_cells
from posbench.measures.perplexity.breaks import breaks as rope_breaks
from posbench.measures.perplexity.breaks import plot as plot_rope_law
from posbench.measures.perplexity.breaks import section as rope_section
from posbench.measures.perplexity.records import (
    METRICS,
    POSITION_COLUMNS,
    PROTOCOL_NAMES,
    SUMMARY_COLUMNS,
    WINDOW_START,
    protocol_label,
    read_positions,
    read_windows,
    row_key,
)
from posbench.schemes import label_variant, run_label
from posbench.stats import mean_ci

UNRECORDED = "unrecorded"  # a run whose train_log.jsonl does not name its attention backend


def token_unit(df: pd.DataFrame) -> str:
    """What one token is: byte, or token (bpe-2048) under a tokenizer, named."""
    tokenizers = sorted(set(df["tokenizer"])) if "tokenizer" in df else ["bytes"]
    return "byte" if tokenizers == ["bytes"] else f"token ({', '.join(tokenizers)})"


def metric_label(metric: str, df: pd.DataFrame) -> str:
    """What a cell holds: perplexity per byte, or per token under a tokenizer, named."""
    label = METRICS[metric].label
    return label if metric == "bpb" else label.replace("per byte", f"per {token_unit(df)}")


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
    """Schemes x lengths of one protocol (compare.summarize): the mean `value` (ppl unless
    with_metric chose another) over seeds, its 95% interval and the schemes tied for best, with
    ppl(longest)/ppl(train) and bits per byte at both beside them. The longest is the longest
    length every scheme (as trained) was scored at, so that `posbench evaluate` scoring one run
    further does not move the headline to a length the others lack."""
    if "value" not in df:
        df = with_metric(df, "ppl")
    order = list(dict.fromkeys(df["scheme"]))
    lengths = sorted(df["length"].unique())
    # a variant row (rope+yarn) counts against its base scheme's seeds: those are its checkpoints
    base_seeds = df.groupby(df["scheme"].str.split("+").str[0])["seed"].nunique()
    seeds = {s: base_seeds[s.split("+")[0]] for s in order}
    out = summarize(df.rename(columns={"length": "column"}), lengths, order, False, seeds)
    ok = df[df["status"] == "ok"]
    base = int(df["train_len"].iloc[0])  # one per table; a fine-tuned child's too (its parent's)
    plain = df[~df["scheme"].str.contains("+", regex=False)]  # the runs as trained; a variant's rows are extra
    everyone = set.intersection(*(set(g) for _, g in plain.groupby("scheme", sort=False)["length"]), set(lengths))
    longest = max(everyone, default=lengths[-1])
    ratio = summarize(_ratios(df, base, longest), ["ratio"], order, False, seeds)  # an interval, ties
    for c in ("ratio", "ci ratio", "status ratio", "n ratio", "nonfinite ratio", "best ratio"):
        out[c] = ratio[c]
    out.attrs["tests"] = out.attrs["tests"] | ratio.attrs["tests"]
    for name, L in (("bpb train", base), ("bpb longest", longest)):  # beside perplexity, in bits per byte
        have = ok[ok["length"] == L]
        out[name] = have.groupby("scheme")["bpb"].mean().reindex(order) if "bpb" in have else math.nan
    out.attrs["train_len"], out.attrs["longest"] = base, longest  # a grid point's
    return out


def _ratios(df: pd.DataFrame, base: int, longest: int) -> pd.DataFrame:
    """Each run's ppl(longest) / ppl(base), a row per (scheme, seed) scored at both lengths, for
    compare.summarize: status ok, or the status of the length that has no value (non-finite,
    beyond-max-len)."""
    rows = []
    at = df[df["length"].isin([base, longest])].set_index(["scheme", "seed", "length"])
    for scheme, seed in dict.fromkeys(zip(df["scheme"], df["seed"])):
        if (scheme, seed, base) not in at.index or (scheme, seed, longest) not in at.index:
            continue
        a, b = at.loc[(scheme, seed, base)], at.loc[(scheme, seed, longest)]
        bad = [r["status"] for r in (a, b) if r["status"] != "ok"]
        value = b["ppl"] / a["ppl"] if not bad else math.nan
        rows.append(
            {"scheme": scheme, "seed": seed, "column": "ratio", "value": value, "status": bad[0] if bad else "ok"}
        )
    return pd.DataFrame(rows, columns=["scheme", "seed", "column", "value", "status"])


WINDOWS_NOTE = (
    "a pretrained model's ± is over its windows: the 95% interval of the mean loss over the windows "
    "scored at that length (Student's t), through exp for perplexity"
)


def window_means(collected) -> dict[tuple, list[float]]:
    """Each pretrained model's mean loss per window, from its windows.csv: (scheme label,
    length, protocol, stride) -> one value a window. A model has no seeds; its windows are the
    samples of its text that an interval can come from."""
    out: dict[tuple, list[float]] = {}
    for run in collected.runs:
        if not run.cfg.model.pretrained:
            continue
        for r in read_windows(run.folder):
            out.setdefault(row_key(r), []).append(float(r["loss"]) / int(r["tokens"]))
    return out


def over_windows(table: pd.DataFrame, part: pd.DataFrame, windows: dict, metric: str) -> None:
    """A pretrained model's cells take their interval from its windows (`window_means`): the
    mean loss's, as is for loss, times each cell's value for perplexity (exp's slope), scaled
    as the value for bits per byte. Its ratio keeps none."""
    if not windows or metric == "ratio":
        return
    for r in part[part["status"] == "ok"].to_dict("records"):
        means = windows.get(row_key(r), [])
        if r["scheme"] not in table.index or len(means) < 2:
            continue
        half = mean_ci(means)[1]
        scale = {"loss": 1.0, "ppl": r["ppl"], "bpb": r["bpb"] / r["loss"]}[metric]
        table.loc[r["scheme"], f"ci {int(r['length'])}"] = half * scale


def spread_note(tables: dict[str, pd.DataFrame], pretrained: bool = False, windows: bool = False) -> str:
    """What a cell's ± and its bold mean, over every table of a report (`pretrained`: of
    pretrained models alone, which have no seeds; `windows`: some have intervals over windows)."""
    seeds = max(int(t["seeds"].max()) for t in tables.values())
    tests = set().union(*(t.attrs.get("tests", set()) for t in tables.values()))
    if pretrained:
        return compare_spread(seeds, tests, more=WINDOWS_NOTE if windows else "one pretrained model each")
    return compare_spread(seeds, tests) + (f"; {WINDOWS_NOTE}" if windows else "")


def lengths_of(table: pd.DataFrame) -> list[int]:
    return table.attrs["columns"]


def trained_at(df: pd.DataFrame) -> str:
    """'32', or '32, 64' for a grid over training lengths."""
    return ", ".join(str(L) for L in sorted(set(df["train_len"])))


def describe(configs: list, df: pd.DataFrame) -> list[str]:
    """Corpus, model size, training budget and evaluation protocol, from the run configs."""
    c = configs[0]
    m, t = c.model, c.train
    params = m.params
    corpus = corpus_name(c.data)
    tokenizers = sorted(set(df["tokenizer"])) if "tokenizer" in df else ["bytes"]
    if tokenizers != ["bytes"]:
        corpus = corpus.removesuffix(" (bytes)").removesuffix(", bytes") + f"; tokenizer: {', '.join(tokenizers)}"
    lines = [f"- corpus: {corpus}; validation = last {c.data.val_fraction:.0%} of it"]
    if m.pretrained is None:
        tokens = t.steps * t.batch_size * m.train_len
        lines += [
            f"- model: {m.n_layer} layer{'s' if m.n_layer > 1 else ''}, d_model {m.d_model}, {m.n_head} heads, "
            f"{params / 1e6:.2f}M parameters with NoPE, vocab {m.vocab_size}",
            f"- training: {t.steps} steps x {t.batch_size} sequences x {m.train_len} tokens "
            f"= {tokens:,} tokens, {t.rate_said()}, {seeds_said(df)}",
        ]
    for p in {id(c.model.pretrained): c.model.pretrained for c in configs if c.model.pretrained}.values():
        lines.append(
            f"- {p['name']}: pretrained, not trained here ({p['architecture']}, read from {p['path']}; the "
            f"sha256 of its files in its config.yaml), context {p['context']:,} (dashed where a length is marked)"
        )
    lines.append(
        f"- evaluation: {_protocols_note(df)}, {_tokens_note(df)}; {WINDOW_START}; bpb: bits per byte, the "
        f"summed loss in bits over the UTF-8 bytes the scored tokens cover (comparable across tokenizers)"
    )
    lines.append(f"- attention: {backends_note(df)}")
    if "point" in df:
        points = "; ".join(point_order(df))
        lines.append(f"- grid points (a table each; the lines above describe the first run): {points}")
    variants = sorted({s for s in df["scheme"] if "+" in s})
    if variants:
        dynamic = any(s.split("+")[-1] == "dynamic" for s in variants)
        scaled = [  # pretrained models whose config scales RoPE itself (Llama 3.1's llama3)
            p["name"]
            for p in (c.model.pretrained for c in configs)
            if p and (p.get("rope") or {}).get("rope_type", "default") != "default"
        ]
        own = (
            f" ({', '.join(scaled)}: length / the context it was pretrained at, at least its own scaling's "
            f"factor; longrope its own factor)"
            if scaled
            else ""
        )
        lines.append(
            f"- {', '.join(variants)}: the same checkpoints evaluated with an evaluation-time "
            f"variant (`posbench schemes` describes each), no retraining; s = length / train "
            f"length, at least 1{own}, or the s after @"
            + ("; dynamic without @: factor 1, grown with each forward's length" if dynamic else "")
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
    so a table made with several names which runs used which (`short`: only that they differ).
    A training-free variant's rows are eager by design (its remap's own formula): said apart."""
    variants = df["scheme"].map(lambda label: label_variant(label)[1])
    own = pd.Series(False, index=df.index)  # a training-free variant's eager rows
    if variants.notna().any():
        from posbench.schemes import TRAINING_FREE_NAMES

        own = variants.isin(TRAINING_FREE_NAMES) & (df["attention"] == "eager")
    if own.any():
        aside = ", ".join(sorted(set(df.loc[own, "scheme"])))
        rest = df[~own]
        rest.attrs = dict(df.attrs)
        if rest.empty:
            return f"eager, the training-free variants' own formula ({aside})"
        note = backends_note(rest, short)
        return note if short else f"{note}; {aside}: eager, the training-free variants' own formula"
    trained = {name: b or UNRECORDED for name, b in df.attrs.get("trained_with", {}).items()}
    scored = _scored_by(df)
    train_set, score_set = set(trained.values()), set(scored)
    if len(score_set) == 1 and len(train_set) <= 1:
        how = next(iter(scored))
        if train_set in (set(), {how}):
            return f"{how} backend (model.attention)"
        return f"trained with {train_set.pop()}, scored with {how}"
    by_scheme = _one_backend_a_scheme(df, trained)
    if by_scheme:  # auto on a GPU: flex for a table over distances, sdpa for the rest
        if short:
            return "one backend a scheme, see summary.md"
        return f"one backend a scheme, trained and scored: {by_scheme} (model.attention)"
    if short:
        return "different backends across runs, see summary.md"
    by_train: dict[str, list[str]] = {}
    for name, b in sorted(trained.items()):
        by_train.setdefault(b, []).append(name)
    return (
        f"DIFFERENT backends across runs (they differ in the last bits): "
        f"trained with {_grouped(by_train)}; scored with {_grouped(scored)}"
    )


def _scored_by(df: pd.DataFrame) -> dict[str, list[str]]:
    """Each backend's runs ('alibi seed 0'); a run scored by several at once names its lengths
    under each ('rope seed 0 at 32, 96'), so no run hides in another backend's 'the rest'."""
    runs = [f"{s} seed {n}" for s, n in zip(df["scheme"], df["seed"])]
    backends: dict[str, dict[str, set]] = {}
    for run, backend, length in zip(runs, df["attention"], df["length"] if "length" in df else [None] * len(df)):
        backends.setdefault(backend, {}).setdefault(run, set()).add(length)
    mixed = {run for run in runs if sum(run in held for held in backends.values()) > 1}

    def named(run: str, lengths: set) -> str:
        known = sorted(L for L in lengths if L is not None)
        return f"{run} at {', '.join(map(str, known))}" if run in mixed and known else run

    return {b: sorted(named(run, lengths) for run, lengths in held.items()) for b, held in sorted(backends.items())}


def _one_backend_a_scheme(df: pd.DataFrame, trained: dict[str, str]) -> Optional[str]:
    """'flex for alibi, t5; sdpa for fire, nope', where each scheme's runs were trained and scored
    by one backend; else None."""
    scheme_of = df.attrs.get("scheme_of", {})
    backends: dict[str, set] = {}
    for label, backend in zip(df["scheme"], df["attention"]):  # rope+yarn's rows are rope's
        backends.setdefault(label_variant(label)[0], set()).add(backend)
    for name, backend in trained.items():
        if name not in scheme_of:
            return None
        backends.setdefault(scheme_of[name], set()).add(backend)
    if any(len(b) > 1 for b in backends.values()):
        return None
    schemes: dict[str, list[str]] = {}
    for scheme, (backend,) in backends.items():
        schemes.setdefault(backend, []).append(scheme)
    return "; ".join(f"{b} for {', '.join(sorted(s))}" for b, s in sorted(schemes.items()))


def _grouped(runs_by_backend: dict[str, list[str]]) -> str:
    """'native', or 'flex (t5 seed 0), native (the rest)': the most used backend unlisted, unless
    a run it holds is scored by another backend too ('rope seed 0 at 64'): then every one is listed."""
    if len(runs_by_backend) == 1:
        return next(iter(runs_by_backend))
    most = max(runs_by_backend, key=lambda b: len(runs_by_backend[b]))
    if any(" at " in run for run in runs_by_backend[most]):
        most = None
    parts = [f"{b} ({', '.join(runs)})" for b, runs in sorted(runs_by_backend.items()) if b != most]
    return ", ".join(parts + ([f"{most} (the rest)"] if most else []))


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


def grid(
    table: pd.DataFrame, train_len: int, metric: str, missing: str = "", bpb: bool = True
) -> tuple[list[list[str]], set]:
    """The table as rows of strings (a header first): schemes x lengths, the seed count and
    ppl(longest)/ppl(train), and the (row, column) cells that are best. Where nothing was scored
    past the training length (a pretrained model within its context) there is no ratio, and
    bits per byte once, at the one of the two lengths that was scored."""
    lengths = lengths_of(table)
    heads = [str(L) for L in lengths]
    longest = table.attrs["longest"]
    rows, best = compare_grid(table, heads, METRICS[metric].digits, missing=missing, seeds=True)
    past = longest > train_len
    rows[0] += [f"ppl({longest})/ppl({train_len})"] if past else []
    bpbs = {"bpb train": train_len, "bpb longest": longest} if past else {}
    bpbs = bpbs or ({"bpb train": train_len} if longest == train_len else {"bpb longest": longest})
    with_bpb = bpb and metric != "bpb" and table[list(bpbs)].notna().any().any()
    rows[0] += [f"bpb({L})" for L in bpbs.values()] if with_bpb else []
    best |= {(i, len(lengths) + 2) for i, s in enumerate(table.index, start=1) if past and table.loc[s, "best ratio"]}
    for s, row in zip(table.index, rows[1:]):
        row += [ratio_cell(table, s)] if past else []
        if with_bpb:
            row += [_bpb_cell(table.loc[s, k]) for k in bpbs]
    return rows, best


def _bpb_cell(value) -> str:
    return f"{value:.3f}" if value == value else ""


def ratio_cell(table: pd.DataFrame, scheme: str) -> str:
    """ppl(longest)/ppl(train) (compare.cell): the mean of each seed's ratio with its interval;
    blank where either length was not scored; — where the scheme cannot encode the longest; nan
    where the loss blew up there."""
    return cell(table, scheme, "ratio", 2, missing="—")


def report(collected, metric: str, transpose: bool) -> dict:
    """The parts of a perplexity report: title, description, a section per protocol (and grid
    point), the long rows for summary.csv, and a function that draws the plots."""
    df, configs = frame(collected)
    df = with_metric(df, metric)
    what = metric_label(metric, df)
    windows = window_means(collected)
    tables, effective = protocol_tables(collected, df, windows, metric)
    pretrained = all(c.model.pretrained for c in configs)  # no training to speak of, a context instead
    trained = "context" if pretrained else "trained at"
    note = spread_note(tables, pretrained, bool(windows))
    tokenized = bool(set(df["tokenizer"].dropna()) - {"bytes", ""})
    sections, notes = [], []
    for label, table in tables.items():
        train_len = table.attrs["train_len"]
        rows, best = grid(table, train_len, metric)
        # the files hold bpb; the terminal too where a tokenizer makes it differ from loss / ln 2
        shown, shown_best = grid(table, train_len, metric, missing="—", bpb=tokenized)
        ratio = f"ppl({table.attrs['longest']})/ppl({train_len})"
        if ratio in shown[0]:
            shown[0][shown[0].index(ratio)] = f"ppl({table.attrs['longest']})/ppl(train)"
        eff, criteria = effective.get(label, ({}, []))
        if eff:  # one column beside the ratio: flat is not the same as using the context
            for table_rows in (rows, shown):
                table_rows[0].append("eff. length")
                for row in table_rows[1:]:
                    row.append(eff.get(row[0], ""))
            notes.append(f"eff. length: the longest length up to which {', '.join(criteria)} (docs/measures.md)")
        if transpose:
            rows, best = transposed(rows, best)
            shown, shown_best = transposed(shown, shown_best)
        sections.append(
            Section(
                heading=label,
                caption=f"{tex(what)}, {trained} {train_len}; {tex(label)}. {tex(note)}.",
                rows=rows,
                best=best,
                terminal=shown,
                terminal_best=shown_best,
                title=f"{what}, {trained} {train_len} ({label}; attention: {backends_note(df, short=True)})",
            )
        )
    positions = position_losses(collected.runs, df.attrs["points"])
    tabled = positions[positions["length"].isin(set(df["length"]))]  # a training command's: what it asked for
    rope = rope_breaks(collected.runs, tabled, df.attrs["points"])
    if not rope.empty:
        sections.append(rope_section(rope))
    curve = extend.curve_table(collected.runs)
    if curve is not None:
        sections.append(extend.curve_section(*curve[:2]))
    longest = max(int(L) for L in df["length"])
    legend = (
        f"{note}. — : the scheme cannot encode that length (beyond-max-len); nan: the loss blew up; "
        f"blank: not evaluated"
    )

    def plots(folder: Path, stem: str = "summary") -> list[str]:
        """The metric's plot as <stem>.png; the others, which no view changes, with the summary."""
        unit = token_unit(df)
        plot(tables, folder / f"{stem}.png", metric, what, unit)
        if stem != "summary":
            return [f"{stem}.png"]
        train_lens = (
            df.groupby("point")["train_len"].first().to_dict() if "point" in df else {"": int(df["train_len"].iloc[0])}
        )
        plot_positions(positions, train_lens, folder / "positions.png", unit)
        drawn = ["summary.png", "positions.png"]
        if plot_rope_law(rope, folder / "rope_law.png"):
            drawn.append("rope_law.png")
        if not pretrained:
            plot_training({run.folder: run for run in collected.runs}, folder / "training.png", unit)
            drawn.append("training.png")
        if curve is not None:
            extend.plot_curve(curve[2], curve[1], folder / "steps.png")
            drawn.append("steps.png")
        return drawn

    return {
        "title": f"Length extrapolation: {trained} {trained_at(df)}, evaluated up to {longest}",
        "describe": describe(configs, df)
        + extend.describe(configs)
        + [f"- cells: {what}, {note}"]
        + [f"- {n}" for n in dict.fromkeys(notes)],
        "sections": sections,
        "legend": legend,
        "csv": (df, SUMMARY_COLUMNS + (["point"] if "point" in df else [])),
        "plots": plots,
    }


def protocol_tables(collected, df: pd.DataFrame, windows, metric: str) -> tuple[dict, dict]:
    """A comparison table per grid point and protocol (keyed "point; protocol", or the protocol
    alone), and for the non-overlapping ones the effective length of runs context_gain scored."""
    tables, effective = {}, {}
    for point in point_order(df):
        rows = df if point is None else df[df["point"] == point]
        for protocol, stride in protocols(rows):
            part = rows[(rows["protocol"] == protocol) & (rows["stride"].fillna("").astype(str) == stride)]
            label = protocol_label(protocol, stride)
            table = comparison(part)
            over_windows(table, part, windows, metric)
            key = label if point is None else f"{point}; {label}"
            tables[key] = table
            if protocol == "nonoverlapping":
                here = [r for r in collected.runs if collected.points.get(r.folder, "") == (point or "")]
                effective[key] = effective_cells(here)
    return tables, effective


def frame(collected) -> tuple[pd.DataFrame, list]:
    """Every run's rows as one long DataFrame, typed and in table order. Its attrs hold only small
    values (each run's backend, the diverged runs, the grid points): pandas deep-copies them on
    every operation, and the runs with their rows would make a report of a few runs take seconds."""
    points = collected.points
    columns = SUMMARY_COLUMNS + (["point"] if len(set(points.values())) > 1 else [])
    df = pd.DataFrame(
        [{**r, "point": points[run.folder], "experiment": run.experiment} for run in collected.runs for r in run.rows],
        columns=[*columns, "experiment"],
    )
    for c in ("seed", "train_len", "length", "tokens"):
        df[c] = df[c].astype(int)
    for c in ("loss", "ppl", "bpb"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df["scheme"] = pd.Categorical(df["scheme"], categories=scheme_order(set(df["scheme"])), ordered=True)
    df = df.sort_values([c for c in ("experiment", "point", "scheme", "seed", "length") if c in df])
    df = df.drop(columns="experiment").reset_index(drop=True)
    df["scheme"] = df["scheme"].astype(str)
    df.attrs["trained_with"] = {
        run.folder.name: run.trained_with for run in collected.runs if not run.cfg.model.pretrained
    }
    df.attrs["scheme_of"] = {run.folder.name: run_label(run.cfg.model) for run in collected.runs}
    df.attrs["diverged"] = collected.diverged
    df.attrs["points"] = points if "point" in df else {}
    return df, [run.cfg for run in collected.runs]


def join_checks(rows: list[dict]) -> list[tuple[str, set]]:
    """What two experiments joined into one table must share, beyond their settings."""
    return [
        ("training lengths", {int(r["train_len"]) for r in rows}),
        ("protocols", {protocol_label(r["protocol"], r["stride"]) for r in rows}),
    ]


def position_losses(runs: list, points: dict) -> pd.DataFrame:
    """Every run's loss per window position (its positions.csv.gz), with its seed and grid point
    (`points`: a run folder's, where there are several), in long format."""
    frames = []
    for run in runs:
        rows = read_positions(run.folder)
        if rows:
            frame = pd.DataFrame(rows, columns=POSITION_COLUMNS)
            frames.append(frame.assign(seed=run.cfg.seeds[0], point=points.get(run.folder, "")))
    if not frames:
        return pd.DataFrame(columns=[*POSITION_COLUMNS, "seed", "point"])
    out = pd.concat(frames, ignore_index=True)
    out["stride"] = out["stride"].fillna("").astype(str)
    for c in ("length", "position", "tokens"):
        out[c] = out[c].astype(int)
    out["loss"] = out["loss"].astype(float)
    return out


POSITION_POINTS = 200  # the most points a line of positions.png draws


def plot_positions(pos: pd.DataFrame, train_lens: dict, path: Path, unit: str = "byte") -> bool:
    """Mean loss at each position of the longest windows (compare.band_plot): a line per scheme
    with its 95% band over seeds, a panel per protocol (and grid point), a dashed line at the
    training length (`train_lens`: grid point -> its length): where a scheme breaks; beside it,
    grey, how often training windows held the distance back to the window's start."""
    from posbench.stats import t_quantile

    if pos.empty:
        return False
    longest = pos["length"].max()
    pos = pos[pos["length"] == longest]
    groups = sorted(
        pos.groupby(["point", "protocol", "stride"]).groups,
        key=lambda ps: (train_lens[ps[0]], ps[0], ps[1] != "nonoverlapping", ps[1:]),
    )
    panels = []
    for point, protocol, stride in groups:
        part = pos[(pos["point"] == point) & (pos["protocol"] == protocol) & (pos["stride"] == stride)]
        # the positions every window scores: all of them in chunks, a sliding window's last
        # `stride` (its first window alone scores the rest, too few tokens to draw)
        part = part[part["tokens"] >= part["tokens"].max() / 2]
        # a point per `width` of those positions, their mean loss at their mean position: a
        # long window's few tokens per position would otherwise draw noise
        first = int(part["position"].min())
        width = max(1, math.ceil((int(part["position"].max()) - first + 1) / POSITION_POINTS))
        part = part.assign(bin=(part["position"] - first) // width)
        where = f"{point}; " if point else ""
        L = train_lens[point]
        # STRING (An et al. 2024): a window of L trains distance d in L - d of its query-key pairs,
        # so the far distances a position past L needs were rarely or never seen
        trained = Line("training pairs at distance = position, per window", [0, L, int(longest) - 1], [L, 0, 0], [], 1)
        means = f", means of {width} positions" if width > 1 else ""
        title = f"{where}{protocol_label(protocol, stride)}: windows of {longest}{means}"
        panel = Panel(title, mark=L, beside=trained)
        for s in scheme_order(set(part["scheme"])):
            mine = part[part["scheme"] == s]
            xs = mine.groupby("bin")["position"].mean()
            at = mine.groupby(["seed", "bin"])["loss"].mean().groupby("bin").agg(["mean", "std", "count"])
            n = int(at["count"].min())
            half = t_quantile(0.975, n - 1) * at["std"] / at["count"] ** 0.5 if n > 1 else at["mean"] * math.nan
            panel.lines.append(Line(s, list(xs[at.index]), list(at["mean"]), list(half), n))
        panels.append(panel)
    xlabel = f"position in the window; dashed: training length; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, f"mean loss (nats per {unit})", xlabel, log=False, markers=False)


def plot(tables: dict[str, pd.DataFrame], path: Path, metric: str = "ppl", what: str = "", unit: str = "byte") -> bool:
    """The metric against length (compare.band_plot): a line per scheme with its 95% band over
    seeds, a dashed line at the training length, a panel per table (protocol, and grid point)."""
    what = what or METRICS[metric].label
    panels = []
    for label, table in tables.items():
        panels.append(Panel(f"{what} by length: {label}", lines(table), table.attrs["train_len"]))
    length = "bytes" if unit == "byte" else "tokens"
    xlabel = f"evaluation length ({length}); dashed: the training length; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, what, xlabel, log=False if metric == "loss" else None)
