"""Text beyond Shakespeare bytes: formats, tokenizers and prepared corpora.

Where a corpus's text comes from, how it becomes tokens, and corpora prepared once into
memory-mapped token files (`posbench prepare`).

Sources (data.path):
  - text files, or a glob of them;
  - .jsonl and .parquet files, one document per row in the field data.text_field;
  - a Hugging Face `datasets` folder saved with save_to_disk;
  - a folder `posbench prepare` wrote (tokens.json beside train.bin and val.bin).

Tokenizers (data.tokenizer):
  - bytes: each byte a token, 256 of them;
  - bpe: a byte-level BPE of data.vocab_size tokens. Hugging Face `tokenizers` trains it on the
    training split alone; it is cached by the corpus's digest, the split and the size;
  - the path of a tokenizer.json (Hugging Face) or of a sentencepiece .model.

How a corpus becomes tokens:
  - A corpus is one byte stream: the files joined as they are, or each row's text followed by a
    blank line.
  - Its last val_fraction of bytes is the validation split, unless data.val_path names one.
  - Each split is cut into chunks of at most CHUNK bytes, at the last line end in each.
  - Each chunk is encoded on its own. So a corpus prepared once and the same text read into
    memory give the same tokens.
The formats' libraries (tokenizers, sentencepiece, datasets, pyarrow) come with the `text` extra.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from posbench.errors import PosbenchError
from posbench.files import atomic, cache_dir, room_in

CHUNK = 1 << 20  # the bytes read and encoded at once, at most: a chunk ends at its last line end
PIECE = 1 << 14  # the bytes of one text a tokenizer encodes, at most, cut likewise
PREPARED = "tokens.json"  # what marks a folder `posbench prepare` wrote
EXTRA = "pip install -e '.[text]'"  # the install line a missing library's error names
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte


def need(module: str, what: str):
    """`import module`, or one line naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PosbenchError(f"{what} needs the Python package '{module}': {EXTRA}") from None


# --- sources ---------------------------------------------------------------------------------------


def is_prepared(path: Optional[str]) -> bool:
    return bool(path) and (Path(os.path.expanduser(path)) / PREPARED).is_file()


def is_dataset_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


KEYS = {"path": "data.path", "text_field": "data.text_field", "val_path": "data.val_path"}  # a config names them
FLAGS = {"path": "SOURCE", "text_field": "--text-field", "val_path": "--val-path"}  # posbench prepare names them


def source_files(pattern: str, what: str = "data.path") -> list[Path]:
    """The files (or `datasets` folders) a path or glob names, in name order."""
    expanded = os.path.expanduser(pattern)
    if is_dataset_folder(Path(expanded)):
        return [Path(expanded)]
    found = sorted(glob.glob(expanded, recursive=True))
    files = [Path(f) for f in found if os.path.isfile(f) or is_dataset_folder(Path(f))]
    if not files:
        raise matches_no_file(pattern, what)
    return files


def matches_no_file(pattern: str, what: str) -> PosbenchError:
    """The error for a path or glob that names no file; a folder is told how to name its files."""
    folder = os.path.isdir(os.path.expanduser(pattern))
    inside = f"; it is a folder: give its files, e.g. '{Path(pattern) / '*.txt'}'" if folder else ""
    return PosbenchError(f"{what} '{pattern}' matches no file{inside}")


def pieces(
    pattern: str, field: str, what: str = "data.path", field_key: str = "data.text_field", text: bool = False
) -> Iterator[bytes]:
    """The corpus's byte stream in pieces, read one file (or batch of rows) at a time; `what`
    and `field_key` are how an error names the path and the field (a config key, or a flag).
    With `text` (a text tokenizer reads it) a plain file must be UTF-8 (`utf8`)."""
    for f in source_files(pattern, what):
        if f.is_dir():
            yield from _dataset_rows(f, field, field_key)
        elif f.suffix == ".jsonl":
            yield from _jsonl_rows(f, field, field_key)
        elif f.suffix == ".parquet":
            yield from _parquet_rows(f, field, field_key)
        else:
            with f.open("rb") as fh:
                blocks = iter(lambda: fh.read(CHUNK), b"")
                yield from utf8(blocks, f) if text else blocks


def check_splits(name: str, train: int, val: int, val_path: Optional[str]) -> None:
    """At least two tokens a split (an input and its target); one line naming what is too short."""
    if val_path and val < 2 <= train:
        raise PosbenchError(f"the validation set '{val_path}' makes {val} validation tokens; too few")
    if train < 2 or val < 2:
        raise PosbenchError(f"the corpus '{name}' makes {train} training and {val} validation tokens; too few")


def utf8(blocks: Iterator[bytes], path: Path) -> Iterator[bytes]:
    """A file's blocks as they are, checked to be UTF-8 on the way. A text tokenizer would read
    a byte that is not as U+FFFD, three bytes that bits per byte would count for one: refused,
    naming the first such byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    at = 0  # the file's bytes before this block
    for block in itertools.chain(blocks, [b""]):
        held = len(decoder.getstate()[0])  # a character's first bytes, carried over from the last block
        try:
            decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise PosbenchError(
                f"{path}: not UTF-8 at byte {at - held + e.start:,} (0x{e.object[e.start]:02x}); a text tokenizer "
                f"reads UTF-8: convert the file (e.g. iconv -f latin1 -t utf-8), or use the bytes tokenizer"
            ) from None
        at += len(block)
        if block:
            yield block


def _document(text, where: str, field: str, key: str) -> bytes:
    if not isinstance(text, str):
        raise PosbenchError(f"{where}: field '{field}' ({key}) holds {type(text).__name__}, not text")
    try:
        return text.encode("utf-8") + b"\n\n"
    except UnicodeEncodeError as e:  # a lone surrogate, as JSON's "\ud800" gives
        raise PosbenchError(f"{where}: field '{field}' holds {text[e.start]!r}, which UTF-8 cannot encode") from None


def _jsonl_rows(path: Path, field: str, key: str) -> Iterator[bytes]:
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PosbenchError(f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x}); JSON is UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise PosbenchError(f"{path}:{n}: not a JSON object per line") from None
            if not isinstance(row, dict) or field not in row:
                have = f"; its fields: {', '.join(row)}" if isinstance(row, dict) and row else ""
                raise PosbenchError(f"{path}:{n}: no field '{field}' (set {key} to the text's field){have}")
            yield _document(row[field], f"{path}:{n}", field, key)


def _parquet_rows(path: Path, field: str, key: str) -> Iterator[bytes]:
    pq = need("pyarrow.parquet", f"reading {path}")
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own kinds for a file that is not parquet
        raise PosbenchError(f"{path}: not a readable parquet file ({e})") from None
    if field not in table.schema_arrow.names:
        have = ", ".join(table.schema_arrow.names)
        raise PosbenchError(f"{path}: no column '{field}' ({key}); its columns: {have}")
    for rows in table.iter_batches(columns=[field], batch_size=1024):
        for text in rows.column(0).to_pylist():
            yield _document(text, str(path), field, key)


def _dataset_rows(path: Path, field: str, key: str) -> Iterator[bytes]:
    datasets = need("datasets", f"reading the datasets folder {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise PosbenchError(f"{path}: not a datasets folder saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise PosbenchError(f"{path}: a DatasetDict without a 'train' split (its splits: {', '.join(ds)})")
        ds = ds["train"]
    if field not in ds.column_names:
        raise PosbenchError(f"{path}: no column '{field}' ({key}); its columns: {', '.join(ds.column_names)}")
    for rows in ds.iter(batch_size=1024):
        for text in rows[field]:
            yield _document(text, str(path), field, key)


# --- the split and the chunks ----------------------------------------------------------------------


def too_small(name: str, total: int, split: int, val_fraction: float) -> PosbenchError:
    """A split of fewer than 2 bytes (an input and its target), named with the fraction that made it."""
    return PosbenchError(
        f"the corpus '{name}' has {total:,} bytes: at val_fraction {val_fraction}, {split:,} to train on and "
        f"{total - split:,} to validate; each needs at least 2"
    )


def split_point(total: int, val_fraction: float) -> int:
    """Where validation starts: the last int(total * val_fraction) bytes are held out."""
    return total - int(total * val_fraction)


def chunks(stream: Iterator[bytes], size: int = CHUNK) -> Iterator[bytes]:
    """The stream cut into chunks of at most `size` bytes, each ending at its last line end (or,
    for a line longer than that, before the UTF-8 character at `size`): a function of the bytes
    alone, however they arrive."""
    buf = b""
    for piece in stream:
        buf += piece
        while len(buf) > size:  # the byte at `size` has arrived: char_start can see where it falls
            cut = buf.rfind(b"\n", 0, size) + 1 or char_start(buf, size) or size
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def char_start(data: bytes, at: int) -> int:
    """`at`, moved back to the first byte of the UTF-8 character it falls inside (by at most 3
    bytes, the continuation bytes of one character): a text tokenizer given half a character
    reads U+FFFD, whose three bytes bits per byte would count."""
    back = 0
    while back < 3 and 0 < at - back < len(data) and data[at - back] & 0xC0 == 0x80:
        back += 1
    return at - back


def text_split(stream, at: int) -> int:
    """Where a text tokenizer's validation split starts: `at`, or the start of the character
    it falls inside, read from the few bytes before it (`stream()` gives the corpus afresh)."""
    start = max(at - 3, 0)
    return start + char_start(b"".join(split_stream(stream(), start, at + 1)), at - start)


def split_stream(stream: Iterator[bytes], start: int, stop: Optional[int]) -> Iterator[bytes]:
    """The bytes [start, stop) of a stream of pieces (stop None: to its end)."""
    at = 0
    for piece in stream:
        a, b = max(start - at, 0), len(piece) if stop is None else min(stop - at, len(piece))
        if a < b:
            yield piece[a:b]
        at += len(piece)
        if stop is not None and at >= stop:
            return


# --- tokenizers ------------------------------------------------------------------------------------


@dataclass
class Tokenizer:
    """What every tokenizer gives: a name for the tables, its size, encode, and the UTF-8 bytes
    each token spells (what bits per byte divides by)."""

    name: str
    vocab_size: int
    kind: str  # bytes, hf (tokenizer.json and posbench's bpe), sentencepiece
    impl: object = None
    file: Optional[Path] = None  # the tokenizer's own file (bpe: its cached tokenizer.json)

    def encode(self, chunk: bytes) -> np.ndarray:
        if self.kind == "bytes":
            return np.frombuffer(chunk, dtype=np.uint8)
        # in pieces of at most PIECE bytes at line ends, encoded as a batch (in parallel, where
        # the library can): a function of the chunk alone, as the chunks are of the stream
        texts = [p.decode("utf-8", errors="replace") for p in chunks(iter([chunk]), PIECE)]
        if self.kind == "hf":
            # no special tokens: a BOS a template adds to every piece would be scored as text
            ids = [e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = self.impl.encode(texts)
        return np.fromiter((i for row in ids for i in row), dtype=np.int64)

    def byte_lengths(self) -> np.ndarray:
        """(vocab_size,) the bytes each token stands for: 1 for bytes; a byte-level BPE's token
        spelled back to its bytes; a sentencepiece piece with ▁ as a space and <0xNN> as one
        byte; 0 for control tokens. Elsewhere a token's decoded text in UTF-8."""
        if self.kind == "bytes":
            return np.ones(self.vocab_size, dtype=np.int64)
        out = np.zeros(self.vocab_size, dtype=np.int64)
        if self.kind == "sentencepiece":
            for i in range(self.vocab_size):
                piece = self.impl.id_to_piece(i)
                if self.impl.is_control(i) or self.impl.is_unknown(i):
                    continue
                out[i] = 1 if self.impl.is_byte(i) else len(piece.replace("\u2581", " ").encode())
            return out
        decoder = _byte_decoder()
        special = {t.content for t in self.impl.get_added_tokens_decoder().values() if t.special}
        raw = self.impl.to_str()
        spec = raw.replace(" ", "")
        fallback = '"byte_fallback":true' in spec
        byte_level = '"type":"ByteLevel"' in spec  # its characters stand for bytes (GPT-2's table)
        glue = json.loads(raw)["model"].get("continuing_subword_prefix") or ""  # WordPiece's ##
        for token, i in self.impl.get_vocab().items():
            if i >= self.vocab_size:
                continue
            if fallback and _BYTE_PIECE.fullmatch(token):  # sentencepiece's byte fallback: <0x0A> is one byte
                out[i] = 1
            elif token in special:
                continue  # a control token spells no text
            elif "\u2581" in token or fallback:  # a sentencepiece-style piece: ▁ stands for a space
                out[i] = len(token.replace("\u2581", " ").encode())
            elif byte_level and all(c in decoder for c in token):  # each character stands for one byte
                out[i] = len(token)
            elif glue and token.startswith(glue):  # a word's continuation: the prefix spells nothing
                out[i] = len(token[len(glue) :].encode())
            else:
                out[i] = len(self.impl.decode([i]).encode())
        return out


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_decoder() -> dict:
    """GPT-2's byte-to-character table, inverted: the byte-level BPE's characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def tokenizer_kind(spec: str) -> str:
    """bytes, bpe, hf (a tokenizer.json) or sentencepiece (a .model), from data.tokenizer."""
    if spec in ("bytes", "bpe"):
        return spec
    return "sentencepiece" if spec.endswith(".model") else "hf"


def tokenizer_file(spec: str) -> Path:
    path = Path(os.path.expanduser(spec))
    if not path.is_file():
        raise PosbenchError(
            f"data.tokenizer '{spec}': no such file; expected bytes, bpe, or the path of a tokenizer.json "
            f"or a sentencepiece .model"
        )
    return path


def load_tokenizer_file(spec: str) -> Tokenizer:
    """A tokenizer.json (Hugging Face tokenizers) or a sentencepiece .model."""
    path = tokenizer_file(spec)
    if tokenizer_kind(spec) == "sentencepiece":
        spm = need("sentencepiece", f"data.tokenizer {spec}")
        try:
            sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise PosbenchError(f"data.tokenizer {spec}: not a sentencepiece model ({e})") from None
        return Tokenizer(f"sentencepiece {path.name}", sp.get_piece_size(), "sentencepiece", sp, path)
    tokenizers = need("tokenizers", f"data.tokenizer {spec}")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise PosbenchError(f"data.tokenizer {spec}: not a tokenizer.json ({str(e).splitlines()[0][:120]})") from None
    return Tokenizer(f"{path.name}", tok.get_vocab_size(), "hf", tok, path)


def vocab_of(data) -> int:
    """The model's vocabulary under data.tokenizer, read without training anything."""
    if is_prepared(data.path):
        return int(read_prepared_meta(data.path)["vocab_size"])
    kind = tokenizer_kind(data.tokenizer)
    if kind == "bytes":
        return BYTE_ALPHABET
    if kind == "bpe":
        need("tokenizers", "data.tokenizer=bpe")
        return data.vocab_size
    return load_tokenizer_file(data.tokenizer).vocab_size


def bpe(train: Iterator[bytes], vocab_size: int, key: str, progress=None) -> Tokenizer:
    """A byte-level BPE of vocab_size tokens trained on `train` (the training split's chunks),
    or the one cached under `key` (the corpus's digest, its split and the size)."""
    tokenizers = need("tokenizers", "data.tokenizer=bpe")
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if not path.is_file():
        if progress is not None:
            progress(
                f"training a byte-level BPE of {vocab_size} tokens on the training split (cached in {path.parent})"
            )
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator((c.decode("utf-8", errors="replace") for c in train), trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic(path) as tmp:  # a half-written tokenizer never passes for a cached one
            tok.save(str(tmp))
    tok = tokenizers.Tokenizer.from_file(str(path))
    return Tokenizer(f"bpe-{vocab_size}", tok.get_vocab_size(), "hf", tok, path)


# --- a corpus as tokens ----------------------------------------------------------------------------


@dataclass
class Tokens:
    """A corpus's two splits as token arrays (in memory, or memory-mapped), with the tokenizer."""

    name: str
    train: np.ndarray
    val: np.ndarray
    tokenizer: str
    byte_lengths: np.ndarray  # (vocab,) the bytes each token spells


def digest(stream: Iterator[bytes]) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    for piece in stream:
        h.update(piece)
        n += len(piece)
    return h.hexdigest(), n


def held_out(data, names=KEYS) -> None:
    """A validation set of its own must not be one of the training files: its scores would be
    the training loss."""
    train = {f.resolve() for f in source_files(data.path, names["path"])} if data.path else set()
    both = sorted(f for f in source_files(data.val_path, names["val_path"]) if f.resolve() in train)
    if both:
        raise PosbenchError(f"{names['val_path']} {data.val_path}: {both[0]} is also a training file; hold it out")


def tokenize(data, stream, progress=None, report=None, names=KEYS) -> tuple[Tokenizer, Iterator, Iterator]:
    """The tokenizer (a BPE trained on the training split if asked) and the two splits' token
    arrays, chunk by chunk. `stream()` gives the corpus's pieces afresh each call; `names` says
    how an error names the settings (KEYS, or FLAGS for posbench prepare)."""
    if data.val_path:
        held_out(data, names)

        def val_of():
            text = tokenizer_kind(data.tokenizer) != "bytes"
            return pieces(data.val_path, data.text_field, names["val_path"], names["text_field"], text)

        train_of = stream
        split = None
    else:
        sha, total = digest(stream())
        if total == 0:
            raise PosbenchError(f"the corpus '{data.path}' is empty")
        split = split_point(total, data.val_fraction)
        if tokenizer_kind(data.tokenizer) != "bytes":  # a split that ends inside a character reads U+FFFD
            split = text_split(stream, split)
        if split < 2 or total - split < 2:
            raise too_small(data.path, total, split, data.val_fraction)

        def train_of():
            return split_stream(stream(), 0, split)

        def val_of():
            return split_stream(stream(), split, None)

    kind = tokenizer_kind(data.tokenizer)
    if kind == "bytes":
        tok = Tokenizer("bytes", BYTE_ALPHABET, "bytes")
    elif kind == "bpe":
        if split is None:  # a validation set of its own: the key hashes the training files
            sha, _ = digest(train_of())
        key = hashlib.sha256(f"{sha}:{split}:{data.vocab_size}".encode()).hexdigest()[:16]
        tok = bpe(chunks(train_of()), data.vocab_size, key, progress)
    else:
        tok = load_tokenizer_file(data.tokenizer)

    def encoded(of):
        for c in chunks(of()):
            ids = tok.encode(c)
            if report is not None:
                report(len(c))
            yield ids

    return tok, encoded(train_of), encoded(val_of)


def dtype_for(vocab_size: int):
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def in_memory(data, stream, progress=None) -> Tokens:
    tok, train, val = tokenize(data, stream, progress)
    dt = dtype_for(tok.vocab_size)
    tr = np.concatenate([a.astype(dt) for a in train] or [np.zeros(0, dt)])
    va = np.concatenate([a.astype(dt) for a in val] or [np.zeros(0, dt)])
    return Tokens("", tr, va, tok.name, tok.byte_lengths())


# --- prepared corpora ------------------------------------------------------------------------------


def read_prepared_meta(path: str) -> dict:
    meta_path = Path(os.path.expanduser(path)) / PREPARED
    try:
        meta = json.loads(meta_path.read_text())
        for key in ("train_tokens", "val_tokens", "vocab_size", "dtype", "spec", "tokenizer"):
            meta[key]  # noqa: B018  (present, or a KeyError)
    except (OSError, ValueError, KeyError, TypeError):
        raise PosbenchError(f"{meta_path}: not a tokens.json that posbench prepare wrote; prepare it again") from None
    return meta


def load_prepared(path: str) -> Tokens:
    """A prepared folder's splits, memory-mapped: windows are read from disk as they are drawn."""
    folder = Path(os.path.expanduser(path))
    meta = read_prepared_meta(path)
    dt, vocab = np.dtype(meta["dtype"]), int(meta["vocab_size"])
    arrays = []
    for split in ("train", "val"):
        file = folder / f"{split}.bin"
        want = int(meta[f"{split}_tokens"])
        if not file.is_file() or file.stat().st_size != want * dt.itemsize:
            raise PosbenchError(f"{file}: missing or not the {want:,} tokens tokens.json says; prepare it again")
        tokens = np.memmap(file, dtype=dt, mode="r", shape=(want,))
        top = largest(tokens)
        if top >= vocab:  # the model's embedding has `vocab` rows: such an id would fail deep in a forward pass
            raise PosbenchError(
                f"{file}: holds token id {top:,}, past the vocabulary of {vocab:,} that tokens.json gives; "
                f"prepare it again"
            )
        arrays.append(tokens)
    lengths_file = folder / "byte_lengths.npy"
    lengths = np.ones(vocab, np.int64)  # a folder prepared without it: one byte per token
    if lengths_file.is_file():
        try:
            lengths = np.load(lengths_file, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            lengths = None
        if lengths is None or lengths.shape != (vocab,) or lengths.dtype.kind not in "iu":
            raise PosbenchError(
                f"{lengths_file}: damaged, not the {vocab:,} byte lengths tokens.json's vocabulary needs; "
                f"prepare it again"
            )
    return Tokens(meta.get("name", str(folder)), arrays[0], arrays[1], meta["tokenizer"], lengths)


def largest(tokens: np.ndarray, step: int = 1 << 24) -> int:
    """The largest id in a memory-mapped token file, read a slice at a time (never whole in
    memory), as fast as the disk reads it, once per process that loads it."""
    return max((int(tokens[i : i + step].max()) for i in range(0, len(tokens), step)), default=-1)


def prepare(data, out: Path, progress=None, advance=None) -> dict:
    """Tokenize data.path once into out/: train.bin and val.bin (uint8, uint16 or uint32),
    byte_lengths.npy, the tokenizer's own file and tokens.json (tokenizer, source digests, token
    and byte counts). Written under a temporary name and renamed when whole, by one process at a
    time: a second `posbench prepare` into the same folder is refused, naming the first."""
    from posbench.files import exclusive, file_in_the_way, lock_holder

    out = Path(out)
    lock = out.resolve().with_name(f".{out.resolve().name}.lock")  # beside it; `--out .` too
    try:  # the lock is the first thing written: a folder that takes no file is said as --out's
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    except OSError as e:
        file = file_in_the_way(lock.parent)
        why = f"{file} is a file, not a folder" if file else e.strerror or e
        raise PosbenchError(f"--out {out}: cannot write there ({why})") from None
    with exclusive(lock) as held:
        if not held:
            pid = lock_holder(lock)
            raise PosbenchError(
                f"{out}: another posbench prepare{f' (pid {pid})' if pid else ''} is writing it; wait for it to "
                f"finish, or choose another --out"
            )
        try:
            return _prepare(data, out, progress, advance)
        finally:
            lock.unlink(missing_ok=True)  # while still held: a process that opened it takes the next one


def _prepare(data, out: Path, progress, advance) -> dict:
    import shutil

    if is_prepared(data.path):
        raise PosbenchError(f"SOURCE {data.path}: already a prepared folder")
    if out.exists() and any(out.iterdir()):
        raise PosbenchError(f"{out}: exists and is not empty; choose another --out or delete it")

    def stream():
        text = tokenizer_kind(data.tokenizer) != "bytes"
        return pieces(data.path, data.text_field, FLAGS["path"], FLAGS["text_field"], text)

    sources = [str(f) for f in source_files(data.path, FLAGS["path"])]
    tok, train, val = tokenize(data, stream, progress, advance, FLAGS)
    tmp = out.with_name("." + out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:  # a source refused half-way, a full disk or Ctrl-C leaves nothing behind
        with room_in(out):
            meta = _write_tokens(data, tok, train, val, tmp, stream, sources)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return meta


def _write_tokens(data, tok: Tokenizer, train: Iterator, val: Iterator, tmp: Path, stream, sources) -> dict:
    """The prepared folder's files, into `tmp`; returns what tokens.json says."""
    import shutil

    dt = dtype_for(tok.vocab_size)
    counts = {}
    lengths = tok.byte_lengths()
    tokens = hashlib.sha256()  # both splits' token ids as written: what a run reads, pinned by its data.json
    for split, arrays in (("train", train), ("val", val)):
        n = nbytes = 0
        tokens.update(f"|{split}|".encode())
        with (tmp / f"{split}.bin").open("wb") as fh:
            for a in arrays:
                chunk = a.astype(dt).tobytes()
                fh.write(chunk)
                tokens.update(chunk)
                n += len(a)
                nbytes += int(lengths[a].sum()) if len(a) else 0
        counts[split] = (n, nbytes)
    check_splits(data.path, counts["train"][0], counts["val"][0], data.val_path)
    np.save(tmp / "byte_lengths.npy", lengths)
    if tok.file is not None:
        shutil.copy2(tok.file, tmp / tok.file.name)
    meta = {
        "name": f"{data.path} ({tok.name})",
        "spec": data.tokenizer,  # data.tokenizer as given, and data.vocab_size: a config reading it takes them
        "bpe_vocab_size": data.vocab_size,
        "tokenizer": tok.name,
        "tokenizer_file": tok.file.name if tok.file is not None else None,
        "vocab_size": tok.vocab_size,
        "dtype": np.dtype(dt).name,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_bytes": counts["train"][1],
        "val_bytes": counts["val"][1],
        "sources": sources,
        "source_sha256": digest(stream())[0],
        "tokens_sha256": tokens.hexdigest(),
        "tokenizer_sha256": hashlib.sha256(tok.file.read_bytes()).hexdigest() if tok.file is not None else None,
        "text_field": data.text_field,
        "val_fraction": None if data.val_path else data.val_fraction,
        "val_path": data.val_path,
    }
    (tmp / PREPARED).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
