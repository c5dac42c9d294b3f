"""Positional schemes, one family per module, and the registry that names them."""

from __future__ import annotations

import difflib

from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.plugins import load_plugin
from posbench.schemes.absolute import Learned, Sinusoidal, sinusoid
from posbench.schemes.alibi import ALiBi, alibi_slopes
from posbench.schemes.base import EvalVariant, NoPE, PositionalScheme, require_even, variant_label
from posbench.schemes.cope import CoPE, cope_bias
from posbench.schemes.fire import FIRE
from posbench.schemes.kerple import KerpleLog, KerplePower
from posbench.schemes.randomized import Randomized
from posbench.schemes.rope import ROPE_SCALINGS, RoPE, XPos, rope_frequencies
from posbench.schemes.t5 import Hybrid, T5Bias, t5_relative_bucket
from posbench.schemes.xl import TransformerXL, rel_shift

__all__ = [
    "SCHEMES",
    "catalogue",
    "resolve_scheme",
    "build_scheme",
    "PositionalScheme",
    "EvalVariant",
    "variant_label",
    "require_even",
    "NoPE",
    "Sinusoidal",
    "Learned",
    "T5Bias",
    "TransformerXL",
    "RoPE",
    "ALiBi",
    "Hybrid",
    "XPos",
    "KerpleLog",
    "KerplePower",
    "FIRE",
    "Randomized",
    "CoPE",
    "sinusoid",
    "t5_relative_bucket",
    "rel_shift",
    "rope_frequencies",
    "ROPE_SCALINGS",
    "alibi_slopes",
    "cope_bias",
]

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
        return load_plugin(
            name, "scheme", PositionalScheme, "posbench.schemes.PositionalScheme", "examples.my_scheme:MyScheme"
        )
    base, plus, variant = name.partition("+")
    if plus and variant in getattr(SCHEMES.get(base), "eval_variants", {}):
        raise PosbenchError(
            f"'{name}' is an evaluation-time variant of {base}, not a scheme to train: train "
            f"{base} and add --rope-scaling {variant} (or eval.rope_scaling: [{variant}])"
        )
    close = difflib.get_close_matches(name, list(SCHEMES), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise PosbenchError(f"unknown scheme '{name}'{hint}; valid schemes: {', '.join(SCHEMES)}, or module:Class")


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
