"""The command line: thin commands that delegate, and the one place that prints."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from posbench.config import length_grid, load_config
from posbench.errors import PosbenchError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Which positional encoding lets a transformer LM work beyond its training length?",
)
out = Console(emoji=False)  # no :b: -> emoji in names such as module:b:c
err = Console(stderr=True, emoji=False)


@contextlib.contextmanager
def user_errors(on_interrupt: str = "finished runs and checkpoints are kept; rerun the same command to resume"):
    """A domain error becomes one line and a non-zero exit, never a traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except PosbenchError as e:
        _error(str(e))
    except KeyboardInterrupt:
        err.print(f"interrupted: {on_interrupt}", soft_wrap=True)
        raise typer.Exit(code=130) from None
    except OSError as e:  # a full disk, an unwritable out_dir, an unreadable file
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _error(f"{where}{e.strerror or e}")
    except (torch_oom(), MemoryError) as e:
        _out_of_memory(e)
    except Exception as e:  # a bug here or in a user's plugin: still one line, unless debugging
        if os.environ.get("POSBENCH_DEBUG", "0") not in ("", "0"):
            raise
        if "can't allocate memory" in str(e):  # torch's CPU allocator raises a RuntimeError
            _out_of_memory(e)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        # exit 1, not 2: scripts can tell a bug (here or in a plugin) from a bad input
        _error(f"unexpected {type(e).__name__}: {first} (POSBENCH_DEBUG=1 shows the traceback)", code=1)


def _error(message: str, code: int = 2):
    _print_error(message)
    raise typer.Exit(code=code)


def _print_error(message: str) -> None:
    """The one line: markup-escaped, so a path like x[b].yaml prints as it is."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _out_of_memory(e: BaseException):
    _error(
        f"out of memory ({(str(e).splitlines() or [''])[0][:100]}); "
        "try shorter eval.lengths, a smaller eval.batch_size or a smaller model"
    )


def torch_oom():
    import torch

    return torch.OutOfMemoryError


class BarReporter:
    """A progress bar per training run, with the running loss; runs training at once
    (train.workers) get a bar each, live together."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Optional[Progress] = None
        self.tasks: dict = {}

    def start(self, label, total):
        if self.progress is None:
            self.progress = Progress(
                TextColumn("{task.description:<18}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.progress.start()
        self.tasks[label] = self.progress.add_task(label, total=total, loss="-")

    def step(self, label, step, loss):
        self.progress.update(self.tasks[label], completed=step, loss=f"{loss:.3f}")

    def finish(self, label):
        self.progress.stop_task(self.tasks.pop(label))
        if not self.tasks:  # the bars stay on screen; the next run starts a fresh set
            self.progress.stop()
            self.progress = None

    def note(self, message):
        self.console.print(message, highlight=False)


def _scheme_list(text: str) -> list[str]:
    """`--schemes alibi,rope`, or `all` for every registered scheme."""
    from posbench.schemes import SCHEMES

    return list(SCHEMES) if text.strip() == "all" else [s.strip() for s in text.split(",") if s.strip()]


def _csv_ints(text: Optional[str], what: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise PosbenchError(f"{what} '{text}': expected comma-separated integers, e.g. 100,150,200") from None


def _set_threads(threads: Optional[int]) -> None:
    import torch

    if threads is not None:
        if threads <= 0:
            raise PosbenchError(f"--threads {threads}: the thread count must be positive")
        torch.set_num_threads(threads)


def _csv_names(text: Optional[str]) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _comparison_table(table, title: str, caption: str, digits: int = 2) -> Table:
    from posbench.report import cell, is_best, lengths_of

    lengths = lengths_of(table)
    t = Table(title=title, caption=caption)
    t.add_column("scheme", style="bold", no_wrap=True, min_width=max(len(s) for s in table.index))
    for L in lengths:
        t.add_column(str(L), justify="right")
    t.add_column("seeds", justify="right")
    t.add_column(f"ppl({lengths[-1]})/ppl(train)", justify="right")
    for s in table.index:
        r = table.loc[s, "ratio"]
        cells = [cell(table, s, L, missing="—", digits=digits) for L in lengths]
        cells = [f"[bold]{escape(c)}[/]" if is_best(table, s, L) else escape(c) for L, c in zip(lengths, cells)]
        t.add_row(escape(s), *cells, str(int(table.loc[s, "seeds"])), f"{r:.2f}" if r == r else "—")
    return t


def _print_summary(
    exps,
    metric: str = "ppl",
    transpose: bool = False,
    out_dir: Optional[Path] = None,
    buckets: Optional[list[int]] = None,
) -> None:
    from posbench.report import METRICS, backends_note, diverged_note, spread_note, summary_dir, write_summary
    from posbench.task_report import is_task_experiment

    dirs = [exps] if isinstance(exps, (str, Path)) else list(exps)
    if is_task_experiment(dirs):
        return _print_task_summary(dirs, metric, transpose, out_dir, buckets)
    if buckets is not None:
        raise PosbenchError("--buckets applies to the runs of a task, not to perplexity (task lm)")
    df, configs, tables = write_summary(exps, metric, transpose, out_dir)
    caption = (
        f"{spread_note(tables)}. — : the scheme cannot encode that length (beyond-max-len); "
        f"nan: the loss blew up; blank: not evaluated"
    )
    for label, table in tables.items():
        title = (
            f"{METRICS[metric][0]}, trained at {table.attrs['train_len']} ({label}; "
            f"attention: {backends_note(df, short=True)})"
        )
        out.print(_comparison_table(table, title, caption, METRICS[metric][1]))
    if df.attrs.get("diverged"):
        out.print(f"diverged, so not in the table: {diverged_note(df)}", highlight=False)
    if df.attrs.get("running"):
        out.print(
            f"still running in another process, so not in the table: {', '.join(df.attrs['running'])}", highlight=False
        )
    _say_written(
        summary_dir(exps, out_dir),
        ("summary.csv", "summary.md", "summary.tex", "summary.png", "positions.png", "training.png"),
    )


def _say_written(folder: Path, names) -> None:
    for name in names:
        if (folder / name).exists():
            out.print(f"wrote {folder / name}", highlight=False)


def _print_task_summary(dirs, metric: str, transpose: bool, out_dir: Optional[Path], buckets) -> None:
    from posbench.accuracy import task_of
    from posbench.report import summary_dir
    from posbench.task_report import grid, write_summary

    if metric != "ppl":  # the default of --metric
        raise PosbenchError(f"--metric {metric}: a task's runs are scored by exact match alone")
    folder = summary_dir(dirs, out_dir)
    for point, configs, _, table in write_summary(dirs, folder, transpose, buckets):
        task = task_of(configs[0])
        rows = grid(table, transpose or len(table.attrs["buckets"]) > 12, bold=lambda c: "\0" + c)
        where = f"; {point}" if point else ""
        t = Table(
            title=f"{configs[0].task}: % exact match by length (trained on 1..{task.train_max}{where})",
            caption="mean ± 95% interval over seeds; bold: the best and every scheme not significantly different",
        )
        for i, c in enumerate(rows[0]):
            t.add_column(escape(c), justify="left" if i == 0 else "right", style="bold" if i == 0 else None)
        for r in rows[1:]:
            t.add_row(*(f"[bold]{escape(c[1:])}[/]" if c.startswith("\0") else escape(c) for c in r))
        out.print(t)
    _say_written(folder, ("summary.csv", "summary.md", "summary.tex", "summary.png", "training.png"))


Sets = Annotated[Optional[list[str]], typer.Option("--set", help="override a config key: key=value")]
AttentionOpt = Annotated[
    Optional[str], typer.Option(help="attention backend: auto, eager, sdpa, native or flex (model.attention)")
]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile for training (off: no gain on CPU)")]
Protocol = Annotated[Optional[str], typer.Option(help="nonoverlapping, sliding, or both: nonoverlapping,sliding")]
Stride = Annotated[Optional[int], typer.Option(help="sliding windows' stride (default: train_len / 4)")]
TaskOpt = Annotated[
    Optional[str],
    typer.Option(
        help="lm (perplexity, the default), copy, reverse, sort, addition, parity, passkey, recall, or module:Class"
    ),
]


@app.command()
def extrapolate(
    train_len: Annotated[Optional[int], typer.Option(help="training length")] = None,
    test_len: Annotated[Optional[int], typer.Option(help="longest test length")] = None,
    lengths: Annotated[Optional[str], typer.Option(help="test lengths, e.g. 100,150,200")] = None,
    schemes: Annotated[Optional[str], typer.Option(help="e.g. alibi,rope, or all")] = None,
    seeds: Annotated[Optional[str], typer.Option(help="e.g. 0,1,2")] = None,
    config: Annotated[Optional[Path], typer.Option(help="a YAML config")] = None,
    set_: Sets = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda")] = None,
    attention: AttentionOpt = None,
    rope_scaling: Annotated[
        Optional[str], typer.Option(help="also score rope runs scaled at evaluation, e.g. yarn,ntk")
    ] = None,
    rope_factor: Annotated[Optional[float], typer.Option(help="fixed scale s (default L'/L)")] = None,
    protocol: Protocol = None,
    stride: Stride = None,
    compile_: Compile = False,
    task: TaskOpt = None,
):
    """Train one model per scheme at the training length and compare them at longer lengths.

    --task copy (reverse, sort, addition, parity, passkey, recall) trains on a synthetic task
    instead of the corpus and scores exact-match accuracy by length."""
    from posbench.runs import check_experiment, run_experiment

    with user_errors():
        if test_len is not None and lengths is not None:
            raise PosbenchError("--test-len and --lengths both set the evaluation lengths; give one")
        values = {
            "model.train_len": train_len,
            "schemes": _scheme_list(schemes) if schemes is not None else None,
            "seeds": _csv_ints(seeds, "--seeds"),
            "eval.lengths": _csv_ints(lengths, "--lengths"),
            "train.threads": threads,
            "train.device": device,
            "model.attention": attention,
            "eval.rope_scaling": _csv_names(rope_scaling) if rope_scaling is not None else None,
            "eval.rope_factor": rope_factor,
            "eval.protocol": _csv_names(protocol) if protocol is not None else None,
            "eval.stride": stride,
            "train.compile": compile_ or None,
            "task": task,
        }
        if task is not None and task != "lm" and (train_len, test_len, lengths) != (None, None, None):
            raise PosbenchError(
                "--train-len, --test-len and --lengths set perplexity lengths; a task's are "
                "task_options.train_max and test_max, e.g. --set task_options.test_max=60"
            )
        if test_len is not None:  # the grid runs from the training length, however it is given
            model_sets = [o for o in set_ or [] if o.startswith("model.")]
            L = train_len or load_config(config, model_sets).model.train_len
            values["eval.lengths"] = length_grid(L, test_len)
        cfg = load_config(config, set_ or [], values, check=check_experiment)
        _kernel_notes(cfg)
        exp = run_experiment(cfg, BarReporter(err))
        _print_summary(exp)


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="a YAML config with a sweep: block of lists")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the grid and what would be skipped")] = False,
    set_: Sets = None,
    executor: Annotated[str, typer.Option(help="local (this machine), or ray (a Ray cluster)")] = "local",
    address: Annotated[Optional[str], typer.Option(help="the Ray cluster: auto, or ray://head:10001")] = None,
    storage: Annotated[
        Optional[str], typer.Option(help="where Ray tasks keep checkpoints (default: each node's cache)")
    ] = None,
):
    """Train and compare every run of a config's sweep: grid, in one experiment folder.

    The sweep: block maps config keys (schemes, seeds, model.train_len, any dotted key) to
    lists of values; every combination is a run. A rerun skips finished runs and resumes
    unfinished ones."""
    from posbench.config import load_sweep
    from posbench.runs import check_experiment, plan_sweep, run_sweep

    with user_errors():
        if executor not in ("local", "ray"):
            raise PosbenchError(f"--executor {executor}: expected local or ray")
        if executor == "local" and (address or storage):
            raise PosbenchError("--address and --storage are for --executor ray")
        grid = load_sweep(config, set_ or [], check=check_experiment)
        if dry_run:
            exp, plan = plan_sweep(grid)
            out.print(_grid_table(exp, grid, plan))
            return
        _kernel_notes(grid[0][1])
        if executor == "ray":
            from posbench.cluster import run_sweep_on_ray

            exp = run_sweep_on_ray(grid, config.read_text(), BarReporter(err), address, storage)
        else:
            exp = run_sweep(grid, config.read_text(), BarReporter(err))
        _print_summary(exp)


def _grid_table(exp: Path, grid, plan) -> Table:
    from posbench.runs import plan_note

    keys = list(grid[0][0])
    t = Table(title=f"{exp}: {len(grid)} grid point(s), {len(plan)} run(s)")
    t.add_column("run", overflow="fold")
    for k in keys:
        t.add_column(k)
    t.add_column("would")
    settings = {id(cfg): s for s, cfg in grid}
    for cfg, _, rdir, state in plan:
        point = settings[id(cfg)]
        values = [str(point[k]) for k in keys]
        t.add_row(escape(rdir.name), *map(escape, values), escape(plan_note(rdir, state)))
    return t


def _kernel_notes(cfg) -> None:
    """Build the C kernels once, here, before any worker starts; say where auto cannot use them."""
    from posbench import native
    from posbench.train import pick_device

    device = pick_device(cfg.train.device)
    if cfg.model.attention != "auto" or device.type != "cpu":
        return  # a backend named outright is checked when the model runs; a GPU takes SDPA
    why = native.why_not(cfg.model.head_dim, device)
    if why:
        err.print(
            f"note: attention runs on SDPA, a few times slower on a CPU: the native backend cannot run ({why})",
            highlight=False,
            markup=False,
        )
    elif "cope" in cfg.schemes and native.load("cope") is None:
        err.print(
            f"note: cope trains on its PyTorch bias, several times slower: its C kernel cannot run "
            f"({native.unavailable['cope']})",
            highlight=False,
            markup=False,
        )


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(help="a YAML config (default: the defaults)")] = None,
    scheme: Annotated[Optional[str], typer.Option(help="one scheme (a name or module:Class)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="one seed")] = None,
    set_: Sets = None,
    attention: AttentionOpt = None,
    compile_: Compile = False,
    task: TaskOpt = None,
):
    """Train (and evaluate at the config's lengths) the runs of a config, or one of them."""
    from posbench.runs import check_experiment, run_experiment, run_name

    with user_errors():
        values = {
            "schemes": [scheme] if scheme is not None else None,
            "seeds": [seed] if seed is not None else None,
            "model.attention": attention,
            "train.compile": compile_ or None,
            "task": task,
        }
        cfg = load_config(config, set_ or [], values, check=check_experiment)
        _kernel_notes(cfg)
        exp = run_experiment(cfg, BarReporter(err))
        for s in cfg.schemes:
            for n in cfg.seeds:
                out.print(f"run folder: {exp / run_name(s, n)}", highlight=False)
        _print_summary(exp)


@app.command()
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run folder holding model.pt")],
    lengths: Annotated[Optional[str], typer.Option(help="e.g. 100,200,400")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    rope_scaling: Annotated[
        Optional[str], typer.Option(help="also score RoPE scaled at evaluation: linear,ntk,dynamic,yarn")
    ] = None,
    rope_factor: Annotated[Optional[float], typer.Option(help="fixed scale s (default L'/L per length)")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda (default: the run's)")] = None,
    attention: AttentionOpt = None,
):
    """Evaluate an existing checkpoint; its rows are merged into the run's eval.csv.

    --rope-scaling yarn also scores the rope checkpoint rescaled at evaluation time (rows
    rope+yarn), beside plain rope, at these lengths and the training length."""
    from posbench.runs import evaluate_run

    with user_errors():
        _set_threads(threads)
        kinds = _csv_names(rope_scaling)
        if rope_factor is not None and not kinds:
            raise PosbenchError("--rope-factor needs --rope-scaling, e.g. --rope-scaling yarn")
        Ls = _csv_ints(lengths, "--lengths")
        rc, rows = evaluate_run(run_dir, Ls, kinds or [None], rope_factor, device, attention)
        if rc.task != "lm":
            t = Table(title=f"{rc.task}: {rc.model.scheme} seed {rc.seeds[0]}; attention {rows[0]['attention']}")
            for c in ("length", "exact", "instances", "status"):
                t.add_column(c, justify="right")
            for r in rows:
                ok = r["status"] == "ok"
                t.add_row(
                    str(r["length"]), f"{100 * r['accuracy']:.1f}%" if ok else "—", str(r["instances"]), r["status"]
                )
            out.print(t)
            out.print(f"wrote {Path(run_dir) / 'eval.csv'} and {Path(run_dir) / 'samples.txt'}", highlight=False)
            return
        how = rows[0]["attention"] if rows else rc.model.attention
        t = Table(title=f"{rc.model.scheme} seed {rc.seeds[0]}, trained at {rc.model.train_len}; attention {how}")
        for c in ("scheme", "length", "loss", "ppl", "status"):
            t.add_column(c, justify="left" if c == "scheme" else "right")
        for r in rows:
            ok = r["status"] == "ok"
            t.add_row(
                r["scheme"],
                str(r["length"]),
                f"{r['loss']:.4f}" if ok else "—",
                f"{r['ppl']:.2f}" if ok else "—",
                r["status"],
            )
        out.print(t)
        out.print(f"wrote {Path(run_dir) / 'eval.csv'}", highlight=False)


@app.command()
def report(
    experiment_dirs: Annotated[list[Path], typer.Argument(help="e.g. results/default; several join into one table")],
    metric: Annotated[str, typer.Option(help="ppl, loss, or ratio (to the training length)")] = "ppl",
    transpose: Annotated[bool, typer.Option(help="lengths as rows, schemes as columns")] = False,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="where a joined report goes")] = None,
    buckets: Annotated[
        Optional[str], typer.Option(help="a task's length buckets by their last length, e.g. 10,20,30,40")
    ] = None,
):
    """Rebuild the summary tables (Markdown, CSV, LaTeX) and plots from run folders, without training."""
    with user_errors():
        edges = _csv_ints(buckets, "--buckets")
        if any(e <= 0 for e in edges or []):
            raise PosbenchError(f"--buckets {buckets}: a bucket ends at a positive length")
        _print_summary(experiment_dirs, metric, transpose, out_dir, edges)


STATE_STYLES = {"done": "green", "partial": "yellow", "running": "cyan", "failed": "bold red", "diverged": "red"}


@app.command()
def status(
    experiment_dir: Annotated[Path, typer.Argument(help="an experiment folder, e.g. results/sweep-example")],
):
    """Each run of an experiment: done, partial (at which step), failed, diverged or running."""
    from posbench.runs import run_status

    with user_errors():
        rows = run_status(experiment_dir)
    t = Table(title=f"{experiment_dir}: {len(rows)} run(s)")
    for c in ("run", "scheme", "seed", "train_len", "state", "detail"):
        t.add_column(c, justify="right" if c in ("seed", "train_len") else "left", no_wrap=c == "run")
    for r in rows:
        state = f"[{STATE_STYLES.get(r['state'], '')}]{r['state']}[/]"
        t.add_row(
            escape(r["run"]), escape(str(r["scheme"])), str(r["seed"]), str(r["train_len"]), state, escape(r["detail"])
        )
    out.print(t)


@app.command()
def schemes():
    """List the registered positional schemes and their evaluation-time variants."""
    from posbench.schemes import catalogue

    t = Table(title="positional schemes")
    t.add_column("name", style="bold")
    t.add_column("description")
    for name, what in catalogue():
        t.add_row(name, what)
    out.print(t)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option(help="a seconds-long run (tiny batch; memory at 1x, 16x, 32x)")] = False,
    peer: Annotated[Optional[str], typer.Option(help="also time a peer library: x-transformers")] = None,
    schemes: Annotated[Optional[str], typer.Option(help="e.g. alibi,rope, or all (default: the config's)")] = None,
    config: Annotated[Optional[Path], typer.Option(help="a YAML config for the model size")] = None,
    set_: Sets = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads")] = None,
    device: Annotated[
        Optional[str], typer.Option(help="auto, cpu or cuda (default: the config's train.device)")
    ] = None,
    attention: AttentionOpt = None,
    rounds: Annotated[
        Optional[int], typer.Option(help="interleaved timing rounds (default 30; 1 with --quick)")
    ] = None,
    out_file: Annotated[Path, typer.Option("--out", help="the CSV to write, or a folder for bench.csv")] = Path(
        "results/bench/bench.csv"
    ),
):
    """Training tokens/s (vs NoPE and a peer), FLOP utilisation, and eval memory up to 64x."""

    from posbench.bench import BenchSettings, run_bench, write_bench
    from posbench.runs import check_experiment
    from posbench.train import pick_device

    with user_errors(on_interrupt="nothing was written; an earlier bench.csv is kept"):
        values = {
            "schemes": _scheme_list(schemes) if schemes is not None else None,
            "train.device": device,  # checked with the config's own
            "model.attention": attention,
            # the bench evaluates at its own multiples of train_len and never reads eval.*, so the
            # config's test lengths must not stop a longer train_len (--set model.train_len=1024
            # against the default [100..200]): one length longer than any train_len, and its tokens
            "eval.lengths": [2**40],
            "eval.tokens": 2**40,
        }
        cfg = load_config(config, set_ or [], values, check=check_experiment)
        _set_threads(threads)
        dev = pick_device(cfg.train.device, "bench takes --device cpu")
        out_file = _writable_csv(out_file)  # before the minutes of timing, not after
        settings = BenchSettings.quick() if quick else BenchSettings(batch_size=cfg.train.batch_size)
        if rounds is not None:
            if rounds < 1:
                raise PosbenchError(f"--rounds {rounds}: at least one round is needed")
            settings.rounds = rounds
        rows, peak = run_bench(
            cfg.model,
            cfg.schemes,
            settings,
            peer,
            progress=lambda m: err.print(m, highlight=False),
            options=cfg.scheme_options,
            device=dev,
        )
        write_bench(rows, out_file)
        out.print(_bench_table(rows, peak, cfg.model, dev, peer))
        _kernel_notes(cfg)
        out.print(f"wrote {out_file}", highlight=False)


def _writable_csv(path: Path) -> Path:
    """`path`, or path/bench.csv when it is a folder. The CSV is written beside itself and renamed
    over the old one, so it must be a plain file (or nothing yet) in a folder that can be made
    and written; a symlink is followed, so its target is what gets replaced."""
    if path.is_dir():
        path = path / "bench.csv"
    path = path.resolve()
    if path.exists() and not path.is_file():
        raise PosbenchError(f"--out {path}: exists and is not a plain file")
    folder = path.parent
    while not folder.exists():  # the nearest folder that exists must let us make the rest
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise PosbenchError(f"--out {path}: cannot write in {folder}")
    return path


def _backends(rows) -> str:
    return ", ".join(sorted({r["attention"] for r in rows}))


def _bench_table(rows, peak, mc, device, peer) -> Table:
    train = [r for r in rows if r["measurement"] == "train"]
    lengths = sorted({r["eval_len"] for r in rows if r["measurement"] == "eval"})
    mem = {(r["scheme"], r["eval_len"]): r["peak_mem_mb"] for r in rows if r["measurement"] == "eval"}
    where = rows[0]["device"] if rows else str(device)
    if device.type == "cuda":
        where, peak_text = f"{where}, bf16 autocast", f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
    else:
        peak_text = f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s"
    t = Table(
        title=f"posbench bench: {mc.n_layer} layers, d_model {mc.d_model}, {mc.n_head} heads, "
        f"T={mc.train_len}; {where}; attention {_backends(rows)}; {peak_text}" + (f"; peer: {peer}" if peer else ""),
        caption="eval memory: peak tensor memory of one no-grad forward, batch 1",
    )
    cols = ["scheme", "tokens/s", "x NoPE", "MFU"]
    if peer:
        cols += ["peer tok/s", "x peer"]
    cols += [f"mem@{L} MB" for L in lengths]
    for c in cols:
        t.add_column(c, justify="left" if c == "scheme" else "right")

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    for r in train:
        mfu = f(r["mfu"], ".0%" if r["mfu"] >= 0.1 else ".1%" if r["mfu"] >= 0.01 else ".2%")  # a GPU's can be tiny
        cells = [r["scheme"], f(r["tokens_per_s"], ".0f"), f(r["ratio_vs_nope"], ".2f"), mfu]
        if peer:
            cells += [f(r["peer_tokens_per_s"], ".0f"), f(r["peer_ratio"], ".2f")]
        cells += [f(mem.get((r["scheme"], L)), ".1f") for L in lengths]
        t.add_row(*cells)
    return t


@app.command("check-scheme")
def check_scheme(
    scheme: Annotated[str, typer.Argument(help="a registered name or module:Class")],
):
    """Check a scheme at a tiny size: causality, forward, backward, beyond the training length."""
    from posbench.check import run_checks

    with user_errors():
        results = run_checks(scheme)
    t = Table(title=f"check-scheme {scheme}")
    t.add_column("check", style="bold")
    t.add_column("result")
    t.add_column("reason")
    for r in results:
        t.add_row(r.name, "[green]pass[/]" if r.ok else "[bold red]FAIL[/]", r.reason)
    out.print(t)
    failed = [r.name for r in results if not r.ok]
    if failed:
        err.print(f"[bold red]failed:[/] {', '.join(failed)}", highlight=False)
        raise typer.Exit(code=1)


@app.command()
def inspect(
    target: Annotated[str, typer.Argument(help="a scheme (name or module:Class) or a run folder")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="default: results/inspect/<name>")] = None,
    length: Annotated[Optional[int], typer.Option(help="positions to draw; default 2x train_len")] = None,
):
    """Plot what a scheme does to attention (and, for a trained run, what it learned)."""
    from posbench.plots import inspect_target

    with user_errors():
        paths = inspect_target(target, out_dir, length)
    if not paths:
        out.print(f"{target}: its hooks change nothing (NoPE), so there is nothing to draw")
    for p in paths:
        out.print(f"wrote {p}", highlight=False, soft_wrap=True)  # unbroken, to copy and open


def _usage_errors() -> tuple:
    """click's usage errors, from click itself or from the copy newer typers vendor."""
    kinds = []
    with contextlib.suppress(ImportError):
        import click

        kinds.append(click.ClickException)
    with contextlib.suppress(ImportError):
        from typer._click.exceptions import ClickException

        kinds.append(ClickException)
    return tuple(kinds)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main():
    # a console script does not put the working directory on sys.path, so a user's
    # `mymodule:MyScheme` beside their config would not import; add it, as uvicorn does
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` cleans up like Ctrl-C: no half-written runs
    try:
        code = app(prog_name="posbench", standalone_mode=False)
    except _usage_errors() as e:  # one line, not typer's boxed panel
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `posbench`: typer printed the help
            return 0
        cmd = e.ctx.command_path if getattr(e, "ctx", None) else "posbench"
        _print_error(f"{e.format_message()} (see '{cmd} --help')")
        code = e.exit_code
    except typer.Abort:  # end of input at a prompt
        code = 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
