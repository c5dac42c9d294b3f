"""Seeds and spread: Student's t quantiles and intervals, paired and Welch tests, and ties for
best."""

import math

import pytest

from posbench.stats import mean_ci, paired_p, t_quantile, tied_for_best, welch_p

# two-sided 95% critical values of Student's t, df = 1..9 (2 to 10 seeds), from the printed tables
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262]


@pytest.mark.parametrize("df", range(1, 10))
def test_the_t_quantile_matches_the_printed_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df - 1], abs=5e-4)


def test_identical_seeds_give_an_interval_of_zero_width_and_one_seed_none():
    assert mean_ci([6.5, 6.5, 6.5]) == (6.5, 0.0)
    mean, half = mean_ci([6.0])
    assert mean == 6.0 and math.isnan(half)
    mean, half = mean_ci([1.0, 3.0])  # sd = sqrt(2), n = 2: 12.706 * sqrt(2) / sqrt(2)
    assert mean == 2.0 and half == pytest.approx(12.706, abs=1e-3)


def test_a_paired_test_sees_a_consistent_gap_that_welch_cannot():
    """Seeds vary a lot between them, but one scheme is 0.1 better on every seed."""
    a = [5.0, 7.0, 9.0, 6.0]
    b = [x + 0.1 + 0.001 * i for i, x in enumerate(a)]
    assert paired_p(a, b) < 0.001 and welch_p(a, b) > 0.5
    assert paired_p(a, a) == 1.0 and welch_p(a, a) == 1.0


def test_tied_for_best_marks_the_best_and_whoever_cannot_be_told_apart():
    values = {
        "alibi": {0: 6.0, 1: 6.2, 2: 5.9},
        "t5": {0: 6.05, 1: 6.15, 2: 5.95},  # no consistent gap to alibi
        "rope": {0: 7.0, 1: 7.2, 2: 6.9},  # 1.0 worse on every seed
    }
    best, tied, test = tied_for_best(values)
    assert best == "alibi" and tied == {"alibi", "t5"} and test == "paired"
    best, tied, test = tied_for_best({"alibi": {0: 6.0}, "rope": {0: 7.0}})
    assert best == "alibi" and tied == {"alibi"} and test == "none"
    _, _, test = tied_for_best({"alibi": {0: 6.0, 1: 6.1}, "rope": {3: 7.0, 4: 7.2}})
    assert test == "welch"


def test_the_paired_and_welch_p_values_are_scipys():
    """Against scipy.stats.ttest_rel and ttest_ind(equal_var=False) on these numbers (computed
    once with scipy 1.17 and written here, so the test needs no scipy): a z-test in place of
    either t (degrees of freedom taken as infinite) would give other values."""
    a, b = [1, 2, 3.5, 4], [1.5, 2.2, 3.9, 4.8]
    assert paired_p(a, b) == pytest.approx(0.032004589062638804, rel=1e-9)
    assert welch_p(a, b[:3]) == pytest.approx(0.9300787151985364, rel=1e-9)
