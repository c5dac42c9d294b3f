"""Tokenizers, corpora in other formats, prepared (memory-mapped) corpora and bits per byte."""

import csv
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
from conftest import SMOKE, invoke

from posbench.config import DataConfig
from posbench.data import CorpusBatches, load_corpus
from posbench.text import CHUNK, chunks, split_stream

pytest.importorskip("tokenizers")

WORDS = ["the", "king", "queen", "sword", "love", "death", "night", "day", "crown", "heart", "fair", "lord"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Each test trains its BPEs into a cache of its own."""
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "cache"))


def _lines(n=3000, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(n)]


@pytest.fixture
def words(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("\n".join(_lines()) + "\n")
    return path


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _smoke(out, *more):
    return invoke("extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={out}", *more)


# --- bits per byte -----------------------------------------------------------------------------------


def test_bits_per_byte_of_bytes_is_the_loss_over_ln_2(tmp_path, words):
    res = _smoke(tmp_path / "r", "--set", f"data.path={words}")
    assert res.exit_code == 0, res.output
    for r in _rows(tmp_path / "r" / "smoke" / "alibi-seed0" / "eval.csv"):
        assert r["tokenizer"] == "bytes"
        assert float(r["bpb"]) == float(r["loss"]) / math.log(2)
    assert "bpb(32)" in (tmp_path / "r" / "smoke" / "summary.md").read_text()


def test_bits_per_byte_of_bpe_divides_by_the_bytes_its_tokens_spell(tmp_path, words):
    res = _smoke(
        tmp_path / "r", "--set", f"data.path={words}", "--set", "data.tokenizer=bpe", "--set", "data.vocab_size=300"
    )
    assert res.exit_code == 0, res.output
    corpus = load_corpus(DataConfig(path=str(words), tokenizer="bpe", vocab_size=300))
    rows = _rows(tmp_path / "r" / "smoke" / "alibi-seed0" / "eval.csv")
    n = int(rows[0]["tokens"])
    from tokenizers import Tokenizer

    (cached,) = (tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json")
    spelled = len(Tokenizer.from_file(str(cached)).decode(corpus.val[1 : n + 1].tolist()).encode())
    assert corpus.bytes_of(corpus.val[1 : n + 1]) == spelled > 2 * n  # a token is several bytes
    for r in rows:
        assert r["tokenizer"] == "bpe-300"
        assert float(r["bpb"]) == pytest.approx(float(r["loss"]) * n / (spelled * math.log(2)), rel=1e-12)
    summary = (tmp_path / "r" / "smoke" / "summary.md").read_text()
    assert "tokenizer: bpe-300" in summary and "perplexity per token (bpe-300)" in summary


def test_old_eval_files_read_as_bytes():
    """eval.csv written before tokenizers (the committed references) reads with bpb = loss / ln 2."""
    from conftest import ROOT

    from posbench.measures.perplexity.records import read_eval

    rows = read_eval(ROOT / "results" / "reference" / "alibi-seed0")
    assert rows and all(r["tokenizer"] == "bytes" for r in rows)
    assert float(rows[0]["bpb"]) == float(rows[0]["loss"]) / math.log(2)


# --- the tokenizer -----------------------------------------------------------------------------------


def test_a_cached_tokenizer_is_reused_not_trained_again(tmp_path, words):
    args = ("--set", f"data.path={words}", "--set", "data.tokenizer=bpe", "--set", "data.vocab_size=300")
    first = _smoke(tmp_path / "a", *args)
    assert first.exit_code == 0 and "training a byte-level BPE of 300 tokens" in first.output
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json")
    stamp = cached.stat().st_mtime_ns
    second = _smoke(tmp_path / "b", *args)
    assert second.exit_code == 0 and "training a byte-level BPE" not in second.output
    assert cached.stat().st_mtime_ns == stamp
    a, b = (_rows(tmp_path / d / "smoke" / "alibi-seed0" / "eval.csv") for d in ("a", "b"))
    assert a == b


def test_the_tokenizer_never_saw_the_validation_text(tmp_path):
    """Letters that occur only in the held-out tail never merge into a token."""
    text = "\n".join(_lines(2000)) + "\n" + "QJXZ QJXZ ZXJQ\n" * 200
    path = tmp_path / "t.txt"
    path.write_text(text)
    val_fraction = (len("QJXZ QJXZ ZXJQ\n") * 200 + 10) / len(text)
    data = DataConfig(path=str(path), tokenizer="bpe", vocab_size=400, val_fraction=val_fraction)
    load_corpus(data)
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("bpe-400-*.json")
    vocab = json.loads(cached.read_text())["model"]["vocab"]
    merged = [t for t in vocab if len(t) > 1 and set(t.replace("Ġ", "")) & set("QJXZ")]
    assert merged == []
    whole = DataConfig(path=str(path), tokenizer="bpe", vocab_size=400, val_fraction=0.001)
    load_corpus(whole)  # trained on the same text with the tail in training: the letters merge
    other = [p for p in (tmp_path / "cache" / "tokenizers").glob("bpe-400-*.json") if p != cached]
    assert any(len(t) > 1 and set(t) & set("QJXZ") for t in json.loads(other[0].read_text())["model"]["vocab"])


def test_a_tokenizer_json_and_a_sentencepiece_model_are_used_as_given(tmp_path, words):
    load_corpus(DataConfig(path=str(words), tokenizer="bpe", vocab_size=300))
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json")
    by_file = load_corpus(DataConfig(path=str(words), tokenizer=str(cached)))
    trained = load_corpus(DataConfig(path=str(words), tokenizer="bpe", vocab_size=300))
    assert np.array_equal(by_file.train, trained.train) and np.array_equal(by_file.val, trained.val)
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        input=str(words), model_prefix=str(tmp_path / "sp"), vocab_size=290, byte_fallback=True, minloglevel=2
    )
    res = _smoke(tmp_path / "r", "--set", f"data.path={words}", "--set", f"data.tokenizer={tmp_path / 'sp.model'}")
    assert res.exit_code == 0, res.output
    import yaml

    cfg = yaml.safe_load((tmp_path / "r" / "smoke" / "alibi-seed0" / "config.yaml").read_text())
    assert cfg["model"]["vocab_size"] == 290
    assert _rows(tmp_path / "r" / "smoke" / "alibi-seed0" / "eval.csv")[0]["tokenizer"] == "sentencepiece sp.model"


# --- sources and prepared corpora --------------------------------------------------------------------


def test_chunks_are_a_function_of_the_bytes_alone():
    data = b"".join(f"line {i} {'x' * (i % 300)}\n".encode() for i in range(20000))
    whole = list(chunks(iter([data])))
    pieces = [data[i : i + 777] for i in range(0, len(data), 777)]
    assert list(chunks(iter(pieces))) == whole and b"".join(whole) == data
    assert all(len(c) <= CHUNK and c.endswith(b"\n") for c in whole[:-1])
    assert b"".join(split_stream(iter(pieces), 1000, 5000)) == data[1000:5000]


def test_a_line_longer_than_a_chunk_is_cut_before_a_character_however_its_bytes_arrive():
    """A chunk of a line with no newline ends before the character at its size: with "é" across
    byte 4 of 4-byte chunks the cut is at 3, whether the bytes come whole or exactly 4 at a time
    (as a file is read, a block of CHUNK bytes), so no chunk ends inside a character."""
    data = b"abc" + "é".encode() + b"xyz"
    want = [b"abc", "é".encode() + b"xy", b"z"]
    assert list(chunks(iter([data]), 4)) == want
    assert list(chunks(iter([data[:4], data[4:]]), 4)) == want
    line = b"a" * (CHUNK - 1) + "é".encode() + b"b" * 100 + b"\n"
    got = list(chunks(iter([line[:CHUNK], line[CHUNK:]])))
    assert b"".join(got) == line and all(c.decode() for c in got)  # every chunk whole UTF-8


def test_a_wordpiece_tokenizers_bytes_are_its_texts_own(tmp_path):
    """A tokenizer that is not byte-level (WordPiece): "café" is 5 UTF-8 bytes, not 4 characters,
    and "##s" continues a word, spelling 1 byte; so bits per byte counts "cafés" as its 6 bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    from posbench.text import load_tokenizer_file

    vocab = {"[UNK]": 0, "café": 1, "naïve": 2, "##s": 3, "the": 4}
    wordpiece = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    wordpiece.save(str(tmp_path / "wp.json"))
    tok = load_tokenizer_file(str(tmp_path / "wp.json"))
    lengths = tok.byte_lengths()
    assert [int(lengths[vocab[w]]) for w in ("café", "naïve", "##s", "the")] == [5, 6, 1, 3]
    assert int(lengths[tok.encode("cafés".encode())].sum()) == len("cafés".encode())


def test_jsonl_parquet_and_datasets_rows_read_alike(tmp_path):
    texts = _lines(500)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    want = load_corpus(DataConfig(path=str(jsonl)))
    assert bytes(np.asarray(want.train)).startswith((texts[0] + "\n\n" + texts[1]).encode())
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet")
    got = load_corpus(DataConfig(path=str(tmp_path / "c.parquet"), text_field="body"))
    assert np.array_equal(np.asarray(got.train), np.asarray(want.train))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    got = load_corpus(DataConfig(path=str(tmp_path / "ds")))
    assert np.array_equal(np.asarray(got.val), np.asarray(want.val))


def test_a_prepared_corpus_gives_the_batches_and_eval_tokens_of_the_in_memory_one(tmp_path, words):
    res = invoke("prepare", words, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300")
    assert res.exit_code == 0, res.output
    assert "training and" in res.output
    assert "from 0.2 MB in" in " ".join(res.output.split())  # its 160,215 bytes
    small = tmp_path / "small.txt"
    small.write_text("a few words\n" * 500)
    res = invoke("prepare", small, "--out", tmp_path / "small")
    assert res.exit_code == 0 and "from 6,000 bytes in" in " ".join(res.output.split()), res.output  # not 0.0 MB
    assert res.output.startswith("wrote "), res.output  # no progress bar's empty line where no terminal shows it
    prepared = load_corpus(DataConfig(path=str(tmp_path / "prep")))
    assert isinstance(prepared.train, np.memmap)
    memory = load_corpus(DataConfig(path=str(words), tokenizer="bpe", vocab_size=300))
    for L in (16, 64):
        a, b = CorpusBatches(prepared, 8, L), CorpusBatches(memory, 8, L)
        ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for _ in range(5):
            (xa, ya), (xb, yb) = a(ga), b(gb)
            assert xa.dtype == torch.int64 and torch.equal(xa, xb) and torch.equal(ya, yb)
    # a run on the prepared folder takes its tokenizer and scores what the in-memory run scores
    r1 = _smoke(tmp_path / "p", "--set", f"data.path={tmp_path / 'prep'}")
    r2 = _smoke(
        tmp_path / "m", "--set", f"data.path={words}", "--set", "data.tokenizer=bpe", "--set", "data.vocab_size=300"
    )
    assert r1.exit_code == 0 and r2.exit_code == 0, r1.output + r2.output
    rows = [_rows(tmp_path / d / "smoke" / "alibi-seed0" / "eval.csv") for d in ("p", "m")]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]


def test_a_folder_prepared_again_with_another_tokenizer_of_the_same_name_is_other_data(tmp_path, words):
    """A prepared folder is pinned by tokens.json, never read whole: it holds the sha256 of the
    token ids and of the tokenizer's file as prepare wrote them, so the same text through a
    tokenizer file of the same name with two ids swapped gives another pin (a run's data.json
    then refuses it), and the same tokenizer again gives the same one."""
    assert (
        invoke("prepare", words, "--out", tmp_path / "bpe", "--tokenizer", "bpe", "--vocab-size", "300").exit_code == 0
    )
    (file,) = [p for p in (tmp_path / "bpe").glob("*.json") if p.name != "tokens.json"]
    for where in ("a", "b", "c"):
        (tmp_path / where).mkdir()
        shutil.copy2(file, tmp_path / where / "tok.json")
    tok = json.loads((tmp_path / "b" / "tok.json").read_text())
    vocab = tok["model"]["vocab"]
    (x, i), (y, j) = [(k, v) for k, v in vocab.items() if v in (300 - 1, 300 - 2)]
    vocab[x], vocab[y] = j, i
    (tmp_path / "b" / "tok.json").write_text(json.dumps(tok))
    pins = {}
    for where in ("a", "b", "c"):
        res = invoke(
            "prepare", words, "--out", tmp_path / f"prep-{where}", "--tokenizer", tmp_path / where / "tok.json"
        )
        assert res.exit_code == 0, res.output
        meta = json.loads((tmp_path / f"prep-{where}" / "tokens.json").read_text())
        assert len(meta["tokens_sha256"]) == 64 and len(meta["tokenizer_sha256"]) == 64
        pins[where] = (meta["tokenizer"], load_corpus(DataConfig(path=str(tmp_path / f"prep-{where}"))).sha256())
    assert pins["a"][0] == pins["b"][0] and pins["a"][1] != pins["b"][1] and pins["a"] == pins["c"]


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "more,message",
    [
        (("--set", "data.tokenizer=nowhere/tok.json"), "data.tokenizer 'nowhere/tok.json': no such file"),
        (("--set", "data.tokenizer=bpe", "--set", "data.vocab_size=100"), "smaller than the 256 byte symbols"),
        (("--set", "data.vocab_size=300"), "sizes a BPE trained here"),
        (("--set", "data.tokenizer=bpe", "--set", "model.vocab_size=512"), "leave model.vocab_size unset"),
    ],
)
def test_a_bad_tokenizer_is_one_line_and_writes_nothing(tmp_path, words, more, message):
    res = _smoke(tmp_path / "r", "--set", f"data.path={words}", *more)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_missing_text_field_and_an_empty_corpus_are_one_line(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"body": "x"}) + "\n")
    empty = tmp_path / "e.txt"
    empty.write_text("")
    for path, message in ((jsonl, "c.jsonl:1: no field 'text'"), (empty, "is empty")):
        for res in (
            _smoke(tmp_path / "r", "--set", f"data.path={path}", "--set", "data.tokenizer=bpe"),
            invoke("prepare", path, "--out", tmp_path / "prep"),
        ):
            assert res.exit_code == 2, res.output
            assert message in res.output and "Traceback" not in res.output
        assert not (tmp_path / "r").exists() and not (tmp_path / "prep").exists()


def test_an_out_folder_that_takes_no_file_is_one_line_naming_out(tmp_path, words):
    """The lock beside --out is the first thing written: where it cannot be, the line names
    --out as given, not the lock file."""
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    res = invoke("prepare", words, "--out", blocker / "prep")
    assert res.exit_code == 2, res.output
    assert f"--out {blocker / 'prep'}: cannot write there ({blocker} is a file, not a folder)" in res.output
    assert ".lock" not in res.output and len(res.output.strip().splitlines()) == 1
    assert blocker.read_text() == "a file, not a folder"


def test_an_empty_validation_set_of_its_own_is_named_not_the_corpus(tmp_path, words):
    held = tmp_path / "held.txt"
    held.write_text("")
    for res in (
        invoke("prepare", words, "--out", tmp_path / "prep", "--val-path", held),
        _smoke(tmp_path / "r", "--set", f"data.path={words}", "--set", f"data.val_path={held}"),
    ):
        assert res.exit_code == 2 and res.output.count("error:") == 1 and "Traceback" not in res.output, res.output
        assert f"the validation set '{held}' makes 0 validation tokens; too few" in " ".join(res.output.split())
    assert not (tmp_path / "prep").exists() and not (tmp_path / "r").exists()


def test_a_missing_library_names_the_extra(tmp_path, words, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    monkeypatch.delitem(__import__("sys").modules, "tokenizers", raising=False)
    res = _smoke(tmp_path / "r", "--set", f"data.path={words}", "--set", "data.tokenizer=bpe")
    assert res.exit_code == 2
    assert "needs the Python package 'tokenizers': pip install -e '.[text]'" in res.output


def test_a_validation_set_of_its_own_is_held_out_whole(tmp_path, words):
    """data.val_path: the training split is all of data.path, the validation split all of
    val_path, in memory and prepared alike, and the BPE learns from the training files alone."""
    held = tmp_path / "held.txt"
    held.write_text("\n".join(_lines(300, seed=1)) + "\n")
    corpus = load_corpus(DataConfig(path=str(words), val_path=str(held)))
    assert bytes(np.asarray(corpus.train)) == words.read_bytes()
    assert bytes(np.asarray(corpus.val)) == held.read_bytes()
    res = invoke(
        "prepare", words, "--out", tmp_path / "p", "--tokenizer", "bpe", "--vocab-size", "300", "--val-path", held
    )
    assert res.exit_code == 0, res.output
    prepared = load_corpus(DataConfig(path=str(tmp_path / "p")))
    memory = load_corpus(DataConfig(path=str(words), val_path=str(held), tokenizer="bpe", vocab_size=300))
    assert np.array_equal(prepared.val, memory.val) and np.array_equal(prepared.train, memory.train)
    assert prepared.bytes_of(prepared.val) == len(held.read_bytes())


def test_prepares_errors_name_its_own_flags_and_the_fields_it_found(tmp_path):
    """posbench prepare says --text-field and SOURCE (its own words, not the config's
    data.text_field and data.path), and lists the fields a row has; training keeps the keys."""
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"content": "x", "path": "a.py"}) + "\n")
    res = invoke("prepare", jsonl, "--out", tmp_path / "prep")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "(set --text-field to the text's field); its fields: content, path" in said, said
    assert "data.text_field" not in said and not (tmp_path / "prep").exists()
    res = invoke("prepare", tmp_path / "none*.txt", "--out", tmp_path / "prep")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"SOURCE '{tmp_path / 'none*.txt'}' matches no file" in said, said
    res = _smoke(tmp_path / "r", "--set", f"data.path={jsonl}", "--set", "data.tokenizer=bpe")
    assert "(set data.text_field to the text's field); its fields: content, path" in " ".join(res.output.split())


def test_a_second_prepare_into_one_folder_is_refused_naming_the_first(tmp_path):
    """Two `prepare` into one --out never mix their files (tokens.json of one source, train.bin of
    the other's tokens): while one writes, the other is one line naming it, and writes nothing."""
    import os

    from posbench.files import exclusive

    (tmp_path / "a.txt").write_text("to be or not to be that is the question\n" * 200)
    out = tmp_path / "prepared"
    with exclusive(tmp_path / ".prepared.lock") as held:  # as the first process holds it
        assert held
        res = invoke("prepare", tmp_path / "a.txt", "--out", out)
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"another posbench prepare (pid {os.getpid()}) is writing it" in " ".join(res.output.split())
    assert not out.exists()
    res = invoke("prepare", tmp_path / "a.txt", "--out", out)  # once it is done, the folder is free
    assert res.exit_code == 0, res.output
    assert (out / "tokens.json").is_file() and not (tmp_path / ".prepared.lock").exists()


# --- text that is not UTF-8, and characters cut in two -------------------------------------------


def test_text_that_is_not_utf8_is_refused_under_a_text_tokenizer_and_read_as_bytes(tmp_path, words):
    """A text tokenizer never reads a byte that is not UTF-8 (Latin-1 é) as U+FFFD, three bytes that
    bits per byte would count for one: it is one line naming the file and the first such byte,
    and nothing is written; the bytes tokenizer reads the file, counting each byte once."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(words.read_bytes()[:5000] + "café\n".encode("latin-1") + words.read_bytes()[5000:])
    said = f"{latin}: not UTF-8 at byte 5,003 (0xe9); a text tokenizer reads UTF-8"
    for res in (
        invoke("prepare", latin, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300"),
        invoke("prepare", words, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300",
               "--val-path", latin),  # refused while its tokens are written: the folder goes
        _smoke(tmp_path / "r", "--set", f"data.path={latin}", "--set", "data.tokenizer=bpe",
               "--set", "data.vocab_size=300"),
    ):  # fmt: skip
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert said in " ".join(res.output.split()), res.output
        assert not (tmp_path / "prep").exists() and not (tmp_path / ".prep.partial").exists()
        assert not (tmp_path / "r").exists()
    res = invoke("prepare", latin, "--out", tmp_path / "prep")
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "prep" / "tokens.json").read_text())
    assert meta["train_bytes"] + meta["val_bytes"] == latin.stat().st_size


def test_the_first_byte_that_is_not_utf8_is_found_across_blocks(tmp_path):
    from posbench.errors import PosbenchError
    from posbench.text import utf8

    two = "é".encode()  # a character of two bytes, cut between two blocks
    assert b"".join(utf8(iter([b"ab" + two[:1], two[1:] + b"cd"]), tmp_path)) == b"ab" + two + b"cd"
    for blocks, at in (
        ([b"ab" + two[:1], two[1:] + b"c\xff"], 5),
        ([b"ab" + two[:1], b"cd"], 2),
        ([b"abc" + two[:1]], 3),  # the file ends inside a character
    ):
        with pytest.raises(PosbenchError, match=f"not UTF-8 at byte {at} "):
            list(utf8(iter(blocks), tmp_path))


def test_no_character_is_cut_in_two_so_bits_per_byte_counts_the_file(tmp_path):
    """A line longer than a piece (16 KiB) is cut inside it, and the validation split starts at
    a byte offset: each at the start of a character, or a text tokenizer reads U+FFFD there."""
    text = tmp_path / "long.txt"
    text.write_text(("x" + "é" * 9000 + "\n") * 6, encoding="utf-8")  # 18,002 bytes a line, é at odd offsets
    assert all(c.decode() for c in chunks(iter([text.read_bytes()]), 2**14))
    res = invoke("prepare", text, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300")
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "prep" / "tokens.json").read_text())
    assert meta["train_bytes"] + meta["val_bytes"] == text.stat().st_size


def test_a_token_id_past_the_vocabulary_in_a_prepared_file_is_one_line(tmp_path, words):
    """Refused before anything is trained or written, in one line naming the file, the id
    and the vocabulary."""
    res = invoke("prepare", words, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300")
    assert res.exit_code == 0, res.output
    vocab = json.loads((tmp_path / "prep" / "tokens.json").read_text())["vocab_size"]
    val = np.memmap(tmp_path / "prep" / "val.bin", dtype=np.uint16, mode="r+")
    val[7] = 4000  # a file written by hand, or by another prepare, under this tokens.json
    val.flush()
    res = _smoke(tmp_path / "r", "--set", f"data.path={tmp_path / 'prep'}")
    last = res.output.strip().splitlines()[-1]  # after a note that the C kernels are built, in this cache
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert last.startswith(
        f"error: {tmp_path / 'prep' / 'val.bin'}: holds token id 4,000, past the vocabulary of {vocab:,}"
    )
    assert not (tmp_path / "r").exists()


def test_a_sentencepiece_style_tokenizer_json_counts_the_bytes_its_tokens_spell_and_scores_no_bos(tmp_path):
    """A tokenizer.json in Llama 2's style: pieces with ▁ for a space, byte fallback (<0x0A> is
    one byte, not six) and a template that adds a BOS, which is never inserted into the text.
    Its tokens spell the text's bytes plus the one ▁ it prepends to a piece."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    from posbench.text import load_tokenizer_file

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    text = "the cat sat on the mat, the dog ate the hat. " * 40  # no line end: it falls back to a byte
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=330, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    t = load_tokenizer_file(str(path))
    sample = "the cat\nate the hat é\n"  # é is not in the vocabulary: two fallback bytes
    ids = t.encode(sample.encode())
    assert 1 not in ids.tolist()  # no BOS
    pieces = [tok.id_to_token(i) for i in ids]
    assert "<0x0A>" in pieces and "<0xC3>" in pieces and "<0xA9>" in pieces
    lengths = t.byte_lengths()
    assert lengths[tok.token_to_id("<0x0A>")] == 1 and lengths[1] == 0
    assert int(lengths[ids].sum()) == len(sample.encode()) + 1  # the ▁ prepended to the piece


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: f.write_bytes(b"garbage, not an array"),
        lambda f: f.write_bytes(f.read_bytes()[:40]),  # cut inside the header
        lambda f: f.write_bytes(b""),
        lambda f: np.save(f, np.ones(7, np.int64)),  # an array, of another vocabulary's length
        lambda f: np.save(f, np.array([{"a": 1}], dtype=object)),  # pickled objects are never loaded
    ],
)
def test_a_damaged_byte_lengths_file_in_a_prepared_folder_is_one_line(tmp_path, words, damage):
    """byte_lengths.npy turns token losses into bits per byte: damaged, it is named in one line
    before anything trains, as the token files are."""
    res = invoke("prepare", words, "--out", tmp_path / "prep", "--tokenizer", "bpe", "--vocab-size", "300")
    assert res.exit_code == 0, res.output
    vocab = json.loads((tmp_path / "prep" / "tokens.json").read_text())["vocab_size"]
    lengths = tmp_path / "prep" / "byte_lengths.npy"
    damage(lengths)
    res = _smoke(tmp_path / "r", "--set", f"data.path={tmp_path / 'prep'}")
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert last.startswith(f"error: {lengths}: damaged, not the {vocab:,} byte lengths"), res.output
    assert not (tmp_path / "r").exists()


def test_a_validation_set_that_is_a_training_file_is_refused(tmp_path):
    """Its scores would be the training loss: prepare and a run refuse it, naming the file."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("to be or not to be that is the question " * 2000)
    res = invoke("prepare", corpus, "--out", tmp_path / "prep", "--val-path", corpus)
    assert res.exit_code == 2 and f"--val-path {corpus}: {corpus} is also a training file; hold it out" in " ".join(
        res.output.split()
    ), res.output
    assert not (tmp_path / "prep").exists()
    out = tmp_path / "r"
    res = invoke(
        "extrapolate", "--set", f"data.path={corpus}", "--set", f"data.val_path={corpus}", "--set", f"out_dir={out}"
    )
    assert res.exit_code == 2 and "is also a training file; hold it out" in res.output, res.output
    assert not list(out.rglob("model.pt"))


def test_a_split_too_small_names_the_fraction_that_made_it(tmp_path):
    """Not "the corpus is too small": 0.999999 of 1,000 bytes leaves 1 to train on."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("x" * 999 + "\n")
    res = invoke("prepare", corpus, "--out", tmp_path / "prep", "--val-fraction", "0.999999")
    said = f"the corpus '{corpus}' has 1,000 bytes: at val_fraction 0.999999, 1 to train on and 999 to validate"
    assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    assert not (tmp_path / "prep").exists()
