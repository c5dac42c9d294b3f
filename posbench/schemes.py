"""Positional schemes: one class each, three hooks, one registry.

A scheme touches the model in exactly three places (the x-transformers taxonomy):
  embed(x, pos)                 add an absolute signal to the token embeddings
  rotate(q, k, pos, layer)      transform q and k in every layer (RoPE, Transformer-XL's u)
  bias(q, k, qpos, kpos, layer) an additive bias on the attention logits, after the 1/sqrt(d)
                                scaling of q.k (ALiBi, T5); it may look at q (Transformer-XL)
                                and at k (contextual schemes)
A fourth hook is optional and only for speed:
  attend(q, k, v, qpos, kpos, layer)  the whole causal attention, computed some faster way;
                                      it must equal the generic path with `bias` (tests check
                                      it), and None, the default, means the generic path
The base class's hooks are no-ops, which is exactly NoPE. The model calls every hook every time
and never asks which scheme it holds. `bias` is called on blocks of queries, so it must build
its (Tq, Tk) bias from the positions it is given, never from a cached (T, T) table.

A scheme may also declare evaluation-time variants (`eval_variants`): a change applied to a
trained checkpoint while it is evaluated, with no retraining, reported as rows named
`<scheme>+<variant>`. RoPE's are the inference-time scalings of transformers' ROPE_INIT_FUNCTIONS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import inspect
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from posbench import native
from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.native.layers import rope  # x * cos + rotate_half(x) * sin, fused on CPU


class PositionalScheme(nn.Module):
    """Base of every scheme. Subclass it, override any of the three hooks, and register a name
    or load it as module:Class (README, "Write your own scheme")."""

    description = "no positional information at all; the causal mask alone leaks order"
    options: dict = {}  # option name -> default value; YAML `scheme_options.<name>` overrides
    eval_variants: dict = {}  # variant name -> description; evaluated as rows "<scheme>+<name>"
    variant: Optional["EvalVariant"] = None  # the variant being evaluated, set by eval_variant()

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
            # sizes, distances, bases and scales: every numeric option with a positive
            # default is a positive quantity (a subclass may check more in its __init__)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and isinstance(default, (int, float)) and default > 0 and not value > 0:
                raise PosbenchError(f"{where}.{key}={value} must be positive")

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
                f"scheme '{self.cfg.scheme}' has no evaluation-time variant '{name}' "
                f"(its variants: {have})"
            )
        self.variant, self._memo = EvalVariant(name, train_len, length, factor), None
        try:
            yield
        finally:
            self.variant, self._memo = None, None

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(T, device=device)  # (T,)

    def embed(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x  # (B, T, C)

    def rotate(self, q, k, pos, layer: int):
        return q, k  # (B, H, T, D) each

    def bias(self, q, k, qpos, kpos, layer: int) -> Optional[torch.Tensor]:
        return None  # or (B or 1, H, Tq, Tk), added to the scaled logits

    def attend(self, q, k, v, qpos, kpos, layer: int) -> Optional[torch.Tensor]:
        return None  # or (B, H, Tq, D): softmax(q.k / sqrt(d) + bias, future masked) v


@dataclasses.dataclass(frozen=True)
class EvalVariant:
    name: str
    train_len: int  # L, the length the checkpoint was trained at
    length: int  # L', the evaluation length
    factor: Optional[float] = None  # a fixed scale; None = derived from L' / L


def variant_label(scheme: str, variant: Optional[str], factor: Optional[float] = None) -> str:
    """The scheme column of a row: `rope`, `rope+yarn`, or `rope+yarn@4` for a fixed factor 4."""
    if variant is None:
        return scheme
    return f"{scheme}+{variant}" + (f"@{factor:g}" if factor is not None else "")


class NoPE(PositionalScheme):
    pass


def sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(p, 2k) = sin(p / 10000^(2k/dim)), PE(p, 2k+1) = cos(same); (len(pos), dim)."""
    inv = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    ang = pos.float()[:, None] * inv[None, :]  # (T, dim/2)
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1)  # interleaved (T, dim)


def require_even(cfg: ModelConfig, what: str, value: int) -> None:
    """Sin/cos pairs and rotations take dimensions two at a time."""
    if value % 2:
        raise PosbenchError(
            f"scheme '{cfg.scheme}' pairs dimensions as sin/cos or rotations, so {what}={value} must be even"
        )


class Sinusoidal(PositionalScheme):
    """The encoding is scaled by 1/sqrt(d_model), x-transformers' ScaledSinusoidalEmbedding at
    its initial value. Unscaled, its unit amplitude drowns GPT-style token embeddings (std 0.02):
    in-length perplexity measured 16.3 unscaled against 6.9 scaled at the default size."""

    description = "fixed sin/cos of the absolute position added to the embeddings (Vaswani 2017)"

    def __init__(self, cfg):
        super().__init__(cfg)
        require_even(cfg, "model.d_model", cfg.d_model)

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
        nb, far = self.opt["num_buckets"], self.opt["max_distance"]
        if nb < 2 or far <= nb // 2:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}: need num_buckets >= 2 and max_distance > "
                f"num_buckets/2 (the exact buckets), got {nb} and {far}"
            )
        # shared by all layers, as in T5
        self.table = nn.Parameter(torch.zeros(self.opt["num_buckets"], cfg.n_head))  # (NB, H)

    def bias(self, q, k, qpos, kpos, layer):
        return self.once_per_forward((qpos, kpos), lambda: self.bucket_bias(qpos, kpos, q.dtype))

    def bucket_bias(self, qpos, kpos, dtype):
        rel = kpos[None, :] - qpos[:, None]  # (Tq, Tk)
        b = t5_relative_bucket(rel, False, self.opt["num_buckets"], self.opt["max_distance"])
        # index_select, not table[b]: the same values, and its backward (an index_add) is ~10x
        # faster than advanced indexing's (an accumulating index_put): ~1 ms of a training step
        bias = self.table.index_select(0, b.flatten()).view(*b.shape, -1)  # (Tq, Tk, H)
        return bias.permute(2, 0, 1).unsqueeze(0).to(dtype)  # (1, H, Tq, Tk)


class TransformerXL(PositionalScheme):
    """score = (q_i + u).k_j + (q_i + v).W_r r(i-j), all scaled by 1/sqrt(d) (Dai 2019).

    The content term's u rides on q through `rotate`, so attention computes (q + u).k itself;
    the position term is the bias, computed from that same q with u swapped for v."""

    description = "content-dependent relative attention with sinusoidal distances (Dai 2019)"

    def __init__(self, cfg):
        super().__init__(cfg)
        H, D, C = cfg.n_head, cfg.head_dim, cfg.d_model
        require_even(cfg, "model.d_model", C)  # r(i-j) is a sinusoid of width d_model
        self.u = nn.Parameter(torch.zeros(H, 1, D))  # shared by all layers, as in the paper
        self.v = nn.Parameter(torch.zeros(H, 1, D))
        self.w_r = nn.ModuleList([nn.Linear(C, C, bias=False) for _ in range(cfg.n_layer)])

    def rotate(self, q, k, pos, layer):
        return q + self.u.to(q.dtype), k  # u is fp32; under bf16 autocast q must stay bf16

    def bias(self, q, k, qpos, kpos, layer):
        B, H, Tq, D = q.shape
        Tk = k.size(2)
        # Positions are consecutive and the last query sees the last key, so the distances
        # i-j run from Tk-1 down to -(Tq-1). Column c of `rev` holds distance Tk-1-c; a last
        # column of zeros is the padding the shift needs, made by the matmul for free.
        r = sinusoid(torch.arange(Tk - 1, -1, -1, device=q.device), self.cfg.d_model)  # (Tk, C)
        rk = self.w_r[layer](r.to(q.dtype)).view(Tk, H, D).permute(1, 2, 0)  # (H, D, Tk)
        rk = F.pad(rk, (0, 1))  # (H, D, Tk + 1)
        # heads first, so this is H matmuls of (B*Tq, D) x (D, Tk+1), not B*H small ones
        qv = ((q + (self.v - self.u).to(q.dtype)) * D**-0.5).transpose(0, 1).reshape(H, B * Tq, D)
        rev = torch.bmm(qv, rk).view(H, B, Tq, Tk + 1)  # (H, B, Tq, Tk + 1)
        return rel_shift(rev).transpose(0, 1)  # (B, H, Tq, Tk): [i, j] is distance qpos_i - kpos_j

    def attend(self, q, k, v, qpos, kpos, layer):
        # the same scores through posbench/native/attention.c where it applies (CPU, fp32, a C
        # compiler), the position term computed inside its tiles, so the (T, T) bias above is
        # never written; None sends it the generic way, as it does for a subclass that changes
        # the bias or the positions
        if type(self).bias is not TransformerXL.bias or type(self).positions is not PositionalScheme.positions:
            return None
        if not native.attention_applies(q, k, v):  # before building rk and q + v for nothing
            return None
        H, D, Tk = q.size(1), q.size(3), k.size(2)
        r = sinusoid(torch.arange(Tk, device=q.device), self.cfg.d_model)  # (Tk, C): row d, distance d
        rk = self.w_r[layer](r.to(q.dtype)).view(Tk, H, D).transpose(0, 1)  # (H, Tk, D)
        return native.relative_attention(q, k, v, q + (self.v - self.u).to(q.dtype), rk)  # q + v


def rel_shift(rev: torch.Tensor) -> torch.Tensor:
    """(..., Tq, Tk+1) -> (..., Tq, Tk) with out[..., i, j] = rev[..., i, Tq-1-i+j]: Transformer-XL's
    shift without a gather, reading the buffer with rows one element shorter. The last column
    of `rev` must be padding. Only j <= i + Tk-Tq (the past) is meaningful; the future holds
    whatever the shift reads and is masked."""
    *lead, Tq, Tk1 = rev.shape
    Tk = Tk1 - 1
    return rev.flatten(-2)[..., Tq - 1 : Tq - 1 + Tq * Tk].view(*lead, Tq, Tk)


ROPE_SCALINGS = (None, "linear", "ntk", "dynamic", "yarn")


def rope_frequencies(
    head_dim: int,
    base: float = 10000.0,
    scaling: Optional[str] = None,
    factor: float = 1.0,
    original_max_len: Optional[int] = None,
    seq_len: Optional[int] = None,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies theta_k = base^(-2k/d), k < d/2, as scaled at inference time,
    and the attention factor that multiplies cos and sin. Each kind is the default plus a small
    change, as in transformers' ROPE_INIT_FUNCTIONS (`src/transformers/modeling_rope_utils.py`):

      linear   theta_k / s (position interpolation)
      ntk      base' = base * s^(d/(d-2)) (NTK-aware; transformers has no static entry for it,
               this is x-transformers' `base_rescale_factor`)
      dynamic  base' = base * (s*n/L - (s-1))^(d/(d-2)), n = seq_len if seq_len > L else L
      yarn     theta_k/s below dimension `low`, theta_k above `high`, a linear ramp between;
               low/high where the training length L turns 32 (beta_fast) and 1 (beta_slow)
               times round; attention factor 0.1*ln(s) + 1 (1 when s <= 1)

    s = `factor`, L = `original_max_len` (the training length). YaRN matches
    `_compute_yarn_parameters` as of transformers 4.55-4.57, after its `truncate` option
    (default True: floor/ceil the ramp ends) was added; for s >= 1 that is also 4.45's result.
    Computed in float64, returned as float32 (d/2,).
    """
    if scaling not in ROPE_SCALINGS:
        raise PosbenchError(
            f"unknown RoPE scaling '{scaling}'; valid: {', '.join(str(k) for k in ROPE_SCALINGS[1:])}"
        )
    d = head_dim
    if scaling in ("ntk", "dynamic") and d <= 2:
        raise PosbenchError(f"{scaling} RoPE scaling needs a head dimension above 2, not {d}")
    if scaling in ("dynamic", "yarn") and not original_max_len:
        raise PosbenchError(f"{scaling} RoPE scaling needs the training length (original_max_len)")
    exponent = torch.arange(0, d, 2, dtype=torch.float64) / d  # (d/2,) = 2k/d
    attention = 1.0
    if scaling == "ntk":
        base = base * factor ** (d / (d - 2))
    elif scaling == "dynamic":
        n = seq_len if seq_len is not None and seq_len > original_max_len else original_max_len
        base = base * (factor * n / original_max_len - (factor - 1)) ** (d / (d - 2))
    inv = base**-exponent  # (d/2,)
    if scaling == "linear":
        inv = inv / factor
    elif scaling == "yarn":
        low, high = _yarn_ramp_ends(d, base, original_max_len, truncate)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # (d/2,)
        inv = inv / factor * ramp + inv * (1 - ramp)  # 0: keep theta_k (fast dims), 1: theta_k / s
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv.float(), attention


def _yarn_ramp_ends(d: int, base: float, L: int, truncate: bool) -> tuple[float, float]:
    """The dimensions where a length-L window holds 32 (beta_fast) and 1 (beta_slow) turns:
    dim(r) = d * ln(L / (2 pi r)) / (2 ln base), floored/ceiled, clipped to [0, d-1]."""

    def dim(turns):
        return d * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim(32), dim(1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    return low, (high + 0.001 if high == low else high)  # transformers' guard against 0/0


class RoPE(PositionalScheme):
    """Rotates dims (k, k + d/2) of q and k by angle p * theta_k, theta_k = base^(-2k/d). This
    pairs the halves (like transformers and x-transformers) instead of neighbours (2k, 2k+1);
    the two are the same rotation up to a fixed permutation of dims, which the q/k projections
    absorb. At evaluation, its variants rescale theta_k (see `rope_frequencies`) with
    s = L'/L (evaluation length over training length) unless a factor is fixed; `dynamic`
    uses transformers' factor (default 1) and grows s with each forward's own length."""

    description = "rotates q and k by position-proportional angles; q.k depends on i-j (Su 2021)"
    options = {"base": 10000.0}
    eval_variants = {
        "linear": "RoPE with positions interpolated, theta/s (Chen 2023)",
        "ntk": "RoPE with an NTK-aware base, base*s^(d/(d-2)) (bloc97 2023)",
        "dynamic": "RoPE with dynamic NTK, s grown with each forward's length (emozilla 2023)",
        "yarn": "RoPE with YaRN's per-dimension ramp and attention factor (Peng 2023)",
    }

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.opt["base"] <= 1:  # theta_k = base^(-2k/d) must fall with k; YaRN divides by log(base)
            raise PosbenchError(f"scheme_options.{cfg.scheme}.base={self.opt['base']} must be > 1")
        require_even(cfg, "the head size model.d_model / model.n_head", cfg.head_dim)

    def rotate(self, q, k, pos, layer):
        cos, sin = self.once_per_forward((pos,), lambda: self.angles(pos, q.size(-1), q.dtype))
        return rope(q, cos, sin), rope(k, cos, sin)  # x * cos + rotate_half(x) * sin

    def frequencies(self, D: int, seq_len: int) -> tuple[torch.Tensor, float]:
        v = self.variant
        if v is None:
            return rope_frequencies(D, self.opt["base"])
        default = 1.0 if v.name == "dynamic" else v.length / v.train_len
        factor = default if v.factor is None else v.factor
        return rope_frequencies(D, self.opt["base"], v.name, factor, v.train_len, seq_len)

    def angles(self, pos, D, dtype):
        inv, attention = self.frequencies(D, pos.numel())
        ang = pos.float()[:, None] * inv.to(pos.device)[None, :]  # (T, D/2)
        cos, sin = ang.cos() * attention, ang.sin() * attention  # transformers scales both
        return cos.repeat(1, 2).to(dtype), sin.repeat(1, 2).to(dtype)  # (T, D) each


class XPos(RoPE):
    """xPos (Sun et al. 2023): RoPE whose score q_i.k_j is also scaled by zeta_k^((i-j)/gamma),
    zeta_k = (2k + 0.4 d) / (1.4 d) < 1 per frequency k, gamma = scale_base (512), so far
    keys are damped, more so in the fast dimensions. As in x-transformers' `rotary_xpos`, q is
    multiplied by zeta^(p/gamma) and k by zeta^(-p/gamma) after the rotation, with p counted
    from the middle of the sequence (which cancels in i-j and keeps the powers small)."""

    description = "RoPE times a per-dimension decay zeta_k^((i-j)/gamma) (Sun 2023, xPos)"
    options = {"base": 10000.0, "scale_base": 512.0}
    eval_variants = {}  # RoPE's scalings were not defined for xPos's decay

    def rotate(self, q, k, pos, layer):
        cos, sin, up = self.once_per_forward((pos,), lambda: self.xpos(pos, q.size(-1), q.dtype))
        q = rope(q, cos, sin) * up  # (B, H, T, D)
        k = rope(k, cos, sin) / up
        return q, k

    def xpos(self, pos, D, dtype):
        cos, sin = self.angles(pos, D, dtype)  # (T, D) each
        zeta = (torch.arange(0, D, 2, device=pos.device).float() + 0.4 * D) / (1.4 * D)  # (D/2,)
        power = (pos - pos.max() // 2).float() / self.opt["scale_base"]  # (T,)
        up = zeta[None, :] ** power[:, None]  # (T, D/2)
        return cos, sin, up.repeat(1, 2).to(dtype)


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


class KerpleLog(PositionalScheme):
    """KERPLE, logarithmic kernel (Chi et al. 2022): bias -r1_h * log(1 + r2_h * |i-j|), with
    r1, r2 > 0 learned per head and per layer. As in the reference (chijames/KERPLE
    `megatron/mpu/layers.py`, ParallelKerpleLog, one module per layer): r1 starts U(0, 2), r2
    U(0, 1), and both are clamped to >= 0.01 in place before use while training, so a head at
    the floor can still learn its way back; evaluation clamps the values it uses."""

    description = "learned log-distance bias -r1*log(1+r2*|i-j|) per head (Chi 2022, KERPLE)"
    eps = 1e-2  # the reference's floor for r1 and r2
    r1_init, r2_init, r2_max = 2.0, 1.0, None  # r1 ~ U(0, 2), r2 ~ U(0, 1), r2 unbounded

    def __init__(self, cfg):
        super().__init__(cfg)
        self.r1 = nn.Parameter(torch.rand(cfg.n_layer, cfg.n_head) * self.r1_init)  # (n_layer, H)
        self.r2 = nn.Parameter(torch.rand(cfg.n_layer, cfg.n_head) * self.r2_init)  # (n_layer, H)

    def bias(self, q, k, qpos, kpos, layer):
        if self.training:  # `.data`: autograd's saved copies from earlier blocks stay valid
            self.r1.data[layer].clamp_(min=self.eps)
            self.r2.data[layer].clamp_(min=self.eps, max=self.r2_max)
        r1 = self.r1[layer].clamp(min=self.eps)[:, None, None]  # (H, 1, 1)
        r2 = self.r2[layer].clamp(min=self.eps, max=self.r2_max)[:, None, None]
        dist = (qpos[:, None] - kpos[None, :]).clamp(min=0).float()  # (Tq, Tk); future is masked
        return self.kernel(r1, r2, dist).unsqueeze(0).to(q.dtype)  # (1, H, Tq, Tk)

    @staticmethod
    def kernel(r1, r2, dist):
        return -r1 * torch.log1p(r2 * dist)


class KerplePower(KerpleLog):
    """KERPLE, power kernel (Chi et al. 2022): bias -r1_h * |i-j|^r2_h with r1 > 0 and
    0 < r2 <= 2 learned per head (r2 = 1 is ALiBi with a learned slope). Reference:
    ParallelKerplePower in chijames/KERPLE `megatron/mpu/layers.py`, where the slope (our r1)
    starts U(0, 1) and the power (our r2) U(0, 2), clamped to [0.01, 2]."""

    description = "learned power-distance bias -r1*|i-j|^r2 per head (Chi 2022, KERPLE)"
    r1_init, r2_init, r2_max = 1.0, 2.0, 2.0

    @staticmethod
    def kernel(r1, r2, dist):
        return -r1 * dist.pow(r2)  # 0^r2 = 0 on the diagonal, with a zero gradient


class FIRE(PositionalScheme):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long
    Context Transformers"): b(i, j) = f(psi(i-j) / psi(max(L_thr, i))), psi(x) = log(c x + 1),
    f an MLP 1 -> 32 -> n_head with ReLU, one per layer. Dividing by psi(i) maps every distance
    into [0, 1] whatever the length (progressive interpolation); the learned threshold L_thr
    keeps short prefixes from being stretched. c and L_thr are learned, as in the paper's
    listing (reproduced e.g. in mcleish7/arithmetic `cramming/architectures/embeddings.py`,
    whose defaults are these: MLP width 32, c from 0.1, eps 1e-6): L_thr = |m * init_L| with m
    learned from 1 and init_L fixed (512 at the paper's training length 2048, so default
    train_len / 4 here)."""

    description = "an MLP of log distance normalised by log query position (Li 2023, FIRE)"
    options = {"mlp_width": 32, "init_c": 0.1, "init_L": None}  # init_L None: train_len / 4
    eps = 1e-6  # keeps psi(max(L_thr, i)) away from 0 when i = 0 and L_thr -> 0

    def __init__(self, cfg):
        super().__init__(cfg)
        init_L = self.opt["init_L"]
        if init_L is None:
            init_L = cfg.train_len / 4
        if isinstance(init_L, bool) or not isinstance(init_L, (int, float)) or init_L <= 0:
            raise PosbenchError(f"scheme_options.{cfg.scheme}.init_L={init_L!r} must be a positive number")
        H, W, n = cfg.n_head, self.opt["mlp_width"], cfg.n_layer
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(1, W), nn.ReLU(), nn.Linear(W, H)) for _ in range(n)
        )
        self.c = nn.Parameter(torch.full((n,), float(self.opt["init_c"])))  # (n_layer,)
        self.L_mult = nn.Parameter(torch.ones(n))  # (n_layer,)
        self.register_buffer("init_L", torch.tensor(float(init_L)), persistent=False)

    def bias(self, q, k, qpos, kpos, layer):
        c = self.c[layer].abs()
        threshold = (self.L_mult[layer] * self.init_L).abs()
        dist = (qpos[:, None] - kpos[None, :]).clamp(min=0).float()  # (Tq, Tk); future is masked
        norm = torch.maximum(qpos.float(), threshold)  # (Tq,)
        x = torch.log1p(c * dist) / (torch.log1p(c * norm) + self.eps)[:, None]  # (Tq, Tk) in [0, 1]
        b = self.mlp[layer](x.unsqueeze(-1).to(q.dtype))  # (Tq, Tk, H)
        return b.permute(2, 0, 1).unsqueeze(0)  # (1, H, Tq, Tk)


class Randomized(PositionalScheme):
    """Randomized positional encodings (Ruoss et al. 2023; google-deepmind/
    randomized_positional_encodings): while training, a sequence's positions are a sorted
    random subset of [0, max_pos) instead of 0..T-1, one subset per batch, so the model meets
    every position up to max_pos >> train_len and only their order is reliable. The positions
    feed the `base` scheme, sinusoidal or rope. The training draws come from torch's global
    generator, so they follow torch.manual_seed.

    Evaluation uses 0..T-1 (eval_positions: consecutive, as the method is usually described).
    The reference code draws at evaluation too (models/transformer.py applies the noisy
    encodings unconditionally); eval_positions: random does that, with one sorted draw per
    length seeded by the length, so a table repeats exactly. Then lengths past max_pos cannot
    be encoded (beyond-max-len)."""

    description = "train on sorted random positions from [0, max_pos), evaluate on 0..T-1 (Ruoss 2023)"
    options = {"base": "sinusoidal", "max_pos": 1024, "eval_positions": "consecutive"}
    bases = {"sinusoidal": Sinusoidal, "rope": RoPE}
    eval_kinds = ("consecutive", "random")

    def __init__(self, cfg):
        super().__init__(cfg)
        for key, valid in (("base", tuple(self.bases)), ("eval_positions", self.eval_kinds)):
            if self.opt[key] not in valid:
                raise PosbenchError(
                    f"scheme_options.{cfg.scheme}.{key}={self.opt[key]!r}: expected one of {', '.join(valid)}"
                )
        if self.opt["max_pos"] < cfg.train_len:
            raise PosbenchError(
                f"scheme_options.{cfg.scheme}.max_pos={self.opt['max_pos']} is shorter than "
                f"model.train_len={cfg.train_len}"
            )
        self.inner = self.bases[self.opt["base"]](dataclasses.replace(cfg, options={}))

    @property
    def max_len(self):
        return self.opt["max_pos"] if self.opt["eval_positions"] == "random" else None

    def positions(self, T, device):
        M = self.opt["max_pos"]
        if T > M and (self.training or self.opt["eval_positions"] == "random"):
            raise PosbenchError(f"randomized: cannot draw {T} distinct positions below max_pos={M}")
        if self.training:
            return torch.randperm(M, device=device)[:T].sort().values  # (T,) increasing
        if self.opt["eval_positions"] == "consecutive":
            return torch.arange(T, device=device)  # (T,)
        gen = torch.Generator().manual_seed(T)  # the same draw for a length, every time
        return torch.randperm(M, generator=gen)[:T].sort().values.to(device)  # (T,) increasing

    def embed(self, x, pos):
        return self.inner.embed(x, pos)

    def rotate(self, q, k, pos, layer):
        return self.inner.rotate(q, k, pos, layer)


class CoPE(PositionalScheme):
    """Contextual position encoding (Golovneva et al. 2024, the paper's listing; x-transformers
    `use_cope`). Positions count what the query attends to rather than tokens:
        gate_it = sigmoid(q_i.k_t / sqrt(d)) for t <= i (0 for the future),
        p_ij = sum_{t=j..i} gate_it                                  (a real number)
        bias_ij = interpolation of q_i.e[p] between e[floor p] and e[ceil p]
    with e a learned (npos_max, d) table per layer, shared by the heads and zero at the start;
    p is clamped to npos_max - 1. The gates need q and k, which the bias hook receives, and
    the future mask by position, since this scheme keeps positions 0..T-1."""

    description = "positions counted by sigmoid gates on q.k, learned position logits (Golovneva 2024)"
    options = {"npos_max": 64}

    def __init__(self, cfg):
        super().__init__(cfg)
        if self.opt["npos_max"] < 2:
            raise PosbenchError(f"scheme_options.{cfg.scheme}.npos_max must be at least 2")
        shape = (cfg.head_dim, self.opt["npos_max"])
        self.pos_emb = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for _ in range(cfg.n_layer))

    def bias(self, q, k, qpos, kpos, layer):
        keep = (kpos[None, :] <= qpos[:, None]).to(q.dtype)  # (Tq, Tk): 1 where a query sees a key
        return CoPEBias.apply(q, k, self.pos_emb[layer].to(q.dtype), keep)  # (B, H, Tq, Tk)

    def attend(self, q, k, v, qpos, kpos, layer):
        # the same attention, with this bias, through the C kernel posbench/native/cope.c
        # where it applies (CPU, fp32, a C compiler); None sends it the generic way, as it
        # does for a subclass that changes the bias or the positions the kernel assumes
        if type(self).bias is not CoPE.bias or type(self).positions is not PositionalScheme.positions:
            return None
        return native.cope_attention(q, k, v, self.pos_emb[layer], qpos, kpos)


class CoPEBias(torch.autograd.Function):
    """CoPE's bias with its backward written out. Autograd's version makes about 45 passes
    over (B, H, Tq, Tk) tensors per layer (flips, floor, ceil, two gathers and their
    scatters); this one makes about 20, mostly in place. tests/test_catalogue.py checks it
    against the plain formula in values and gradients."""

    @staticmethod
    def forward(ctx, q, k, table, keep):
        D, P = table.shape
        scale = D**-0.5
        g = torch.matmul(q * scale, k.transpose(-1, -2)).sigmoid_().mul_(keep)  # (B, H, Tq, Tk) gates
        # positions in fp32 whatever q's dtype: from bf16 gates, total - cumsum is off by up to 0.5
        c = g.cumsum(-1, dtype=torch.float32)
        pos = torch.sub(c[..., -1:], c).add_(g)  # sum_{t=j..i} g_it: total - cumsum + own
        pos.clamp_(max=P - 1)
        lo = pos.floor()
        w = pos.sub_(lo)  # (B, H, Tq, Tk) in [0, 1)
        lo = lo.long()
        by_pos = torch.matmul(q, table)  # (B, H, Tq, P)
        step = F.pad(by_pos.diff(dim=-1), (0, 1))  # e[p+1] - e[p]; 0 at the clamp, so no gradient there
        at_lo, slope = by_pos.gather(-1, lo), step.gather(-1, lo)
        ctx.save_for_backward(q, k, table, g, w.to(q.dtype), lo, slope)  # fp32 positions, kept at q's width
        return at_lo.addcmul_(w, slope)  # e[lo] + w (e[lo+1] - e[lo])

    @staticmethod
    def backward(ctx, d_out):
        q, k, table, g, w, lo, slope = ctx.saved_tensors
        D, P = table.shape
        scale = D**-0.5
        # through the interpolation weight to the positions, then to the gates: pos_ij sums
        # g_it over t >= j, so d g_it = sum over j <= t of d pos_ij, a cumsum
        d_g = (d_out * slope).cumsum_(-1)
        d_logits = d_g.mul_(g - g * g)  # sigmoid'; zero where the future was masked (g = 0)
        d_q = torch.matmul(d_logits, k).mul_(scale)
        d_k = torch.matmul(d_logits.transpose(-1, -2), q).mul_(scale)
        # through the two gathers to the per-position logits q.e[p]
        d_at = torch.zeros(*d_out.shape[:-1], P, dtype=d_out.dtype, device=d_out.device)
        d_by_pos = d_at.scatter_add_(-1, lo, d_out)
        d_step = torch.zeros_like(d_by_pos).scatter_add_(-1, lo, (d_out * w).to(d_out.dtype))
        d_by_pos[..., :-1] -= d_step[..., :-1]
        d_by_pos[..., 1:] += d_step[..., :-1]
        d_q += torch.matmul(d_by_pos, table.t())
        d_table = torch.matmul(q.transpose(-1, -2), d_by_pos).sum(dim=(0, 1))  # (D, P)
        return d_q, d_k, d_table, None


SCHEMES: dict[str, type[PositionalScheme]] = {
    "nope": NoPE,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "t5": T5Bias,
    "xl": TransformerXL,
    "rope": RoPE,
    "alibi": ALiBi,
    "hybrid": Hybrid,
    "xpos": XPos,
    "kerple_log": KerpleLog,
    "kerple_power": KerplePower,
    "fire": FIRE,
    "randomized": Randomized,
    "cope": CoPE,
}


def catalogue() -> list[tuple[str, str]]:
    """(name, description) of every registered scheme, each followed by its evaluation-time
    variants, which are rows of a report rather than schemes that can be trained."""
    rows = []
    for name, cls in SCHEMES.items():
        rows.append((name, cls.description))
        for variant, what in cls.eval_variants.items():
            rows.append((f"{name}+{variant}", f"evaluation-time variant of {name}: {what}"))
    return rows


def resolve_scheme(name: str) -> type[PositionalScheme]:
    """A registered name, or `module:Class` naming a user's PositionalScheme subclass."""
    if name in SCHEMES:
        return SCHEMES[name]
    if ":" in name:
        return _load_plugin(name)
    base, plus, variant = name.partition("+")
    if plus and variant in getattr(SCHEMES.get(base), "eval_variants", {}):
        raise PosbenchError(
            f"'{name}' is an evaluation-time variant of {base}, not a scheme to train: train "
            f"{base} and add --rope-scaling {variant} (or eval.rope_scaling: [{variant}])"
        )
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
    cls = resolve_scheme(cfg.scheme)
    try:
        return cls(cfg)
    except PosbenchError:
        raise
    except Exception as e:
        if cfg.scheme in SCHEMES:  # ours: a bug, which the CLI reports as one
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise PosbenchError(
            f"scheme '{cfg.scheme}' failed to build ({type(e).__name__}: {first}); "
            f"`posbench check-scheme {cfg.scheme}` checks it step by step"
        ) from None
