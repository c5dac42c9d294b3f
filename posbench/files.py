"""Where posbench keeps its files, and how it writes them whole (no reader sees half a file)."""

from __future__ import annotations

import contextlib
import csv
import math
import os
from pathlib import Path

TMP_PREFIX = "tmp-"  # atomic()'s temporary files; a killed writer can leave one behind


def cache_dir() -> Path:
    """The corpus and the compiled kernels: $POSBENCH_CACHE, or $XDG_CACHE_HOME/posbench."""
    root = os.environ.get("POSBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posbench"
    )
    return Path(root)


@contextlib.contextmanager
def atomic(path: Path):
    """A temporary path beside `path` that replaces it only once the block has finished, so no
    reader ever sees a half-written file. The name keeps its suffix (savefig reads it)."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    with atomic(path) as tmp:
        tmp.write_text(text)


def write_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    """A CSV of `columns`; None and NaN are written as empty cells."""
    with atomic(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if _missing(r.get(k)) else r.get(k)) for k in columns})


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))
