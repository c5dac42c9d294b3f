"""The one step from a validated config to a resolved experiment: its task, measure and schemes built once.

A config as loaded holds what the user gave; `resolve` decides everything else, once: the
task (train_len, the training budget, the vocabulary), the measure (the evaluation lengths),
and every scheme's options filled with its defaults, so that a run's record names every
choice its weights were made under (an option in `PositionalScheme.added_later` is named only
once it is off its default, so records that do not name it keep their identity).
An error names the file or flag its value came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from posbench.config import ExperimentConfig, assign, blame, config_from_dict, names_key
from posbench.errors import PosbenchError, did_you_mean
from posbench.measures import Measure
from posbench.schemes import SCHEMES, SEED_SCHEMES, build_scheme
from posbench.tasks import TrainingTask, task_for


@dataclass
class Experiment:
    """A resolved config, the task its runs learn and the measure they are scored by."""

    cfg: ExperimentConfig
    task: TrainingTask
    measure: Measure


def resolve(cfg: ExperimentConfig, test_len: Optional[int] = None) -> Experiment:
    """Resolve `cfg` in place and return it with its task and measure. `test_len` (extrapolate's
    --test-len) asks for the lengths from train_len to it, once train_len is decided."""
    return _resolved(cfg, test_len, scored=True)


def resolve_training(cfg: ExperimentConfig) -> Experiment:
    """Resolve what `cfg` trains, in place: its task (train_len, budget, vocabulary) and its
    schemes; not how it is scored (eval.*), which `posbench bench` does at lengths of its own."""
    return _resolved(cfg, None, scored=False)


def _resolved(cfg: ExperimentConfig, test_len: Optional[int], scored: bool) -> Experiment:
    if cfg.schemes is None:
        cfg.schemes = list(SEED_SCHEMES)
    try:
        task = task_for(cfg)
        task.decide(cfg)  # a task's recipe may set lr and min_lr: compared once both are decided
        if cfg.train.min_lr > cfg.train.lr:
            lr_alone = "train.lr" in cfg.origins and "train.min_lr" not in cfg.origins
            fix = "set train.min_lr too (lr / 10 is usual)" if lr_alone else "lower train.min_lr or raise train.lr"
            raise PosbenchError(
                f"train.min_lr={cfg.train.min_lr:g} is above train.lr={cfg.train.lr:g}, so the cosine would rise to "
                f"it; {fix}",
                "train.lr" if lr_alone else "train.min_lr",
            )
        measure = task.measure()
        if scored:
            measure.decide(cfg, test_len)
            if cfg.eval.measures:  # a bad name or option fails before anything trains
                from posbench.measures.plugin import load_measures

                try:
                    load_measures(cfg.eval.measures, cfg.eval.measure_options, "eval.measure_options")
                except PosbenchError as e:  # an option's error names its key; the rest are the measures'
                    raise PosbenchError(str(e), e.key or "eval.measures", e.exit_code) from None
        _resolve_schemes(cfg)
    except PosbenchError as e:
        raise blame(cfg, e, cfg.source) from None
    return Experiment(cfg, task, measure)


def resolve_sweep(grid: list[tuple[dict, ExperimentConfig]], path) -> list[tuple[dict, Experiment]]:
    """Each point of a sweep's grid (config.load_sweep) resolved; a point that cannot run is
    named by its settings, so a value that only fails beside another is found."""
    resolved = []
    for settings, cfg in grid:
        try:
            resolved.append((settings, resolve(cfg)))
        except PosbenchError as e:
            text, own = str(e), f"{path}: "
            point = ", ".join(f"{k}={v!r}" for k, v in settings.items())
            raise PosbenchError(f"{path}: sweep point {point}: {text.removeprefix(own)}", e.key) from None
    return resolved


def resolve_scoring(rc: ExperimentConfig, asked: dict[str, tuple[str, Any]]) -> Experiment:
    """A trained run's config as a command asks it scored again (`posbench evaluate`): `asked`
    maps eval.* keys to (the flag as given, its value); the run's measure decides the rest once,
    as resolve does (the training length always scored, sliding's default stride), and refuses
    what does not apply to it. An error names the flag. The run's own record is not changed."""
    origins = {key: flag for key, (flag, _) in asked.items()}
    try:
        raw = rc.to_dict()
        for key, (_, value) in asked.items():
            assign(raw, key, value)
        cfg = config_from_dict(raw)
        cfg.origins = origins
        task = task_for(cfg)
        measure = task.measure()
        measure.decide(cfg, None)
    except PosbenchError as e:
        raise blame(origins, e) from None
    return Experiment(cfg, task, measure)


def _resolve_schemes(cfg: ExperimentConfig) -> None:
    """Every scheme builds with its options (bad options fail before anything trains), and
    every eval.perplexity.rope_scaling kind belongs to some scheme and is refused by none run here
    (a training-free one, which every scheme declares, adds no rows for a scheme that refuses it)."""
    from posbench.schemes.training_free import VARIANTS as TRAINING_FREE
    from posbench.schemes.training_free import remap

    for s in cfg.schemes:
        try:
            build_scheme(cfg.model_for(s))
        except PosbenchError as e:  # blamed on a key it names (an option, d_model), else on who named the scheme
            text = str(e)
            named = "scheme_options." in text or any(names_key(text, k) for k in cfg.origins or {} if k != "schemes")
            raise PosbenchError(text, e.key or (None if named else "schemes")) from None
        cls = SCHEMES.lookup(s)
        cls.validate_options(cfg.scheme_options.get(s, {}), where=f"scheme_options.{s}")  # base: 1e6 as a number
        filled = {**cls.options, **cfg.scheme_options.get(s, {})}
        # all of them, so that a run's record names every option, but those added later at their default
        cfg.scheme_options[s] = {k: v for k, v in filled.items() if k not in cls.added_later or v != cls.options[k]}
    for s, opts in cfg.scheme_options.items():  # options of unselected schemes are kept, checked
        if s not in cfg.schemes:
            try:
                SCHEMES.lookup(s).validate_options(opts, where=f"scheme_options.{s}")
            except PosbenchError as e:
                raise PosbenchError(str(e), e.key or f"scheme_options.{s}") from None
    known = {v for c in [*SCHEMES.values(), *map(SCHEMES.lookup, cfg.schemes)] for v in c.eval_variants}
    for kind in cfg.eval.perplexity.rope_scaling:
        if kind not in known:
            raise PosbenchError(
                f"eval.perplexity.rope_scaling: unknown kind '{kind}'{did_you_mean(kind, sorted(known))}; "
                f"valid: {', '.join(sorted(known))}",
                "eval.perplexity.rope_scaling",
            )
        if kind in TRAINING_FREE and cfg.eval.perplexity.rope_factor is not None:  # before anything trains
            try:
                remap(kind, cfg.model.train_len, cfg.model.train_len, cfg.eval.perplexity.rope_factor)
            except PosbenchError as e:
                raise PosbenchError(f"eval.perplexity.rope_factor: {e}", "eval.perplexity.rope_factor") from None
        for c in map(SCHEMES.lookup, cfg.schemes):  # a training-free variant skips the schemes it cannot apply to
            if kind in c.eval_variants and c.refuses(kind) and kind not in TRAINING_FREE:
                raise PosbenchError(f"eval.perplexity.rope_scaling: {c.refuses(kind)}", "eval.perplexity.rope_scaling")
