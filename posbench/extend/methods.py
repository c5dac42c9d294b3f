"""The extension methods (METHODS) and their parser: what each one changes in a parent before it is fine-tuned.

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
  pose         rope: pi's interpolation, at L with each sample's position ids in two chunks,
               the second shifted by a skip from 0..L2-L, so that they cover 0..L2-1 (Zhu 2023)
  interpolate  learned: row j of the table at L2 is the trained table at j/s, PI's map,
               linearly between its two neighbours                             then K steps at L2
  plain        any scheme: nothing changed (a learned table shorter than L2 grows, its new rows
               initialised as GPT-2's, N(0, 0.02))                          then K steps at L2
  continue     any scheme: nothing changed, the parent trained further at L: the control that
               says how much of a child's gain is more training

A method's budget is counted in trained tokens: K steps x batch x L2. One that trains at L
(pose, continue) takes a batch s times the parent's, so every method has trained on the same
tokens at every step of its curve.

A method takes parameters after its name, so variants sit side by side in one extension:
  pi@2        a fixed factor s = 2 instead of L2/L (pi, pose)
  pi-keep2    the 2 fastest RoPE frequencies (k = 0, 1) left unscaled (pi, pose)
  yarn-fast8  YaRN's beta_fast, -slow2 its beta_slow: the turns in L that bound its ramp
  abf-base20000  ABF's base, in place of --abf-base

pi, ntk, yarn and pose scale with the same `rope_frequencies` as the evaluation-time variants,
at the fixed s = L2/L (or the method's @s). The experiment folder of an extension holds, per parent, a copy of the
parent scored as it is and with each of its evaluation-time variants, and every child.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from posbench.errors import PosbenchError, first_line
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
    at_parent_len: bool = False  # it fine-tunes at L, not L2 (PoSE), on a batch s times as large
    takes: tuple = ()  # what may follow its name: "@" a fixed factor, "keep", "fast", "slow", "base"
    given: tuple = ()  # (parameter, value) pairs, as written after its name
    factor: Optional[float] = None  # a fixed s (pi@2); None: L2 / L

    @property
    def base(self) -> str:
        """The method this one is a variant of: pi for pi@2-keep2."""
        return base_method(self.name)

    def value(self, key: str, default=None):
        return dict(self.given).get(key, default)


METHODS = {
    m.name: m
    for m in (
        Method(
            "pi",
            "RoPE positions interpolated, theta/s, then fine-tuned at L2 (Chen 2023)",
            ("rope",),
            "linear",
            takes=("@", "keep"),
        ),
        Method("ntk", "RoPE with an NTK-aware base, base*s^(d/(d-2)), then fine-tuned at L2", ("rope",), "ntk"),
        Method(
            "yarn",
            "RoPE with YaRN's ramp and attention factor, then fine-tuned at L2 (Peng 2023)",
            ("rope",),
            "yarn",
            takes=("fast", "slow"),
        ),
        Method(
            "abf",
            "RoPE with its base raised (--abf-base), then fine-tuned at L2 (Xiong 2023)",
            ("rope",),
            takes=("base",),
        ),
        Method(
            "pose",
            "RoPE interpolated as pi, fine-tuned at L with each sample's position ids skipped to cover 0..L2-1 "
            "(Zhu 2023)",
            ("rope",),
            "linear",
            at_parent_len=True,
            takes=("@", "keep"),
        ),
        Method("interpolate", "the learned table read at j/s for row j, then fine-tuned at L2", ("learned",)),
        Method("plain", "fine-tuned at L2 with nothing changed", None),
        Method("continue", "the parent trained further at L, nothing changed: the control", None, at_parent_len=True),
    )
}
SPELLING = re.compile(r"([a-z_]+)(@[^-]*)?((?:-[a-z]+[^-]*)*)")  # pi@2-keep2: name, @factor, -parameters


def base_method(name: str) -> str:
    """pi for pi@2-keep2: the registered method a spelled one is a variant of."""
    return re.split(r"[@-]", name, maxsplit=1)[0]


def child_label(scheme: str, method: str) -> str:
    """The rows of a fine-tuned run: rope:yarn (rope+yarn is the parent scaled at evaluation only)."""
    return f"{scheme}:{method}"


def parse_methods(text: str) -> list[Method]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise PosbenchError("--methods is empty; give some of " + ", ".join(METHODS))
    return [parse_method(n) for n in dict.fromkeys(names)]


def parse_method(text: str) -> Method:
    """A method as spelled: its name, then a fixed factor (@2) and parameters (-keep2), each
    taken only by the methods that have it."""
    match = SPELLING.fullmatch(text)
    name = base_method(text)
    if name not in METHODS:
        raise PosbenchError(
            f"--methods: unknown method '{name}'{did_you_mean(name, METHODS)}; valid: {', '.join(METHODS)}"
        )
    method = METHODS[name]
    if match is None:
        raise PosbenchError(f"--methods {text}: expected a method, then @FACTOR and -PARAMETERVALUE, as pi@2-keep2")
    factor, given = None, []
    if match.group(2):
        if "@" not in method.takes:
            raise PosbenchError(f"--methods {text}: {name} takes no fixed factor (@); pi and pose do")
        factor = _number(text, match.group(2)[1:], "the factor")
        if not factor > 0:
            raise PosbenchError(f"--methods {text}: the factor must be positive")
    for part in match.group(3).split("-")[1:]:
        key, value = re.fullmatch(r"([a-z]+)(.*)", part).groups()
        if key not in method.takes:
            has = ", ".join(k for k in method.takes if k != "@") or "none"
            raise PosbenchError(f"--methods {text}: {name} takes no parameter '{key}' (its parameters: {has})")
        number = _number(text, value, key)
        if key == "keep" and not (number == int(number) and number >= 0):
            raise PosbenchError(f"--methods {text}: keep counts frequencies, a whole number, not {value}")
        if key in ("fast", "slow") and not number > 0 or key == "base" and not number > 1:
            raise PosbenchError(f"--methods {text}: {key} must be {'> 1' if key == 'base' else 'positive'}")
        given.append((key, int(number) if key == "keep" else number))
    if dict(given).get("fast", 32.0) <= dict(given).get("slow", 1.0):  # YaRN's own (rope.YARN_BETAS) by default
        raise PosbenchError(f"--methods {text}: YaRN's fast turns must exceed its slow ones")
    return replace(method, name=text, given=tuple(given), factor=factor)


def _number(text: str, value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise PosbenchError(f"--methods {text}: {what} '{value}' is not a number")
    return number


def method_of(name: str) -> Optional[Method]:
    """A child's method from the name its model.extend records (None: not one posbench knows)."""
    try:
        return parse_method(name)
    except PosbenchError:
        return None


def applies(method: Method, scheme: str) -> bool:
    return method.schemes is None or scheme in method.schemes


def trained_tokens(cfg) -> int:
    """A run's training budget in trained tokens: steps x batch x length."""
    return cfg.train.steps * cfg.train.batch_size * cfg.model.train_len


# --- the parents ---------------------------------------------------------------------------------


def read_curve(rdir: Path) -> list[dict]:
    """A child's curve.csv rows ([] where it has none); malformed rows are one line."""
    path = Path(rdir) / CURVE
    if not path.is_file():
        return []
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        if reader.fieldnames != CURVE_COLUMNS:
            raise ValueError(f"columns {reader.fieldnames}")
        for r in rows:
            int(r["seed"]), int(r["step"]), int(r["length"]), float(r["loss"] or "nan"), float(r["ppl"] or "nan")
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise PosbenchError(
            f"{path}: malformed fine-tuning curve rows ({first_line(e, 80)}); expected the columns "
            f"{','.join(CURVE_COLUMNS)}"
        ) from None
    return rows
