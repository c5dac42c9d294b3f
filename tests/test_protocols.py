"""Evaluation protocols and the loss per position: every token scored once, as each protocol says."""

import csv
import gzip
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOKE, invoke

from posbench.check import tiny_model
from posbench.errors import PosbenchError
from posbench.evaluate import evaluate_model, stride_tokens, windows

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "protocol,stride", [("nonoverlapping", None), ("sliding", 1), ("sliding", 3), ("sliding", 7), ("sliding", 0.5)]
)
@pytest.mark.parametrize("n,L", [(40, 8), (43, 8), (8, 8), (9, 8), (43, 6)])
def test_windows_score_every_target_once_with_the_context_the_protocol_promises(protocol, stride, n, L):
    if protocol == "sliding" and stride_tokens(stride, L) > L:  # 7 at 6: a window cannot score its stride
        with pytest.raises(PosbenchError, match="sliding stride 7 is longer than the window of 6"):
            windows(n, L, protocol, stride)
        return
    seen = []
    for start, first in windows(n, L, protocol, stride):
        end = min(start + L, n)
        assert 0 <= start and 0 <= first <= end - start
        for t in range(start + first, end):
            seen.append(t)
            context = t - start  # tokens before target t inside its window
            if protocol == "sliding" and t >= L:
                assert context >= L - stride_tokens(stride, L)
    assert seen == list(range(n))


def test_a_fractional_stride_is_that_fraction_of_each_length():
    assert [stride_tokens(0.5, L) for L in (8, 1024, 16384)] == [4, 512, 8192]
    assert stride_tokens(0.25, 6) == 2 and stride_tokens(0.01, 8) == 1 and stride_tokens(3, 100) == 3
    model, tokens = _model_and_tokens()
    half, _ = evaluate_model(model, tokens, [16, 32], 3, CPU, protocol="sliding", stride=0.5)
    for row in half:  # each length's row is the token stride of half of it, to the last bit
        (tokens_stride,), _ = evaluate_model(
            model, tokens, [row["length"]], 3, CPU, protocol="sliding", stride=row["length"] // 2
        )
        assert row["loss"] == tokens_stride["loss"] and row["stride"] == 0.5


def _model_and_tokens():
    torch.manual_seed(0)
    model = tiny_model("alibi")  # a bias, so position matters
    return model, torch.randint(0, 256, (65,), generator=torch.Generator().manual_seed(1))  # 64 targets


def test_sliding_with_the_stride_of_the_window_is_non_overlapping():
    model, tokens = _model_and_tokens()
    a, pa = evaluate_model(model, tokens, [16, 32], 3, CPU, protocol="nonoverlapping")
    b, pb = evaluate_model(model, tokens, [16, 32], 3, CPU, protocol="sliding", stride=16)
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=1e-6)
    assert torch.allclose(pa[16][0], pb[16][0], atol=1e-5) and torch.equal(pa[16][1], pb[16][1])
    assert b[1]["protocol"] == "sliding" and b[1]["stride"] == 16 and a[1]["stride"] is None


def test_stride_one_scores_each_token_on_the_window_before_it():
    """Each token's loss, from the positions' sums, equals a plain loop that feeds the model
    the L-1 tokens before it (all of them where fewer exist)."""
    model, tokens = _model_and_tokens()
    L = 16
    (row,), by_pos = evaluate_model(model, tokens, [L], 4, CPU, protocol="sliding", stride=1)
    n = len(tokens) - 1
    want = []
    with torch.no_grad():
        for t in range(n):  # target t+1 given tokens[max(0, t-L+1) .. t]
            start = max(0, t - L + 1)
            logits = model(tokens[None, start : t + 1].long())
            want.append(F.cross_entropy(logits[0, -1:], tokens[t + 1 : t + 2].long()).item())
    sums, counts, _ = by_pos[L]
    # positions 0..L-2 come from the first window only; position L-1 sums every later one
    assert counts.tolist() == [1] * (L - 1) + [n - L + 1]
    assert torch.allclose(sums[: L - 1], torch.tensor(want[: L - 1], dtype=torch.float64), atol=1e-5)
    assert sums[L - 1].item() == pytest.approx(sum(want[L - 1 :]), abs=1e-4)
    assert row["loss"] == pytest.approx(sum(want) / n, abs=1e-6)


@pytest.mark.parametrize("protocol,stride", [("nonoverlapping", None), ("sliding", 5)])
def test_the_loss_per_position_averages_token_weighted_to_the_reported_loss(protocol, stride):
    model, tokens = _model_and_tokens()
    rows, by_pos = evaluate_model(model, tokens, [16, 20, 28], 4, CPU, protocol=protocol, stride=stride)
    for row in rows:
        sums, counts, _ = by_pos[row["length"]]
        assert counts.sum().item() == len(tokens) - 1
        means = sums / counts.clamp(min=1)
        assert (means * counts).sum().item() / counts.sum().item() == pytest.approx(row["loss"], abs=1e-9)


@pytest.mark.plots
def test_both_protocols_are_rows_of_one_experiment_with_positions_on_disk(tmp_path, corpus_file):
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi,rope",
        "--protocol",
        "nonoverlapping,sliding",
        "--stride",
        "8",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0, res.output
    exp = tmp_path / "smoke"
    rows = list(csv.DictReader((exp / "summary.csv").open()))
    assert {(r["protocol"], r["stride"]) for r in rows} == {("nonoverlapping", ""), ("sliding", "8")}
    assert len(rows) == 2 * 2 * 3  # schemes x protocols x lengths
    text = (exp / "summary.md").read_text()
    assert "## nonoverlapping" in text and "## sliding, stride 8" in text
    assert "sliding evaluation, stride 8:" in " ".join(res.output.split())
    assert (exp / "positions.png").is_file() and (exp / "summary.png").is_file()
    pos = list(csv.DictReader(gzip.open(exp / "alibi-seed0" / "positions.csv.gz", "rt")))
    evals = list(csv.DictReader((exp / "alibi-seed0" / "eval.csv").open()))
    for r in evals:
        mine = [
            p for p in pos if (p["length"], p["protocol"], p["stride"]) == (r["length"], r["protocol"], r["stride"])
        ]
        assert len(mine) == int(r["length"])
        total = sum(float(p["loss"]) * int(p["tokens"]) for p in mine) / sum(int(p["tokens"]) for p in mine)
        assert math.isclose(total, float(r["loss"]), rel_tol=1e-9)
    # a rerun with one protocol scores nothing new, and a report rebuilds both from the records
    before = (exp / "alibi-seed0" / "eval.csv").read_text()
    assert (
        invoke(
            "extrapolate",
            "--config",
            SMOKE,
            "--schemes",
            "alibi,rope",
            "--set",
            f"out_dir={tmp_path}",
            "--set",
            f"data.path={corpus_file}",
        ).exit_code
        == 0
    )
    assert (exp / "alibi-seed0" / "eval.csv").read_text() == before
    assert invoke("report", exp).exit_code == 0 and "## sliding, stride 8" in (exp / "summary.md").read_text()


def test_evaluate_adds_sliding_rows_beside_the_non_overlapping_ones(tmp_path, corpus_file):
    """`posbench evaluate RUN --protocol sliding --stride 8` scores the run's checkpoint with
    sliding windows and merges those rows into its eval.csv, beside the ones it holds."""
    res = invoke(
        "extrapolate",
        "--config",
        SMOKE,
        "--schemes",
        "alibi",
        "--set",
        "train.steps=2",
        "--set",
        f"out_dir={tmp_path}",
        "--set",
        f"data.path={corpus_file}",
    )
    assert res.exit_code == 0, res.output
    run = tmp_path / "smoke" / "alibi-seed0"
    before = {(r["length"], r["protocol"], r["stride"]) for r in csv.DictReader((run / "eval.csv").open())}
    assert {(p, s) for _, p, s in before} == {("nonoverlapping", "")}
    # its loss per position as a plain positions.csv, which is read as the .gz is and replaced by it
    plain = gzip.decompress((run / "positions.csv.gz").read_bytes()).decode()
    (run / "positions.csv").write_text(plain)
    (run / "positions.csv.gz").unlink()
    res = invoke("evaluate", run, "--stride", "8")  # the run's protocol has no sliding window to step
    assert res.exit_code == 2 and "--stride 8: a stride is the sliding windows' step" in " ".join(res.output.split())
    res = invoke("evaluate", run, "--protocol", "sliding", "--stride", "8")
    assert res.exit_code == 0, res.output
    after = {(r["length"], r["protocol"], r["stride"]) for r in csv.DictReader((run / "eval.csv").open())}
    lengths = {length for length, _, _ in before}
    assert after == before | {(length, "sliding", "8") for length in lengths}
    assert not (run / "positions.csv").exists()
    rows = list(csv.DictReader(gzip.open(run / "positions.csv.gz", "rt")))
    kept = [r for r in rows if r["protocol"] == "nonoverlapping"]
    assert kept == list(csv.DictReader(plain.splitlines())) and len(rows) > len(kept)


def test_a_gzipped_record_is_the_same_bytes_for_the_same_rows_and_a_broken_one_is_one_line(tmp_path):
    """positions.csv.gz carries neither a name nor a time, so scoring the same rows again leaves
    a committed file byte for byte as it was; a truncated or foreign file is refused as a
    malformed record."""
    from conftest import ROOT

    from posbench.errors import PosbenchError
    from posbench.files import write_rows
    from posbench.measures.perplexity.records import POSITION_COLUMNS, read_positions

    committed = ROOT / "results" / "reference" / "alibi-seed0"
    rows = read_positions(committed)
    assert len(rows) > 100
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        write_rows(folder / "positions.csv.gz", rows, POSITION_COLUMNS)
        write_rows(folder / "positions.csv", rows, POSITION_COLUMNS)
    assert (a / "positions.csv.gz").read_bytes() == (committed / "positions.csv.gz").read_bytes()
    assert gzip.decompress((a / "positions.csv.gz").read_bytes()) == (a / "positions.csv").read_bytes()
    (b / "positions.csv.gz").unlink()
    assert read_positions(b) == read_positions(a) == rows  # the plain file alone; the .gz where both are
    for broken in ((a / "positions.csv.gz").read_bytes()[:-12], b"not gzip at all"):
        (a / "positions.csv.gz").write_bytes(broken)
        with pytest.raises(PosbenchError, match="positions.csv.gz: malformed loss-per-position rows"):
            read_positions(a)


def test_a_stride_below_one_slides_every_length_by_its_fraction_and_is_named_so(tmp_path, corpus_file):
    """--stride 0.5 is half of each length, where a stride of tokens longer than the shortest
    window is refused; a whole stride typed as 16.0 is the 16 tokens it names."""
    common = ["--schemes", "alibi", "--set", "train.steps=2", "--set", f"data.path={corpus_file}"]
    common += ["--set", f"out_dir={tmp_path}", "--protocol", "sliding"]
    res = invoke("extrapolate", "--config", SMOKE, "--stride", "0.5", *common)
    assert res.exit_code == 0, res.output
    exp = tmp_path / "smoke"
    rows = list(csv.DictReader((exp / "alibi-seed0" / "eval.csv").open()))
    assert {(r["protocol"], r["stride"]) for r in rows} == {("sliding", "0.5")} and len(rows) > 1
    assert "## sliding, stride 0.5 x length" in (exp / "summary.md").read_text()
    assert (exp / "alibi-seed0" / "config.yaml").read_text().count("stride: 0.5") == 1
    res = invoke("evaluate", exp / "alibi-seed0", "--protocol", "sliding", "--stride", "16.0")
    assert res.exit_code == 0, res.output
    strides = {r["stride"] for r in csv.DictReader((exp / "alibi-seed0" / "eval.csv").open())}
    assert strides == {"0.5", "16"}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--protocol", "slidng"], "eval.perplexity.protocol: unknown protocol 'slidng' (did you mean 'sliding'?)"),
        (["--protocol", "sliding", "--stride", "0"], "eval.perplexity.stride=0 must be a whole number of tokens"),
        (["--protocol", "sliding", "--stride", "2.5"], "eval.perplexity.stride=2.5 must be a whole number of tokens"),
        (["--protocol", "sliding", "--stride", "33"], "eval.perplexity.stride=33 is longer than the shortest window"),
        (["--set", "eval.perplexity.protocol=[]"], "eval.perplexity.protocol is empty"),
    ],
)
def test_bad_protocols_and_strides_are_one_line_and_write_nothing(tmp_path, args, message):
    res = invoke("extrapolate", "--config", SMOKE, "--set", f"out_dir={tmp_path / 'r'}", *args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "r").exists()
