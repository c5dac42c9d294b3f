"""Training-free evaluation-time variants that any scheme whose hooks follow the positions they are given takes.

Self-Extend, ReRoPE, STRING and LM-Infinite change which distance a (query, key) pair is scored
at; LM-Infinite also hides the middle keys, and log-n scales a far query's logits. Each is a
`Remap`: per (query i, key j) at distance d = i - j, the logit is the scheme's own at positions
(i, j) where d < `far`, and the scheme's own at the remapped positions (q'(i), k'(j)) where
d >= `far`, both from the scheme's hooks (a second `rotate` of q and k for a rotary scheme, a
second `bias` for a relative bias):

  self_extend  Self-Extend (Jin et al. 2024, "LLM Maybe LongLM"; datamllab/LongLM
               `self_extend_patch/Llama.py`): far = W, q' = floor(i/G) + W - W/G, k' = floor(j/G),
               so a grouped distance floor(i/G) - floor(j/G) + W - W/G continues from W.
               W = L/4; G (the factor) the smallest group with W + (L'-W)/G <= L/2, the README's rule
  rerope       ReRoPE (Su 2023, bojone/rerope `rerope_patch.py`): far = w, q' = w, k' = 0, so every
               distance past the window w is w. w = L/4 (the factor), the README's w1024 at 4k
  string       STRING (An et al. 2024, HKUNLP/STRING `string_for_llama.py`): far = S, q' = i - S + W,
               k' = j: a distance d >= S is scored at d - S + W. S = int(0.33 L) (the factor),
               W = min(128, S/2) (the reference's local_value 128, halved for short training lengths)
  lm_infinite  LM-Infinite (Han et al. 2024; Glaciohound/LM-Infinite `models/llama.py`): far = L,
               q' = L, k' = 0 (distances capped at L), and a key d >= n_local back is hidden unless
               it is one of the first n_global: the Lambda mask. n_local = L (the factor), n_global = 10
  logn         log-n attention temperature (Qwen's logn-attn; Chiang & Cholak 2022): the logits of
               the query that sees n keys times max(1, log n / log L); L the factor

L is the training length and L' the evaluation length. The variants compute attention by the
eager formula, `block` queries at a time, so memory stays linear in the length: evaluation only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

import torch

from posbench.errors import PosbenchError

VARIANTS = {  # name -> description; evaluated as rows "<scheme>+<name>"
    "self_extend": "Self-Extend: distances past W grouped by G, floor(i/G) - floor(j/G) + W - W/G (Jin 2024)",
    "rerope": "ReRoPE: distances past a window w clipped to w (Su 2023)",
    "string": "STRING: distances d >= S shifted to d - S + W, well-trained ones over the tail (An 2024)",
    "lm_infinite": "LM-Infinite: a Lambda mask (first 10 keys and the last L) and distances capped at L (Han 2024)",
    "logn": "log-n attention temperature: logits times max(1, log n / log L), n keys seen (Qwen; Chiang 2022)",
}
SINKS = 10  # LM-Infinite's n_global, the first keys every query keeps (its README: 10 to 100 alike)


@dataclasses.dataclass(frozen=True)
class Remap:
    """What a training-free variant changes in attention at one evaluation length."""

    name: str
    far: Optional[float] = None  # distances d >= far are scored at the positions q'(i), k'(j)
    far_q: Optional[Callable] = None  # (T,) query positions -> (T,) q'
    far_k: Optional[Callable] = None  # (T,) key positions -> (T,) k'
    local: Optional[int] = None  # a key `local` or more back is hidden, unless among the first `sinks`
    sinks: int = 0
    log_base: Optional[float] = None  # a query seeing n keys has its logits times max(1, log n / log log_base)

    def attention(self, q, k, v, pos, scheme, layer: int, block: Optional[int]) -> torch.Tensor:
        """softmax(logits, future masked) v for unrotated (B, H, T, D) q, k, v, `block` queries at a
        time, the logits from the scheme's own hooks as the variant remaps them."""
        qn, kn = scheme.rotate(q, k, pos, layer)  # (B, H, T, D) each, at their own positions
        if self.far is not None:
            qpos_far, kpos_far = self.far_q(pos), self.far_k(pos)  # (T,) each
            qf = scheme.rotate(q, q, qpos_far, layer)[0]  # (B, H, T, D): q at q'
            kf = scheme.rotate(k, k, kpos_far, layer)[1]  # (B, H, T, D): k at k'
        T = q.size(2)
        step = block or T
        out = []
        for s in range(0, T, step):
            e = min(s + step, T)
            qpos, kpos = pos[s:e], pos[:e]
            scores = logits(qn[:, :, s:e], kn[:, :, :e], qpos, kpos, scheme, layer)  # (B, H, Tq, Tk)
            d = qpos[:, None] - kpos[None, :]  # (Tq, Tk)
            if self.far is not None:
                remapped = logits(qf[:, :, s:e], kf[:, :, :e], qpos_far[s:e], kpos_far[:e], scheme, layer)
                scores = torch.where(d >= self.far, remapped, scores)
            if self.local is not None:
                hidden = (d >= self.local) & (kpos[None, :] >= self.sinks)  # (Tq, Tk)
                scores = scores.masked_fill(hidden, float("-inf"))
            future = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
            scores = scores.masked_fill(future, float("-inf"))  # causality by index, as attention.future_mask
            if self.log_base is not None:  # n: the keys each query sees, i + 1, or fewer in a pattern's window
                n = torch.isfinite(scores).sum(-1, keepdim=True).clamp(min=1).to(scores.dtype)  # (B, H, Tq, 1)
                scores = scores * (n.log() / math.log(self.log_base)).clamp(min=1)
            out.append(torch.matmul(scores.softmax(dim=-1).to(v.dtype), v[:, :, :e]))  # (B, H, Tq, D)
        return torch.cat(out, dim=2)  # (B, H, T, D)


def logits(q, k, qpos, kpos, scheme, layer: int) -> torch.Tensor:
    """q.k / sqrt(d) plus the scheme's bias at these positions: (B, H, Tq, Tk)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5  # (B, H, Tq, Tk)
    bias = scheme.bias(q, k, qpos, kpos, layer)  # None or (B or 1, H, Tq, Tk)
    return scores if bias is None else scores + bias


def remap(name: str, train_len: int, length: int, factor: Optional[float] = None) -> Remap:
    """Variant `name` of a model trained at `train_len` scored at `length`; `factor` fixes its
    main parameter (G, w, S, n_local, or log-n's base length), else derived as the module says."""
    L = train_len
    if name == "self_extend":
        W = max(1, L // 4)
        G = _whole(factor, name, "the group size G") or max(1, math.ceil((length - W) / max(1, L // 2 - W)))
        shift = W - W / G  # a whole number where G divides W, as positions are
        shift = int(shift) if shift == int(shift) else shift
        return Remap(name, far=W, far_q=lambda p: p // G + shift, far_k=lambda p: p // G)
    if name == "rerope":
        w = _whole(factor, name, "the window w") or max(1, L // 4)
        return Remap(name, far=w, far_q=lambda p: torch.full_like(p, w), far_k=torch.zeros_like)
    if name == "string":
        S = _whole(factor, name, "the shift S") or max(1, int(0.33 * L))
        W = min(128, S // 2)
        return Remap(name, far=S, far_q=lambda p: p - S + W, far_k=lambda p: p)
    if name == "lm_infinite":
        local = _whole(factor, name, "the local window n_local") or L
        return Remap(
            name, far=L, far_q=lambda p: torch.full_like(p, L), far_k=torch.zeros_like, local=local, sinks=SINKS
        )
    if name == "logn":
        base = L if factor is None else factor
        if not base > 1:
            raise PosbenchError(f"logn's factor is the base length of its log, above 1; got {factor:g}")
        return Remap(name, log_base=base)
    raise PosbenchError(f"unknown training-free variant '{name}'; valid: {', '.join(VARIANTS)}")


def _whole(factor: Optional[float], name: str, what: str) -> Optional[int]:
    if factor is None:
        return None
    if factor != int(factor) or factor < 1:
        raise PosbenchError(f"{name}'s factor is {what}, a whole number of tokens >= 1; got {factor:g}")
    return int(factor)
