"""The one exception posbench raises for anything a user can fix, and the two ways its messages are worded."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class PosbenchError(Exception):
    """A problem with the user's input or files, worded so the user can act on it. `key` is the
    dotted config key the problem is about, where there is one, so that the config loader can
    say which file or flag the value came from. `exit_code` is the command's: 2 for a bad input,
    1 for a bug (posbench's, or a user's plugin breaking its contract), so scripts tell them apart."""

    def __init__(self, message: str, key: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.key, self.exit_code = key, exit_code


def first_line(e: BaseException, limit: int = 200, last: bool = False) -> str:
    """An exception as one line: its message's first (or `last`) line, else its type's name; one
    over `limit` characters is cut at a word and ends in "...", not mid-word."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    line = (lines[-1] if last else lines[0]) if lines else type(e).__name__
    if len(line) <= limit:
        return line
    cut = line[:limit]
    at = cut.rfind(" ")
    return (cut[:at] if at > limit // 2 else cut) + " ..."  # a long path has no word to cut at


def did_you_mean(name: str, choices: Iterable[str], aliases: Mapping[str, str] | None = None) -> str:
    """ " (did you mean 'rope'?)" for the closest of `choices`, or "" when none is close. Case
    does not count, and `aliases` (what papers call a choice: rotary -> rope) suggest theirs."""
    by_lower = {str(c).lower(): str(c) for c in choices} | {k.lower(): v for k, v in (aliases or {}).items()}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.5)
    return f" (did you mean '{by_lower[close[0]]}'?)" if close else ""
