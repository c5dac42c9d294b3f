"""What the command line shows: progress bars and every table a command prints, drawn with rich."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from posbench.progress import Reporter

out = Console(emoji=False)  # no :b: -> emoji in names such as module:b:c
err = Console(stderr=True, emoji=False)


def section_table(section) -> Table:
    """A report section (posbench/measures) as a terminal table, best cells in bold."""
    rows = section.terminal or section.rows
    best = section.terminal_best if section.terminal is not None else section.best
    t = Table(title=section.title or section.heading, caption=section.legend)
    for j, c in enumerate(rows[0]):
        if j == 0:
            t.add_column(escape(c), style="bold", no_wrap=True, min_width=max(len(r[0]) for r in rows[1:]))
        else:
            t.add_column(escape(c), justify="right")
    for i, r in enumerate(rows[1:], start=1):
        t.add_row(*(f"[bold]{escape(c)}[/]" if (i, j) in best and c else escape(c) for j, c in enumerate(r)))
    return t


def print_report(collected, parts: dict, folder: Path) -> None:
    """`posbench report` and the end of every training command: the tables, who is missing, what was written."""
    for s in parts["sections"]:
        s.legend = parts["legend"]
        out.print(section_table(s))
    if collected.diverged:
        out.print(f"diverged, so not in the table: {', '.join(collected.diverged.values())}", highlight=False)
    if collected.running:
        out.print(
            f"still running in another process, so not in the table: {', '.join(collected.running)}", highlight=False
        )
    for name in parts["written"]:
        if (folder / name).exists():
            out.print(f"wrote {folder / name}", highlight=False)


def checks_table(scheme: str, results) -> Table:
    """`posbench check-scheme`: each check, pass or FAIL, and why."""
    t = Table(title=f"check-scheme {escape(scheme)}")
    t.add_column("check", style="bold")
    t.add_column("result")
    t.add_column("reason")
    for r in results:
        t.add_row(r.name, "[green]pass[/]" if r.ok else "[bold red]FAIL[/]", escape(r.reason))
    return t


def status_table(experiment_dir: Path, rows: list[dict]) -> Table:
    t = Table(title=f"{experiment_dir}: {len(rows)} run(s)")
    for c in ("run", "scheme", "seed", "train_len", "state", "detail"):
        t.add_column(c, justify="right" if c in ("seed", "train_len") else "left", no_wrap=c == "run")
    for r in rows:
        state = f"[{STATE_STYLES.get(r['state'], '')}]{r['state']}[/]"
        t.add_row(
            escape(r["run"]), escape(str(r["scheme"])), str(r["seed"]), str(r["train_len"]), state, escape(r["detail"])
        )
    return t


def plain_table(title: str, rows: list[list[str]], left: bool = False) -> Table:
    """A title and rows of text (a header first), the first column (`left`: every one) left-aligned."""
    t = Table(title=escape(title))
    for j, c in enumerate(rows[0]):
        t.add_column(
            escape(c), justify="left" if j == 0 or left else "right", style="bold" if j == 0 and left else None
        )
    for r in rows[1:]:
        t.add_row(*map(escape, r))
    return t


class BarReporter(Reporter):
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


def grid_table(exp: Path, grid, plan) -> Table:
    from posbench.experiment.plan import plan_note

    keys = list(grid[0][0])
    t = Table(title=f"{exp}: {len(grid)} grid point(s), {len(plan)} run(s)")
    t.add_column("run", overflow="fold")
    for k in keys:
        t.add_column(k)
    t.add_column("would")
    settings = {id(exp.cfg): s for s, exp in grid}
    for job in plan:
        point = settings[id(job.point)]
        values = [str(point[k]) for k in keys]
        t.add_row(escape(job.folder.name), *map(escape, values), escape(plan_note(job)))
    return t


STATE_STYLES = {"done": "green", "partial": "yellow", "running": "cyan", "failed": "bold red", "diverged": "red"}


def _backends(rows) -> str:
    return ", ".join(sorted({r["attention"] for r in rows}))


def bench_table(rows, peak, mc, device, peer) -> Table:
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
