"""Positional schemes: one class each, three hooks, one registry.

A scheme touches the model in exactly three places (the x-transformers taxonomy):
  embed(x, pos)                 add an absolute signal to the token embeddings
  rotate(q, k, pos, layer)      transform q and k in every layer (RoPE, Transformer-XL's u)
  bias(q, k, qpos, kpos, layer) an additive bias on the attention logits, after the 1/sqrt(d)
                                scaling of q.k (ALiBi, T5); it may look at q (Transformer-XL)
                                and at k (contextual schemes)
The base class's hooks are no-ops, which is exactly NoPE. The model calls every hook every time
and never asks which scheme it holds. `bias` is called on blocks of queries, so it must build
its (Tq, Tk) bias from the positions it is given, never from a cached (T, T) table.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench.config import ModelConfig
from posbench.errors import PosbenchError


class PositionalScheme(nn.Module):
    """Base of every scheme. Subclass it, override any of the three hooks, and register a name
    or load it as module:Class (README, "Write your own scheme")."""

    description = "no positional information at all; the causal mask alone leaks order"
    options: dict = {}  # option name -> default value; YAML `scheme_options.<name>` overrides

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.validate_options(cfg.options, where=f"scheme_options.{cfg.scheme}")
        self.cfg = cfg
        self.opt = {**self.options, **cfg.options}

    @classmethod
    def validate_options(cls, given: dict, where: str) -> None:
        for key, value in given.items():
            if key not in cls.options:
                close = difflib.get_close_matches(key, list(cls.options), n=1, cutoff=0.5)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                valid = ", ".join(cls.options) or "none"
                raise PosbenchError(f"{where}.{key}: unknown option{hint}; valid options: {valid}")
            default = cls.options[key]
            if default is not None and not isinstance(value, type(default)):
                if not (isinstance(default, float) and isinstance(value, int)):
                    raise PosbenchError(
                        f"{where}.{key}: expected {type(default).__name__}, got {value!r}"
                    )

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

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(T, device=device)  # (T,)

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x  # (B, T, C)

    def rotate(self, q, k, pos, layer: int):
        return q, k  # (B, H, T, D) each

    def bias(self, q, k, qpos, kpos, layer: int) -> Optional[torch.Tensor]:
        return None  # or (B or 1, H, Tq, Tk), added to the scaled logits


class NoPE(PositionalScheme):
    pass


def sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(p, 2k) = sin(p / 10000^(2k/dim)), PE(p, 2k+1) = cos(same); (len(pos), dim)."""
    inv = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    ang = pos.float()[:, None] * inv[None, :]  # (T, dim/2)
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1)  # interleaved (T, dim)


class Sinusoidal(PositionalScheme):
    """The encoding is scaled by 1/sqrt(d_model), x-transformers' ScaledSinusoidalEmbedding at
    its initial value. Unscaled, its unit amplitude drowns GPT-style token embeddings (std 0.02):
    in-length perplexity measured 16.3 unscaled against 6.9 scaled at the default size."""

    description = "fixed sin/cos of the absolute position added to the embeddings (Vaswani 2017)"

    def embed(self, x, pos):
        return x + sinusoid(pos, x.size(-1)).to(x.dtype) / math.sqrt(x.size(-1))


class Learned(PositionalScheme):
    """A table of max_len rows, GPT-2 style: rows past the training length exist but are never
    trained, so evaluating there shows what an untrained position does. Past the table there
    is no position at all, and the model refuses rather than clamp."""

    description = "a trained table of absolute position vectors (GPT-2); undefined past its size"
    options = {"max_len": 1024}  # GPT-2's n_positions

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.max_len < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.learned.max_len={self.max_len} is shorter than "
                f"model.train_len={cfg.train_len}"
            )
        self.table = nn.Parameter(torch.randn(self.max_len, cfg.d_model) * 0.02)  # (max_len, C)

    @property
    def max_len(self):
        return self.opt["max_len"]

    def embed(self, x, pos):
        return x + self.table[pos]  # (B, T, C)


def t5_relative_bucket(
    relative_position: torch.Tensor,
    bidirectional: bool = False,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """T5's bucketing of relative_position = key_pos - query_pos: half the buckets exact, the
    rest log-spaced up to max_distance, everything farther in the last bucket."""
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    n = relative_position
    if bidirectional:
        num_buckets //= 2
        buckets += (n > 0).long() * num_buckets
        n = n.abs()
    else:
        n = (-n).clamp(min=0)  # only the past counts; the future shares bucket 0
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # the clamp only guards log(0), which is_small discards anyway
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class T5Bias(PositionalScheme):
    description = "a learned scalar per head per log-spaced distance bucket (Raffel 2020)"
    options = {"num_buckets": 32, "max_distance": 128}

    def __init__(self, cfg):
        super().__init__(cfg)
        # shared by all layers, as in T5
        self.table = nn.Parameter(torch.zeros(self.opt["num_buckets"], cfg.n_head))  # (NB, H)

    def bias(self, q, k, qpos, kpos, layer):
        return self.once_per_forward((qpos, kpos), lambda: self.bucket_bias(qpos, kpos, q.dtype))

    def bucket_bias(self, qpos, kpos, dtype):
        rel = kpos[None, :] - qpos[:, None]  # (Tq, Tk)
        b = t5_relative_bucket(rel, False, self.opt["num_buckets"], self.opt["max_distance"])
        return self.table[b].permute(2, 0, 1).unsqueeze(0).to(dtype)  # (1, H, Tq, Tk)


class TransformerXL(PositionalScheme):
    """score = (q_i + u).k_j + (q_i + v).W_r r(i-j), all scaled by 1/sqrt(d) (Dai 2019).

    The content term's u rides on q through `rotate`, so attention computes (q + u).k itself;
    the position term is the bias, computed from that same q with u swapped for v."""

    description = "content-dependent relative attention with sinusoidal distances (Dai 2019)"

    def __init__(self, cfg):
        super().__init__(cfg)
        H, D, C = cfg.n_head, cfg.head_dim, cfg.d_model
        self.u = nn.Parameter(torch.zeros(H, 1, D))  # shared by all layers, as in the paper
        self.v = nn.Parameter(torch.zeros(H, 1, D))
        self.w_r = nn.ModuleList([nn.Linear(C, C, bias=False) for _ in range(cfg.n_layer)])

    def rotate(self, q, k, pos, layer):
        return q + self.u, k

    def bias(self, q, k, qpos, kpos, layer):
        B, H, Tq, D = q.shape
        far = int(qpos.max() - kpos.min()) + 1  # distances 0..far-1 occur in this block
        r = sinusoid(torch.arange(far, device=q.device), self.cfg.d_model)  # (far, C)
        rk = self.w_r[layer](r.to(q.dtype)).view(far, H, D).permute(1, 2, 0)  # (H, D, far)
        by_dist = (q - self.u + self.v) @ rk  # (B, H, Tq, far)
        dist = (qpos[:, None] - kpos[None, :]).clamp(min=0)  # (Tq, Tk); future is masked
        out = by_dist.gather(-1, dist.expand(B, H, -1, -1))  # (B, H, Tq, Tk)
        return out / math.sqrt(D)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RoPE(PositionalScheme):
    """Rotates dims (k, k + d/2) of q and k by angle p * base^(-2k/d). This pairs the halves
    (like transformers and x-transformers) instead of neighbours (2k, 2k+1); the two are the
    same rotation up to a fixed permutation of dims, which the q/k projections absorb."""

    description = "rotates q and k by position-proportional angles; q.k depends on i-j (Su 2021)"
    options = {"base": 10000.0}

    def rotate(self, q, k, pos, layer):
        cos, sin = self.once_per_forward((pos,), lambda: self.angles(pos, q.size(-1), q.dtype))
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def angles(self, pos, D, dtype):
        inv = self.opt["base"] ** (-torch.arange(0, D, 2, device=pos.device).float() / D)
        ang = pos.float()[:, None] * inv[None, :]  # (T, D/2)
        return ang.cos().repeat(1, 2).to(dtype), ang.sin().repeat(1, 2).to(dtype)  # (T, D) each


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head h of n (1-based) gets 2^(-8h/n) when n is a power of two. Otherwise, as in the
    reference code: the slopes of the nearest lower power of two c, then every other slope
    of the 2c-head list, which interleaves and is not monotonic (n=6: 1/4..1/256, 1/2, 1/8)."""
    c = 2 ** math.floor(math.log2(n_heads))
    base = [2.0 ** (-8.0 * h / c) for h in range(1, c + 1)]
    extra = [2.0 ** (-8.0 * h / (2 * c)) for h in range(1, 2 * c + 1, 2)]
    return torch.tensor(base + extra[: n_heads - c])


class ALiBi(PositionalScheme):
    description = "a fixed linear penalty -m_h*(i-j) on the logits, one slope per head (Press 2022)"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)  # (H,)

    def bias(self, q, k, qpos, kpos, layer):
        return self.once_per_forward((qpos, kpos), lambda: self.linear_bias(qpos, kpos, q.dtype))

    def linear_bias(self, qpos, kpos, dtype):
        dist = (qpos[:, None] - kpos[None, :]).to(dtype)  # (Tq, Tk)
        return (-self.slopes.to(dtype)[:, None, None] * dist).unsqueeze(0)  # (1, H, Tq, Tk)


class Hybrid(PositionalScheme):
    description = "sinusoidal absolute embeddings plus a T5 relative bias in every layer"
    options = T5Bias.options

    def __init__(self, cfg):
        super().__init__(cfg)
        self.absolute = Sinusoidal(dataclasses.replace(cfg, options={}))
        self.relative = T5Bias(cfg)

    def embed(self, x, pos):
        return self.absolute.embed(x, pos)

    def bias(self, q, k, qpos, kpos, layer):
        return self.relative.bias(q, k, qpos, kpos, layer)


SCHEMES: dict[str, type[PositionalScheme]] = {
    "nope": NoPE,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "t5": T5Bias,
    "xl": TransformerXL,
    "rope": RoPE,
    "alibi": ALiBi,
    "hybrid": Hybrid,
}


def resolve_scheme(name: str) -> type[PositionalScheme]:
    """A registered name, or `module:Class` naming a user's PositionalScheme subclass."""
    if name in SCHEMES:
        return SCHEMES[name]
    if ":" in name:
        return _load_plugin(name)
    close = difflib.get_close_matches(name, list(SCHEMES), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise PosbenchError(
        f"unknown scheme '{name}'{hint}; valid schemes: {', '.join(SCHEMES)}, or module:Class"
    )


def _load_plugin(spec: str) -> type[PositionalScheme]:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise PosbenchError(f"scheme '{spec}': expected module:Class, e.g. examples.my_scheme:MyScheme")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PosbenchError(f"scheme '{spec}': cannot import module '{module_name}' ({e})") from None
    except Exception as e:  # the user's module itself is broken: name the error, not a traceback
        first = (str(e).strip().splitlines() or [""])[0]
        raise PosbenchError(
            f"scheme '{spec}': importing module '{module_name}' failed ({type(e).__name__}: {first})"
        ) from None
    cls = module
    for part in class_name.split("."):  # module:Outer.Inner works too
        cls = getattr(cls, part, None)
    if cls is None:
        raise PosbenchError(f"scheme '{spec}': module '{module_name}' has no '{class_name}'")
    if not (inspect.isclass(cls) and issubclass(cls, PositionalScheme)):
        raise PosbenchError(
            f"scheme '{spec}': {class_name} is not a subclass of posbench.schemes.PositionalScheme"
        )
    return cls


def build_scheme(cfg: ModelConfig) -> PositionalScheme:
    return resolve_scheme(cfg.scheme)(cfg)
