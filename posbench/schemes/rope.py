"""Rotary schemes: RoPE with its options and inference-time scalings, xPos, and SSMax on RoPE."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn as nn

from posbench.errors import PosbenchError
from posbench.schemes.base import PositionalScheme, require_even

ROPE_SCALINGS = (None, "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")  # posbench.schemes names them too
YARN_BETAS = (32.0, 1.0)  # YaRN's beta_fast and beta_slow, set for Llama: turns in L that bound its ramp
LLAMA3 = (1.0, 4.0)  # Llama 3.1's low_freq_factor and high_freq_factor: turns in L that bound its ramp
LONGROPE_NEEDS = (
    "longrope needs short_factor and long_factor, d_head/2 factors each, searched for each model (LongRoPE, "
    "Ding 2024); posbench runs no such search, so its rope has none: posbench pretrained scores longrope "
    "on a model whose config has them"
)


def rope_frequencies(
    head_dim: int,
    base: float = 10000.0,
    scaling: Optional[str] = None,
    factor: float = 1.0,
    original_max_len: Optional[int] = None,
    seq_len: Optional[int] = None,
    truncate: bool = True,
    longrope: Optional[tuple[Sequence[float], Sequence[float]]] = None,
    betas: tuple[float, float] = YARN_BETAS,
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies theta_k = base^(-2k/d), k < d/2, as scaled at inference time,
    and the attention factor that multiplies cos and sin. Each kind is the default plus a small
    change, as in transformers' ROPE_INIT_FUNCTIONS (`src/transformers/modeling_rope_utils.py`):

      linear   theta_k / s (position interpolation)
      ntk      base' = base * s^(d/(d-2)) (NTK-aware; transformers has no static entry for it,
               this is x-transformers' `base_rescale_factor`)
      dynamic  base' = base * (s*n/L - (s-1))^(d/(d-2)), n = seq_len if seq_len > L else L
               (transformers' dynamic: NTK-aware with s grown with the length)
      yarn     theta_k/s below dimension `low`, theta_k above `high`, a linear ramp between;
               low/high where the training length L turns beta_fast and beta_slow times
               round (`betas`, by default YaRN's 32 and 1); attention factor 0.1*ln(s) + 1 (1 when s <= 1)
      llama3   by the turns r_k = L theta_k / (2 pi) that dimension k makes in L: theta_k/s
               where r_k < 1, theta_k where r_k > 4, and (1 - g) theta_k/s + g theta_k between,
               g = (r_k - 1)/(4 - 1) (Llama 3.1's low/high_freq_factor 1 and 4)
      longrope theta_k / f_k with f = short_factor (seq_len <= L) or long_factor (seq_len > L),
               `longrope` = (short_factor, long_factor), d/2 factors each searched for one model
               (Phi-3's); attention factor sqrt(1 + ln(s)/ln(L)) (1 when s <= 1)

    s = `factor`, L = `original_max_len` (the training length). YaRN matches
    transformers' `_compute_yarn_parameters` with its `truncate` option at its default (True:
    floor/ceil the ramp ends); tests/test_catalogue.py checks it against the installed version.
    Computed in float64 and returned as float32 (d/2,), except llama3 and longrope: computed in
    float32 in transformers' own order of operations, they equal it to the last bit.
    """
    if scaling not in ROPE_SCALINGS:
        raise PosbenchError(f"unknown RoPE scaling '{scaling}'; valid: {', '.join(str(k) for k in ROPE_SCALINGS[1:])}")
    d = head_dim
    if scaling in ("ntk", "dynamic") and d <= 2:
        raise PosbenchError(f"{scaling} RoPE scaling needs a head dimension above 2, not {d}")
    if scaling in ("dynamic", "yarn", "llama3", "longrope") and not original_max_len:
        raise PosbenchError(f"{scaling} RoPE scaling needs the training length (original_max_len)")
    if scaling in ("llama3", "longrope"):
        return _float32_scaling(d, base, scaling, factor, original_max_len, seq_len, longrope)
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
        low, high = _yarn_ramp_ends(d, base, original_max_len, truncate, betas)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # (d/2,)
        inv = inv / factor * ramp + inv * (1 - ramp)  # 0: keep theta_k (fast dims), 1: theta_k / s
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv.float(), attention


def _float32_scaling(
    d: int, base: float, scaling: str, factor: float, L: int, seq_len: Optional[int], longrope
) -> tuple[torch.Tensor, float]:
    """llama3 and longrope as transformers' `_compute_llama3_parameters` and
    `_compute_longrope_parameters` compute them, operation for operation in float32."""
    exponent = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # (d/2,) = 2k/d
    if scaling == "longrope":
        if longrope is None:
            raise PosbenchError(LONGROPE_NEEDS)
        f = longrope[1] if seq_len and seq_len > L else longrope[0]
        if len(f) != d // 2:
            raise PosbenchError(f"longrope's factors: {len(f)} given, one per rotated pair is {d // 2}")
        inv = 1.0 / (torch.tensor(f, dtype=torch.float32) * base**exponent)  # (d/2,)
        return inv, math.sqrt(1 + math.log(factor) / math.log(L)) if factor > 1 else 1.0
    low, high = LLAMA3
    inv = 1.0 / (base**exponent)  # (d/2,)
    wavelen = 2 * math.pi / inv  # (d/2,) tokens per turn; L / wavelen = r_k, the turns in L
    inv = torch.where(wavelen > L / low, inv / factor, inv)  # r_k < 1: theta_k / s
    g = (L / wavelen - low) / (high - low)  # (d/2,)
    between = (wavelen >= L / high) & (wavelen <= L / low)  # 1 <= r_k <= 4
    return torch.where(between, (1 - g) * inv / factor + g * inv, inv), 1.0


def _yarn_ramp_ends(d: int, base: float, L: int, truncate: bool, betas=YARN_BETAS) -> tuple[float, float]:
    """The dimensions where a length-L window holds beta_fast (32) and beta_slow (1) turns:
    dim(r) = d * ln(L / (2 pi r)) / (2 ln base), floored/ceiled, clipped to [0, d-1]."""

    def dim(turns):
        return d * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim(betas[0]), dim(betas[1])
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    return low, (high + 0.001 if high == low else high)  # transformers' guard against 0/0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: dim k is paired with dim k + d/2."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat([-x2, x1], dim=-1)  # (..., D)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each pair (x_k, x_{k+R/2}) of the first R dims of (B, H, T, D) x by the angle
    whose cos and sin are (T, R) tables holding each angle twice, once per half; dims R..D-1
    pass unchanged (transformers' partial rotary, `apply_rotary_pos_emb`)."""
    R = cos.size(-1)
    if R < x.size(-1):
        return torch.cat([apply_rotary(x[..., :R], cos, sin), x[..., R:]], dim=-1)  # (B, H, T, D)
    return x * cos + rotate_half(x) * sin  # (B, H, T, D)


def rotated_dims(head_dim: int, fraction: float) -> int:
    """R, the dims of a head that rotate: int(fraction * d), truncated as transformers'
    `partial_rotary_factor` and GPT-NeoX's `rotary_pct` (0.25 of 32 is 8, of 36 is 9, refused)."""
    return int(head_dim * fraction)


def kept_pairs(R: int, base: float, keep: float = 1.0, hope_len: Optional[int] = None) -> torch.Tensor:
    """(R/2,) bool, True for the pairs that rotate; the others get theta_k = 0 and pass unrotated.
    keep (p-RoPE, Barbero 2025): the first int(keep * R // 2) pairs, the fastest, as transformers'
    `proportional` rope type (Gemma's p-RoPE); HoPE (Chen 2025): the pairs whose wavelength
    2 pi / theta_k is at most the training length `hope_len`, theta_k = base^(-2k/R) unscaled."""
    kept = torch.arange(R // 2) < int(keep * R // 2)  # (R/2,)
    if hope_len is not None:
        wavelength = 2 * math.pi * base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
        kept &= wavelength <= hope_len
    return kept


class RoPE(PositionalScheme):
    """Rotates dims (k, k + R/2) of q and k by angle p * theta_k, theta_k = base^(-2k/R). This
    pairs the halves (like transformers and x-transformers) instead of neighbours (2k, 2k+1);
    the two are the same rotation up to a fixed permutation of dims, which the q/k projections
    absorb. At evaluation, its variants rescale theta_k (see `rope_frequencies`) with
    s = L'/L (evaluation length over training length, at least 1) unless a factor is fixed; `dynamic`
    uses transformers' factor (default 1) and grows s with each forward's own length.

    Options (docs/schemes.md, "RoPE options"):
      base      theta_k = base^(-2k/R)
      fraction  R = int(fraction * d) dims rotate, the first R of each head, with the whole
                spectrum squeezed into them; the other d - R pass unchanged (transformers'
                partial_rotary_factor, GPT-NeoX's rotary_pct)
      keep      p-RoPE: the spectrum over R stays, the slowest pairs past the first
                int(keep * R // 2) get theta_k = 0 (unrotated)
      hope      HoPE: theta_k = 0 for every pair whose wavelength 2 pi / theta_k exceeds the
                training length L (it never turns once within a training window)
    A variant scales the rotating pairs only: a zero theta_k stays zero."""

    description = "rotates q and k by position-proportional angles; q.k depends on i-j (Su 2021)"
    options = {"base": 10000.0, "fraction": 1.0, "keep": 1.0, "hope": False}
    added_later = ("fraction", "keep", "hope")
    eval_variants = {
        "linear": "RoPE with positions interpolated, theta/s (Chen 2023)",
        "ntk": "RoPE with an NTK-aware base, base*s^(d/(d-2)) (bloc97 2023); transformers has no static type for it",
        "dynamic": "RoPE with dynamic NTK, s grown with each forward's length (emozilla 2023); transformers' dynamic",
        "yarn": "RoPE with YaRN's per-dimension ramp and attention factor (Peng 2023)",
        "llama3": "RoPE with Llama 3.1's ramp: theta/s below 1 turn in L, theta above 4 (Meta 2024)",
        "longrope": "RoPE rescaled by factors searched per model, Phi-3's (Ding 2024); refused: runs have none",
        **PositionalScheme.eval_variants,  # the training-free ones every scheme takes
    }
    # LongRoPE's (short_factor, long_factor), d_head/2 factors each, found by a search on one
    # trained model's perplexity. posbench runs no such search, so rope has none and refuses
    # longrope; a subclass (module:Class) given a model's searched factors sets them here.
    longrope: Optional[tuple[Sequence[float], Sequence[float]]] = None

    @classmethod
    def refuses(cls, variant: str) -> Optional[str]:
        return LONGROPE_NEEDS if variant == "longrope" and cls.longrope is None else super().refuses(variant)

    def __init__(self, cfg):
        super().__init__(cfg)
        where = f"scheme_options.{cfg.scheme}"
        if self.opt["base"] <= 1:  # theta_k = base^(-2k/d) must fall with k; YaRN divides by log(base)
            raise PosbenchError(f"{where}.base={self.opt['base']} must be > 1")
        require_even(cfg, "the head size model.d_model / model.n_head", cfg.head_dim)
        # a subclass that declares none of fraction, keep, hope (xPos) rotates every pair
        fraction, keep = self.opt.get("fraction", 1.0), self.opt.get("keep", 1.0)
        for key, value in (("fraction", fraction), ("keep", keep)):
            if not 0 < value <= 1:
                raise PosbenchError(f"{where}.{key}={value} must be in (0, 1]")
        self.rotary_dim = R = rotated_dims(cfg.head_dim, fraction)
        if R == 0 or R % 2:
            raise PosbenchError(
                f"{where}.fraction={fraction} rotates int({fraction} * {cfg.head_dim}) = {R} dims of each head; "
                f"rotations take dims two at a time, so that must be even and at least 2"
            )
        # HoPE's cut is the parent's for a run `posbench extend` fine-tunes: it starts as its parent
        hope_len = (cfg.extend or {}).get("from_len", cfg.train_len) if self.opt.get("hope", False) else None
        self.kept = kept_pairs(R, self.opt["base"], keep, hope_len)  # (R/2,) bool
        if not self.kept.any():
            why = (
                f"keep={keep} keeps int({keep} * {R} // 2) = 0 pairs"
                if keep < 1
                else (f"hope: no pair's wavelength 2 pi base^(2k/{R}) fits in model.train_len={cfg.train_len}")
            )
            raise PosbenchError(f"{where}: {why}, so nothing rotates; that is scheme nope")
        # a run fine-tuned by `posbench extend` with a scaling keeps it for good: the same
        # rope_frequencies at s = L2/L (or the method's fixed s) as the evaluation-time
        # variant, and no variant on top
        self.fixed = (cfg.extend or {}).get("scaling")
        if self.fixed:
            self.eval_variants = {}
        keep_fast, rotating = (cfg.extend or {}).get("keep_fast", 0), int(self.kept.sum())
        if keep_fast >= rotating:
            raise PosbenchError(
                f"{cfg.extend['method']}: keeps {keep_fast} of the {rotating} frequencies of each head unscaled, so "
                f"none is scaled; keep at most {rotating - 1}"
            )

    per_row_positions = True  # rotate takes (B, T) positions too: each row of a batch its own (PoSE)

    def rotate(self, q, k, pos, layer):
        cos, sin = self.once_per_forward((pos,), lambda: self.angles(pos, q.dtype))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (B, H, T, D) each

    def theta(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """theta (R/2,) as trained or as the variant scales it, zero where a pair does not
        rotate, and the attention factor on cos and sin."""
        inv, attention = self.frequencies(self.rotary_dim, seq_len)
        return torch.where(self.kept, inv, 0.0), attention

    def frequencies(self, D: int, seq_len: int) -> tuple[torch.Tensor, float]:
        """theta_k = base^(-2k/D) for D rotating dims, scaled as trained or as the variant says."""
        v = self.variant
        if v is None and self.fixed:
            return self.fine_tuned_frequencies(D, seq_len)
        if v is None:
            return rope_frequencies(D, self.opt["base"])
        default = 1.0 if v.name == "dynamic" else max(1.0, v.length / v.train_len)  # unscaled up to L
        factor = default if v.factor is None else v.factor
        return rope_frequencies(D, self.opt["base"], v.name, factor, v.train_len, seq_len, longrope=self.longrope)

    def fine_tuned_frequencies(self, D: int, seq_len: int) -> tuple[torch.Tensor, float]:
        """The scaling `posbench extend` fixed (model.extend): its kind at its factor, YaRN's
        ramp at its betas, and the `keep_fast` fastest frequencies (k = 0, 1, ...) unscaled."""
        ext = self.cfg.extend
        betas = (ext.get("beta_fast", YARN_BETAS[0]), ext.get("beta_slow", YARN_BETAS[1]))
        inv, attention = rope_frequencies(
            D, self.opt["base"], self.fixed, ext["factor"], ext["from_len"], seq_len, betas=betas
        )  # (D/2,)
        keep = ext.get("keep_fast", 0)
        if keep:
            inv = torch.cat([rope_frequencies(D, self.opt["base"])[0][:keep], inv[keep:]])  # (D/2,)
        return inv, attention

    def angles(self, pos, dtype):
        """cos and sin, (T, R) each for (T,) positions, (B, 1, T, R) for a row's own (B, T)."""
        inv, attention = self.theta(pos.size(-1))
        ang = pos.float()[..., None] * inv.to(pos.device)  # (T, R/2) or (B, T, R/2)
        cos, sin = ang.cos() * attention, ang.sin() * attention  # transformers scales both
        cos, sin = torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)  # (..., T, R)
        return (cos, sin) if pos.dim() == 1 else (cos[:, None], sin[:, None])


class XPos(RoPE):
    """xPos (Sun et al. 2023): RoPE whose score q_i.k_j is also scaled by zeta_k^((i-j)/gamma),
    zeta_k = (2k + 0.4 d) / (1.4 d) < 1 per frequency k, gamma = scale_base (512), so far
    keys are damped, more so in the fast dimensions. As in x-transformers' `rotary_xpos`, q is
    multiplied by zeta^(p/gamma) and k by zeta^(-p/gamma) after the rotation, with p counted
    from the middle of the sequence (which cancels in i-j and keeps the powers small)."""

    description = "RoPE times a per-dimension decay zeta_k^((i-j)/gamma) (Sun 2023, xPos)"
    per_row_positions = False
    options = {"base": 10000.0, "scale_base": 512.0}
    eval_variants = PositionalScheme.eval_variants  # RoPE's scalings were not defined for xPos's decay
    fixed_distances = "its decay is centred on each call's positions, so q and k rotated apart do not meet at i-j"

    def rotate(self, q, k, pos, layer):
        cos, sin, up = self.once_per_forward((pos,), lambda: self.xpos(pos, q.size(-1), q.dtype))
        q = apply_rotary(q, cos, sin) * up  # (B, H, T, D)
        k = apply_rotary(k, cos, sin) / up
        return q, k

    def xpos(self, pos, D, dtype):
        cos, sin = self.angles(pos, dtype)  # (T, D) each
        zeta = (torch.arange(0, D, 2, device=pos.device).float() + 0.4 * D) / (1.4 * D)  # (D/2,)
        power = (pos - pos.max() // 2).float() / self.opt["scale_base"]  # (T,)
        up = zeta[None, :] ** power[:, None]  # (T, D/2)
        return cos, sin, up.repeat(1, 2).to(dtype)


class SSMax(RoPE):
    """Scalable-Softmax (Nakanishi 2025, arXiv 2501.19399) on RoPE: the query at index i, which
    sees n = i + 1 keys under the causal mask, has its logits multiplied by s_h log n, s_h
    learned per layer and head:

        softmax_j( (s_h log n) * q_i.k_j / sqrt(d) )  =  softmax_j( n^(s_h q_i.k_j / sqrt(d)) )

    so the largest weight no longer fades as n grows. As the paper writes it, the factor is
    applied to q (it is one per query row), here after RoPE's rotation; with `bias`, the factor
    is s_h log n + b_h (the paper's variant with a bias, b_h learned, starting at 0). s starts
    at `s`, or at 1 / ln(L) (L = model.train_len) when null, so that at the training length the
    factor starts at 1 and the model starts as plain RoPE. n counts keys by index, as the mask
    does, never by position value. RoPE's scalings and the training-free remaps apply to the
    rotation; YaRN and logn are left out, as YaRN's attention factor 0.1 ln(L'/L) + 1 and logn's
    log n / log L are a second length-dependent temperature on top of SSMax's own."""

    description = "RoPE with Scalable-Softmax: logits times s_h log n, n = keys the query sees (Nakanishi 2025)"
    options = {**RoPE.options, "s": None, "bias": False}  # s null: 1 / ln(model.train_len)
    added_later = ()  # every option is in every ssmax run's record
    eval_variants = {k: v for k, v in RoPE.eval_variants.items() if k not in ("yarn", "logn")}
    counts_keys = True  # its factor is s log(i + 1): a pattern's window or chunk shows fewer keys

    @classmethod
    def refuses(cls, variant: str) -> Optional[str]:
        if variant == "logn":  # said here too, so a pattern with an ssmax layer leaves logn out
            return "logn's log n / log L is a second temperature on top of ssmax's own s log n"
        return super().refuses(variant)

    def __init__(self, cfg):
        super().__init__(cfg)
        s0 = self.opt["s"]
        if s0 is None:
            s0 = 1 / math.log(max(cfg.train_len, 2))
        elif isinstance(s0, bool) or not isinstance(s0, (int, float)) or not s0 > 0:
            raise PosbenchError(f"scheme_options.{cfg.scheme}.s={s0!r}: expected a positive number, or null")
        H = cfg.n_head
        # one (H,) vector per layer: a 1-d parameter, which AdamW does not decay towards 0
        self.s = nn.ParameterList(nn.Parameter(torch.full((H,), float(s0))) for _ in range(cfg.n_layer))
        self.b = (
            nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(cfg.n_layer)) if self.opt["bias"] else None
        )

    def rotate(self, q, k, pos, layer):
        q, k = super().rotate(q, k, pos, layer)  # (B, H, T, D) each
        log_n = torch.arange(1, q.size(2) + 1, device=q.device, dtype=q.dtype).log()  # (T,): n = i + 1
        scale = self.s[layer][:, None] * log_n[None, :]  # (H, T)
        if self.b is not None:
            scale = scale + self.b[layer][:, None]
        return q * scale[:, :, None].to(q.dtype), k  # (B, H, T, D) each
