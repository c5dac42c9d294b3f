"""Context extension by fine-tuning: `posbench extend`, its methods, and what each changes.

A finished run (the parent), trained at L, is copied and fine-tuned at a longer length L2 for
K steps with one method. The child is a run like any other: its own folder, checkpoints, lock
and records, scored with its parent's measure. Its model.extend names the method, L, L2, the
RoPE scaling the method fixes, and the parent's identity (the hash of what decided its
weights), so a child is never silently reused after its parent was retrained. s = L2 / L.

  pi           rope: theta_k / s (Chen 2023)                                   then K steps at L2
  ntk          rope: base * s^(d/(d-2)) (bloc97 2023)                          then K steps at L2
  yarn         rope: YaRN's ramp, beta_fast 32, beta_slow 1, and its attention
               factor 0.1 ln s + 1 (Peng 2023)                                 then K steps at L2
  abf          rope: base raised to abf_base, 500,000 (Xiong 2023)             then K steps at L2
  pose         rope: pi's interpolation, K steps at L with position ids in two chunks, the
               second shifted by a skip from 0..L2-L, so that they cover 0..L2-1 (Zhu 2023)
  interpolate  learned: rows 0..L2-1 of the table are its trained rows 0..L-1 resized by
               linear interpolation (PI's idea for absolute positions)      then K steps at L2
  plain        any scheme: nothing changed (a learned table shorter than L2 grows, its new rows
               initialised as GPT-2's, N(0, 0.02))                          then K steps at L2

pi, ntk, yarn and pose scale with the same `rope_frequencies` as the evaluation-time variants,
at the fixed s = L2/L. The experiment folder of an extension holds, per parent, a copy of the
parent scored as it is and with each of its evaluation-time variants, and every child.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError
from posbench.registry import did_you_mean

EXTEND_RECORD = "extend.yaml"  # the extension an experiment folder holds: parents, L2, K, methods
PARENT = "parent.txt"  # a run folder's parent run folder, as a path (its identity is in model.extend)
CURVE = "curve.csv"  # a child's perplexity at L2 after some of its fine-tuning steps
CURVE_COLUMNS = ["scheme", "seed", "step", "length", "loss", "ppl", "tokens"]
ABF_BASE = 500000.0  # Xiong et al.'s base for Llama 2 Long (from 10,000)


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    schemes: Optional[tuple] = None  # the schemes it applies to; None: every scheme
    scaling: Optional[str] = None  # the RoPE scaling it fixes (a `rope_frequencies` kind)
    at_parent_len: bool = False  # it fine-tunes at L, not L2 (PoSE)


METHODS = {
    m.name: m
    for m in (
        Method("pi", "RoPE positions interpolated, theta/s, then fine-tuned at L2 (Chen 2023)", ("rope",), "linear"),
        Method("ntk", "RoPE with an NTK-aware base, base*s^(d/(d-2)), then fine-tuned at L2", ("rope",), "ntk"),
        Method(
            "yarn", "RoPE with YaRN's ramp and attention factor, then fine-tuned at L2 (Peng 2023)", ("rope",), "yarn"
        ),
        Method("abf", "RoPE with its base raised (--abf-base), then fine-tuned at L2 (Xiong 2023)", ("rope",)),
        Method(
            "pose",
            "RoPE interpolated as pi, fine-tuned at L with position ids skipped to cover 0..L2-1 (Zhu 2023)",
            ("rope",),
            "linear",
            at_parent_len=True,
        ),
        Method("interpolate", "the learned table's trained rows resized to L2, then fine-tuned at L2", ("learned",)),
        Method("plain", "fine-tuned at L2 with nothing changed", None),
    )
}


def child_label(scheme: str, method: str) -> str:
    """The rows of a fine-tuned run: rope:yarn (rope+yarn is the parent scaled at evaluation only)."""
    return f"{scheme}:{method}"


def parse_methods(text: str) -> list[Method]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise PosbenchError("--methods is empty; give some of " + ", ".join(METHODS))
    for n in names:
        if n not in METHODS:
            raise PosbenchError(
                f"--methods: unknown method '{n}'{did_you_mean(n, METHODS)}; valid: {', '.join(METHODS)}"
            )
    return [METHODS[n] for n in dict.fromkeys(names)]


def applies(method: Method, scheme: str) -> bool:
    return method.schemes is None or scheme in method.schemes


# --- the parents ---------------------------------------------------------------------------------


def read_curve(rdir: Path) -> list[dict]:
    path = Path(rdir) / CURVE
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
