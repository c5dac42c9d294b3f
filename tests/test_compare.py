"""The comparison engine (posbench/compare): one table builder, one cell, for every measure."""

from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest

from posbench.compare.table import cell, grid, summarize


def _long(rows):
    return pd.DataFrame(rows, columns=["scheme", "seed", "column", "value", "status"])


def test_the_table_shows_seeds_that_blew_up_and_hides_no_ratio_behind_them():
    """Seed 0 blew up at 64, seed 1 did not: the cell shows seed 1's value and says one seed
    blew up, and so does the ratio, each seed's own ppl(64)/ppl(32) over the seeds scored at both."""
    from posbench.measures.perplexity.views import comparison

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
    assert cell(table, "alibi", "ratio", 2) == f"{13 / 12:.2f} (1 of 2 seeds; 1 non-finite)"  # never hidden
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
    """A task table cell over fewer seeds than its row's says so ("n of m seeds"), as
    perplexity's does; where no seed was scored it shows —."""
    from posbench.measures.exact_match.views import comparison
    from posbench.measures.exact_match.views import grid as task_grid

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


# --- the one band plot: what it plots, where its legend goes, lines that never look alike ----


@pytest.fixture
def figures(monkeypatch):
    """Every figure a report writes, by file name, kept open for reading back."""
    from posbench.compare import plot

    kept, save = {}, plot.save

    def keep(plt, fig, path):
        fig.canvas.draw()  # lays the figure out as saved, so extents read back as drawn
        kept[path.name] = fig
        return save(plt, fig, path)

    monkeypatch.setattr(plot, "save", keep)  # every figure is drawn there
    return kept


def _report(tmp_path, name: str):
    from conftest import ROOT, invoke

    copy = tmp_path / name
    shutil.copytree(ROOT / "results" / name, copy)
    res = invoke("report", copy)
    assert res.exit_code == 0, res.output


def _legend_clear_of_data(fig) -> bool:
    """Whether every legend lies outside every panel that draws data."""
    boxes = [ax.get_window_extent() for ax in fig.axes if ax.get_lines()]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return bool(legends) and all(
        not leg.get_window_extent().overlaps(box) for leg in legends for box in boxes
    )  # fmt: skip


@pytest.mark.plots
def test_the_summary_plot_names_its_metric_and_unit_and_its_legend_covers_no_data(tmp_path, figures):
    _report(tmp_path, "reference")
    summary = figures["summary.png"]
    ax = summary.axes[0]
    assert ax.get_ylabel() == "perplexity per byte", ax.get_ylabel()
    assert "perplexity" in ax.get_title() and "nonoverlapping" in ax.get_title()
    assert "evaluation length (bytes)" in ax.get_xlabel()
    for name in ("summary.png", "positions.png", "training.png"):
        assert _legend_clear_of_data(figures[name]), name


@pytest.mark.plots
def test_a_task_plot_names_its_metric_and_its_legend_covers_no_data(tmp_path, figures):
    _report(tmp_path, "recipe-search/cpu-passkey")
    summary = figures["summary.png"]
    assert summary.axes[0].get_ylabel() == "% exact match"
    assert _legend_clear_of_data(summary) and _legend_clear_of_data(figures["training.png"])


def test_every_line_of_an_extension_plot_looks_different_and_its_log_axis_is_labelled(tmp_path, figures):
    """The extension reference draws rope, its evaluation-time variants and its fine-tuned
    children: a variant keeps rope's hue, but no two lines share colour, dashes and marker, and
    no child takes another scheme's colour. steps.png's log axis reads in numbers, more than one."""
    from matplotlib.colors import to_hex

    from posbench.compare.plot import colour
    from posbench.schemes import SCHEMES

    _report(tmp_path, "reference-extend")
    for name in ("summary.png", "steps.png"):
        looks = {  # dashes as drawn: get_linestyle() names every custom pattern "--"
            line.get_label(): (to_hex(line.get_color()), repr(line._unscaled_dash_pattern), line.get_marker())
            for ax in figures[name].axes
            for line in ax.get_lines()
            if not line.get_label().startswith("_")
        }
        assert len(looks) > 5 and len(set(looks.values())) == len(looks), looks
        others = {colour(s) for s in SCHEMES if s != "rope"}
        assert not any(look[0] in others for label, look in looks.items() if label.startswith("rope")), looks
    ax = figures["steps.png"].axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels() if t.get_text()]
    visible = [t for t in labels if t]
    assert ax.get_yscale() == "log" and len(visible) >= 2, labels


def test_lines_that_can_share_a_plot_never_look_alike():
    """Every registered scheme, rope's evaluation-time variants (and one at another factor), the
    modified schemes and every fine-tuning method's child: distinct (colour, dashes, marker)."""
    from posbench.compare.plot import style
    from posbench.extend.methods import METHODS
    from posbench.schemes import MODIFIERS, SCHEMES

    names = list(SCHEMES) + [f"rope+{v}" for v in SCHEMES["rope"].eval_variants] + ["rope+yarn@4"]
    names += ["rope+rerope@4", "alibi+rerope", "noisy_rope+logn"]
    names += [f"{m}rope" for m in MODIFIERS] + [f"rope:{m}" for m in METHODS]
    looks = {n: (style(n)["color"], repr(style(n)["linestyle"]), style(n)["marker"]) for n in names}
    assert len(set(looks.values())) == len(names), looks


def test_a_metric_names_its_column_direction_and_aggregation_once():
    """Every metric of the two measures reads a column its records hold, or is derived (each
    run's ratio); a pooled metric names the two counts it pools; one that mixes them up is refused."""
    from posbench.measures.base import Metric
    from posbench.measures.exact_match import ExactMatch
    from posbench.measures.exact_match.records import EVAL_COLUMNS as TASK_COLUMNS
    from posbench.measures.perplexity import Perplexity
    from posbench.measures.perplexity.records import EVAL_COLUMNS

    for measure, columns in ((Perplexity, EVAL_COLUMNS), (ExactMatch, TASK_COLUMNS)):
        for m in measure.metrics.values():
            assert (m.column in columns) == (m.aggregate != "derived"), m
            assert set(m.pooled) <= set(columns), m
    assert ExactMatch.metrics["exact_match"].pooled == ("correct", "instances")
    with pytest.raises(ValueError):
        Metric("x", "x", True, aggregate="pooled")
    with pytest.raises(ValueError):
        Metric("x", "x", True, aggregate="median")


def test_the_extension_steps_table_bolds_the_best_method_at_each_step():
    """Extend's curve is a view through the engine: results/reference-extend's steps table marks,
    at each step, the method with the lowest mean perplexity over its seeds' curve.csv (and any
    not significantly different), as every other table does."""
    import csv

    from conftest import ROOT

    committed = ROOT / "results" / "reference-extend"
    means: dict = {}
    for path in committed.glob("*/curve.csv"):
        with path.open() as f:
            for r in csv.DictReader(f):
                means.setdefault(int(r["step"]), {}).setdefault(r["scheme"], []).append(float(r["ppl"]))
    section = (committed / "summary.md").read_text().split("after k fine-tuning steps\n\n")[1].strip().splitlines()
    head, rows = section[0].strip("|").split("|"), [r.strip("|").split("|") for r in section[2:]]
    assert [int(h) for h in head[1:]] == sorted(means)
    for j, step in enumerate(sorted(means), start=1):
        best = min(means[step], key=lambda s: sum(means[step][s]) / len(means[step][s]))
        assert next(r[j] for r in rows if r[0].strip() == best).strip().startswith("**"), (step, best)
    assert any(not r[j].strip().startswith("**") for r in rows for j in range(1, len(head)))


def test_a_task_report_says_what_its_bold_means_as_a_perplexity_report_does():
    """Task tables' note is the engine's, naming the test that decided the ties (the task
    reference pairs its seeds), word for word as perplexity's."""
    from conftest import ROOT

    from posbench.compare.table import spread_note

    md = (ROOT / "results" / "reference-tasks" / "summary.md").read_text()
    ppl = (ROOT / "results" / "reference" / "summary.md").read_text()
    note = spread_note(3, {"paired"})
    assert f"- cells: % exact match, {note};" in md and f"- cells: perplexity per byte, {note}" in ppl


def test_the_ratio_column_has_an_interval_and_a_bold_best_like_every_other_cell():
    """results/reference's ppl(800)/ppl(100) is each seed's own ratio from its eval.csv,
    their mean ± Student's t interval, and the lowest (with any not significantly different)
    in bold."""
    import csv

    from conftest import ROOT

    from posbench.stats import mean_ci

    committed = ROOT / "results" / "reference"
    ratios: dict = {}
    for path in sorted(committed.glob("*/eval.csv")):
        with path.open() as f:
            ppl = {int(r["length"]): float(r["ppl"]) for r in csv.DictReader(f) if r["protocol"] == "nonoverlapping"}
        ratios.setdefault(path.parent.name.split("-seed")[0], []).append(ppl[800] / ppl[100])
    md = (committed / "summary.md").read_text().split("## nonoverlapping\n\n")[1].split("\n\n")[0].splitlines()
    cells = {r.strip("|").split("|")[0].strip(): r.strip("|").split("|")[6].strip() for r in md[2:]}
    for scheme, values in ratios.items():
        mean, ci = mean_ci(values)
        assert cells[scheme].strip("*") == f"{mean:.2f} ± {ci:.2f}", (scheme, cells[scheme])
    best = min(ratios, key=lambda s: sum(ratios[s]))
    assert cells[best].startswith("**") and not all(c.startswith("**") for c in cells.values())


def test_a_column_where_every_scheme_ties_has_no_bold():
    """Bold singles out the best and what a test cannot tell from it; where that is every
    scheme (all at 0.0 past a task's training length), it would single out nothing."""
    from posbench.compare.table import ALL_TIED, spread_note

    rows = [(s, seed, "past", 0.0, "ok") for s in "abc" for seed in range(3)]
    rows += [
        (s, seed, "in", v + 0.01 * seed, "ok") for s, v in (("a", 1.0), ("b", 0.5), ("c", 0.2)) for seed in range(3)
    ]
    table = summarize(_long(rows), ["in", "past"], ["a", "b", "c"], higher_is_better=True)
    assert [s for s in "abc" if table.loc[s, "best in"]] == ["a"]
    assert not any(table.loc[s, "best past"] for s in "abc")
    assert ALL_TIED in table.attrs["tests"] and "none at a length where every scheme ties" in spread_note(
        3, table.attrs["tests"]
    )
    one_seed = summarize(_long([(s, 0, "past", 0.0, "ok") for s in "ab"]), ["past"], ["a", "b"], True)
    assert not one_seed["best past"].any()


def test_the_task_reference_bolds_no_column_whole():
    """The tie rule: where the schemes tie (rows of 0.0 past N among them) no cell of
    the column is bold; results/reference-tasks' tables bold no column whole, and their note says
    why a column has no bold."""
    from conftest import ROOT

    md = (ROOT / "results" / "reference-tasks" / "summary.md").read_text()
    assert "none at a length where every scheme ties" in md
    tables = [part.split("\n\n")[0].splitlines() for part in md.split("\n\n| scheme | in-dist |")[1:]]
    assert len(tables) == 5  # a task's table each
    bold = 0
    for table in tables:
        cells = [row.strip("|").split("|")[1:-1] for row in table[2:]]
        for j in range(len(cells[0])):
            column = [row[j].strip() for row in cells]
            assert not all(c.startswith("**") for c in column), column
        bold += sum(c.strip().startswith("**") for row in cells for c in row)
    assert bold  # bold where a best stands out (a table may have none: sort's schemes tie at every length)


def test_extend_rows_keep_every_parent_above_the_fine_tuned_children():
    """An extension of alibi, hybrid and rope lists alibi and hybrid above rope's
    children. Runs trained from scratch (and rope evaluated rescaled) come first in registry
    order; then the children, by parent in that order and by method."""
    from posbench.compare.order import scheme_order
    from posbench.extend.methods import METHODS
    from posbench.schemes import SCHEMES

    parents = {"nope", "rope", "alibi", "hybrid"}
    children = {f"{p}:{m}" for p in parents for m in ("plain", "pi") if m == "plain" or p == "rope"}
    order = scheme_order(parents | {"rope+yarn"} | children)
    trained = [s for s in SCHEMES if s in parents]
    rows = [r for s in trained for r in ([s, "rope+yarn"] if s == "rope" else [s])]  # rope's variant beside it
    assert order[: len(rows)] == rows
    tail = order[len(trained) + 1 :]
    assert set(tail) == children
    key = [(trained.index(c.split(":")[0]), list(METHODS).index(c.split(":")[1])) for c in tail]
    assert key == sorted(key)
    alone = {f"rope:{m}" for m in METHODS if m != "interpolate"}  # extend's steps table: children, no parent
    assert scheme_order(alone) == [f"rope:{m}" for m in METHODS if f"rope:{m}" in alone]


def test_the_extension_steps_caption_does_not_repeat_the_first_tables():
    """extend's steps caption does not repeat the first table's note (Student's t, the
    test and its p); it says what is its own, the best method at each step, and points to the
    test above (results/reference-extend's summary)."""
    from conftest import ROOT

    from posbench.compare.table import spread_note

    tex = (ROOT / "results" / "reference-extend" / "summary.tex").read_text()
    captions = [c.split("}\n")[0] for c in tex.split("\\caption{")[1:]]
    first, steps = captions[0], captions[-1]  # the rope law's table stands between them
    assert spread_note(3, {"paired"}).replace("±", "$\\pm$").replace("%", "\\%") in first
    assert "Student's t" not in steps and "p >= 0.05" not in steps
    assert "bold: the best method at each step and every method not significantly different from it" in steps


def test_a_header_tells_the_seeds_of_each_row():
    """A header does not say `seeds [0, 1, 2]` when 6 of 8 rows stand on one seed. Where
    every row has the same seeds it names them once; else each set is said with its rows, the
    largest group as the rest."""
    from posbench.compare.table import seeds_said

    full = {"t5": [0, 1, 2], "rope": [0, 1, 2]}
    one = {s: [0] for s in ("nope", "sinusoidal", "learned", "xl", "alibi", "hybrid")}
    frame = pd.DataFrame([(s, n) for s, seeds in {**full, **one}.items() for n in seeds], columns=["scheme", "seed"])
    assert seeds_said(frame[frame["scheme"].isin(full)]) == f"seeds {sorted(set(full['t5']))}"  # as before
    said = seeds_said(frame)
    assert said == f"seeds {full['t5']} ({', '.join(full)}); [0] (the other {len(one)} rows)"
    two = pd.DataFrame([("a", 0), ("a", 1), ("b", 1)], columns=["scheme", "seed"])
    assert seeds_said(two) == "seeds [0, 1] (a); [1] (b)"  # no group of one is called the rest


def test_the_reciprocal_rank_table_has_intervals_and_the_engines_tie_rule():
    """The mean reciprocal rank goes through the engine: results/reference-tasks' table is derived
    here from the runs' eval.csv alone. At each task and seed the schemes are ranked by exact match
    past N (tied schemes share their mean rank). The first column is the mean of 1/rank over every
    (task, seed) pair, a task's column over its seeds, each with its 95% interval; bold marks the
    best of a column and every scheme a paired t-test cannot tell from it (p >= 0.05), and nothing
    in a column where that is every scheme."""
    import csv

    from conftest import ROOT

    from posbench.stats import mean_ci, paired_p

    committed = ROOT / "results" / "reference-tasks"
    past: dict = {}  # (task, seed) -> {scheme: share exact past N}
    for path in committed.glob("*/eval.csv"):
        with path.open() as f:
            rows = [r for r in csv.DictReader(f) if int(r["length"]) > int(r["train_max"])]
        key, scheme = (rows[0]["task"], int(rows[0]["seed"])), rows[0]["scheme"]
        past.setdefault(key, {})[scheme] = sum(int(r["correct"]) for r in rows) / sum(int(r["instances"]) for r in rows)
    schemes = set().union(*past.values())
    assert all(set(by) == schemes for by in past.values())
    rr: dict = {}  # (task or "all", scheme) -> 1/rank, pair by pair in one order
    for key in sorted(past):
        for scheme, rank in pd.Series(past[key]).rank(method="average", ascending=False).items():
            for column in ("all", key[0]):
                rr.setdefault((column, scheme), []).append(1 / rank)

    def expected(column: str) -> dict:
        values = {s: rr[column, s] for s in schemes}
        best = max(values, key=lambda s: sum(values[s]))
        bold = {s for s in values if s == best or paired_p(values[s], values[best]) >= 0.05}
        bold = set() if bold == set(values) else bold  # where every scheme ties, bold singles out none
        cell = {s: "{:.2f} ± {:.2f}".format(*mean_ci(values[s])) for s in values}
        return {s: f"**{cell[s]}**" if s in bold else cell[s] for s in values}

    md = (committed / "summary.md").read_text()
    heading = f"## mean reciprocal rank past N over {len(past)} (grid point, seed) pairs"
    table = md.split(heading)[1].split("\n\n")[1].splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = {r.strip("|").split("|")[0].strip(): [c.strip() for c in r.strip("|").split("|")[1:]] for r in table[2:]}
    assert set(cells) == schemes and len(head) == 2 + len({t for t, _ in past})
    for j, column in enumerate(head[1:]):
        task = "all" if j == 0 else column.split(",")[0].removeprefix("task=")
        assert {s: cells[s][j] for s in schemes} == expected(task), column
    assert f"averaged over the {len(past)} pairs" in (committed / "summary.tex").read_text()


def test_a_reports_header_tells_the_seeds_of_each_row(tmp_path):
    """results/reference with alibi's seeds 1 and 2 removed: the header does not say
    seeds [0, 1, 2] of every row."""
    from conftest import ROOT, invoke

    copy = tmp_path / "reference"
    shutil.copytree(ROOT / "results" / "reference", copy)
    for n in (1, 2):
        shutil.rmtree(copy / f"alibi-seed{n}")
    assert invoke("report", copy).exit_code == 0
    assert "seeds [0] (alibi); [0, 1, 2] (the other 3 rows)" in (copy / "summary.md").read_text()


def test_latex_sets_every_special_character_literally_and_escapes_none_twice():
    from posbench.compare.render import tex

    assert tex("T_extra = 2 pi base^(d/2) ~ {50%} & #1 $x \\ ± —") == (
        "T\\_extra = 2 pi base\\textasciicircum{}(d/2) \\textasciitilde{} \\{50\\%\\} \\& \\#1 \\$x "
        "\\textbackslash{} $\\pm$ --"
    )
