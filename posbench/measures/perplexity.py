"""Perplexity: next-byte loss on the corpus at each length, its records (eval.csv, positions.csv) and tables.

A run of task lm trains on random windows of the corpus at train_len and is scored at every
eval length on the same validation tokens, under each protocol (posbench/evaluate.py holds the
torch side: windows and the forward passes). Its eval.csv holds a row per (scheme label,
length, protocol, stride); positions.csv the mean loss at each window position.
"""

from __future__ import annotations

import csv
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
from posbench.config import length_grid
from posbench.data import SHAKESPEARE_NAME
from posbench.errors import PosbenchError
from posbench.extend import report as extend
from posbench.files import write_rows
from posbench.measures.base import Measure, Metric, Section

UNRECORDED = "unrecorded"  # a run whose train_log.jsonl does not name its attention backend


def default_stride(train_len: int) -> int:
    """Sliding windows advance by a quarter of the training length unless told otherwise."""
    return max(1, train_len // 4)


class Perplexity(Measure):
    name = "perplexity"
    metrics = {
        "ppl": Metric("ppl", "perplexity per byte", higher_is_better=False, digits=2, column="ppl"),
        "loss": Metric("loss", "loss in nats per byte", higher_is_better=False, digits=3, column="loss"),
        "ratio": Metric(
            "ratio", "perplexity over its perplexity at the training length", False, 3, aggregate="derived"
        ),
        "bpb": Metric(
            "bpb",
            "bits per byte",
            higher_is_better=False,
            digits=3,
            column="bpb",
            compares=("data.tokenizer", "data.vocab_size", "model.vocab_size"),
        ),
    }
    records = ("eval.csv", "positions.csv")

    def decide(self, cfg, test_len: Optional[int]) -> None:
        L = cfg.model.train_len
        # the shortest length scored: the training length, or a fine-tuned child's parent's
        # (posbench extend scores a child beside its parent, from the parent's length)
        floor = cfg.model.extend["from_len"] if cfg.model.extend else L
        if test_len is not None:  # the grid runs from the training length, however it is given
            cfg.eval.lengths = length_grid(L, test_len)
        if "sliding" in cfg.eval.protocol:
            if cfg.eval.stride is None:
                cfg.eval.stride = default_stride(L)
            if cfg.eval.stride > floor:
                raise PosbenchError(
                    f"eval.stride={cfg.eval.stride} is longer than the shortest window, "
                    f"model.train_len={floor}; a window cannot score more than its length",
                    "eval.stride",
                )
        # the training length, the base of every ratio, is always scored; columns read in order
        cfg.eval.lengths = sorted({L, *cfg.eval.lengths})
        if cfg.eval.tokens < max(cfg.eval.lengths):
            raise PosbenchError(
                f"eval.tokens={cfg.eval.tokens} is fewer than the longest eval length {max(cfg.eval.lengths)}",
                "eval.tokens",
            )
        short = [n for n in cfg.eval.lengths if n < floor]
        if short:
            raise PosbenchError(
                f"eval.lengths {short} are shorter than the training length "
                f"model.train_len={floor}; test lengths must be >= it",
                "eval.lengths",
            )

    def notes(self, cfg, corpus) -> list[str]:
        from posbench.evaluate import eval_tokens, windows
        from posbench.schemes import SCHEMES

        notes = []
        kinds = set(cfg.eval.rope_scaling)
        if kinds and not any(kinds & set(SCHEMES.lookup(s).eval_variants) for s in cfg.schemes):
            owners = [name for name, cls in SCHEMES.items() if kinds & set(cls.eval_variants)]
            notes.append(
                f"eval.rope_scaling {cfg.eval.rope_scaling}: no scheme run here has these "
                f"evaluation-time variants ({', '.join(owners)} would), so they add no rows"
            )
        if "sliding" in cfg.eval.protocol:  # stride 1 is exact and slow: say how slow first
            n = len(eval_tokens(corpus, cfg, cfg.eval.lengths)) - 1
            count = sum(len(windows(n, L, "sliding", cfg.eval.stride)) for L in cfg.eval.lengths)
            chunks = sum(len(windows(n, L, "nonoverlapping", None)) for L in cfg.eval.lengths)
            notes.append(
                f"sliding evaluation, stride {cfg.eval.stride}: {count:,} windows per run over all lengths, "
                f"about {count / chunks:.0f}x the forward passes of non-overlapping evaluation"
            )
        return notes

    def score(self, rc, rdir: Path, model, corpus, device, backend: str) -> None:
        from posbench.evaluate import eval_tokens

        n_tokens = len(eval_tokens(corpus, rc, rc.eval.lengths)) - 1  # the same for every run
        for (variant, protocol), lengths in _unevaluated(rc, rdir, model, n_tokens, backend).items():
            evaluate_into(rc, rdir, model, corpus, lengths, [variant], rc.eval.rope_factor, [protocol])

    def rescore(self, cfg, rdir: Path, model, corpus, device) -> list[dict]:
        """Plain and each of eval.rope_scaling's variants (a variant row reads against the plain
        one), at eval.lengths (the training length, every ratio's base, among them)."""
        ev = cfg.eval
        return evaluate_into(
            cfg, rdir, model, corpus, ev.lengths, [None, *ev.rope_scaling], ev.rope_factor, ev.protocol
        )

    def evaluation(self, rc, rows: list[dict]) -> tuple[str, list[list[str]]]:
        how = rows[0]["attention"] if rows else rc.model.attention
        table = [["scheme", "length", "protocol", "loss", "ppl", "status"]]
        for r in rows:
            ok = r["status"] == "ok"
            table.append(
                [
                    r["scheme"],
                    str(r["length"]),
                    protocol_label(r["protocol"], r["stride"]),
                    f"{r['loss']:.4f}" if ok else "—",
                    f"{r['ppl']:.2f}" if ok else "—",
                    r["status"],
                ]
            )
        from posbench.schemes import run_label

        return f"{run_label(rc.model)} seed {rc.seeds[0]}, trained at {rc.model.train_len}; attention {how}", table

    def read(self, rdir: Path) -> list[dict]:
        return read_eval(rdir)

    def asked(self, rows: list[dict], cfg) -> list[dict]:
        lengths = set(cfg.eval.lengths)
        protocols = {(p, str(cfg.eval.stride) if p == "sliding" else "") for p in cfg.eval.protocol}
        variants = {None, *cfg.eval.rope_scaling}

        def variant(label: str):
            return label.partition("+")[2].partition("@")[0] or None

        return [
            r
            for r in rows
            if int(r["length"]) in lengths
            and (r["protocol"], str(r["stride"])) in protocols
            and variant(r["scheme"]) in variants
        ]

    def report(self, collected, metric: str, transpose: bool, buckets) -> dict:
        if buckets is not None:
            raise PosbenchError("--buckets applies to the runs of a task, not to perplexity (task lm)")
        return report(collected, metric or "ppl", transpose)

    def join_checks(self, rows: list[dict]) -> list[tuple[str, set]]:
        return join_checks(rows)


PROTOCOL_NAMES = {
    "nonoverlapping": "non-overlapping chunks, every token scored once",
    "sliding": "sliding windows, each scoring its last stride tokens, every token scored once",
}


def protocol_label(protocol: str, stride) -> str:
    """How a table names a protocol: `nonoverlapping`, or `sliding, stride 25`."""
    return protocol if protocol == "nonoverlapping" else f"{protocol}, stride {stride}"


EVAL_COLUMNS = [
    "scheme",
    "seed",
    "train_len",
    "length",
    "protocol",
    "stride",
    "loss",
    "ppl",
    "bpb",  # bits per byte: the summed loss in bits over the UTF-8 bytes the scored tokens cover
    "tokens",
    "status",
    "attention",
    "tokenizer",
]
BYTES_COLUMNS = [c for c in EVAL_COLUMNS if c not in ("bpb", "tokenizer")]  # eval.csv before tokenizers: bytes


POSITION_COLUMNS = ["scheme", "length", "protocol", "stride", "position", "loss", "tokens"]


STATUSES = ("ok", "beyond-max-len", "non-finite")  # scored; cannot encode the length; blew up


def eval_rows(cfg, rows: list[dict], label: Optional[str] = None) -> list[dict]:
    """Rows of one run; `label` names an evaluation-time variant's rows, e.g. rope+yarn."""
    from posbench.schemes import run_label

    ident = {"scheme": label or run_label(cfg.model), "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
    return [{**ident, **r} for r in rows]


def read_eval(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "eval.csv"
    if not path.is_file():
        return []
    bad = PosbenchError(f"{path}: malformed evaluation rows; delete it and run evaluate again")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = reader.fieldnames
    except (UnicodeDecodeError, csv.Error):
        raise bad from None
    if header == BYTES_COLUMNS and rows:  # written before tokenizers: bytes, so bpb = loss / ln 2
        for r in rows:
            ok = r.get("status") == "ok" and r.get("loss") not in (None, "")
            r["bpb"], r["tokenizer"] = (repr(float(r["loss"]) / math.log(2)) if ok else "nan"), "bytes"
        rows = [{c: r[c] for c in EVAL_COLUMNS} for r in rows]
    elif header != EVAL_COLUMNS or not rows:
        raise bad
    for r in rows:
        try:
            int(r["length"]), int(r["tokens"]), int(r["seed"]), int(r["train_len"])
            if r["status"] not in STATUSES or (r["status"] == "ok" and not math.isfinite(float(r["loss"]))):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad from None
    return rows


def evaluate_into(
    rc,
    rdir: Path,
    model,
    corpus,
    lengths: list[int],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
    protocols: Optional[list[str]] = None,
) -> list[dict]:
    """Evaluate at `lengths` under each protocol (None: the config's), as trained (None) and as
    each named evaluation-time variant, and merge the rows into the run's eval.csv and their
    loss per position into positions.csv: a (scheme label, length, protocol, stride) row
    replaces its old one. The plain rows come first, then each variant's."""
    from posbench.device import pick_device
    from posbench.evaluate import eval_tokens, evaluate_model
    from posbench.schemes import run_label, variant_label

    unknown = [v for v in variants if v is not None and v not in model.scheme.eval_variants]
    if unknown:
        have = ", ".join(model.scheme.eval_variants) or "none"
        raise PosbenchError(
            f"scheme '{rc.model.scheme}' has no evaluation-time variant '{unknown[0]}' (its variants: {have})"
        )
    if factor is not None and not factor >= 1.0:
        raise PosbenchError(f"rope factor {factor}: must be >= 1")
    device = pick_device(rc.train.device)
    tokens = eval_tokens(corpus, rc, lengths)
    labels = {variant_label(run_label(rc.model), v, factor) for v in variants}
    n = len(tokens) - 1
    stale = {
        int(r["length"])
        for r in read_eval(rdir)
        if r["scheme"] in labels and int(r["tokens"]) != n and int(r["length"]) <= n
    }
    if stale - set(lengths):  # rows scored on other tokens do not compare with these: redo them
        lengths = sorted(set(lengths) | stale)
        tokens = eval_tokens(corpus, rc, lengths)
    rows, positions = [], []
    n_bytes = corpus.bytes_of(tokens[1:])  # the targets: every protocol scores each once
    for protocol in protocols or rc.eval.protocol:
        stride = rc.eval.stride if protocol == "sliding" else None
        for v in variants:
            label = variant_label(run_label(rc.model), v, factor)
            scored, by_position = evaluate_model(
                model, tokens, lengths, rc.eval.batch_size, device, v, factor, protocol, stride
            )
            for r in scored:  # bits per byte: the loss summed over the n scored tokens, over their bytes
                r["bpb"] = r["loss"] / math.log(2) * (n / n_bytes) if r["status"] == "ok" else float("nan")
                r["tokenizer"] = corpus.tokenizer
            rows += eval_rows(rc, scored, label)
            for L, (sums, counts) in by_position.items():
                ident = {"scheme": label, "length": L, "protocol": protocol, "stride": stride}
                positions += [
                    {**ident, "position": p, "loss": sums[p].item() / c.item(), "tokens": c.item()}
                    for p, c in enumerate(counts)
                    if c > 0
                ]
    new = {_row_key(r) for r in rows}
    keep = [r for r in read_eval(rdir) if _row_key(r) not in new]
    base = run_label(rc.model)

    def order(r):
        return r["scheme"] != base, r["scheme"], r["protocol"], int(r["length"])

    write_rows(rdir / "eval.csv", sorted(keep + rows, key=order), EVAL_COLUMNS)
    kept = [r for r in read_positions(rdir) if _row_key(r) not in new]
    write_rows(
        rdir / "positions.csv",
        sorted(kept + positions, key=lambda r: (*order(r), int(r["position"]))),
        POSITION_COLUMNS,
    )
    return rows


def _row_key(r: dict) -> tuple:
    """What one evaluation row stands for: scheme label, length, protocol and stride."""
    return r["scheme"], int(r["length"]), r["protocol"], str(r["stride"] if r["stride"] is not None else "")


def read_positions(run_dir: Path) -> list[dict]:
    """positions.csv's rows: the mean loss at each window position (empty if none yet)."""
    path = Path(run_dir) / "positions.csv"
    if not path.is_file():
        return []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != POSITION_COLUMNS:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r["position"]), int(r["tokens"]), float(r["loss"])
    except (UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        raise PosbenchError(f"{path}: malformed loss-per-position rows; delete it and run evaluate again") from None
    return rows


def _unevaluated(rc, rdir: Path, model, n_tokens: int, backend: str) -> dict[tuple, list[int]]:
    """For each (variant, protocol) (variant None: as trained), the lengths still lacking a row
    scored on these tokens by this attention backend; eval.rope_scaling kinds apply to a run
    only if its scheme declares them."""
    from posbench.schemes import run_label, variant_label

    variants = [None] + [v for v in rc.eval.rope_scaling if v in model.scheme.eval_variants]
    have = {(*_row_key(r), int(r["tokens"]), r["attention"]) for r in read_eval(rdir)}
    missing = {}
    for protocol in rc.eval.protocol:
        stride = str(rc.eval.stride) if protocol == "sliding" else ""
        for v in variants:
            label = variant_label(run_label(rc.model), v, rc.eval.rope_factor)
            lengths = [L for L in rc.eval.lengths if (label, L, protocol, stride, n_tokens, backend) not in have]
            if lengths:
                missing[v, protocol] = lengths
    return missing


def token_unit(df: pd.DataFrame) -> str:
    """What one token is: byte, or token (bpe-2048) under a tokenizer, named."""
    tokenizers = sorted(set(df["tokenizer"])) if "tokenizer" in df else ["bytes"]
    return "byte" if tokenizers == ["bytes"] else f"token ({', '.join(tokenizers)})"


def metric_label(metric: str, df: pd.DataFrame) -> str:
    """What a cell holds: perplexity per byte, or per token under a tokenizer, named."""
    label = Perplexity.metrics[metric].label
    return label if metric == "bpb" else label.replace("per byte", f"per {token_unit(df)}")


def with_metric(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """df with a `value` column: each row's ppl, loss, or ppl over the same run's (scheme,
    seed, protocol) ppl at the training length."""
    if metric not in Perplexity.metrics:
        raise PosbenchError(f"--metric {metric}: expected one of {', '.join(Perplexity.metrics)}")
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


def spread_note(tables: dict[str, pd.DataFrame]) -> str:
    """What a cell's ± and its bold mean, over every table of a report."""
    seeds = max(int(t["seeds"].max()) for t in tables.values())
    return compare_spread(seeds, set().union(*(t.attrs.get("tests", set()) for t in tables.values())))


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
    corpus = SHAKESPEARE_NAME if c.data.path is None else f"{c.data.path} (bytes)"
    tokenizers = sorted(set(df["tokenizer"])) if "tokenizer" in df else ["bytes"]
    if tokenizers != ["bytes"]:
        corpus = corpus.removesuffix(" (bytes)").removesuffix(", bytes") + f"; tokenizer: {', '.join(tokenizers)}"
    tokens = t.steps * t.batch_size * m.train_len
    lines = [
        f"- corpus: {corpus}; validation = last {c.data.val_fraction:.0%} of it",
        f"- model: {m.n_layer} layer{'s' if m.n_layer > 1 else ''}, d_model {m.d_model}, {m.n_head} heads, "
        f"{params / 1e6:.2f}M parameters with NoPE, vocab {m.vocab_size}",
        f"- training: {t.steps} steps x {t.batch_size} sequences x {m.train_len} tokens "
        f"= {tokens:,} tokens, AdamW lr {t.lr:g} (warmup {t.warmup_steps}, cosine "
        f"to {t.min_lr:g}), {seeds_said(df)}",
        f"- evaluation: {_protocols_note(df)}, {_tokens_note(df)}; bpb: bits per byte, the summed loss in "
        f"bits over the UTF-8 bytes the scored tokens cover (comparable across tokenizers)",
    ]
    lines.append(f"- attention: {backends_note(df)}")
    if "point" in df:
        points = "; ".join(point_order(df))
        lines.append(f"- grid points (a table each; the lines above describe the first run): {points}")
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


def grid(
    table: pd.DataFrame, train_len: int, metric: str, missing: str = "", bpb: bool = True
) -> tuple[list[list[str]], set]:
    """The table as rows of strings (a header first): schemes x lengths, the seed count and
    ppl(longest)/ppl(train), and the (row, column) cells that are best."""
    lengths = lengths_of(table)
    heads = [str(L) for L in lengths]
    rows, best = compare_grid(table, heads, Perplexity.metrics[metric].digits, missing=missing, seeds=True)
    rows[0] += [f"ppl({table.attrs['longest']})/ppl({train_len})"]
    with_bpb = bpb and metric != "bpb" and table[["bpb train", "bpb longest"]].notna().any().any()
    rows[0] += [f"bpb({train_len})", f"bpb({table.attrs['longest']})"] if with_bpb else []
    best |= {(i, len(lengths) + 2) for i, s in enumerate(table.index, start=1) if table.loc[s, "best ratio"]}
    for s, row in zip(table.index, rows[1:]):
        row += [ratio_cell(table, s)]
        if with_bpb:
            row += [_bpb_cell(table.loc[s, k]) for k in ("bpb train", "bpb longest")]
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
    tables = {}
    for point in point_order(df):
        rows = df if point is None else df[df["point"] == point]
        for protocol, stride in protocols(rows):
            part = rows[(rows["protocol"] == protocol) & (rows["stride"].fillna("").astype(str) == stride)]
            label = protocol_label(protocol, stride)
            tables[label if point is None else f"{point}; {label}"] = comparison(part)
    note = spread_note(tables)
    tokenized = bool(set(df["tokenizer"].dropna()) - {"bytes", ""})
    sections = []
    for label, table in tables.items():
        train_len = table.attrs["train_len"]
        rows, best = grid(table, train_len, metric)
        # the files hold bpb; the terminal too where a tokenizer makes it differ from loss / ln 2
        shown, shown_best = grid(table, train_len, metric, missing="—", bpb=tokenized)
        shown[0][shown[0].index(f"ppl({table.attrs['longest']})/ppl({train_len})")] = (
            f"ppl({table.attrs['longest']})/ppl(train)"
        )
        if transpose:
            rows, best = transposed(rows, best)
            shown, shown_best = transposed(shown, shown_best)
        sections.append(
            Section(
                heading=label,
                caption=f"{tex(what)}, trained at {train_len}; {tex(label)}. {tex(note)}.",
                rows=rows,
                best=best,
                terminal=shown,
                terminal_best=shown_best,
                title=f"{what}, trained at {train_len} ({label}; attention: {backends_note(df, short=True)})",
            )
        )
    curve = extend.curve_table(df.attrs["runs"].values())
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
        plot_positions(position_losses(df), train_lens, folder / "positions.png", unit)
        plot_training(df.attrs["runs"], folder / "training.png", unit)
        if curve is not None:
            extend.plot_curve(curve[2], curve[1], folder / "steps.png")
            return ["summary.png", "positions.png", "training.png", "steps.png"]
        return ["summary.png", "positions.png", "training.png"]

    return {
        "title": f"Length extrapolation: trained at {trained_at(df)}, evaluated up to {longest}",
        "describe": describe(configs, df) + extend.describe(configs) + [f"- cells: {what}, {note}"],
        "sections": sections,
        "legend": legend,
        "csv": (df, EVAL_COLUMNS + (["point"] if "point" in df else [])),
        "plots": plots,
    }


def frame(collected) -> tuple[pd.DataFrame, list]:
    """Every run's rows as one long DataFrame, typed and in table order, with its runs in attrs."""
    points = collected.points
    columns = EVAL_COLUMNS + (["point"] if len(set(points.values())) > 1 else [])
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
    df.attrs["trained_with"] = {run.folder.name: run.trained_with for run in collected.runs}
    df.attrs["runs"] = {run.folder: run for run in collected.runs}
    df.attrs["diverged"] = collected.diverged
    df.attrs["points"] = points if "point" in df else {}
    return df, [run.cfg for run in collected.runs]


def join_checks(rows: list[dict]) -> list[tuple[str, set]]:
    """What two experiments joined into one table must share, beyond their settings."""
    return [
        ("training length", {int(r["train_len"]) for r in rows}),
        ("protocols", {protocol_label(r["protocol"], r["stride"]) for r in rows}),
    ]


def position_losses(df: pd.DataFrame) -> pd.DataFrame:
    """Every run's loss per window position (its positions.csv), with its seed and grid point,
    in long format."""
    frames = []
    points = df.attrs.get("points", {})
    for rdir, run in df.attrs.get("runs", {}).items():
        rows = read_positions(rdir)
        if rows:
            frame = pd.DataFrame(rows, columns=POSITION_COLUMNS)
            frames.append(frame.assign(seed=run.cfg.seeds[0], point=points.get(rdir, "")))
    if not frames:
        return pd.DataFrame(columns=[*POSITION_COLUMNS, "seed", "point"])
    out = pd.concat(frames, ignore_index=True)
    out["stride"] = out["stride"].fillna("").astype(str)
    for c in ("length", "position", "tokens"):
        out[c] = out[c].astype(int)
    out["loss"] = out["loss"].astype(float)
    return out


def plot_positions(pos: pd.DataFrame, train_lens: dict, path: Path, unit: str = "byte") -> bool:
    """Mean loss at each position of the longest windows (compare.band_plot): a line per scheme
    with its 95% band over seeds, a panel per protocol (and grid point), a dashed line at the
    training length (`train_lens`: grid point -> its length): where a scheme breaks."""
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
        where = f"{point}; " if point else ""
        panel = Panel(f"{where}{protocol_label(protocol, stride)}: windows of {longest}", mark=train_lens[point])
        for s in scheme_order(set(part["scheme"])):
            at = part[part["scheme"] == s].groupby("position")["loss"].agg(["mean", "std", "count"])
            n = int(at["count"].min())
            half = t_quantile(0.975, n - 1) * at["std"] / at["count"] ** 0.5 if n > 1 else at["mean"] * math.nan
            panel.lines.append(Line(s, list(at.index), list(at["mean"]), list(half), n))
        panels.append(panel)
    xlabel = f"position in the window; dashed: the training length; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, f"mean loss (nats per {unit})", xlabel, log=False, markers=False)


def plot(tables: dict[str, pd.DataFrame], path: Path, metric: str = "ppl", what: str = "", unit: str = "byte") -> bool:
    """The metric against length (compare.band_plot): a line per scheme with its 95% band over
    seeds, a dashed line at the training length, a panel per table (protocol, and grid point)."""
    what = what or Perplexity.metrics[metric].label
    panels = []
    for label, table in tables.items():
        panels.append(Panel(f"{what} by length: {label}", lines(table), table.attrs["train_len"]))
    length = "bytes" if unit == "byte" else "tokens"
    xlabel = f"evaluation length ({length}); dashed: the training length; band: 95% ({BAND_SEEDS}+ seeds)"
    return band_plot(panels, path, what, xlabel, log=False if metric == "loss" else None)
