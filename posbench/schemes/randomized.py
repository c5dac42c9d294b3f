"""Position modifiers of any scheme: sorted random positions (Ruoss et al.'s NOISY_), or a random start.

`randomized` feeds its `base` option's scheme; `noisy_<scheme>` and `offset_<scheme>` name a
modifier of one scheme directly (noisy_rope, noisy_alibi, offset_t5, ...), so a scheme and its
modified self train in one experiment as separate rows. The base scheme's hooks see the drawn
positions; a noisy_/offset_ scheme takes its base's options beside its own.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme


class Modifier(PositionalScheme):
    """What the position modifiers share: a base scheme (the `base` option, or the name after
    noisy_/offset_) built with the options that are not the modifier's, whose hooks see the
    positions the modifier chooses. No `attend`: a base's fast kernel may assume positions
    0..T-1, so every backend uses the base's `bias`."""

    own: tuple = ("base", "max_pos")  # the modifier's options; any others are the base's
    registry = None  # the scheme registry, which hands itself to the classes that ask (see build_base)
    fixed_base: Optional[str] = None  # set for noisy_<scheme> and offset_<scheme>

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.opt["max_pos"] < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}.max_pos={self.opt['max_pos']} is shorter than "
                f"model.train_len={cfg.train_len}"
            )
        self.inner = build_base(self, cfg)

    def embed(self, x, pos):
        return self.inner.embed(x, pos)

    def observe(self, x, pos, layer):
        self.inner.observe(x, pos, layer)

    def rotate(self, q, k, pos, layer):
        return self.inner.rotate(q, k, pos, layer)

    def bias(self, q, k, qpos, kpos, layer):
        return self.inner.bias(q, k, qpos, kpos, layer)


class Randomized(Modifier):
    """Randomized positional encodings (Ruoss et al. 2023): a sequence's positions are a sorted
    random subset of [0, max_pos) instead of 0..T-1, so the model meets every position up to
    max_pos >> train_len and only their order is reliable. The positions feed the `base`
    scheme, any registered one (noisy_<scheme> names it directly).

    Set up as the reference, google-deepmind/randomized_positional_encodings: its
    `models/transformer.py` applies the noisy encodings whether training or not, so it draws a
    fresh sorted subset for every batch at evaluation too (`experiments/range_evaluation.py`
    feeds each batch a new rng key; its issue #1: "we also randomize at test time"). While
    training, the draws come from torch's global generator, so they follow torch.manual_seed.

    Options:
      eval_positions  how positions are chosen at evaluation:
        "fresh" (default, the reference): a new sorted draw for every forward call (batch).
                The draws come from a generator this scheme owns, seeded by the length T and by
                k, the number of forward calls at that length since the scheme last entered
                train or eval mode (`train()`, `eval()`) or `restart_draws()`. So the k-th batch
                of length T gets the same positions every time: a checkpoint evaluated with
                the same config (lengths, tokens, batch size) gives the same table, and a length
                scores the same whichever other lengths are evaluated with it.
        "fixed": one sorted draw per length, seeded by the length alone, shared by every batch.
        "consecutive": 0..T-1, as the method is often described.
      base     the scheme the positions feed (default sinusoidal)
      max_pos  the range positions are drawn from
    Under "fresh" and "fixed", lengths past max_pos cannot be encoded (beyond-max-len).
    """

    description = "train and evaluate on sorted random positions from [0, max_pos) (Ruoss 2023)"
    options = {"base": "sinusoidal", "max_pos": 1024, "eval_positions": "fresh"}
    own = ("base", "max_pos", "eval_positions")
    registry = None

    def __init__(self, cfg):
        super().__init__(cfg)
        self.choice("eval_positions", ("fresh", "fixed", "consecutive"))
        self.gen = torch.Generator()  # the evaluation draws; reseeded for every one
        self.draws: dict[int, int] = {}  # length -> forward calls drawn at it so far

    @property
    def max_len(self):
        if self.opt["eval_positions"] == "consecutive":
            return self.inner.max_len  # 0..T-1: as far as the base encodes
        return self.opt["max_pos"]

    @property
    def prefix_consistent(self) -> bool:
        """A prefix run alone draws other positions than it gets inside the whole sequence, but
        where evaluation takes 0..T-1."""
        return self.opt["eval_positions"] == "consecutive"

    def train(self, mode: bool = True):
        self.restart_draws()
        return super().train(mode)

    def restart_draws(self) -> None:
        """The next evaluation draw at each length is its first again."""
        self.draws = {}

    def positions(self, T, device):
        M, kind = self.opt["max_pos"], self.opt["eval_positions"]
        if T > M and (self.training or kind != "consecutive"):
            raise PosbenchError(f"randomized: cannot draw {T} distinct positions below max_pos={M}")
        if self.training:
            return torch.randperm(M, device=device)[:T].sort().values  # (T,) increasing
        if kind == "consecutive":
            return torch.arange(T, device=device)  # (T,)
        if kind == "fixed":
            seed = T
        else:
            k = self.draws.get(T, 0)
            self.draws[T] = k + 1
            seed = (T << 32) + k  # distinct for every (T, k) with k < 2^32
        self.gen.manual_seed(seed)
        return torch.randperm(M, generator=self.gen)[:T].sort().values.to(device)  # (T,) increasing


class Offset(Modifier):
    """A random start (as the arithmetic studies train): in training a sequence's positions are
    k..k+T-1, k drawn uniformly from [0, max_pos - T] for every batch (from torch's generator,
    so they follow torch.manual_seed); at evaluation they are 0..T-1. The base scheme meets
    positions up to max_pos while training at train_len."""

    description = "train on positions k..k+T-1 from a random start k <= max_pos - T; evaluate from 0"
    options = {"base": "sinusoidal", "max_pos": 1024}
    registry = None

    @property
    def max_len(self):
        return self.inner.max_len

    def positions(self, T, device):
        if not self.training:
            return torch.arange(T, device=device)  # (T,)
        start = torch.randint(0, max(1, self.opt["max_pos"] - T + 1), ()).item()
        return torch.arange(start, start + T, device=device)  # (T,)


def build_base(modifier, cfg):
    """The scheme a modifier feeds, built with the options that are not the modifier's own."""
    base = type(modifier).fixed_base or modifier.opt["base"]
    where = (
        f"{cfg.scheme}: its base {base!r}"
        if type(modifier).fixed_base
        else f"scheme_options.{cfg.scheme}.base={base!r}"
    )
    try:
        if type(modifier).registry is None:
            raise PosbenchError(f"{cfg.scheme}: build it by name (posbench.schemes.SCHEMES), which finds its base")
        cls = type(modifier).registry.lookup(base)
    except PosbenchError as e:
        raise PosbenchError(f"{where}: {e}") from None
    if issubclass(cls, Modifier):
        raise PosbenchError(f"{where}: a modifier's base is a scheme, not another modifier")
    if cls.replaces_softmax:
        raise PosbenchError(
            f"{where}: {base} replaces softmax with attention of its own and reads no positions, "
            f"so the modifier's positions would change nothing"
        )
    options = {k: v for k, v in modifier.opt.items() if k not in modifier.own}
    inner = cls(dataclasses.replace(cfg, options=options))  # its errors name the scheme asked for
    if inner.max_len is not None and inner.max_len < modifier.opt["max_pos"]:
        raise PosbenchError(
            f"scheme_options.{cfg.scheme}.max_pos={modifier.opt['max_pos']}: {base} encodes at most "
            f"{inner.max_len} positions; lower max_pos or raise {base}'s own limit"
        )
    return inner


def modified(name: str, base: str, modifier: type, what: str, registry) -> Optional[type]:
    """The class `name` (noisy_<base>, offset_<base>) names: `modifier` with its base fixed,
    taking the base's options beside its own (None: let the registry try `name` as a plugin)."""
    if name in _MODIFIED:
        return _MODIFIED[name]
    try:
        base_cls = registry.lookup(base)
    except PosbenchError as e:
        if ":" in name:  # perhaps a plugin whose module's name begins so: let the registry try that
            return None
        raise PosbenchError(f"scheme '{name}': {e}") from None
    if issubclass(base_cls, Modifier):
        raise PosbenchError(f"scheme '{name}': its base '{base}' is itself a modifier; a modifier's base is a scheme")
    own = {k: v for k, v in modifier.options.items() if k != "base"}
    mine = tuple(k for k in modifier.own if k != "base")  # rope's own `base` option stays rope's
    attrs = {
        "registry": registry,
        "fixed_base": base,
        "own": mine,
        "options": {**own, **base_cls.options},
        "added_later": (*modifier.added_later, *base_cls.added_later),
        "description": f"{base}, trained {what}",
    }
    return _MODIFIED.setdefault(name, type(f"{modifier.__name__}_{base}", (modifier,), attrs))


_MODIFIED: dict[str, type] = {}  # noisy_rope -> its class, made once
