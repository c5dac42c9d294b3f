"""Effective length: how far a run stays as good as at its training length.

The longest length up to which a run stays as good as at its training length by every measure
it was scored by, so that "flat" and "uses its context" are one column.

A run's effective length is the longest L, walking up from its training length through the
lengths it was scored at, at which all of these hold at L and at every length before it:

- perplexity within (1 + eps) of its perplexity at the training length (non-overlapping);
- context gain (K = the training length) not negative, where the run was scored by context_gain;
- retrieval accuracy (mean over depths) at least `fraction` of its accuracy at the training
  length, where the run was scored by retrieval (or retrieval_short) and retrieves at the
  training length at least twice as often as chance (1 in distractors + 1): at chance the
  measure says nothing of the far context, and its noise would decide the length.

A run scored as an evaluation-time variant too (context_gain_yarn, by `--measure-option
variant=yarn`) has an effective length as that variant: its rope+yarn perplexity rows (at the
factor the measure was scored at), its context_gain_yarn and retrieval_yarn records.

eps and fraction are the run's `eval.effective` (0.10 and 0.5 unless its config says otherwise),
read from its config.yaml, so a report states the thresholds each run was judged by. A criterion
whose measure was not scored is left out (and said). No torch: read from records.
"""

from __future__ import annotations

import math
from typing import Optional

from posbench.compare.table import mean_cell
from posbench.measures.plugin import read_measures
from posbench.schemes import run_label, variant_label

GAIN = "context_gain"
RETRIEVAL = ("retrieval", "retrieval_short")


def effective_length(
    ppl: dict[int, float],
    train_len: int,
    gain: Optional[dict[int, float]] = None,
    retrieval: Optional[dict[int, float]] = None,
    *,
    eps: float,
    fraction: float,
) -> Optional[int]:
    """The longest length of `ppl` (length -> perplexity) from `train_len` up at which every
    criterion holds there and before; None where the training length itself was not scored.
    `gain` (length -> context gain) has no value at lengths up to K: nothing to hold there."""
    if train_len not in ppl or not ppl[train_len] == ppl[train_len]:
        return None
    base_acc = None if retrieval is None else retrieval.get(train_len)
    longest = train_len
    for L in sorted(x for x in ppl if x > train_len):
        ok = ppl[L] == ppl[L] and ppl[L] <= (1 + eps) * ppl[train_len]
        if gain is not None and gain.get(L) == gain.get(L) and gain.get(L) is not None:
            ok = ok and gain[L] >= 0
        if base_acc is not None and retrieval.get(L) is not None:
            ok = ok and retrieval[L] >= fraction * base_acc
        if not ok:
            break
        longest = L
    return longest


def row_label(run, measures: dict, variant: Optional[str]) -> str:
    """The row a run's effective length belongs to: its own, or its `variant`'s at the factor its
    context_gain_<variant> was scored at (rope+yarn@2)."""
    factor = None if variant is None else (measures[f"{GAIN}_{variant}"].options or {}).get("factor")
    return variant_label(run_label(run.cfg.model), variant, factor)


def by_run(run, measures: dict, variant: Optional[str] = None) -> tuple[Optional[int], list[str]]:
    """A run's effective length from its records (its rows, non-overlapping; `measures`: its
    plugin.read_measures) and the criteria that decided it: as trained, or as its evaluation-time
    `variant` (its perplexity rows of that variant, at the factor its context_gain_<variant> was
    scored at, and its measures' records of that variant)."""
    own = "" if variant is None else f"_{variant}"
    label, L = row_label(run, measures, variant), run.cfg.model.train_len
    eps, fraction = run.cfg.eval.effective.eps, run.cfg.eval.effective.fraction
    ppl = {
        int(r["length"]): float(r["ppl"]) if r["status"] == "ok" else math.nan
        for r in run.rows
        if r["scheme"] == label and r["protocol"] == "nonoverlapping"
    }
    said = [f"ppl within {eps:.0%} of ppl({L})"]
    gain = None
    if GAIN + own in measures:
        gain = {int(r["length"]): float(r["gain"] or "nan") for r in measures[GAIN + own].rows}
        said.append("context gain >= 0")
    retrieval = None
    for found in (name + own for name in RETRIEVAL if name + own in measures):  # the first that can judge
        acc: dict[int, list] = {}
        for r in measures[found].rows:
            if r["status"] == "ok":
                acc.setdefault(int(r["length"]), []).append(float(r["retrieval_accuracy"]))
        by_length = {length: sum(v) / len(v) for length, v in acc.items()}  # the mean over depths
        chance = 1 / (1 + int((measures[found].options or {}).get("distractors", 9)))
        if by_length.get(L, 0.0) >= 2 * chance:  # else (too short at L, or at chance) it says nothing
            retrieval = by_length
            said.append(f"{found.removesuffix(own)} accuracy >= {fraction:.0%} of its accuracy at {L}")
            break
    return effective_length(ppl, L, gain, retrieval, eps=eps, fraction=fraction), said


def cells(runs) -> tuple[dict[str, str], list[str]]:
    """Row label -> its effective length's cell (the mean and 95% interval over seeds) and the
    criteria, for the runs scored by context_gain, as trained and as each evaluation-time
    variant it was scored as (context_gain_yarn: the rope+yarn row); empty where none was."""
    found: dict[str, list] = {}
    said: list[str] = []
    for run in runs:
        measures = read_measures(run.folder)
        for name, rec in measures.items():
            if name != GAIN and not (name.startswith(GAIN + "_") and (rec.options or {}).get("variant")):
                continue
            variant = None if name == GAIN else rec.options["variant"]
            eff, criteria = by_run(run, measures, variant)
            if eff is not None:
                found.setdefault(row_label(run, measures, variant), []).append(eff)
                said = max(said, criteria, key=len)
    out = {}
    for label, values in found.items():
        out[label] = mean_cell(values)
    return out, said
