"""Experiment trackers: a run's records sent to TensorBoard, Weights & Biases, MLflow or Trackio.

`train.tracker` (`--tracker`) names one. The records on disk stay the source of truth: a tracker
gets a copy, for the dashboard a researcher already has open, and no report reads one back.
Each tracker is its library's own client behind `Tracker`, offline, writing into the
experiment folder beside the runs: tensorboard/ (event files), mlruns/ (an MLflow file store),
wandb/ (offline runs, which `wandb sync` uploads) or trackio/ (Trackio's local store).

A run is sent once its records are complete, trained and scored, by the process that drives
the experiment (never a worker process or a Ray task), as a tracker run named as its folder
and grouped by its experiment (and a sweep's grid point). What is sent: the resolved config,
the attention backend and the library versions; loss, learning rate and throughput by step
(train_log.jsonl); every result in eval.csv by length. The experiment's tables and plots go to
a tracker run of their own, named after the experiment, each time a command that trains or
scores writes its report. trackers.json in a run folder keeps the tracker run's id and what
was sent, so a run scored again (posbench evaluate) sends its new results to the same tracker
run, a run killed and resumed is sent once, when it completes, and a finished run is never
sent twice.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib.util
import io
import json
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Optional

from posbench.config import check_tracker_name
from posbench.errors import PosbenchError
from posbench.experiment.records import read_train_log

INSTALL = "pip install -e '.[trackers]'"
RECORD = "trackers.json"  # in a run folder: {tracker: {"id": ..., "train": sent?, "eval": {"eval/ppl@48": value sent}}}
IMAGES = ("summary.png", "positions.png", "training.png", "steps.png")  # the report's plots, where present


def check_tracker(name: Optional[str], where: str = "train.tracker") -> None:
    """An unknown tracker, or one whose library is not installed, is one line."""
    check_tracker_name(name, where)
    if name is not None and not tracker_installed(name):
        raise PosbenchError(f"{where}={name}: the {name} library is not installed; {INSTALL} (or pip install {name})")


def tracker_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None  # each library's module is named as its tracker


def usable(name: Optional[str]) -> Optional[str]:
    """A tracker a record names (a run's train.tracker), where its library is installed here."""
    return name if name is not None and tracker_installed(name) else None


class Tracker:
    """One tracker run. `key`: the id it had when sent before (None: a new run); `self.key` is
    the id to keep. `axis` names the x of a series: step (training) or length (evaluation)."""

    resends_whole = False  # True: a run sent again is written whole again (W&B offline)

    def __init__(self, store: Path, group: str, name: str, key: Optional[str], config: dict):
        raise NotImplementedError

    def scalars(self, axis: str, x: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def image(self, tag: str, path: Path) -> None:
        raise NotImplementedError

    def text(self, tag: str, text: str) -> None:
        raise NotImplementedError

    def sent(self) -> None:
        """Everything meant for this tracker run was handed over (before `close`)."""

    def close(self) -> None:
        pass


class TensorBoard(Tracker):
    """Event files in tensorboard/<run>: `tensorboard --logdir results/<experiment>/tensorboard`."""

    def __init__(self, store, group, name, key, config):
        from torch.utils.tensorboard import SummaryWriter

        self.key = name  # its folder is the run
        self.writer = SummaryWriter(log_dir=str(store / "tensorboard" / name))
        if key is None:
            self.text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()))  # indented: markdown code

    def scalars(self, axis, x, values):
        # TensorBoard's x is always "step": a series along another axis says so in its tag
        # (eval_by_length/ppl), where its chart's title shows it
        for tag, value in values.items():
            group, _, name = tag.partition("/")
            self.writer.add_scalar(tag if axis == "step" else f"{group}_by_{axis}/{name}", value, x)

    def image(self, tag, path):
        import matplotlib.image

        self.writer.add_image(tag, matplotlib.image.imread(path)[..., :3], dataformats="HWC")

    def text(self, tag, text):
        self.writer.add_text(tag, text)

    def close(self):
        self.writer.close()


class MLflow(Tracker):
    """An MLflow file store in mlruns/ (`mlflow ui --backend-store-uri results/<experiment>/mlruns`),
    one MLflow experiment per posbench experiment; the config is the run's params."""

    def __init__(self, store, group, name, key, config):
        # MLflow 3 refuses a file store unless asked; it is the store that needs no server or database
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline: nothing leaves the machine
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.store = store.resolve()
        self.client = MlflowClient(tracking_uri=(self.store / "mlruns").as_uri())
        try:
            if key is not None:
                self.client.get_run(key)
        except MlflowException:  # no such run here
            key = None
        if key is None:
            found = self.client.get_experiment_by_name(group)
            experiment = found.experiment_id if found else self.client.create_experiment(group)
            tags = {"posbench.experiment": group, "posbench.grid_point": str(config.get("grid_point", ""))}
            key = self.client.create_run(experiment, run_name=name, tags=tags).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in config.items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 params a batch
                self.client.log_batch(key, params=params[i : i + 100])
        self.key = key
        self.client.update_run(key, status="RUNNING")

    def scalars(self, axis, x, values):
        from mlflow.entities import Metric

        self.client.log_batch(self.key, metrics=[Metric(k, v, 0, x) for k, v in values.items()])

    def image(self, tag, path):
        self._artifacts().log_artifact(str(path))

    def text(self, tag, text):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / f"{tag}.md").write_text(text)
            self._artifacts().log_artifact(str(Path(tmp) / f"{tag}.md"))

    def _artifacts(self):
        """The run's artifact folder in this store, where the file store puts it. MLflow records
        it as an absolute path, which a store moved with its experiment folder would still name:
        written here, nothing lands outside the experiment folder."""
        from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

        run = self.client.get_run(self.key)
        return LocalArtifactRepository(str(self.store / "mlruns" / run.info.experiment_id / self.key / "artifacts"))

    def close(self):
        self.client.set_terminated(self.key)


class WandB(Tracker):
    """Offline runs in wandb/ (`wandb sync results/<experiment>/wandb/offline-run-*`), project and
    group the experiment. Offline, W&B does not resume: a run sent again is a new offline run of
    the same id, and syncing it replaces the earlier one, so it is sent whole again."""

    resends_whole = True

    def __init__(self, store, group, name, key, config):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.key = key or hashlib.sha256(f"{store.resolve()}/{name}".encode()).hexdigest()[:16]
        # a busy machine starts W&B's service slowly: wait for it rather than drop the copy
        wait = {"init_timeout": 600.0, "x_service_wait": 600.0}
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, **wait)
        self.run = wandb.init(
            project=group,
            group=group,
            job_type=config.get("grid_point") or None,  # a sweep's runs, grouped by grid point too
            name=name,
            id=self.key,
            resume="allow",
            mode="offline",
            dir=str(store),
            config=config,
            settings=settings,
            reinit="finish_previous",
        )
        self.folder = Path(self.run.settings.sync_dir)
        self.axes: set = set()

    def scalars(self, axis, x, values):
        if axis == "step":
            self.run.log(values, step=x)
            return
        prefix = next(iter(values)).split("/")[0]  # eval/... : its own x, as W&B's steps only rise
        if prefix not in self.axes:
            self.run.define_metric(f"{prefix}/{axis}")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/{axis}")
            self.axes.add(prefix)
        self.run.log({**values, f"{prefix}/{axis}": x})

    def image(self, tag, path):
        import wandb

        self.run.log({tag: wandb.Image(str(path))})

    def text(self, tag, text):
        self.run.summary[tag] = text

    def sent(self):
        self.whole = True

    def close(self):
        import wandb

        self.run.finish()
        # W&B's service writes the offline run file after finish returns: wait for it, so the
        # file is whole when posbench moves on (a report, a test, a sync read it)
        wandb.teardown()
        if getattr(self, "whole", False):
            self._drop_older()

    def _drop_older(self):
        """`wandb sync` of an id's offline runs keeps the last synced: a run is sent whole each
        time, so once it is, the older offline runs of its id (and any a failed send left) go:
        one folder per run, whatever order a shell syncs them in."""
        import shutil

        pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(self.key)}(-\d+)?")
        for folder in self.folder.parent.iterdir():
            if folder != self.folder and folder.is_dir() and pattern.fullmatch(folder.name):
                shutil.rmtree(folder, ignore_errors=True)


class Trackio(Tracker):
    """Trackio's local store in trackio/ (`TRACKIO_DIR=results/<experiment>/trackio trackio show`),
    project the experiment."""

    def __init__(self, store, group, name, key, config):
        import trackio

        _trackio_at(store / "trackio")
        with contextlib.redirect_stdout(io.StringIO()):  # it prints where to view the dashboard
            self.run = trackio.init(project=group, name=name, group=group, config=config, resume="allow")
        self.key = name

    def scalars(self, axis, x, values):
        import trackio

        trackio.log(values, step=x)

    def image(self, tag, path):
        import trackio

        trackio.log({tag: trackio.Image(str(path))})

    def text(self, tag, text):
        import trackio

        trackio.log({tag: trackio.Markdown(text)})

    def close(self):
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()


def _trackio_at(folder: Path) -> None:
    """Trackio reads its store's folder (TRACKIO_DIR) once, into module constants: set both."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRACKIO_DIR"] = str(folder)
    for module in [m for n, m in sys.modules.items() if n == "trackio" or n.startswith("trackio.")]:
        if hasattr(module, "TRACKIO_DIR"):
            module.TRACKIO_DIR = folder
        if hasattr(module, "MEDIA_DIR"):
            module.MEDIA_DIR = folder / "media"


CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}


# --- what is sent ---------------------------------------------------------------------------------


def send_run(tracker: Optional[str], exp_dir: Path, rdir: Path) -> None:
    """Send what `rdir`'s records hold and its tracker run lacks: the config and training log
    once, and each evaluation result not sent before (posbench evaluate adds lengths)."""
    if tracker is None or not (rdir / "eval.csv").is_file():
        return
    import yaml

    from posbench.config import config_from_dict
    from posbench.measures import measure_for
    from posbench.schemes import run_label

    exp_dir, rdir = exp_dir.resolve(), rdir.resolve()  # `posbench evaluate .` names them by path
    sent = _read_record(rdir).get(tracker, {})
    config = yaml.safe_load((rdir / "config.yaml").read_text())
    cfg = config_from_dict(config)
    columns = {m.column: m.name for m in measure_for(cfg).metrics.values() if m.column}  # each sent by its name
    points = _eval_points((rdir / "eval.csv").read_text(), run_label(cfg.model), columns) | _measure_points(rdir)
    before = sent.get("eval") if isinstance(sent.get("eval"), dict) else {}
    fresh = {k: v for k, v in points.items() if before.get(k) != v}
    if sent.get("train") and not fresh:
        return
    cls = CLASSES[tracker]
    log = read_train_log(rdir)
    flat = _flat_config(config, log)
    point = grid_point(rdir.name, config["model"]["scheme"], config["seeds"][0])
    if point:
        flat["grid_point"] = point
    with _kept_going(tracker, rdir.name):
        run = cls(exp_dir, exp_dir.name, rdir.name, sent.get("id"), flat)
        # sent whole again: to W&B, whose offline runs do not resume, and to a new tracker run
        whole = sent.get("id") is not None and (cls.resends_whole or run.key != sent["id"])
        now = {"id": run.key, "train": bool(sent.get("train")) and not whole, "eval": before}

        def remember(**done):  # after each part, so a failure later never makes a second run
            now.update(done)
            _write_record(rdir, {**_read_record(rdir), tracker: now})

        try:
            remember()
            if not sent.get("train") or whole:
                _send_training(run, config, log)
                remember(train=True)
            by_length: dict[int, dict] = {}
            for key, value in (points if whole else fresh).items():
                name, length = key.rsplit("@", 1)
                by_length.setdefault(int(length), {})[name] = value
            for length in sorted(by_length):
                run.scalars("length", length, by_length[length])
            remember(eval=points)
            run.sent()
        finally:
            run.close()


@contextlib.contextmanager
def _kept_going(tracker: str, what: str):
    """A tracker that fails (its library's error, a full disk) costs its copy, never the run:
    one line, and the next command sends what was not sent."""
    try:
        yield
    except Exception as e:  # any library error: the records are already on disk
        from posbench import progress
        from posbench.errors import first_line

        progress.say(
            f"{tracker}: {what} was not sent ({type(e).__name__}: {first_line(e)}); its records are "
            f"kept, and the next posbench command on it sends it"
        )


def send_report(tracker: Optional[str], exp_dir: Path) -> None:
    """The experiment's tables (summary.md and .csv) and plots, to a tracker run named after it."""
    if tracker is None or not (exp_dir / "summary.md").is_file():
        return
    exp_dir = exp_dir.resolve()
    sent = _read_record(exp_dir).get(tracker, {})
    with _kept_going(tracker, f"the report of {exp_dir.name}"):
        run = CLASSES[tracker](exp_dir, exp_dir.name, exp_dir.name, sent.get("id"), {"experiment": exp_dir.name})
        try:
            run.text("summary", (exp_dir / "summary.md").read_text())
            if (exp_dir / "summary.csv").is_file():
                run.text("summary_csv", (exp_dir / "summary.csv").read_text())
            for name in IMAGES:
                if (exp_dir / name).is_file():
                    run.image(name.removesuffix(".png"), exp_dir / name)
            run.sent()
        finally:
            run.close()
        _write_record(exp_dir, {**_read_record(exp_dir), tracker: {"id": run.key}})


def _send_training(run: Tracker, config: dict, log: list[dict]) -> None:
    """Loss, lr and throughput by step, in the unit the run's task names (tokens/s for the
    corpus, instances/s for a synthetic task, whose batches are padded to their longest)."""
    from posbench.config import config_from_dict
    from posbench.tasks import task_for

    cfg = config_from_dict(config)
    per_step, unit = task_for(cfg).throughput(cfg)
    before = None
    for row in log:
        values = {"train/loss": row["loss"], "train/lr": row.get("lr", math.nan)}
        if before is not None and row.get("seconds", 0) > before.get("seconds", math.inf):
            values[f"train/{unit}"] = per_step * (row["step"] - before["step"]) / (row["seconds"] - before["seconds"])
        run.scalars("step", row["step"], {k: v for k, v in values.items() if math.isfinite(v)})
        before = row


def _eval_points(evals: str, label: str, columns: dict[str, str]) -> dict[str, float]:
    """{"eval/ppl@48": value, ...}: each metric (`columns`: eval.csv's column -> the metric's
    name) of each eval.csv row at its length. A row of an
    evaluation-time variant (rope+yarn), another protocol or stride names it after a dot,
    eval/ppl.rope_yarn.sliding_s32: no name is a folder of another (MLflow's file store keeps a
    metric as a file), and each is a name every tracker takes."""
    points = {}
    for r in csv.DictReader(io.StringIO(evals)):
        if r.get("status", "ok") != "ok":
            continue
        parts = [r["scheme"]] if r["scheme"] != label else []
        if r.get("protocol", "") not in ("", "nonoverlapping"):
            parts.append(r["protocol"] + (f"_s{r['stride']}" if r.get("stride") else ""))
        suffix = "".join("." + re.sub(r"[^A-Za-z0-9_-]", "_", part) for part in parts)
        for column, name in columns.items():
            value = float(r[column]) if r.get(column) not in (None, "") else math.nan
            if math.isfinite(value):
                points[f"eval/{name}{suffix}@{r['length']}"] = value
    return points


def _measure_points(rdir: Path) -> dict[str, float]:
    """{"eval/next_byte_accuracy@48": value, ...}: what users' measures scored (RUN/measures/),
    each metric by its name, and by the value of a measure's second axis where it has one
    ("eval/retrieval_accuracy.depth25@48")."""
    from posbench.measures.plugin import read_measures

    points = {}
    for rec in read_measures(rdir).values():
        for r in rec.rows:
            at = f".{rec.axis}{float(r[rec.axis]):g}" if rec.axis else ""
            for name in rec.metrics:
                value = float(r[name]) if r["status"] == "ok" and r[name] != "" else math.nan
                if math.isfinite(value):
                    points[f"eval/{name}{at}@{r['length']}"] = value
    return points


def grid_point(folder: str, scheme: str, seed: int) -> str:
    """A sweep run's grid point, from its folder's name: 'alibi-seed0-taskcopy-8e8e6430' ->
    'taskcopy'; '' for a run of a plain experiment ('alibi-seed0')."""
    from posbench.experiment.records import run_name

    middle = folder.removeprefix(run_name(scheme, seed))
    return middle.strip("-").rsplit("-", 1)[0] if middle.count("-") >= 2 else ""


def _flat_config(config: dict, log: list[dict]) -> dict:
    """The run's config as dotted keys, with how it was computed: backend and versions."""
    import torch

    from posbench import __version__

    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else value

    walk("", config)
    attention = next((row["attention"] for row in log if "attention" in row), None)
    return {
        **out,
        "attention": attention,
        "posbench": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _read_record(rdir: Path) -> dict:
    path = rdir / RECORD
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}  # a record cut short is sent again, as if never sent


def _write_record(rdir: Path, record: dict) -> None:
    from posbench.files import write_atomic

    write_atomic(rdir / RECORD, json.dumps(record, indent=1) + "\n")
