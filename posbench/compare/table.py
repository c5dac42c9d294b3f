"""The one table builder: long rows to schemes x columns of means, intervals and ties.

The one table builder and the one cell: a measure's long rows -> schemes x columns of the
mean over seeds, its 95% interval, how many seeds it stands on, and the schemes tied for best."""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from posbench.stats import mean_ci, tied_for_best

OK = "ok"  # a row's status where it was scored; any other says why not (beyond-max-len, non-finite)
NON_FINITE = "non-finite"
ALL_TIED = "all tied"  # in attrs["tests"]: a column where every scheme tied, so none is bold


def summarize(
    long: pd.DataFrame,
    columns: list,
    order: list[str],
    higher_is_better: bool,
    seeds: Optional[dict[str, int]] = None,
) -> pd.DataFrame:
    """`long` holds a row per (scheme, seed, column): its `value` and `status` (OK, or why it has
    no value). The table has a row per scheme of `order` and, for each column c: c, the mean of
    the seeds scored there; `ci c`, its 95% interval (Student's t); `status c`, the first row's
    status (NaN where none was evaluated); `n c`, the seeds scored; `nonfinite c`, the seeds whose
    value blew up; `best c`, whether the scheme is best or not significantly different from the
    best, by the metric's direction, and none where every scheme scored there is (bold on every
    cell, such as a row of 0.0 past a task's training length, would single out nothing). `seeds`
    is each row's seed count (default: its own seeds). attrs["tests"]: the tests that decided the
    ties (paired, welch), and ALL_TIED where a column had no best."""
    out = pd.DataFrame(index=pd.Index(order, name="scheme"))
    scored = long[(long["status"] == OK) & long["value"].notna()]
    tests: set[str] = set()
    for c in columns:
        at, here = scored[scored["column"] == c], long[long["column"] == c]
        by_scheme = {s: dict(zip(g["seed"], g["value"])) for s, g in at.groupby("scheme", sort=False)}
        _, tied, test = tied_for_best(by_scheme, higher_is_better)
        tests |= set(test.split("+")) - {"none"}
        if len(by_scheme) > 1 and tied == set(by_scheme):
            tied, tests = set(), tests | {ALL_TIED}
        stats = {s: mean_ci(list(v.values())) for s, v in by_scheme.items()}
        first = here.groupby("scheme", sort=False)["status"].first()
        blown = here[here["status"] == NON_FINITE].groupby("scheme", sort=False)["seed"].nunique()
        out[c] = [stats[s][0] if s in stats else math.nan for s in order]
        out[f"ci {c}"] = [stats[s][1] if s in stats else math.nan for s in order]
        out[f"status {c}"] = first.reindex(order)
        out[f"n {c}"] = [len(by_scheme[s]) if s in by_scheme else math.nan for s in order]
        out[f"nonfinite {c}"] = blown.reindex(order)
        out[f"best {c}"] = [s in tied for s in order]
    own = long.groupby("scheme", sort=False)["seed"].nunique()
    out["seeds"] = [(seeds or own)[s] for s in order]
    out.attrs["tests"] = tests
    out.attrs["columns"] = list(columns)
    return out


def cell(table: pd.DataFrame, scheme: str, c, digits: int, scale: float = 1.0, missing: str = "") -> str:
    """'12.34', or '12.34 ± 0.10' (the 95% interval over seeds), each times `scale`, with
    '(1 of 3 seeds)' when fewer seeds than the row's were scored there and '; 1 non-finite' when
    some blew up; 'nan' when every seed did; `missing` (else the status) where the scheme could
    not be scored; blank where it was never evaluated."""
    v, ci, st = table.loc[scheme, c], table.loc[scheme, f"ci {c}"], table.loc[scheme, f"status {c}"]
    if not isinstance(st, str):
        return ""
    blown = table.loc[scheme, f"nonfinite {c}"]
    blown = 0 if blown != blown else int(blown)
    if v != v:  # no seed scored here
        return "nan" if blown else (missing or st)
    text = f"{scale * v:.{digits}f} ± {scale * ci:.{digits}f}" if ci == ci else f"{scale * v:.{digits}f}"
    n, of = table.loc[scheme, f"n {c}"], table.loc[scheme, "seeds"]
    if blown:
        return f"{text} ({n:.0f} of {of} seeds; {blown} non-finite)"
    return text if n == of else f"{text} ({n:.0f} of {of} seeds)"


def mean_cell(values: list[float], digits: int = 0) -> str:
    """'123 ± 14': the mean of one value per seed and its 95% interval (Student's t); the mean
    alone where there is one value. For a column a measure derives itself, beside summarize's."""
    mean, ci = mean_ci(values)
    return f"{mean:.{digits}f} ± {ci:.{digits}f}" if ci == ci else f"{mean:.{digits}f}"


def grid(
    table: pd.DataFrame, heads: list[str], digits: int, scale: float = 1.0, missing: str = "", seeds: bool = False
) -> tuple[list[list[str]], set]:
    """The table as rows of strings, a header first ("scheme" and `heads`, a head per column,
    then "seeds" with `seeds`: each row's seed count), and the (row, column) cells to set in
    bold. A measure appends its own columns to each row."""
    columns = table.attrs["columns"]
    rows, best = [["scheme", *heads] + (["seeds"] if seeds else [])], set()
    for i, s in enumerate(table.index, start=1):
        rows.append([s] + [cell(table, s, c, digits, scale, missing) for c in columns])
        rows[-1] += [str(int(table.loc[s, "seeds"]))] if seeds else []
        best |= {(i, j) for j, c in enumerate(columns, start=1) if table.loc[s, f"best {c}"]}
    return rows, best


def seeds_said(rows: pd.DataFrame) -> str:
    """The seeds a report's rows (a row per scheme, seed, ...) stand on, for its header: 'seeds
    [0, 1, 2]' where every scheme has the same, else each set with its schemes, most seeds first
    and the largest group last as the rest: 'seeds [0, 1, 2] (t5, rope); [0] (the other 6 rows)'."""
    groups: dict[tuple, list[str]] = {}
    for scheme, seeds in rows.groupby("scheme", sort=False)["seed"]:
        groups.setdefault(tuple(sorted({int(n) for n in seeds})), []).append(str(scheme))
    if len(groups) <= 1:
        return f"seeds {list(next(iter(groups), ()))}"
    rest = max(groups, key=lambda seeds: len(groups[seeds]))  # the first of the largest groups
    rest = rest if len(groups[rest]) > 1 else None
    said = [f"{list(seeds)} ({', '.join(groups[seeds])})" for seeds in sorted(groups, key=lambda s: (-len(s), s))]
    if rest is not None:
        said.remove(f"{list(rest)} ({', '.join(groups[rest])})")
        said.append(f"{list(rest)} (the other {len(groups[rest])} rows)")
    return f"seeds {'; '.join(said)}"


def spread_note(seeds: int, tests: set[str], at: str = "length", more: str = "use --seeds 0,1,2") -> str:
    """What a cell's ± and its bold mean (the best at each `at`: length, step), or why there is no
    interval (and `more`, how to have one); and, where a column had every scheme tied (ALL_TIED
    in `tests`), that it has no bold."""
    none = f"; none at a {at} where every scheme ties" if ALL_TIED in tests else ""
    if seeds < 2:
        return f"1 seed: no interval; {more}. Bold: the best scheme at each {at}{none}"
    how = {
        "paired": "a paired t-test over seeds (the same seeds: the same init and data order)",
        "welch": "Welch's t-test where the seed sets differ",
    }
    test = "; ".join(how[t] for t in sorted(tests - {ALL_TIED})) or "no test (too few seeds)"
    return (
        f"mean ± 95% confidence interval over seeds (Student's t). Bold: the best scheme at each "
        f"{at} and every scheme not significantly different from it (p >= 0.05, {test}){none}"
    )
