"""Execution: train what an experiment or a sweep lacks, score it with its measure, write its records.

Every run holds its lock while it trains and is scored. It trains in its hidden partial folder,
resuming from a checkpoint there, and is renamed into place once config, log and weights
exist. Nothing here asks which task or measure a run has: its task makes its batches, its measure
scores it.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from posbench.attention import FLEX_CANNOT_TRAIN_ON_CPU, backend_for
from posbench.config import ExperimentConfig, check_device, check_trainable, dump_yaml
from posbench.device import pick_device
from posbench.errors import PosbenchError, first_line
from posbench.experiment.checkpoint import load_run, save_checkpoint
from posbench.experiment.plan import (
    Job,
    check_same_experiment,
    partial_identity,
    plan_runs,
    plan_state,
    plan_sweep,
    run_identity,
    sweep_size,
)
from posbench.experiment.records import (
    CHECKPOINT,
    CLAIMING,
    CONFIG,
    DIVERGED,
    FAILED,
    PLANNED,
    PREVIOUS,
    SCORING,
    SWEEP_RECORD,
    WEIGHTS,
    check_read,
    check_same_read,
    diverged_step,
    has_checkpoint,
    lock_file,
    partial_dir,
    planned,
    record_read,
    run_name,
    scoring,
)
from posbench.files import STAGE_PREFIX, TMP_PREFIX, exclusive, lock_holder, room_in, waiting_for, write_atomic
from posbench.measures import Measure, Scorer, ScoringRun
from posbench.model import TransformerLM
from posbench.progress import Marked, Reporter
from posbench.registry import named_by
from posbench.resolve import Experiment, resolve_scoring
from posbench.tasks import task_for
from posbench.trackers import check_tracker, send_run, usable
from posbench.workers import run_in_workers, worker_plan


def run_experiment(exp: Experiment, reporter: Reporter) -> Path:
    """Train what is missing, score everything its measure asks; returns the experiment folder."""
    jobs = plan_runs(exp)
    folder = Path(exp.cfg.out_dir) / exp.cfg.name
    sources = prepare(exp, jobs, reporter)
    run_jobs(exp.cfg, jobs, folder, reporter, sources)
    return folder


def sweep_jobs(grid: list[tuple[dict, Experiment]], reporter: Reporter) -> tuple[Path, list[Job], dict]:
    """A sweep's experiment folder (not made yet), its jobs and the data they read, each grid
    point checked before any runs."""
    folder, jobs = plan_sweep(grid)
    size = sweep_size(grid, jobs)
    if size is not None:  # thousands of runs: said before the first one starts
        reporter.note(size)
    sources = {}
    for _, exp in grid:
        mine = [job for job in jobs if job.point is exp.cfg]
        if mine:
            sources.update(prepare(exp, mine, reporter))
    return folder, jobs, sources


def begin_sweep(folder: Path, source: str, jobs: list[Job], sources: dict) -> None:
    """A sweep's experiment folder, made, with `source` (the config file's text) kept there as
    sweep.yaml and its runs named in runs.txt, once its runs' data is checked (check_reads)."""
    check_reads(jobs, sources)
    folder.mkdir(parents=True, exist_ok=True)
    keep_earlier_grid(folder, source)
    write_atomic(folder / SWEEP_RECORD, source)
    record_planned(folder, jobs)


def record_planned(folder: Path, jobs: list[Job]) -> None:
    """runs.txt: the runs the folder was asked to hold, by this command and every one before it."""
    runs = dict.fromkeys([*planned(folder), *(job.folder.name for job in jobs)])
    write_atomic(folder / PLANNED, "".join(f"{name}\n" for name in runs))


def keep_earlier_grid(folder: Path, source: str) -> None:
    """sweep.yaml is the latest grid; an earlier one that differs is kept beside it, oldest first
    (sweep.1.yaml, sweep.2.yaml, ...), since its runs stay in the folder (one that never got to
    train a run is only replaced)."""
    record = folder / SWEEP_RECORD
    if not record.is_file() or record.read_text() == source:
        return
    if not any(p.is_dir() and not p.name.startswith(STAGE_PREFIX) for p in folder.iterdir()):  # nor a run begun
        return
    n = 1
    while (folder / f"{record.stem}.{n}{record.suffix}").exists():
        n += 1
    record.rename(folder / f"{record.stem}.{n}{record.suffix}")


def run_sweep(grid: list[tuple[dict, Experiment]], source: str, reporter: Reporter) -> Path:
    """Train and score what a sweep's grid still lacks, in one experiment folder. Returns it."""
    folder, jobs, sources = sweep_jobs(grid, reporter)
    begin_sweep(folder, source, jobs, sources)
    run_jobs(grid[0][1].cfg, jobs, folder, reporter, sources)
    return folder


def run_extension(plan, reporter: Reporter, tracker: Optional[str]) -> None:
    """posbench extend's plan (posbench.extend.run.Plan): its parents copied and its children
    fine-tuned and scored into its folder, as any experiment's runs are: refused first where its
    children cannot train here, the parents' data read once and checked against what each parent
    read, and each finished run sent to `tracker`."""
    from posbench.extend.run import write_record

    first = plan.jobs[0]
    child = next((job for job in plan.jobs if job.state == "todo" and job.cfg.model.extend), first)
    # not prepare(): it would refuse the parents' tracker where its library is missing, and
    # extend sends runs to it only where it is installed
    check_runnable(child.cfg, plan.jobs)
    data = first.task.source(first.cfg, reporter)
    for note in [*plan.notes, *child.task.notes(child.cfg, data), *child.measure.notes(child.cfg, data)]:
        reporter.note(note)
    sources = {first.task.source_key(first.cfg): data}
    check_reads(plan.jobs, sources)  # a parent read other data: before the folder is made
    write_record(plan)
    run_jobs(child.cfg, plan.jobs, plan.folder, reporter, sources, tracker)  # workers sized by a run that trains


def prepare(exp: Experiment, jobs: list[Job], reporter: Reporter) -> dict:
    """Refuse before anything trains what cannot run here, say what will be slow, and return
    the data the runs read (by its key), read once: a missing corpus fails here."""
    cfg = exp.cfg
    check_tracker(cfg.train.tracker)  # a missing library fails here, before anything trains
    check_runnable(cfg, jobs)
    data = exp.task.source(cfg, reporter)
    for note in [*exp.task.notes(cfg, data), *exp.measure.notes(cfg, data)]:
        reporter.note(note)
    return {exp.task.source_key(cfg): data}


def check_runnable(cfg: ExperimentConfig, jobs: list[Job]) -> None:
    """Refuse, before anything trains, a run too large for this machine's memory or an attention
    backend that cannot train here (auto is never flex on a CPU, so the scheme's table does not
    matter here)."""
    device = pick_device(cfg.train.device)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for job in jobs:
        if job.state == "todo":
            check_trainable(job.cfg.model, gpu, batch=job.cfg.train.batch_size)  # refused, not allocated
    backend = backend_for(cfg.model.attention, device, cfg.model.head_dim, cfg.train.compile)
    if backend == "flex" and device.type == "cpu" and any(job.state == "todo" for job in jobs):
        raise PosbenchError(FLEX_CANNOT_TRAIN_ON_CPU)


def run_jobs(
    cfg: ExperimentConfig,
    jobs: list[Job],
    folder: Path,
    reporter: Reporter,
    sources: dict,
    tracker: Optional[str] = None,
) -> None:
    """Run the jobs into `folder`, in this process or in cfg.train.workers processes (each reads
    its data itself), and send each finished run to `tracker` (None: cfg.train.tracker) from
    here. An experiment folder made here and left with nothing in it but lock files is removed
    on failure."""
    check_reads(jobs, sources)
    to_train = sum(job.state == "todo" for job in jobs)
    reporter.plan(to_train)  # each run's progress says "3 of 8"
    workers, threads = worker_plan(cfg, to_train, reporter.note)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    record_planned(folder, jobs)
    try:
        tracker = usable(tracker or cfg.train.tracker)  # prepare() refused a missing one it was asked for
        if workers > 1:
            labelled = [(job.folder.name, (job,)) for job in jobs]
            sent = lambda i: send_run(tracker, folder, jobs[i].folder)
            run_in_workers(run_job, labelled, lambda: _remove_temporaries(jobs), reporter, workers, threads, sent)
        else:
            if threads:
                torch.set_num_threads(threads)
            for job in jobs:
                run_one(job, source_of(job, sources), reporter)
                send_run(tracker, folder, job.folder)
    except BaseException:
        made = (PLANNED, CLAIMING)
        if created and not any(p for p in folder.iterdir() if not p.name.endswith(".lock") and p.name not in made):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def check_reads(jobs: list[Job], sources: dict) -> None:
    """Refuse, before anything runs, a run (or the parent it is fine-tuned from) that read other
    data than its config names now (records.check_read)."""
    experiments = {}  # in the jobs' order
    for job in jobs:
        digest = job.task.fingerprint(source_of(job, sources))
        for read in (job.folder, job.parent):
            if read is not None:
                check_read(read, digest)
        if job.alike:  # its experiment's runs differ in scheme and seed only: so does their data
            experiments[job.folder.parent, digest] = None
    for folder, digest in experiments:  # each folder's runs read once, not once a job
        check_same_read(folder, digest)


def source_of(job: Job, sources: dict):
    """The data a job's run reads, from `sources` (by its key), read and kept there if missing."""
    key = job.task.source_key(job.cfg)
    if key not in sources:
        sources[key] = job.task.source(job.cfg)
    return sources[key]


def run_job(job: Job, reporter: Reporter) -> str:
    """run_one in a worker process, which reads the run's data itself."""
    return run_one(job, job.task.source(job.cfg), reporter)


def run_one(job: Job, data, reporter: Reporter) -> str:
    """Train one run if it is not trained yet, then score whatever it still lacks, holding its
    lock throughout. Returns what happened: trained, reused, diverged, or held (another
    process holds the run, so it is left to that process)."""
    rc, rdir, state = job.cfg, job.folder, job.state
    if job.point is not None:  # "alibi seed 0" is at every grid point: its folder names the point
        reporter = Marked(reporter, ", " + rdir.name.removeprefix(run_name(rc.schemes[0], rc.seeds[0]) + "-"))
    with exclusive(lock_file(rdir), remove=True) as held:
        if not held:
            held_by = _other_process(rdir)
            reporter.note(f"{rdir.name}: {held_by} is running it; skipped here, rerun once that process is done")
            return "held"
        if state != "done" and ((rdir / WEIGHTS).is_file() or (rdir / DIVERGED).is_file()):
            # another process ended it since it was planned: reused only where it is this very run
            state = plan_state(rc, job.task, rdir, "--out" if job.parent is not None else "--set name=NEW")
        if state == "diverged" or (rdir / DIVERGED).is_file():
            reporter.note(
                f"{rdir.name}: diverged in an earlier attempt ({diverged_step(rdir)}); delete {rdir} to train it again"
            )
            return "diverged"
        record = rc
        if state == "done":
            trained, model = load_run(rdir)  # a corrupt checkpoint fails before it is announced as reused
            check_read(rdir, what_read(job, data)[1])  # against the data.json load_run may have restored
            model.cfg = dataclasses.replace(model.cfg, attention=rc.model.attention)  # scored as asked now
            # its record keeps how it was trained (device, workers, out_dir) and takes how it is scored now
            record = dataclasses.replace(trained, eval=rc.eval, model=model.cfg)
            reporter.note(f"{rdir.name}: already trained, reusing its checkpoint")
        elif job.parent is not None and not rc.model.extend:  # a parent's copy for posbench extend
            from posbench.extend.run import copy_parent

            copy_parent(job)
            _, model = load_run(rdir)
            reporter.note(f"{rdir.name}: copied from {job.parent}, to be scored as it is")
        else:
            model = train_run(job, data, reporter)
            if model is None:
                return "diverged"
        device = pick_device(rc.train.device)
        with scoring(rdir):
            job.measure.score(rc, rdir, model, data, device, model.backend(device), reporter)
            score_measures(rc, rdir, model, data, device)
            write_atomic(rdir / CONFIG, dump_yaml(record))  # how it was trained, and scored now
        record_read(rdir, *what_read(job, data))
        return "reused" if state == "done" else "trained"


def score_measures(rc: ExperimentConfig, rdir: Path, model, data, device) -> None:
    """Score the run by the measures eval.measures names beside its own (measures/plugin.py),
    each where its records lack the lengths asked or hold other options than eval.measure_options."""
    if not rc.eval.measures:
        return
    from posbench.measures.plugin import FOLDER, load_measures, score_into

    run = ScoringRun(rc, model.to(device).eval(), device, data)  # one run: the measures share its passes
    for spec, measure in load_measures(rc.eval.measures, rc.eval.measure_options, "eval.measure_options"):
        folder = rdir / FOLDER
        try:
            was = json.loads((folder / f"{measure.name}.json").read_text())["options"]
            with open(folder / f"{measure.name}.csv", newline="") as f:
                lengths = {int(r["length"]) for r in csv.DictReader(f)}
        except (OSError, ValueError, KeyError, TypeError):
            was, lengths = None, set()
        asked = {k: v for k, v in measure.options.items() if v is not None}  # None: decided as it scores
        if was is None or lengths != set(rc.eval.lengths) or any(was.get(k) != v for k, v in asked.items()):
            score_into(measure, spec, run, rdir)


def train_run(job: Job, data, reporter: Reporter) -> Optional[TransformerLM]:
    """Train in the hidden partial folder, resuming from its checkpoint if it holds one, and
    rename it into place once config, log and weights exist. A run whose loss blew up is
    renamed into place too, with diverged.json for weights, and None is returned. An error
    keeps the partial folder, with the error in failed.txt, only if it has a checkpoint."""
    from posbench.train import Diverged, train_model  # here: scoring alone never loads the training loop

    rc, rdir = job.cfg, job.folder
    partial = partial_dir(rdir)
    record = partial / CONFIG
    if record.is_file() and partial_identity(rdir, job.task) != run_identity(rc, job.task):
        reporter.note(f"{rdir.name}: its unfinished training was under other settings; starting it anew")
        shutil.rmtree(partial)
    with waiting_for(rdir.parent / CLAIMING):  # two processes that began with the folder empty
        if job.alike:
            check_same_experiment(rc, job.task, rdir.parent, frozenset([rdir.name]))
        partial.mkdir(parents=True, exist_ok=True)
        (partial / FAILED).unlink(missing_ok=True)
        write_atomic(record, dump_yaml(rc))  # what the next process to start here checks against
    try:
        if rc.model.extend:  # fine-tuned from a parent by posbench extend
            from posbench.extend.run import fine_tuning

            init, batches, probe = fine_tuning(job, data, partial)
        else:
            init, batches, probe = None, job.task.batches(rc, data), None
        with room_in(partial):  # its log and checkpoints
            model = train_model(rc, batches, reporter, partial, init, probe)
    except Diverged as e:
        write_atomic(partial / DIVERGED, json.dumps({"status": "diverged", "step": e.step, "loss": str(e.loss)}) + "\n")
        reporter.note(f"{rdir.name}: {e}; recorded in {rdir / DIVERGED}, the other runs go on")
        _finish(partial, rdir)
        return None
    except KeyboardInterrupt:
        raise  # its checkpoint is kept: the rerun resumes it
    except BaseException as e:
        if has_checkpoint(partial):
            write_atomic(partial / FAILED, first_line(e, 10**6) + "\n")
        else:  # nothing worth resuming
            shutil.rmtree(partial, ignore_errors=True)
        raise
    corpus, digest = what_read(job, data)
    save_checkpoint(partial / WEIGHTS, model, rc, {"corpus": corpus, "sha256": digest} if digest else None)
    _finish(partial, rdir)
    return model


def what_read(job: Job, data) -> tuple[str, Optional[str]]:
    """The name and sha256 of the data a run reads (None: a synthetic task's, made by its config)."""
    return getattr(data, "name", job.cfg.task), job.task.fingerprint(data)


def _finish(partial: Path, rdir: Path) -> None:
    """The mid-run checkpoints go, then the whole folder takes its final name."""
    for name in (CHECKPOINT, PREVIOUS):
        (partial / name).unlink(missing_ok=True)
    if rdir.exists():
        shutil.rmtree(rdir)
    partial.rename(rdir)


def _remove_temporaries(jobs: list[Job]) -> None:
    """What killed workers leave: temporary files. Their partial folders hold the checkpoints a
    rerun resumes from; a run another process holds is that process's own."""
    for job in jobs:
        with exclusive(lock_file(job.folder)) as held:
            if held:
                for folder in (job.folder, partial_dir(job.folder)):
                    for tmp in folder.glob(TMP_PREFIX + "*") if folder.is_dir() else []:
                        tmp.unlink(missing_ok=True)


def evaluate_run(
    run_dir: Path,
    asked: dict,
    device: Optional[str] = None,
    attention: Optional[str] = None,
    tracker: Optional[str] = None,
) -> tuple[ExperimentConfig, Measure, list[dict]]:
    """`posbench evaluate`: score a finished run again with its measure, as `asked` (eval.* keys
    -> (the flag as given, its value); the rest is the run's config's, resolve.resolve_scoring),
    on `device` (None: the run's own) with the `attention` backend (None: the run's
    model.attention), merge the rows into its records, send them to `tracker` (None: the run's
    train.tracker, where its library is installed here), and restore a deleted config.yaml from
    the checkpoint's copy. Returns the config it was scored under, its measure and the new rows."""
    with scoring_alone(Path(run_dir)):
        return _evaluate_run(run_dir, asked, device, attention, tracker)


def _evaluate_run(run_dir, asked, device, attention, tracker):
    trained, rc, model = _to_score(run_dir, device)
    if not (Path(run_dir) / CONFIG).is_file():
        write_atomic(Path(run_dir) / CONFIG, dump_yaml(trained))
    if attention is not None:  # how it is scored, not what it learned: the weights are the same
        model.cfg = dataclasses.replace(model.cfg, attention=attention)  # checked as it runs
    with named_by(run_dir):  # its task, if a user's module:Class, is said before it is imported
        exp = resolve_scoring(rc, asked)
    dev = pick_device(rc.train.device)
    check_tracker(tracker, "--tracker")
    tracker = tracker or usable(rc.train.tracker)  # the run's own, where its library is installed here
    source = exp.task.source(exp.cfg)
    digest = exp.task.fingerprint(source)
    check_read(run_dir, digest)  # before a row is scored: on other data they would not compare
    rows = exp.measure.rescore(exp.cfg, Path(run_dir), model.to(dev), source, dev)
    if exp.cfg.eval == rc.eval and attention is None and not rc.eval.measures:  # every row its config asks: scored
        (Path(run_dir) / SCORING).unlink(missing_ok=True)
    record_read(run_dir, getattr(source, "name", rc.task), digest)
    _send(tracker, run_dir)
    return exp.cfg, exp.measure, rows


def measure_run(
    run_dir: Path, specs: list[str], options: dict, device: Optional[str] = None, tracker: Optional[str] = None
) -> tuple[ExperimentConfig, list[tuple[Scorer, list[dict]]]]:
    """`posbench evaluate RUN --measure SPEC,...`: score a finished run by measures beside its own
    (posbench's by name, or a user's module:Class; measures/plugin.py) with `options`
    (--measure-option), on what it read, on `device` (None: the run's own), and send the rows to
    `tracker` (None: the run's train.tracker, where its library is installed here). Returns the
    run's config and each measure with its rows."""
    from posbench.experiment.checkpoint import pretrained_refused
    from posbench.measures.plugin import load_measures, score_into

    check_tracker(tracker, "--tracker")
    measures = load_measures(specs, options)
    if not (Path(run_dir) / WEIGHTS).is_file():
        pretrained_refused(Path(run_dir), f"score it with posbench pretrained {{path}} --measure {','.join(specs)}")
    with scoring_alone(Path(run_dir)):
        _, rc, model = _to_score(run_dir, device)
        dev = pick_device(rc.train.device)
        with named_by(run_dir):
            task = task_for(rc)
        run = ScoringRun(rc, model.to(dev).eval(), dev, task.source(rc))  # one run: the measures share its passes
        check_read(run_dir, task.fingerprint(run.source))
        scored = [(measure, score_into(measure, spec, run, Path(run_dir))) for spec, measure in measures]
    _send(tracker or usable(rc.train.tracker), run_dir)
    return rc, scored


@contextlib.contextmanager
def scoring_alone(rdir: Path):
    """The run's lock while `evaluate` scores it again: each scoring reads the records, then
    writes them back with its rows merged in, so two at once would lose the first one's rows."""
    with exclusive(lock_file(rdir), remove=True) as held:
        if not held:
            held_by = _other_process(rdir)
            raise PosbenchError(f"{rdir}: {held_by} is training or scoring it; rerun once that process is done")
        yield


def _other_process(rdir: Path) -> str:
    """'another posbench process (pid 123)': the one holding the run's lock."""
    pid = lock_holder(lock_file(rdir))
    return f"another posbench process{f' (pid {pid})' if pid else ''}"


def _to_score(run_dir: Path, device: Optional[str]) -> tuple[ExperimentConfig, ExperimentConfig, TransformerLM]:
    """A finished run's config as trained, as scored on `device` (None: the run's own), and its model."""
    trained, model = load_run(run_dir)
    rc = trained
    if device is not None:  # a run trained on a GPU can be scored on a laptop
        check_device(device, f"--device {device}")
        rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, device=device))
    return trained, rc, model


def _send(tracker: Optional[str], run_dir: Path) -> None:
    """A rescored run's new results, to its tracker run."""
    where = Path(run_dir).resolve()  # `posbench evaluate .` too: its experiment is the folder above
    send_run(tracker, where.parent, where)
