"""Context gain and key tokens: does a model use its far context?

Does a model use its far context? Context gain and key tokens (LongPPL), from two passes over
the same windows: each window of L tokens whole, and its last K tokens alone.

Each window's last m = K // 2 targets are scored twice: with the whole window visible (a context
of L - m + 1 to L tokens) and with only the window's last K tokens visible (K - m + 1 to K). The
short pass scores all K of its targets and keeps the last m, so no target is compared at a
context shorter than K - m + 1: what "any context helps" is worth is in both losses, and short - full
is what the tokens lying K/2 to L back add. Where they hurt (positions past what the model
learned, as RoPE's past its training length) it is negative. K is the run's training length (a
pretrained model's context), where the short pass is in distribution, and any other K asked.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch

from posbench.errors import PosbenchError
from posbench.measures.base import Metric, Scorer, ScoringRun, over_samples, ratio_over_samples

# LongPPL's key token: its loss drops by more than 2 nats with the long context, and is under
# 2 nats with it; set for BPE tokens of 7B models, about 4 bytes of English text each
LONGPPL_NATS = 2.0
LONGPPL_BYTES = 4.0
NOT_PAST_K = "not-past-k"  # a length no longer than every K: nothing lies beyond what the short pass sees


def context_losses(
    run: ScoringRun, L: int, K: int, variant: Optional[str] = None, factor: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, full): the losses in nats of each window's last K // 2 targets, (n, K // 2) each,
    with only the window's last K tokens visible and with all L; both passes as the model's
    evaluation-time `variant` (None: as trained) at length L's factor, or `factor`: the model
    as it would be deployed at L, shown less. The passes are kept in `run.memo`, so measures
    scored on one run share them and the pass at L is made once for all K."""
    at = (variant, factor)
    if ("full", L, at) not in run.memo:
        run.memo["full", L, at] = _pass(run, L, L, variant, factor)  # (n, L)
    if ("short", L, K, at) not in run.memo:
        run.memo["short", L, K, at] = _pass(run, L, K, variant, factor)  # (n, K)
    m = K // 2
    return run.memo["short", L, K, at][:, -m:], run.memo["full", L, at][:, -m:]


@torch.no_grad()
def _pass(run: ScoringRun, L: int, K: int, variant: Optional[str], factor: Optional[float]) -> torch.Tensor:
    """Each target's loss with the last K tokens of each window of L visible, (n, K)."""
    out = []
    scaled = nullcontext() if variant is None else run.model.eval_variant(variant, L, factor)
    with scaled:
        for x, y in run.windows(L):  # (b, L) each
            win = torch.cat([x, y[:, -1:]], dim=1)[:, -(K + 1) :]  # (b, K + 1): the last K inputs and their targets
            out.append(run.model.token_losses(win).float().cpu())  # (b, K)
    return torch.cat(out)


def _named(name: str, variant: Optional[str]) -> str:
    """A measure's records' name: context_gain, or context_gain_yarn scored as variant yarn."""
    if variant is not None and (not isinstance(variant, str) or not variant.replace("_", "").isalnum()):
        raise PosbenchError(f"variant: {variant!r} is not a variant's name (yarn, linear, ...)")
    return name if variant is None else f"{name}_{variant}"


def _ks(given) -> list[int]:
    """The K a user names (--measure-option k=64,128), checked."""
    ks = list(given or [])
    for K in ks:
        if isinstance(K, bool) or not isinstance(K, int) or K < 2:
            raise PosbenchError(f"k: {K!r} is not a length of at least 2 tokens")
    return ks


def _by_k(run: ScoringRun, ks: list[int]) -> dict[str, int]:
    """Metric suffix -> K: "" for the run's training length, "_k64" for each K named."""
    return {"": int(run.cfg.model.train_len), **{f"_k{K}": K for K in ks}}


def _rows(run: ScoringRun, ks: list[int], metrics, cells) -> list[dict]:
    """A row per length: `cells(L, K, suffix)` (its metrics at K, and their "ci" over the
    windows) for every K below L, NaN for the others; a status where the model cannot encode L
    or no K is below it."""
    rows = []
    for L in run.lengths:
        if run.model.max_len is not None and L > run.model.max_len:
            rows.append({"length": L, "status": "beyond-max-len"})
            continue
        by_k = _by_k(run, ks)
        if all(K >= L for K in by_k.values()):
            rows.append({"length": L, "status": NOT_PAST_K})
            continue
        row, ci = {"length": L, **dict.fromkeys(metrics, math.nan)}, {}
        for suffix, K in by_k.items():
            if K < L:
                got = cells(L, K, suffix)
                ci |= got.pop("ci")
                row |= got
        rows.append(row | {"ci": ci})
    return rows


class ContextGain(Scorer):
    """Loss with only the last K tokens visible minus loss with the whole window, nats per
    token, on the same targets (the module docstring): positive where the far context helps."""

    name = "context_gain"
    # more K than the training length (a pretrained model's context); an evaluation-time variant
    # (rope's yarn, a pretrained model's linear) at each length's factor or `factor`, whose
    # records are context_gain_<variant>, a table of their own
    options = {"k": [], "variant": None, "factor": None}

    def __init__(self, **options):
        super().__init__(**options)
        self.ks = _ks(self.options["k"])
        self.name = _named(self.name, self.options["variant"])
        self.metrics = {f"gain{s}": self._metric(s, K) for s, K in [("", None), *((f"_k{K}", K) for K in self.ks)]}

    @staticmethod
    def _metric(suffix: str, K) -> Metric:
        at = "K = train_len" if K is None else f"K = {K}"
        return Metric(
            f"gain{suffix}",
            f"context gain in nats ({at})",
            higher_is_better=True,
            digits=3,
            title=f"Context gain ({at})",
            how="loss of each window's last K/2 targets with only its last K tokens visible, minus with all of it",
        )

    def score(self, run: ScoringRun) -> list[dict]:
        def gain(L, K, suffix):
            short, full = context_losses(run, L, K, self.options["variant"], self.options["factor"])
            value, half = over_samples((short - full).mean(1).tolist())  # a window's gain each: equal targets
            return {f"gain{suffix}": value, "ci": {f"gain{suffix}": half}}

        return _rows(run, self.ks, self.metrics, gain)


class KeyTokens(Scorer):
    """LongPPL's key tokens, the model its own evaluator: of the targets context gain scores,
    those whose short - full loss exceeds alpha and whose full loss is under beta (nats); their
    share, and the perplexity on them alone."""

    name = "key_tokens"
    # alpha, beta None: LongPPL's 2 nats scaled by the corpus's bytes per token over 4 (its BPE
    # tokens'), 0.5 nats for a byte
    options = {"k": [], "alpha": None, "beta": None, "variant": None, "factor": None}  # variant: as context_gain's

    def __init__(self, **options):
        super().__init__(**options)
        self.ks = _ks(self.options["k"])
        self.name = _named(self.name, self.options["variant"])
        self.asked = (self.options["alpha"], self.options["beta"])  # None: scaled to the run's tokens
        for key in ("alpha", "beta"):
            value = self.options[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise PosbenchError(f"{key}: {value!r} is not a positive number of nats")
        self.metrics = {}
        for suffix, K in [("", None), *((f"_k{K}", K) for K in self.ks)]:
            at = "K = train_len" if K is None else f"K = {K}"
            self.metrics[f"key_fraction{suffix}"] = Metric(
                f"key_fraction{suffix}",
                f"% key tokens ({at})",
                higher_is_better=True,
                digits=2,
                scale=100,
                title=f"Key tokens ({at})",
                how="share of the scored targets whose loss drops by more than alpha with the far context, under beta",
            )
            self.metrics[f"key_ppl{suffix}"] = Metric(
                f"key_ppl{suffix}",
                f"ppl on key tokens ({at})",
                higher_is_better=False,
                digits=3,
                title=f"Perplexity on key tokens ({at})",
                how="exp of the mean full-context loss of the key tokens",
            )

    def thresholds(self, run: ScoringRun) -> dict:
        """alpha and beta in nats, as given or scaled from LongPPL's by the bytes per token of the
        run's evaluation tokens; recorded with the bytes per token in the measure's options."""
        from posbench.evaluate import eval_tokens

        tokens = eval_tokens(run.source, run.cfg, run.lengths)
        per_token = run.source.bytes_of(tokens) / len(tokens)
        scaled = LONGPPL_NATS * per_token / LONGPPL_BYTES
        alpha, beta = self.asked
        return {
            "alpha": float(scaled if alpha is None else alpha),
            "beta": float(scaled if beta is None else beta),
            "bytes_per_token": round(per_token, 4),
        }

    def score(self, run: ScoringRun) -> list[dict]:
        self.options = {**self.options, **self.thresholds(run)}
        alpha, beta = self.options["alpha"], self.options["beta"]

        def key(L, K, suffix):
            short, full = context_losses(run, L, K, self.options["variant"], self.options["factor"])
            is_key = ((short - full) > alpha) & (full < beta)  # (n, K // 2)
            share, share_ci = over_samples(is_key.double().mean(1).tolist())  # equal targets a window
            # the mean loss over every key token, windows holding unequal numbers of them
            loss, loss_ci = ratio_over_samples((full * is_key).sum(1).tolist(), is_key.sum(1).tolist())
            ppl = math.exp(loss) if loss == loss else math.nan
            return {
                f"key_fraction{suffix}": share,
                f"key_ppl{suffix}": ppl,
                "ci": {f"key_fraction{suffix}": share_ci, f"key_ppl{suffix}": ppl * loss_ci},  # exp's slope
            }

        return _rows(run, self.ks, self.metrics, key)
