"""How library code reports progress: the Reporter interface, which the CLI implements and draws."""

from __future__ import annotations


class Reporter:
    """Progress callbacks; the CLI supplies one that draws bars, library code never prints.
    Runs may train at once (train.workers), so each call names its run's label. This base
    reports nothing."""

    def start(self, label: str, total: int) -> None: ...

    def step(self, label: str, step: int, loss: float) -> None: ...

    def finish(self, label: str) -> None: ...

    def note(self, message: str) -> None: ...
