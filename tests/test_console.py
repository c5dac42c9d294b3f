"""What the terminal shows: tables in 80 columns (output redirected) cut no number,
and progress comes in logs and bars while runs train."""

import torch
from conftest import invoke, smoke_experiment

from posbench.schemes import SEED_SCHEMES


def _whole(number: str, text: str) -> bool:
    """`number` appears in `text` as a whole token, not cut short nor run into another."""
    import re

    return re.search(rf"(?<![\w.]){re.escape(number)}(?![\w.])", text) is not None


def _rendered(table, width: int = 80) -> str:
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue()


def test_the_report_in_80_columns_cuts_no_number_and_no_header(tmp_path):
    """Two seeds and five lengths, redirected (CliRunner is 80 wide): every number of the
    table is there in full, and no header ends in "…" (ppl(64)/ppl(train) breaks after its "/")."""
    import re

    more = ("--schemes", "learned,alibi", "--seeds", "0,1", "--set", "eval.lengths=[32,40,48,56,64]")
    exp, _, _ = smoke_experiment(tmp_path, *more)
    res = invoke("report", exp)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    table = [line.split("|") for line in (exp / "summary.md").read_text().splitlines() if line.startswith("| ")]
    shown = [i for i, head in enumerate(table[0]) if not head.strip().startswith("bpb(")]  # bpb: files only
    numbers = {n for cells in table for i in shown for n in re.findall(r"\d+\.\d+", cells[i])}
    assert numbers and all(_whole(n, res.output) for n in numbers), res.output
    assert "ppl(64)/" in res.output and "ppl(train)" in res.output, res.output


def test_bench_tables_in_80_columns_tell_100_from_1600(tmp_path):
    """With the peer's columns and the first step's, eval memory at 100 and 1600 is headed
    by its length in full, never "mem@1…" twice, and every number is there in full."""
    from posbench.config import ModelConfig
    from posbench.console import bench_table

    rows, where = [], {"device": "cpu (AMD EPYC 7B13, 2 threads)", "attention": "native"}
    for i, s in enumerate(("nope", "sinusoidal", "learned", "alibi")):
        speed = {
            "tokens_per_s": 61234.4 - 997 * i,
            "ratio_vs_nope": 1 - 0.03 * i,
            "mfu": 0.0734,
            "first_call_s": 0.0412,
        }
        peer = {"peer_tokens_per_s": 50876.0 + i, "peer_ratio": 1.21 + 0.01 * i}
        rows.append({"scheme": s, "measurement": "train", **speed, **peer, **where})
        for L, mb in ((100, 3.1 + i), (1600, 655.4 + i)):
            mb = None if s == "learned" and L > 100 else mb  # beyond its table
            rows.append(
                {"scheme": s, "measurement": "eval", "eval_len": L, "peak_mem_mb": mb, "first_call_s": None, **where}
            )
    text = _rendered(bench_table(rows, 1.2e11, ModelConfig(), torch.device("cpu"), "x-transformers", rounds=30))
    assert "…" not in text, text
    head = next(line for line in text.splitlines() if "scheme" in line and "100" in line)
    assert _whole("100", head) and _whole("1600", head), text
    formats = {"tokens_per_s": ".0f", "ratio_vs_nope": ".2f", "peer_tokens_per_s": ".0f", "peer_ratio": ".2f"}
    formats |= {"first_call_s": ".3f"}  # the first step's seconds
    for r in rows:
        for key, fmt in {**formats, "peak_mem_mb": ".1f"}.items():
            if r.get(key) is not None:
                assert _whole(format(r[key], fmt), text), (key, r[key], text)


def test_status_in_80_columns_spends_a_line_or_two_a_run(tmp_path):
    """A run is a line, with its state and whole detail beside it; a sweep's runs, whose
    folder names are long, at most two; no number is cut and nothing ends in "…"."""
    import re

    from posbench.console import status_table

    runs = [
        ("alibi-seed0-train_len64-3f9c2a1e", "running", "training, at step 120 of 500 (pid 4242)"),
        ("rope-seed1-train_len128-0c613c13", "partial", "at step 250 of 500; rerun to resume"),
        ("sinusoidal-seed2-train_len64-85eaff04", "done", "trained and evaluated"),
        ("t5-seed0-train_len128-12ab34cd", "diverged", "at step 37 (loss nan)"),
    ]
    rows = []  # as run_status gives them
    for run, state, detail in runs:
        scheme, seed = run.split("-")[:2]
        rows.append({"run": run, "scheme": scheme, "seed": int(seed[4:]), "train_len": 64})
        rows[-1].update(state=state, detail=detail)
    text = _rendered(status_table(tmp_path / "sweep", rows))
    assert "…" not in text, text
    body = [line for line in text.splitlines() if line.startswith("│")]
    assert len(body) <= 2 * len(rows), text
    for r in rows:
        assert r["run"] in text and all(_whole(n, text) for n in re.findall(r"\d+", r["detail"])), text
    short = [{**r, "run": r["run"].rsplit("-", 2)[0]} for r in rows]  # an experiment's: alibi-seed0
    text = _rendered(status_table(tmp_path / "default", short))
    assert len([line for line in text.splitlines() if line.startswith("│")]) == len(rows), text
    for r in short:
        line = next(line for line in text.splitlines() if f"│ {r['run']} " in line)
        assert r["state"] in line and r["detail"] in line, text


def test_without_a_terminal_progress_lines_come_while_a_run_trains():
    """Output redirected (nohup, CI, tee): a line every tenth of a run, with its loss and
    time left, before the run finishes, not a bar drawn only at its end."""
    import io

    from rich.console import Console

    from posbench.console import BarReporter

    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    reporter = BarReporter(console)
    reporter.start("alibi seed 0", 100)
    for step in range(1, 51):
        reporter.step("alibi seed 0", step, 3.0 - step / 100)
    during = console.file.getvalue()
    assert "alibi seed 0: step 50/100, loss 2.500, eta" in during, during
    assert "alibi seed 0: step 10/100" in during and "step 11/100" not in during, during  # a tenth, not every step
    for step in range(51, 101):
        reporter.step("alibi seed 0", step, 2.0)
    reporter.finish("alibi seed 0")
    assert "alibi seed 0: step 100/100, loss 2.000, took" in console.file.getvalue()


def test_progress_counts_the_runs_in_logs_and_on_a_terminal(smoke):
    """Each run says which of the runs to train it is ("2 of 8"), in a log and in a bar,
    and a bar shows the time left."""
    import io

    from rich.console import Console

    from posbench.console import BarReporter

    exp, res, _ = smoke
    said = " ".join(res.output.split())
    planned = (exp / "runs.txt").read_text().split()  # the runs in the order they were trained
    assert len(planned) == len(SEED_SCHEMES)
    for k, run in enumerate(planned, start=1):
        scheme = run.removesuffix("-seed0")
        assert f"{scheme} seed 0 ({k} of {len(planned)})" in said, res.output
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    reporter = BarReporter(console)
    reporter.plan(3)
    reporter.start("rope seed 1", 100)
    reporter.step("rope seed 1", 50, 2.5)
    reporter.finish("rope seed 1")
    drawn = console.file.getvalue()
    assert "rope seed 1 (1 of 3)" in drawn and "50/100" in drawn and "eta" in drawn, drawn


def test_a_sweeps_progress_names_each_grid_point(tmp_path):
    """Two grid points train "alibi seed 0" each; their progress is told apart by the
    grid point, as the run folder names it (train_len16-<hash>)."""
    text = tmp_path / "tiny.txt"
    text.write_text("to be or not to be that is the question\n" * 400)
    config = tmp_path / "sweep.yaml"
    config.write_text(
        f"name: grid\nout_dir: {tmp_path / 'r'}\ndata: {{path: {text}}}\n"
        "model: {n_layer: 1, n_head: 2, d_model: 32, train_len: 16}\n"
        "train: {steps: 10, batch_size: 4, warmup_steps: 2, log_every: 5, threads: 1}\n"
        "eval: {lengths: [32], tokens: 1024}\n"
        "sweep:\n  schemes: [alibi]\n  model.train_len: [16, 24]\n"
    )
    res = invoke("sweep", config)
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    runs = sorted(p.name for p in (tmp_path / "r" / "grid").iterdir() if p.is_dir())
    assert len(runs) == 2
    for k, run in enumerate(runs, start=1):
        assert f"alibi seed 0, {run.removeprefix('alibi-seed0-')} ({k} of 2)" in said, res.output


def _help(command: str, width: int) -> str:
    from typer.testing import CliRunner

    from posbench.cli import app

    res = CliRunner().invoke(app, [command, "--help"], terminal_width=width, env={"COLUMNS": str(width)})
    assert res.exit_code == 0, res.output
    return res.output


def test_help_prose_reflows_to_the_terminal_and_loses_no_word():
    """A docstring's paragraph does not break where its source line does ("... instead of
    the corpus and" / "scores exact-match accuracy by length."). At any width a paragraph flows
    whole, and every word of it and of each option's help is shown (no <name> taken for markup)."""
    import inspect

    import click
    import typer
    from conftest import folded

    from posbench.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        wide = _help(name, 2000)
        lines = [folded(line).strip() for line in wide.splitlines()]
        for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
            assert " ".join(paragraph.split()) in lines, (name, paragraph, wide)
        shown = folded(_help(name, 80))
        for param in command.params:
            if isinstance(param, click.Option) and param.help:
                assert " ".join(param.help.split()) in shown, (name, param.help, shown)


def test_a_path_is_printed_unbroken_in_80_columns(tmp_path):
    """`wrote results/...` prints a long path whole, never broken across two lines; the
    terminal folds it, so it can be copied."""
    import shutil

    from conftest import ROOT, invoke

    deep = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2) / "reference-bytes"
    shutil.copytree(ROOT / "results" / "reference-bytes", deep)
    res = invoke("report", deep)
    assert res.exit_code == 0, res.output
    assert f"wrote {deep / 'summary.md'}\n" in res.output, res.output


def test_a_quick_scoring_without_a_terminal_says_nothing_and_never_that_it_stopped():
    """A run scored in under QUIET_SCORING_S leaves no line in a sweep's log, least of all
    'scoring rope seed 2 ...: stopped at tokens 0/98304'."""
    import io

    from rich.console import Console

    from posbench.console import BarReporter

    buf = io.StringIO()
    reporter = BarReporter(Console(file=buf, force_terminal=False, width=200))
    for done in (4096, 8192, 12288):
        reporter.scoring("rope seed 2, nonoverlapping", done, 12288)
    assert buf.getvalue() == "", buf.getvalue()
    reporter.scoring("rope seed 3, nonoverlapping", 4096, 12288)  # one stopped short is still said
    reporter.finish("scoring rope seed 3, nonoverlapping")
    assert "stopped at tokens 4,096/12,288" in buf.getvalue(), buf.getvalue()
