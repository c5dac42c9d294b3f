"""Effective length: the longest length up to which every measure a run was scored by holds."""

import pytest
from conftest import invoke

from posbench.config import EffectiveConfig
from posbench.measures.effective import effective_length

EPS, FRACTION = EffectiveConfig().eps, EffectiveConfig().fraction


def test_the_walk_stops_at_the_first_length_any_criterion_fails():
    ppl = {100: 6.0, 200: 6.0 * (1 + EPS), 400: 6.0 * (1 + 2 * EPS), 800: 6.0}
    assert (
        effective_length(ppl, 100, eps=EPS, fraction=FRACTION) == 200
    )  # 400 is past the margin; 800 after it does not count
    assert effective_length(ppl, 100, eps=2 * EPS, fraction=FRACTION) == 800  # a wider margin holds them all
    flat = {100: 6.0, 200: 6.1, 400: 6.2, 800: 6.3}
    assert effective_length(flat, 100, eps=EPS, fraction=FRACTION) == 800
    # flat perplexity, but the far context hurts from 400: "flat" is not "uses its context"
    assert effective_length(flat, 100, {200: 0.01, 400: -0.02, 800: 0.3}, eps=EPS, fraction=FRACTION) == 200
    assert effective_length(flat, 100, {200: 0.0, 400: 0.0, 800: 0.0}, eps=EPS, fraction=FRACTION) == 800
    # retrieval may fall to `fraction` of its in-distribution accuracy, no further
    acc = {100: 0.8, 200: 0.8 * FRACTION, 400: 0.8 * FRACTION - 0.01, 800: 0.8}
    assert effective_length(flat, 100, retrieval=acc, eps=EPS, fraction=FRACTION) == 200
    assert effective_length(flat, 100, retrieval=acc, eps=EPS, fraction=FRACTION - 0.02) == 800
    assert effective_length({200: 6.0}, 100, eps=EPS, fraction=FRACTION) is None  # the training length was not scored
    assert effective_length({100: 6.0, 200: float("nan")}, 100, eps=EPS, fraction=FRACTION) == 100  # blew up at 200


def test_retrieval_judges_a_run_by_its_mean_over_depths_from_the_first_record_that_can():
    """by_run over a run's records: retrieval accuracy is the mean over depths at each length; a
    record counts where the run retrieves at L at least twice as often as chance (exactly twice
    counts), and where `retrieval`'s texts are too short at L, `retrieval_short`'s judge."""
    from types import SimpleNamespace

    from posbench.config import ExperimentConfig
    from posbench.measures.effective import by_run
    from posbench.measures.plugin import Records

    cfg = ExperimentConfig()
    cfg.model.scheme, cfg.model.train_len = "rope", 100
    rows = [{"scheme": "rope", "protocol": "nonoverlapping", "length": str(n), "ppl": "6.0", "status": "ok"}
            for n in (100, 200, 400)]  # fmt: skip
    run = SimpleNamespace(cfg=cfg, rows=rows)

    def records(name, acc):  # length -> accuracy at depths 0 and 100 (None: too short there)
        rs = [
            {
                "length": str(n),
                "depth": str(d),
                "status": "ok" if a is not None else "too-short",
                "retrieval_accuracy": "" if a is None else a,
            }
            for n, pair in acc.items()
            for d, a in zip((0, 100), pair)
        ]
        return Records(f"posbench.measures.retrieval:{name}", {}, rs, "depth", {"distractors": 9})

    said = "retrieval_short accuracy >= 50% of its accuracy at 100"
    # the mean over depths: 0.6 at 100, 0.3 (half of it) at 200, 0.25 at 400; the last depth alone would say 400
    short = {"retrieval_short": records("ShortRetrieval", {100: (0.8, 0.4), 200: (0.2, 0.4), 400: (0.0, 0.5)})}
    assert by_run(run, short) == (200, ["ppl within 10% of ppl(100)", said])
    too_short = records("Retrieval", {100: (None, None), 200: (0.1, 0.1), 400: (0.1, 0.1)})
    assert by_run(run, {"retrieval": too_short, **short}) == (200, ["ppl within 10% of ppl(100)", said])
    at_twice_chance = {"retrieval_short": records("ShortRetrieval", {100: (0.2, 0.2), 200: (0.0, 0.0)})}
    assert by_run(run, at_twice_chance)[0] == 100
    below = {"retrieval_short": records("ShortRetrieval", {100: (0.19, 0.19), 200: (0.0, 0.0)})}
    assert by_run(run, below) == (400, ["ppl within 10% of ppl(100)"])  # at chance it says nothing


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
                found.append(effective_length(ppl, int(rows[0]["train_len"]), gain, eps=EPS, fraction=FRACTION))
            mean, ci = mean_ci(found)
            assert cells[scheme] == (f"{mean:.0f} ± {ci:.0f}" if ci == ci else f"{mean:.0f}"), (scheme, cells)


def test_the_thresholds_are_each_runs_config_and_the_report_states_them(smoke, tmp_path):
    """eval.effective.eps given to a run's scoring is recorded in its config.yaml and judges it:
    at eps = 1000 every scored length is within it, so only context gain can stop the walk."""
    import shutil

    import yaml

    exp = tmp_path / "smoke"
    shutil.copytree(smoke[0], exp)
    for run in sorted(p for p in exp.iterdir() if p.is_dir()):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["eval"]["effective"] = {"eps": 1000.0, "fraction": 0.5}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert invoke("evaluate", run, "--measure", "context_gain").exit_code == 0
    assert invoke("report", exp).exit_code == 0
    md = (exp / "summary.md").read_text()
    assert "ppl within 100000% of ppl(" in md and "ppl within 10% of" not in md


def test_retrieval_judges_only_a_run_that_retrieves_above_chance_at_its_training_length():
    """At chance (1 in 10 with 9 distractors) retrieval says nothing of the far context: its noise
    would decide the length, so the criterion is left out and not said; at twice chance it holds."""
    from types import SimpleNamespace

    from posbench.config import ExperimentConfig
    from posbench.measures.effective import by_run
    from posbench.measures.plugin import Records

    cfg = ExperimentConfig()
    cfg.model.scheme, cfg.model.train_len = "rope", 100
    rows = [
        {"scheme": "rope", "protocol": "nonoverlapping", "length": str(n), "ppl": "6.0", "status": "ok"}
        for n in (100, 200, 400)
    ]
    run = SimpleNamespace(cfg=cfg, rows=rows)

    def scored(acc):  # length -> accuracy
        rows = [{"length": str(n), "status": "ok", "retrieval_accuracy": str(a)} for n, a in acc.items()]
        return {"retrieval": Records("posbench.measures.retrieval:Retrieval", {}, rows, "depth", {"distractors": 9})}

    at_chance = scored({100: 0.12, 200: 0.05, 400: 0.11})
    assert by_run(run, at_chance) == (400, ["ppl within 10% of ppl(100)"])
    above = scored({100: 0.6, 200: 0.2, 400: 0.5})  # 0.2 < half of 0.6 at 200
    eff, said = by_run(run, above)
    assert eff == 100 and said[-1] == "retrieval accuracy >= 50% of its accuracy at 100"


def test_a_variant_scored_by_the_measures_has_an_effective_length_of_its_own():
    """A run scored as yarn at factor 2 (its rope+yarn@2 rows, context_gain_yarn): the plain run
    breaks at 400 (perplexity, then a negative gain), the variant holds to 800; each is judged by
    its own rows and records, and each is a row of the column."""
    from types import SimpleNamespace

    from posbench.config import ExperimentConfig
    from posbench.measures.effective import by_run
    from posbench.measures.plugin import Records

    cfg = ExperimentConfig()
    cfg.model.scheme, cfg.model.train_len = "rope", 100
    ppl = {"rope": [6.0, 6.2, 9.0, 20.0], "rope+yarn@2": [6.1, 6.1, 6.2, 6.3]}
    rows = [
        {"scheme": s, "protocol": "nonoverlapping", "length": str(n), "ppl": str(p), "status": "ok"}
        for s, values in ppl.items()
        for n, p in zip((100, 200, 400, 800), values)
    ]
    run = SimpleNamespace(cfg=cfg, rows=rows)

    def gains(values, **options):
        rows = [{"length": str(n), "gain": str(g)} for n, g in zip((100, 200, 400, 800), values)]
        return Records("posbench.measures.context:ContextGain", {}, rows, None, {"variant": None, **options})

    measures = {
        "context_gain": gains(["", 0.01, -0.5, -1.0]),
        "context_gain_yarn": gains(["", 0.02, 0.03, 0.0], variant="yarn", factor=2.0),
    }
    assert by_run(run, measures) == (200, ["ppl within 10% of ppl(100)", "context gain >= 0"])
    assert by_run(run, measures, "yarn") == (800, ["ppl within 10% of ppl(100)", "context gain >= 0"])
    measures["context_gain_yarn"] = gains(["", 0.02, -0.01, 0.0], variant="yarn", factor=2.0)
    assert by_run(run, measures, "yarn")[0] == 200  # its own gain, not the plain run's, stops it


def test_the_column_has_a_row_for_each_variant_a_run_was_scored_as(smoke, tmp_path):
    """evaluate --rope-scaling yarn adds rope+yarn rows; context_gain with variant=yarn scores
    them: the main table's rope+yarn row gets its own effective length, as its records give it."""
    import shutil

    from posbench.measures.effective import cells
    from posbench.report import collect

    exp = tmp_path / "smoke"
    shutil.copytree(smoke[0], exp)
    for run in sorted(exp.glob("*-seed*")):
        assert invoke("evaluate", run, "--measure", "context_gain").exit_code == 0
    for run in sorted(exp.glob("rope-seed*")):
        assert invoke("evaluate", run, "--rope-scaling", "yarn").exit_code == 0
        res = invoke("evaluate", run, "--measure", "context_gain", "--measure-option", "variant=yarn")
        assert res.exit_code == 0, res.output
    assert invoke("report", exp).exit_code == 0
    md = (exp / "summary.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| scheme | "))
    table = md.split(head)[1].split("\n\n")[0].splitlines()[2:]
    shown = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table}
    found, _ = cells(collect(exp).runs)
    assert "rope+yarn" in found and shown["rope+yarn"] == found["rope+yarn"] != ""
    assert shown["rope"] == found["rope"]
