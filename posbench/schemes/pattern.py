"""Per-layer patterns: a scheme made of schemes, one per layer, each with an optional attention window.

A pattern lists a period of layers, each a scheme (with its own options) and an optional
window W: a window layer's query attends only to the last W keys, itself included (or a chunk C:
only to the keys of its own block of C, as Llama 4's chunked attention). The period
repeats over model.n_layer (layer i is the period's i mod its length). The presets name the
stacks of recent models; `pattern_<label>` is the user's own, its period given as
scheme_options.pattern_<label>.layers:

    schemes: [rope, nope, rnope_swa, pattern_rope3_nope]
    scheme_options:
      pattern_rope3_nope:
        layers: [{scheme: rope, window: 32}, {scheme: rope, window: 32}, {scheme: rope, window: 32}, nope]

A pattern is one scheme to the model: the model hands every hook its layer index, and the pattern
answers with that layer's scheme; a window (or chunk) is an additive -inf bias on that layer's logits. Layers
that name the same scheme with the same options share one instance, as the layers of a plain run
share its scheme (one T5 table, RoPE's angles computed once a forward pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from posbench.errors import PosbenchError
from posbench.registry import check_options
from posbench.schemes.base import PositionalScheme
from posbench.schemes.rope import RoPE
from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

LAYER_KEYS = ("scheme", "window", "chunk", "options")
EXAMPLE = "[{scheme: rope, window: 32}, {scheme: rope, window: 32}, {scheme: rope, window: 32}, nope]"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of a pattern: its scheme (a name or module:Class), its attention window or
    chunk (None: every earlier key) and that scheme's options."""

    scheme: str
    window: Optional[int] = None  # a query sees its last `window` keys, itself included
    options: tuple = ()  # (key, value) pairs: a Layer is frozen, and compared by them
    chunk: Optional[int] = None  # a query sees the keys of its own block of `chunk` (keys 0..C-1, C..2C-1, ...)

    @property
    def local(self) -> bool:
        """Whether a query sees fewer than all earlier keys (a window or a chunk)."""
        return self.window is not None or self.chunk is not None

    @property
    def opt(self) -> dict:
        return dict(self.options)

    @property
    def shares(self) -> tuple:
        """What layers must agree on to share one instance of their scheme: its name, its
        options (by repr: an option's value may be a list) and whether it attends to every key
        (a window or chunk layer keeps its trained frequencies, so it is built without `extend`)."""
        return self.scheme, repr(self.options), not self.local

    def label(self) -> str:
        """rope, rope@32 (a window), rope@c32 (a chunk), or rope@32(base=1e+06): the scheme, its
        window or chunk, the options given."""
        given = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.options)
        reach = f"@{self.window}" if self.window else f"@c{self.chunk}" if self.chunk else ""
        return self.scheme + reach + (f"({given})" if given else "")


def layer(scheme: str, window: Optional[int] = None, chunk: Optional[int] = None, **options) -> Layer:
    return Layer(scheme, window, tuple(options.items()), chunk)


def parse_layers(value, where: str) -> list[Layer]:
    """A period as written in a config: a non-empty list whose entries are a scheme's name or
    a mapping {scheme, window or chunk, options}; each mistake is one line naming the entry."""
    if not isinstance(value, list) or not value:
        raise PosbenchError(f"{where}: expected a non-empty list of layers, e.g. {EXAMPLE}; got {value!r}")
    layers = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if isinstance(entry, str):
            entry = {"scheme": entry}
        if not isinstance(entry, dict):
            raise PosbenchError(
                f"{at}: expected a scheme's name or a mapping of {', '.join(LAYER_KEYS)}; got {entry!r}"
            )
        unknown = [k for k in entry if k not in LAYER_KEYS]
        if unknown:
            raise PosbenchError(f"{at}.{unknown[0]}: unknown key; a layer takes {', '.join(LAYER_KEYS)}")
        scheme, options = entry.get("scheme"), entry.get("options") or {}
        if not isinstance(scheme, str) or not scheme:
            raise PosbenchError(f"{at}: needs scheme: a scheme's name or module:Class, e.g. rope; got {scheme!r}")
        for key in ("window", "chunk"):
            n = entry.get(key)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
                raise PosbenchError(f"{at}.{key}={n!r}: expected a positive number of keys, or null (all of them)")
        if entry.get("window") is not None and entry.get("chunk") is not None:
            raise PosbenchError(f"{at}: a layer attends within a window or within chunks, not both")
        if not isinstance(options, dict):
            raise PosbenchError(f"{at}.options: expected a mapping of {scheme}'s options, got {options!r}")
        layers.append(Layer(scheme, entry.get("window"), tuple(options.items()), entry.get("chunk")))
    return layers


def preset_window(opt: dict, train_len: int, where: str) -> int:
    """A preset's window option: a positive number of keys; null, a quarter of the training length."""
    w = opt["window"]
    if w is None:
        return max(1, train_len // 4)
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise PosbenchError(f"{where}.window={w!r}: expected a positive number of keys, or null (train_len / 4)")
    return w


class Pattern(PositionalScheme):
    """A scheme per layer. `layers_of` gives the period; every hook answers with the scheme of
    the layer it is called for, and a window layer's bias also masks every key W or more back (a
    chunk layer's, every key outside the query's own chunk).

    A layer's scheme acts in attention only (rotate, bias, attend): a scheme that adds to the
    token embeddings (sinusoidal, learned, hybrid) or chooses its own positions (noisy_,
    offset_, randomized) acts on the whole model, not on one layer, and is refused.

    Evaluation-time variants (RoPE's scalings) apply to the layers with full attention whose
    scheme declares them. A window layer never meets a distance of W or more (a chunk layer, of
    C or more), so, as Gemma 3 scales only its global layers, it keeps its trained frequencies.
    The training-free variants (posbench/schemes/training_free.py) remap every layer's attention,
    a window's or chunk's hidden keys staying hidden, unless a layer's scheme cannot take other
    positions (`fixed_distances`).
    """

    description = "your own pattern of schemes over layers, windows optional: scheme_options.pattern_<label>.layers"
    options = {"layers": None}  # the period, e.g. [{scheme: rope, window: 32}, nope]; see parse_layers
    eval_variants = RoPE.eval_variants  # those its RoPE layers may take; an instance has its layers' own
    variants_by_options = True
    registry = None  # the scheme registry, which builds each layer's scheme (set by the registry)

    @classmethod
    def refuses(cls, variant: str) -> Optional[str]:
        return RoPE.refuses(variant)

    @classmethod
    def layers_of(cls, opt: dict, train_len: int, where: str) -> list[Layer]:
        """The period for these options (the class's defaults filled in)."""
        if opt["layers"] is None:
            raise PosbenchError(f"{where}.layers: a pattern needs its layers, e.g. layers: {EXAMPLE}")
        return parse_layers(opt["layers"], f"{where}.layers")

    @classmethod
    def kernels_for(cls, given: dict, train_len: int) -> tuple:
        period = cls.layers_of({**cls.options, **given}, train_len, "scheme_options")
        # a window or chunk layer attends through its mask and bias, never its scheme's own kernel
        own = {k for x in period if not x.local for k in cls.registry.lookup(x.scheme).kernels_for(x.opt, train_len)}
        return tuple(sorted(own))

    @classmethod
    def layers_needed(cls, given: dict, train_len: int = 16) -> int:
        """The fewest layers that hold a whole period."""
        return len(cls.layers_of({**cls.options, **given}, train_len, "scheme_options"))

    def __init__(self, cfg):
        super().__init__(cfg)
        where = f"scheme_options.{cfg.scheme}"
        period = self.layers_of(self.opt, cfg.train_len, where)
        if cfg.n_layer < len(period):
            knob = f" or lower scheme_options.{cfg.scheme}.every" if "every" in self.options else ""
            raise PosbenchError(
                f"{cfg.scheme} repeats a period of {len(period)} layers ({', '.join(x.label() for x in period)}); "
                f"model.n_layer={cfg.n_layer} does not hold one: raise model.n_layer to {len(period)}{knob}"
            )
        self.period = period
        self.layers = [period[i % len(period)] for i in range(cfg.n_layer)]
        # layers that share a scheme are its model: it is built for as many layers as they are, and
        # a hook is asked for a layer by its rank among them (FIRE's MLP, CoPE's table, XL's W_r
        # per layer are then one for each layer that uses it, none unused)
        ranks: dict = {}  # Layer.shares -> the model's layers that share its instance
        for i, x in enumerate(self.layers):
            ranks.setdefault(x.shares, []).append(i)
        built: dict = {}  # Layer.shares -> its instance
        for i, spec in enumerate(period):
            if spec.shares not in built:
                at = f"{where}.layers[{i}]" if "layers" in self.options else cfg.scheme
                built[spec.shares] = self._build(spec, dataclasses.replace(cfg, n_layer=len(ranks[spec.shares])), at)
        self.schemes = nn.ModuleList(built.values())  # registered: their parameters train and are saved
        self.at = [built[x.shares] for x in self.layers]  # layer -> its scheme
        self.rank = [ranks[x.shares].index(i) for i, x in enumerate(self.layers)]  # layer -> the layer its scheme sees
        self.windows = [x.window for x in self.layers]  # layer -> its window, None for none
        self.chunks = [x.chunk for x in self.layers]  # layer -> its chunk, None for none
        full = [s for s, x in zip(self.at, self.layers) if not x.local]
        self.eval_variants = {v: d for s in full for v, d in s.eval_variants.items() if v not in TRAINING_FREE}
        self.eval_variants.update({v: d for v, d in TRAINING_FREE.items() if not self.fixed(v)})

    def _build(self, spec: Layer, cfg, at: str) -> PositionalScheme:
        if type(self).registry is None:
            raise PosbenchError(f"{cfg.scheme}: build it by name (posbench.schemes.SCHEMES), which finds its layers")
        try:
            cls = type(self).registry.lookup(spec.scheme)
        except PosbenchError as e:
            raise PosbenchError(f"{at}: {e}") from None
        if issubclass(cls, Pattern):
            raise PosbenchError(f"{at}: {spec.scheme} is itself a pattern; a pattern's layers are schemes")
        if cls.replaces_softmax:
            raise PosbenchError(
                f"{at}: {spec.scheme} replaces softmax with attention of its own, which a pattern's "
                f"layers cannot: they share the backend's softmax"
            )
        if spec.local and cls.counts_keys:
            raise PosbenchError(
                f"{at}: {spec.scheme} scales a query's logits by the log of the i + 1 keys a full layer "
                f"shows it, and a window or chunk shows it fewer; give it a layer without window or chunk"
            )
        for hook, what in (("positions", "chooses its own positions"), ("embed", "adds to the token embeddings")):
            if getattr(cls, hook) is not getattr(PositionalScheme, hook):
                raise PosbenchError(
                    f"{at}: {spec.scheme} {what}, which acts on the whole model, not on one layer; "
                    f"a pattern's layers act in attention (rotate, bias)"
                )
        check_options(cls.options, spec.opt, f"{at}.options" if "layers" in self.options else at)
        # a window or chunk layer keeps its trained frequencies, even in a run `posbench extend` fine-tuned
        extend = None if spec.local else cfg.extend
        sub = dataclasses.replace(cfg, scheme=spec.scheme, options=spec.opt, extend=extend)
        try:
            return type(self).registry.build(spec.scheme, sub)
        except PosbenchError as e:
            raise PosbenchError(f"{at}: {e}") from None

    def fixed(self, variant: str) -> dict[str, str]:
        """The layers' schemes that cannot take training-free variant `variant`, each with its
        reason (a scheme without a position hook, nope, is left as it is)."""
        base = PositionalScheme
        hooked = [s for s in self.schemes if type(s).rotate is not base.rotate or type(s).bias is not base.bias]
        return {s.cfg.scheme: why for s in hooked if (why := type(s).refuses(variant))}

    def describe(self) -> list[str]:
        """One line a layer: its index, its scheme and the options given or off their defaults, its attention."""
        lines = []
        for i, (spec, s) in enumerate(zip(self.layers, self.at)):
            shown = {k: v for k, v in s.opt.items() if k in spec.opt or v != s.options.get(k)}
            given = ", ".join(f"{k}={v!r}" for k, v in shown.items())
            reach = (
                f"a window of {spec.window} keys"
                if spec.window
                else f"chunks of {spec.chunk} keys"
                if spec.chunk
                else "full attention"
            )
            lines.append(f"layer {i}: {spec.scheme}" + (f" ({given})" if given else "") + f", {reach}")
        return lines

    @property
    def max_len(self) -> Optional[int]:
        limits = [s.max_len for s in self.schemes if s.max_len is not None]
        return min(limits) if limits else None

    def observe(self, x, pos, layer):
        self.at[layer].observe(x, pos, self.rank[layer])

    def rotate(self, q, k, pos, layer):
        return self.at[layer].rotate(q, k, pos, self.rank[layer])

    def bias(self, q, k, qpos, kpos, layer):
        b = self.at[layer].bias(q, k, qpos, kpos, self.rank[layer])  # None or (B or 1, H, Tq, Tk)
        W, C = self.windows[layer], self.chunks[layer]
        if W is None and C is None:
            return b  # None keeps SDPA's is_causal path, as NoPE's
        masks = self.once_per_forward((qpos, kpos), dict)  # (W, C, dtype) -> its mask, for every layer of a pass
        if (W, C, q.dtype) not in masks:
            Tq, Tk = qpos.numel(), kpos.numel()
            made = window_mask(Tq, Tk, W, q.device, q.dtype) if W else chunk_mask(Tq, Tk, C, q.device, q.dtype)
            masks[(W, C, q.dtype)] = made  # (Tq, Tk)
        outside = masks[(W, C, q.dtype)].expand(1, q.size(1), qpos.numel(), kpos.numel())  # (1, H, Tq, Tk)
        return outside if b is None else b + outside

    def attend(self, q, k, v, qpos, kpos, layer):
        if self.layers[layer].local:
            return None  # a scheme's own kernel knows no window: the backend adds it with the bias
        return self.at[layer].attend(q, k, v, qpos, kpos, self.rank[layer])

    @contextlib.contextmanager
    def eval_variant(self, name: Optional[str], train_len: int, length: int, factor=None):
        """Each full-attention layer whose scheme declares `name` evaluates as it; the rest as trained."""
        if name is not None and name not in self.eval_variants:
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}' has no evaluation-time variant '{name}': {self.lacks(name)}"
            )
        if name in TRAINING_FREE:  # the whole pattern attends through the remap, every layer's hooks in it
            with PositionalScheme.eval_variant(self, name, train_len, length, factor):
                yield
            return
        with contextlib.ExitStack() as stack:
            if name is not None:
                for s in dict.fromkeys(s for s, x in zip(self.at, self.layers) if not x.local):
                    if name in s.eval_variants:
                        stack.enter_context(s.eval_variant(name, train_len, length, factor))
            yield

    def lacks(self, name: str) -> str:
        """Why no layer takes variant `name`, in words."""
        if name in TRAINING_FREE:
            return "; ".join(f"its {scheme} layers cannot: {why}" for scheme, why in self.fixed(name).items())
        local = [x for x, s in zip(self.layers, self.at) if x.local and name in s.eval_variants]
        none = sorted({x.scheme for x, s in zip(self.layers, self.at) if name not in s.eval_variants})
        parts = []
        if local:
            reach = " or ".join(
                w for w, has in (("a window", "window"), ("chunks", "chunk")) if any(getattr(x, has) for x in local)
            )
            schemes = ", ".join(sorted({x.scheme for x in local}))
            parts.append(f"its {schemes} layers attend within {reach} and keep their trained frequencies")
        if none:
            parts.append(f"its {', '.join(none)} layers have no such variant")
        return "; ".join(parts)


def window_mask(Tq: int, Tk: int, W: int, device, dtype) -> torch.Tensor:
    """(Tq, Tk): -inf where key j is W or more keys before query i, else 0. The queries are the
    last Tq of the Tk keys (the model's blocks of queries), and the window counts keys, not
    position values, as causality does."""
    qi = torch.arange(Tk - Tq, Tk, device=device)  # (Tq,) each query's index
    far = qi[:, None] - torch.arange(Tk, device=device)[None, :] >= W  # (Tq, Tk)
    return torch.zeros(Tq, Tk, device=device, dtype=dtype).masked_fill_(far, float("-inf"))


def chunk_mask(Tq: int, Tk: int, C: int, device, dtype) -> torch.Tensor:
    """(Tq, Tk): -inf where key j lies in another chunk of C keys than query i (chunks 0..C-1,
    C..2C-1, ... by index), else 0; the queries are the last Tq of the Tk keys."""
    qi = torch.arange(Tk - Tq, Tk, device=device)  # (Tq,) each query's index
    other = (qi[:, None] // C) != (torch.arange(Tk, device=device)[None, :] // C)  # (Tq, Tk)
    return torch.zeros(Tq, Tk, device=device, dtype=dtype).masked_fill_(other, float("-inf"))


class RNoPESWA(Pattern):
    """RNoPE-SWA (Yang et al. 2025, "Rope to Nope and Back Again", Cohere): RoPE with a sliding
    window in every layer but each `every`-th, which is NoPE with full attention."""

    description = "RoPE with a sliding window in 3 of 4 layers, NoPE with full attention in the 4th (Yang 2025)"
    options = {"window": None, "every": 4, "base": 10000.0}  # window null: train_len / 4
    eval_variants = {}  # its RoPE layers all attend within a window, which no scaling applies to

    @classmethod
    def refuses(cls, variant: str) -> Optional[str]:
        return None

    @classmethod
    def layers_of(cls, opt, train_len, where):
        w = preset_window(opt, train_len, where)
        return [layer("rope", w, base=opt["base"])] * (_every(opt, where) - 1) + [layer("nope")]


class IRoPE(Pattern):
    """iRoPE: NoPE in every `every`-th layer, RoPE elsewhere. By default every layer attends to
    every earlier key, as SmolLM3's; `chunk` confines the RoPE layers to chunks of that many
    keys, as Llama 4 does (8,192 there). Llama 4's scaling of the NoPE layers' logits with the
    length (attn_temperature_tuning) is not here."""

    description = "NoPE in every 4th layer, RoPE elsewhere (SmolLM3; with chunk, Llama 4's iRoPE)"
    options = {"every": 4, "base": 10000.0, "chunk": None}  # chunk null: full attention, as SmolLM3

    @classmethod
    def layers_of(cls, opt, train_len, where):
        C = opt["chunk"]
        if C is not None and (isinstance(C, bool) or not isinstance(C, int) or C <= 0):
            raise PosbenchError(f"{where}.chunk={C!r}: expected a positive number of keys, or null (full attention)")
        return [layer("rope", chunk=C, base=opt["base"])] * (_every(opt, where) - 1) + [layer("nope")]


class Gemma3(Pattern):
    """Gemma 3's stack (Gemma Team 2025): `every` - 1 local layers, RoPE base 10k within a
    sliding window, then one global layer, RoPE base 1M with full attention (5:1). RoPE's
    scalings apply to the global layers only, as Gemma 3 scales them for its long context."""

    description = "5 local layers (RoPE base 10k, sliding window), then 1 global (RoPE base 1M) (Gemma 3)"
    options = {"window": None, "every": 6, "local_base": 10000.0, "global_base": 1000000.0}

    @classmethod
    def layers_of(cls, opt, train_len, where):
        w = preset_window(opt, train_len, where)
        local = layer("rope", w, base=opt["local_base"])
        return [local] * (_every(opt, where) - 1) + [layer("rope", base=opt["global_base"])]


def _every(opt: dict, where: str) -> int:
    if opt["every"] < 2:
        raise PosbenchError(f"{where}.every={opt['every']}: a period needs at least 2 layers")
    return opt["every"]


PRESETS = {"rnope_swa": RNoPESWA, "irope": IRoPE, "gemma3": Gemma3}
PREFIX = "pattern_"  # pattern_<label>: the user's own, its layers in scheme_options.pattern_<label>.layers


def pattern(name: str, registry) -> Optional[type]:
    """The class a preset's name or pattern_<label> names (None: some other name)."""
    if name in PRESETS:
        cls = PRESETS[name]
    elif name.startswith(PREFIX) and len(name) > len(PREFIX) and ":" not in name:
        cls = _MINE.setdefault(name, type(f"Pattern_{name[len(PREFIX) :]}", (Pattern,), {}))
    else:
        return None
    cls.registry = registry
    return cls


_MINE: dict[str, type] = {}  # pattern_<label> -> its class, made once


class LayerOf(PositionalScheme):
    """Layer `i` of a pattern as a scheme of its own, its hooks answering for that layer
    whatever layer they are asked for: what `posbench inspect` draws, a layer at a time."""

    def __init__(self, pattern: Pattern, i: int):
        nn.Module.__init__(self)
        self.cfg, self.i, self.spec = pattern.cfg, i, pattern.layers[i]
        self.inner = pattern.at[i]  # registered: its parameters are drawn
        self.opt, self.whole = self.inner.opt, [pattern]  # a list: the pattern is not a submodule

    @property
    def max_len(self):
        return self.inner.max_len

    def observe(self, x, pos, layer):
        self.whole[0].observe(x, pos, self.i)

    def rotate(self, q, k, pos, layer):
        return self.whole[0].rotate(q, k, pos, self.i)

    def bias(self, q, k, qpos, kpos, layer):
        return self.whole[0].bias(q, k, qpos, kpos, self.i)


def layer_views(pattern: Pattern) -> list[LayerOf]:
    """One view for the first layer of each distinct layer of the period."""
    firsts = {}
    for i, spec in enumerate(pattern.layers):
        firsts.setdefault((spec.shares, spec.window, spec.chunk), i)
    return [LayerOf(pattern, i) for i in firsts.values()]
