"""Measures beside a run's own: posbench's by name, or a user's module:Class.

Measures beside a run's own, posbench's by name (MEASURES: context_gain, key_tokens, retrieval, retrieval_short) or a
user's (module:Class): a model judged by another number, its records beside the run's own,
tabled, plotted and sent to trackers by the comparison engine.

`posbench evaluate RUN --measure examples.my_measure:NextByteAccuracy` imports the class, hands
it the run's model and data (a `ScoringRun`) and writes what it returns, a row per length, into
RUN/measures/<name>.csv, with RUN/measures/<name>.json naming its metrics (label, direction,
digits), so that reports read them with no import of the user's code. Every report of the
experiment then holds a table per metric with intervals over seeds, a plot and LaTeX.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd

from posbench.errors import PosbenchError, did_you_mean
from posbench.files import write_atomic, write_rows
from posbench.measures.base import Metric, Scorer, ScoringRun, Section
from posbench.registry import Registry

FOLDER = "measures"  # in a run folder: <name>.csv and <name>.json per user measure
KEYS = ["scheme", "seed", "train_len", "length", "status", "attention"]  # every row's, before its metrics
CI = "ci_"  # a metric's interval over a run's own samples, in the column ci_<metric>
OWN = "own_ci"  # a report's mark on the rows of a pretrained model whose records hold ci_<metric>
# what a report writes or reads beside a measure's <name>.csv and <name>.png in an experiment
# folder (and summary-*, a view's tables): a measure of one of these names would overwrite them
RESERVED = ("summary", "eval", "positions", "training", "steps", "rope_law", "runs", "sweep", "extend", "bench")


# posbench's own measures, by name; a user's is named as module:Class
MEASURES = Registry(
    "measure",
    {
        "context_gain": "posbench.measures.context:ContextGain",
        "key_tokens": "posbench.measures.context:KeyTokens",
        "retrieval": "posbench.measures.retrieval:Retrieval",
        "retrieval_short": "posbench.measures.retrieval:ShortRetrieval",
    },
    "posbench.measures.base:Scorer",
    "examples.my_measure:NextByteAccuracy",
)


class Records(NamedTuple):
    """A run's records of one user measure, as read back."""

    spec: str  # its module:Class
    metrics: dict[str, Metric]
    rows: list[dict]
    axis: Optional[str] = None  # its second axis, a column beside length, or none
    options: Optional[dict] = None  # what it scored with, its `options`
    samples: Optional[str] = None  # what its ci_<metric> columns are over (windows), where it has them


def keys(axis: Optional[str]) -> list[str]:
    """A row's columns before its metrics: KEYS, with a measure's second axis after the length."""
    return KEYS if axis is None else KEYS[:4] + [axis] + KEYS[4:]


def columns(axis: Optional[str], metrics, cis: list[str]) -> list[str]:
    """A measure's records' columns: keys, its metrics, then ci_<metric> for each metric that has
    an interval over the run's own samples, in the metrics' order."""
    return keys(axis) + list(metrics) + cis


def load_measure(spec: str, options: Optional[dict] = None, where: str = "--measure-option") -> Scorer:
    """The measure `spec` names (one of MEASURES, or a user's module:Class), checked, built
    with `options` (key -> value) over its defaults; an error names `where` they came from."""
    cls = MEASURES.lookup(spec)
    options = options or {}
    for key, value in options.items():
        default = cls.options.get(key, ...)
        if default is ...:
            valid = ", ".join(cls.options)
            raise PosbenchError(f"{_at(where, key)}: not an option of measure {spec}; valid: {valid}", _key(where))
        want = float if isinstance(default, float) else type(default)
        if default is not None and not isinstance(value, (int, float) if want is float else want):
            raise PosbenchError(f"{_at(where, key)}: expected {want.__name__}, got {value!r}", _key(where))
    try:
        measure = cls(**options) if options else cls()
    except PosbenchError as e:  # an option the class refuses: "k: 1 is not a length ..."
        raise PosbenchError(_at(where, str(e)), _key(where)) from None
    if not measure.name or not measure.name.replace("_", "").isalnum():
        raise PosbenchError(f"measure '{spec}': its name {measure.name!r} must be a word (letters, digits, _)")
    taken = measure.name in RESERVED or measure.name.startswith("summary")
    # posbench's own measure under its own name: named, spelled module:Class, or subclassed (other defaults)
    own = measure.name not in MEASURES or isinstance(measure, MEASURES.lookup(measure.name))
    if taken or not own:
        what = "a file a report writes" if taken else "posbench's own measure"
        raise PosbenchError(f"measure '{spec}': its name {measure.name!r} is {what}; give the measure another name")
    if not measure.metrics or not all(isinstance(m, Metric) for m in measure.metrics.values()):
        raise PosbenchError(f"measure '{spec}': metrics must name at least one Metric")
    return measure


def _at(where: str, key: str) -> str:
    """'--measure-option k' where a flag gave it, 'eval.measure_options.k' where a config did."""
    return f"{where} {key}" if where.startswith("--") else f"{where}.{key}"


def _key(where: str) -> Optional[str]:
    """The config key an option's error is blamed on (None where a flag gave it: it names itself)."""
    return None if where.startswith("--") else where


def load_measures(specs: list[str], options: dict, where: str = "--measure-option") -> list[tuple[str, Scorer]]:
    """Each measure of `specs` with the `options` it has (key=value goes to every measure named
    that has the key); a key that none has is one line naming theirs. `where`: what gave them."""
    classes = {spec: MEASURES.lookup(spec) for spec in specs}
    known = {key for cls in classes.values() for key in cls.options}
    unknown = [key for key in options if key not in known]
    if unknown:
        valid = ", ".join(sorted(known)) or "none"
        raise PosbenchError(
            f"{_at(where, unknown[0])}: no option of {', '.join(specs)}{did_you_mean(unknown[0], known)}; "
            f"valid: {valid}",
            _key(where),
        )
    out = []
    for spec, cls in classes.items():
        mine = {k: v for k, v in options.items() if k in cls.options}
        # a list option given one value (k=64) is a list of one
        mine = {k: [v] if isinstance(cls.options[k], list) and not isinstance(v, list) else v for k, v in mine.items()}
        out.append((spec, load_measure(spec, mine, where)))
    return out


def score_into(measure: Scorer, spec: str, run: ScoringRun, rdir: Path) -> list[dict]:
    """Score `run` by the user's measure and write its records into the run folder `rdir` (a row
    per length; the whole file anew). Returns the rows."""
    import dataclasses

    import torch

    from posbench.device import computed_on
    from posbench.experiment.records import log_scoring
    from posbench.schemes import run_label

    axis = measure.axis
    if axis is not None and (not axis.replace("_", "").isalnum() or axis in KEYS or axis in measure.metrics):
        raise PosbenchError(f"measure '{spec}': its axis {axis!r} must be a word other than {', '.join(KEYS)}")
    with torch.no_grad():
        scored = measure.score(run)
    rc = run.cfg
    ident = {"scheme": run_label(rc.model), "seed": rc.seeds[0], "train_len": rc.model.train_len}
    variant = (getattr(measure, "options", None) or {}).get("variant")  # a training-free one attends eager
    backend = run.model.backend(run.device, variant=variant) if variant else run.model.backend(run.device)
    rows, with_ci = [], set()
    for r in scored:
        if not isinstance(r, dict) or not isinstance(r.get("length"), int):
            raise PosbenchError(f"measure '{spec}': score must return dicts with an int 'length', got {r!r}")
        r = dict(r)
        ci = r.pop("ci", None) or {}
        if not isinstance(ci, dict) or set(ci) - set(measure.metrics):
            raise PosbenchError(f"measure '{spec}': a row's ci must map some of its metrics to numbers, got {ci!r}")
        with_ci |= set(ci)
        if axis is not None and (isinstance(r.get(axis), bool) or not isinstance(r.get(axis), (int, float))):
            raise PosbenchError(f"measure '{spec}': a row at length {r['length']} lacks a number '{axis}'")
        missing = [m for m in measure.metrics if m not in r and r.get("status", "ok") == "ok"]
        if missing:
            raise PosbenchError(f"measure '{spec}': a row at length {r['length']} lacks {', '.join(missing)}")
        rows.append(
            {**ident, "status": "ok", "attention": backend, **r}
            | {m: float(r.get(m, math.nan)) for m in measure.metrics}
            | {f"{CI}{m}": float(v) for m, v in ci.items()}
        )
    if not rows:
        raise PosbenchError(f"measure '{spec}': score returned no rows")
    folder = Path(rdir) / FOLDER
    folder.mkdir(exist_ok=True)
    cis = [f"{CI}{m}" for m in measure.metrics if m in with_ci]
    write_rows(folder / f"{measure.name}.csv", rows, columns(axis, measure.metrics, cis))  # no ci: blank
    meta = {
        "measure": spec,
        "options": getattr(measure, "options", {}),
        "metrics": {n: dataclasses.asdict(m) for n, m in measure.metrics.items()},
    }
    meta |= {"axis": axis} if axis is not None else {}
    meta |= {"samples": measure.samples} if cis else {}
    write_atomic(folder / f"{measure.name}.json", json.dumps(meta, indent=1) + "\n")
    log_scoring(rdir, measure.name, rows, computed_on(run.device))
    return rows


# --- records and reports (no torch) ---------------------------------------------------------------


def read_measures(rdir: Path) -> dict[str, Records]:
    """The run's user measures: name -> its Records (module:Class, metrics, rows, its second
    axis and options); a malformed record is one line."""
    out = {}
    for meta_path in sorted((Path(rdir) / FOLDER).glob("*.json")):
        name, path = meta_path.stem, meta_path.with_suffix(".csv")
        again = "score the run again with posbench evaluate --measure"
        bad = PosbenchError(f"{path}: malformed measure records; {again}")
        try:
            meta = json.loads(meta_path.read_text())
            metrics = {n: Metric(**{**m, "pooled": tuple(m["pooled"])}) for n, m in meta["metrics"].items()}
        except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise PosbenchError(f"{meta_path}: malformed measure description; {again}") from None
        if not path.is_file():
            raise PosbenchError(f"{path}: missing, though {meta_path.name} describes it; {again}")
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                rows = list(reader)
            axis, samples = meta.get("axis"), meta.get("samples")
            cis = [f"{CI}{m}" for m in metrics if f"{CI}{m}" in (reader.fieldnames or [])]
            if reader.fieldnames != columns(axis, metrics, cis) or not rows or bool(cis) != bool(samples):
                raise ValueError
            for r in rows:
                if None in r or None in r.values():  # a row cut short, or with cells past the header
                    raise ValueError
                # an empty metric: not scored at that length (its status says why)
                int(r["length"]), int(r["seed"]), int(r["train_len"]), *(float(r[m] or "nan") for m in [*metrics, *cis])
                if axis is not None:
                    float(r[axis])
        except (OSError, UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
            raise bad from None
        out[name] = Records(meta["measure"], metrics, rows, axis, meta.get("options"), samples)
    return out


def report(collected) -> tuple[list[Section], dict[str, pd.DataFrame], dict[str, list], list[str]]:
    """The user measures' part of a report: for each measure and metric a table of schemes x
    lengths (compare.summarize), one per value of a measure's second axis; their long rows by
    measure (written as <name>.csv beside summary.csv); the panels of a plot per measure
    (<name>.png: each metric against length, or with an axis a heatmap of axis x length per
    scheme); and a line each for summary.md."""
    from posbench.compare.order import scheme_order
    from posbench.compare.plot import Heat, Panel, lines
    from posbench.compare.render import tex
    from posbench.compare.table import grid, summarize

    found: dict[str, tuple[dict, list]] = {}
    specs: dict[str, set] = {}
    axes: dict[str, Optional[str]] = {}
    options: dict[str, list] = {}
    samples: dict[str, str] = {}  # a measure's samples, where a pretrained model's cells take their ci from them
    for run in collected.runs:
        for name, rec in read_measures(run.folder).items():
            point = collected.points.get(run.folder, "")
            own = bool(run.cfg.model.pretrained and rec.samples)  # a model with no seeds: its ci is its samples'
            found.setdefault(name, (rec.metrics, []))[1].extend({**r, "point": point, OWN: own} for r in rec.rows)
            if own:
                samples[name] = rec.samples
            specs.setdefault(name, set()).add(rec.spec)
            if axes.setdefault(name, rec.axis) != rec.axis:
                raise PosbenchError(
                    f"{run.folder / FOLDER / name}.csv: measure {name} by {rec.axis or 'length'} here, by "
                    f"{axes[name] or 'length'} in another run; score every run with the same measure"
                )
            if rec.options and rec.options not in options.setdefault(name, []):
                options[name].append(rec.options)
    sections, frames, panels, describe = [], {}, {}, []
    for name, (metrics, rows) in sorted(found.items()):
        labels, runs = ", ".join(m.label for m in metrics.values()), len({(r["scheme"], r["seed"]) for r in rows})
        axis = axes[name]
        said = "; ".join(
            ", ".join(f"{k} {_said(v)}" for k, v in o.items() if v not in (None, "", [])) for o in options.get(name, [])
        )
        describe.append(
            f"- {name}: {labels}, {_origin(specs[name])}, on {runs} run{'s' * (runs != 1)}"
            + (f", by {axis} and length" if axis else "")
            + (f"; scored with {said}" if said else "")
            + (f"; a pretrained model's ± is over its {samples[name]}" if name in samples else "")
        )
        df = pd.DataFrame(rows)
        for c in ("seed", "train_len", "length"):
            df[c] = df[c].astype(int)
        if axis is not None:
            df[axis] = pd.to_numeric(df[axis])
        frames[name] = df.drop(columns=[OWN])
        for metric in metrics.values():
            for point in sorted(set(df["point"])):
                part = df[df["point"] == point]
                where = f" ({point})" if point else ""
                mark = int(part["train_len"].iloc[0])
                values = [None] if axis is None else sorted(set(part[axis]))
                tables = {}
                for v in values:
                    cut = part if v is None else part[part[axis] == v]
                    at = "" if v is None else f" at {axis} {v:g}"
                    long = cut.assign(column=cut["length"], value=pd.to_numeric(cut[metric.name], errors="coerce"))
                    lengths = sorted(set(long["length"]))
                    table = summarize(long, lengths, scheme_order(set(long["scheme"])), metric.higher_is_better)
                    own = _over_samples(table, long, metric.name)
                    heads = [str(L) for L in lengths]
                    rows_, best = grid(table, heads, metric.digits, metric.scale, missing="—", seeds=True)
                    note = _note(table, own, samples.get(name, ""))
                    heading = f"{name}: {metric.label} by length{at}{where}"
                    sections.append(
                        Section(heading, f"{tex(heading)}; {tex(note)}.", rows_, best, title=heading, legend=note)
                    )
                    tables[v] = table
                    if axis is None:
                        panel = Panel(heading, lines(table, metric.scale), mark)
                        panels.setdefault(name, []).append((metric.label, panel))
                if axis is not None:
                    lengths = sorted(set(part["length"]))
                    for s in scheme_order(set(part["scheme"])):
                        grid_ = [[_mean(tables[v], s, L) * metric.scale for L in lengths] for v in values]
                        label = f"{metric.label}{where}"  # a row of panels and its colour bar
                        look = {"higher_is_better": metric.higher_is_better, "digits": metric.digits, "mark": mark}
                        heat = Heat(s, lengths, values, grid_, label, axis, **look)
                        panels.setdefault(name, []).append((metric.label, heat))
    return sections, frames, panels, describe


def _over_samples(table: pd.DataFrame, long: pd.DataFrame, metric: str) -> set[str]:
    """A pretrained model's cells take their interval from its own samples (its records'
    ci_<metric>: over windows, over trials), having no seeds to take one from; the schemes so
    set. Any other keeps summarize's interval over seeds."""
    own = set()
    ci = f"{CI}{metric}"
    if ci not in long:
        return own
    for r in long[long[OWN] & (long["status"] == "ok")].to_dict("records"):
        half = pd.to_numeric(r[ci], errors="coerce")
        if r["scheme"] in table.index and half == half:
            table.loc[r["scheme"], f"ci {r['length']}"] = float(half)
            own.add(r["scheme"])
    return own


def _note(table: pd.DataFrame, own: set[str], samples: str) -> str:
    """spread_note, and what a pretrained model's ± is over where its cells have one."""
    from posbench.compare.table import spread_note

    seeds = int(table["seeds"].max())
    if not own:
        return spread_note(seeds, table.attrs["tests"])
    said = (
        f"a pretrained model's ± is over its {samples}: the 95% interval of the mean over the {samples} "
        f"scored there (Student's t)"
    )
    if own == set(table.index):
        return spread_note(seeds, table.attrs["tests"], more=said)
    return f"{spread_note(seeds, table.attrs['tests'])}; {said}"


def _mean(table: pd.DataFrame, scheme: str, column) -> float:
    """A summarize table's mean over seeds at `column` for `scheme`; nan where none was scored."""
    if scheme not in table.index or column not in table.attrs["columns"]:
        return math.nan
    return float(table.loc[scheme, column])


def _origin(specs: set[str]) -> str:
    """Whose measure a table is: posbench's (a registered name) or a user's (module:Class)."""
    own, theirs = sorted(s for s in specs if ":" not in s), sorted(s for s in specs if ":" in s)
    return ", ".join(
        [f"posbench's measure {', '.join(own)}"] * bool(own)
        + [f"a user's measure ({', '.join(theirs)})"] * bool(theirs)
    )


def _said(value) -> str:
    """An option's value as a description says it: a list as 0,25,50, text quoted on one line."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else repr(value)


def write_plots(panels: dict, folder: Path) -> list[str]:
    """<name>.png per user measure: each metric against length, a panel per metric (and grid
    point); for a measure with a second axis, its heatmaps: a row per metric (and grid point), a
    panel per scheme."""
    from posbench.compare.plot import BAND_SEEDS, Heat, band_plot, heatmap

    written = []
    for name, drawn in panels.items():
        heats = [p for _, p in drawn if isinstance(p, Heat)]
        if heats:
            rows: dict[str, list] = {}
            for h in heats:
                rows.setdefault(h.label, []).append(h)
            if heatmap(list(rows.values()), folder / f"{name}.png"):
                written.append(f"{name}.png")
            continue
        labels = sorted({label for label, _ in drawn})
        xlabel = f"evaluation length; dashed: the training length; band: 95% ({BAND_SEEDS}+ seeds)"
        ylabel = labels[0] if len(labels) == 1 else "see each panel's title"
        if band_plot(
            [p for _, p in drawn], folder / f"{name}.png", ylabel, xlabel, log=False, share_y=len(labels) == 1
        ):
            written.append(f"{name}.png")
    return written
