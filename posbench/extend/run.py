"""`posbench extend`'s runs: the children planned, what each starts from, and the parents' copies.

The parents, the children's configs, what a child starts from and trains on, and the copies
of the parents (the methods: posbench/extend/methods.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from posbench.config import ExperimentConfig, apply_override, assign, config_from_dict, dump_yaml, set_clash
from posbench.errors import PosbenchError
from posbench.extend.methods import (
    ABF_BASE,
    CURVE,
    CURVE_COLUMNS,
    EXTEND_RECORD,
    PARENT,
    Method,
    applies,
    base_method,
    child_label,
    read_curve,
    trained_tokens,
)
from posbench.files import room_in, write_atomic

if TYPE_CHECKING:
    import torch


def parents_in(folder: Path) -> list[Path]:
    """The finished runs to extend: `folder` itself if it is a run, else its runs. An
    unfinished one (no model.pt, or a training still under way) is an error, before anything
    is written; a diverged one has nothing to extend and is left out."""
    from posbench.experiment.records import diverged_step, planned, run_state

    folder = Path(folder)
    if not folder.is_dir():
        raise PosbenchError(f"{folder}: no such run or experiment folder")
    from posbench.experiment.checkpoint import pretrained_refused

    advice = "extend fine-tunes posbench's runs; posbench pretrained {path} --rope-scaling yarn scales it"
    pretrained_refused(folder, advice)
    run = run_state(folder)
    if run.state == "done":
        return [folder]
    if run.state == "diverged":
        raise PosbenchError(f"{folder}: a run that diverged {diverged_step(folder)}; it has no model.pt to extend")
    if run.state != "none":
        raise PosbenchError(f"{folder}: an unfinished run (no model.pt); finish training it before extending it")
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = {p.name for p in runs}
    for name in planned(folder):
        if name not in names:
            raise PosbenchError(f"{folder / name}: an unfinished run (not trained yet); finish {folder} first")
    found = []
    for p in runs:
        pretrained_refused(p, advice)
        state = run_state(p).state
        if state == "done":
            found.append(p)
        elif state in ("running", "unfinished"):
            raise PosbenchError(f"{p}: an unfinished run (no model.pt); finish training it before extending {folder}")
    for p in sorted(folder.glob(".*.partial")):
        raise PosbenchError(f"{folder / p.name[1 : -len('.partial')]}: an unfinished run; finish {folder} first")
    if not found:
        raise PosbenchError(f"{folder}: holds no finished run (model.pt) to extend")
    return found


def parent_identity(rc: ExperimentConfig, task) -> str:
    """The hash of what decided a parent's weights: its children record it."""
    from posbench.experiment.plan import run_identity

    return hashlib.sha256(json.dumps(run_identity(rc, task), sort_keys=True).encode()).hexdigest()[:16]


# --- the children's configs ----------------------------------------------------------------------


@dataclass
class Plan:
    """What `posbench extend` will do: the copies of the parents and the children, as jobs."""

    folder: Path
    jobs: list  # posbench.experiment.plan.Job: each parent's copy, then its children
    notes: list[str]
    record: dict  # extend.yaml


FLAG_KEYS = {"model.train_len": "--to", "train.steps": "--steps", "train.lr": "--lr", "eval.lengths": "--lengths"}


def plan_extension(
    source: Path,
    to: int,
    methods: list[Method],
    steps: int,
    out: Optional[Path] = None,
    lengths: Optional[list[int]] = None,
    lr: Optional[float] = None,
    abf_base: float = ABF_BASE,
    curve: Optional[list[int]] = None,
    overrides: list[str] = (),
) -> Plan:
    """Every job, checked before anything is written: a bad method, parent or length is one line."""
    from posbench.experiment.checkpoint import load_run
    from posbench.experiment.plan import Job, plan_state
    from posbench.experiment.records import read_config, run_name
    from posbench.registry import named_by
    from posbench.schemes import SCHEMES, build_scheme
    from posbench.tasks import task_for

    for o in overrides:  # what extend decides from its own flags: a --set of it would win in silence
        key = set_clash(o, FLAG_KEYS)
        if key is not None:
            raise PosbenchError(f"--set {o}: extend sets {key} from {FLAG_KEYS[key]}; give that instead")
    if steps <= 0:
        raise PosbenchError(f"--steps {steps} must be positive")
    if lr is not None and not lr > 0:
        raise PosbenchError(f"--lr {lr} must be positive")
    if not abf_base > 1:
        raise PosbenchError(f"--abf-base {abf_base} must be > 1")
    outside = [s for s in curve or [] if not 0 <= s <= steps]
    if outside:
        raise PosbenchError(f"--curve {outside[0]}: the steps scored while fine-tuning lie in 0..{steps} (--steps)")
    parents = parents_in(source)
    source = Path(source)
    folder = Path(out) if out is not None else source.parent / f"{source.name}-extend{to}"
    if folder.resolve() == source.resolve() or source.resolve() in folder.resolve().parents:
        raise PosbenchError(f"--out {folder}: inside the parent's folder {source}, which extend never writes to")
    holds = [p for p in parents if folder.resolve() == p.resolve() or folder.resolve() in p.resolve().parents]
    if holds:
        raise PosbenchError(f"--out {folder}: holds the parent run {holds[0]}, which extend never writes to")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / EXTEND_RECORD).is_file():
        raise PosbenchError(
            f"--out {folder}: a folder extend did not make (no {EXTEND_RECORD}); give a new or empty folder"
        )
    _check_same_extension(folder, to, steps)
    jobs, notes, skipped, hoped, tokens = [], [], {}, {}, {}
    for pdir in parents:
        recorded = (pdir / "config.yaml").is_file()
        prc = read_config(pdir) if recorded else load_run(pdir)[0]
        with named_by(pdir):  # its scheme and task, if a user's module:Class, are said before they run
            SCHEMES.lookup(prc.model.scheme)
            task = task_for(prc)
        measure = task.measure()
        why_not = task.not_extendable(prc)
        if why_not is not None:
            raise PosbenchError(f"{pdir}: {why_not}")
        if prc.model.extend:
            raise PosbenchError(f"{pdir}: already a fine-tuned run ({prc.model.extend['method']}); extend its parent")
        L, scheme, seed = prc.model.train_len, prc.model.scheme, prc.seeds[0]
        if to <= L:
            raise PosbenchError(f"--to {to} is not longer than {pdir.name}'s training length {L}")
        if recorded:  # its weights, checked against their checksum before anything is written
            load_run(pdir)
        want = sorted(set(lengths or [*prc.eval.lengths, to, 2 * to, 4 * to]))
        if min(want) < 1:
            raise PosbenchError(f"--lengths: every length must be positive, not {min(want)}")
        ident = parent_identity(prc, task)
        settings = parent_settings(prc, overrides)
        copy_rc = _with(
            prc,
            settings,
            folder,
            eval={"lengths": want, "perplexity.rope_scaling": _variants(prc), "perplexity.rope_factor": None},
        )
        copy_dir = folder / run_name(scheme, seed)
        state = plan_state(copy_rc, task, copy_dir, "--out")  # "todo": copied, never trained
        jobs.append(Job(copy_rc, task, measure, copy_dir, "copy" if state == "todo" else state, parent=pdir))
        for m in methods:
            if not applies(m, scheme):
                skipped.setdefault(m, []).append(scheme)
                continue
            if m.base == "abf" and prc.model.options.get("hope"):  # a new base would move HoPE's cut
                hoped.setdefault(m, []).append(pdir.name)
                continue
            rc = child_config(prc, m, to, steps, lr, want, ident, abf_base, folder, overrides)
            build_scheme(rc.model)  # what the method asks of the scheme (pi-keep99 of 8 pairs), before any writing
            rdir = folder / f"{run_name(scheme, seed)}-{m.name}"
            points = sorted(set(curve or default_curve(steps)))
            jobs.append(Job(rc, task, measure, rdir, plan_state(rc, task, rdir, "--out"), parent=pdir, curve=points))
            tokens.setdefault(m.name, trained_tokens(rc))
    for m, schemes in skipped.items():
        only = ", ".join(m.schemes)
        notes.append(f"{m.name} applies to {only} only: not to {', '.join(sorted(set(schemes)))}")
    for m, names in hoped.items():
        notes.append(
            f"{m.name} skipped for {', '.join(names)}: their RoPE leaves the pairs slower than the training "
            f"length unrotated (hope), and a new base would move that cut, so a child would not start as its parent"
        )
    if not any(job.cfg.model.extend for job in jobs):
        raise PosbenchError(
            f"no method given applies to the runs in {source} ({'; '.join(notes)}); plain applies to every scheme"
        )
    record = {
        "parents": [os.path.relpath(p.resolve(), folder.resolve()) for p in parents],
        "to": to,
        "steps": steps,
        "methods": [m.name for m in methods],
        "tokens": tokens,  # each method's fine-tuning, in trained tokens (equal: docs/extend.md)
        "lengths": sorted({L for job in jobs for L in job.cfg.eval.lengths}),
    }
    return Plan(folder, jobs, notes, record)


def parent_settings(prc: ExperimentConfig, overrides) -> list[str]:
    """The --set overrides a parent's copy takes: those that change how runs are run or scored,
    not what its weights were trained under (a child takes every one, e.g. train.batch_size).
    One that changes the model is refused: the parent's weights fit the parent's model alone."""
    from posbench.config import flat
    from posbench.experiment.records import weights_identity

    base = flat(weights_identity(prc))
    kept = []
    for o in overrides:
        raw = prc.to_dict()
        apply_override(raw, o, {})
        changed = [k for k, v in flat(weights_identity(config_from_dict(raw))).items() if base.get(k) != v]
        model = [k for k in changed if k.startswith("model.")]
        if model:
            raise PosbenchError(
                f"--set {o}: extend fine-tunes the parent's weights, which fit its model as trained ({model[0]}: "
                f"{base.get(model[0])}); its model settings cannot change"
            )
        if not changed:
            kept.append(o)
    return kept


def default_curve(steps: int) -> list[int]:
    """Where a child is scored at L2 while it fine-tunes: before, and after 1/10, 1/4, 1/2, all."""
    return sorted({0, steps // 10, steps // 4, steps // 2, steps})


def _variants(rc: ExperimentConfig) -> list[str]:
    """The parent's own evaluation-time variants, but those its scheme refuses (rope's longrope). A
    pattern over layers has its layers' own, so they are asked of the scheme as built."""
    from posbench.schemes import build_scheme
    from posbench.schemes.training_free import VARIANTS as TRAINING_FREE  # every scheme's, not the parent's own

    scheme = build_scheme(rc.model)
    return [v for v in scheme.eval_variants if v not in TRAINING_FREE and not scheme.refuses(v)]


def _with(rc: ExperimentConfig, overrides, folder: Path, model=None, train=None, eval=None, options=None, last=None):
    """rc with sections changed, in a new experiment folder, with the user's --set overrides,
    then the keys of `last` (what a method derives from the overridden values);
    its measure decides how it is scored, as for any config (posbench/resolve.py), and an error
    names the --set it came from. What it trains is the parent's, resolved when it was trained."""
    from posbench.config import blame
    from posbench.tasks import task_for

    raw = rc.to_dict()
    raw.update(name=folder.name, out_dir=str(folder.parent))
    for section, changes in (("model", model), ("train", train), ("eval", eval)):
        for key, value in (changes or {}).items():
            assign(raw, f"{section}.{key}", value)
    if options is not None:
        raw["model"]["options"] = options
        raw["scheme_options"] = {rc.model.scheme: dict(options)} if options else {}
    origins: dict = {}
    for o in overrides:
        apply_override(raw, o, origins)
    for key, value in (last or {}).items():
        assign(raw, key, value)
    cfg = config_from_dict(raw, source="extend")
    cfg.origins = origins
    try:
        task_for(cfg).measure().decide(cfg, None)
    except PosbenchError as e:
        raise blame(origins, e) from None
    return cfg


def child_config(
    prc: ExperimentConfig,
    method: Method,
    to: int,
    steps: int,
    lr: Optional[float],
    lengths: list[int],
    parent: str,
    abf_base: float,
    folder: Path,
    overrides=(),
) -> ExperimentConfig:
    """The parent's config as the child trains it: at L2 (PoSE, continue: at L, on a batch s
    times the parent's, so that it trains on the same tokens), K steps from lr (default: the
    parent's final lr, min_lr) with a warmup of K/20 and a cosine decay to lr/10, scored at
    `lengths` as it is (no evaluation-time variant on top of its own scaling)."""
    from posbench.schemes import SCHEMES

    L = prc.model.train_len
    ext = {"method": method.name, "parent": parent, "from_len": L, "to_len": to}
    if method.scaling:
        ext.update(scaling=method.scaling, factor=method.factor or to / L)
    if method.value("keep"):
        ext["keep_fast"] = method.value("keep")
    for key in ("fast", "slow"):
        if method.value(key) is not None:
            ext[f"beta_{key}"] = method.value(key)
    options = dict(prc.model.options)
    if method.base == "abf":
        options["base"] = method.value("base", abf_base)
    options = SCHEMES.lookup(prc.model.scheme).options_at(options, to)
    lr = prc.train.min_lr if lr is None else lr
    train = {"steps": steps, "lr": lr, "min_lr": float(f"{lr / 10:.6g}"), "warmup_steps": max(1, round(steps / 20))}
    model = {"train_len": L if method.at_parent_len else to, "extend": ext}
    last = {}
    if method.at_parent_len:  # the batch as overridden, s times: K x batch x L2 tokens, as at L2
        raw = prc.to_dict()
        for o in overrides:
            apply_override(raw, o, {})
        last["train.batch_size"] = max(1, round(raw["train"]["batch_size"] * to / L))
    return _with(
        prc,
        overrides,
        folder,
        model,
        train,
        {"lengths": lengths, "perplexity.rope_scaling": [], "perplexity.rope_factor": None},
        options,
        last,
    )


def start_weights(rc: ExperimentConfig, parent: Path) -> dict:
    """The parent's weights, as the child's model holds them: a learned table interpolated to
    L2 or grown past its max_len (its new rows from the child's own initialization)."""
    import torch

    from posbench.experiment.checkpoint import load_run
    from posbench.model import TransformerLM

    _, pmodel = load_run(parent)
    state = pmodel.state_dict()
    torch.manual_seed(rc.seeds[0])
    fresh = TransformerLM(rc.model).state_dict()  # the rows a grown table adds
    ext = rc.model.extend
    key = "scheme.table"
    if key in state and key in fresh:
        old, new = state[key], fresh[key].clone()  # (parent max_len, C), (child max_len, C)
        if ext["method"] == "interpolate":
            L, L2 = ext["from_len"], ext["to_len"]
            new[:L2] = interpolate_rows(old[:L], L2)
            new[L2:] = old[L2 : len(new)] if len(old) > L2 else new[L2:]
        else:
            n = min(len(old), len(new))
            new[:n] = old[:n]
        state[key] = new
    return state


def interpolate_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """(L, C) -> (n, C): row j is rows at x = j / s, s = n / L, PI's map of position j, linearly
    between its two neighbours; past the last trained row (x > L - 1) it is that row."""
    import torch

    L = rows.size(0)
    x = torch.arange(n, dtype=torch.float64) * L / n  # (n,) = j / s
    lo = x.floor().long().clamp(max=L - 1)  # (n,)
    hi = (lo + 1).clamp(max=L - 1)
    w = (x - lo).clamp(max=1).to(rows.dtype)[:, None]  # (n, 1); 0 past the last row, where lo = hi
    return rows[lo] * (1 - w) + rows[hi] * w  # (n, C)


def pose_positions(B: int, T: int, to_len: int, gen: torch.Generator) -> torch.Tensor:
    """PoSE's position ids for B windows of T tokens, each row drawn on its own as the reference
    draws each sample (dwzhu-pku/PoSE, train_pose.py, `train_preprocess_function_pose`): a first
    chunk 0..r1-1, r1 drawn from 1..(T+1)//2, then the rest shifted by a skip u drawn from
    0..to_len-T, so the last id is at most to_len-1. Drawn from the data generator, so a resumed
    run draws the same ones."""
    import torch

    r1 = torch.randint(1, (T + 1) // 2 + 1, (B, 1), generator=gen)  # (B, 1)
    u = torch.randint(0, to_len - T + 1, (B, 1), generator=gen)  # (B, 1)
    j = torch.arange(T)[None, :]  # (1, T)
    return j + u * (j >= r1)  # (B, T)


class PoSEBatches:
    """A run's batches with PoSE's position ids: (x, y, pos). The text stays contiguous; the
    reference also takes its second chunk from further on in the document."""

    def __init__(self, inner, to_len: int):
        self.inner, self.to_len = inner, to_len

    def __call__(self, gen):
        x, y = self.inner(gen)
        return x, y, pose_positions(x.size(0), x.size(1), self.to_len, gen)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state) -> None:
        self.inner.set_state(state)


class Curve:
    """The probe train_model calls after every step: at the planned steps it scores the
    model at L2 on the run's own validation tokens and writes curve.csv. A resumed run drops the
    rows from its resume step on and scores them again."""

    def __init__(self, rc: ExperimentConfig, corpus, folder: Path, steps: list[int]):
        from posbench.device import pick_device
        from posbench.evaluate import eval_tokens

        self.rc, self.path, self.steps = rc, folder / CURVE, set(steps)
        self.tokens = eval_tokens(corpus, rc, rc.eval.lengths)
        self.device = pick_device(rc.train.device)
        self.first = True

    def __call__(self, step: int, model, resumed_at: int) -> None:
        from posbench.evaluate import evaluate_model
        from posbench.files import write_rows

        rows = read_curve(self.path.parent) if self.first and resumed_at else []
        if self.first:
            write_rows(self.path, [r for r in rows if int(r["step"]) < step], CURVE_COLUMNS)
            self.first = False
        if step not in self.steps:
            return
        L2 = self.rc.model.extend["to_len"]
        (row,), _ = evaluate_model(model, self.tokens, [L2], self.rc.eval.batch_size, self.device)
        label = child_label(self.rc.model.scheme, self.rc.model.extend["method"])
        new = {"scheme": label, "seed": self.rc.seeds[0], "step": step, "length": L2}
        new.update({k: row[k] for k in ("loss", "ppl", "tokens")})
        write_rows(self.path, [*read_curve(self.path.parent), new], CURVE_COLUMNS)


def fine_tuning(job, data, folder: Path):
    """What train_model needs beyond a fresh run's for a child: (init, batches, probe)."""
    rc = job.cfg
    batches = job.task.batches(rc, data)
    if base_method(rc.model.extend["method"]) == "pose":
        batches = PoSEBatches(batches, rc.model.extend["to_len"])
    write_atomic(folder / PARENT, parent_path(job) + "\n")
    init = start_weights(rc, job.parent)
    return init, batches, Curve(rc, data, folder, job.curve or default_curve(rc.train.steps))


def copy_parent(job) -> None:
    """A parent's copy in the extension's folder: its weights, log and config (scored here at the
    extension's lengths and with its evaluation-time variants); the parent is only read."""
    from posbench.experiment.records import CONFIG, WEIGHTS, partial_dir

    partial = partial_dir(job.folder)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:  # a full disk leaves no half copy behind
        with room_in(job.folder.parent):
            shutil.copy2(job.parent / WEIGHTS, partial / WEIGHTS)
            if (job.parent / "train_log.jsonl").is_file():
                shutil.copy2(job.parent / "train_log.jsonl", partial / "train_log.jsonl")
            write_atomic(partial / CONFIG, dump_yaml(job.cfg))
            write_atomic(partial / PARENT, parent_path(job) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if job.folder.exists():
        shutil.rmtree(job.folder)
    partial.rename(job.folder)


def _check_same_extension(folder: Path, to: int, steps: int) -> None:
    """A folder's extend.yaml says one length and one budget for all its children: a rerun into
    it with others would make the record false for the children already there."""
    old = _recorded(folder)
    if old is None:
        return  # none yet, or unreadable: write_record writes it anew
    held = {"--to": old.get("to"), "--steps": old.get("steps")}
    given = {"--to": to, "--steps": steps}
    differ = [flag for flag in held if held[flag] is not None and held[flag] != given[flag]]
    if differ:
        was = " ".join(f"{flag} {held[flag]}" for flag in held)
        raise PosbenchError(
            f"--out {folder}: its extensions were made with {was} ({EXTEND_RECORD}), this one with "
            f"{' '.join(f'{flag} {given[flag]}' for flag in differ)}; rerun with {was}, or give another --out"
        )


def _recorded(folder: Path) -> Optional[dict]:
    """The folder's extend.yaml as written (None where there is none, or it cannot be read)."""
    import yaml

    try:
        old = yaml.safe_load((folder / EXTEND_RECORD).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return old if isinstance(old, dict) else None


def parent_path(job) -> str:
    """The parent's folder as seen from the extension's folder, so the two can move together."""
    return os.path.relpath(Path(job.parent).resolve(), job.folder.parent.resolve())


def write_record(plan: Plan) -> None:
    """extend.yaml: a rerun with fewer methods or parents keeps those the folder already holds."""
    import yaml

    path, record, old = plan.folder / EXTEND_RECORD, dict(plan.record), _recorded(plan.folder)
    if old is not None:
        for key in ("parents", "methods", "lengths"):
            if isinstance(old.get(key), list):
                record[key] = list(dict.fromkeys([*old[key], *record[key]]))
        record["lengths"] = sorted(record["lengths"])
        if isinstance(old.get("tokens"), dict):
            record["tokens"] = {**old["tokens"], **record["tokens"]}
    plan.folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(record, sort_keys=False))


# --- the report ----------------------------------------------------------------------------------
