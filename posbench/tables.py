"""Which settings tell a report's grid points apart."""

from __future__ import annotations

from posbench.config import flat


def point_labels(parts: dict) -> dict:
    """Run folder -> 'model.train_len=64, train.lr=0.001': the settings in which its training
    differs from other runs' (all '' when they share them all). Where the task differs, what
    each task derives is left out: its train_len and the options it left at the task's default."""
    from posbench.tasks import task_derived

    flats = {rdir: flat(part) for rdir, part in parts.items()}
    keys = sorted({k for f in flats.values() for k in f})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flats.values()}) > 1]
    if "task" in varying:
        varying = [k for k in varying if not all(task_derived(f, k) for f in flats.values())]
    return {rdir: ", ".join(f"{k}={f[k] if k in f else _default(k)}" for k in varying) for rdir, f in flats.items()}


def options_apart(points: dict, runs: list) -> dict:
    """`points` (run folder -> its grid point), where runs of one scheme and seed that share a
    point differ in their scheme's options (a sweep of scheme_options.rope.base): those options
    join the point's label, as a swept setting that every scheme shares does. The runs' identity
    leaves scheme options out, as each scheme has its own."""
    from posbench.schemes import run_label

    groups: dict = {}
    for run in runs:
        groups.setdefault((run_label(run.cfg.model), run.cfg.seeds[0], points[run.folder]), []).append(run)
    out = dict(points)
    for (_, _, point), same in groups.items():
        options = [run.cfg.model.options for run in same]
        varying = sorted(k for k in set().union(*options) if len({repr(o.get(k)) for o in options}) > 1)
        for run in same if varying else ():
            said = [f"scheme_options.{run.cfg.model.scheme}.{k}={run.cfg.model.options.get(k)}" for k in varying]
            out[run.folder] = ", ".join([point, *said] if point else said)
    return out


def _default(key: str):
    """A setting a run's identity leaves out while it is at its default, and that default
    (data.tokenizer: bytes)."""
    import dataclasses

    from posbench.config import ExperimentConfig

    value = ExperimentConfig()
    for part in key.split("."):
        if not dataclasses.is_dataclass(value):  # inside a dict (task_options): no default of its own
            return None
        value = getattr(value, part, None)
    return None if dataclasses.is_dataclass(value) else value
