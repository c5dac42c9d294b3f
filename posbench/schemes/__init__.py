"""Positional schemes, one family per module, and the registry that names them.

The registry and this package import no scheme module until a scheme is used, so the names
(and their order, the order of the paper tables) are known without torch.
"""

from __future__ import annotations

import importlib
from typing import Optional

from posbench.errors import PosbenchError
from posbench.registry import Registry


def _explain(name: str) -> None:
    base, plus, variant = name.partition("+")
    if plus and base in SCHEMES and variant in SCHEMES[base].eval_variants:
        raise PosbenchError(
            f"'{name}' is an evaluation-time variant of {base}, not a scheme to train: train "
            f"{base} and add --rope-scaling {variant} (or eval.rope_scaling: [{variant}])"
        )


PATTERNS = ("rnope_swa", "irope", "gemma3")  # presets of posbench/schemes/pattern.py, with pattern_<label>

# evaluation-time variants by name, so that a report sorts and draws their rows with no scheme
# (and no torch) imported: the training-free ones every scheme declares (training_free.VARIANTS)
# and RoPE's scalings (RoPE.eval_variants), each in its table's order
TRAINING_FREE_NAMES = ("self_extend", "rerope", "string", "lm_infinite", "logn")
ROPE_SCALING_NAMES = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")


SCHEMES = Registry(
    "scheme",
    {
        "nope": "posbench.schemes.base:NoPE",
        "sinusoidal": "posbench.schemes.absolute:Sinusoidal",
        "learned": "posbench.schemes.absolute:Learned",
        "t5": "posbench.schemes.t5:T5Bias",
        "xl": "posbench.schemes.xl:TransformerXL",
        "rope": "posbench.schemes.rope:RoPE",
        "alibi": "posbench.schemes.alibi:ALiBi",
        "hybrid": "posbench.schemes.t5:Hybrid",
        "xpos": "posbench.schemes.rope:XPos",
        "kerple_log": "posbench.schemes.kerple:KerpleLog",
        "kerple_power": "posbench.schemes.kerple:KerplePower",
        "fire": "posbench.schemes.fire:FIRE",
        "randomized": "posbench.schemes.randomized:Randomized",
        "offset": "posbench.schemes.randomized:Offset",
        "cope": "posbench.schemes.cope:CoPE",
        "ssmax": "posbench.schemes.rope:SSMax",
        "fox": "posbench.schemes.fox:FoX",
        "stickbreaking": "posbench.schemes.stickbreaking:StickBreaking",
    },
    base="posbench.schemes:PositionalScheme",
    example="examples.my_scheme:MyScheme",
    explain=_explain,
    derive=lambda name, registry: _pattern(name, registry) or _modified(name, registry),
    forms=(
        PATTERNS,
        "the patterns over layers rnope_swa, irope, gemma3 and pattern_<label>, noisy_<scheme>, offset_<scheme>",
    ),
    # what papers and other libraries call them, suggested for an unknown name
    aliases={
        "rotary": "rope",
        "roformer": "rope",
        "none": "nope",
        "transformer-xl": "xl",
        "transformer_xl": "xl",
        "gpt2": "learned",
        "gpt-2": "learned",
        "forgetting": "fox",
        "forgetting_transformer": "fox",
        "stick_breaking": "stickbreaking",
        "stick-breaking": "stickbreaking",
    },
)


# prefix -> the modifier it applies to the scheme named after it, and how that scheme trains:
# noisy_rope is rope on sorted random positions (randomized with base rope)
MODIFIERS = {"noisy_": ("randomized", "on sorted random positions"), "offset_": ("offset", "from a random start")}


def _pattern(name: str, registry):
    """A preset pattern over layers (rnope_swa, irope, gemma3) or the user's own, pattern_<label>."""
    if name not in PATTERNS and not name.startswith("pattern_"):
        return None  # no scheme module is imported for any other name
    from posbench.schemes.pattern import pattern

    return pattern(name, registry)


def _modified(name: str, registry):
    """noisy_<scheme> and offset_<scheme>: a modifier of a registered scheme (or module:Class)."""
    prefix = next((p for p in MODIFIERS if name.startswith(p) and len(name) > len(p)), None)
    if prefix is None:
        return None  # no scheme module is imported for any other name
    from posbench.schemes.randomized import modified

    modifier, what = MODIFIERS[prefix]
    return modified(name, name[len(prefix) :], registry.lookup(modifier), what, registry)


def run_label(model_cfg) -> str:
    """The scheme column of a run's rows: rope, rope:yarn for a run that `posbench extend`
    fine-tuned from a rope run with method yarn, or a pretrained model's name."""
    if getattr(model_cfg, "pretrained", None):
        return model_cfg.pretrained["name"]
    ext = model_cfg.extend
    return f"{model_cfg.scheme}:{ext['method']}" if ext else model_cfg.scheme


def variant_label(scheme: str, variant: Optional[str], factor: Optional[float] = None) -> str:
    """The scheme column of a row: `rope`, `rope+yarn`, or `rope+yarn@4` for a fixed factor 4."""
    if variant is None:
        return scheme
    return f"{scheme}+{variant}" + (f"@{factor:g}" if factor is not None else "")


def label_variant(label: str) -> tuple[str, Optional[str]]:
    """variant_label read back: ('rope', 'yarn') for rope+yarn or rope+yarn@4, ('rope', None) for rope."""
    base, _, variant = label.partition("+")
    return base, variant.partition("@")[0] or None


# the schemes that rotate q and k by theta_k = base^(-2k/d), and the option holding base: the RoPE
# scaling law (posbench/rope_law.py) predicts where their runs break, with no scheme imported
ROTARY_BASE = {"rope": "base", "ssmax": "base"}

SEED_SCHEMES = ["nope", "sinusoidal", "learned", "t5", "xl", "rope", "alibi", "hybrid"]  # the default experiment

_EXPORTS = {  # what `from posbench.schemes import X` gives, imported on first use
    "posbench.schemes.base": ["PositionalScheme", "EvalVariant", "NoPE", "require_even"],
    "posbench.schemes.distance": ["DistanceBias", "DistanceTable"],
    "posbench.schemes.absolute": ["Sinusoidal", "Learned", "sinusoid"],
    "posbench.schemes.t5": ["T5Bias", "Hybrid", "t5_relative_bucket"],
    "posbench.schemes.xl": ["TransformerXL", "rel_shift"],
    "posbench.schemes.rope": ["RoPE", "XPos", "SSMax", "rope_frequencies", "ROPE_SCALINGS"],
    "posbench.schemes.alibi": ["ALiBi", "alibi_slopes"],
    "posbench.schemes.kerple": ["KerpleLog", "KerplePower"],
    "posbench.schemes.fire": ["FIRE"],
    "posbench.schemes.randomized": ["Randomized", "Offset"],
    "posbench.schemes.cope": ["CoPE", "cope_bias"],
    "posbench.schemes.fox": ["FoX"],
    "posbench.schemes.stickbreaking": ["StickBreaking", "StickBreakingAttention", "stick_breaking"],
    "posbench.schemes.pattern": ["Pattern", "Layer", "window_mask"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "SCHEMES",
    "SEED_SCHEMES",
    "PATTERNS",
    "TRAINING_FREE_NAMES",
    "ROPE_SCALING_NAMES",
    "catalogue",
    "resolve_scheme",
    "build_scheme",
    "check_hint",
    *_WHERE,
]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        if "registry" in vars(value) if isinstance(value, type) else False:  # as SCHEMES[...] gives it
            value.registry = value.registry or SCHEMES
        return value
    raise AttributeError(f"module 'posbench.schemes' has no attribute '{name}'")


def catalogue() -> list[tuple[str, str]]:
    """(name, description) of every registered scheme, each followed by its own evaluation-time
    variants, which are rows of a report rather than schemes that can be trained; then the
    training-free variants, each with the schemes that take it."""
    from posbench.schemes.training_free import VARIANTS as TRAINING_FREE

    rows = []
    for name, cls in SCHEMES.items():
        rows.append((name, cls.description))
        for variant, what in cls.eval_variants.items():
            if variant not in TRAINING_FREE:
                rows.append((f"{name}+{variant}", f"evaluation-time variant of {name}: {what}"))
    for variant, what in TRAINING_FREE.items():
        takers = [n for n, c in SCHEMES.items() if variant in c.eval_variants and not c.refuses(variant)]
        takers = "every scheme" if len(takers) == len(SCHEMES) else ", ".join(takers) + " and patterns"
        rows.append((f"<scheme>+{variant}", f"training-free variant of {takers}: {what}"))
    from posbench.schemes.pattern import Pattern

    rows += [(name, SCHEMES.lookup(name).description) for name in PATTERNS]
    rows += [
        ("pattern_<label>", Pattern.description),
        ("noisy_<scheme>", "any scheme trained and evaluated on sorted random positions (randomized with that base)"),
        ("offset_<scheme>", "any scheme trained on positions from a random start (offset with that base)"),
    ]
    return rows


def resolve_scheme(name: str) -> type:
    """A registered name, or `module:Class` naming a user's PositionalScheme subclass."""
    return SCHEMES.lookup(name)


def check_hint(name: str) -> str:
    """What a user's scheme that fails to build is told to run."""
    return f"; `posbench check-scheme {name}` checks it step by step"


def build_scheme(cfg):
    """The scheme a model config names, built with its options; one whose own tensors would not
    fit in this machine's memory is refused before any is allocated."""
    _check_size(cfg)
    return SCHEMES.build(cfg.scheme, cfg, hint=check_hint(cfg.scheme))


def _check_size(cfg) -> None:
    """Counted on the meta device, where nothing is allocated: its weights and buffers as they
    are (training needs more, as check_trainable counts the model's). Only a scheme given
    options: its defaults are small. Its module is imported first, off the meta device, so
    that tensors it makes at import are real. A scheme that reads its tensors while it builds
    (RoPE's kept pairs) cannot build there, and is built for real."""
    import torch

    from posbench.config import physical_memory

    if not cfg.options:
        return
    cls = SCHEMES.lookup(cfg.scheme)
    try:
        with torch.device("meta"):
            scheme = cls(cfg)
    except Exception:
        return
    params = sum(p.numel() for p in scheme.parameters())
    need = sum(t.numel() * t.element_size() for t in (*scheme.parameters(), *scheme.buffers()))
    have = physical_memory()
    if have and need > have:
        given = ", ".join(f"{k}={v}" for k, v in cfg.options.items()) or "its defaults"
        raise PosbenchError(
            f"scheme_options.{cfg.scheme} ({given}): the scheme alone holds about {params:.2g} parameters, "
            f"{need / 2**30:.3g} GiB, more than the {have / 2**30:.0f} GiB here",
            f"scheme_options.{cfg.scheme}",
        )
