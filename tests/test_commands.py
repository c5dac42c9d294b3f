"""Each command end to end on configs/smoke.yaml and a tiny corpus: the files and tables it
writes and the flags it takes."""

import csv
import json

import pytest
import torch
import yaml
from conftest import SMOKE, folded, invoke, report_rebuilt

from posbench.schemes import SEED_SCHEMES


def test_extrapolate_writes_every_promised_file(smoke):
    exp, res, _ = smoke
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (exp / name).stat().st_size > 0, name
    for scheme in SEED_SCHEMES:
        run = exp / f"{scheme}-seed0"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["model"]["scheme"] == scheme and cfg["seeds"] == [0]
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        assert set(log[0]) == {"step", "loss", "lr", "seconds", "attention", "device", "threads", "torch", "posbench"}
        assert (log[0]["device"], log[0]["threads"], log[0]["torch"]) == ("cpu", 1, torch.__version__)
        assert log[-1]["step"] == cfg["train"]["steps"] - 1
        ckpt = torch.load(run / "model.pt", weights_only=True)
        assert ckpt["config"] == cfg  # the checkpoint carries its own resolved config
        rows = list(csv.DictReader((run / "eval.csv").open()))
        assert [int(r["length"]) for r in rows] == [32, 48, 64]
        (scored,) = [json.loads(line) for line in (run / "eval_log.jsonl").read_text().splitlines()]
        assert (scored["measure"], scored["lengths"], scored["schemes"]) == ("perplexity", [32, 48, 64], [scheme])
        assert (scored["device"], scored["threads"], scored["torch"]) == ("cpu", 1, torch.__version__)
        assert scored["attention"] == rows[0]["attention"] == log[0]["attention"]
    assert not list(exp.glob(".*partial"))


def test_summary_csv_is_long_format_with_status(smoke):
    exp, _, _ = smoke
    rows = list(csv.DictReader((exp / "summary.csv").open()))
    assert list(rows[0]) == [
        "scheme",
        "seed",
        "train_len",
        "length",
        "protocol",
        "stride",
        "loss",
        "ppl",
        "bpb",
        "tokens",
        "status",
        "attention",
        "tokenizer",
    ]
    assert len(rows) == len(SEED_SCHEMES) * 3
    by = {(r["scheme"], int(r["length"])): r for r in rows}
    assert by[("learned", 32)]["status"] == "ok"
    assert by[("learned", 64)]["status"] == "beyond-max-len" and by[("learned", 64)]["ppl"] == ""
    assert by[("alibi", 64)]["status"] == "ok"
    ok = [r for r in rows if r["status"] == "ok"]
    assert len({r["tokens"] for r in rows}) == 1  # the same tokens at every length
    for r in ok:
        assert float(r["ppl"]) == pytest.approx(2.718281828 ** float(r["loss"]), rel=1e-6)
        assert 1 < float(r["ppl"]) < 256  # better than uniform over bytes after training


def test_summary_md_names_corpus_model_budget_protocol(smoke):
    exp, res, text = smoke
    md = (exp / "summary.md").read_text()
    assert f"corpus: {text}" in md
    assert "1 layer, d_model 32, 2 heads" in md
    assert "30 steps x 8 sequences x 32 tokens" in md
    assert "nonoverlapping" in md
    for scheme in SEED_SCHEMES:
        assert f"| {scheme} |" in md
    assert "beyond-max-len" in md
    assert "ppl(64)/ppl(32)" in md
    assert "alibi" in res.output and "ppl(64)/ppl(train)" in res.output  # the terminal table


def test_report_rebuilds_the_same_summary_from_disk(smoke, tmp_path):
    exp, _, _ = smoke
    copy = tmp_path / "copy"
    res = report_rebuilt(exp, copy, ("summary.csv", "summary.md", "summary.png"))
    assert res.exit_code == 0, res.output
    assert (copy / "summary.csv").read_text() == (exp / "summary.csv").read_text()
    assert (copy / "summary.md").read_text() == (exp / "summary.md").read_text()


def test_train_one_run(tmp_path, corpus_file):
    out = tmp_path / "r"
    res = invoke(
        "train",
        SMOKE,
        "--scheme",
        "alibi",
        "--seed",
        "2",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=5",
    )
    assert res.exit_code == 0, res.output
    assert (out / "smoke" / "alibi-seed2" / "model.pt").is_file()
    assert sorted(p.name for p in (out / "smoke").iterdir() if p.is_dir()) == ["alibi-seed2"]


def test_train_with_no_config_trains_the_defaults_and_one_run_on_request(tmp_path, corpus_file):
    quick = [
        "--set",
        f"out_dir={tmp_path / 'r'}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=2",
        "--set",
        "eval.tokens=400",
        "--set",
        "train.workers=1",
    ]
    res = invoke("train", "--scheme", "alibi", *quick)
    assert res.exit_code == 0, res.output
    runs = sorted(p.name for p in (tmp_path / "r" / "default").iterdir() if p.is_dir())
    assert runs == ["alibi-seed0"]
    cfg = yaml.safe_load((tmp_path / "r" / "default" / "alibi-seed0" / "config.yaml").read_text())
    assert cfg["model"]["d_model"] == 128 and cfg["eval"]["lengths"] == [100, 125, 150, 200]  # the defaults
    res = invoke(
        "train",
        SMOKE,
        "--set",
        f"out_dir={tmp_path / 's'}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "schemes=[nope, alibi]",
    )
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "s" / "smoke").iterdir() if p.is_dir()) == ["alibi-seed0", "nope-seed0"]


def test_train_and_sweep_take_the_config_as_a_flag_and_train_takes_seeds(tmp_path, corpus_file):
    """Every command takes `--config FILE`; `train --seeds 0,1,2`, as the tables' footer advises."""
    from conftest import ROOT

    out = tmp_path / "results"
    sets = ["--set", f"out_dir={out}", "--set", f"data.path={corpus_file}", "--set", "train.steps=2"]
    res = invoke("train", "--config", SMOKE, "--scheme", "nope", "--seeds", "0,1", *sets)
    assert res.exit_code == 0, res.output
    assert all((out / "smoke" / f"nope-seed{n}" / "model.pt").exists() for n in (0, 1))
    res = invoke("train", SMOKE, "--config", SMOKE)
    assert res.exit_code == 2 and "config given twice" in folded(res.output), res.output
    res = invoke("train", "--seed", "1", "--seeds", "0,1")
    assert res.exit_code == 2 and "--seed and --seeds both pick the seeds" in folded(res.output), res.output
    res = invoke("sweep", "--config", ROOT / "configs" / "sweep-example.yaml", "--dry-run")
    assert res.exit_code == 0 and "grid point" in res.output, res.output
    res = invoke("sweep")
    assert res.exit_code == 2 and "posbench sweep needs a config" in folded(res.output), res.output


def test_schemes_lists_every_registered_scheme_with_a_description():
    res = invoke("schemes")
    assert res.exit_code == 0
    for s in SEED_SCHEMES:
        assert s in res.output


def test_schemes_all_runs_every_registered_scheme_with_rope_rows(tmp_path, corpus_file):
    from posbench.schemes import SCHEMES

    out = tmp_path / "r"
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "all",
        "--rope-scaling",
        "yarn,linear",
        "--set",
        f"out_dir={out}",
        "--set",
        f"data.path={corpus_file}",
        "--set",
        "train.steps=3",
    )
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader((out / "smoke" / "summary.csv").open()))
    variants = {f"{s}+{v}" for s, cls in SCHEMES.items() for v in ("yarn", "linear") if v in cls.eval_variants}
    assert {"rope+yarn", "rope+linear", "ssmax+linear"} <= variants and "ssmax+yarn" not in variants
    assert {r["scheme"] for r in rows} == set(SCHEMES) | variants
    assert len(SCHEMES) >= 14
