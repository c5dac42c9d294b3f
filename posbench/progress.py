"""How library code reports progress: the Reporter interface, which the CLI implements and draws."""

from __future__ import annotations

from collections.abc import Callable

# the CLI's one line for what no run's progress carries (a module about to be imported, a
# tracker that failed); a library caller hears nothing
notice: Callable[[str], None] | None = None


def say(line: str) -> None:
    if notice is not None:
        notice(line)


class Reporter:
    """Progress callbacks; the CLI supplies one that draws bars, library code never prints.
    Runs may train at once (train.workers), so each call names its run's label. This base
    reports nothing."""

    def plan(self, runs: int) -> None:
        """How many runs this command will train, so each can say it is "3 of 8"."""

    def start(self, label: str, total: int) -> None: ...

    def step(self, label: str, step: int, loss: float) -> None: ...

    def finish(self, label: str) -> None: ...

    def note(self, message: str) -> None: ...

    def scoring(self, label: str, done: int, total: int) -> None:
        """`done` of `total` tokens of a run's scoring (all its lengths) are scored."""


class Marked(Reporter):
    """Another reporter, with `mark` after each run's label: a sweep's grid point, since the
    label ("alibi seed 0") is the same at every point."""

    def __init__(self, reporter: Reporter, mark: str):
        self.reporter, self.mark = reporter, mark

    def plan(self, runs):
        self.reporter.plan(runs)

    def start(self, label, total):
        self.reporter.start(label + self.mark, total)

    def step(self, label, step, loss):
        self.reporter.step(label + self.mark, step, loss)

    def finish(self, label):
        self.reporter.finish(label + self.mark)

    def note(self, message):
        self.reporter.note(message)

    def scoring(self, label, done, total):
        self.reporter.scoring(label + self.mark, done, total)
