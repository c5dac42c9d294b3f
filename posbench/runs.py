"""Run folders: checkpoints, records, planning and resume, and the experiment that runs them all.

A run folder holds config.yaml (fully resolved), model.pt (weights plus that same config),
train_log.jsonl (step, loss, lr, seconds, attention backend) and eval.csv (its evaluation rows,
each naming the backend that scored it); a run whose loss blew up holds diverged.json instead of
model.pt. Folders are built under a hidden name, beside their mid-run checkpoints, and renamed
when whole, so an interrupted run leaves nothing that could pass for a finished one and a rerun
resumes it. A lock file per run (.<run>.lock) keeps two processes from training one run.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import torch

from posbench.accuracy import evaluate_task_into, read_task_eval
from posbench.attention import FLEX_CANNOT_TRAIN_ON_CPU, backend_for
from posbench.config import (
    ExperimentConfig,
    ModelConfig,
    check_device,
    check_trainable,
    config_from_dict,
    dump_yaml,
    read_record,
    read_yaml,
)
from posbench.data import Corpus, load_corpus
from posbench.errors import PosbenchError
from posbench.evaluate import eval_tokens, evaluate_model, windows
from posbench.files import TMP_PREFIX, atomic, exclusive, lock_holder, write_atomic, write_rows
from posbench.model import TransformerLM
from posbench.schemes import SCHEMES, build_scheme, resolve_scheme, variant_label
from posbench.tasks import LM, build_task
from posbench.train import CHECKPOINT, PREVIOUS, Diverged, Reporter, load_progress, pick_device, train_model
from posbench.workers import run_in_workers, worker_plan

EVAL_COLUMNS = [
    "scheme",
    "seed",
    "train_len",
    "length",
    "protocol",
    "stride",
    "loss",
    "ppl",
    "tokens",
    "status",
    "attention",
]
POSITION_COLUMNS = ["scheme", "length", "protocol", "stride", "position", "loss", "tokens"]
STATUSES = ("ok", "beyond-max-len", "non-finite")  # scored; cannot encode the length; blew up
UNRECORDED = "unrecorded"  # the backend of rows written before eval.csv named it
FILLED = {"protocol": "nonoverlapping", "stride": "", "attention": UNRECORDED}  # what an older eval.csv lacks


def check_experiment(cfg: ExperimentConfig) -> None:
    """What config.py cannot check alone: every scheme builds with its options (so bad options
    fail before anything trains), and every eval.rope_scaling kind belongs to some scheme. Each
    run's scheme options are filled in with the scheme's defaults, so that its record names
    every choice its weights were made under; so are a task's options, its training budget
    and the model's train_len, the task's longest training instance."""
    if cfg.task != LM:
        check_task(cfg)
    for s in cfg.schemes:
        build_scheme(cfg.model_for(s))
        cfg.scheme_options[s] = {**resolve_scheme(s).options, **cfg.scheme_options.get(s, {})}
    for s, opts in cfg.scheme_options.items():  # options of unselected schemes are kept, checked
        if s not in cfg.schemes:
            resolve_scheme(s).validate_options(opts, where=f"scheme_options.{s}")
    known = {v for c in [*SCHEMES.values(), *map(resolve_scheme, cfg.schemes)] for v in c.eval_variants}
    for kind in cfg.eval.rope_scaling:
        if kind not in known:
            close = difflib.get_close_matches(kind, sorted(known), n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise PosbenchError(f"eval.rope_scaling: unknown kind '{kind}'{hint}; valid: {', '.join(sorted(known))}")


def check_task(cfg: ExperimentConfig) -> None:
    task = build_task(cfg.task, cfg.task_options)
    cfg.task_options = {**type(task).options, **cfg.task_options, "test_max": task.test_max}
    if cfg.name == "default":  # lm's; a task's runs go to results/<task> unless named
        cfg.name = safe_name(cfg.task)
    if cfg.model.train_len not in (ModelConfig.train_len, task.train_len):
        raise PosbenchError(
            f"model.train_len={cfg.model.train_len}: a task derives it (task {cfg.task}: "
            f"{task.train_len}, its longest training instance); set task_options.train_max instead"
        )
    cfg.model.train_len = task.train_len
    cfg.eval.lengths = [task.train_len]  # perplexity lengths: a task is scored at its own lengths
    cfg.train.steps = cfg.train.steps or task.budget["steps"]
    cfg.train.batch_size = cfg.train.batch_size or task.budget["batch_size"]
    unused = [
        name
        for name, on in (
            ("eval.rope_scaling", cfg.eval.rope_scaling),
            ("eval.protocol sliding", "sliding" in cfg.eval.protocol),
        )
        if on
    ]
    if unused:
        raise PosbenchError(f"{unused[0]} applies to perplexity (task lm), not to task {cfg.task}")


def safe_name(text: str) -> str:
    """A folder name from anything, e.g. a plugin's module:Class."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def run_name(scheme: str, seed: int) -> str:
    return f"{safe_name(scheme)}-seed{seed}"


def partial_dir(rdir: Path) -> Path:
    """The hidden folder a run is built in before it is renamed to `rdir`."""
    return rdir.with_name("." + rdir.name + ".partial")


def lock_file(rdir: Path) -> Path:
    """The run's lock: whoever holds it alone may write `rdir` and its partial folder."""
    return rdir.with_name("." + rdir.name + ".lock")


DIVERGED, FAILED = "diverged.json", "failed.txt"  # a diverged run's record; a failed partial's error
SWEEP_RECORD = "sweep.yaml"  # the grid a sweep's experiment folder was made by; its runs may differ


def save_checkpoint(path: Path, model: TransformerLM, cfg: ExperimentConfig) -> None:
    with atomic(path) as tmp:
        torch.save({"config": cfg.to_dict(), "model": model.state_dict()}, tmp)


def load_run(run_dir: Path) -> tuple[ExperimentConfig, TransformerLM]:
    """A checkpoint carries its own config: nothing else is needed to rebuild the model."""
    ckpt_path = Path(run_dir) / "model.pt"
    if not Path(run_dir).is_dir():
        raise PosbenchError(f"{run_dir}: no such run directory")
    if not ckpt_path.is_file():
        raise PosbenchError(f"{run_dir}: holds no checkpoint (model.pt); train it first")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        cfg = config_from_dict(ckpt["config"], source=str(ckpt_path))
        model = TransformerLM(cfg.model)
    except PosbenchError:
        raise
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise PosbenchError(f"{ckpt_path}: corrupt or not a posbench checkpoint ({reason})") from None
    unrecorded = sorted(set(type(model.scheme).options) - set(cfg.model.options))
    if unrecorded:  # its weights were made under defaults that this posbench may not share
        raise PosbenchError(
            f"{ckpt_path}: does not record scheme '{cfg.model.scheme}''s option(s) {', '.join(unrecorded)}, "
            f"so it cannot be scored as it was trained; it was saved by another version: retrain it"
        )
    try:
        model.load_state_dict(ckpt["model"])
    except Exception as e:
        reason = str(e).strip().splitlines()[-1].strip()[:120]
        raise PosbenchError(
            f"{ckpt_path}: its weights do not fit scheme '{cfg.model.scheme}' as this posbench "
            f"builds it ({reason}); it was saved by another version: retrain it"
        ) from None
    if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
        raise PosbenchError(f"{ckpt_path}: holds non-finite weights (NaN or inf); retrain it")
    record = Path(run_dir) / "config.yaml"
    if record.is_file():  # the run's record: its data and eval settings are the current ones
        rec = config_from_dict(read_record(record), source=str(record))
        ours, theirs = _weights_part(cfg.to_dict()), _weights_part(rec.to_dict())
        if ours != theirs:
            diff = ", ".join(differences(ours, theirs, ("model.pt", "in config.yaml")))
            raise PosbenchError(f"{record} does not describe model.pt ({diff}); restore or delete it")
        cfg = rec
        model.cfg = dataclasses.replace(model.cfg, attention=rec.model.attention)
    return cfg, model


def _weights_part(d: dict) -> dict:
    """What a checkpoint's weights came from, given its text: the data may move or change."""
    return {k: v for k, v in _training_part(d).items() if k != "data"}


def eval_rows(cfg: ExperimentConfig, rows: list[dict], label: Optional[str] = None) -> list[dict]:
    """Rows of one run; `label` names an evaluation-time variant's rows, e.g. rope+yarn."""
    ident = {"scheme": label or cfg.model.scheme, "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
    return [{**ident, **r} for r in rows]


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
    if header is None or set(EVAL_COLUMNS) - set(header) - set(FILLED) or set(header) - set(EVAL_COLUMNS):
        raise bad
    for r in rows:
        for column, value in FILLED.items():
            r.setdefault(column, value)
    if not rows:  # a run is never dropped from a table in silence
        raise bad
    for r in rows:
        if r.get("status") == "ok" and r.get("loss") in ("", "nan", "inf"):  # how older versions wrote it
            r["status"] = "non-finite"
        try:
            int(r["length"]), int(r["tokens"]), int(r["seed"]), int(r["train_len"])
            if r["status"] not in STATUSES or (r["status"] == "ok" and not math.isfinite(float(r["loss"]))):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad from None
    return rows


def plan_runs(cfg: ExperimentConfig) -> list[tuple[ExperimentConfig, Path, str]]:
    """(resolved config, run folder, state) for every (scheme, seed), checked before anything is
    written: a folder trained under another config is an error, not overwritten. The state is
    "todo", "done" (trained) or "diverged" (its loss blew up in an earlier attempt)."""
    check_experiment(cfg)
    exp = Path(cfg.out_dir) / cfg.name
    _check_same_experiment(cfg, exp)
    runs = [(cfg.for_run(s, n), exp / run_name(s, n)) for s in cfg.schemes for n in cfg.seeds]
    return [(rc, rdir, plan_state(rc, rdir)) for rc, rdir in runs]


def plan_state(rc: ExperimentConfig, rdir: Path) -> str:
    """ "todo", "done" or "diverged" for the run `rc` in `rdir`; an error if the folder holds
    another config's run or something that is not a run."""
    if not ((rdir / "model.pt").is_file() or (rdir / DIVERGED).is_file()):
        if rdir.exists() and any(rdir.iterdir()):
            raise PosbenchError(f"{rdir} exists but holds no finished run; delete it to retrain")
        return "todo"
    try:  # the record, or the checkpoint's own copy when config.yaml was lost
        old = read_record(rdir / "config.yaml") if (rdir / "config.yaml").is_file() else load_run(rdir)[0].to_dict()
    except PosbenchError as e:
        raise PosbenchError(f"{e}; delete {rdir} to retrain it") from None
    new = rc.to_dict()
    if _training_part(old) != _training_part(new):
        diff = differences(_training_part(old), _training_part(new), (rdir.name, "here"))
        raise PosbenchError(
            f"{rdir} was trained under a different config ({', '.join(diff)}); "
            f"choose another experiment name with --set name=NEW, or delete that folder"
        )
    return "done" if (rdir / "model.pt").is_file() else "diverged"


def _check_same_experiment(cfg: ExperimentConfig, exp: Path) -> None:
    """An experiment's runs differ in scheme and seed only; a run trained at another length or
    size would be averaged with them as if it were another seed."""
    new = experiment_part(cfg.to_dict())
    for cfg_file in sorted(exp.glob("*/config.yaml")):
        if cfg_file.parent.name.startswith("."):
            continue
        try:
            old = experiment_part(config_from_dict(read_record(cfg_file)).to_dict())
        except PosbenchError:
            continue  # a damaged run folder is reported when it is planned
        if old != new:
            diff = differences(old, new, names=(cfg_file.parent.name, "here"))
            raise PosbenchError(
                f"{exp} holds runs trained under other settings ({', '.join(diff)}); "
                f"its runs must differ only in scheme and seed: choose another name with --set name=NEW"
            )


def experiment_part(d: dict) -> dict:
    """What every run of one experiment shares: the training part without scheme and seed."""
    part = _training_part(d)
    for key in ("schemes", "seeds", "scheme_options"):
        part.pop(key, None)
    if isinstance(part.get("model"), dict):
        part["model"] = {k: v for k, v in part["model"].items() if k not in ("scheme", "options")}
    return part


def flat(d: dict, where: str = "") -> dict:
    """A nested config as dotted keys: {'model.train_len': 32, ...}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{where}{k}.") if isinstance(v, dict) and v else {f"{where}{k}": v})
    return out


def differences(a: dict, b: dict, names=("old", "new"), where: str = "") -> list[str]:
    """Dotted keys whose values differ, e.g. ['model.train_len: 32 in alibi-seed0, 64 here']."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, names, f"{where}{k}.")
        elif x != y:
            out.append(f"{where}{k}: {x} in {names[0]}, {y} {names[1]}")
    return out


def _training_part(d: dict) -> dict:
    """What decides the weights: everything but the evaluation settings, where the results
    live (a copied or renamed experiment folder still resumes) and how fast it ran (the
    attention backend changes only the last bits; the records name the one that ran)."""
    part = {k: v for k, v in d.items() if k not in ("eval", "name", "out_dir")}
    if part.get("task", LM) == LM:  # records written before tasks existed name none
        part.pop("task", None)
        part.pop("task_options", None)
    else:  # no corpus is read
        part.pop("data", None)
    if isinstance(part.get("model"), dict):
        part["model"] = {k: v for k, v in part["model"].items() if k != "attention"}
    if isinstance(part.get("train"), dict):
        part["train"] = {
            k: v
            for k, v in part["train"].items()
            if k not in ("threads", "workers", "device", "compile", "log_every", "checkpoint_every")
        }
    return part


def train_run(rc: ExperimentConfig, rdir: Path, corpus: Corpus, reporter: Reporter) -> Optional[TransformerLM]:
    """Train in the hidden partial folder, resuming from its checkpoint if it holds one, and
    rename it into place once config, log and weights exist. A run whose loss blew up is
    renamed into place too, with diverged.json for weights, and None is returned. An error
    keeps the partial folder, with the error in failed.txt, only if it has a checkpoint."""
    partial = partial_dir(rdir)
    record = partial / "config.yaml"
    if record.is_file() and _training_part(_read_or_empty(record)) != _training_part(rc.to_dict()):
        reporter.note(f"{rdir.name}: its unfinished training was under other settings; starting it anew")
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    (partial / FAILED).unlink(missing_ok=True)
    write_atomic(record, dump_yaml(rc))
    try:
        batches = (
            None if rc.task == LM else build_task(rc.task, rc.task_options).batches(rc.seeds[0], rc.train.batch_size)
        )
        model = train_model(rc, corpus, reporter, partial, batches)
    except Diverged as e:
        write_atomic(partial / DIVERGED, json.dumps({"status": "diverged", "step": e.step, "loss": str(e.loss)}) + "\n")
        reporter.note(f"{rdir.name}: {e}; recorded in {rdir / DIVERGED}, the other runs go on")
        _finish(partial, rdir)
        return None
    except KeyboardInterrupt:
        raise  # its checkpoint is kept: the rerun resumes it
    except BaseException as e:
        if (partial / CHECKPOINT).is_file() or (partial / PREVIOUS).is_file():
            write_atomic(partial / FAILED, (str(e).strip().splitlines() or [type(e).__name__])[0] + "\n")
        else:  # nothing worth resuming
            shutil.rmtree(partial, ignore_errors=True)
        raise
    save_checkpoint(partial / "model.pt", model, rc)
    _finish(partial, rdir)
    return model


def _finish(partial: Path, rdir: Path) -> None:
    """The mid-run checkpoints go, then the whole folder takes its final name."""
    for name in (CHECKPOINT, PREVIOUS):
        (partial / name).unlink(missing_ok=True)
    if rdir.exists():
        shutil.rmtree(rdir)
    partial.rename(rdir)


def _read_or_empty(path: Path) -> dict:
    try:
        return read_yaml(path)
    except PosbenchError:
        return {}


def evaluate_into(
    rc,
    rdir: Path,
    model,
    corpus: Corpus,
    lengths: list[int],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
    protocols: Optional[list[str]] = None,
) -> list[dict]:
    """Evaluate at `lengths` under each protocol (None: the config's), as trained (None) and as
    each named evaluation-time variant, and merge the rows into the run's eval.csv and their
    loss per position into positions.csv: a (scheme label, length, protocol, stride) row
    replaces its old one. The plain rows come first, then each variant's."""
    unknown = [v for v in variants if v is not None and v not in model.scheme.eval_variants]
    if unknown:
        have = ", ".join(model.scheme.eval_variants) or "none"
        raise PosbenchError(
            f"scheme '{rc.model.scheme}' has no evaluation-time variant '{unknown[0]}' (its variants: {have})"
        )
    if factor is not None and not factor >= 1.0:
        raise PosbenchError(f"rope factor {factor}: must be >= 1")
    device = pick_device(rc.train.device)
    tokens = eval_tokens(corpus, rc, lengths)
    labels = {variant_label(rc.model.scheme, v, factor) for v in variants}
    n = len(tokens) - 1
    stale = {
        int(r["length"])
        for r in read_eval(rdir)
        if r["scheme"] in labels and int(r["tokens"]) != n and int(r["length"]) <= n
    }
    if stale - set(lengths):  # rows scored on other tokens do not compare with these: redo them
        lengths = sorted(set(lengths) | stale)
        tokens = eval_tokens(corpus, rc, lengths)
    rows, positions = [], []
    for protocol in protocols or rc.eval.protocol:
        stride = rc.eval.stride if protocol == "sliding" else None
        for v in variants:
            label = variant_label(rc.model.scheme, v, factor)
            scored, by_position = evaluate_model(
                model, tokens, lengths, rc.eval.batch_size, device, v, factor, protocol, stride
            )
            rows += eval_rows(rc, scored, label)
            for L, (sums, counts) in by_position.items():
                ident = {"scheme": label, "length": L, "protocol": protocol, "stride": stride}
                positions += [
                    {**ident, "position": p, "loss": sums[p].item() / c.item(), "tokens": c.item()}
                    for p, c in enumerate(counts)
                    if c > 0
                ]
    new = {_row_key(r) for r in rows}
    keep = [r for r in read_eval(rdir) if _row_key(r) not in new]
    base = rc.model.scheme

    def order(r):
        return r["scheme"] != base, r["scheme"], r["protocol"], int(r["length"])

    write_rows(rdir / "eval.csv", sorted(keep + rows, key=order), EVAL_COLUMNS)
    kept = [r for r in read_positions(rdir) if _row_key(r) not in new]
    write_rows(
        rdir / "positions.csv",
        sorted(kept + positions, key=lambda r: (*order(r), int(r["position"]))),
        POSITION_COLUMNS,
    )
    return rows


def _row_key(r: dict) -> tuple:
    """What one evaluation row stands for: scheme label, length, protocol and stride."""
    return r["scheme"], int(r["length"]), r["protocol"], str(r["stride"] if r["stride"] is not None else "")


def read_positions(run_dir: Path) -> list[dict]:
    """positions.csv's rows: the mean loss at each window position (empty if none yet)."""
    path = Path(run_dir) / "positions.csv"
    if not path.is_file():
        return []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != POSITION_COLUMNS:
            raise ValueError
        for r in rows:
            int(r["length"]), int(r["position"]), int(r["tokens"]), float(r["loss"])
    except (UnicodeDecodeError, csv.Error, KeyError, TypeError, ValueError):
        raise PosbenchError(f"{path}: malformed loss-per-position rows; delete it and run evaluate again") from None
    return rows


def evaluate_run(
    run_dir: Path,
    lengths: Optional[list[int]],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
    device: Optional[str] = None,
    attention: Optional[str] = None,
) -> tuple[ExperimentConfig, list[dict]]:
    """`posbench evaluate`: score a finished run at `lengths` (None: its config's), on `device`
    (None: the run's own) with the `attention` backend (None: the run's model.attention), merge
    the rows into its eval.csv, and restore a deleted config.yaml from the checkpoint's copy.
    Returns the run's config and the new rows."""
    rc, model = load_run(run_dir)
    if not (Path(run_dir) / "config.yaml").is_file():
        write_atomic(Path(run_dir) / "config.yaml", dump_yaml(rc))
    if rc.task != LM and lengths:
        raise PosbenchError(
            f"--lengths: a run of task {rc.task} is scored at its task's test lengths (task_options.test_max)"
        )
    if device is not None:  # a run trained on a GPU can be scored on a laptop
        check_device(device, f"--device {device}")
        rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, device=device))
    if attention is not None:  # how it is scored, not what it learned: the weights are the same
        model.cfg = dataclasses.replace(model.cfg, attention=attention)  # checked as it runs
    if rc.task != LM:
        if any(v is not None for v in variants):
            raise PosbenchError(f"--rope-scaling applies to perplexity (task lm), not to task {rc.task}")
        dev = pick_device(rc.train.device)
        return rc, evaluate_task_into(rc, Path(run_dir), model.to(dev), dev, model.backend(dev))
    lengths = lengths or rc.eval.lengths
    if not lengths or min(lengths) < rc.model.train_len:
        raise PosbenchError(
            f"--lengths {','.join(map(str, lengths))}: every length must be >= the training length {rc.model.train_len}"
        )
    if any(v is not None for v in variants):  # a variant row reads against the plain one, and
        variants = [None, *(v for v in variants if v is not None)]  # both need the ratio's base
        lengths = sorted({rc.model.train_len, *lengths})
    rows = evaluate_into(rc, Path(run_dir), model, load_corpus(rc.data), lengths, variants, factor)
    return rc, rows


def _unevaluated(rc, rdir: Path, model, n_tokens: int, backend: str) -> dict[tuple, list[int]]:
    """For each (variant, protocol) (variant None: as trained), the lengths still lacking a row
    scored on these tokens by this attention backend; eval.rope_scaling kinds apply to a run
    only if its scheme declares them."""
    variants = [None] + [v for v in rc.eval.rope_scaling if v in model.scheme.eval_variants]
    have = {(*_row_key(r), int(r["tokens"]), r["attention"]) for r in read_eval(rdir)}
    missing = {}
    for protocol in rc.eval.protocol:
        stride = str(rc.eval.stride) if protocol == "sliding" else ""
        for v in variants:
            label = variant_label(rc.model.scheme, v, rc.eval.rope_factor)
            lengths = [L for L in rc.eval.lengths if (label, L, protocol, stride, n_tokens, backend) not in have]
            if lengths:
                missing[v, protocol] = lengths
    return missing


def sweep_run_name(rc: ExperimentConfig, settings: dict) -> str:
    """'alibi-seed0-train_len64-3f9c2a1e': readable, then a hash of everything that decides
    the weights, so a folder is one config and a changed setting is a new folder."""
    readable = [
        f"{safe_name(k.split('.')[-1])}{safe_name(str(v))}"
        for k, v in settings.items()
        if k not in ("schemes", "seeds", "model.scheme")
    ]
    return "-".join([run_name(rc.schemes[0], rc.seeds[0]), *readable, run_digest(rc)])


def run_digest(rc: ExperimentConfig) -> str:
    """A hash of everything that decides a run's weights."""
    return hashlib.sha256(json.dumps(_training_part(rc.to_dict()), sort_keys=True).encode()).hexdigest()[:8]


def plan_sweep(grid: list[tuple[dict, ExperimentConfig]]) -> tuple[Path, list[tuple]]:
    """The experiment folder of a sweep's grid (from load_sweep) and its runs, as plan_runs
    gives them, each with its grid point's config: (point config, run config, folder, state).
    Nothing is written; two points that would train one run are an error."""
    first = grid[0][1]
    exp = Path(first.out_dir) / first.name
    if len({cfg.task == LM for _, cfg in grid}) > 1:  # perplexity and exact match share no table
        raise PosbenchError(
            "sweep: task mixes lm with the tasks, which one report cannot compare; sweep lm apart from the tasks"
        )
    plan, seen = [], {}
    for settings, cfg in grid:
        if (cfg.out_dir, cfg.name) != (first.out_dir, first.name):
            named = "; each task names its own folder unless the config sets name" if cfg.task != first.task else ""
            raise PosbenchError(
                f"sweep: its points would write to {exp} and {Path(cfg.out_dir) / cfg.name}, but name "
                f"and out_dir make the one experiment folder and cannot be swept{named}"
            )
        for s in cfg.schemes:
            for n in cfg.seeds:
                rc = cfg.for_run(s, n)
                rdir = exp / sweep_run_name(rc, settings)
                where = ", ".join(f"{k}={v}" for k, v in settings.items())
                digest = run_digest(rc)  # the readable part of two names may differ
                same = seen.get(digest)
                if same is not None and same[0] != where:
                    raise PosbenchError(
                        f"sweep points {same[0]} and {where} train the same run {same[1].name}: they differ "
                        f"only in how runs are scored or run, which a sweep does not vary"
                    )
                if same is None:
                    seen[digest] = where, rdir
                    plan.append((cfg, rc, rdir, plan_state(rc, rdir)))
    return exp, plan


def plan_note(rdir: Path, state: str) -> str:
    """What a run would do now: train, resume at step N, or be skipped, and why."""
    holder = lock_holder(lock_file(rdir))
    if holder is not None:
        return f"skip: another process (pid {holder or '?'}) holds it"
    if state == "done":
        return "skip: trained (score what it lacks)"
    if state == "diverged":
        return f"skip: diverged {diverged_step(rdir)}"
    step = _checkpoint_step(partial_dir(rdir))
    return "train" if step is None else f"resume at step {step}"


def sweep_jobs(grid: list[tuple[dict, ExperimentConfig]], source: str, reporter: Reporter) -> tuple[Path, list]:
    """A sweep's experiment folder, made, with `source` (the config file's text) kept there as
    sweep.yaml, and its (config, folder, state, evaluation tokens) jobs, each grid point checked
    before any of them runs."""
    exp, plan = plan_sweep(grid)
    jobs = []
    for _, cfg in grid:
        mine = [(rc, rdir, state) for c, rc, rdir, state in plan if c is cfg]
        if mine:
            jobs += [(rc, rdir, state, n) for (rc, rdir, state), n in zip(mine, prepare(cfg, mine, reporter))]
    exp.mkdir(parents=True, exist_ok=True)
    write_atomic(exp / SWEEP_RECORD, source)
    return exp, jobs


def run_sweep(grid: list[tuple[dict, ExperimentConfig]], source: str, reporter: Reporter) -> Path:
    """Train and evaluate what a sweep's grid still lacks, in one experiment folder. Returns it."""
    exp, jobs = sweep_jobs(grid, source, reporter)
    run_jobs(grid[0][1], jobs, exp, reporter)
    return exp


def run_experiment(cfg: ExperimentConfig, reporter: Reporter) -> Path:
    """Train what is missing, evaluate everything at cfg.eval.lengths; returns the folder."""
    plan = plan_runs(cfg)
    exp = Path(cfg.out_dir) / cfg.name
    jobs = [(rc, rdir, state, n_tokens) for (rc, rdir, state), n_tokens in zip(plan, prepare(cfg, plan, reporter))]
    run_jobs(cfg, jobs, exp, reporter)
    return exp


def prepare(cfg: ExperimentConfig, plan, reporter: Reporter) -> list[int]:
    """Refuse before anything trains what cannot run here, say what will be slow, and return
    the number of evaluation tokens of each planned run (the same for every run of `cfg`)."""
    kinds = set(cfg.eval.rope_scaling)
    if kinds and not any(kinds & set(resolve_scheme(s).eval_variants) for s in cfg.schemes):
        owners = [name for name, cls in SCHEMES.items() if kinds & set(cls.eval_variants)]
        reporter.note(
            f"eval.rope_scaling {cfg.eval.rope_scaling}: no scheme run here has these "
            f"evaluation-time variants ({', '.join(owners)} would), so they add no rows"
        )
    device = pick_device(cfg.train.device)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for rc, _, state in plan:
        if state == "todo":
            check_trainable(rc.model, gpu)  # a model too big is refused, not allocated
    # a backend that cannot run here is refused before anything trains
    backend = backend_for(cfg.model.attention, device, cfg.model.head_dim, cfg.train.compile)
    if backend == "flex" and device.type == "cpu" and any(state == "todo" for _, _, state in plan):
        raise PosbenchError(FLEX_CANNOT_TRAIN_ON_CPU)
    corpus, n_tokens = None, 0
    if cfg.task == LM:
        corpus = load_corpus(cfg.data)  # fails before any folder is made
        n_tokens = len(eval_tokens(corpus, cfg, cfg.eval.lengths)) - 1  # the same for every run
    if "sliding" in cfg.eval.protocol:  # stride 1 is exact and slow: say how slow first
        count = sum(len(windows(n_tokens, L, "sliding", cfg.eval.stride)) for L in cfg.eval.lengths)
        chunks = sum(len(windows(n_tokens, L, "nonoverlapping", None)) for L in cfg.eval.lengths)
        reporter.note(
            f"sliding evaluation, stride {cfg.eval.stride}: {count:,} windows per run over all lengths, "
            f"about {count / chunks:.0f}x the forward passes of non-overlapping evaluation"
        )
    if cfg.task != LM:
        reporter.note(
            f"task {cfg.task}: train_len {cfg.model.train_len} (its longest training instance), "
            f"{cfg.train.steps} steps x {cfg.train.batch_size} instances per run"
        )
    return [n_tokens] * len(plan)


def run_jobs(cfg: ExperimentConfig, jobs: list[tuple], exp: Path, reporter: Reporter) -> None:
    """Run (config, folder, state, evaluation tokens) jobs into `exp`, in this process or in
    cfg.train.workers processes. An experiment folder made here and left with nothing in it
    but lock files is removed on failure."""
    workers, threads = worker_plan(cfg, sum(state == "todo" for _, _, state, _ in jobs))
    created = not exp.exists()
    exp.mkdir(parents=True, exist_ok=True)
    try:
        if workers > 1:
            labelled = [(rdir.name, (rc, rdir, state, n)) for rc, rdir, state, n in jobs]
            run_in_workers(run_job, labelled, lambda: _remove_temporaries(jobs), reporter, workers, threads)
        else:
            if threads:
                torch.set_num_threads(threads)
            corpora = {}
            for rc, rdir, state, n_tokens in jobs:
                key = json.dumps([rc.task, dataclasses.asdict(rc.data)], sort_keys=True)
                corpus = corpora[key] if key in corpora else corpora.setdefault(key, corpus_for(rc))
                run_one(rc, rdir, state, corpus, n_tokens, reporter)
    except BaseException:
        if created and not any(p for p in exp.iterdir() if not p.name.endswith(".lock")):
            shutil.rmtree(exp, ignore_errors=True)
        raise


def run_one(rc, rdir: Path, state: str, corpus: Optional[Corpus], n_tokens: int, reporter: Reporter) -> str:
    """Train one run if it is not trained yet, then score whatever it still lacks, holding its
    lock throughout. Returns what happened: trained, reused, diverged, or held (another
    process holds the run, so it is left to that process)."""
    with exclusive(lock_file(rdir)) as held:
        if not held:
            pid = lock_holder(lock_file(rdir))
            reporter.note(
                f"{rdir.name}: another posbench process{f' (pid {pid})' if pid else ''} is running it; "
                f"skipped here, rerun once that process is done"
            )
            return "held"
        if state != "done" and (rdir / "model.pt").is_file():
            state = "done"  # another process finished it since it was planned
        if state == "diverged" or (rdir / DIVERGED).is_file():
            reporter.note(
                f"{rdir.name}: diverged in an earlier attempt ({diverged_step(rdir)}); delete {rdir} to train it again"
            )
            return "diverged"
        if state == "done":
            _, model = load_run(rdir)  # a corrupt checkpoint fails before it is announced as reused
            model.cfg = dataclasses.replace(model.cfg, attention=rc.model.attention)  # scored as asked now
            reporter.note(f"{rdir.name}: already trained, reusing its checkpoint")
        else:
            model = train_run(rc, rdir, corpus, reporter)
            if model is None:
                return "diverged"
        device = pick_device(rc.train.device)
        backend = model.backend(device)
        if rc.task != LM:
            try:
                scored = {r["attention"] for r in read_task_eval(rdir)} == {backend}
            except PosbenchError:
                scored = False
            if not scored:
                evaluate_task_into(rc, rdir, model.to(device), device, backend)
        else:
            for (variant, protocol), lengths in _unevaluated(
                rc, rdir, model, n_tokens, backend
            ).items():  # only what is missing
                evaluate_into(rc, rdir, model, corpus, lengths, [variant], rc.eval.rope_factor, [protocol])
        write_atomic(rdir / "config.yaml", dump_yaml(rc))  # eval settings may have changed
        return "reused" if state == "done" else "trained"


def run_job(rc, rdir: Path, state: str, n_tokens: int, reporter: Reporter) -> str:
    """run_one in a worker process, which reads the corpus from the cache itself."""
    return run_one(rc, rdir, state, corpus_for(rc), n_tokens, reporter)


def corpus_for(rc: ExperimentConfig) -> Optional[Corpus]:
    """The text a run trains and is scored on; a task makes its own instances and reads none."""
    return load_corpus(rc.data) if rc.task == LM else None


def _remove_temporaries(jobs) -> None:
    """What killed workers leave: temporary files. Their partial folders hold the checkpoints a
    rerun resumes from; a run another process holds is that process's own."""
    for _, rdir, _, _ in jobs:
        with exclusive(lock_file(rdir)) as held:
            if held:
                for folder in (rdir, partial_dir(rdir)):
                    for tmp in folder.glob(TMP_PREFIX + "*") if folder.is_dir() else []:
                        tmp.unlink(missing_ok=True)


def diverged_step(rdir: Path) -> str:
    """'at step 12', from a diverged run's record."""
    try:
        return f"at step {json.loads((Path(rdir) / DIVERGED).read_text())['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "at an unrecorded step"


def run_status(exp: Path) -> list[dict]:
    """`posbench status`: a row per run found in the experiment folder `exp`, with its state
    (done, partial, failed, diverged or running) and what can be said of it."""
    exp = Path(exp)
    if not exp.is_dir():
        raise PosbenchError(f"{exp}: no such experiment directory")
    rows = {}
    for folder in sorted(p for p in exp.iterdir() if p.is_dir()):
        hidden = folder.name.startswith(".")
        if hidden and not folder.name.endswith(".partial"):
            continue
        rdir = exp / folder.name[1 : -len(".partial")] if hidden else folder
        if not hidden and not any((folder / f).is_file() for f in ("config.yaml", "model.pt", DIVERGED)):
            continue  # not a run folder
        if not hidden or rdir.name not in rows:  # a finished folder outranks a partial one left beside it
            rows[rdir.name] = _status_of(folder, rdir, hidden)
    return [rows[name] for name in sorted(rows)]


def _status_of(folder: Path, rdir: Path, hidden: bool) -> dict:
    try:
        cfg = config_from_dict(read_record(folder / "config.yaml"))
        ident = {"scheme": cfg.schemes[0], "seed": cfg.seeds[0], "train_len": cfg.model.train_len}
        steps = cfg.train.steps
    except PosbenchError:
        ident, steps = {"scheme": "?", "seed": "?", "train_len": "?"}, None
    row = {"run": rdir.name, **ident}
    holder = lock_holder(lock_file(rdir))
    step = _checkpoint_step(folder) if hidden else None
    at = f"at step {step} of {steps}" if step is not None else "no checkpoint yet"
    if holder is not None:
        doing = f"training, {at}" if hidden else "evaluating"
        return {**row, "state": "running", "detail": f"{doing} (pid {holder or '?'})"}
    if not hidden:
        if (folder / DIVERGED).is_file() and not (folder / "model.pt").is_file():
            return {**row, "state": "diverged", "detail": diverged_step(folder)}
        missing = [f for f in ("model.pt", "eval.csv") if not (folder / f).is_file()]
        return {
            **row,
            "state": "done" if not missing else "partial",
            "detail": "trained and evaluated" if not missing else f"lacks {' and '.join(missing)}",
        }
    if (folder / FAILED).is_file():
        return {**row, "state": "failed", "detail": f"{(folder / FAILED).read_text(errors='replace').strip()} ({at})"}
    return {**row, "state": "partial", "detail": f"{at}; rerun to resume" if step is not None else at}


def _checkpoint_step(folder: Path) -> Optional[int]:
    """The step a partial folder's checkpoint resumes from (None if it has no readable one)."""
    try:
        state = load_progress(folder)
    except PosbenchError:
        return None
    return int(state["step"]) if state is not None else None


def read_train_log(rdir: Path) -> list[dict]:
    """A run's train_log.jsonl records (empty if it has none or it cannot be read)."""
    try:
        return [json.loads(line) for line in (Path(rdir) / "train_log.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []


def trained_with(rdir: Path) -> Optional[str]:
    """The attention backend a run trained with, from its train_log.jsonl (None if unrecorded)."""
    log = read_train_log(rdir)
    return log[0].get("attention") if log and isinstance(log[0], dict) else None
