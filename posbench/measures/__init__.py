"""How a model is judged: the Measure interface, its metrics, and the measure a config's runs are scored by.

A measure is the one place that knows how a run is scored (into the run's records), read back
and tabled; what a run learned from is its task's (posbench/tasks/). Everything else (resolving,
planning, executing, reporting) asks the task and the measure and never which kind they are.
Reading records and building tables import no torch; scoring does, when called.
"""

from __future__ import annotations

from posbench.measures.base import Measure, Metric, Scorer, ScoringRun, Section

__all__ = ["Measure", "Metric", "Scorer", "ScoringRun", "Section", "measure_for"]


def measure_for(cfg) -> Measure:
    """The measure a config's runs are scored by: its task's (perplexity for task lm, exact match
    of a synthetic task)."""
    from posbench.tasks import task_for

    return task_for(cfg).measure()
