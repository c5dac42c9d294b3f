"""Perplexity's records: eval.csv, positions.csv.gz and windows.csv, and their readers.

eval.csv (a row per scheme label, length, protocol and stride), positions.csv.gz (the mean
loss at each window position) and windows.csv (each window's summed loss and scored tokens: a
pretrained model's intervals), their columns and readers; no torch."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError
from posbench.files import GZIP_ERRORS, open_text
from posbench.measures.base import Metric

PROTOCOL_NAMES = {
    "nonoverlapping": "non-overlapping chunks, every token scored once",
    "sliding": "sliding windows, each scoring its last stride tokens, every token scored once",
}
# what each window starts with: a beginning-of-text token would lower the first tokens' loss
WINDOW_START = "each window starts mid-text, with no beginning-of-text token"


def protocol_label(protocol: str, stride) -> str:
    """How a table names a protocol: `nonoverlapping`, `sliding, stride 25`, or for a stride
    that is a fraction of each window, `sliding, stride 0.5 x length`."""
    if protocol == "nonoverlapping":
        return protocol
    return f"{protocol}, stride {stride}" + (" x length" if float(stride) < 1 else "")


EVAL_COLUMNS = [
    "scheme",
    "seed",
    "train_len",
    "length",
    "protocol",
    "stride",
    "loss",
    "ppl",
    "bpb",  # bits per byte: the summed loss in bits over the UTF-8 bytes the scored tokens cover
    "tokens",
    "status",
    "attention",
    "tokenizer",
    "weights",  # the first 16 digits of the sha256 of the weights that scored the row (model.pt's)
]
SUMMARY_COLUMNS = EVAL_COLUMNS[:-1]  # a table's rows: which weights scored each is the run folder's to check
WEIGHTLESS_COLUMNS = EVAL_COLUMNS[:-1]  # eval.csv before its rows named their weights
BYTES_COLUMNS = [c for c in WEIGHTLESS_COLUMNS if c not in ("bpb", "tokenizer")]  # eval.csv before tokenizers: bytes


POSITION_COLUMNS = ["scheme", "length", "protocol", "stride", "position", "loss", "tokens"]
WINDOW_COLUMNS = ["scheme", "length", "protocol", "stride", "window", "loss", "tokens"]  # loss: summed, in nats


STATUSES = ("ok", "beyond-max-len", "non-finite")  # scored; cannot encode the length; blew up


def eval_rows(cfg, rows: list[dict], label: Optional[str] = None, weights: str = "") -> list[dict]:
    """Rows of one run; `label` names an evaluation-time variant's rows, e.g. rope+yarn; `weights`
    the weights that scored them (checkpoint.weights_mark)."""
    from posbench.schemes import run_label

    ident = {"scheme": label or run_label(cfg.model), "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
    return [{**ident, **r, "weights": weights} for r in rows]


def read_eval(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "eval.csv"
    if not path.is_file():
        return []
    bad = PosbenchError(f"{path}: malformed evaluation rows; delete it and run evaluate again")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = reader.fieldnames
    except (UnicodeDecodeError, csv.Error):
        raise bad from None
    if header == BYTES_COLUMNS and rows:  # written before tokenizers: bytes, so bpb = loss / ln 2
        for r in rows:
            ok = r.get("status") == "ok" and r.get("loss") not in (None, "")
            r["bpb"], r["tokenizer"] = (repr(float(r["loss"]) / math.log(2)) if ok else "nan"), "bytes"
        header = WEIGHTLESS_COLUMNS
    if header == WEIGHTLESS_COLUMNS and rows:  # its weights unnamed: taken as the run's own
        rows = [{**{c: r[c] for c in WEIGHTLESS_COLUMNS}, "weights": ""} for r in rows]
    elif header != EVAL_COLUMNS or not rows:
        raise bad
    for r in rows:
        try:
            if min(int(r["length"]), int(r["train_len"])) < 1 or min(int(r["tokens"]), int(r["seed"])) < 0:
                raise ValueError
            if r["status"] not in STATUSES:
                raise ValueError
            # a scored row's mean cross-entropy is finite and >= 0, so its perplexity is >= 1
            if r["status"] == "ok" and not (0 <= float(r["loss"]) < math.inf and 1 <= float(r["ppl"]) < math.inf):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad from None
    seen = set()
    for r in rows:  # one row per what it stands for: a second would be averaged in as if another seed
        if row_key(r) in seen:
            raise PosbenchError(
                f"{path}: {r['scheme']} at length {r['length']} ({r['protocol']}) has two rows; "
                f"delete the file and run evaluate again"
            )
        seen.add(row_key(r))
    return rows


def row_key(r: dict) -> tuple:
    """What one evaluation row stands for: scheme label, length, protocol and stride."""
    return r["scheme"], int(r["length"]), r["protocol"], str(r["stride"] if r["stride"] is not None else "")


POSITIONS = "positions.csv.gz"  # a 16k model's rows run to tens of MB as text
PLAIN_POSITIONS = "positions.csv"  # the same rows uncompressed, also read


def positions_file(run_dir: Path) -> Path:
    """Where a run's loss per position is: positions.csv.gz, else a plain positions.csv."""
    gz, plain = Path(run_dir) / POSITIONS, Path(run_dir) / PLAIN_POSITIONS
    return plain if plain.is_file() and not gz.is_file() else gz


def read_positions(run_dir: Path) -> list[dict]:
    """The rows of positions.csv.gz (or positions.csv): the mean loss at each window position
    (empty if none yet)."""
    return _read_losses(positions_file(run_dir), POSITION_COLUMNS, "position")


def read_windows(run_dir: Path) -> list[dict]:
    """windows.csv's rows: each window's summed loss and its scored tokens (empty if none)."""
    return _read_losses(Path(run_dir) / "windows.csv", WINDOW_COLUMNS, "window")


def _read_losses(path: Path, columns: list[str], per: str) -> list[dict]:
    """A loss-per-`per` file's rows, checked (positions.csv.gz, windows.csv); empty if it is absent."""
    if not path.is_file():
        return []
    try:
        with open_text(path) as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != columns:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r[per]), int(r["tokens"]), float(r["loss"])
    except (UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError, *GZIP_ERRORS):
        raise PosbenchError(f"{path}: malformed loss-per-{per} rows; delete it and run evaluate again") from None
    return rows


METRICS = {  # what a perplexity report tables, by --metric
    "ppl": Metric("ppl", "perplexity per byte", higher_is_better=False, digits=2, column="ppl"),
    "loss": Metric("loss", "loss in nats per byte", higher_is_better=False, digits=3, column="loss"),
    "ratio": Metric("ratio", "perplexity over its perplexity at the training length", False, 3, aggregate="derived"),
    "bpb": Metric(
        "bpb",
        "bits per byte",
        higher_is_better=False,
        digits=3,
        column="bpb",
        compares=("data.tokenizer", "data.vocab_size", "model.vocab_size"),
    ),
}
