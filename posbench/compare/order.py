"""The order rows and panels come in: schemes as the registry lists them, grid points by their settings."""

from __future__ import annotations

import pandas as pd


def point_order(df: pd.DataFrame) -> list:
    """The grid points in order of their settings (numbers as numbers), or [None] for none."""
    if "point" not in df:
        return [None]
    first = df.groupby("point")["train_len"].first()
    return sorted(first.index, key=lambda p: (first[p], p))


def scheme_order(names: set) -> list[str]:
    """Registry order (the order of the paper tables), each scheme followed by its
    evaluation-time variants (rope, rope+ntk, rope+yarn, ...) and its modified selves
    (noisy_rope, offset_rope); then the fine-tuned children (rope:pi), by parent in that order
    and by method, so that extend's table keeps every parent together (alibi and hybrid above
    rope's children, not below them); plugins after."""
    from posbench.extend.methods import METHODS, base_method
    from posbench.schemes import SCHEMES

    def method(n):  # a fine-tuned run's rows (rope:yarn, rope:yarn-fast8) in the order of the methods
        m = base_method(n.partition(":")[2])
        return list(METHODS).index(m) if m in METHODS else len(METHODS), n

    order = []
    for s in SCHEMES:
        order += [s] if s in names else []
        order += sorted(n for n in names if n.startswith(s + "+"))
        order += sorted(n for n in names if base_of(n) == s and n != s and "+" not in n and ":" not in n)
    place = {s: i for i, s in enumerate(SCHEMES)}

    def child(n):  # rope:pi by its parent's place (rope, then noisy_rope), whether or not the parent is a row here
        parent = n.partition(":")[0]
        return place[base_of(parent)], parent != base_of(parent), parent, method(n)

    order += sorted((n for n in names if ":" in n and base_of(n) in place and n not in order), key=child)
    return order + sorted(names - set(order))


def base_of(name: str) -> str:
    """The trained scheme a row stands on: rope for rope, rope+yarn, rope:pi, noisy_rope and offset_rope."""
    from posbench.schemes import MODIFIERS

    name = name.partition("+")[0].partition(":")[0]
    for prefix in MODIFIERS:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name
