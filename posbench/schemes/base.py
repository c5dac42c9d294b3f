"""The base every positional scheme subclasses: its hooks, its options and its evaluation-time variants."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn as nn

import posbench.schemes.training_free as training_free
from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.registry import check_options


class PositionalScheme(nn.Module):
    """Base of every scheme. Subclass it, override any of the three hooks, and register a name
    or load it as module:Class (docs/extending.md, "Write your own scheme").

    A scheme touches the model in exactly three places (the x-transformers taxonomy):
      embed(x, pos)                 add an absolute signal to the token embeddings
      rotate(q, k, pos, layer)      transform q and k in every layer (RoPE, Transformer-XL's u)
      bias(q, k, qpos, kpos, layer) an additive bias on the attention logits, after the 1/sqrt(d)
                                    scaling of q.k (ALiBi, T5); it may look at q (Transformer-XL)
                                    and at k (contextual schemes)
    A scheme whose bias reads the tokens themselves has one more hook:
      observe(x, pos, layer)        the layer's attention input x (B, T, C), from which q, k and v
                                    are made; the model calls it once per layer and forward,
                                    before rotate, so the scheme keeps what that layer's `bias`
                                    reads (FoX's forget gates). A no-op by default.
    A fourth hook is optional and only for speed:
      attend(q, k, v, qpos, kpos, layer)  the scheme's own fast kernel for the whole causal
                                          attention, softmax(q.k / sqrt(d) + bias, future masked) v.
                                          Only the `native` attention backend tries it
                                          (model.attention: auto | eager | sdpa | native | flex);
                                          eager, the plain reference formula, and sdpa and flex use
                                          `bias` only. None, the default, declines, and the backend
                                          then uses `bias`. `posbench check-scheme` verifies attend
                                          against bias.
    A fifth hook is optional and only for speed too:
      tiled_bias(qpos, kpos, layer, dtype)  its bias in a form posbench's Triton kernels compute
                                            inside their tiles (posbench/kernels): a table over
                                            distances, or FIRE's lines; None, the default, leaves
                                            them to read `bias` as a dense tensor. Only the
                                            `triton` backend asks.
    A scheme that is no bias on softmax but a formula of its own (stick-breaking) sets the class
    attribute `replaces_softmax`: every backend then calls its `attend`, which must answer, and
    never `bias`.
    The base class's hooks are no-ops, which is exactly NoPE. The model calls every hook every
    time and never asks which scheme it holds. `bias` is called on blocks of queries, so it must
    build its (Tq, Tk) bias from the positions it is given, never from a cached (T, T) table.

    A scheme may also declare evaluation-time variants (`eval_variants`): a change applied to a
    trained checkpoint while it is evaluated, with no retraining, reported as rows named
    `<scheme>+<variant>`. RoPE's are the inference-time scalings of transformers'
    ROPE_INIT_FUNCTIONS. Every scheme also takes the training-free variants of
    posbench/schemes/training_free.py (self_extend, rerope, string, lm_infinite, logn), which
    hand its `rotate` and `bias` other positions, unless it refuses them: one that adds to the
    embeddings or chooses its own positions, one with no position hook (nope: only lm_infinite's
    mask and logn), or one that says why its hooks cannot take other positions
    (`fixed_distances`). `refuses` says in one line why a declared variant cannot apply (rope's
    longrope has no searched factors), before anything is trained or scored.
    """

    description = "no positional information at all; the causal mask alone leaks order"
    options: dict = {}  # option name -> default value; YAML `scheme_options.<name>` overrides
    kernels: tuple = ()  # posbench/native's C kernels of its own, beside attention's (built before workers start)
    # options a run's config leaves out while they are at their default, so that records which
    # do not name them keep their identity (and resume, and are found done)
    added_later: tuple = ()
    eval_variants: dict = dict(training_free.VARIANTS)  # name -> description; rows "<scheme>+<name>"
    variant: Optional[EvalVariant] = None  # the variant being evaluated, set by eval_variant()
    remap: Optional[training_free.Remap] = None  # the training-free variant being evaluated, set by eval_variant()
    fixed_distances: Optional[str] = None  # why its hooks cannot be handed other positions (None: they can)
    replaces_softmax: bool = False  # True: `attend` is the attention under every backend
    per_row_positions = False  # its hooks take (B, T) positions, each row its own (PoSE), not only (T,)
    prefix_consistent = True  # a byte's logits depend only on the bytes before it, in one pass or decoded alone
    counts_keys = False  # True: its logits scale with the keys a query sees, counted as i + 1 (a full layer's)
    variants_by_options = False  # True: an instance takes only some of eval_variants, as its options decide

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.validate_options(cfg.options, where=f"scheme_options.{cfg.scheme}")
        self.cfg = cfg
        self.opt = {**self.options, **cfg.options}

    @classmethod
    def validate_options(cls, given: dict, where: str) -> None:
        check_options(cls.options, given, where)

    def lacks(self, name: str) -> str:
        """Why this instance takes no variant `name` that its class declares (see variants_by_options)."""
        return f"its options leave no part of it that takes {name}"

    @classmethod
    def layers_needed(cls, given: dict, train_len: int = 16) -> int:
        """The fewest layers a model of it has (a pattern's: its whole period)."""
        return 1

    @classmethod
    def kernels_for(cls, given: dict, train_len: int) -> tuple:
        """Its own C kernels with these options (a pattern's are its layers')."""
        return cls.kernels

    @classmethod
    def options_at(cls, options: dict, length: int) -> dict:
        """Its options for a model fine-tuned to `length` (posbench extend): as they are."""
        return options

    def choice(self, key: str, valid) -> str:
        """The value of option `key`, refused in one line unless it is one of `valid`."""
        value = self.opt[key]
        if value not in valid:
            raise PosbenchError(f"scheme_options.{self.cfg.scheme}.{key}={value!r}: expected one of {', '.join(valid)}")
        return value

    @property
    def max_len(self) -> Optional[int]:
        """Longest sequence this scheme can encode; None means any length."""
        return None

    def once_per_forward(self, key: tuple, make):
        """`make()`, reused while the same position tensors come back. The model hands one
        `pos` object to every layer of a forward pass, so work shared by the layers (RoPE's
        angles, a bias shared by all layers) is done once per forward, never across two."""
        memo = getattr(self, "_memo", None)
        if memo is not None and len(memo[0]) == len(key) and all(a is b for a, b in zip(memo[0], key)):
            return memo[1]
        value = make()
        self._memo = (key, value)  # holding the key keeps its ids from being reused
        return value

    @contextlib.contextmanager
    def eval_variant(self, name: Optional[str], train_len: int, length: int, factor=None):
        """Within the block, the hooks evaluate as variant `name` of a model trained at
        `train_len`, scored at `length` (None: the scheme as trained). `factor` fixes the
        variant's scale; None lets the variant derive it from length / train_len."""
        if name is None:
            yield
            return
        if name not in self.eval_variants:
            have = ", ".join(self.eval_variants) or "none"
            raise PosbenchError(
                f"scheme '{self.cfg.scheme}' has no evaluation-time variant '{name}' (its variants: {have})"
            )
        why = self.refuses(name)
        if why:
            raise PosbenchError(f"{self.cfg.scheme}+{name}: {why}" if name in training_free.VARIANTS else why)
        if name in training_free.VARIANTS:  # the model attends through the remap (model.Attention)
            self.remap = training_free.remap(name, train_len, length, factor)
        else:
            self.variant = EvalVariant(name, train_len, length, factor)
        self._memo = None
        try:
            yield
        finally:
            self.variant, self.remap, self._memo = None, None, None

    @classmethod
    def refuses(cls, variant: str) -> Optional[str]:
        """Why this scheme cannot apply its declared variant `variant`, in one line (None: it can)."""
        if variant not in training_free.VARIANTS:
            return None
        what = cls.__name__
        if cls.replaces_softmax:
            return f"{variant} changes softmax attention's logits, and {what} has no softmax (its own attend)"
        if variant == "logn":  # a temperature suits any logits
            return None
        if cls.positions is not PositionalScheme.positions:
            return f"{variant} remaps the distances of positions 0..T-1, and {what} chooses its own positions"
        if cls.embed is not PositionalScheme.embed:
            return f"{variant} remaps distances in attention, and {what} adds absolute positions to the embeddings"
        if cls.fixed_distances:
            return f"{variant} hands the hooks other positions, and {what} cannot take them: {cls.fixed_distances}"
        if variant != "lm_infinite" and cls.rotate is PositionalScheme.rotate and cls.bias is PositionalScheme.bias:
            return f"{variant} remaps distances, and {what} has none in attention (lm_infinite's mask and logn apply)"
        return None

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(T, device=device)  # (T,)

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x  # (B, T, C)

    def observe(self, x: torch.Tensor, pos: torch.Tensor, layer: int) -> None:
        return None  # x: (B, T, C), the layer's attention input

    def rotate(self, q, k, pos, layer: int):
        return q, k  # (B, H, T, D) each

    def bias(self, q, k, qpos, kpos, layer: int) -> Optional[torch.Tensor]:
        return None  # or (B or 1, H, Tq, Tk), added to the scaled logits

    def attend(self, q, k, v, qpos, kpos, layer: int) -> Optional[torch.Tensor]:
        return None  # or (B, H, Tq, D): softmax(q.k / sqrt(d) + bias, future masked) v

    def tiled_bias(self, qpos, kpos, layer: int, dtype):
        return None  # or a DistanceTable or FIRE's Lines: `bias` in a kernel's terms


@dataclasses.dataclass(frozen=True)
class EvalVariant:
    name: str
    train_len: int  # L, the length the checkpoint was trained at
    length: int  # L', the evaluation length
    factor: Optional[float] = None  # a fixed scale; None = derived from L' / L


class NoPE(PositionalScheme):
    pass


def require_even(cfg: ModelConfig, what: str, value: int) -> None:
    """Sin/cos pairs and rotations take dimensions two at a time."""
    if value % 2:
        raise PosbenchError(
            f"scheme '{cfg.scheme}' pairs dimensions as sin/cos or rotations, so {what}={value} must be even"
        )
