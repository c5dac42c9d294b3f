"""Perplexity: next-token loss on the corpus at each length, the measure of task lm's runs.

A run is scored at every eval length on the same validation tokens, under each protocol. Its
rooms: records.py (eval.csv, a row per scheme label, length, protocol and stride; positions.csv.gz,
the mean loss at each window position; the metrics), score.py (scoring into them;
posbench/evaluate.py holds the forward passes) and views.py (tables and plots). This module
decides how a config's runs are scored and answers the Measure interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from posbench.config import length_grid
from posbench.errors import PosbenchError
from posbench.measures.base import Measure, only_own_section
from posbench.measures.perplexity.records import METRICS, protocol_label, read_eval
from posbench.measures.perplexity.score import default_stride, evaluate_into, unevaluated
from posbench.measures.perplexity.views import join_checks, report


class Perplexity(Measure):
    name = "perplexity"
    metrics = METRICS
    records = ("eval.csv", "positions.csv.gz", "windows.csv")

    def decide(self, cfg, test_len: Optional[int]) -> None:
        L = cfg.model.train_len
        # the shortest length scored: the training length, or a fine-tuned child's parent's
        # (posbench extend scores a child beside its parent, from the parent's length); a
        # pretrained model's, any (its context, model.train_len, is scored beside them)
        floor = cfg.model.extend["from_len"] if cfg.model.extend else 1 if cfg.model.pretrained else L
        if test_len is not None and cfg.model.pretrained and test_len < L:
            raise PosbenchError(
                f"--test-len {test_len} is shorter than the model's context {L}, where its grid starts; "
                f"--lengths scores shorter lengths"
            )
        if test_len is not None:  # the grid runs from the training length, however it is given
            cfg.eval.lengths = length_grid(L, test_len)
        only_own_section(cfg, self.name)
        # the training length, the base of every ratio, is always scored (a pretrained model's
        # context where a length reaches past it); columns read in order
        if not cfg.model.pretrained or max(cfg.eval.lengths) > L:
            cfg.eval.lengths = sorted({L, *cfg.eval.lengths})
        cfg.eval.lengths = sorted(cfg.eval.lengths)
        if cfg.eval.tokens < L and not cfg.model.pretrained:  # the training length is always scored
            raise PosbenchError(
                f"model.train_len={L} is more than eval.tokens={cfg.eval.tokens}, the tokens every length is "
                "scored on; raise eval.tokens",
                "model.train_len",
            )
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
        own = cfg.eval.perplexity
        if "sliding" in own.protocol:
            # a pretrained model's windows may be shorter than its context: the shortest is its own
            shortest = cfg.eval.lengths[0] if cfg.model.pretrained else floor
            if own.stride is None:
                own.stride = default_stride(min(L, shortest) if cfg.model.pretrained else L)
            if own.stride >= 1 and own.stride > shortest:  # a fraction fits every length
                where = f"eval.lengths {shortest}" if cfg.model.pretrained else f"model.train_len={floor}"
                raise PosbenchError(
                    f"eval.perplexity.stride={own.stride} is longer than the shortest window, "
                    f"{where}; a window cannot score more than its length",
                    "eval.perplexity.stride",
                )
        elif own.stride is not None and (cfg.origins or {}).get("eval.perplexity.stride", "").startswith("--"):
            # a stride from the command line where no sliding window is scored would change
            # nothing: refused rather than ignored
            where = cfg.origins["eval.perplexity.stride"]
            add = "--set 'eval.protocol=[sliding]'" if where.startswith("--set") else "--protocol sliding"
            raise PosbenchError(
                f"{where}: a stride is the sliding windows' step, and the protocol here is "
                f"{','.join(own.protocol)}: add {add} (or nonoverlapping,sliding)"
            )

    def notes(self, cfg, corpus) -> list[str]:
        from posbench.evaluate import eval_tokens, windows
        from posbench.schemes import SCHEMES

        notes = []
        if corpus is not None:  # a validation split too short to score is refused before training, not after
            eval_tokens(corpus, cfg, cfg.eval.lengths)
        own = cfg.eval.perplexity
        kinds = set(own.rope_scaling)
        if kinds and not any(kinds & set(SCHEMES.lookup(s).eval_variants) for s in cfg.schemes):
            owners = [name for name, cls in SCHEMES.items() if kinds & set(cls.eval_variants)]
            notes.append(
                f"eval.perplexity.rope_scaling {own.rope_scaling}: no scheme run here has these "
                f"evaluation-time variants ({', '.join(owners)} would), so they add no rows"
            )
        from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

        for kind in [k for k in own.rope_scaling if k in TRAINING_FREE]:  # every scheme declares these
            for s in cfg.schemes:
                why = SCHEMES.lookup(s).refuses(kind)
                if why:
                    notes.append(f"eval.perplexity.rope_scaling {kind}: no {s}+{kind} rows, {why}")
        for s in cfg.schemes if kinds else []:  # a pattern over layers whose own layers take none of them
            if SCHEMES.lookup(s).variants_by_options:
                from posbench.schemes import build_scheme

                scheme = build_scheme(cfg.model_for(s))
                for kind in own.rope_scaling:
                    if kind not in scheme.eval_variants:
                        notes.append(f"eval.perplexity.rope_scaling {kind}: no {s}+{kind} rows, {scheme.lacks(kind)}")
        if "sliding" in own.protocol:  # stride 1 is exact and slow: say how slow first
            n = len(eval_tokens(corpus, cfg, cfg.eval.lengths)) - 1
            count = sum(len(windows(n, L, "sliding", own.stride)) for L in cfg.eval.lengths)
            chunks = sum(len(windows(n, L, "nonoverlapping", None)) for L in cfg.eval.lengths)
            notes.append(
                f"sliding evaluation, stride {own.stride}: {count:,} windows per run over all lengths, "
                f"about {count / chunks:.0f}x the forward passes of non-overlapping evaluation"
            )
        return notes

    def score(self, rc, rdir: Path, model, corpus, device, backend: str, reporter=None) -> None:
        from posbench.evaluate import eval_tokens
        from posbench.experiment.checkpoint import weights_mark

        n_tokens = len(eval_tokens(corpus, rc, rc.eval.lengths)) - 1  # the same for every run
        factor = rc.eval.perplexity.rope_factor
        weights = weights_mark(model)  # once: every block's rows name the same weights
        for (variant, protocol), lengths in unevaluated(rc, rdir, model, n_tokens, device, weights).items():
            evaluate_into(rc, rdir, model, corpus, lengths, [variant], factor, [protocol], reporter, weights)

    def rescore(self, cfg, rdir: Path, model, corpus, device) -> list[dict]:
        """Plain and each of eval.perplexity.rope_scaling's variants (a variant row reads against the plain
        one), at eval.lengths (the training length, every ratio's base, among them)."""
        own = cfg.eval.perplexity
        return evaluate_into(
            cfg, rdir, model, corpus, cfg.eval.lengths, [None, *own.rope_scaling], own.rope_factor, own.protocol
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

    def check_beside(self, rdir: Path) -> None:
        from posbench.measures.perplexity.records import read_positions

        read_positions(rdir)  # the report's positions plot; windows.csv it reads for pretrained models alone

    def asked(self, rows: list[dict], cfg) -> list[dict]:
        from posbench.schemes import label_variant

        lengths = set(cfg.eval.lengths)
        own = cfg.eval.perplexity
        protocols = {(p, str(own.stride) if p == "sliding" else "") for p in own.protocol}
        variants = {None, *own.rope_scaling}
        return [
            r
            for r in rows
            if int(r["length"]) in lengths
            and (r["protocol"], str(r["stride"])) in protocols
            and label_variant(r["scheme"])[1] in variants
        ]

    def report(self, collected, metric: str, transpose: bool, buckets) -> dict:
        if buckets is not None:
            raise PosbenchError("--buckets applies to the runs of a task, not to perplexity (task lm)")
        return report(collected, metric or "ppl", transpose)

    def join_checks(self, rows: list[dict]) -> list[tuple[str, set]]:
        return join_checks(rows)
