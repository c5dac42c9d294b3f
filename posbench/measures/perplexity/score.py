"""Perplexity's scoring: every length, protocol and variant into the run's records.

Each length's windows of the validation tokens, under each protocol and evaluation-time
variant, merged into the run's records (posbench/evaluate.py holds the forward passes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError
from posbench.files import write_rows
from posbench.measures.perplexity.records import (
    EVAL_COLUMNS,
    PLAIN_POSITIONS,
    POSITION_COLUMNS,
    POSITIONS,
    WINDOW_COLUMNS,
    eval_rows,
    read_eval,
    read_positions,
    read_windows,
    row_key,
)


def default_stride(train_len: int) -> int:
    """Sliding windows advance by a quarter of the training length unless told otherwise."""
    return max(1, train_len // 4)


def evaluate_into(
    rc,
    rdir: Path,
    model,
    corpus,
    lengths: list[int],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
    protocols: Optional[list[str]] = None,
    reporter=None,
    weights: Optional[str] = None,
) -> list[dict]:
    """Evaluate at `lengths` under each protocol (None: the config's), as trained (None) and as
    each named evaluation-time variant, and merge the rows into the run's eval.csv and their
    loss per position into positions.csv.gz: a (scheme label, length, protocol, stride) row
    replaces its old one. The plain rows come first, then each variant's. `reporter` hears how
    many of the input tokens are scored (Reporter.scoring); `weights`, the rows' weights_mark of
    `model`, where the caller has it."""
    from posbench.device import computed_on, pick_device
    from posbench.evaluate import eval_tokens, evaluate_model, window_tokens
    from posbench.experiment.checkpoint import weights_mark
    from posbench.experiment.records import log_scoring
    from posbench.schemes import run_label, variant_label

    _refuse_variants(rc, model, variants, max(lengths), factor)
    if weights is None:  # outside any variant, which may change a buffer of the scheme's
        weights = weights_mark(model)
    device = pick_device(rc.train.device)
    tokens = eval_tokens(corpus, rc, lengths)
    labels = {variant_label(run_label(rc.model), v, factor) for v in variants}
    n = len(tokens) - 1
    old = read_eval(rdir), read_positions(rdir), read_windows(rdir)  # each checked before any scoring or writing
    stale = {
        int(r["length"]) for r in old[0] if r["scheme"] in labels and int(r["tokens"]) != n and int(r["length"]) <= n
    }
    if stale - set(lengths):  # rows scored on other tokens do not compare with these: redo them
        lengths = sorted(set(lengths) | stale)
        tokens = eval_tokens(corpus, rc, lengths)
    rows, positions, per_window = [], [], []
    n_bytes = corpus.bytes_of(tokens[1:])  # the targets: every protocol scores each once
    protocols = protocols or rc.eval.perplexity.protocol
    stride_of = {p: rc.eval.perplexity.stride if p == "sliding" else None for p in protocols}
    total = len(variants) * sum(window_tokens(n, L, p, stride_of[p]) for p in protocols for L in lengths)
    done = 0

    def progress(count: int) -> None:
        nonlocal done
        done += count
        if reporter is not None:
            reporter.scoring(f"{', '.join(sorted(labels))} seed {rc.seeds[0]}, {', '.join(protocols)}", done, total)

    for protocol in protocols:
        stride = stride_of[protocol]
        for v in variants:
            label = variant_label(run_label(rc.model), v, factor)
            scored, by_position = evaluate_model(
                model, tokens, lengths, rc.eval.batch_size, device, v, factor, protocol, stride, progress
            )
            for r in scored:  # bits per byte: the loss summed over the n scored tokens, over their bytes
                r["bpb"] = r["loss"] / math.log(2) * (n / n_bytes) if r["status"] == "ok" else float("nan")
                r["tokenizer"] = corpus.tokenizer
            rows += eval_rows(rc, scored, label, weights)
            for L, (sums, counts, wins) in by_position.items():
                ident = {"scheme": label, "length": L, "protocol": protocol, "stride": stride}
                positions += [
                    {**ident, "position": p, "loss": sums[p].item() / c.item(), "tokens": c.item()}
                    for p, c in enumerate(counts)
                    if c > 0
                ]
                per_window += [
                    {**ident, "window": w, "loss": loss, "tokens": int(count)}
                    for w, (loss, count) in enumerate(wins.tolist())
                ]
    _merge_records(rdir, run_label(rc.model), old, rows, positions, per_window)
    log_scoring(rdir, "perplexity", rows, computed_on(device))
    return rows


def _refuse_variants(rc, model, variants: list[Optional[str]], longest: int, factor: Optional[float]) -> None:
    """One line, before any scoring, for a variant the model lacks or cannot apply, or a factor below 1."""
    unknown = [v for v in variants if v is not None and v not in model.eval_variants]
    scheme = getattr(model, "scheme", None)
    for v in unknown:  # a training-free variant the scheme refuses says why, in its own words
        if scheme is not None and v in scheme.eval_variants:
            with scheme.eval_variant(v, rc.model.train_len, longest, factor):
                pass
    if unknown:
        have = ", ".join(model.eval_variants) or "none"
        # a scheme whose options decide its variants (a pattern) says why this one lacks it
        why = f": {scheme.lacks(unknown[0])}" if scheme is not None and scheme.variants_by_options else ""
        raise PosbenchError(
            f"scheme '{rc.model.scheme}' has no evaluation-time variant '{unknown[0]}' (its variants: {have}){why}"
        )
    if factor is not None and not factor >= 1.0:
        raise PosbenchError(f"rope factor {factor}: must be >= 1")
    for v in variants:  # one the model declares but cannot apply (longrope without factors) refuses here
        with model.eval_variant(v, longest, factor):
            pass


def _merge_records(rdir: Path, base: str, old: tuple, rows: list, positions: list, per_window: list) -> None:
    """The new rows into eval.csv, their loss per position into positions.csv.gz and per window
    into windows.csv (`old`: the three files' rows as read); a row replaces the old one of its
    key. The plain run's rows (`base`) first. eval.csv goes last: it says what is scored, so a
    process stopped before it leaves those lengths to be scored again, all three files with them."""
    new = {row_key(r) for r in rows}
    old_eval, old_positions, old_windows = old

    def order(r):
        return r["scheme"] != base, r["scheme"], r["protocol"], int(r["length"])

    kept = [r for r in old_positions if row_key(r) not in new]
    write_rows(
        rdir / POSITIONS,
        sorted(kept + positions, key=lambda r: (*order(r), int(r["position"]))),
        POSITION_COLUMNS,
    )
    (rdir / PLAIN_POSITIONS).unlink(missing_ok=True)  # its rows are kept in the .gz
    kept = [r for r in old_windows if row_key(r) not in new]
    write_rows(
        rdir / "windows.csv", sorted(kept + per_window, key=lambda r: (*order(r), int(r["window"]))), WINDOW_COLUMNS
    )
    keep = [r for r in old_eval if row_key(r) not in new]
    write_rows(rdir / "eval.csv", sorted(keep + rows, key=order), EVAL_COLUMNS)


def unevaluated(rc, rdir: Path, model, n_tokens: int, device, own: str) -> dict[tuple, list[int]]:
    """For each (variant, protocol) (variant None: as trained), the lengths still lacking a row
    scored on these tokens by the attention backend that variant runs on `device`;
    eval.perplexity.rope_scaling kinds apply to a run only if its scheme declares them."""
    from posbench.schemes import run_label, variant_label

    variants = [None] + [v for v in rc.eval.perplexity.rope_scaling if v in model.eval_variants]
    # `own`: the model's weights_mark; a row other weights scored (another run's eval.csv copied in) is scored again
    have = {(*row_key(r), int(r["tokens"]), r["attention"]) for r in read_eval(rdir) if r["weights"] in ("", own)}
    missing = {}
    for protocol in rc.eval.perplexity.protocol:
        stride = str(rc.eval.perplexity.stride) if protocol == "sliding" else ""
        for v in variants:
            label = variant_label(run_label(rc.model), v, rc.eval.perplexity.rope_factor)
            backend = model.backend(device, variant=v)
            lengths = [L for L in rc.eval.lengths if (label, L, protocol, stride, n_tokens, backend) not in have]
            if lengths:
                missing[v, protocol] = lengths
    return missing
