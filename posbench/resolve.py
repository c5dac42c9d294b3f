"""The one step from a validated config to a resolved experiment: the measure and schemes built once.

A config as loaded holds what the user gave; `resolve` decides everything else, once: the
measure (and with it the task), train_len, the training budget and the evaluation lengths,
and every scheme's options filled with its defaults, so that a run's record names every
choice its weights were made under. An error names the file or flag its value came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from posbench.config import ExperimentConfig, blame
from posbench.errors import PosbenchError, did_you_mean
from posbench.measures import Measure, measure_for
from posbench.schemes import SCHEMES, SEED_SCHEMES, build_scheme


@dataclass
class Experiment:
    """A resolved config and the measure its runs are trained for and scored by."""

    cfg: ExperimentConfig
    measure: Measure


def resolve(cfg: ExperimentConfig, test_len: Optional[int] = None) -> Experiment:
    """Resolve `cfg` in place and return it with its measure. `test_len` (extrapolate's
    --test-len) asks for the lengths from train_len to it, once train_len is decided."""
    if cfg.schemes is None:
        cfg.schemes = list(SEED_SCHEMES)
    try:
        measure = measure_for(cfg)
        measure.decide(cfg, test_len)
        _resolve_vocab(cfg, measure)
        _resolve_schemes(cfg)
    except PosbenchError as e:
        raise blame(cfg, e, cfg.source) from None
    return Experiment(cfg, measure)


def _resolve_vocab(cfg: ExperimentConfig, measure: Measure) -> None:
    """model.vocab_size follows data.tokenizer: at least the 256 bytes, or the tokenizer's size
    (read from its file, or data.vocab_size for a BPE still to train)."""
    from posbench.text import BYTE_ALPHABET, is_prepared, tokenizer_kind, vocab_of

    if not measure.reads_corpus and cfg.data.tokenizer != "bytes":  # its runs read their own bytes
        raise PosbenchError(f"data.tokenizer {cfg.data.tokenizer}: a task is written in bytes", "data.tokenizer")
    tokens = measure.reads_corpus and (tokenizer_kind(cfg.data.tokenizer) != "bytes" or is_prepared(cfg.data.path))
    if not tokens:
        if cfg.model.vocab_size < BYTE_ALPHABET:
            raise PosbenchError(
                f"model.vocab_size={cfg.model.vocab_size}: the corpus is bytes, so it must be >= 256",
                "model.vocab_size",
            )
        return
    if is_prepared(cfg.data.path):  # its tokens were made by one tokenizer: the config takes it
        from posbench.text import read_prepared_meta

        meta = read_prepared_meta(cfg.data.path)
        given = cfg.origins.get("data.tokenizer") and (cfg.data.tokenizer, cfg.data.vocab_size)
        if given and given != (meta["spec"], meta["bpe_vocab_size"]):
            raise PosbenchError(
                f"data.path {cfg.data.path} holds tokens of {meta['tokenizer']}, not of data.tokenizer "
                f"{cfg.data.tokenizer}; leave data.tokenizer unset to use its own",
                "data.tokenizer",
            )
        cfg.data.tokenizer, cfg.data.vocab_size = meta["spec"], meta["bpe_vocab_size"]
    vocab = vocab_of(cfg.data)
    if "model.vocab_size" in cfg.origins and cfg.model.vocab_size != vocab:
        raise PosbenchError(
            f"model.vocab_size={cfg.model.vocab_size}, but data.tokenizer {cfg.data.tokenizer} has {vocab} tokens; "
            f"leave model.vocab_size unset: it follows the tokenizer",
            "model.vocab_size",
        )
    cfg.model.vocab_size = vocab


def _resolve_schemes(cfg: ExperimentConfig) -> None:
    """Every scheme builds with its options (bad options fail before anything trains), and
    every eval.rope_scaling kind belongs to some scheme."""
    for s in cfg.schemes:
        build_scheme(cfg.model_for(s))
        cfg.scheme_options[s] = {**SCHEMES.lookup(s).options, **cfg.scheme_options.get(s, {})}
    for s, opts in cfg.scheme_options.items():  # options of unselected schemes are kept, checked
        if s not in cfg.schemes:
            SCHEMES.lookup(s).validate_options(opts, where=f"scheme_options.{s}")
    known = {v for c in [*SCHEMES.values(), *map(SCHEMES.lookup, cfg.schemes)] for v in c.eval_variants}
    for kind in cfg.eval.rope_scaling:
        if kind not in known:
            raise PosbenchError(
                f"eval.rope_scaling: unknown kind '{kind}'{did_you_mean(kind, sorted(known))}; "
                f"valid: {', '.join(sorted(known))}",
                "eval.rope_scaling",
            )
