"""Effective length: the longest length up to which every measure a run was scored by holds."""

import pytest
from conftest import invoke

from posbench.measures.effective import EPS, FRACTION, effective_length


def test_the_walk_stops_at_the_first_length_any_criterion_fails():
    ppl = {100: 6.0, 200: 6.0 * (1 + EPS), 400: 6.0 * (1 + 2 * EPS), 800: 6.0}
    assert effective_length(ppl, 100) == 200  # 400 is past the margin; 800 after it does not count
    flat = {100: 6.0, 200: 6.1, 400: 6.2, 800: 6.3}
    assert effective_length(flat, 100) == 800
    # flat perplexity, but the far context hurts from 400: "flat" is not "uses its context"
    assert effective_length(flat, 100, gain={200: 0.01, 400: -0.02, 800: 0.3}) == 200
    assert effective_length(flat, 100, gain={200: 0.0, 400: 0.0, 800: 0.0}) == 800  # not negative holds
    # retrieval may fall to FRACTION of its in-distribution accuracy, no further
    acc = {100: 0.8, 200: 0.8 * FRACTION, 400: 0.8 * FRACTION - 0.01, 800: 0.8}
    assert effective_length(flat, 100, retrieval=acc) == 200
    assert effective_length({200: 6.0}, 100) is None  # the training length was not scored
    assert effective_length({100: 6.0, 200: float("nan")}, 100) == 100  # the loss blew up at 200


@pytest.mark.parametrize("scored", [False, True])
def test_the_main_table_has_the_column_only_where_context_gain_was_scored(smoke, tmp_path, scored):
    import shutil

    exp = tmp_path / "smoke"
    shutil.copytree(smoke[0], exp)
    if scored:
        for run in sorted(p for p in exp.iterdir() if p.is_dir()):
            assert invoke("evaluate", run, "--measure", "context_gain").exit_code == 0
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    md = (exp / "summary.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| scheme | "))
    assert head.endswith("| eff. length |") == scored, head
    if scored:
        assert "- eff. length: the longest length up to which ppl within 10% of ppl(" in md
        assert "context gain >= 0" in md
        import csv

        from posbench.stats import mean_ci

        table = md.split(head)[1].split("\n\n")[0].splitlines()[2:]  # the main table's rows
        cells = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table}
        for scheme in ("alibi", "rope"):
            found = []
            for run in sorted(exp.glob(f"{scheme}-seed*")):
                rows = list(csv.DictReader((run / "eval.csv").open()))
                ppl = {int(r["length"]): float(r["ppl"]) for r in rows if r["scheme"] == scheme}
                gain = {int(r["length"]): float(r["gain"] or "nan") for r in csv.DictReader(
                    (run / "measures" / "context_gain.csv").open())}  # fmt: skip
                found.append(effective_length(ppl, int(rows[0]["train_len"]), gain))
            mean, ci = mean_ci(found)
            assert cells[scheme] == (f"{mean:.0f} ± {ci:.0f}" if ci == ci else f"{mean:.0f}"), (scheme, cells)
