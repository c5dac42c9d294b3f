"""The report pipeline: run folders on disk -> one comparison, for every measure. No torch.

`collect` reads an experiment's run folders once: diverged runs are named, runs another
process holds are "running", an unfinished run is one line saying how to finish it. `join`
checks once what several experiments must share. The run's measure builds the sections
(tables and their cells); this module writes them as summary.csv, .md, .tex and plots.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from posbench.compare.render import latex_table, markdown_table
from posbench.config import differences, flat, identity, shared_identity
from posbench.errors import PosbenchError
from posbench.experiment.records import (
    CONFIG,
    EVAL,
    SWEEP_RECORD,
    WEIGHTS,
    data_read,
    diverged_at,
    diverged_step,
    last_logged,
    read_config,
    run_state,
    trained_with,
    weights_record,
    where_computed,
)
from posbench.extend.methods import EXTEND_RECORD
from posbench.files import together
from posbench.measures import Measure, plugin
from posbench.registry import named_by
from posbench.schemes import run_label
from posbench.tables import options_apart, point_labels
from posbench.tasks import task_for


@dataclass
class Run:
    folder: Path
    cfg: object
    rows: list[dict]
    trained_with: Optional[str]
    experiment: int = 0  # its experiment's place in a join: a joined table lists each one's schemes in turn
    where: tuple = (None, ())  # records.where_computed: where it was trained, and where scored


@dataclass
class Collected:
    """The evaluated runs of one or more experiments, and the ones left out, with why."""

    measure: Optional[Measure]  # None when every run is still running in another process
    runs: list[Run] = field(default_factory=list)
    diverged: dict = field(default_factory=dict)  # run folder name -> 'alibi seed 1 at step 12'
    running: list = field(default_factory=list)  # run folders another process holds
    in_part: list = field(default_factory=list)  # run folders whose scoring was stopped part way (scoring.txt)
    points: dict = field(default_factory=dict)  # run folder -> its grid point ('' for none)
    parts: dict = field(default_factory=dict)  # run folder -> what its experiment's runs share


IN_PART = "scored in part, so some of their rows are missing (rerun the command that scored them)"


def collect(exp_dir: Path) -> Collected:
    """Every run of one experiment folder. A sweep's folder (it holds sweep.yaml) may hold runs
    trained under other settings: each names its grid point; elsewhere they are refused."""
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        what = "is a file, not an experiment folder" if exp_dir.exists() else "no such experiment directory"
        raise PosbenchError(f"{exp_dir}: {what}")
    if run_state(exp_dir).here:  # a run, not an experiment: its experiment holds its table
        raise PosbenchError(
            f"{exp_dir} is one run; its table is its experiment's: posbench report {exp_dir.parent} "
            f"(posbench evaluate {exp_dir} scores it again)"
        )
    sweep = (exp_dir / SWEEP_RECORD).is_file()
    extension = (exp_dir / EXTEND_RECORD).is_file()  # parents and their fine-tuned children: one table
    out, first, kinds = None, None, {}
    diverged, running, in_part = {}, [], []
    for rdir in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        run = run_state(rdir)
        if run.state == "diverged":  # no weights, no rows: named, not scored
            c = read_config(rdir)
            diverged[rdir.name] = f"{c.schemes[0]} seed {c.seeds[0]} {diverged_step(rdir)}"
            continue
        if not run.here:
            continue  # not a run folder
        if not run.scored:
            if run.holder is not None:
                running.append(rdir.name)  # another process is training or scoring it
                continue
            lacks = " and ".join(f for f in (CONFIG, EVAL) if not (rdir / f).is_file())
            in_the_way = [f for f in (CONFIG, EVAL) if (rdir / f).exists() and not (rdir / f).is_file()]
            if in_the_way:  # no command can write the record there
                where = rdir / in_the_way[0]
                raise PosbenchError(
                    f"{where}: not a file; restore the run's record, or move {rdir.name} out of {exp_dir}"
                )
            finish = f"posbench evaluate {rdir}" if run.trained else "posbench extrapolate (or train) again"
            model = None if run.trained else _pretrained_model(rdir)
            if model:  # a stopped `posbench pretrained`, which trains nothing
                finish = f"posbench pretrained {model} --name {exp_dir.name} again"
            raise PosbenchError(
                f"{rdir}: a run folder without {lacks}; finish it with {finish}, or move it out of {exp_dir}"
            )
        cfg = read_config(rdir)
        measure, part = table_share(cfg, rdir)
        kinds.setdefault(type(measure), rdir)
        if len(kinds) > 1:  # perplexity and exact match share no table
            (a, first_dir), (b, other_dir) = kinds.items()
            raise PosbenchError(
                f"this report mixes runs scored by {a.name} (e.g. {first_dir}) with runs scored by {b.name} "
                f"(e.g. {other_dir}); report them apart"
            )
        if first is None:
            first, out = (rdir, part), Collected(measure)
        elif part != first[1] and not (sweep or extension):
            diff = differences(first[1], part, (first[0].name, f"in {rdir.name}"))
            raise PosbenchError(
                f"{exp_dir}: runs trained under different settings ({', '.join(diff)}); "
                f"a table compares runs that differ only in scheme and seed"
            )
        rows = check_rows(rdir, cfg, measure.read(rdir))
        if run.scoring and run.holder is None:  # its rows are tabled, and the ones missing said
            in_part.append(rdir.name)
        out.runs.append(Run(rdir, cfg, rows, trained_with(rdir), where=where_computed(rdir)))
        out.parts[rdir] = part
    for lock in sorted(exp_dir.glob(".*.lock")):  # a run still training has no folder of its own yet
        name = lock.name[1 : -len(".lock")]
        if not (exp_dir / name).exists() and run_state(exp_dir / name).state == "running":
            running.append(name)
    if out is None and running:  # nothing to table yet: another process is training every run
        return Collected(None, diverged=diverged, running=running)
    if out is None:
        if diverged:
            first = all(diverged_at(exp_dir / name) == 0 for name in diverged)  # before any update: not the rate
            why = "their first loss, before any update, is not finite: no learning rate changes that"
            raise PosbenchError(
                f"{exp_dir}: every run diverged ({', '.join(diverged.values())}); {why if first else 'lower train.lr'}"
            )
        raise PosbenchError(f"{exp_dir}: holds no evaluated runs (run folders with config.yaml and eval.csv)")
    _check_one_corpus(exp_dir, out)
    out.points = dict.fromkeys(out.parts, "") if extension else options_apart(point_labels(out.parts), out.runs)
    holds: dict[tuple, Path] = {}
    for run in out.runs:  # one row per (scheme, seed) and point: a copied run folder would make two
        key = (out.points[run.folder], run_label(run.cfg.model), run.cfg.seeds[0])
        if key in holds:
            at = f" at {key[0]}" if key[0] else ""
            raise PosbenchError(
                f"{exp_dir}: {holds[key].name} and {run.folder.name} both hold {key[1]} seed {key[2]}{at}; "
                "move one of them out"
            )
        holds[key] = run.folder
    out.diverged, out.running, out.in_part = diverged, running, in_part
    return out


def check_rows(rdir: Path, cfg, rows: list[dict]) -> list[dict]:
    """A run's rows, refused where they are not its config's (a record edited by hand, or another
    run's file copied in): another training length, scheme or seed than config.yaml says, or a
    training log that ends at another step than its train.steps."""
    scored_at = {int(r["train_len"]) for r in rows if r.get("train_len")}
    if scored_at - {cfg.model.train_len}:
        raise PosbenchError(
            f"{rdir}: its rows were scored at train_len {min(scored_at - {cfg.model.train_len})}, but its "
            f"config.yaml says {cfg.model.train_len}; restore config.yaml's model.train_len"
        )
    last = last_logged(rdir)
    if last is not None and last["step"] + 1 != cfg.train.steps:  # what a table says of its training is config.yaml's
        raise PosbenchError(
            f"{rdir}: its config.yaml says train.steps {cfg.train.steps}, but its train_log.jsonl ends at "
            f"step {last['step'] + 1}; restore config.yaml's train.steps"
        )
    label, seed = run_label(cfg.model), cfg.seeds[0]
    theirs = {r["scheme"] for r in rows if r.get("scheme")}  # label, or label+variant (a pretrained name may hold "+")
    other = sorted(s for s in theirs if s != label and not s.startswith(f"{label}+"))
    seeds = sorted({int(r["seed"]) for r in rows if r.get("seed") not in (None, "")} - {seed})
    if other or seeds:
        said = f"scheme {other[0]}" if other else f"seed {seeds[0]}"
        raise PosbenchError(
            f"{rdir}: its rows are of {said}, but its config.yaml says {label} seed {seed}: another run's "
            f"records; restore the run's own, or delete its {EVAL} and score it again with posbench evaluate"
        )
    marks = sorted({r["weights"] for r in rows if r.get("weights")})
    if marks:  # rows name the weights that scored them: model.pt's, or at least one set
        record = weights_record(rdir) if (rdir / WEIGHTS).is_file() else None
        own = record["sha256"][:16] if record is not None and isinstance(record.get("sha256"), str) else None
        other = [m for m in marks if m != own] if own else marks[1:]
        if other:
            whose = f"its {WEIGHTS}'s ({own})" if own else "its other rows'"
            raise PosbenchError(
                f"{rdir}: its {EVAL} holds rows scored by other weights ({other[0]}) than {whose}: another run's "
                f"records; restore the run's own, or delete its {EVAL} and score it again with posbench evaluate"
            )
    return rows


def _check_one_corpus(exp_dir: Path, collected: Collected) -> None:
    """Runs that share their settings (all of an experiment's; a sweep's at one grid point) read
    one corpus, by its sha256 in their data.json: else a table would compare models trained on
    two texts under one corpus line."""
    first: dict[str, tuple[Path, tuple]] = {}
    for run in collected.runs:
        read = data_read(run.folder)
        if read is None:
            continue
        key = repr(sorted(collected.parts[run.folder].items(), key=str))
        seen, was = first.setdefault(key, (run.folder, read))
        if was[1] != read[1]:
            raise PosbenchError(
                f"{exp_dir}: {seen.name} read {was[0]} with sha256 {was[1][:12]}, {run.folder.name} read "
                f"{read[0]} with sha256 {read[1][:12]}: a table compares runs trained on one corpus; move one out, "
                f"or train it again on the other's data"
            )


def table_share(cfg, rdir: Optional[Path] = None) -> tuple[Measure, dict]:
    """What a run shares with every run of its table: the measure that scores it, and its
    settings but for scheme and seed. Reading a run folder (`rdir`), a task of the user's is
    imported to learn its lengths: said first."""
    with named_by(rdir) if rdir is not None else contextlib.nullcontext():
        task = task_for(cfg)
    return task.measure(), shared_identity(task.identity(identity(cfg)))


def check_joins(exp_dir: Path, cfg, rdir: Path) -> None:
    """Refuse, before run folder `rdir` is written into `exp_dir`, a run that collect would refuse
    to table beside the runs already there (trained under other settings, or scored by another
    measure), so that a refused run leaves the folder as it was."""
    if not exp_dir.is_dir() or (exp_dir / SWEEP_RECORD).is_file() or (exp_dir / EXTEND_RECORD).is_file():
        return
    measure, part = table_share(cfg)
    for other in sorted(p for p in exp_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p != rdir):
        if not run_state(other).scored:
            continue
        their_measure, their_part = table_share(read_config(other), other)
        if (type(their_measure), their_part) != (type(measure), part):
            diff = differences(their_part, part, (other.name, "here")) or [f"scored by {their_measure.name}"]
            raise PosbenchError(
                f"{exp_dir} holds runs its table could not join with this one ({', '.join(diff[:3])}); "
                "write it to another folder (--name) and join the two with posbench report A B"
            )
        return  # the runs already there agree among themselves, as collect checks


def _pretrained_model(rdir: Path) -> Optional[str]:
    """The model's path, where the run folder's config.yaml says it holds a pretrained model's scores."""
    from posbench.config import read_record

    try:
        pre = read_record(rdir / CONFIG).get("model", {}).get("pretrained")
    except (PosbenchError, OSError, AttributeError):
        return None  # no record to read: a training command's folder, as far as anyone can tell
    return pre.get("path") if isinstance(pre, dict) else None


def join(collected: list[Collected], dirs: list[Path], metric: Optional[str] = None) -> Collected:
    """Several experiments as one comparison: refused unless they are scored by one measure,
    share what it names (training length, protocols...) and hold no (scheme, seed) twice. Where
    they differ only in settings the `metric` compares across (bits per byte: the tokenizer),
    each setting is a grid point: a table each."""
    if len(collected) == 1:
        return collected[0]
    first, name = collected[0], dirs[0].name
    compares = getattr(first.measure.metrics.get(metric or ""), "compares", ())
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
                    f"cannot join {name} and {d.name}: their {what} differ "
                    f"({', '.join(map(str, sorted(a, key=str)))} against {', '.join(map(str, sorted(b, key=str)))})"
                )
        made = [{bool(run.cfg.model.pretrained) for run in c.runs} for c in (first, other)]
        if made[0] != made[1]:  # its settings are the model's own, not a training budget to compare
            pre = name if True in made[0] else d.name
            raise PosbenchError(
                f"cannot join {name} and {d.name}: {pre} holds pretrained models, scored here but not trained; "
                "a joined table compares runs trained alike, so report them apart"
            )
        ours, theirs = _settings(first, compares), _settings(other, compares)
        if ours != theirs:  # a row's header would name one budget for runs trained under another
            a, b = next((a, b) for a, b in zip(ours, theirs) if a != b) if len(ours) == len(theirs) else (ours, theirs)
            diff = differences(a, b, (name, f"in {d.name}")) if isinstance(a, dict) else ["their grid points differ"]
            across = [
                m.name
                for m in first.measure.metrics.values()
                if m.compares and any(k in " ".join(diff) for k in m.compares)
            ]
            hint = f"; in {across[0]} they compare: --metric {across[0]}" if across and not compares else ""
            raise PosbenchError(
                f"cannot join {name} and {d.name}: they were trained under different settings ({', '.join(diff)}); "
                f"a joined table compares runs that differ only in scheme and seed{hint}"
            )
        apart = _settings(first) != _settings(other)  # in what the metric compares across: points apart
        mine = {(run.cfg.schemes[0], run.cfg.seeds[0]) for run in first.runs}
        clash = set() if apart else mine & {(run.cfg.schemes[0], run.cfg.seeds[0]) for run in other.runs}
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
        joined.in_part += c.in_part
        joined.points.update(c.points)
        joined.parts.update(c.parts)
    if any(_settings(c) != _settings(first) for c in collected[1:]):  # a table per tokenizer, say
        joined.points = options_apart(point_labels(joined.parts), joined.runs)
    return joined


def _settings(c: Collected, leaving: tuple[str, ...] = ()) -> list[dict]:
    """What an experiment's runs share, once per grid point, in a fixed order, but for the
    settings in `leaving`."""
    unique = {}
    for part in c.parts.values():
        kept = {k: v for k, v in flat(part).items() if k not in leaving}
        unique[repr(sorted(kept.items(), key=str))] = kept
    return [unique[k] for k in sorted(unique)]


def write_summary(
    exp_dirs,
    metric: Optional[str] = None,
    transpose: bool = False,
    out: Optional[Path] = None,
    buckets: Optional[list[int]] = None,
    asked=None,
) -> tuple[Collected, dict, Path]:
    """summary.csv, summary.md, summary.tex and the plots, from the run folders of one
    experiment, or of several joined into one comparison (written to `out`, by default a
    folder beside the first named after them all); `asked`, the config a training command ran,
    keeps to the rows it asked for where `posbench evaluate` scored more. Returns what was
    collected, the report's parts (title, sections...) and the folder written."""
    dirs = _dirs(exp_dirs)
    every = [collect(d) for d in dirs]
    folder = summary_dir(dirs, out)
    scored = [(c, d) for c, d in zip(every, dirs) if c.runs]
    if not scored:  # every run is still another process's
        return Collected(None, running=[r for c in every for r in c.running]), None, folder
    collected = join([c for c, _ in scored], [d for _, d in scored], metric)
    for c in every:
        if not c.runs:
            collected.running += c.running
    if asked is not None:
        for run in collected.runs:
            run.rows = collected.measure.asked(run.rows, asked)
    parts = collected.measure.report(collected, metric, transpose, buckets)
    stem = "summary" if out else view(collected.measure, metric, transpose, buckets)
    extra, frames, panels, lines = plugin.report(collected)  # what users' measures scored, after the run's own
    parts["sections"] += extra
    parts["describe"] = parts["describe"] + lines
    folder.mkdir(parents=True, exist_ok=True)
    frame, columns = parts["csv"]
    with together(folder) as stage:  # a report stopped part way leaves the earlier one whole
        frame.to_csv(stage / f"{stem}.csv", index=False, columns=columns)
        (stage / f"{stem}.md").write_text(markdown(parts, collected))
        (stage / f"{stem}.tex").write_text(
            "\n".join(line for s in parts["sections"] for line in latex_table(s.rows, s.best, s.caption)),
        )
        parts["written"] = [f"{stem}.csv", f"{stem}.md", f"{stem}.tex", *parts["plots"](stage, stem)]
        if stem == "summary":  # a view changes the run's own tables alone
            for name, rows in frames.items():
                rows.to_csv(stage / f"{name}.csv", index=False)
            parts["written"] += [f"{name}.csv" for name in frames] + plugin.write_plots(panels, stage)
    return collected, parts, folder


def view(measure: Measure, metric: Optional[str], transpose: bool, buckets: Optional[list[int]]) -> str:
    """The name a report's files take: summary for the experiment's own tables, or, for another
    view (another metric, buckets, transposed), summary-<view> beside them, never over them."""
    default = next(iter(measure.metrics))
    parts = [metric] if metric not in (None, default) else []
    parts += ["buckets-" + "-".join(map(str, buckets))] if buckets is not None else []
    parts += ["transposed"] if transpose else []
    return "-".join(["summary", *parts])


def markdown(parts: dict, collected: Collected) -> str:
    """summary.md: what was run, then a table per section."""
    out = [f"# {parts['title']}", "", *parts["describe"]]
    where = where_note(collected.runs)
    if where:
        out.append(f"- computed: {where}")
    if collected.diverged:
        out.append(f"- diverged, so not in the tables: {', '.join(collected.diverged.values())}")
    if collected.running:
        out.append(f"- still running in another process, so not in the tables: {', '.join(collected.running)}")
    if collected.in_part:
        out.append(f"- {IN_PART}: {', '.join(collected.in_part)}")
    for s in parts["sections"]:
        out += ["", f"## {s.heading}", "", *markdown_table(s.rows, s.best)]
    return "\n".join(out) + "\n"


def where_note(runs: list[Run]) -> Optional[str]:
    """Where the runs were trained and scored, from their logs (the device decides the precision:
    bf16 autocast on a GPU): one place for all, or each place with its runs; None where no log
    says (records written before they did)."""
    phases: dict[str, dict[str, list[str]]] = {"trained": {}, "scored": {}}
    for run in runs:
        trained, scored = run.where
        if not run.cfg.model.pretrained:
            phases["trained"].setdefault(trained or "unrecorded", []).append(run.folder.name)
        for where in scored or ["unrecorded"]:
            phases["scored"].setdefault(where, []).append(run.folder.name)
    places = set(phases["trained"]) | set(phases["scored"])
    if places <= {"unrecorded"}:
        return None
    if len(places) == 1:
        return f"on {places.pop()} (every run, {' and '.join(p for p, held in phases.items() if held)})"

    def on(place: str, runs: list[str], every: bool) -> str:
        where = "with no record" if place == "unrecorded" else f"on {place}"
        return f"{where} ({'every run' if every else ', '.join(sorted(runs))})"

    said = [
        f"{phase} " + " and ".join(on(place, runs, len(held) == 1) for place, runs in sorted(held.items()))
        for phase, held in phases.items()
        if held
    ]
    return "; ".join(said)


def _dirs(exp_dirs) -> list[Path]:
    return [Path(d) for d in ([exp_dirs] if isinstance(exp_dirs, (str, Path)) else exp_dirs)]


def summary_dir(exp_dirs, out: Optional[Path] = None) -> Path:
    """Where write_summary writes: `out`, the one experiment's folder, or, for several joined,
    a folder beside the first named after them all (results/a+b)."""
    dirs = _dirs(exp_dirs)
    if out:
        return _report_folder(Path(out), dirs)
    return dirs[0] if len(dirs) == 1 else dirs[0].parent / "+".join(d.name for d in dirs)


def _report_folder(out: Path, sources: list[Path]) -> Path:
    """`--out` as a folder the report may fill: not a file, not a file's name (summary.md goes
    inside it), and not a run or another experiment, whose own summary it would replace."""
    if out.exists() and not out.is_dir():
        raise PosbenchError(f"--out {out}: is a file; the report's tables and plots go into a folder")
    if not out.exists() and out.suffix.lower() in (".md", ".csv", ".tex", ".png", ".pdf"):
        raise PosbenchError(f"--out {out}: names a folder for summary.md, .csv, .tex and the plots, not a file")
    if out.is_dir() and all(out.resolve() != d.resolve() for d in sources):
        if (out / CONFIG).is_file():
            raise PosbenchError(f"--out {out}: is a run's folder; give a folder of its own for the report")
        if any((d / CONFIG).is_file() for d in out.iterdir() if d.is_dir()):
            raise PosbenchError(f"--out {out}: holds another experiment's runs, whose summary it would replace")
    return out
