"""The `posbench` command's entry, which takes Ctrl-C and kill before anything heavy imports.

So a signal at any moment ends the command with one line; `python -m posbench` runs it too."""

import os
import signal
import sys
import threading
import time

PATIENCE = 10.0  # seconds a signal waits for an import to finish (torch's, on a busy machine)
_first: float | None = None  # when the signal now waiting was first put off
_timer: threading.Timer | None = None  # the one that sends it again


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """Ctrl-C and kill raise KeyboardInterrupt, which a command turns into one line and exit 130;
    not inside an import, which it would leave half done (numpy and torch then swallow it, or
    abort): there the signal is sent again every 50 ms until the import is done, for PATIENCE
    seconds at most (an import that hangs still ends)."""
    global _first, _timer
    if _importing(frame) and (_first is None or time.monotonic() - _first < PATIENCE):
        _first = _first or time.monotonic()
        if _timer is None or not _timer.is_alive():  # one pending at a time, however often pressed
            _timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            _timer.daemon = True
            _timer.start()
        return
    if _timer is not None:
        _timer.cancel()
    _first = _timer = None
    raise KeyboardInterrupt


def take_signals() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # `kill` cleans up like Ctrl-C: no half-written runs
        signal.signal(s, _interrupt)


def main() -> int:
    take_signals()
    try:
        from posbench.cli import main as run

        return run()
    except KeyboardInterrupt:  # before a command began, or after it ended: none of its own lines
        print("interrupted: rerun the same command", file=sys.stderr)
        return 130
    finally:  # the command has ended and said so: Ctrl-C again changes nothing, kill ends the process
        if _timer is not None:
            _timer.cancel()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
