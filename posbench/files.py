"""Where posbench keeps its files, how it writes them whole (no reader sees half a file), and run locks."""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import gzip
import io
import math
import os
import shutil
import socket
import zlib
from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError

TMP_PREFIX = "tmp-"  # atomic()'s temporary files; a killed writer can leave one behind
STAGE_PREFIX = ".together-"  # together()'s hidden folders (host, pid); a killed writer can leave one behind


def cache_dir() -> Path:
    """The corpus and the compiled kernels: $POSBENCH_CACHE, or $XDG_CACHE_HOME/posbench."""
    root = os.environ.get("POSBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posbench"
    )
    return Path(root)


@contextlib.contextmanager
def atomic(path: Path):
    """A temporary path beside `path` that replaces it only once the block has finished, so no
    reader ever sees a half-written file. The name keeps its suffix (savefig reads it) and
    names this process, so two processes writing one file never share a temporary one."""
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with room_in(path.parent):
            try:
                yield tmp
                tmp.replace(path)
            except OSError as e:  # said of the file being written, not of its temporary name
                if e.filename is None or Path(e.filename) != tmp or e.errno is None:
                    raise
                raise type(e)(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def together(folder: Path):
    """A hidden folder in `folder` to write several files in; once the block has finished they
    take their names in `folder` together, so a stop part way leaves every earlier file as it
    was, never some new and some old. Stages that killed writers left are removed."""
    mine = f"{STAGE_PREFIX}{socket.gethostname()}-"  # a pid says nothing of another machine's stage
    for stale in folder.glob(f"{mine}*"):
        pid = stale.name.removeprefix(mine)
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    stage = folder / f"{mine}{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        with room_in(folder):
            try:
                stage.mkdir()
                yield stage
            except OSError as e:  # said of the file being written, not of its place in the stage
                if e.filename is None or e.errno is None or stage not in (Path(e.filename), *Path(e.filename).parents):
                    raise
                raise type(e)(e.errno, e.strerror, str(folder / Path(e.filename).relative_to(stage))) from None
        made = sorted(stage.iterdir())
        for path in made:  # a folder in a file's way is said before any file has moved
            if (folder / path.name).is_dir():
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(folder / path.name))
        for path in made:
            try:
                os.replace(path, folder / path.name)
            except OSError as e:
                raise type(e)(e.errno, e.strerror, str(folder / path.name)) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        pass
    return True


def file_in_the_way(path: Path) -> Optional[Path]:
    """The file that `path`, meant as a folder or a path inside one, runs into (itself or an
    ancestor), or None. os.path.isfile never raises, on a folder it may not search either."""
    path = Path(os.fsdecode(path))
    return next((p for p in (path, *path.parents) if os.path.isfile(p)), None)


def disk_full(e: Optional[BaseException]) -> bool:
    """Whether `e`, or an error it wraps, is a full disk (or a spent quota). torch.save raises a
    RuntimeError of its own ("enforce fail at inline_container.cc") whose context holds the
    OSError, where it writes to a Python file object; to a path it keeps no errno."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def room_in(folder: Path):
    """A full disk while the block writes into `folder` is one line naming it."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not disk_full(e):
            raise
        raise PosbenchError(
            f"{folder}: the disk is full ({os.strerror(errno.ENOSPC)}); free some space, then rerun the same command"
        ) from None


def write_atomic(path: Path, text: str) -> None:
    with atomic(path) as tmp:
        tmp.write_text(text)


def write_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    """A CSV of `columns`; None and NaN are written as empty cells. A path ending in .gz is
    gzipped in one write, with neither name nor time in its header: the same rows give the same
    bytes (under one zlib)."""
    with atomic(path) as tmp:
        if path.suffix == ".gz":
            text = io.StringIO(newline="")
            _write_csv(text, rows, columns)
            with tmp.open("wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as z:
                z.write(text.getvalue().encode())  # one write: a flush would add an empty block
        else:
            with tmp.open("w", newline="") as f:
                _write_csv(f, rows, columns)


def _write_csv(f, rows: list[dict], columns: list[str]) -> None:
    w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if _missing(r.get(k)) else r.get(k)) for k in columns})


GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # what reading a damaged .gz raises


def open_text(path: Path):
    """A CSV record for reading, gzipped or not by its name (a damaged .gz: GZIP_ERRORS)."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(newline="", encoding="utf-8")


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


@contextlib.contextmanager
def exclusive(path: Path, remove: bool = False):
    """Hold the lock file `path` for the block: yields True if this process has it, False if
    another holds it. It is an flock, so the kernel releases it when its holder dies, kill -9
    included; the file itself stays, holding the last holder's pid, unless `remove` and the
    block ended without an error: then the holder unlinks it before letting go. A process that
    locked a file unlinked that way (it opened it before the unlink) takes the new one instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed it after we opened it: lock the file now at `path`
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
        if remove:
            path.unlink(missing_ok=True)  # while still held: no one can take the old file for the run's lock
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def waiting_for(path: Path):
    """Hold the lock file `path` for the block, waiting while another process holds it: for a
    step of a few file operations that two processes must not interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def lock_holder(path: Path) -> Optional[int]:
    """The pid holding the lock file `path` (0 if it cannot be read), or None if no one does."""
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        return None
    finally:
        os.close(fd)


def safe_name(text: str) -> str:
    """A folder name from anything, e.g. a plugin's module:Class."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
