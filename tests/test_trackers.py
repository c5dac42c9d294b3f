"""Trackers: what a run sends is read back with each library's own reader and equals its records.

Each test runs configs/smoke.yaml with --tracker, then reads the tracker's files (TensorBoard's
event reader, MlflowClient on the file store, the W&B offline run file's records, Trackio's
local store) and compares a training loss at a step and a perplexity at a length with
train_log.jsonl and eval.csv.
"""

import csv
import glob
import json
import os
import re
import struct
from pathlib import Path

import pytest
from conftest import ROOT, invoke, smoke_experiment

from posbench.trackers import RECORD

TRACKERS = ["tensorboard", "mlflow", "wandb", "trackio"]
SCHEMES = ("--schemes", "nope,alibi")


def _runs_and_series(tracker: str, exp: Path) -> dict[str, dict[str, dict[float, float]]]:
    """{tracker run name: {tag: {x: value}}}, read with the tracker's own reader. x is the step
    for train/*, the length for eval/*."""
    return {"tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb, "trackio": _trackio}[tracker](exp)


def _tensorboard(exp, raw: bool = False):
    """TensorBoard's x is always a step, so its evaluation series say they are by length
    (eval_by_length/ppl); read back under the other trackers' names (eval/ppl) unless `raw`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for folder in sorted((exp / "tensorboard").iterdir()):
        events = EventAccumulator(str(folder))
        events.Reload()
        out[folder.name] = {
            (tag if raw else tag.replace("eval_by_length/", "eval/", 1)): {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]
        }
        out[folder.name]["images"] = {tag: 1 for tag in events.Tags()["images"]}
    return out


def _mlflow(exp):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(exp / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(exp.name)
    out = {}
    for run in client.search_runs([experiment.experiment_id]):
        name = run.info.run_name
        assert name not in out, f"two MLflow runs named {name}"
        series = {}
        for tag in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, tag)
            series[tag] = {m.step: m.value for m in history}
            assert len(series[tag]) == len(history), f"{name}: {tag} sent twice at some step"
        series["params"] = run.data.params
        series["artifacts"] = {a.path: 1 for a in client.list_artifacts(run.info.run_id)}
        out[name] = series
    return out


def _wandb_records(path: str):
    """The records of a .wandb file: W&B's LevelDB-style log (a 7-byte header, 32 KiB blocks of
    chunks, each a crc, a length and a type: full, first, middle, last), each record one of
    W&B's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # a block's zero-filled tail
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def _started(path: str) -> tuple[str, int]:
    """When an offline run started, from its folder's name: W&B names a second run of an id
    started in the same second `offline-run-<time>-ID-1`, which sorts before `...-ID/` by name."""
    m = re.search(r"offline-run-(\d{8}_\d{6})-[0-9a-f]+(?:-(\d+))?/", path)
    return m[1], int(m[2] or 0)


def _wandb(exp):
    out, ids = {}, {}
    for path in sorted(glob.glob(str(exp / "wandb" / "offline-run-*" / "run-*.wandb")), key=_started):
        name, series = None, {}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                name = record.run.display_name
                ids.setdefault(name, set()).add(record.run.run_id)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                for tag, value in row.items():
                    if isinstance(value, (int, float)) and not tag.startswith("_") and not tag.endswith("/length"):
                        x = row["eval/length"] if tag.startswith("eval/") else row["_step"]
                        series.setdefault(tag, {})[x] = value
        out.setdefault(name, {}).update(series)
    for name, run_ids in ids.items():
        assert len(run_ids) == 1, f"{name} was sent as {len(run_ids)} W&B runs"
    return out


def _trackio(exp):
    from trackio.sqlite_storage import SQLiteStorage

    from posbench.trackers import _trackio_at

    _trackio_at(exp / "trackio")
    out = {}
    for name in SQLiteStorage.get_runs(exp.name):
        series = {}
        for row in SQLiteStorage.get_logs(exp.name, name):
            for tag, value in row.items():
                if isinstance(value, (int, float)) and tag != "step":
                    series.setdefault(tag, {})[row["step"]] = value
        out[name] = series
    return out


def _records(run: Path) -> tuple[dict, dict]:
    """(loss by step from train_log.jsonl, perplexity by length from eval.csv)."""
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    with open(run / "eval.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["protocol"] == "nonoverlapping"]
    return {r["step"]: r["loss"] for r in log}, {int(r["length"]): float(r["ppl"]) for r in rows}


@pytest.mark.plots
@pytest.mark.parametrize("tracker", TRACKERS)
def test_a_tracker_holds_the_loss_and_perplexity_of_the_records(tmp_path, tracker):
    exp, res, _ = smoke_experiment(tmp_path, *SCHEMES, "--tracker", tracker)
    sent = _runs_and_series(tracker, exp)
    assert {"nope-seed0", "alibi-seed0", "smoke"} <= set(sent), sorted(sent)  # runs named as their folders
    for name in ("nope-seed0", "alibi-seed0"):
        loss, ppl = _records(exp / name)
        assert loss[10] != loss[20] and ppl[32] != ppl[64]  # different values, so a mix-up shows
        got = sent[name]
        assert got["train/loss"][10] == pytest.approx(loss[10], rel=1e-6)  # TensorBoard keeps float32
        assert got["train/loss"][20] == pytest.approx(loss[20], rel=1e-6)
        assert got["eval/ppl"][48] == pytest.approx(ppl[48], rel=1e-6)
        assert sorted(got["eval/ppl"]) == sorted(ppl) and len(got["train/loss"]) == len(loss)
        assert "train/lr" in got and "train/tokens_per_s" in got
        assert json.loads((exp / name / RECORD).read_text())[tracker]["train"] is True
    if tracker == "tensorboard":  # the experiment's plots, as images, in a run named after it
        assert {"summary", "training", "positions"} <= set(sent["smoke"]["images"])
        # a series whose step is the length says so in its name, which titles its chart
        tags = set(_tensorboard(exp, raw=True)["nope-seed0"]) - {"images"}
        assert {t.split("/")[0] for t in tags} == {"train", "eval_by_length"}, tags
        _, ppl = _records(exp / "nope-seed0")
        assert _tensorboard(exp, raw=True)["nope-seed0"]["eval_by_length/ppl"] == pytest.approx(ppl, rel=1e-6)
    if tracker == "mlflow":
        assert {"summary.png", "positions.png", "summary.md"} <= set(sent["smoke"]["artifacts"])
        params = sent["nope-seed0"]["params"]
        assert params["model.n_layer"] == "1" and params["attention"] and params["torch"]


def test_a_run_killed_and_resumed_is_one_tracker_run_and_evaluate_adds_to_it(tmp_path):
    """Nothing is sent while a run is unfinished; the resumed run is sent once, and a later
    posbench evaluate sends its new lengths to the same MLflow run."""
    from test_sweeps import _args, _text, kill_after_two_checkpoints

    text = _text(tmp_path)
    more = ("--set", "train.steps=400", "--set", "train.checkpoint_every=25", "--tracker", "mlflow")
    exp = tmp_path / "r" / "smoke"
    kill_after_two_checkpoints(_args(tmp_path / "r", text, *more), exp / ".alibi-seed0.partial")
    assert not (exp / "mlruns").exists() or "alibi-seed0" not in _mlflow(exp)
    res = invoke(*_args(tmp_path / "r", text, *more))  # the same command, in this process
    assert res.exit_code == 0, res.output
    assert "resuming from its checkpoint" in " ".join(res.output.split())
    loss, ppl = _records(exp / "alibi-seed0")
    sent = _mlflow(exp)["alibi-seed0"]  # one run of that name (_mlflow asserts it)
    assert sent["train/loss"] == pytest.approx(loss) and sent["eval/ppl"] == pytest.approx(ppl)
    res = invoke("evaluate", exp / "alibi-seed0", "--lengths", "80")
    assert res.exit_code == 0, res.output
    _, ppl = _records(exp / "alibi-seed0")
    sent = _mlflow(exp)["alibi-seed0"]
    assert 80 in ppl and sent["eval/ppl"] == pytest.approx(ppl)


def test_a_rerun_and_a_second_report_send_nothing_twice(tmp_path):
    exp, _, text = smoke_experiment(tmp_path, *SCHEMES, "--tracker", "wandb")
    first = sorted(glob.glob(str(exp / "wandb" / "offline-run-*")))
    res = invoke(
        "extrapolate", "--config", ROOT / "configs" / "smoke.yaml", *SCHEMES, "--tracker", "wandb",
        "--set", f"out_dir={tmp_path / 'results'}", "--set", f"data.path={text}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    again = sorted(glob.glob(str(exp / "wandb" / "offline-run-*")))
    assert len(again) == len(first)  # the report's run, sent again with the report, replaces its older self
    assert set(again) != set(first) and len(set(again) - set(first)) == 1
    _wandb(exp)  # each name is one W&B run id


def test_runs_trained_in_workers_are_sent_by_the_driver(worker_smoke):
    exp, _, _ = worker_smoke  # trained by two workers with --tracker tensorboard
    sent = _tensorboard(exp)
    for name in ("nope-seed0", "alibi-seed0"):
        loss, _ = _records(exp / name)
        assert sent[name]["train/loss"][10] == pytest.approx(loss[10], rel=1e-6)


def test_an_unknown_tracker_is_one_line_with_a_suggestion(tmp_path):
    res = invoke("extrapolate", "--tracker", "wandbb", "--set", f"out_dir={tmp_path}")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "train.tracker='wandbb': unknown tracker (did you mean 'wandb'?)" in " ".join(res.output.split())
    assert not any(tmp_path.iterdir())


def test_a_tracker_whose_library_is_missing_is_one_line_naming_the_install(tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    res = invoke(
        "extrapolate", "--config", ROOT / "configs" / "smoke.yaml", "--tracker", "wandb",
        "--set", f"out_dir={tmp_path / 'r'}",
    )  # fmt: skip
    assert res.exit_code == 2 and "Traceback" not in res.output
    said = " ".join(res.output.split())
    assert "train.tracker=wandb: the wandb library is not installed; pip install -e '.[trackers]'" in said
    assert not (tmp_path / "r" / "smoke").exists()


def test_a_task_run_sends_its_accuracy_by_length(tmp_path):
    from conftest import QUICK_TASK

    res = invoke("extrapolate", "--task", "copy", "--schemes", "nope", "--tracker", "tensorboard",
                 "--set", f"out_dir={tmp_path}", *QUICK_TASK)  # fmt: skip
    assert res.exit_code == 0, res.output
    exp = tmp_path / "copy"
    with open(exp / "nope-seed0" / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    sent = _tensorboard(exp)["nope-seed0"]
    assert sent["eval/exact_match"] == pytest.approx({int(r["length"]): float(r["accuracy"]) for r in rows})
    assert sent["eval/token_accuracy"] == pytest.approx({int(r["length"]): float(r["token_accuracy"]) for r in rows})
    assert "train/instances_per_s" in sent


def test_a_tracker_that_fails_costs_its_copy_not_the_run(tmp_path, monkeypatch):
    """The library's error is one note; the records are written, and the next command sends the run."""
    from posbench import trackers

    def broken(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(trackers.TensorBoard, "__init__", broken)
    exp, res, text = smoke_experiment(tmp_path, "--schemes", "nope", "--tracker", "tensorboard")
    said = " ".join(res.output.split())
    assert "note: tensorboard: nope-seed0 was not sent (OSError: No space left on device)" in said
    assert (exp / "nope-seed0" / "eval.csv").is_file() and not (exp / "nope-seed0" / RECORD).exists()
    monkeypatch.undo()
    res = invoke(
        "extrapolate", "--config", ROOT / "configs" / "smoke.yaml", "--schemes", "nope", "--tracker", "tensorboard",
        "--set", f"out_dir={tmp_path / 'results'}", "--set", f"data.path={text}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    loss, _ = _records(exp / "nope-seed0")
    assert _tensorboard(exp)["nope-seed0"]["train/loss"][10] == pytest.approx(loss[10], rel=1e-6)


def test_evaluate_sends_to_the_runs_tracker_where_its_library_is_installed(tmp_path, monkeypatch):
    """A run trained with a tracker, scored again where that library is missing (a laptop), is
    scored without sending; where it is installed, the new lengths go to the same tracker run."""
    import importlib.util

    exp, _, _ = smoke_experiment(tmp_path, "--schemes", "nope", "--tracker", "tensorboard")
    run = exp / "nope-seed0"
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else find(n, *a))
    res = invoke("evaluate", run, "--lengths", "80")
    assert res.exit_code == 0, res.output
    res = invoke("evaluate", run, "--lengths", "96", "--tracker", "tensorboard")  # asked outright: one line
    assert res.exit_code == 2 and "the tensorboard library is not installed" in " ".join(res.output.split())
    monkeypatch.undo()
    assert 80 not in _tensorboard(exp)["nope-seed0"]["eval/ppl"]
    monkeypatch.chdir(run)
    res = invoke("evaluate", ".", "--lengths", "96")  # the run named by a relative path
    assert res.exit_code == 0, res.output
    assert not (run / "tensorboard").exists()
    _, ppl = _records(run)
    assert {80, 96} <= set(ppl) and _tensorboard(exp)["nope-seed0"]["eval/ppl"] == pytest.approx(ppl, rel=1e-6)


def test_a_sweeps_runs_are_grouped_by_experiment_and_grid_point(tmp_path):
    from test_sweeps import _sweep

    res = invoke("sweep", _sweep(tmp_path), "--tracker", "mlflow")
    assert res.exit_code == 0, res.output
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    exp = tmp_path / "r" / "grid"
    client = MlflowClient(tracking_uri=(exp / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("grid").experiment_id])
    points = {r.info.run_name: r.data.tags.get("posbench.grid_point") for r in runs}
    folders = sorted(p.parent.name for p in exp.glob("*/config.yaml"))
    assert {points[f] for f in folders} == {"train_len16", "train_len24"}
    assert points["grid"] == ""  # the experiment's own run: its tables and plots


def test_variants_protocols_and_lengths_added_later_are_each_sent_once(tmp_path):
    """rope scored plain, as rope+yarn and under sliding windows: each series under a name of its
    own, every value as in eval.csv; evaluate's new length is sent once, the rest not again."""
    exp, _, _ = smoke_experiment(
        tmp_path,
        "--schemes",
        "rope",
        "--tracker",
        "mlflow",
        "--rope-scaling",
        "yarn",
        "--protocol",
        "nonoverlapping,sliding",
    )
    run = exp / "rope-seed0"

    def expected():
        with open(run / "eval.csv") as f:
            rows = list(csv.DictReader(f))
        out = {}
        for r in rows:
            name = "eval/ppl" + (".rope_yarn" if r["scheme"] == "rope+yarn" else "")
            name += f".sliding_s{r['stride']}" if r["protocol"] == "sliding" else ""
            out.setdefault(name, {})[int(r["length"])] = float(r["ppl"])
        return out

    want = expected()
    assert len(want) == 4, sorted(want)  # plain and yarn, each under both protocols
    sent = _mlflow(exp)["rope-seed0"]
    assert {k: v for k, v in sent.items() if k.startswith("eval/ppl")} == want
    assert invoke("evaluate", run, "--lengths", "80").exit_code == 0
    sent = _mlflow(exp)["rope-seed0"]  # _mlflow fails on a value sent twice at one length
    assert {k: v for k, v in sent.items() if k.startswith("eval/ppl")} == expected() and 80 in sent["eval/ppl"]


def test_a_wandb_run_sent_again_is_one_offline_run_holding_it_whole(tmp_path):
    """W&B does not resume offline: syncing an id's offline runs keeps the last synced, so a run
    sent again (evaluate) is sent whole, training curve and every length, and its older offline
    runs go: one folder per run, whatever order `wandb sync offline-run-*` takes them in."""
    exp, _, _ = smoke_experiment(tmp_path, "--schemes", "nope", "--tracker", "wandb")
    run = exp / "nope-seed0"
    key = json.loads((run / RECORD).read_text())["wandb"]["id"]
    first = glob.glob(str(exp / "wandb" / f"offline-run-*-{key}*"))
    res = invoke("evaluate", run, "--lengths", "80")
    assert res.exit_code == 0 and "was not sent" not in res.output, res.output
    mine = glob.glob(str(exp / "wandb" / f"offline-run-*-{key}*"))
    assert len(first) == 1 and len(mine) == 1 and mine != first
    series = {}
    for record in _wandb_records(str(Path(mine[0]) / f"run-{key}.wandb")):
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for tag, value in row.items():
                if tag in ("train/loss", "eval/ppl"):
                    series.setdefault(tag, {})[row["eval/length"] if tag == "eval/ppl" else row["_step"]] = value
    loss, ppl = _records(run)
    assert series.get("train/loss") == pytest.approx(loss) and series.get("eval/ppl") == pytest.approx(ppl)
    assert 80 in ppl


def test_an_extended_run_sends_its_own_rows_as_its_own_series(tmp_path):
    """A child of posbench extend labels its rows rope:yarn; those are its own results (eval/ppl),
    while its evaluation-time variants get a name of their own."""
    exp, _, _ = smoke_experiment(tmp_path, "--schemes", "rope")
    out = tmp_path / "ext"
    res = invoke("extend", exp, "--to", "64", "--steps", "4", "--methods", "yarn", "--out", out, "--tracker", "mlflow")
    assert res.exit_code == 0, res.output
    sent = _mlflow(out)["rope-seed0-yarn"]
    with open(out / "rope-seed0-yarn" / "eval.csv") as f:
        own = {int(r["length"]): float(r["ppl"]) for r in csv.DictReader(f) if r["scheme"] == "rope:yarn"}
    assert own and sent["eval/ppl"] == own
    assert not any(".rope_yarn" in tag for tag in sent if tag.startswith("eval/ppl") and tag != "eval/ppl")


@pytest.mark.plots
def test_an_mlflow_store_moved_with_its_folder_writes_nothing_outside_it(tmp_path):
    """MLflow keeps a run's artifact path absolute; a moved experiment must not write into the old one."""
    import shutil

    (tmp_path / "a").mkdir()
    exp, _, _ = smoke_experiment(tmp_path / "a", "--schemes", "nope", "--tracker", "mlflow")
    moved = tmp_path / "b" / "smoke"
    shutil.copytree(exp, moved)
    shutil.rmtree(exp)  # the old store is gone: a write there would recreate it
    res = invoke("evaluate", moved / "nope-seed0", "--lengths", "80")
    assert res.exit_code == 0, res.output
    assert not exp.exists()
    _, ppl = _records(moved / "nope-seed0")
    assert _mlflow(moved)["nope-seed0"]["eval/ppl"] == pytest.approx(ppl) and 80 in ppl
    res = invoke(
        "extrapolate", "--config", ROOT / "configs" / "smoke.yaml", "--schemes", "nope", "--tracker", "mlflow",
        "--set", f"out_dir={tmp_path / 'b'}", "--set", f"data.path={tmp_path / 'a' / 'tiny.txt'}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert not exp.exists()  # the report's plots went to the moved store, not the old path
    assert len(list((moved / "mlruns").glob("*/*/artifacts/summary.png"))) == 1
