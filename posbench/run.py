"""Runs: train one (scheme, seed), evaluate it at every length, and keep the records on disk.

A run folder holds config.yaml (fully resolved), model.pt (weights plus that same config),
train_log.jsonl (step, loss, lr, seconds) and eval.csv (its evaluation rows). Folders are
built under a temporary name and renamed when whole, so an interrupted run leaves nothing
that could pass for a finished one.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from posbench.config import (ExperimentConfig, check_device, check_trainable, config_from_dict, dump_yaml,
                             read_yaml)
from posbench.data import Corpus, batch, load_corpus
from posbench.errors import PosbenchError
from posbench.model import TransformerLM
from posbench.native.layers import cross_entropy
from posbench.native.optim import clip_and_step
from posbench.schemes import SCHEMES, resolve_scheme, variant_label

EVAL_COLUMNS = ["scheme", "seed", "train_len", "length", "loss", "ppl", "tokens", "status"]
STATUSES = ("ok", "beyond-max-len", "non-finite")  # scored; cannot encode the length; blew up
PROTOCOL_NAMES = {"nonoverlapping": "non-overlapping chunks, every token scored"}


class Reporter:
    """Progress callbacks; the CLI supplies one that draws bars, library code never prints.
    Runs may train at once (train.workers), so each call names its run's label."""

    def start(self, label: str, total: int) -> None: ...

    def step(self, label: str, step: int, loss: float) -> None: ...

    def finish(self, label: str) -> None: ...

    def note(self, message: str) -> None: ...


class QueueReporter(Reporter):
    """A worker process's reporter: every call goes to the parent, which replays it."""

    def __init__(self, queue):
        self.queue = queue

    def start(self, label, total):
        self.queue.put(("start", label, total))

    def step(self, label, step, loss):
        self.queue.put(("step", label, step, loss))

    def finish(self, label):
        self.queue.put(("finish", label))

    def note(self, message):
        self.queue.put(("note", message))


# --- small pieces ----------------------------------------------------------------------------


def pick_device(name: str, hint: str = "evaluate takes --device cpu") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"train.device={name}: no CUDA device is available here ({hint})")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise PosbenchError(f"train.device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 on GPUs; CPUs stay fp32, the tested default."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def safe_name(text: str) -> str:
    """A folder name from anything, e.g. a plugin's module:Class."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def run_name(scheme: str, seed: int) -> str:
    return f"{safe_name(scheme)}-seed{seed}"


TMP_PREFIX = "tmp-"  # atomic()'s temporary files; a killed writer can leave one behind


def partial_dir(rdir: Path) -> Path:
    """The hidden folder a run is built in before it is renamed to `rdir`."""
    return rdir.with_name("." + rdir.name + ".partial")


@contextlib.contextmanager
def atomic(path: Path):
    """A temporary path beside `path` that replaces it only once the block has finished, so no
    reader ever sees a half-written file. The name keeps its suffix (savefig reads it)."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    with atomic(path) as tmp:
        tmp.write_text(text)


def write_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    """A CSV of `columns`; None and NaN are written as empty cells."""
    with atomic(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if _missing(r.get(k)) else r.get(k)) for k in columns})


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


# --- training --------------------------------------------------------------------------------


def train_model(cfg: ExperimentConfig, corpus: Corpus, reporter: Reporter, log_path: Path):
    """Train cfg.model (one scheme) with seed cfg.seeds[0]; returns the model on the CPU."""
    seed, tc, L = cfg.seeds[0], cfg.train, cfg.model.train_len
    if len(corpus.train) < L + 2:
        raise PosbenchError(
            f"the training split of '{corpus.name}' has {len(corpus.train)} bytes, "
            f"fewer than model.train_len+2={L + 2}"
        )
    device = pick_device(tc.device)
    torch.manual_seed(seed)
    model = TransformerLM(cfg.model).to(device)
    gen = torch.Generator().manual_seed(seed)  # the data order depends on the seed alone
    params = list(model.parameters())  # once: model.parameters() walks every module each call
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
        fused=True,  # one kernel for all parameters; the per-tensor loop costs ~10% at this size
    )
    forward = torch.compile(model) if tc.compile else model  # same weights, compiled graph
    label = f"{cfg.model.scheme} seed {seed}"
    reporter.start(label, tc.steps)
    t0 = time.perf_counter()
    with log_path.open("w", buffering=1) as log:  # line-buffered: `tail -f` works
        for step in range(tc.steps):
            lr = lr_at(step, tc)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batch(corpus.train, tc.batch_size, L, gen)
            x, y = x.to(device), y.to(device)
            with autocast(device):
                logits = _compiled_call(forward, x) if tc.compile and step == 0 else forward(x)  # (B, T, V)
            loss = cross_entropy(logits.float().flatten(0, 1), y.flatten())  # F.cross_entropy, fused in C on CPU
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clip_and_step(opt, params, tc.grad_clip)  # clip_grad_norm_ (if > 0) and opt.step(), in C on CPU
            if step % tc.log_every == 0 or step == tc.steps - 1:
                value = loss.item()
                if not math.isfinite(value):
                    raise PosbenchError(
                        f"training {cfg.model.scheme} diverged at step {step} (loss {value}); "
                        f"lower train.lr (now {tc.lr})"
                    )
                rec = {"step": step, "loss": round(value, 5), "lr": lr,
                       "seconds": round(time.perf_counter() - t0, 3)}  # fmt: skip
                log.write(json.dumps(rec) + "\n")
                reporter.step(label, step + 1, value)
    reporter.finish(label)
    return model.cpu()


def _compiled_call(forward, x):
    """The first call compiles; a missing C++ compiler or an unsupported op fails here."""
    try:
        return forward(x)
    except PosbenchError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise PosbenchError(f"train.compile: torch.compile failed ({first}); train without --compile") from None


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
        rec = config_from_dict(read_yaml(record), source=str(record))
        ours, theirs = _weights_part(cfg.to_dict()), _weights_part(rec.to_dict())
        if ours != theirs:
            diff = ", ".join(differences(ours, theirs, ("model.pt", "in config.yaml")))
            raise PosbenchError(f"{record} does not describe model.pt ({diff}); restore or delete it")
        cfg = rec
    return cfg, model


def _weights_part(d: dict) -> dict:
    """What a checkpoint's weights came from, given its text: the data may move or change."""
    return {k: v for k, v in _training_part(d).items() if k != "data"}


# --- evaluation ------------------------------------------------------------------------------


def eval_tokens(corpus: Corpus, cfg: ExperimentConfig, lengths: list[int]) -> torch.Tensor:
    """The validation tokens scored at every length: the first eval.tokens (+1 for targets)."""
    if cfg.eval.tokens < max(lengths):
        raise PosbenchError(f"eval.tokens={cfg.eval.tokens} is fewer than eval length {max(lengths)}")
    n = min(cfg.eval.tokens, len(corpus.val) - 1)
    if n < max(lengths):
        raise PosbenchError(
            f"the validation split of '{corpus.name}' has {len(corpus.val)} bytes, too few "
            f"for eval length {max(lengths)}; use shorter lengths or more text"
        )
    return corpus.val[: n + 1]


@torch.no_grad()
def evaluate_model(
    model: TransformerLM,
    tokens: torch.Tensor,
    lengths: list[int],
    batch_size: int,
    device: torch.device,
    variant: Optional[str] = None,
    factor: Optional[float] = None,
) -> list[dict]:
    """Mean next-byte loss at each length: the same tokens cut into non-overlapping chunks of
    that length (the last one shorter), every token scored, so lengths compare directly.
    With `variant`, the scheme's evaluation-time variant of that name is applied per length."""
    model = model.to(device).eval()
    n = len(tokens) - 1
    rows = []
    for L in lengths:
        row = {"length": L, "tokens": n, "loss": float("nan"), "ppl": float("nan")}
        if model.max_len is not None and L > model.max_len:
            rows.append({**row, "status": "beyond-max-len"})
            continue
        with model.scheme.eval_variant(variant, model.cfg.train_len, L, factor):
            loss = _mean_nll(model, tokens, L, batch_size, device)
        if not math.isfinite(loss):  # a blow-up at some length is a result, not a lost row
            rows.append({**row, "status": "non-finite"})
            continue
        rows.append({**row, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "status": "ok"})
    model.train()
    return rows


def _mean_nll(model, tokens: torch.Tensor, L: int, batch_size: int, device) -> float:
    """All n tokens scored in non-overlapping chunks of L."""
    n = len(tokens) - 1
    starts = list(range(0, n, L))
    full = [s for s in starts if s + L <= n]
    total = 0.0
    for i in range(0, len(full), batch_size):
        idx = torch.tensor(full[i : i + batch_size])[:, None] + torch.arange(L + 1)  # (b, L+1)
        win = tokens[idx].long().to(device)
        total += _nll_sum(model, win, device)
    if len(full) < len(starts):  # the remainder, so that every length scores all n tokens
        win = tokens[starts[-1] :].long()[None].to(device)  # (1, n - s + 1)
        total += _nll_sum(model, win, device)
    return total / n


def _nll_sum(model, win, device) -> float:
    with autocast(device):
        logits = model(win[:, :-1])  # (b, L, V)
    return F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()


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
    if header != EVAL_COLUMNS or not rows:  # a run is never dropped from a table in silence
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


# --- experiments -----------------------------------------------------------------------------


def plan_runs(cfg: ExperimentConfig) -> list[tuple[ExperimentConfig, Path, bool]]:
    """(resolved config, run folder, already trained?) for every (scheme, seed), checked before
    anything is written: a folder trained under another config is an error, not overwritten."""
    exp = Path(cfg.out_dir) / cfg.name
    _check_same_experiment(cfg, exp)
    plan = []
    for scheme in cfg.schemes:
        for seed in cfg.seeds:
            rc = cfg.for_run(scheme, seed)
            rdir = exp / run_name(scheme, seed)
            done = False
            if (rdir / "model.pt").is_file():
                try:  # the record, or the checkpoint's own copy when config.yaml was lost
                    old = (read_yaml(rdir / "config.yaml") if (rdir / "config.yaml").is_file()
                           else load_run(rdir)[0].to_dict())  # fmt: skip
                except PosbenchError as e:
                    raise PosbenchError(f"{e}; delete {rdir} to retrain it") from None
                new = rc.to_dict()
                if _training_part(old) != _training_part(new):
                    diff = differences(_training_part(old), _training_part(new), (rdir.name, "here"))
                    raise PosbenchError(
                        f"{rdir} was trained under a different config ({', '.join(diff)}); "
                        f"choose another experiment name with --set name=NEW, or delete that folder"
                    )
                done = True
            elif rdir.exists() and any(rdir.iterdir()):
                raise PosbenchError(f"{rdir} exists but holds no finished run; delete it to retrain")
            plan.append((rc, rdir, done))
    return plan


def _check_same_experiment(cfg: ExperimentConfig, exp: Path) -> None:
    """An experiment's runs differ in scheme and seed only; a run trained at another length or
    size would be averaged with them as if it were another seed."""
    new = experiment_part(cfg.to_dict())
    for cfg_file in sorted(exp.glob("*/config.yaml")):
        if cfg_file.parent.name.startswith("."):
            continue
        try:
            old = experiment_part(config_from_dict(read_yaml(cfg_file)).to_dict())
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
    live (a copied or renamed experiment folder still resumes) and how fast it ran."""
    part = {k: v for k, v in d.items() if k not in ("eval", "name", "out_dir")}
    if isinstance(part.get("train"), dict):
        part["train"] = {k: v for k, v in part["train"].items()
                         if k not in ("threads", "workers", "device", "compile", "log_every")}  # fmt: skip
    return part


def train_run(rc: ExperimentConfig, rdir: Path, corpus: Corpus, reporter: Reporter) -> TransformerLM:
    """Train into a hidden folder and rename it into place once config, log and weights exist."""
    partial = partial_dir(rdir)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        write_atomic(partial / "config.yaml", dump_yaml(rc))
        model = train_model(rc, corpus, reporter, partial / "train_log.jsonl")
        save_checkpoint(partial / "model.pt", model, rc)
        if rdir.exists():
            shutil.rmtree(rdir)
        partial.rename(rdir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return model


def evaluate_into(
    rc,
    rdir: Path,
    model,
    corpus: Corpus,
    lengths: list[int],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
) -> list[dict]:
    """Evaluate at `lengths`, as trained (None) and as each named evaluation-time variant, and
    merge the rows into the run's eval.csv: a (scheme label, length) row replaces its old one.
    The plain rows come first, then each variant's, so the file reads as a table."""
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
    stale = {int(r["length"]) for r in read_eval(rdir)
             if r["scheme"] in labels and int(r["tokens"]) != n and int(r["length"]) <= n}  # fmt: skip
    if stale - set(lengths):  # rows scored on other tokens do not compare with these: redo them
        lengths = sorted(set(lengths) | stale)
        tokens = eval_tokens(corpus, rc, lengths)
    rows = []
    for v in variants:
        scored = evaluate_model(model, tokens, lengths, rc.eval.batch_size, device, v, factor)
        rows += eval_rows(rc, scored, variant_label(rc.model.scheme, v, factor))
    new = {(r["scheme"], int(r["length"])) for r in rows}
    keep = [r for r in read_eval(rdir) if (r["scheme"], int(r["length"])) not in new]
    base = rc.model.scheme
    merged = sorted(keep + rows, key=lambda r: (r["scheme"] != base, r["scheme"], int(r["length"])))
    write_rows(rdir / "eval.csv", merged, EVAL_COLUMNS)
    return rows


def evaluate_run(
    run_dir: Path,
    lengths: Optional[list[int]],
    variants: list[Optional[str]] = (None,),
    factor: Optional[float] = None,
    device: Optional[str] = None,
) -> tuple[ExperimentConfig, list[dict]]:
    """`posbench evaluate`: score a finished run at `lengths` (None: its config's), on `device`
    (None: the run's own), merge the rows into its eval.csv, and restore a deleted config.yaml
    from the checkpoint's copy. Returns the run's config and the new rows."""
    rc, model = load_run(run_dir)
    if not (Path(run_dir) / "config.yaml").is_file():
        write_atomic(Path(run_dir) / "config.yaml", dump_yaml(rc))
    if device is not None:  # a run trained on a GPU can be scored on a laptop
        check_device(device, f"--device {device}")
        rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, device=device))
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


def _unevaluated(rc, rdir: Path, model, n_tokens: int) -> dict[Optional[str], list[int]]:
    """For each variant (None: as trained), the lengths still lacking a row with these tokens;
    eval.rope_scaling kinds apply to a run only if its scheme declares them."""
    variants = [None] + [v for v in rc.eval.rope_scaling if v in model.scheme.eval_variants]
    have = {(r["scheme"], int(r["length"]), int(r["tokens"])) for r in read_eval(rdir)}
    missing = {}
    for v in variants:
        label = variant_label(rc.model.scheme, v, rc.eval.rope_factor)
        lengths = [L for L in rc.eval.lengths if (label, L, n_tokens) not in have]
        if lengths:
            missing[v] = lengths
    return missing


def run_experiment(cfg: ExperimentConfig, reporter: Reporter) -> Path:
    """Train what is missing, evaluate everything at cfg.eval.lengths; returns the folder."""
    plan = plan_runs(cfg)
    kinds = set(cfg.eval.rope_scaling)
    if kinds and not any(kinds & set(resolve_scheme(s).eval_variants) for s in cfg.schemes):
        owners = [name for name, cls in SCHEMES.items() if kinds & set(cls.eval_variants)]
        reporter.note(
            f"eval.rope_scaling {cfg.eval.rope_scaling}: no scheme run here has these "
            f"evaluation-time variants ({', '.join(owners)} would), so they add no rows"
        )
    device = pick_device(cfg.train.device)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for rc, _, done in plan:
        if not done:
            check_trainable(rc.model, gpu)  # a model too big is refused, not allocated
    corpus = load_corpus(cfg.data)  # fails before any folder is made
    n_tokens = len(eval_tokens(corpus, cfg, cfg.eval.lengths)) - 1  # the same for every run
    workers, threads = worker_plan(cfg, sum(not done for _, _, done in plan))
    exp = Path(cfg.out_dir) / cfg.name
    created = not exp.exists()
    exp.mkdir(parents=True, exist_ok=True)
    try:
        if workers > 1:
            _run_in_workers(plan, n_tokens, reporter, workers, threads)
        else:
            if threads:
                torch.set_num_threads(threads)
            for rc, rdir, done in plan:
                run_one(rc, rdir, done, corpus, n_tokens, reporter)
    except BaseException:
        if created and not any(p for p in exp.iterdir() if not p.name.startswith(".")):
            shutil.rmtree(exp, ignore_errors=True)
        raise
    return exp


def run_one(rc, rdir: Path, done: bool, corpus: Corpus, n_tokens: int, reporter: Reporter) -> None:
    """Train one run if it is not trained yet, then score whatever it still lacks."""
    if done:
        _, model = load_run(rdir)  # a corrupt checkpoint fails before it is announced as reused
        reporter.note(f"{rdir.name}: already trained, reusing its checkpoint")
    else:
        model = train_run(rc, rdir, corpus, reporter)
    for variant, lengths in _unevaluated(rc, rdir, model, n_tokens).items():  # only what is missing
        evaluate_into(rc, rdir, model, corpus, lengths, [variant], rc.eval.rope_factor)
    write_atomic(rdir / "config.yaml", dump_yaml(rc))  # eval settings may have changed


# --- several runs at once --------------------------------------------------------------------


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, e.g. in a container
    except AttributeError:
        return os.cpu_count() or 1


SMALL_RUN_TOKENS = 200_000  # below this a run trains in about the 2 s a worker takes to start


def worker_plan(cfg: ExperimentConfig, to_train: int) -> tuple[int, Optional[int]]:
    """(processes, torch threads in each). A model this small scales poorly over threads: on 2
    cores, two runs at once with 1 thread each finished 1.1-1.5x sooner than one after the
    other with 2 threads (A/B over whole runs, README "Configs"). A GPU gets 1 process, and runs
    too small to repay a worker's start (configs/smoke.yaml) stay in this process."""
    tc = cfg.train
    workers = tc.workers
    if workers is None:
        small = tc.steps * tc.batch_size * cfg.model.train_len < SMALL_RUN_TOKENS
        workers = 1 if small or pick_device(tc.device).type != "cpu" else cpu_cores()
    workers = max(1, min(workers, to_train))
    threads = tc.threads or (max(1, cpu_cores() // workers) if workers > 1 else None)
    return workers, threads


def _worker_main(threads: Optional[int], jobs, events) -> None:
    """A worker process: take (index, rc, rdir, done, n_tokens) jobs until None. Ctrl-C is the
    parent's to handle; it stops workers by killing them and cleans up after them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    reporter = QueueReporter(events)
    while (job := jobs.get()) is not None:
        i, rc, rdir, done, n_tokens = job
        try:
            run_one(rc, rdir, done, load_corpus(rc.data), n_tokens, reporter)
            events.put(("done", i))
        except PosbenchError as e:
            events.put(("failed", i, str(e)))
        except Exception as e:  # a bug, not the user's input: keep its type for the report
            events.put(("failed", i, f"{rdir.name}: {type(e).__name__}: {e}"))


def _run_in_workers(plan, n_tokens: int, reporter: Reporter, workers: int, threads) -> None:
    """Each (scheme, seed) in a worker process, `workers` at a time, progress relayed through
    a queue. After the first error no new run starts; the runs under way finish and are kept,
    and the error is raised here. An interrupt kills the workers at once and removes what
    their unfinished runs had written."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # fork after torch has started its threads can deadlock
    jobs, events = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(threads, jobs, events), daemon=True) for _ in range(workers)]
    todo = [(i, rc, rdir, done, n_tokens) for i, (rc, rdir, done) in enumerate(plan)]
    error, busy = None, 0
    try:
        for p in procs:
            p.start()
        for _ in range(workers):
            job = todo.pop(0) if todo else None
            jobs.put(job)
            busy += job is not None
        while busy:
            try:
                kind, *args = events.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise PosbenchError(
                        f"a worker process died (exit code {dead[0].exitcode}), perhaps out of "
                        "memory; rerun with --set train.workers=1 to see the error"
                    )
                continue
            if kind in ("done", "failed"):
                if kind == "failed" and error is None:
                    error = args[1]
                nxt = todo.pop(0) if todo and error is None else None
                jobs.put(nxt)
                busy -= nxt is None
            else:
                getattr(reporter, kind)(*args)
        for p in procs:
            p.join()
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for _, rdir, _ in plan:  # what killed runs leave: hidden partial folders, temp files
            shutil.rmtree(partial_dir(rdir), ignore_errors=True)
            for tmp in rdir.glob(TMP_PREFIX + "*") if rdir.is_dir() else []:
                tmp.unlink(missing_ok=True)
        raise
    if error is not None:
        raise PosbenchError(error)
