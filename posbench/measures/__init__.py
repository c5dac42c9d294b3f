"""What a run is scored by: the Measure interface, its metrics, and the measure a config asks for.

A measure is the one place that knows how a run of its kind is trained (its training length,
budget and batches), scored (into the run's records), read back and tabled. Everything else
(resolving, planning, executing, reporting) asks the measure and never which kind it is.
Reading records and building tables import no torch; training and scoring do, when called.
"""

from __future__ import annotations

from posbench.measures.base import Measure, Metric, Scorer, ScoringRun, Section

__all__ = ["Measure", "Metric", "Scorer", "ScoringRun", "Section", "measure_for"]


def measure_for(cfg) -> Measure:
    """The measure a config asks for: perplexity for task lm, else exact match of that task."""
    from posbench.tasks import LM

    if cfg.task == LM:
        from posbench.measures.perplexity import Perplexity

        return Perplexity()
    from posbench.measures.exact_match import ExactMatch
    from posbench.tasks import build_task

    return ExactMatch(build_task(cfg.task, cfg.task_options))
