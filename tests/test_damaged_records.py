"""Damaged records and checkpoints: each is named in one line, and what is on disk stays as it
was."""

import contextlib
import csv
import errno
import os
import shutil

import pytest
import torch
import yaml
from conftest import SMOKE, invoke, report_refused

from posbench.experiment.checkpoint import weights_digest


def test_run_dir_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    res = invoke("evaluate", tmp_path / "empty")
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "holds no checkpoint (model.pt)" in res.output


def test_corrupt_checkpoint_keeps_what_is_on_disk(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    (run / "model.pt").write_bytes(b"not a checkpoint at all")
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code != 0 and "Traceback" not in res.output
    said = " ".join(res.output.split())
    assert "corrupt or not a posbench checkpoint" in said and "or delete it and rerun the experiment's command" in said
    assert (run / "eval.csv").read_text() == before


def test_status_reads_model_pt_without_torch_and_calls_another_runs_weights_damaged(smoke, tmp_path):
    """Another scheme's model.pt copied into a run folder: evaluate refuses it, and status, which
    reads model.pt's own config without torch (nothing of the file's choosing runs), says the
    same line where it said done."""
    import subprocess
    import sys

    from posbench.experiment.records import weights_record
    from posbench.experiment.status import run_status

    exp, _, _ = smoke
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    record = weights_record(copy / "t5-seed0")
    assert record["config"] == yaml.safe_load((copy / "t5-seed0" / "config.yaml").read_text())
    assert record["read"] == yaml.safe_load((copy / "t5-seed0" / "data.json").read_text())
    shutil.copy2(copy / "t5-seed0" / "model.pt", copy / "rope-seed0" / "model.pt")
    said = f"{copy / 'rope-seed0' / 'config.yaml'} does not describe model.pt ("
    refused = " ".join(invoke("evaluate", copy / "rope-seed0").output.split()).removeprefix("error: ")
    assert refused.startswith(said) and "schemes: ['t5'] in model.pt, ['rope'] in config.yaml" in refused
    rows = {r["run"]: r for r in run_status(copy)}
    assert (rows["rope-seed0"]["state"], rows["rope-seed0"]["detail"]) == ("damaged", refused)
    assert {r["state"] for name, r in rows.items() if name != "rope-seed0"} == {"done"}
    # model.pt's record of its data against data.json: evaluate's line again, and nothing written
    (copy / "t5-seed0" / "data.json").write_text('{"corpus": "elsewhere.txt (bytes)", "sha256": "' + "0" * 64 + '"}')
    refused = " ".join(invoke("evaluate", copy / "t5-seed0").output.split()).removeprefix("error: ")
    assert refused.startswith(f"{copy / 't5-seed0' / 'data.json'} does not describe model.pt"), refused
    row = {r["run"]: r for r in run_status(copy)}["t5-seed0"]
    assert (row["state"], row["detail"]) == ("damaged", refused)
    probe = "import sys; from posbench.experiment.records import weights_record as w; "
    probe += f"r = w({str(copy / 't5-seed0')!r}); print(r['config']['model']['scheme'], 'torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.stdout.split() == ["t5", "False"], res.stdout + res.stderr


def test_weights_of_another_version_of_a_scheme_are_one_line(smoke, tmp_path):
    """A checkpoint whose tensors do not fit the scheme (KERPLE's r1 saved as one per head where
    the scheme holds one per head and layer) says so, instead of calling a good file corrupt."""
    exp, _, _ = smoke
    run = tmp_path / "t5-seed0"
    shutil.copytree(exp / "t5-seed0", run)
    ckpt = torch.load(run / "model.pt", weights_only=True)
    ckpt["model"]["scheme.table"] = ckpt["model"]["scheme.table"][:, :1]
    ckpt["sha256"] = weights_digest(ckpt["model"])  # as the version that saved it wrote it
    torch.save(ckpt, run / "model.pt")
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "its weights do not fit scheme 't5'" in res.output and "retrain it" in res.output


def test_a_checkpoint_with_nan_weights_is_refused(smoke, tmp_path):
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    ckpt = torch.load(run / "model.pt", weights_only=True)
    ckpt["model"]["tok.weight"][0, 0] = float("nan")
    ckpt["sha256"] = weights_digest(ckpt["model"])  # saved so: the checksum holds, the weights do not
    torch.save(ckpt, run / "model.pt")
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "holds non-finite weights" in res.output
    assert (run / "eval.csv").read_text() == before


def test_a_run_records_every_scheme_option_and_a_checkpoint_without_them_is_refused(smoke, tmp_path):
    """A checkpoint that does not say how its scheme was set up cannot be scored as trained:
    its scheme's defaults may differ from this posbench's. One line, and nothing is changed."""
    exp, _, _ = smoke
    run = tmp_path / "t5-seed0"
    shutil.copytree(exp / "t5-seed0", run)
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["model"]["options"]["scale"] == "sqrt_head_dim" and record["model"]["options"]["init"] == "normal"
    ckpt = torch.load(run / "model.pt", weights_only=True)
    for key in ("scale", "init"):
        del ckpt["config"]["model"]["options"][key]
        del ckpt["config"]["scheme_options"]["t5"][key]
    torch.save(ckpt, run / "model.pt")
    (run / "config.yaml").unlink()
    before = (run / "eval.csv").read_text()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and "does not record scheme 't5''s option(s) init, scale" in " ".join(res.output.split())
    assert (run / "eval.csv").read_text() == before


def test_report_of_an_empty_folder(tmp_path):
    res = invoke("report", tmp_path)
    assert res.exit_code != 0 and "holds no evaluated runs" in res.output


def test_damaged_records_are_one_line(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "eval.csv").write_text("scheme,length\nrope,abc\n")
    res = invoke("report", copy)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "eval.csv: malformed evaluation rows" in " ".join(res.output.split())


@pytest.mark.parametrize("column,value", [("length", "-64"), ("ppl", "-5.0"), ("ppl", "inf"), ("loss", "-0.5")])
def test_an_impossible_value_in_eval_csv_is_a_damaged_record_not_a_result(smoke, tmp_path, column, value):
    """A length is positive, and a scored row's mean cross-entropy is finite and >= 0, so its
    perplexity is >= 1: a hand-edited row outside that is refused, not tabled (or bolded)."""
    import csv

    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    path = copy / "rope-seed0" / "eval.csv"
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows, columns = list(reader), reader.fieldnames
    assert rows[0]["status"] == "ok"
    rows[0][column] = value
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    res = invoke("report", copy)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"{path}: malformed evaluation rows" in " ".join(res.output.split())


def test_a_row_given_twice_in_eval_csv_is_a_damaged_record_in_report_and_status(smoke, tmp_path):
    """A second row for one (scheme, length, protocol) would be averaged in as if another seed
    (report crashed on it, exit 1): one line naming it, and status says damaged, committed
    records without weights included."""
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "alibi-seed0" / "model.pt").unlink()  # a committed reference's records
    for run in ("rope-seed0", "alibi-seed0"):
        path = copy / run / "eval.csv"
        with path.open("a") as f:
            f.write(path.read_text().splitlines()[1] + "\n")
    res = invoke("report", copy)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    said = "eval.csv: alibi at length 32 (nonoverlapping) has two rows; delete the file and run evaluate again"
    assert said in " ".join(res.output.split()), res.output
    res = invoke("status", copy)
    states = {
        line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines() if "-seed0" in line
    }
    assert states["rope-seed0"] == states["alibi-seed0"] == "damaged", res.output


def test_an_empty_config_yaml_is_a_damaged_record_not_the_defaults(smoke, tmp_path):
    """A run's config.yaml left empty (a full disk, a crash) would read as the default config:
    a report would make it a grid point of its own, status would show the default train_len."""
    from posbench.experiment.status import run_status

    exp, _, text = smoke
    copy = tmp_path / "smoke"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "config.yaml").write_text("")
    before = (copy / "summary.csv").read_text()
    for args in (
        ["report", copy],
        ["evaluate", copy / "rope-seed0"],
        ["extrapolate", "--config", SMOKE, "--set", f"out_dir={tmp_path}", "--set", f"data.path={text}"],
    ):
        res = invoke(*args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        said = " ".join(res.output.split())
        assert "rope-seed0/config.yaml: empty" in said and len(res.output.strip().splitlines()) <= 2
    assert (copy / "summary.csv").read_text() == before and (copy / "rope-seed0" / "model.pt").is_file()
    row = {r["run"]: r for r in run_status(copy)}["rope-seed0"]
    assert (row["scheme"], row["train_len"]) == ("?", "?")


def test_report_never_drops_a_run_in_silence(smoke, tmp_path):
    """A run whose eval.csv is garbage, empty or only a header is an error naming that file,
    and the summary that was there stays, instead of a summary rewritten without the run."""
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    summary = (copy / "summary.csv").read_text()
    header = (copy / "alibi-seed0" / "eval.csv").read_text().splitlines()[0] + "\n"
    for damage in [
        'garbage,,,"\n',
        "",
        header,
        header + "alibi,0,32,32,2.9,18.1,799,weird\n",
        header + "alibi,0,32,32,abc,18.1,799,ok\n",
        b"\xff\xfe",
    ]:
        target = copy / "alibi-seed0" / "eval.csv"
        target.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
        res = invoke("report", copy)
        assert res.exit_code == 2, (damage, res.output)
        assert "alibi-seed0/eval.csv: malformed evaluation rows" in " ".join(res.output.split()), damage
        assert (copy / "summary.csv").read_text() == summary


def test_report_names_a_run_folder_missing_its_records(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    shutil.copytree(exp, copy)
    (copy / "rope-seed0" / "eval.csv").unlink()
    res = invoke("report", copy)
    assert res.exit_code == 2 and "rope-seed0: a run folder without eval.csv" in " ".join(res.output.split())


def _flip_inside_a_tensor(path):
    """One byte flipped in the middle of model.pt's largest tensor: the file still loads."""
    import struct
    import zipfile

    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF
    path.write_bytes(raw)


def test_a_model_pt_with_bytes_flipped_inside_is_refused_and_no_record_is_touched(smoke, tmp_path):
    """model.pt carries a checksum of its weights, checked on load: a byte flipped inside a
    tensor (which torch loads without a word) is one line, and eval.csv keeps its rows."""
    import torch

    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    good = torch.load(run / "model.pt", weights_only=True)["model"]
    _flip_inside_a_tensor(run / "model.pt")
    bad = torch.load(run / "model.pt", weights_only=True)["model"]
    assert any(not torch.equal(good[k], bad[k]) for k in good)  # it loads, other weights
    before = (run / "eval.csv").read_bytes()
    res = invoke("evaluate", run, "--lengths", "32")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "damaged: its weights do not match the checksum written with them" in " ".join(res.output.split())
    assert (run / "eval.csv").read_bytes() == before


@pytest.mark.parametrize("damaged", ["windows.csv", "positions.csv.gz"])
def test_a_damaged_record_stops_evaluate_before_any_record_is_rewritten(smoke, tmp_path, damaged):
    """evaluate merges new rows into eval.csv, positions.csv.gz and windows.csv: each is read and
    checked before scoring, so a damaged one leaves the other two as they were."""
    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    (run / damaged).write_bytes(b"garbage,x\n")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    res = invoke("evaluate", run, "--lengths", "32,40")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{run / damaged}: " in " ".join(res.output.split())
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_run_is_scored_and_fine_tuned_only_on_the_data_it_read(tmp_path):
    """evaluate, a rerun and extend read data.path afresh; a run's data.json pins the sha256 of
    what it read, so a corpus changed under its name never gives a model's rows on other text:
    each of them refuses other data in one line, before anything is scored or trained, and the
    records stay as they were."""
    from conftest import smoke_experiment

    exp, _, text = smoke_experiment(tmp_path, "--schemes", "alibi")
    run = exp / "alibi-seed0"
    pinned = yaml.safe_load((run / "data.json").read_text())
    assert len(pinned["sha256"]) == 64 and str(text) in pinned["corpus"]
    text.write_text("all the world is a stage and all the men and women merely players\n" * 400)
    before = (run / "eval.csv").read_bytes()
    for args in (
        ["evaluate", run, "--lengths", "32"],
        ["extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={exp.parent}"]
        + ["--set", f"data.path={text}"],
        ["extend", run, "--to", "64", "--steps", "2", "--out", tmp_path / "ext"],
    ):
        res = invoke(*args)
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"read {text} (bytes) with sha256 {pinned['sha256'][:12]}" in said, res.output
        assert "its scores would not compare" in said and (run / "eval.csv").read_bytes() == before
    assert not (tmp_path / "ext").exists()


def test_an_experiments_runs_all_read_one_corpus(tmp_path):
    """A scheme added to an experiment after its corpus changed would be tabled beside runs
    trained on the old text under one corpus line: it is refused before it trains, and a run on
    other data copied in makes the report refuse, each in one line naming both sha256."""
    from conftest import smoke_experiment

    exp, _, text = smoke_experiment(tmp_path, "--schemes", "alibi")
    was = yaml.safe_load((exp / "alibi-seed0" / "data.json").read_text())["sha256"]
    text.write_text("all the world is a stage and all the men and women merely players\n" * 400)
    args = ["extrapolate", "--config", SMOKE, "--set", f"out_dir={exp.parent}", "--set", f"data.path={text}"]
    res = invoke(*args, "--schemes", "rope")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{exp} holds runs that read {text} (bytes) with sha256 {was[:12]} (alibi-seed0)" in said
    assert "a table compares runs on one corpus" in said and not (exp / "rope-seed0").exists()
    assert not list(exp.glob(".rope-seed0*"))
    assert invoke(*args, "--schemes", "rope", "--set", "name=other").exit_code == 0
    shutil.copytree(exp.parent / "other" / "rope-seed0", exp / "rope-seed0")
    now = yaml.safe_load((exp / "rope-seed0" / "data.json").read_text())["sha256"]
    said = report_refused(exp)
    assert f"alibi-seed0 read {text} (bytes) with sha256 {was[:12]}, rope-seed0 read {text} (bytes)" in said
    assert f"with sha256 {now[:12]}: a table compares runs trained on one corpus" in said


def test_rows_scored_by_other_weights_are_never_tabled_as_the_runs_own(tmp_path):
    """Each row of eval.csv names the weights that scored it (model.pt's sha256, 16 digits): the
    eval.csv of another experiment's alibi seed 0 (another budget) copied into this run's folder
    is refused by report and called damaged by status, and the rerun scores its rows again."""
    from conftest import smoke_experiment

    from posbench.experiment.records import weights_record
    from posbench.experiment.status import run_status

    exp, _, text = smoke_experiment(tmp_path, "--schemes", "alibi")
    run = exp / "alibi-seed0"
    own = weights_record(run)["sha256"][:16]
    rows = list(csv.DictReader(open(run / "eval.csv")))
    assert {r["weights"] for r in rows} == {own} and "weights" not in open(exp / "summary.csv").readline()
    args = ["extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"data.path={text}"]
    assert invoke(*args, "--set", f"out_dir={tmp_path / 'b'}", "--set", "train.steps=4").exit_code == 0
    theirs = tmp_path / "b" / "smoke" / "alibi-seed0"
    shutil.copy2(theirs / "eval.csv", run / "eval.csv")
    other = weights_record(theirs)["sha256"][:16]
    said = report_refused(exp)
    assert f"{run}: its eval.csv holds rows scored by other weights ({other}) than its model.pt's ({own})" in said
    assert {r["run"]: r for r in run_status(exp)}["alibi-seed0"]["state"] == "damaged"
    assert invoke(*args, "--set", f"out_dir={exp.parent}").exit_code == 0  # reused, its rows scored again
    assert [r["weights"] for r in csv.DictReader(open(run / "eval.csv"))] == [own] * len(rows)
    assert [r["loss"] for r in csv.DictReader(open(run / "eval.csv"))] == [r["loss"] for r in rows]


def test_weights_trained_on_other_data_are_never_scored_as_the_runs_own(tmp_path):
    """model.pt names the data its weights were trained on, as data.json does: weights copied in
    from a run on another corpus are refused in one line against the run's data.json, and where
    the run lacks its data.json, model.pt's copy is restored, so the run is held to the data it
    really read, never pinned to whatever its config reads now."""
    from conftest import smoke_experiment

    (tmp_path / "a").mkdir()
    exp, _, text = smoke_experiment(tmp_path / "a", "--schemes", "alibi")
    theirs = exp / "alibi-seed0"
    ckpt = torch.load(theirs / "model.pt", weights_only=True)
    assert ckpt["read"] == yaml.safe_load((theirs / "data.json").read_text())  # one record, written twice
    other = tmp_path / "b" / "other.txt"
    other.parent.mkdir()
    other.write_text("all the world is a stage and all the men and women merely players\n" * 400)
    res = invoke(
        "extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={tmp_path / 'b'}",
        "--set", f"data.path={other}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    run = tmp_path / "b" / "smoke" / "alibi-seed0"
    pinned = yaml.safe_load((run / "data.json").read_text())
    shutil.copy2(theirs / "model.pt", run / "model.pt")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    res = invoke("evaluate", run, "--lengths", "32")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{run / 'data.json'} does not describe model.pt" in said
    assert f"trained on {text} (bytes) with sha256 {ckpt['read']['sha256'][:12]}" in said
    assert f"data.json names {other} (bytes) with sha256 {pinned['sha256'][:12]}" in said
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    (run / "data.json").unlink()  # nothing left to hold it against but model.pt's own record
    res = invoke("evaluate", run, "--lengths", "32")
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"read {text} (bytes) with sha256 {ckpt['read']['sha256'][:12]}" in said, said
    assert (run / "eval.csv").read_bytes() == before["eval.csv"]


# --- a full disk: one line naming the folder, nothing half-written, nothing on disk lost ---------


def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_full():
    """OSError ENOSPC as torch.save wraps it in a RuntimeError of its own when it writes to a file
    object ('[enforce fail at inline_container.cc]')."""
    try:
        _no_space()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def _full_save(obj, f, *args, **kwargs):
    """torch.save on a full disk, after half a file."""
    with open(f, "wb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as fh:
        fh.write(b"half a file")
        _disk_full()


def _temporaries(folder):
    return [p for p in folder.rglob("*") if p.name.startswith("tmp-")]


def test_a_full_disk_while_saving_weights_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    """A full disk while torch.save writes the weights ends in one line naming the run's .partial folder
    and saying to free space and rerun (torch's own `[enforce fail at inline_container.cc]` is not); no temporary,
    no half-written model.pt and no finished run folder is left."""
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    monkeypatch.setattr(torch, "save", _full_save)
    out = tmp_path / "r"
    res = invoke("extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={out}",
                 "--set", f"data.path={text}")  # fmt: skip
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    partial = out / "smoke" / ".alibi-seed0.partial"
    assert res.output.strip().splitlines()[-1] == (
        f"error: {partial}: the disk is full (No space left on device); free some space, then rerun the same command"
    )
    assert not _temporaries(out) and not (partial / "model.pt").exists()
    assert not (out / "smoke" / "alibi-seed0").exists()  # no run passes for a finished one


def test_a_full_disk_while_writing_records_keeps_the_records_on_disk(smoke, tmp_path, monkeypatch):
    import csv

    exp, _, _ = smoke
    run = tmp_path / "alibi-seed0"
    shutil.copytree(exp / "alibi-seed0", run)
    before = (run / "eval.csv").read_text()
    monkeypatch.setattr(csv.DictWriter, "writeheader", _no_space)
    res = invoke("evaluate", run, "--lengths", "40")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{run}: the disk is full" in " ".join(res.output.split())
    assert (run / "eval.csv").read_text() == before and not _temporaries(run)


def test_a_full_disk_while_checkpointing_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    from posbench.errors import PosbenchError
    from posbench.experiment.checkpoint import save_progress

    (tmp_path / "checkpoint.pt").write_bytes(b"the checkpoint before")
    monkeypatch.setattr(torch, "save", _full_save)
    with pytest.raises(PosbenchError, match=f"^{tmp_path}: the disk is full"):
        save_progress(tmp_path, {"model": {}})
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"the checkpoint before" and not _temporaries(tmp_path)


def test_a_full_disk_while_preparing_leaves_no_folder(tmp_path, monkeypatch):
    import numpy as np

    (tmp_path / "a.txt").write_text("to be or not to be that is the question\n" * 200)
    monkeypatch.setattr(np, "save", _no_space)  # byte_lengths.npy, after train.bin and val.bin
    res = invoke("prepare", tmp_path / "a.txt", "--out", tmp_path / "prepared")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{tmp_path / 'prepared'}: the disk is full" in " ".join(res.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # no partial folder, no lock


def test_a_record_that_is_a_folder_is_named_not_sent_to_a_command_that_cannot_fix_it(tmp_path):
    """config.yaml replaced by a folder: report said to finish the run with extrapolate, which
    cannot write the record there either."""
    from conftest import ROOT

    exp = tmp_path / "exp"
    shutil.copytree(ROOT / "results" / "reference" / "alibi-seed0", exp / "alibi-seed0")
    (exp / "alibi-seed0" / "config.yaml").unlink()
    (exp / "alibi-seed0" / "config.yaml").mkdir()
    res = invoke("report", exp, "--out", tmp_path / "view")
    record = exp / "alibi-seed0" / "config.yaml"
    said = f"{record}: not a file; restore the run's record, or move alibi-seed0 out of {exp}"
    assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    assert not (tmp_path / "view").exists()
