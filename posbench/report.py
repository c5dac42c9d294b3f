"""The report pipeline: run folders on disk -> one comparison, for every measure. No torch.

`collect` reads an experiment's run folders once: diverged runs are named, runs another
process holds are "running", an unfinished run is one line saying how to finish it. `join`
checks once what several experiments must share. The run's measure builds the sections
(tables and their cells); this module writes them as summary.csv, .md, .tex and plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from posbench.config import differences, identity, shared_identity
from posbench.errors import PosbenchError
from posbench.experiment.records import (
    CONFIG,
    DIVERGED,
    EVAL,
    SWEEP_RECORD,
    WEIGHTS,
    diverged_step,
    lock_file,
    read_config,
    trained_with,
)
from posbench.files import atomic, lock_holder, write_atomic
from posbench.measures import Measure, measure_for
from posbench.tables import latex_table, markdown_table, point_labels


@dataclass
class Run:
    folder: Path
    cfg: object
    rows: list[dict]
    trained_with: Optional[str]
    experiment: int = 0  # its experiment's place in a join: a joined table lists each one's schemes in turn


@dataclass
class Collected:
    """The evaluated runs of one or more experiments, and the ones left out, with why."""

    measure: Measure
    runs: list[Run] = field(default_factory=list)
    diverged: dict = field(default_factory=dict)  # run folder name -> 'alibi seed 1 at step 12'
    running: list = field(default_factory=list)  # run folders another process holds
    points: dict = field(default_factory=dict)  # run folder -> its grid point ('' for none)


def collect(exp_dir: Path) -> Collected:
    """Every run of one experiment folder. A sweep's folder (it holds sweep.yaml) may hold runs
    trained under other settings: each names its grid point; elsewhere they are refused."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise PosbenchError(f"{exp_dir}: no such experiment directory")
    sweep = (exp_dir / SWEEP_RECORD).is_file()
    out, first, kinds = None, None, {}
    diverged, running = {}, []
    for rdir in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        has = {f: (rdir / f).is_file() for f in (CONFIG, EVAL, WEIGHTS)}
        if (rdir / DIVERGED).is_file() and not has[WEIGHTS]:  # no weights, no rows: named, not scored
            c = read_config(rdir)
            diverged[rdir.name] = f"{c.schemes[0]} seed {c.seeds[0]} {diverged_step(rdir)}"
            continue
        if not any(has.values()):
            continue  # not a run folder
        if not (has[CONFIG] and has[EVAL]):
            if lock_holder(lock_file(rdir)) is not None:
                running.append(rdir.name)  # another process is training or scoring it
                continue
            lacks = " and ".join(f for f in (CONFIG, EVAL) if not has[f])
            finish = f"posbench evaluate {rdir}" if has[WEIGHTS] else "posbench extrapolate (or train) again"
            raise PosbenchError(
                f"{rdir}: a run folder without {lacks}; finish it with {finish}, or move it out of {exp_dir}"
            )
        cfg = read_config(rdir)
        measure = measure_for(cfg)
        kinds.setdefault(type(measure), rdir)
        if len(kinds) > 1:  # perplexity and exact match share no table
            (a, b) = kinds.values()
            raise PosbenchError(
                f"this report mixes runs scored by {type(measure).name} and by another measure "
                f"(e.g. {a} and {b}); report them apart"
            )
        part = shared_identity(measure.identity(identity(cfg)))
        if first is None:
            first, out = (rdir, part), Collected(measure)
        elif part != first[1] and not sweep:
            diff = differences(first[1], part, (first[0].name, f"in {rdir.name}"))
            raise PosbenchError(
                f"{exp_dir}: runs trained under different settings ({', '.join(diff)}); "
                f"a table compares runs that differ only in scheme and seed"
            )
        out.runs.append(Run(rdir, cfg, measure.read(rdir), trained_with(rdir)))
        out.points[rdir] = part
    if out is None:
        if diverged:
            raise PosbenchError(f"{exp_dir}: every run diverged ({', '.join(diverged.values())}); lower train.lr")
        raise PosbenchError(f"{exp_dir}: holds no evaluated runs (run folders with config.yaml and eval.csv)")
    out.points = point_labels(out.points)
    out.diverged, out.running = diverged, running
    return out


def join(collected: list[Collected], dirs: list[Path]) -> Collected:
    """Several experiments as one comparison: refused unless they are scored by one measure,
    share what it names (training length, protocols...) and hold no (scheme, seed) twice."""
    if len(collected) == 1:
        return collected[0]
    first, name = collected[0], dirs[0].name
    for other, d in zip(collected[1:], dirs[1:]):
        if type(other.measure) is not type(first.measure):
            raise PosbenchError(
                f"this report mixes runs scored by {first.measure.name} (e.g. {first.runs[0].folder}) with runs "
                f"scored by {other.measure.name} (e.g. {other.runs[0].folder}); report them apart"
            )
        a_rows = [r for run in first.runs for r in run.rows]
        b_rows = [r for run in other.runs for r in run.rows]
        for (what, a), (_, b) in zip(first.measure.join_checks(a_rows), first.measure.join_checks(b_rows)):
            if a != b:
                raise PosbenchError(
                    f"cannot join {name} and {d.name}: their {what} differ ({_listed(a)} against {_listed(b)})"
                )
        mine = {(run.cfg.schemes[0], run.cfg.seeds[0]) for run in first.runs}
        clash = mine & {(run.cfg.schemes[0], run.cfg.seeds[0]) for run in other.runs}
        if clash:
            s, n = sorted(clash)[0]
            raise PosbenchError(f"cannot join {name} and {d.name}: both hold {s} seed {n}")
    joined = Collected(first.measure)
    for i, c in enumerate(collected):
        for run in c.runs:
            run.experiment = i
        joined.runs += c.runs
        joined.diverged.update(c.diverged)
        joined.running += c.running
        joined.points.update(c.points)
    return joined


def _listed(values: set) -> str:
    from posbench.measures.perplexity import protocol_label

    return ", ".join(protocol_label(*v) if isinstance(v, tuple) else str(v) for v in sorted(values, key=str))


def write_summary(
    exp_dirs,
    metric: Optional[str] = None,
    transpose: bool = False,
    out: Optional[Path] = None,
    buckets: Optional[list[int]] = None,
) -> tuple[Collected, dict, Path]:
    """summary.csv, summary.md, summary.tex and the plots, from the run folders of one
    experiment, or of several joined into one comparison (written to `out`, by default a
    folder beside the first named after them all). Returns what was collected, the report's
    parts (title, sections...) and the folder written."""
    dirs = _dirs(exp_dirs)
    collected = join([collect(d) for d in dirs], dirs)
    parts = collected.measure.report(collected, metric, transpose, buckets)
    folder = summary_dir(dirs, out)
    folder.mkdir(parents=True, exist_ok=True)
    frame, columns = parts["csv"]
    with atomic(folder / "summary.csv") as tmp:
        frame.to_csv(tmp, index=False, columns=columns)
    write_atomic(folder / "summary.md", markdown(parts, collected))
    write_atomic(
        folder / "summary.tex",
        "\n".join(line for s in parts["sections"] for line in latex_table(s.rows, s.best, s.caption)),
    )
    parts["written"] = ["summary.csv", "summary.md", "summary.tex", *parts["plots"](folder)]
    return collected, parts, folder


def markdown(parts: dict, collected: Collected) -> str:
    """summary.md: what was run, then a table per section."""
    out = [f"# {parts['title']}", "", *parts["describe"]]
    if collected.diverged:
        out.append(f"- diverged, so not in the tables: {', '.join(collected.diverged.values())}")
    if collected.running:
        out.append(f"- still running in another process, so not in the tables: {', '.join(collected.running)}")
    for s in parts["sections"]:
        out += ["", f"## {s.heading}", "", *markdown_table(s.rows, s.best)]
    return "\n".join(out) + "\n"


def _dirs(exp_dirs) -> list[Path]:
    return [Path(d) for d in ([exp_dirs] if isinstance(exp_dirs, (str, Path)) else exp_dirs)]


def summary_dir(exp_dirs, out: Optional[Path] = None) -> Path:
    """Where write_summary writes: `out`, the one experiment's folder, or, for several joined,
    a folder beside the first named after them all (results/a+b)."""
    dirs = _dirs(exp_dirs)
    if out:
        return Path(out)
    return dirs[0] if len(dirs) == 1 else dirs[0].parent / "+".join(d.name for d in dirs)
