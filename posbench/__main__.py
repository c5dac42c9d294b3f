"""The `posbench` command's entry, which takes Ctrl-C and kill before anything heavy imports.

So a signal at any moment ends the command with one line; `python -m posbench` runs it too."""

import os
import signal
import sys
import threading


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """Ctrl-C and kill raise KeyboardInterrupt, which a command turns into one line and exit 130;
    never inside an import, which it would leave half done (numpy and torch then swallow it, or
    fail later with another error): there the signal comes again 50 ms later."""
    if _importing(frame):
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


def take_signals() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # `kill` cleans up like Ctrl-C: no half-written runs
        signal.signal(s, _interrupt)


def main() -> int:
    take_signals()
    try:
        from posbench.cli import main as run

        code = run()
    except KeyboardInterrupt:  # before a command began, or after it ended: none of its own lines
        print("interrupted: rerun the same command", file=sys.stderr)
        return 130
    for s in (signal.SIGINT, signal.SIGTERM):  # the command has ended: a late signal changes nothing
        signal.signal(s, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
