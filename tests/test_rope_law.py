"""Where RoPE should break (the scaling law) and where it does (the loss per position)."""

import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import invoke

from posbench.rope_law import MARGIN, break_position, critical_dim, extrapolation_bound

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "results" / "reference"


def test_the_law_gives_the_papers_worked_numbers():
    # Liu et al. 2024: LLaMA2 (d 128, base 10,000, trained at 4,096) has critical dimension 92
    assert critical_dim(128, 10_000, 4096) == 92
    assert extrapolation_bound(128, 10_000, 4096) == pytest.approx(2 * math.pi * 10_000 ** (92 / 128))
    # d_head 32, base 10,000, L = 100 (the defaults): d_extra = 2 ceil(16 log_1e4(100 / 2 pi)) = 10,
    # T_extra = 2 pi 1e4^(10/32) = 111.7
    assert critical_dim(32, 10_000, 100) == 10
    assert extrapolation_bound(32, 10_000, 100) == pytest.approx(111.73, abs=0.01)
    # the bound is the period of the first dim a window of L does not see whole: it is >= L,
    # and the dim before it (d_extra - 2) turns whole within L
    for d, base, L in ((32, 10_000, 100), (64, 100_000, 8192), (128, 500_000, 8192), (32, 100, 100)):
        k = critical_dim(d, base, L)
        assert extrapolation_bound(d, base, L) >= L > 2 * math.pi * base ** ((k - 2) / d)
    # a base so small that every dim turns whole within L: nothing unseen, no bound
    assert critical_dim(32, 10, 100) == 32 and extrapolation_bound(32, 10, 100) == math.inf


def test_the_break_is_the_first_bin_past_l_above_the_level_by_the_margin():
    L = 100
    flat = pd.Series(2.0, index=range(400))
    assert break_position(flat, L) is None
    step = flat.copy()
    step[step.index >= 230] = 2.0 * (1 + 2 * MARGIN)  # rises at 230: the bin [230, 240) is first
    assert break_position(step, L) == 230
    below = flat.copy()
    below[below.index >= 150] = 2.0 * (1 + MARGIN / 2)  # under the margin: no break
    assert break_position(below, L) is None
    early = step.copy()
    early[early.index < 50] = 9.0  # the first positions' loss (little context) is not the level
    assert break_position(early, L) == 230


def test_the_reference_report_sets_the_law_beside_each_seeds_measured_break(tmp_path):
    res = invoke("report", str(REFERENCE), "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    md = (tmp_path / "summary.md").read_text()
    head = "| scheme | d | base | trained at | d_extra | predicted break | measured break | seeds |"
    assert head in md
    row = next(line for line in md.splitlines() if line.startswith("| rope | 32 |"))
    breaks = []
    for seed in range(3):  # derived here from each seed's positions.csv.gz, as the law's own words say
        pos = pd.read_csv(REFERENCE / f"rope-seed{seed}" / "positions.csv.gz")
        pos = pos[(pos["protocol"] == "nonoverlapping") & (pos["length"] == pos["length"].max())]
        breaks.append(break_position(pos.set_index("position")["loss"], 100))
    assert None not in breaks
    from posbench.stats import mean_ci

    mean, ci = mean_ci(breaks)
    assert row == f"| rope | 32 | 10000 | 100 | 10 | 112 | {mean:.0f} ± {ci:.0f} | 3 |", row
    assert "| alibi |" not in md.split(head)[1]  # only rotary runs have a law


def test_the_committed_base_sweep_rebuilds_a_point_per_base_and_sets_each_law_beside_its_breaks(tmp_path):
    """results/rope-base (configs/rope-base.yaml): runs of one scheme and seed that differ only in
    scheme_options.rope.base are a grid point each, where the report failed on them; each base's
    row holds the law's numbers and its seeds' breaks, derived here from the records."""
    from conftest import rebuilds_byte_for_byte

    from posbench.stats import mean_ci

    committed = rebuilds_byte_for_byte("rope-base", tmp_path)
    md = (committed / "summary.md").read_text()
    for base in (10.0, 100.0, 10000.0, 1000000.0):
        assert f"## scheme_options.rope.base={base}; nonoverlapping" in md
        broke = []
        for run in sorted(committed.glob(f"rope-seed*-base{base}-*")):
            pos = pd.read_csv(run / "positions.csv.gz")
            pos = pos[pos["length"] == pos["length"].max()]
            broke.append(break_position(pos.set_index("position")["loss"], 100))
        assert len(broke) == 3 and None not in broke
        mean, ci = mean_ci(broke)
        bound = extrapolation_bound(32, base, 100)
        predicted = "none" if math.isinf(bound) else f"{bound:.0f}"
        row = (
            f"| rope (scheme_options.rope.base={base}) | 32 | {base:g} | 100 | {critical_dim(32, base, 100)} | "
            f"{predicted} | {mean:.0f} ± {ci:.0f} | 3 |"
        )
        assert row in md, (row, md)
    assert (committed / "rope_law.png").is_file()


def test_a_pretrained_model_whose_config_sets_its_head_size_apart_is_read_at_that_size(tmp_path):
    """As Qwen3's configs do: width 256 and 4 heads, yet head_dim 128; transformers rotates 128 dims
    a head, so the law takes d = 128 (64 would put its break at 6,283 instead of 5,063 at L = 4096)."""
    transformers = pytest.importorskip("transformers")
    from posbench.config import ExperimentConfig
    from posbench.experiment.pretrained import model_config
    from posbench.pretrained import PretrainedLM
    from posbench.rope_law import rotary

    config = transformers.Qwen3Config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=64,
        num_hidden_layers=1, vocab_size=32, rope_theta=1_000_000, max_position_embeddings=40960,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    model = PretrainedLM(transformers.Qwen3ForCausalLM(config), None, tmp_path)
    rc = model_config(ExperimentConfig(), model, "tokenizer.json")
    d, base = rotary(rc)
    assert (d, base) == (2 * model.rotary.inv_freq.numel(), 1e6) == (128, 1e6)
    assert round(extrapolation_bound(d, base, 4096)) == 5063
