"""A run folder's layout and its records, read by plain code: no torch, no training code.

A run folder holds config.yaml (fully resolved), model.pt (weights plus that same config and
data.json's record), train_log.jsonl (step, loss, lr, seconds, and how each line was computed:
attention backend, device, threads, versions), eval_log.jsonl (the same, a line each time it was
scored), data.json (the sha256 of the corpus it read: what it is scored and fine-tuned on, and
model.pt, are checked against it) and its measure's records (e.g. eval.csv); a run whose loss
blew up holds diverged.json instead of model.pt. Folders are built under a hidden name
(.<run>.partial), beside their mid-run checkpoints, and renamed when whole, so an interrupted
run leaves nothing that could pass for a finished one. A lock file per run (.<run>.lock) keeps
two processes from writing one run.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

from posbench.config import ExperimentConfig, config_from_dict, differences, identity, read_record
from posbench.errors import PosbenchError
from posbench.files import lock_holder, safe_name

CONFIG, WEIGHTS, DIVERGED, FAILED = "config.yaml", "model.pt", "diverged.json", "failed.txt"
CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"  # mid-run state; the one before it
EVAL = "eval.csv"  # the scored rows, in the columns of the run's measure
DATA = "data.json"  # what the run read, by sha256 (the corpus's tokens), where its config cannot say it
PLANNED = "runs.txt"  # the run folders an experiment was asked to hold, one a line: status names the missing ones
SWEEP_RECORD = "sweep.yaml"  # the grid a sweep's experiment folder was made by; its runs may differ
CLAIMING = ".claiming"  # locked while a run that starts to train checks the experiment and records its config
SCORING = "scoring.txt"  # while a run is scored: a stop before its last row leaves it, so its rows are known in part
EVAL_LOG = "eval_log.jsonl"  # a line each time rows were scored: what, by which backend, on what, by which versions


def planned(exp: Path) -> list[str]:
    """The run folders an experiment folder was asked to hold (empty if it does not say)."""
    try:
        return [line for line in (Path(exp) / PLANNED).read_text().splitlines() if line]
    except (OSError, UnicodeDecodeError):
        return []


def read_config(rdir: Path) -> ExperimentConfig:
    """A run's config.yaml as a config; a damaged one is one line naming it."""
    path = Path(rdir) / CONFIG
    return config_from_dict(read_record(path), source=str(path))


def run_name(scheme: str, seed: int) -> str:
    return f"{safe_name(scheme)}-seed{seed}"


def partial_dir(rdir: Path) -> Path:
    """The hidden folder a run is built in before it is renamed to `rdir`."""
    return rdir.parent / f".{rdir.name}.partial"  # not with_name, which refuses the root


def has_checkpoint(partial: Path) -> bool:
    """Whether a partial folder holds a checkpoint (or the one before it) to resume from."""
    return any((Path(partial) / name).is_file() for name in (CHECKPOINT, PREVIOUS))


def lock_file(rdir: Path) -> Path:
    """The run's lock: whoever holds it alone may write `rdir` and its partial folder."""
    return rdir.parent / f".{rdir.name}.lock"


@dataclass(frozen=True)
class RunState:
    """What a run is, from its folder, its partial folder and its lock: the one reading that
    status, report, plan and extend share (each says it in its own words)."""

    folder: Path  # the run folder, whether or not it exists
    trained: bool  # model.pt: its weights are final
    diverged: bool  # diverged.json and no model.pt: its loss blew up, there is nothing to score
    scored: bool  # config.yaml and eval.csv: a report can table it (a committed reference has no model.pt)
    here: bool  # its folder holds a run's record; else all there is of it lies in its partial folder
    partial: bool  # its partial folder exists: training began there
    scoring: bool = False  # scoring.txt: its scoring began and has not finished (or was stopped)

    @cached_property
    def holder(self) -> Optional[int]:
        """The pid of the process holding the run (0: unknown), None when no one does. Read only
        when asked: a look at the lock can make a process taking it that instant think it held."""
        return lock_holder(lock_file(self.folder))

    @property
    def state(self) -> str:
        """ "diverged", "done" (trained), "running" (neither, and another process holds it),
        "unfinished" (neither: records without weights, or a partial folder) or "none"."""
        if self.diverged:
            return "diverged"
        if self.trained:
            return "done"
        if self.holder is not None:
            return "running"
        return "unfinished" if self.here or self.partial else "none"


def run_state(rdir: Path) -> RunState:
    """The state of the run that lives, or would live, in `rdir`."""
    rdir = Path(rdir)
    has = {f: (rdir / f).is_file() for f in (CONFIG, EVAL, WEIGHTS, DIVERGED)}
    return RunState(
        folder=rdir,
        trained=has[WEIGHTS],
        diverged=has[DIVERGED] and not has[WEIGHTS],
        scored=has[CONFIG] and has[EVAL],
        here=any(has.values()),
        partial=partial_dir(rdir).is_dir(),
        scoring=(rdir / SCORING).is_file(),
    )


@contextlib.contextmanager
def scoring(rdir: Path):
    """scoring.txt in `rdir` while the block scores it, removed once it has finished: a process
    stopped between one length (or variant, or protocol) and the next leaves it, so status and
    report say the run's rows are in part, and the rerun that scores the rest removes it."""
    from posbench.files import write_atomic

    write_atomic(
        Path(rdir) / SCORING,
        f"scoring began (pid {os.getpid()}); while this file is here, the run's rows are in part: rerun "
        "the command that scored it to score the rest\n",
    )
    yield
    (Path(rdir) / SCORING).unlink(missing_ok=True)


def log_scoring(rdir: Path, measure: str, rows: list[dict], computed: dict) -> None:
    """A line in the run's eval_log.jsonl each time rows are written into its records: the
    measure, the lengths (and for perplexity the labels and protocols) it scored, their attention
    backend, and `computed` (device.computed_on: the device, torch's threads, the versions), which
    decide the rows' last digits (bf16 autocast on a GPU), for a run scored again elsewhere too."""
    from datetime import datetime, timezone

    line = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "measure": measure}
    for key, name in (("length", "lengths"), ("scheme", "schemes"), ("protocol", "protocols")):
        if rows and all(key in r for r in rows):
            line[name] = sorted({r[key] for r in rows})
    line["attention"] = ", ".join(sorted({str(r.get("attention")) for r in rows}))
    with open(Path(rdir) / EVAL_LOG, "a") as f:
        f.write(json.dumps(line | computed) + "\n")


def diverged_at(rdir: Path) -> Optional[float]:
    """The step a diverged run's record names (None if it names none)."""
    try:
        step = json.loads((Path(rdir) / DIVERGED).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if _number(step) else None


def diverged_step(rdir: Path) -> str:
    """'at step 12', from a diverged run's record."""
    step = diverged_at(rdir)
    return "at an unrecorded step" if step is None else f"at step {step:,}"


def read_train_log(rdir: Path) -> list[dict]:
    """A run's train_log.jsonl records, each a step's numbers as training writes them; a line that
    is not one (cut off mid-write, edited by hand) is passed over, and a log that cannot be read
    is empty."""
    try:
        lines = (Path(rdir) / "train_log.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [row for row in map(_log_row, lines) if row is not None]


def last_logged(rdir: Path) -> Optional[dict]:
    """The last step a run's train_log.jsonl records (None if none), read from the file's end:
    a long run's log is never parsed whole for it."""
    try:
        with open(Path(rdir) / "train_log.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 2**16))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return next((row for row in map(_log_row, reversed(lines)) if row is not None), None)


def _log_row(line: str) -> Optional[dict]:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or type(row.get("step")) is not int or not _number(row.get("loss")):
        return None
    return row if all(_number(row[k]) for k in ("lr", "seconds") if k in row) else None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def trained_with(rdir: Path) -> Optional[str]:
    """The attention backend a run trained with, from its train_log.jsonl (None if unrecorded)."""
    log = read_train_log(rdir)
    return log[0].get("attention") if log else None  # read_train_log's rows are dicts


def where_computed(rdir: Path) -> tuple[Optional[str], list[str]]:
    """Where a run was trained and where scored, as a table says it ("cpu in fp32 with torch
    2.13.0"): from train_log.jsonl's last line and each line of eval_log.jsonl; None and [] where
    they do not say (records written before they did)."""
    last = last_logged(rdir)
    try:
        lines = (Path(rdir) / EVAL_LOG).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    scored = []
    for line in lines:
        try:
            where = _where(json.loads(line))
        except ValueError:
            continue  # a line cut off mid-write
        if where is not None and where not in scored:
            scored.append(where)
    return (_where(last) if last else None), scored


def _where(line) -> Optional[str]:
    device = line.get("device") if isinstance(line, dict) else None
    version = line.get("torch") if isinstance(line, dict) else None
    if not isinstance(device, str) or not isinstance(version, str):
        return None
    return f"{device} in {'bf16 autocast' if device.startswith('cuda') else 'fp32'} with torch {version}"


def data_read(rdir: Path) -> Optional[tuple[str, str]]:
    """(corpus, sha256) from a run's data.json; None where it has none. A malformed one is one
    line naming it."""
    path = Path(rdir) / DATA
    if not path.is_file():
        return None
    try:
        read = json.loads(path.read_text())
        if not isinstance(read["sha256"], str):
            raise TypeError
        return str(read["corpus"]), read["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise PosbenchError(f"{path}: malformed; restore it, or delete it for posbench to write it again") from None


def check_read(rdir: Path, digest: Optional[str]) -> None:
    """Refuse to score or fine-tune the run in `rdir` on data other than it read: its data.json
    names the sha256 of what it read; `digest` is what its config reads now (None: nothing to pin,
    a synthetic task's runs, whose options make their data)."""
    read = data_read(rdir) if digest is not None else None
    if read is None:
        return
    name, was = read
    if was != digest:
        raise PosbenchError(
            f"{rdir} read {name} with sha256 {was[:12]}, but the data its config names now has sha256 "
            f"{digest[:12]}: its scores would not compare; restore that data, or train the run anew"
        )


def check_same_read(folder: Path, digest: Optional[str]) -> None:
    """Refuse a run on data other than the finished runs of its experiment `folder` read (its
    runs differ in scheme and seed only): a table would compare models trained on two corpora."""
    if digest is None:
        return
    for rdir in sorted(p for p in Path(folder).iterdir() if p.is_dir() and p.name[0] != ".") if folder.is_dir() else []:
        read = data_read(rdir)
        if read is not None and read[1] != digest:
            raise PosbenchError(
                f"{folder} holds runs that read {read[0]} with sha256 {read[1][:12]} ({rdir.name}), but the data "
                f"this config names has sha256 {digest[:12]}: a table compares runs on one corpus; restore that "
                f"data, or choose another name with --set name=NEW"
            )


def record_read(rdir: Path, name: str, digest: Optional[str]) -> None:
    """data.json: the sha256 of what the run read, where it has none yet."""
    from posbench.files import write_atomic

    if digest is not None and not (Path(rdir) / DATA).is_file():
        write_atomic(Path(rdir) / DATA, json.dumps({"corpus": name, "sha256": digest}, indent=1) + "\n")


def weights_identity(cfg: ExperimentConfig) -> dict:
    """What a checkpoint's weights came from, as far as its text can say: the data may move."""
    return {k: v for k, v in identity(cfg).items() if k != "data"}


def check_describes(record: Path, rec: ExperimentConfig, trained: ExperimentConfig) -> None:
    """A run's config.yaml (`record`, read as `rec`) must describe its model.pt, trained as `trained`."""
    ours, theirs = weights_identity(trained), weights_identity(rec)
    if ours != theirs:
        diff = ", ".join(differences(ours, theirs, (WEIGHTS, f"in {CONFIG}")))
        raise PosbenchError(f"{record} does not describe {WEIGHTS} ({diff}); restore or delete it")


def weights_record(rdir: Path) -> Optional[dict]:
    """model.pt's own record (its config, and data.json's) without torch: the pickle beside the
    tensors, read with every class it names (tensors, storages) stood in for by None, so nothing
    of the file's choosing runs. None where the file cannot be read so."""
    try:
        with zipfile.ZipFile(Path(rdir) / WEIGHTS) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
            if info.file_size > 2**24:  # the names and config beside the tensors: never this large
                return None
            raw = z.read(info)
        ckpt = _Plain(io.BytesIO(raw)).load()
    except Exception:  # a damaged or foreign file: load_run names it in full
        return None
    return ckpt if isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict) else None


class _Plain(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return lambda *args, **kwargs: None

    def persistent_load(self, pid):
        return None


def check_weights_read(rdir: Path, read, restore: bool = True) -> None:
    """model.pt names the data its weights were trained on (`read`: corpus, sha256); the run's
    data.json must name the same, so weights copied in from a run on other data are never
    scored as this run's. A data.json the run lacks is restored from model.pt's (`restore`)."""
    if not (isinstance(read, dict) and isinstance(read.get("sha256"), str) and isinstance(read.get("corpus"), str)):
        raise PosbenchError(f"{Path(rdir) / WEIGHTS}: its record of the data it read is malformed; retrain the run")
    said = data_read(rdir)
    if said is None:
        if restore:
            with contextlib.suppress(OSError):  # a folder this user cannot write: nothing to hold it against
                record_read(rdir, read["corpus"], read["sha256"])
        return
    name, was = said
    if was != read["sha256"]:
        raise PosbenchError(
            f"{Path(rdir) / DATA} does not describe model.pt: its weights were trained on {read['corpus']} with "
            f"sha256 {read['sha256'][:12]}, data.json names {name} with sha256 {was[:12]}; restore the run's own "
            f"files, or delete the run to train it anew"
        )
