"""The Measure interface and what it builds: its metrics and its report sections."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from posbench.errors import PosbenchError

AGGREGATES = ("mean", "pooled", "derived")


@dataclass(frozen=True)
class Metric:
    """One number a measure reports, registered once: its name, where its records hold it, its
    direction and how it is aggregated. Over seeds a cell is always the mean with its interval;
    `aggregate` says what one seed's value is: its record's `column` as is (mean), `pooled`
    right-of-total (the sum of `pooled[0]` over the sum of `pooled[1]` across a bucket's
    lengths), or `derived` by its measure from other columns (a run's ppl at L over its ppl at
    the training length), with no column of its own."""

    name: str  # as --metric names it, and as trackers send it
    label: str  # what a table cell holds
    higher_is_better: bool
    digits: int = 2
    column: Optional[str] = None  # eval.csv's column that holds it (None: derived from others)
    aggregate: str = "mean"
    pooled: tuple[str, ...] = ()  # (right, of): the counts that pool
    scale: float = 1.0  # a cell shows value x scale (100: percent)
    title: str = ""  # a report's title for it
    how: str = ""  # how one value is scored, for a report's description
    # settings whose runs its values still compare across (bits per byte: the tokenizer's), so a
    # report of it may join experiments that differ in them, a table per setting
    compares: tuple[str, ...] = ()

    def __post_init__(self):
        if self.aggregate not in AGGREGATES or (self.aggregate == "pooled") != (len(self.pooled) == 2):
            raise ValueError(f"metric {self.name}: aggregate {self.aggregate!r} with pooled {self.pooled!r}")


@dataclass
class Section:
    """One comparison table of a report: schemes against lengths (or buckets) for one protocol
    and grid point. `rows` are cells of text, a header first; `best` marks the cells that are
    best or tied for best."""

    heading: str  # the table's name in summary.md, and in a terminal title
    caption: str  # what a cell holds and what bold means, for LaTeX and the terminal
    rows: list[list[str]]
    best: set = field(default_factory=set)  # (row, column) indices of the cells to set in bold
    terminal: Optional[list[list[str]]] = None  # the rows a terminal shows, where they differ
    terminal_best: Optional[set] = None
    title: str = ""  # the terminal table's title
    legend: str = ""  # what the terminal's marks mean


class Measure:
    """The interface; posbench/measures/perplexity/ and exact_match/ implement it. A measure
    judges a trained model: what a run learned from is its task's (posbench/tasks/)."""

    name: str = ""
    metrics: dict[str, Metric] = {}
    records: tuple[str, ...] = ("eval.csv",)  # the files `score` writes into a run folder

    # --- deciding a config (posbench/resolve.py calls it once, after the task's) ----------------
    def decide(self, cfg, test_len: Optional[int]) -> None:
        """Decide what the runs are scored at (eval.*) in `cfg`, in place, and refuse evaluation
        settings that do not apply to this measure."""
        raise NotImplementedError

    def notes(self, cfg, source) -> list[str]:
        """What to say before scoring, given what the runs read: what will be slow, what adds nothing.
        Raises PosbenchError where the runs could not be scored at all (a validation split shorter
        than a length): it is asked before anything trains."""
        return []

    # --- scoring (these import torch) ----------------------------------------------------------
    def score(self, rc, rdir: Path, model, source, device, backend: str, reporter=None) -> None:
        """Score what the run's records still lack under `rc`, into them; `reporter` (a
        progress.Reporter, or None) may hear how far scoring is."""
        raise NotImplementedError

    def rescore(self, cfg, rdir: Path, model, source, device) -> list[dict]:
        """`posbench evaluate`: score a trained run again as `cfg` asks (resolve.resolve_scoring
        decided it), on `source` (what its task reads), whatever its records hold; returns the
        new rows."""
        raise NotImplementedError

    def evaluation(self, rc, rows: list[dict]) -> tuple[str, list[list[str]]]:
        """`posbench evaluate`'s new rows as a title and a table (header first)."""
        raise NotImplementedError

    # --- records and reports (no torch) ------------------------------------------------------
    def read(self, rdir: Path) -> list[dict]:
        """The run's scored rows, checked; a malformed record is one line naming it."""
        raise NotImplementedError

    def check_beside(self, rdir: Path) -> None:
        """Read the records a report reads beside the rows (a loss per position...), raising its
        one line where one is malformed: status says such a run is damaged."""

    def asked(self, rows: list[dict], cfg) -> list[dict]:
        """The rows a command that ran `cfg` asked for (a run may hold more, scored by evaluate)."""
        return rows

    def report(self, collected, metric: Optional[str], transpose: bool, buckets) -> dict:
        """The parts of a report of `collected` (posbench/report.py): "title", "describe" (lines),
        "sections", "legend", "csv" (a frame and its columns) and "plots" (folder -> names)."""
        raise NotImplementedError

    def join_checks(self, rows: list[dict]) -> list[tuple[str, set]]:
        """What two experiments joined into one table must share, beyond their settings."""
        return []


def only_own_section(cfg, own: str) -> None:
    """Refuse a key of another measure's section of eval (posbench/config.py) that is set away
    from its default: the runs of `cfg` are scored by the measure `own`, which never reads it."""
    for f in dataclasses.fields(cfg.eval):
        section = getattr(cfg.eval, f.name)
        if f.name == own or not dataclasses.is_dataclass(section):
            continue
        default = type(section)()
        for g in dataclasses.fields(section):
            if getattr(section, g.name) != getattr(default, g.name):
                key = f"eval.{f.name}.{g.name}"
                raise PosbenchError(
                    f"{key} is an option of the {f.name} measure; the runs of task {cfg.task} are scored by {own}", key
                )


class Scorer:
    """A measure scored beside a run's own, posbench's (measures/plugin.py names them) or a
    user's: `name` (its records' file name), `metrics` (what each row holds, by name) and
    `score`, which returns a row per length: {"length": L, <metric>: value, ...}, with "status"
    where a length could not be scored ("beyond-max-len"). `options` are its options and their
    defaults (None: decided from the run); `--measure-option key=value` sets them, and its
    records keep them as scored. A measure with a second axis names it (`axis = "depth"`) and
    returns a row per length and value of it ({"length": L, "depth": 25, ...}); its records keep
    the column and its reports give a table per value and a heatmap of axis x length per scheme.
    A row may also carry "ci": {metric: half-width}, the 95% interval of a value over the run's
    own `samples` (its windows, its trials: `over_samples`); a report shows it where a model has
    no seeds to give one (a pretrained model)."""

    name: str = ""
    metrics: dict[str, Metric] = {}
    options: dict[str, Any] = {}
    axis: Optional[str] = None  # a column each row holds beside its length (a number), or none
    samples: str = "windows"  # what a row's "ci" is over, as a report says it

    def __init__(self, **options):
        unknown, valid = sorted(set(options) - set(type(self).options)), ", ".join(type(self).options)
        if unknown:
            raise PosbenchError(f"{type(self).__name__}: no option {unknown[0]}; valid: {valid}")
        self.options = {**type(self).options, **options}

    def score(self, run: ScoringRun) -> list[dict]:
        raise NotImplementedError


def over_samples(values) -> tuple[float, float]:
    """The mean of one value per sample (a window, a trial) and the half-width of its 95%
    interval (Student's t; nan with one sample): a Scorer's value and its "ci"."""
    from posbench.stats import mean_ci

    return mean_ci([float(v) for v in values])


def ratio_over_samples(sums, counts) -> tuple[float, float]:
    """sum(sums) / sum(counts) (a mean over tokens that the samples hold unequal numbers of) and
    the half-width of its 95% interval over the samples: the ratio estimator's, mean_ci of each
    sample's sum - ratio x count over the mean count. nan where no sample counts anything, and
    an interval of nan where fewer than two do: from one, the spread is unknown, not 0."""
    from posbench.stats import mean_ci

    sums, counts = [float(v) for v in sums], [float(c) for c in counts]
    total = sum(counts)
    if not total:
        return math.nan, math.nan
    ratio = sum(sums) / total
    if sum(c > 0 for c in counts) < 2:
        return ratio, math.nan
    return ratio, mean_ci([s - ratio * c for s, c in zip(sums, counts)])[1] / (total / len(counts))


@dataclass
class ScoringRun:
    """What a measure scores: a trained run's model (in eval mode, on `device`), its config, and
    what it read (the corpus of a language model, the test set of a task)."""

    cfg: Any  # the run's ExperimentConfig
    # its TransformerLM (forward(tokens (B, T)) -> logits (B, T, V)) or a PretrainedLM; both give
    # token_losses(win (B, T + 1)) -> (B, T), each target's loss in nats
    model: Any
    device: Any
    source: Any
    memo: dict = field(default_factory=dict, repr=False)  # passes that measures scored on it share

    @property
    def lengths(self) -> list[int]:
        """The lengths the run was scored at: its eval.lengths."""
        return list(self.cfg.eval.lengths)

    def windows(self, L: int, batch_size: Optional[int] = None):
        """Batches of the validation tokens cut into non-overlapping windows of L, as perplexity
        reads them: (inputs, targets) of (b, L) each, targets one token on, on the run's device."""
        import torch

        from posbench.evaluate import eval_tokens

        if not hasattr(self.source, "val"):
            raise PosbenchError(f"a run of task {self.cfg.task} has no corpus to cut into windows")
        tokens = eval_tokens(self.source, self.cfg, self.lengths).long()
        starts = list(range(0, len(tokens) - L - 1 + 1, L))  # whole windows only
        size = batch_size or self.cfg.eval.batch_size
        for i in range(0, len(starts), size):
            idx = torch.tensor(starts[i : i + size])[:, None] + torch.arange(L + 1)  # (b, L+1)
            win = tokens[idx].to(self.device)
            yield win[:, :-1], win[:, 1:]
