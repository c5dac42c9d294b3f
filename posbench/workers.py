"""Several runs at once: a pool of worker processes, progress relayed to the parent's reporter."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch

from posbench.config import ExperimentConfig
from posbench.device import pick_device
from posbench.errors import PosbenchError
from posbench.progress import Reporter
from posbench.registry import PLUGIN_MODULES, unexpected

SMALL_RUN_TOKENS = 200_000  # below this a run trains in about the 2 s a worker takes to start
STOP_GRACE_S = 3.0  # how long a stopped worker has to finish its step and save its checkpoint
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, e.g. in a container
    except AttributeError:
        return os.cpu_count() or 1


def worker_plan(
    cfg: ExperimentConfig, to_train: int, note: Callable[[str], None] = lambda message: None
) -> tuple[int, Optional[int]]:
    """(processes, torch threads in each). A model this small scales poorly over threads: on 2
    cores, two runs at once with 1 thread each finish sooner than one after the other with 2
    threads. A GPU gets 1 process, and runs too small to repay a worker's start
    (configs/smoke.yaml) stay in this process, which `note` hears of where several runs on
    several cores then train one after another."""
    tc = cfg.train
    workers = tc.workers
    if workers is None:
        tokens = tc.steps * tc.batch_size * cfg.model.train_len
        small = tokens < SMALL_RUN_TOKENS
        workers = 1 if small or pick_device(tc.device).type != "cpu" else cpu_cores()
        if small and to_train > 1 and cpu_cores() > 1:
            note(
                f"{to_train} runs train one after another: each is {tokens:,} tokens (train.steps x "
                f"train.batch_size x model.train_len), under the {SMALL_RUN_TOKENS:,} that repay a "
                f"worker's start; --set train.workers={min(cpu_cores(), to_train)} trains them side by side"
            )
    workers = max(1, min(workers, to_train))
    threads = tc.threads or (max(1, cpu_cores() // workers) if workers > 1 else None)
    return workers, threads


class QueueReporter(Reporter):
    """A worker process's reporter: every call goes to the parent, which replays it."""

    def __init__(self, queue):
        self.queue = queue

    def start(self, label, total):
        self.queue.put(("start", label, total))

    def step(self, label, step, loss):
        self.queue.put(("step", label, step, loss))

    def finish(self, label):
        self.queue.put(("finish", label))

    def note(self, message):
        self.queue.put(("note", message))

    def scoring(self, label, done, total):
        self.queue.put(("scoring", label, done, total))


def _worker_main(work: Callable, threads: Optional[int], jobs, events, parent: int, plugins: dict) -> None:
    """A worker process: call work(*args, reporter) for each (index, (label, args)) until None.
    Ctrl-C is the parent's to handle: it stops workers with SIGTERM, on which a training run
    saves its checkpoint and the worker exits. A worker never outlives its parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt)  # training takes it over to stop at a step's end
    _die_with(parent)
    PLUGIN_MODULES.update(plugins)  # the parent's, so an error in a plugin's code is said as that plugin's
    if threads:
        torch.set_num_threads(threads)
    reporter = QueueReporter(events)
    try:
        while (item := jobs.get()) is not None:
            i, (label, args) = item
            try:
                work(*args, reporter)
                events.put(("done", i))
            except PosbenchError as e:
                events.put(("failed", i, e))
            except (Exception, SystemExit) as e:  # a bug, here or in a plugin: its type and its plugin
                events.put(("failed", i, PosbenchError(f"{label}: {unexpected(e)}", exit_code=1)))
    except KeyboardInterrupt:  # stopped by the parent, checkpoint saved
        os._exit(0)  # not via the queues' feeder threads, whose reader may be gone


@contextlib.contextmanager
def _children_ignore_ctrl_c():
    """Processes started within ignore SIGINT from their first instruction (an ignored signal
    stays ignored through exec), not from _worker_main: a worker still importing torch would
    otherwise print its KeyboardInterrupt's traceback. This process takes Ctrl-C again after."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if before is not None:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _die_with(parent: int) -> None:
    """When the parent dies, kill -9 included, this worker gets SIGTERM from the kernel (Linux's
    PR_SET_PDEATHSIG) and so stops as on Ctrl-C. A thread watching the parent's pid is the
    fallback where prctl is missing, and the hard stop if the graceful one hangs."""
    try:
        told = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) == 0
    except (OSError, AttributeError):  # not Linux
        told = False
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        if not told:  # a second SIGTERM would cut the checkpoint short
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_in_workers(
    work: Callable,
    jobs: list[tuple],
    cleanup: Callable[[], None],
    reporter: Reporter,
    workers: int,
    threads: Optional[int],
    on_done: Callable[[int], None] = lambda i: None,
) -> None:
    """work(*args, reporter) for each (label, args) job, in `workers` processes, and on_done(i)
    here, in this process, as job i finishes. `work` must be a module-level function (the
    spawned workers import it by name). After the first error no new job starts;
    the jobs under way finish and are kept, and the error is raised here. An interrupt kills
    the workers at once and calls `cleanup` to remove what their unfinished jobs had written."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # fork after torch has started its threads can deadlock
    job_queue, events = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_main, args=(work, threads, job_queue, events, os.getpid(), PLUGIN_MODULES), daemon=True
        )
        for _ in range(workers)
    ]
    todo = list(enumerate(jobs))
    error, busy = None, 0
    try:
        with _children_ignore_ctrl_c():
            for p in procs:
                p.start()
        for _ in range(workers):
            item = todo.pop(0) if todo else None
            job_queue.put(item)
            busy += item is not None
        while busy:
            try:
                kind, *args = events.get(timeout=0.5)
            except queue_mod.Empty:
                # a worker exits on its own only once told there is no more work, so one that
                # ended while every live worker is busy held a job (a plugin's os._exit(0) too)
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead or sum(p.is_alive() for p in procs) < busy:
                    code = dead[0].exitcode if dead else 0
                    raise PosbenchError(
                        f"a worker process died (exit code {code}), perhaps out of "
                        "memory; rerun with --set train.workers=1 to see the error"
                    ) from None
                continue
            if kind in ("done", "failed"):
                if kind == "failed" and error is None:
                    error = args[1]
                if kind == "done":
                    on_done(args[0])
                nxt = todo.pop(0) if todo and error is None else None
                job_queue.put(nxt)
                busy -= nxt is None
            else:
                getattr(reporter, kind)(*args)
        for p in procs:
            p.join()
    except BaseException:
        try:  # SIGTERM: each saves its checkpoint at the end of its step; then they are killed
            for p in procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # a second Ctrl-C while waiting still leaves no worker behind
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            cleanup()
        raise
    if error is not None:
        raise error
