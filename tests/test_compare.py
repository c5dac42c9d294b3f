"""The comparison engine (posbench/compare): one table builder, one cell, for every measure."""

from __future__ import annotations

import math

import pandas as pd

from posbench.compare.table import cell, grid, summarize


def _long(rows):
    return pd.DataFrame(rows, columns=["scheme", "seed", "column", "value", "status"])


def test_the_table_shows_seeds_that_blew_up_and_hides_no_ratio_behind_them():
    """Seed 0 blew up at 64, seed 1 did not: the cell shows seed 1's value and says one seed
    blew up, and the ratio is not taken from the seed that survived."""
    from posbench.measures.perplexity import comparison

    rows = [
        ("alibi", s, 32, L, ppl, st)
        for s, L, ppl, st in [
            (0, 32, 10.0, "ok"),
            (0, 64, float("nan"), "non-finite"),
            (1, 32, 12.0, "ok"),
            (1, 64, 13.0, "ok"),
        ]
    ]
    rows += [("rope", s, 32, L, ppl, "ok") for s, L, ppl in [(0, 32, 5.0), (0, 64, 6.0), (1, 32, 7.0)]]
    df = pd.DataFrame(rows, columns=["scheme", "seed", "train_len", "length", "ppl", "status"])
    table = comparison(df)
    assert cell(table, "alibi", 64, 2) == "13.00 (1 of 2 seeds; 1 non-finite)"
    assert table.loc["alibi", "ratio"] != table.loc["alibi", "ratio"]  # NaN, not 13/12
    assert cell(table, "rope", 64, 2) == "6.00 (1 of 2 seeds)"
    assert table.loc["rope", "ratio"] == 6.0 / 5.0  # over seed 0, the one scored at both


def test_a_cell_is_the_mean_and_students_t_interval_of_the_seeds_scored_there():
    values = [0.5, 0.7, 0.9]
    long = _long([("a", s, "in", v, "ok") for s, v in enumerate(values)])
    table = summarize(long, ["in"], ["a"], higher_is_better=True)
    sd = math.sqrt(sum((v - 0.7) ** 2 for v in values) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert table.loc["a", "in"] == sum(values) / 3 and abs(table.loc["a", "ci in"] - half) < 1e-9
    assert cell(table, "a", "in", 1, scale=100) == f"{70.0:.1f} ± {100 * half:.1f}"


def test_best_follows_the_metrics_direction_and_ties_what_a_test_cannot_tell_apart():
    """Two schemes far apart: the better by the metric's direction alone is bold; two within
    noise of each other: both."""
    rows = [("a", s, "x", v, "ok") for s, v in enumerate([1.0, 1.1, 0.9])]
    rows += [("b", s, "x", v, "ok") for s, v in enumerate([5.0, 5.1, 4.9])]
    rows += [("c", s, "x", v, "ok") for s, v in enumerate([1.05, 0.8, 1.2])]
    for higher, bold in ((False, {"a", "c"}), (True, {"b"})):
        table = summarize(_long(rows), ["x"], ["a", "b", "c"], higher_is_better=higher)
        assert {s for s in "abc" if table.loc[s, "best x"]} == bold


def test_a_task_table_says_how_many_seeds_a_cell_stands_on():
    """The drift fix of the engine: a task table cell over fewer seeds than its row's says so
    ("n of m seeds"), as perplexity's always did; where no seed was scored it shows —."""
    from posbench.measures.exact_match import comparison
    from posbench.measures.exact_match import grid as task_grid

    rows = []
    for seed, (inside, outside, st) in enumerate([(1.0, 0.2, "ok"), (0.9, math.nan, "beyond-max-len")]):
        for bucket, value, status in (("in", inside, "ok"), ("out", outside, st)):
            rows.append({"metric": "exact_match", "scheme": "learned", "seed": seed, "bucket": bucket,
                         "value": value, "status": status})  # fmt: skip
        rows.append({"metric": "exact_match", "scheme": "nope", "seed": seed, "bucket": "out", "value": math.nan,
                     "status": "beyond-max-len"})  # fmt: skip
        rows.append({"metric": "exact_match", "scheme": "nope", "seed": seed, "bucket": "in", "value": 1.0,
                     "status": "ok"})  # fmt: skip
    table = comparison(pd.DataFrame(rows), "exact_match")
    rows, _ = task_grid(table, "exact_match")
    assert rows[0] == ["scheme", "in-dist", "out-of-dist", "seeds"]
    assert rows[1][0] == "nope" and rows[1][2] == "—"
    assert rows[2][0] == "learned" and rows[2][2] == "20.0 (1 of 2 seeds)"


def test_grid_rows_bold_the_best_cells_by_position():
    long = _long([("a", 0, 1, 2.0, "ok"), ("b", 0, 1, 3.0, "ok"), ("a", 0, 2, 9.0, "ok"), ("b", 0, 2, 4.0, "ok")])
    rows, best = grid(summarize(long, [1, 2], ["a", "b"], higher_is_better=False), ["1", "2"], digits=1)
    assert rows == [["scheme", "1", "2"], ["a", "2.0", "9.0"], ["b", "3.0", "4.0"]]
    assert best == {(1, 1), (2, 2)}
