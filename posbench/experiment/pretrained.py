"""`posbench pretrained`: a model posbench did not train, scored as a run of task lm.

Its experiment folder holds one run folder per model, named as the model, with config.yaml
(model.pretrained: the model's name, path, architecture, context and the sha256 of each file it
was read from; the shape is the model's own), eval.csv and positions.csv.gz, a row per length,
protocol and RoPE variant (`<model>+yarn@2`), measures/<name>.csv for each --measure, and
data.json (the corpus, by sha256). The tokenizer the corpus is cut with is the model's: its
tokenizer.json, or for a .gguf file the one transformers builds from it, kept as tokenizer.json
in the experiment folder. A rerun scores what the records lack (a --measure, anew) and refuses
other model files or data under the same name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from posbench.config import ExperimentConfig, blame, config_from_dict, differences, dump_yaml, read_record
from posbench.device import pick_device
from posbench.errors import PosbenchError
from posbench.experiment.records import CONFIG, check_read, lock_file, record_read, scoring
from posbench.files import exclusive, lock_holder, safe_name, write_atomic
from posbench.measures.base import ScoringRun
from posbench.measures.plugin import score_into
from posbench.progress import Reporter
from posbench.report import check_joins
from posbench.resolve import Experiment

TOKENIZER = "tokenizer.json"  # in the experiment folder: a .gguf model's tokenizer, as transformers reads it


def tokenizer_of(model, folder: Path) -> str:
    """The tokenizer file the corpus is cut with: the model folder's own tokenizer.json (or
    sentencepiece tokenizer.model), else the one transformers built, written into `folder`."""
    if model.path.is_dir():
        for name in (TOKENIZER, "tokenizer.model"):
            if (model.path / name).is_file():
                return str(model.path / name)
    backend = getattr(model.tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise PosbenchError(f"{model.path}: its tokenizer has no tokenizer.json form for posbench to cut text with")
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / TOKENIZER, backend.to_str() + "\n")
    return str(folder / TOKENIZER)


def check_prepared(data_path, tokenizer: str, model) -> None:
    """A folder `posbench prepare` wrote is read only if it was cut with the model's tokenizer
    (the copy it keeps has the same sha256)."""
    from posbench.pretrained import _sha256
    from posbench.text import is_prepared, read_prepared_meta

    if not is_prepared(data_path):
        return
    kept = read_prepared_meta(data_path).get("tokenizer_file")
    if not kept or _sha256(Path(data_path) / kept) != _sha256(Path(tokenizer)):
        raise PosbenchError(
            f"--data {data_path}: prepared with another tokenizer than {model.name}'s; prepare it with "
            f"--tokenizer {tokenizer}"
        )


def model_config(cfg: ExperimentConfig, model, tokenizer: str) -> ExperimentConfig:
    """`cfg` with what the model decides: its shape and context (model.train_len), its scheme's
    family (rope, or learned positions), its tokenizer (data.tokenizer) and model.pretrained."""
    c = model.config
    model_cfg = dataclasses.replace(
        cfg.model,
        scheme="rope" if model.rotary is not None else "learned",
        n_layer=int(c.num_hidden_layers),
        n_head=int(c.num_attention_heads),
        d_model=int(c.hidden_size),
        train_len=model.context,
        vocab_size=int(c.vocab_size),
        pretrained={
            "name": model.name,
            "path": str(model.path.resolve()),
            "architecture": c.model_type,
            "context": model.context,
            "rope": dict(c.rope_parameters) if model.rotary is not None else None,
            "files": model.digest(),
        },
    )
    head_dim = getattr(c, "head_dim", None)
    if head_dim and head_dim != c.hidden_size // c.num_attention_heads:  # Qwen3's, Gemma's: set apart
        model_cfg.pretrained["head_dim"] = int(head_dim)
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer)
    return dataclasses.replace(cfg, schemes=[model_cfg.scheme], seeds=[0], model=model_cfg, data=data)


PRETRAINED_OWN = ("schemes", "seeds", "scheme_options")  # top-level keys a pretrained model answers itself


def plan_pretrained(cfg: ExperimentConfig, model_path: Path, test_len: Optional[int]) -> tuple[Experiment, object]:
    """The model at `model_path` loaded, and the experiment that scores it as `cfg` asks: its
    shape, context, tokenizer and a batch that fits the longest length. A length that cannot
    fit, or a RoPE scaling the model lacks, is refused before anything is written."""
    from posbench.pretrained import approx_params, fitting_batch, load_pretrained, memory_of, read_model_config
    from posbench.tasks import task_for

    default = ExperimentConfig()
    text = default.task
    if cfg.task != text:  # a task's exact match needs a model trained on that task
        e = PosbenchError(f"task={cfg.task}: posbench pretrained scores a model on text (task {text})", "task")
        raise blame(cfg, e)
    kept = ("train.device", "train.threads")  # the rest of train.* and the model's shape are the model's own

    def changed(key: str) -> bool:  # a file's model: or train: section at the defaults is harmless
        section, field = key.split(".")[:2]
        return getattr(getattr(cfg, section), field) != getattr(getattr(default, section), field)

    unread = [
        k
        for k, where in cfg.origins.items()
        if k.startswith(("model.", "train.")) and k not in kept and (where.startswith("--") or changed(k))
    ]
    # nor its schemes, their options or seeds: the model is its own scheme, trained once
    unread += [k for k, where in cfg.origins.items() if where.startswith("--") and k.split(".")[0] in PRETRAINED_OWN]
    if unread:
        raise PosbenchError(
            f"{cfg.origins[unread[0]]}: posbench pretrained does not read {unread[0]} (the model's shape and "
            f"scheme are its own, and it trains nothing); drop it"
        )
    shape = read_model_config(model_path)  # before the weights: a length that cannot fit is refused first
    context = int(getattr(shape, "max_position_embeddings", 0) or getattr(shape, "n_positions", 0))
    longest = test_len or (max(cfg.eval.lengths) if "eval.lengths" in cfg.origins else 2 * context)
    batch = fitting_batch(shape, approx_params(shape), [longest], cfg.eval.batch_size, memory_of(cfg.train.device))
    model = load_pretrained(model_path)
    kinds, key = cfg.eval.perplexity.rope_scaling, "eval.perplexity.rope_scaling"
    where = cfg.origins.get(key, key)  # the flag, --set, or a file (then the key too)
    where = where if where.startswith("--") else f"{where}: {key}"
    if kinds and not model.eval_variants:
        raise PosbenchError(f"{where}: {model.name} ({model.config.model_type}) has no rotary embedding", key)
    wrong = [k for k in kinds if k not in model.eval_variants]
    if wrong:
        hint = "; transformers' NTK-aware scaling is dynamic" if wrong[0] == "ntk" else ""
        raise PosbenchError(
            f"{where}: {wrong[0]} is not a RoPE type transformers has; valid: {', '.join(model.eval_variants)}{hint}",
            key,
        )
    origins = cfg.origins
    tokenizer = tokenizer_of(model, Path(cfg.out_dir) / cfg.name)
    check_prepared(cfg.data.path, tokenizer, model)
    cfg = model_config(cfg, model, tokenizer)
    cfg.origins = origins
    if test_len is None and "eval.lengths" not in origins:
        cfg.eval.lengths = [model.context, 2 * model.context]
    cfg.eval.batch_size = batch
    task = task_for(cfg)
    own = task.measure()
    try:
        own.decide(cfg, test_len)
    except PosbenchError as e:
        raise blame(cfg, e) from None
    return Experiment(cfg, task, own), model


def check_same_model(rdir: Path, rc: ExperimentConfig) -> None:
    """Refuse to add rows to a run folder that holds another model's (other files, or another
    shape or context under the same name): its rows would not compare."""
    path = rdir / CONFIG
    if not path.is_file():
        return
    was = config_from_dict(read_record(path), source=str(path)).model.pretrained or {}
    now = rc.model.pretrained
    diff = differences(
        {"files": was.get("files"), "context": was.get("context")},
        {"files": now["files"], "context": now["context"]},
        names=(rdir.name, "here"),
    )
    if diff:
        raise PosbenchError(
            f"{rdir} holds the scores of other model files under the name {now['name']} ({diff[0]}); "
            "score this one with --name NEW"
        )


def run_pretrained(exp: Experiment, model, reporter: Reporter, measures: list = ()) -> tuple[Path, Path, list]:
    """Score the model as `exp` asks into its run folder (what the records lack), then by each
    of `measures` ((spec, Scorer): posbench pretrained --measure) into RUN/measures/, anew;
    returns the experiment folder, the run folder and each measure with its rows."""
    rc = exp.cfg
    folder = Path(rc.out_dir) / rc.name
    rdir = folder / safe_name(model.name)
    corpus = exp.task.source(rc, reporter)
    for note in exp.measure.notes(rc, corpus):
        reporter.note(note)
    vocab = corpus.byte_lengths.shape[0] if corpus.byte_lengths is not None else 256
    if vocab > rc.model.vocab_size:
        raise PosbenchError(
            f"{model.path}: its tokenizer has {vocab:,} tokens, more than the model's "
            f"{rc.model.vocab_size:,} embeddings"
        )
    digest = exp.task.fingerprint(corpus)
    check_same_model(rdir, rc)
    check_read(rdir, digest)
    check_joins(folder, rc, rdir)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_file(rdir), remove=True) as held:
        if not held:
            pid = lock_holder(lock_file(rdir))
            raise PosbenchError(f"{rdir}: another posbench process{f' (pid {pid})' if pid else ''} is scoring it")
        rdir.mkdir(exist_ok=True)
        # the record first: a run stopped while it is scored keeps the rows it has, reportable
        write_atomic(rdir / CONFIG, dump_yaml(rc))
        record_read(rdir, corpus.name, digest)
        device = pick_device(rc.train.device)
        with scoring(rdir):
            exp.measure.score(rc, rdir, model.to(device), corpus, device, model.backend(device), reporter)
        run = ScoringRun(rc, model.eval(), device, corpus)  # one run: the measures share its passes
        scored = [(measure, score_into(measure, spec, run, rdir)) for spec, measure in measures]
    return folder, rdir, scored
