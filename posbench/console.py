"""What the command line shows: progress bars and every table a command prints, drawn with rich."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

from rich.console import Console, Group
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column, Table
from rich.text import Text

from posbench.progress import Reporter

out = Console(emoji=False)  # no :b: -> emoji in names such as module:b:c
err = Console(stderr=True, emoji=False)


LONG_HEADER = 24  # a header longer than this (a plugin scheme's module:Class) may fold


def _number_column(t: Table, header: str, cells: list[str], justify: str = "right") -> None:
    """A column of numbers that a narrow console (80 columns when output is redirected) never
    cuts: a cell wraps between its words ("18.80 ±" over "0.15") but no word is split, nor is a
    header's word; only a header longer than LONG_HEADER may fold, and none ends in "…". A table
    with too many such columns for the console is wider than it (see _fitted), never cut."""
    head = max(map(len, header.split("\n")))  # a header may be given in lines
    words = [w for c in cells for w in c.split()] + (header.split() if head <= LONG_HEADER else [])
    widest = max(map(len, words), default=1)
    if all(len(c.split()) <= 1 for c in cells) and head <= LONG_HEADER:
        # nothing to wrap: rich narrows the other columns instead (it narrows only wrapping ones)
        t.add_column(escape(header), justify=justify, no_wrap=True, min_width=max(widest, head))
    else:  # rich may narrow it below its widest word; min_width takes it back
        t.add_column(escape(header), justify=justify, overflow="fold", min_width=widest)


def section_table(section, narrow: bool = False) -> Table:
    """A report section (posbench/measures) as a terminal table, best cells in bold; `narrow`:
    a header breaks after its "/" (ppl(64)/ over ppl(train))."""
    rows = section.terminal or section.rows
    best = section.terminal_best if section.terminal is not None else section.best
    t = Table(title=section.title or section.heading, caption=section.legend)
    for j, c in enumerate(rows[0]):
        if j == 0:
            t.add_column(escape(c), style="bold", no_wrap=True, min_width=max(len(r[0]) for r in rows[1:]))
        else:
            _number_column(t, c.replace("/", "/\n") if narrow else c, [r[j] for r in rows[1:]])
    for i, r in enumerate(rows[1:], start=1):
        t.add_row(*(f"[bold]{escape(c)}[/]" if (i, j) in best and c else escape(c) for j, c in enumerate(r)))
    return t


def _fitted(section, console: Console) -> Table:
    """A section's table for `console`: as it is where it fits; else narrow, its cells wrapped
    between words; and where even that cannot fit (too many lengths), at its full width: wider
    than the console, a row a line, never cut (print it uncropped)."""
    t = section_table(section)
    if Measurement.get(console, console.options.update_width(10**4), t).maximum <= console.width:
        return t
    t = section_table(section, narrow=True)
    need = Measurement.get(console, console.options.update_width(10**4), t)
    if need.minimum > console.width:
        t.width = need.maximum
    return t


def print_report(collected, parts: dict, folder: Path) -> None:
    """`posbench report` and the end of every training command: the tables, who is missing, what was written."""
    if parts is None:  # every run is another process's, still training
        out.print(
            f"{folder}: every run is still running in another process ({', '.join(collected.running)}); "
            f"nothing to report yet: rerun posbench report {folder} once it is done",
            highlight=False,
            soft_wrap=True,
        )
        return
    for s in parts["sections"]:
        s.legend = s.legend or parts["legend"]  # a section with its own note keeps it
        out.print(_fitted(s, out), crop=False)
    if collected.diverged:
        out.print(f"diverged, so not in the table: {', '.join(collected.diverged.values())}", highlight=False)
    if collected.running:
        out.print(
            f"still running in another process, so not in the table: {', '.join(collected.running)}", highlight=False
        )
    if collected.in_part:
        from posbench.report import IN_PART

        out.print(f"{IN_PART}: {', '.join(collected.in_part)}", highlight=False)
    for name in parts["written"]:
        if (folder / name).exists():
            out.print(f"wrote {folder / name}", highlight=False, soft_wrap=True)  # a path unbroken, to copy


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
    """`posbench status`, a line a run in 80 columns: a run's folder name says its scheme and seed
    (and a sweep's grid point, train_len included), so beside it are only its state and detail."""
    lengths = {str(r["train_len"]) for r in rows if r["state"] != "pending"}  # a pending run's is not known
    said = "context" if rows and all(r.get("pretrained") for r in rows) else "train_len"  # a model not trained here
    shared = f", {said} {lengths.pop()}" if len(lengths) == 1 else ""
    t = Table(title=escape(f"{experiment_dir}: {len(rows)} run(s){shared}"))
    longest = max((len(r["run"]) for r in rows), default=0)
    t.add_column("run", no_wrap=longest <= 40, overflow="fold")  # longer: it folds, the detail keeps room
    t.add_column("state", no_wrap=True)
    t.add_column("detail")
    for r in rows:
        state = f"[{STATE_STYLES.get(r['state'], '')}]{r['state']}[/]"
        t.add_row(escape(r["run"]), state, escape(r["detail"]))
    return t


def measure_tables(who: str, scorer, rows: list[dict]) -> list[Table]:
    """A measure's new rows for run `who`: a row per metric and a column per length (labels are
    long, lengths few); for a measure with a second axis (depth), a table per metric, a row per
    value of that axis."""

    def cell(m, v) -> str:
        return f"{m.scale * v:.{m.digits}f}" if v == v else "—"

    if scorer.axis is None:
        table = [["length", *(str(r["length"]) for r in rows)]]
        for n, m in scorer.metrics.items():
            table.append([m.label, *(cell(m, r[n]) for r in rows)])
        table.append(["status", *(r["status"] for r in rows)])
        return [plain_table(f"{scorer.name}: {who}", table)]
    lengths = sorted({r["length"] for r in rows})
    at = {(r[scorer.axis], r["length"]): r for r in rows}
    tables = []
    for n, m in scorer.metrics.items():
        table = [[f"{scorer.axis} \\ length", *map(str, lengths)]]
        for v in sorted({r[scorer.axis] for r in rows}):
            table.append([str(v), *(cell(m, at[v, L][n]) if (v, L) in at else "" for L in lengths)])
        tables.append(plain_table(f"{scorer.name}: {m.label}, {who}", table))
    return tables


def plain_table(title: str, rows: list[list[str]], left: bool = False) -> Table:
    """A title and rows of text (a header first), the first column (`left`: every one) left-aligned,
    its names never cut, and the others numbers, never cut either."""
    t = Table(title=escape(title))
    for j, c in enumerate(rows[0]):
        if j == 0:
            names = max(len(r[0]) for r in rows)
            t.add_column(escape(c), style="bold" if left else None, no_wrap=True, min_width=names)
        elif left:
            t.add_column(escape(c))
        else:
            _number_column(t, c, [r[j] for r in rows[1:]])
    for r in rows[1:]:
        t.add_row(*map(escape, r))
    return t


PLAIN_EVERY_S = 30.0  # without a terminal, a run's progress line at least this often
QUIET_SCORING_S = 10.0  # without a terminal, scoring that ends sooner prints no progress


def _duration(seconds: float) -> str:
    """'40 s', '3 min 20 s', '1 h 05 min'."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class _TimeLeft(TimeRemainingColumn):
    """ "eta 0:00:40" while a run trains, "took 0:01:20" once it is done."""

    def render(self, task):
        return Text(("took " if task.finished else "eta ") + super().render(task).plain, style="progress.remaining")


class BarReporter(Reporter):
    """Each training run's progress, counted ("3 of 8") among the runs the command trains. On a
    terminal, a bar per run with its loss and time left; runs training at once (train.workers)
    get a bar each, live together. Without one (nohup, CI, tee), where bars would show only at
    the end, a plain line each tenth of a run, and at least every PLAIN_EVERY_S seconds."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Optional[Progress] = None
        self.tasks: dict = {}
        self.lines: dict = {}  # without a terminal: label -> what its last line said, and when
        self.runs, self.started = None, 0

    def plan(self, runs):
        self.runs, self.started = runs, 0

    def _counted(self, label: str) -> str:
        self.started += 1
        return label if self.runs is None else f"{label} ({self.started} of {max(self.runs, self.started)})"

    def start(self, label, total):
        name = self._counted(label)
        if not self.console.is_terminal:
            now = time.monotonic()
            self.lines[label] = {"name": name, "total": total, "t0": now, "said": now, "tenth": 0, "step": 0}
            self.say(f"{name}: training, {total:,} steps")
            return
        self.tasks[label] = self._bars().add_task(name, total=total, loss="-")

    def _bars(self) -> Progress:
        """The live bars, started with the first."""
        if self.progress is None:
            self.progress = Progress(  # on a narrow terminal the bar narrows; the label and numbers do not
                TextColumn("{task.description}", table_column=Column(no_wrap=True, min_width=18)),
                BarColumn(),
                MofNCompleteColumn(table_column=Column(no_wrap=True)),
                TextColumn("loss {task.fields[loss]}", table_column=Column(no_wrap=True)),
                _TimeLeft(elapsed_when_finished=True, table_column=Column(no_wrap=True)),
                console=self.console,
            )
            self.progress.start()
        return self.progress

    def step(self, label, step, loss):
        if label in self.lines:
            self._line(self.lines[label], step, loss)
        else:
            self.progress.update(self.tasks[label], completed=step, loss=f"{loss:.3f}")

    def _line(self, run: dict, step: int, loss: float, unit: str = "step") -> None:
        """A line when the run passes a tenth of its steps or PLAIN_EVERY_S since its last line."""
        now = time.monotonic()
        if "first" not in run:  # the time left is timed from here: not the compile, not resumed steps
            run["first"] = now, step
        run["step"] = step
        tenth = step * 10 // max(run["total"], 1)
        if tenth <= run["tenth"] and now - run["said"] < PLAIN_EVERY_S:
            return
        run["tenth"], run["said"] = tenth, now
        t, s = run["first"]
        said = f"{run['name']}: {unit} {step:,}/{run['total']:,}" + (f", loss {loss:.3f}" if loss == loss else "")
        if step >= run["total"]:
            said += f", took {_duration(now - run['t0'])}"
        elif step > s:
            said += f", eta {_duration((now - t) / (step - s) * (run['total'] - step))}"
        self.say(said)

    def finish(self, label):
        if label in self.lines:
            run = self.lines.pop(label)
            if run["step"] < run["total"]:
                self.say(f"{run['name']}: stopped at {run.get('unit', 'step')} {run['step']:,}/{run['total']:,}")
            return
        self.progress.stop_task(self.tasks.pop(label))
        if not self.tasks:  # the bars stay on screen; the next run starts a fresh set
            self.progress.stop()
            self.progress = None

    def scoring(self, label, done, total):
        """A bar per scored run (without a terminal, a line each tenth once it has taken
        QUIET_SCORING_S), its time left timed by tokens: a longer window's tokens cost more, so
        the estimate runs short towards the end."""
        key = f"scoring {label}"
        if key not in self.lines and key not in self.tasks:
            if not self.console.is_terminal:
                now = time.monotonic()
                run = {"name": key, "total": total, "t0": now, "said": now, "tenth": 0, "step": 0}
                self.lines[key] = {**run, "unit": "tokens"}
            else:
                self.tasks[key] = self._bars().add_task(key, total=total, loss="-")
        if key in self.lines:
            self.lines[key]["step"] = done  # said or not: a scoring that reached its total did not stop short
            if time.monotonic() - self.lines[key]["t0"] >= QUIET_SCORING_S:  # a quick scoring says nothing
                self._line(self.lines[key], done, math.nan, "tokens")
        else:
            self.progress.update(self.tasks[key], completed=done)
        if done >= total:
            self.finish(key)

    def say(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def note(self, message):
        self.console.print(message, highlight=False, soft_wrap=True)  # the terminal folds it: no path is cut


def grid_table(exp: Path, grid, plan) -> Table:
    from posbench.experiment.plan import plan_note

    keys = list(grid[0][0])
    t = Table(title=escape(f"{exp}: {len(grid)} grid point(s), {len(plan)} run(s)"))
    settings = {id(exp.cfg): s for s, exp in grid}
    rows = [[job.folder.name, *(str(settings[id(job.point)][k]) for k in keys), plan_note(job)] for job in plan]
    t.add_column("run", overflow="fold")
    for j, k in enumerate(keys, start=1):  # a swept value is never cut
        _number_column(t, k, [r[j] for r in rows], justify="left")
    t.add_column("would")
    for r in rows:
        t.add_row(*map(escape, r))
    return t


STATE_STYLES = {
    "pending": "dim",
    "done": "green",
    "records": "blue",
    "partial": "yellow",
    "damaged": "bold red",
    "running": "cyan",
    "failed": "bold red",
    "diverged": "red",
}


def _backends(rows) -> str:
    return ", ".join(dict.fromkeys(r["attention"] for r in rows))  # in the order they were given


def bench_table(rows, peak, mc, device, peer, rounds: int) -> Group:
    """`posbench bench`: the setting, then training speed and eval memory at each length, two
    tables so that each fits 80 columns with the peer's columns and four lengths (on a GPU a
    third: each length's first forward, which compiles); below them, what the first step is, and
    what a — in the speed table means, where no two of the `rounds` rounds confirmed a time."""
    from posbench.bench import AGREE

    train = [r for r in rows if r["measurement"] == "train"]
    several = len({r["attention"] for r in train}) > 1  # backends side by side: a row is (scheme, backend)

    def who(r) -> str:
        return f"{r['scheme']} {r['attention']}" if several else r["scheme"]

    lengths = sorted({r["eval_len"] for r in rows if r["measurement"] == "eval"})
    mem = {(who(r), r["eval_len"]): r["peak_mem_mb"] for r in rows if r["measurement"] == "eval"}
    where = rows[0]["device"] if rows else str(device)
    if device.type == "cuda":
        where, peak_text = f"{where}, bf16 autocast", f"bf16 matmul peak {_number(peak, 1e12, 'TFLOP/s')}"
    else:
        peak_text = f"fp32 matmul peak {_number(peak, 1e9, 'GFLOP/s')}"

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    speed = [["scheme", "tokens/s", "x NoPE", "MFU", *(["peer tok/s", "x peer"] if peer else []), "first step s"]]
    for r in train:
        small = (r["mfu"] or 1) < 0.1  # a GPU's can be tiny
        mfu = f(r["mfu"], ".2%" if small and r["mfu"] < 0.01 else ".1%" if small else ".0%")
        speed.append([who(r), f(r["tokens_per_s"], ".0f"), f(r["ratio_vs_nope"], ".2f"), mfu])
        if peer:
            speed[-1] += [f(r["peer_tokens_per_s"], ".0f"), f(r["peer_ratio"], ".2f")]
        speed[-1].append(_seconds(r["first_call_s"]))
    memory = [["scheme", *map(str, lengths)]]
    memory += [[who(r), *(f(mem.get((who(r), L)), ".1f") for L in lengths)] for r in train]
    first = {(who(r), r["eval_len"]): r["first_call_s"] for r in rows if r["measurement"] == "eval"}
    timed = any(v is not None for v in first.values())  # on a GPU only: see run_bench
    forward = [["scheme", *map(str, lengths)]]
    forward += [[who(r), *(_seconds(first.get((who(r), L))) for L in lengths)] for r in train]
    compiled = (
        "compiling kernels where the backend does (flex: a later scheme may reuse what an earlier one compiled)"
        if device.type == "cuda"
        else "building posbench's C kernels where none is cached yet (seconds, once: they stay on disk); "
        "otherwise it is warm-up only"
    )
    first_step = (
        f"first step s: each model's first training step, timed alone before the rounds (tokens/s is from the "
        f"steps after it). It pays once for AdamW allocating its state and for {compiled}."
    )
    title = (
        f"posbench bench: {mc.n_layer} layers, d_model {mc.d_model}, {mc.n_head} heads, "
        f"T={mc.train_len}; {where}; attention {_backends(train)}; {peak_text}" + (f"; peer: {peer}" if peer else "")
    )
    if several:  # run_bench's ratios are to NoPE under the first backend
        title += f"; x NoPE: against NoPE under {train[0]['attention']}"
    unconfirmed = [who(r) for r in train if r["tokens_per_s"] is None] + (["the matmul"] if peak is None else [])
    why = (
        f"—: no two of the {rounds} rounds came within {AGREE - 1:.0%} of each other for {', '.join(unconfirmed)} "
        f"(on a busy machine a step can stall many times over), so no time is shown; rerun when the machine "
        f"is quieter, or with more --rounds"
    )
    # the setting is a paragraph above the tables, not a title squeezed to a narrow table's width
    return Group(
        Text(title),
        plain_table("training speed", speed),
        plain_table("peak eval memory (MB), batch 1", memory),
        *([plain_table("first forward (s), batch 1, compilation included", forward)] if timed else []),
        Text(first_step),
        *([Text(why)] if unconfirmed else []),
    )


def _seconds(value) -> str:
    """A first call's seconds: to the millisecond below 10 s, to the tenth above (compiling)."""
    return "—" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _number(value, unit: float, name: str) -> str:
    return "—" if value is None else f"{value / unit:.0f} {name}"
