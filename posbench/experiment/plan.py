"""Planning: which runs an experiment or a sweep holds, where each lives, and what each still needs.

Nothing here writes. A folder that holds another config's run is an error, never overwritten;
two runs are the same run when their identities (config.identity, as their task reads it)
are equal.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from posbench.config import ExperimentConfig, config_from_dict, differences, identity, read_record, shared_identity
from posbench.errors import PosbenchError
from posbench.experiment.records import (
    CONFIG,
    SWEEP_RECORD,
    diverged_step,
    has_checkpoint,
    lock_file,
    partial_dir,
    read_config,
    run_name,
    run_state,
)
from posbench.files import lock_holder, safe_name
from posbench.measures import Measure
from posbench.resolve import Experiment
from posbench.tasks import TrainingTask


@dataclass
class Job:
    """One planned run: its resolved config, the task it learns, the measure it is scored by,
    its folder, and what it needs."""

    cfg: ExperimentConfig
    task: TrainingTask
    measure: Measure
    folder: Path
    # "todo", "done" (trained), "diverged" (its loss blew up in an earlier attempt), "copy" (extend's parents)
    state: str
    point: Optional[ExperimentConfig] = None  # the sweep grid point it belongs to, if any
    # its experiment's runs differ only in scheme and seed: checked again as it starts to train,
    # against what other processes began or finished there since it was planned
    alike: bool = False
    parent: Optional[Path] = None  # posbench extend: the run it copies or is fine-tuned from
    curve: Optional[list] = None  # posbench extend: the steps its perplexity at L2 is scored after


def run_identity(rc: ExperimentConfig, task: TrainingTask) -> dict:
    """What decides a run's weights."""
    return task.identity(identity(rc))


def run_digest(rc: ExperimentConfig, task: TrainingTask) -> str:
    """A hash of everything that decides a run's weights."""
    return hashlib.sha256(json.dumps(run_identity(rc, task), sort_keys=True).encode()).hexdigest()[:8]


def plan_runs(exp: Experiment) -> list[Job]:
    """A job for every (scheme, seed), checked before anything is written, seed by seed: every
    scheme at the first seed before any at the second, so a study stopped early (a time limit,
    a machine handed back) has a comparison at the seeds it finished."""
    cfg = exp.cfg
    folder = Path(cfg.out_dir) / cfg.name
    check_same_experiment(exp.cfg, exp.task, folder, frozenset(run_name(s, n) for s in cfg.schemes for n in cfg.seeds))
    jobs = []
    for n in cfg.seeds:
        for s in cfg.schemes:
            rc = cfg.for_run(s, n)
            rdir = folder / run_name(s, n)
            jobs.append(Job(rc, exp.task, exp.measure, rdir, plan_state(rc, exp.task, rdir), alike=True))
    return jobs


def plan_state(rc: ExperimentConfig, task: TrainingTask, rdir: Path, elsewhere: str = "--set name=NEW") -> str:
    """ "todo", "done" or "diverged" for the run `rc` in `rdir`; an error if the folder holds
    another config's run or something that is not a run. The records of this very run without
    its weights (a committed reference: config.yaml, eval.csv, no model.pt) are trained again."""
    run = run_state(rdir)  # its lock is not read: a look at it could turn away the process taking it
    if not (run.trained or run.diverged):
        if not rdir.exists() or not any(rdir.iterdir()):
            _check_unfinished(rc, task, rdir, elsewhere)
            return "todo"
        if not (rdir / CONFIG).is_file():
            raise PosbenchError(f"{rdir} exists but holds no finished run; delete it to retrain")
    try:  # the record, or the checkpoint's own copy when config.yaml was lost
        if (rdir / CONFIG).is_file():
            old = read_config(rdir)
        else:
            from posbench.experiment.checkpoint import load_run

            old = load_run(rdir)[0]
    except PosbenchError as e:
        raise PosbenchError(f"{e}; delete {rdir} to retrain it") from None
    ours, theirs = run_identity(old, task), run_identity(rc, task)
    if ours != theirs:
        diff = differences(ours, theirs, (rdir.name, "here"))
        raise PosbenchError(
            f"{rdir} was trained under a different config ({', '.join(diff)}); "
            f"choose another experiment folder with {elsewhere}, or delete that folder"
        )
    if run.trained:
        return "done"
    return "diverged" if run.diverged else "todo"


def partial_identity(rdir: Path, task: TrainingTask) -> Optional[dict]:
    """The identity an unfinished run's config.yaml records (None if it has none or it cannot be read)."""
    record = partial_dir(rdir) / CONFIG
    try:
        return run_identity(config_from_dict(read_record(record)), task) if record.is_file() else None
    except PosbenchError:
        return None


def _check_unfinished(rc: ExperimentConfig, task: TrainingTask, rdir: Path, elsewhere: str) -> None:
    """An unfinished run's checkpoints are kept: one trained under other settings is refused,
    not started anew over them (a partial folder with no checkpoint, or whose config cannot be
    read, holds nothing to resume, and training replaces it)."""
    if not has_checkpoint(partial_dir(rdir)):
        return  # nothing to resume: training begins it anew
    ours, theirs = partial_identity(rdir, task), run_identity(rc, task)
    if ours is not None and ours != theirs:
        diff = differences(ours, theirs, (f"its unfinished {rdir.name}", "here"))
        raise PosbenchError(
            f"{rdir.name} was begun under other settings ({', '.join(diff)}) and its checkpoints wait in "
            f"{partial_dir(rdir)}: rerun with its settings to resume it, choose another folder with {elsewhere}, "
            f"or delete that folder to start it anew"
        )


def check_same_experiment(rc: ExperimentConfig, task: TrainingTask, folder: Path, mine: frozenset = frozenset()):
    """An experiment's runs differ in scheme and seed only; a run trained at another length or
    size would be averaged with them as if it were another seed. Its finished runs are read, and
    its unfinished ones that hold a checkpoint or are training now (another process, started
    with other settings into the same new folder), but for the runs named in `mine`, each of which
    its own check meets (plan_state; train_run starts one anew where nothing can resume)."""
    new = shared_identity(run_identity(rc, task))
    records = [(f.parent.name, f, "trained") for f in sorted(folder.glob(f"*/{CONFIG}")) if f.parent.name[0] != "."]
    for f in sorted(folder.glob(f".*.partial/{CONFIG}")):
        name = f.parent.name[1 : -len(".partial")]
        if name not in mine and (has_checkpoint(f.parent) or lock_holder(lock_file(folder / name)) is not None):
            records.append((name, f, "begun"))
    for name, cfg_file, how in records:
        try:
            old = shared_identity(run_identity(config_from_dict(read_record(cfg_file)), task))
        except PosbenchError:
            continue  # a damaged run folder is reported when it is planned
        if old != new:
            diff = differences(old, new, names=(name, "here"))
            raise PosbenchError(
                f"{folder} holds runs {how} under other settings ({', '.join(diff)}); "
                f"its runs must differ only in scheme and seed: choose another name with --set name=NEW"
            )


def sweep_run_name(rc: ExperimentConfig, task: TrainingTask, settings: dict) -> str:
    """'alibi-seed0-train_len64-3f9c2a1e': readable, then a hash of everything that decides
    the weights, so a folder is one config and a changed setting is a new folder."""
    readable = [
        f"{safe_name(k.split('.')[-1])}{safe_name(str(v))}"
        for k, v in settings.items()
        if k not in ("schemes", "seeds", "model.scheme")
    ]
    return "-".join([run_name(rc.schemes[0], rc.seeds[0]), *readable, run_digest(rc, task)])


def plan_sweep(grid: list[tuple[dict, Experiment]]) -> tuple[Path, list[Job]]:
    """The experiment folder of a sweep's resolved grid and its jobs, each with its grid
    point. Nothing is written; two points that would train one run are an error."""
    first = grid[0][1].cfg
    folder = Path(first.out_dir) / first.name
    if len({type(exp.measure) for _, exp in grid}) > 1:  # perplexity and exact match share no table
        raise PosbenchError(
            "sweep: task mixes lm with the tasks, which one report cannot compare; sweep lm apart from the tasks"
        )
    runs = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name[0] != ".") if folder.is_dir() else []
    if runs and not (folder / SWEEP_RECORD).is_file():  # its runs were made to differ in scheme and seed only
        more = f" and {len(runs) - 1} more" if len(runs) > 1 else ""
        raise PosbenchError(
            f"{folder} holds an experiment that is not a sweep ({runs[0]}{more}, no {SWEEP_RECORD}); "
            f"sweep into another folder with --set name=NEW"
        )
    jobs, seen = [], {}
    for settings, exp in grid:
        cfg = exp.cfg
        if (cfg.out_dir, cfg.name) != (first.out_dir, first.name):
            named = "; each task names its own folder unless the config sets name" if cfg.task != first.task else ""
            raise PosbenchError(
                f"sweep: its points would write to {folder} and {Path(cfg.out_dir) / cfg.name}, but name "
                f"and out_dir make the one experiment folder and cannot be swept{named}"
            )
        for n in cfg.seeds:  # seed by seed, as plan_runs
            for s in cfg.schemes:
                rc = cfg.for_run(s, n)
                digest = run_digest(rc, exp.task)  # the readable part of two names may differ
                rdir = folder / sweep_run_name(rc, exp.task, settings)
                rdir = rdir if rdir.exists() else _named_before(folder, rc, digest) or rdir
                where = ", ".join(f"{k}={v}" for k, v in settings.items())
                same = seen.get(digest)
                if same is not None and same[0] != where:
                    raise PosbenchError(
                        f"sweep points {same[0]} and {where} train the same run {same[1].name}: they differ "
                        f"only in how runs are scored or run, which a sweep does not vary"
                    )
                if same is None:
                    seen[digest] = where, rdir
                    jobs.append(Job(rc, exp.task, exp.measure, rdir, plan_state(rc, exp.task, rdir), point=cfg))
    return folder, jobs


def _named_before(folder: Path, rc: ExperimentConfig, digest: str) -> Optional[Path]:
    """The run folder of this very run (its hash) that an earlier sweep into `folder` named by
    other keys (its grid listed train_len, this one does not), finished or still partial:
    reused or resumed, not trained twice."""
    prefix, suffix = f"{run_name(rc.schemes[0], rc.seeds[0])}-", f"-{digest}"
    named = [p.name for p in folder.glob(f"{prefix}*{digest}") if p.is_dir() and p.name.endswith(suffix)]
    named += [p.name[1 : -len(".partial")] for p in folder.glob(f".{prefix}*{digest}.partial") if p.is_dir()]
    return folder / min(named) if named else None


# runs to train past which a sweep says, before it starts, what it will train: a run at the
# defaults takes minutes on a CPU (the README's 4 min of CPU time), so a thousand take days. A
# smaller sweep's progress ("3 of 8") says enough; a grid holds at most MAX_SWEEP_POINTS points
LARGE_SWEEP = 1000


def sweep_size(grid: list[tuple[dict, Experiment]], jobs: list[Job]) -> Optional[str]:
    """One line on a sweep of more than LARGE_SWEEP runs to train: how many (the grid's shape),
    what they train in all, and how to stop and resume it; None for a smaller one."""
    todo = [job for job in jobs if job.state == "todo"]
    if len(todo) <= LARGE_SWEEP:
        return None
    settings = grid[0][0]
    shape = {key: len({repr(point[key]) for point, _ in grid}) for key in settings}
    first = grid[0][1].cfg
    shape |= {key: len(getattr(first, key)) for key in ("schemes", "seeds") if key not in shape}
    sizes = " x ".join(f"{n:,} {key.removesuffix('s') if n == 1 and key in ('schemes', 'seeds') else key}"
                       for key, n in shape.items())  # fmt: skip
    if math.prod(shape.values()) != len(jobs):  # points that share a run
        sizes = f"{len(grid):,} grid points"
    done = f"; {len(jobs) - len(todo):,} of its {len(jobs):,} are done" if len(todo) < len(jobs) else ""
    work: dict[str, int] = {}
    for job in todo:
        per_step, unit = job.task.throughput(job.cfg)
        work[unit.removesuffix("_per_s")] = work.get(unit.removesuffix("_per_s"), 0) + per_step * job.cfg.train.steps
    total = " and ".join(f"{n:,} {unit}" for unit, n in work.items())
    return (
        f"this sweep trains {len(todo):,} runs ({sizes}{done}), {total} in all; Ctrl-C stops it, keeping "
        f"finished runs and checkpoints, and the same command resumes it"
    )


def plan_note(job: Job) -> str:
    """What a run would do now: train, resume at step N, or be skipped, and why."""
    holder = run_state(job.folder).holder
    if holder is not None:
        return f"skip: another process (pid {holder or '?'}) holds it"
    if job.state == "done":
        return "skip: trained (score what it lacks)"
    if job.state == "diverged":
        return f"skip: diverged {diverged_step(job.folder)}"
    from posbench.experiment.status import checkpoint_step

    step = checkpoint_step(partial_dir(job.folder))
    return "train" if step is None else f"resume at step {step:,}"
