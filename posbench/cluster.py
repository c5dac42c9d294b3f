"""Sweeps on a Ray cluster: each run a task; its records come back to the driver, which writes them."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

from posbench.config import config_from_dict
from posbench.errors import PosbenchError, first_line
from posbench.experiment.execute import begin_sweep, run_one, source_of, sweep_jobs
from posbench.experiment.plan import Job, plan_state
from posbench.experiment.records import lock_file, partial_dir
from posbench.files import cache_dir, exclusive, safe_name
from posbench.progress import Reporter
from posbench.resolve import Experiment
from posbench.tasks import task_for
from posbench.trackers import send_run

INSTALL = "--executor ray needs Ray, an optional extra: pip install -e '.[ray]' (or pip install ray)"


def run_sweep_on_ray(
    grid: list[tuple[dict, Experiment]],
    source: str,
    reporter: Reporter,
    address: Optional[str] = None,
    storage: Optional[str] = None,
) -> Path:
    """run_sweep with each unfinished run a Ray task on the cluster at `address` (None: the
    Ray instance this process already has, or a new local one). A task trains in `storage`
    (a path each node can write, shared or not; None: the node's posbench cache), where its
    checkpoints let a retried task resume, and returns the run's files. The driver alone
    writes the experiment folder, so the cluster needs no filesystem shared with it."""
    try:
        import ray
    except ImportError:
        raise PosbenchError(INSTALL) from None
    check_reachable(address)
    exp, jobs, sources = sweep_jobs(grid, reporter)
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except Exception as e:  # no cluster there, or one of another Ray version
            raise PosbenchError(
                f"--address {address or '(local)'}: cannot join a Ray cluster ({first_line(e)})"
            ) from None
    task = ray.remote(train_on_node)
    tracker = grid[0][1].cfg.train.tracker  # checked by sweep_jobs, before anything was sent
    try:
        begin_sweep(exp, source, jobs, sources)  # once a cluster answers: a folder it never trained in is not made
        with contextlib.ExitStack() as held:
            pending, sent, done = {}, 0, 0
            todo = sum(job.state == "todo" for job in jobs)
            for job in jobs:
                rc, rdir, state = job.cfg, job.folder, job.state
                if state != "todo":  # scoring what a finished run lacks is quick: here
                    run_one(job, source_of(job, sources), reporter)
                    send_run(tracker, exp, rdir)
                    continue
                if not held.enter_context(exclusive(lock_file(rdir))):
                    reporter.note(f"{rdir.name}: another posbench process is running it; skipped here")
                    continue
                cuda = rc.train.device.startswith("cuda")
                options = {"num_cpus": rc.train.threads or 1, "num_gpus": 1 if cuda else 0}
                ref = task.options(**options).remote(rc.to_dict(), exp.name, rdir.name, storage)
                pending[ref], sent = rdir, sent + 1
                wants = f"{options['num_cpus']} CPU, {options['num_gpus']} GPU"
                reporter.note(f"{rdir.name} ({sent} of {todo}): sent to the cluster ({wants})")
            try:
                while pending:
                    (ready,), _ = ray.wait(list(pending), num_returns=1)
                    rdir = pending.pop(ready)
                    try:
                        outcome, node, files = ray.get(ready)
                    except ray.exceptions.RayTaskError as e:
                        cause = e.cause if isinstance(getattr(e, "cause", None), PosbenchError) else None
                        said = cause or str(e).strip().splitlines()[-1]
                        code = cause.exit_code if cause else 1  # not posbench's own error: a bug
                        raise PosbenchError(f"{rdir.name}: {said}", exit_code=code) from None
                    write_run(rdir, files)
                    send_run(tracker, exp, rdir)  # the driver sends, never a task
                    done += 1
                    reporter.note(f"{rdir.name}: {outcome} on {node}; {done} of {todo} back")
            except BaseException:
                for ref in pending:
                    ray.cancel(ref)
                raise
    finally:
        if started:
            ray.shutdown()
    return exp


def check_reachable(address: Optional[str], timeout: float = 10.0) -> None:
    """A head at host:port (or ray://host:port) that does not answer is one line; Ray itself
    would keep retrying for minutes. None and 'auto' are Ray's to resolve."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise PosbenchError(f"--address {address}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise PosbenchError(
            f"--address {address}: no Ray head answers there ({e.strerror or e}); start one with `ray start --head`"
        ) from None


def train_on_node(raw: dict, experiment: str, run: str, storage: Optional[str]):
    """A Ray task: train and score one run in storage/<experiment>/<run> on this node, resuming
    from a checkpoint a killed attempt left there; returns (what happened, this node's name,
    the run folder's files by name)."""
    rc = config_from_dict(raw)
    rdir = Path(storage or cache_dir() / "ray") / safe_name(experiment) / run
    rdir.parent.mkdir(parents=True, exist_ok=True)
    task = task_for(rc)
    job = Job(rc, task, task.measure(), rdir, plan_state(rc, task, rdir))
    outcome = run_one(job, task.source(rc), Reporter())
    files = {p.name: p.read_bytes() for p in rdir.iterdir() if p.is_file()}
    return outcome, socket.gethostname(), files


def write_run(rdir: Path, files: dict[str, bytes]) -> None:
    """A run's files, built in its partial folder and renamed into place whole."""
    partial = partial_dir(rdir)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name, data in files.items():
        (partial / name).write_bytes(data)
    if rdir.exists():
        shutil.rmtree(rdir)
    os.replace(partial, rdir)
