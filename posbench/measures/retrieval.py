"""Retrieval by likelihood: a planted pass key ranked against distractors.

Does the model use a key it read far back? A pass key planted at a depth of filler text from
the run's own corpus is asked for at the end, and the model ranks the true key against
distractor keys by their likelihood (docs/measures.md).

    posbench evaluate RUN --measure posbench.measures.retrieval:Retrieval

One trial at length L and depth d (percent): filler tokens from the validation split, the needle
("The pass key is 48213. Remember it. 48213 is the pass key.") after d% of them, the question
("What is the pass key? The pass key is") last, then each candidate answer (" 48213", and N
distractor keys of as many tokens where the tokenizer allows), so that the model reads L tokens
before the last one. Each candidate is scored by its log-likelihood, -sum of its tokens' losses:
accuracy (the true key ranks first; a tie with k distractors counts 1/(k+1)), its mean rank
(ties halved), and the margin, its log-likelihood minus the best distractor's in nats. No text is
generated and no judge reads it. The draws (keys, filler, distractors) follow the seed, the length,
the depth and the trial alone, so the same run gives the same table, and a cell's trials are the
same for every run of one corpus.

The prompt's tokens are the run's own: its corpus's tokenizer (data.tokenizer: bytes, a BPE, a
pretrained model's) encodes the needle, question and keys. A model offering
`continuation_losses(prompt, candidates)` (a pretrained one: its keys and values are kept) reads
the prompt once per trial; any other is given the N + 1 sequences as one batch of windows.

Options (`Retrieval.options`): `--measure-option depths=0,50,100` and the like, a subclass's
own defaults, or the constructor's keywords from Python. They are written into the records.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import Optional

import numpy as np
import torch

from posbench.errors import PosbenchError
from posbench.measures.base import Metric, Scorer, ScoringRun, over_samples

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"  # what follows the question: the candidate scored
TIE = 1e-6  # nats: two candidates this close are tied (the same tokens scored in another batch row)
RETRIES = 100  # draws per distractor for one of the true key's token count, before any count will do


class Retrieval(Scorer):
    name = "retrieval"  # RUN/measures/retrieval.csv and .json
    samples = "trials"
    axis = "depth"  # where the needle sits, as a percent of the filler: 0 at the start, 100 last
    metrics = {
        "retrieval_accuracy": Metric(
            "retrieval_accuracy", "% keys ranked first", higher_is_better=True, digits=1, scale=100,
            title="Retrieval by likelihood", how="the true key ranks first among it and N distractors",
        ),
        "retrieval_rank": Metric(
            "retrieval_rank", "mean rank of the true key", higher_is_better=False, digits=2,
            how="1 + the distractors more likely than the true key (ties halved)",
        ),
        "retrieval_margin": Metric(
            "retrieval_margin", "margin over the best distractor (nats)", higher_is_better=True, digits=2,
            how="log p(true key) - max log p(distractor)",
        ),
    }  # fmt: skip

    options = {
        "depths": [0, 25, 50, 75, 100],  # percent of the filler before the needle
        "trials": 20,  # per depth and length
        "distractors": 9,  # N: chance is 1 / (N + 1)
        "key_digits": 5,
        "seed": 0,
        "lengths": None,  # None: the run's eval.lengths
        # scored as an evaluation-time variant (rope's yarn, a pretrained model's linear) at each
        # length's factor, or this fixed one; its records are retrieval_<variant>, a table of their own
        "variant": None,
        "factor": None,
        "needle": NEEDLE,
        "question": QUESTION,
        "answer": ANSWER,
    }

    def __init__(self, **options):
        super().__init__(**options)
        for k, v in self.options.items():  # read as attributes below
            setattr(self, k, v)
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise PosbenchError(f"depths {self.depths} must be percents, 0 to 100")
        if self.trials < 1 or self.distractors < 1 or not 1 <= self.key_digits <= 18:
            raise PosbenchError("trials and distractors must be at least 1, key_digits 1 to 18")
        if 9 * 10 ** (self.key_digits - 1) <= self.distractors:
            raise PosbenchError(f"{self.key_digits}-digit keys have too few values for {self.distractors} distractors")
        if "{key}" not in self.needle or "{key}" not in self.answer:
            raise PosbenchError("needle and answer must hold {key}")
        if self.variant is not None and self.name == type(self).name:  # one table per variant
            self.name = f"{self.name}_{self.variant}"

    # --- scoring ------------------------------------------------------------------------------

    def score(self, run: ScoringRun) -> list[dict]:
        from posbench.data import tokenizer_of

        if not hasattr(run.source, "val"):
            raise PosbenchError(f"a run of task {run.cfg.task} has no corpus to draw filler from")
        tok = tokenizer_of(run.cfg.data)

        def encode(text: str) -> torch.Tensor:
            return torch.as_tensor(tok.encode(text.encode()).astype(np.int64))

        val, batch = run.source.val, run.cfg.eval.batch_size
        rows = []
        for L in self.lengths or run.lengths:
            for d in self.depths:
                at = {"length": L, "depth": d}
                if run.model.max_len is not None and L > run.model.max_len:
                    rows.append({**at, "status": "beyond-max-len"})  # the scheme cannot encode L
                    continue
                trials = [self.trial(encode, val, L, d, t) for t in range(self.trials)]
                if any(t is None for t in trials):
                    rows.append({**at, "status": "too-short"})  # the needle and question alone fill L
                    continue
                as_scored = (
                    nullcontext() if self.variant is None else run.model.eval_variant(self.variant, L, self.factor)
                )
                with as_scored:
                    nats = candidate_losses(run.model, run.device, trials, batch)
                rows.append({**at, **summary(nats)})
        return rows

    def key(self, rng: random.Random) -> str:
        return str(rng.randrange(10 ** (self.key_digits - 1), 10**self.key_digits))

    def trial(self, encode, val, L: int, depth: float, t: int) -> Optional[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Trial `t` at length L and depth: the prompt (P,) and the candidates' tokens (the true
        key's first), or None where the needle and question leave no room."""
        rng = random.Random(f"{self.seed}:{L}:{depth}:{t}")  # a string seed: the same in every process
        true = self.key(rng)
        answer = encode(self.answer.format(key=true))
        keys, cands, tries = {true}, [answer], 0
        while len(cands) <= self.distractors:
            k = self.key(rng)
            tries += 1
            if k in keys:
                continue
            a = encode(self.answer.format(key=k))
            if len(a) != len(answer) and tries < RETRIES * self.distractors:
                continue  # a key of another token count is scored over more or fewer tokens
            keys.add(k)
            cands.append(a)
        needle, question = encode(self.needle.format(key=true)), encode(self.question)
        n = L + 1 - len(needle) - len(question) - len(answer)  # filler tokens: the model reads L in all
        if n < 0:
            return None
        if n > len(val):
            raise PosbenchError(
                f"length {L}: the validation split's {len(val):,} tokens are fewer than its {n:,} of filler"
            )
        start = rng.randrange(len(val) - n + 1)
        filler = torch.as_tensor(np.asarray(val[start : start + n]).astype(np.int64))  # (n,)
        cut = round(depth / 100 * n)
        return torch.cat([filler[:cut], needle, filler[cut:], question]), cands


def candidate_losses(model, device, trials: list, batch: int) -> list[torch.Tensor]:
    """Each trial's candidates' summed token losses, (C,) per trial: by the model's
    `continuation_losses` where it has one (the prompt read once), else every trial's candidate
    sequences as windows, `batch` at a time, those of one length together."""
    fast = getattr(model, "continuation_losses", None)
    out: list[Optional[torch.Tensor]] = [None] * len(trials)
    if fast is not None:
        for i, (prompt, cands) in enumerate(trials):
            sums = torch.empty(len(cands), dtype=torch.float64)
            for k in sorted({len(c) for c in cands}):
                idx = [j for j, c in enumerate(cands) if len(c) == k]
                conts = torch.stack([cands[j] for j in idx]).to(device)  # (c, k)
                sums[idx] = fast(prompt.to(device), conts).double().sum(1).cpu()
            out[i] = sums
        return out
    seqs = {}  # total length -> [(trial, candidate, its tokens)]
    for i, (prompt, cands) in enumerate(trials):
        out[i] = torch.empty(len(cands), dtype=torch.float64)
        for j, c in enumerate(cands):
            seqs.setdefault(len(prompt) + len(c), []).append((i, j, len(c), torch.cat([prompt, c])))
    for group in seqs.values():
        for s in range(0, len(group), batch):
            part = group[s : s + batch]
            win = torch.stack([w for *_, w in part]).to(device)  # (b, T + 1)
            losses = model.token_losses(win).double().cpu()  # (b, T)
            for r, (i, j, k, _) in enumerate(part):
                out[i][j] = losses[r, -k:].sum()
    return out


def summary(nats: list[torch.Tensor]) -> dict:
    """A cell's metrics from each trial's candidates' losses (the true key's first): the mean
    over trials of first-place (split among ties), rank and margin, and each one's "ci" over
    the trials."""
    per: dict[str, list[float]] = {"retrieval_accuracy": [], "retrieval_rank": [], "retrieval_margin": []}
    for n in nats:
        ll = -n  # (C,) log-likelihoods
        diff = ll[1:] - ll[0]  # (N,) each distractor over the true key
        better, ties = int((diff > TIE).sum()), int((diff.abs() <= TIE).sum())
        per["retrieval_accuracy"].append((better == 0) / (1 + ties))
        per["retrieval_rank"].append(1 + better + ties / 2)
        per["retrieval_margin"].append(float(-diff.max()))
    stats = {m: over_samples(v) for m, v in per.items()}
    return {m: value for m, (value, _) in stats.items()} | {"ci": {m: half for m, (_, half) in stats.items()}}


class ShortRetrieval(Retrieval):
    """Retrieval with texts of 36 bytes in all (the default's take 104), for byte runs whose
    windows are short: posbench's default runs are trained at 100 bytes and scored to 200."""

    name = "retrieval_short"  # RUN/measures/retrieval_short.csv, beside the default's
    options = {**Retrieval.options, "needle": "\nThe key is {key}.\n", "question": "\nThe key is"}
