"""Positional schemes, one family per module, and the registry that names them."""

from __future__ import annotations

import difflib
import importlib
import inspect

from posbench.config import ModelConfig
from posbench.errors import PosbenchError
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
    "SCHEMES", "catalogue", "resolve_scheme", "build_scheme",
    "PositionalScheme", "EvalVariant", "variant_label", "require_even",
    "NoPE", "Sinusoidal", "Learned", "T5Bias", "TransformerXL", "RoPE", "ALiBi", "Hybrid", "XPos",
    "KerpleLog", "KerplePower", "FIRE", "Randomized", "CoPE",
    "sinusoid", "t5_relative_bucket", "rel_shift", "rope_frequencies", "ROPE_SCALINGS",
    "alibi_slopes", "cope_bias",
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
