"""Statistics over seeds: Student's t intervals, and the tests that say which schemes tie for best."""

from __future__ import annotations

import functools
import math
from typing import Optional

ALPHA = 0.05  # two-sided: 95% intervals, and "not significantly different" at p >= 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.cache  # a report asks for the same few (p, df) once per cell, and each is 200 bisection steps
def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, by bisection on t_cdf."""
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% interval (Student's t); nan with one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(1 - ALPHA / 2, n - 1) * sd / math.sqrt(n)


def _two_sided(t: float, df: float) -> float:
    if math.isnan(t):
        return 1.0  # no spread on either side and equal means: nothing tells them apart
    return 2.0 * (1.0 - t_cdf(abs(t), df))


def paired_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of the paired t-test on a[i] - b[i] (the same seed, so the same init and data)."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return _two_sided(mean / (sd / math.sqrt(n)), n - 1)


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of Welch's t-test (unequal variances), for seed sets that do not pair."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    if se2 == 0:
        return 1.0 if ma == mb else 0.0
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    return _two_sided((ma - mb) / math.sqrt(se2), df)


def tied_for_best(
    by_scheme: dict[str, dict[int, float]], higher_is_better: bool = False
) -> tuple[Optional[str], set[str], str]:
    """Of {scheme: {seed: value}}: the best scheme by mean (the lowest, or the highest where
    higher is better), the schemes not significantly different from it (itself included, and
    any with the same mean), and the test used. A paired t-test
    where a scheme's seeds are the best's, Welch's where they differ; with fewer than two seeds
    on either side there is no test and only the best is marked."""
    scored = {s: v for s, v in by_scheme.items() if v}
    if not scored:
        return None, set(), "none"
    mean = {s: sum(v.values()) / len(v) for s, v in scored.items()}
    best = (max if higher_is_better else min)(scored, key=mean.get)
    tied, tests = {s for s in scored if mean[s] == mean[best]}, set()
    ref = scored[best]
    for s, vals in scored.items():
        if s == best or len(vals) < 2 or len(ref) < 2:
            continue
        if set(vals) == set(ref):
            seeds = sorted(ref)
            p = paired_p([vals[k] for k in seeds], [ref[k] for k in seeds])
            tests.add("paired")
        else:
            p = welch_p(list(vals.values()), list(ref.values()))
            tests.add("welch")
        if p >= ALPHA:
            tied.add(s)
    return best, tied, "+".join(sorted(tests)) or "none"
