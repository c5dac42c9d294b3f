"""The benchmark's quick mode, once: every scheme gets a throughput row and memory rows."""

import csv
import io
import os
import time

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from posbench import attention
from posbench.bench import BENCH_COLUMNS, model_flops_per_token
from posbench.cli import app
from posbench.config import ModelConfig
from posbench.errors import PosbenchError
from posbench.model import TransformerLM
from posbench.schemes import SEED_SCHEMES


def test_bench_quick_writes_every_row(tmp_path):
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(app, ["bench", "--quick", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == BENCH_COLUMNS
    train = {r["scheme"]: r for r in rows if r["measurement"] == "train"}
    assert sorted(train) == sorted(SEED_SCHEMES)
    # the speeds are said before the memory part starts, so a bench stopped there keeps them
    said = res.output.index("training speed: nope ")
    assert said < res.output.index("evaluation memory:")
    line = res.output[said:].splitlines()[0]
    for s, r in train.items():  # a busy machine may leave a time unconfirmed: blank, and said so
        assert r["peer_ratio"] == ""  # no peer ran
        who = f"{s} {r['attention']}"
        if r["tokens_per_s"] == "":
            assert r["ratio_vs_nope"] == r["mfu"] == "" and f"{who} unconfirmed" in line, s
            continue
        # the peak is timed beside the model, so load slows both; 2x it would be a FLOP count gone wrong
        assert float(r["tokens_per_s"]) > 0 and (r["mfu"] == "" or 0 < float(r["mfu"]) < 2)
        if r["ratio_vs_nope"]:
            assert f"{who} {float(r['tokens_per_s']):,.0f} tokens/s ({float(r['ratio_vs_nope']):.2f}x NoPE)" in line
    assert train["nope"]["ratio_vs_nope"] in ("", "1.0")
    assert "first step s" in res.output and all(float(r["first_call_s"]) >= 0 for r in train.values())
    first_forward = {r["first_call_s"] for r in rows if r["measurement"] == "eval"}
    if torch.cuda.is_available():  # auto picked the GPU: each length's one forward, compiling
        assert all(float(v) >= 0 for v in first_forward)
    else:  # a CPU's runs under the profiler, whose time it would mostly be: left blank
        assert first_forward == {""}
    for s in SEED_SCHEMES:
        mem = {
            int(r["eval_len"]): float(r["peak_mem_mb"]) for r in rows if r["measurement"] == "eval" and r["scheme"] == s
        }
        assert sorted(mem) == [100, 1600, 3200]
        # twice the length: about twice the memory when it is linear, four times if quadratic
        assert mem[100] < mem[1600] < mem[3200] < 2.6 * mem[1600], (s, mem)


@pytest.mark.parametrize("scheme", ["learned", "randomized"])
def test_memory_of_a_scheme_with_a_position_limit_is_measured_with_one_long_enough(tmp_path, scheme, small_peak):
    """learned's table (1024) and randomized's draws (max_pos 1024) stop short of 3200; the
    bench measures a copy whose limit is the longest length rather than leave those cells empty."""
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(app, ["bench", "--quick", "--schemes", scheme, "--out", str(out)])
    assert res.exit_code == 0, res.output
    mem = {
        int(r["eval_len"]): r["peak_mem_mb"]
        for r in csv.DictReader(out.open())
        if r["measurement"] == "eval" and r["scheme"] == scheme
    }
    assert sorted(mem) == [100, 1600, 3200] and all(float(v) > 0 for v in mem.values()), mem


def test_unknown_peer_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["bench", "--quick", "--peer", "nanogpt", "--out", str(tmp_path / "b.csv")])
    assert res.exit_code != 0 and "unknown peer" in res.output and "Traceback" not in res.output


def test_flops_per_token_counts_matmul_weights_and_attention():
    cfg = ModelConfig()
    model = TransformerLM(cfg)
    C, L, T = cfg.d_model, cfg.n_layer, cfg.train_len
    per_layer = 3 * C * C + C * C + 2 * 4 * C * C  # qkv, proj, the two MLP matrices
    want = 6 * (L * per_layer + 256 * C) + 12 * L * C * T  # the tied head is a 256 x C matmul
    assert model_flops_per_token(cfg, model) == pytest.approx(want)


def test_without_the_kernels_the_table_says_so_and_names_the_backend(tmp_path, monkeypatch, small_peak):
    """auto then runs on SDPA: the rows name it, and a note under the table says why."""
    from posbench import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "unavailable", {})
    monkeypatch.setenv("POSBENCH_NATIVE", "0")
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(app, ["bench", "--quick", "--schemes", "cope", "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert (
        "the native backend cannot run (the attention kernel is unavailable (turned off by POSBENCH_NATIVE=0))" in text
    )
    rows = list(csv.DictReader(out.open()))
    assert {r["scheme"] for r in rows} == {"nope", "cope"} and {r["attention"] for r in rows} == {"sdpa"}


def test_cope_eval_memory_stays_linear_through_its_kernel():
    import torch

    from posbench import native
    from posbench.bench import eval_peak_memory_mb

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(scheme="cope")).eval()
    mem = {L: eval_peak_memory_mb(model, L) for L in (1600, 3200)}
    assert mem[3200] < 2.6 * mem[1600], mem  # quadratic would be 4x
    if native.load("cope") is not None:  # and the kernel is what ran
        calls = []
        real = native.CoPEAttention.apply
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native.CoPEAttention, "apply", lambda *a: calls.append(1) or real(*a))
            eval_peak_memory_mb(model, 600)
        assert calls


def test_out_may_name_a_folder_and_a_bad_out_fails_before_any_timing(tmp_path, monkeypatch, small_peak):
    from posbench import bench

    res = CliRunner().invoke(app, ["bench", "--quick", "--schemes", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [r["scheme"] for r in csv.DictReader((tmp_path / "bench.csv").open())][0] == "nope"

    timed = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: timed.append(1))
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    res = CliRunner().invoke(app, ["bench", "--quick", "--out", str(blocker / "bench.csv")])
    assert res.exit_code != 0 and "Traceback" not in res.output and "a-file" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not timed
    assert blocker.read_text() == "kept"


def test_bench_builds_each_scheme_with_the_configs_options(tmp_path, monkeypatch, small_peak):
    from posbench import bench

    built = []
    real = bench.TransformerLM
    monkeypatch.setattr(bench, "TransformerLM", lambda mc: built.append((mc.scheme, mc.options)) or real(mc))
    res = CliRunner().invoke(
        app, ["bench", "--quick", "--schemes", "t5", "--out", str(tmp_path), "--set", "scheme_options.t5.num_buckets=8"]
    )
    assert res.exit_code == 0, res.output
    t5 = [o for s, o in built if s == "t5"]
    assert t5 and all(o["num_buckets"] == 8 and o["scale"] == "sqrt_head_dim" for o in t5)  # the rest: defaults
    assert ("nope", {}) in built


def test_a_peer_that_cannot_build_the_shape_is_one_line(tmp_path, monkeypatch):
    from posbench import bench

    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return 1 // 0  # what x-transformers' rotary embedding did at head dim 2

    monkeypatch.setattr(bench, "_import_peer", lambda peer: None)
    monkeypatch.setattr(bench, "xtransformers_model", lambda s, mc: Broken() if s == "rope" else None)
    res = CliRunner().invoke(
        app, ["bench", "--quick", "--schemes", "rope", "--peer", "x-transformers", "--out", str(tmp_path)]
    )
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--peer x-transformers cannot train rope at this size" in res.output
    assert "ZeroDivisionError" in res.output and not (tmp_path / "bench.csv").exists()


@pytest.mark.parametrize("name", ["eval.csv", "config.yaml"])  # a run's records, anyone's file
def test_out_never_replaces_a_file_that_is_not_a_bench_csv(tmp_path, monkeypatch, name):
    from posbench import bench

    timed = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: timed.append(1))
    kept = tmp_path / name
    kept.write_text("length,ppl\n100,6.2\n")
    res = CliRunner().invoke(app, ["bench", "--quick", "--out", str(kept)])
    assert res.exit_code == 2 and "Traceback" not in res.output and not timed, res.output
    assert f"{kept}: exists and is not a bench CSV" in res.output and len(res.output.strip().splitlines()) == 1
    assert kept.read_text() == "length,ppl\n100,6.2\n"


def test_out_replaces_a_symlinks_target_and_refuses_a_pipe(tmp_path, small_peak):
    target = tmp_path / "real.csv"
    target.write_text("scheme,measurement,tokens_per_s\nnope,train,1\n")  # an earlier bench's
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    res = CliRunner().invoke(app, ["bench", "--quick", "--schemes", "nope", "--out", str(link)])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and target.read_text().startswith("scheme,")

    pipe = tmp_path / "pipe"  # like /dev/null: renaming a file over it would destroy it
    os.mkfifo(pipe)
    res = CliRunner().invoke(app, ["bench", "--quick", "--out", str(pipe)])
    assert res.exit_code == 2 and f"{pipe}: exists and is not a plain file" in res.output
    assert pipe.is_fifo()


def test_interleaved_rounds_shuffle_the_order_so_no_function_always_follows_another():
    """The function timed right after the 2048² matmul finds the cache flushed; with one fixed
    order that would be NoPE in every round, lowering the baseline of every ratio by ~3%."""
    from posbench.bench import BenchSettings, time_interleaved

    calls = []
    names = ("matmul", "nope", "t5", "rope")
    steps = {name: (lambda name=name: calls.append(name)) for name in names}
    sec = time_interleaved(steps, BenchSettings(steps=1, rounds=12, warmup=0))
    assert sorted(sec) == sorted(names)
    rounds = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert len(rounds) == 12 and all(sorted(r) == sorted(names) for r in rounds)  # each once a round
    after_matmul = {r[r.index("matmul") + 1] for r in rounds if r[-1] != "matmul"}
    assert after_matmul == {"nope", "t5", "rope"}
    calls.clear()
    time_interleaved(steps, BenchSettings(steps=1, rounds=12, warmup=0))
    assert [calls[i : i + 4] for i in range(0, len(calls), 4)] == rounds  # the same orders every run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_on_a_missing_gpu_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(app, ["bench", "--quick", "--device", "cuda", "--out", str(out)])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "train.device=cuda: no CUDA device is available here (bench takes --device cpu)" in res.output
    assert not out.exists()


# seconds a step, the same in every round: each ratio follows from them alone
SIDE_BY_SIDE = {"matmul peak": 1.0, "nope eager": 2.0, "nope sdpa": 1.0, "t5 eager": 4.0, "t5 sdpa": 2.5}


@pytest.fixture
def fixed_times(monkeypatch):
    from posbench import bench

    monkeypatch.setattr(bench, "time_interleaved", lambda steps, s, sync: {k: [SIDE_BY_SIDE[k]] * 2 for k in steps})


def test_backends_side_by_side_are_timed_in_one_run_against_nope_under_the_first(fixed_times, small_peak):
    from posbench.bench import BenchSettings, run_bench

    s = BenchSettings(batch_size=2, steps=1, rounds=2, warmup=0, multiples=(1, 4))
    rows, _ = run_bench(
        ModelConfig(n_layer=1, d_model=32, n_head=2, train_len=16), ["t5"], s, backends=["eager", "sdpa"]
    )
    train = {(r["scheme"], r["attention"]): r for r in rows if r["measurement"] == "train"}
    assert list(train) == [("nope", "eager"), ("nope", "sdpa"), ("t5", "eager"), ("t5", "sdpa")]
    for (scheme, backend), r in train.items():  # NoPE under eager takes 2.0 s a step
        assert r["ratio_vs_nope"] == pytest.approx(2.0 / SIDE_BY_SIDE[f"{scheme} {backend}"])
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / SIDE_BY_SIDE[f"{scheme} {backend}"])
    evals = sorted((r["scheme"], r["attention"], r["eval_len"]) for r in rows if r["measurement"] == "eval")
    assert evals == sorted((s, b, L) for s, b in train for L in (16, 64))


def test_the_bench_command_tables_each_scheme_under_each_backend(tmp_path, fixed_times, small_peak):
    out = tmp_path / "bench.csv"
    args = ["bench", "--quick", "--schemes", "t5", "--attention", "eager,sdpa", "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--set", "model.n_layer=1", "--set", "model.train_len=16"])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "attention eager, sdpa;" in said and "x NoPE: against NoPE under eager" in said
    # --quick's batch of 4 x 16 tokens a step
    assert "training speed: nope eager 32 tokens/s (1.00x NoPE), nope sdpa 64 tokens/s (2.00x NoPE)" in said
    assert "t5 eager 16 tokens/s (0.50x NoPE), t5 sdpa 26 tokens/s (0.80x NoPE)" in said
    for who, ratio in [("nope sdpa", "2.00"), ("t5 eager", "0.50"), ("t5 sdpa", "0.80")]:
        rows = [line.split("│") for line in res.output.splitlines() if line.startswith("│")]
        assert any(cells[1].strip() == who and cells[3].strip() == ratio for cells in rows), who
    assert [(r["scheme"], r["attention"]) for r in csv.DictReader(out.open()) if r["measurement"] == "train"] == [
        ("nope", "eager"),
        ("nope", "sdpa"),
        ("t5", "eager"),
        ("t5", "sdpa"),
    ]


@pytest.mark.parametrize(
    "given, said",
    [
        ("sdpa,bogus", "--attention sdpa,bogus: 'bogus' is not one of auto, eager, sdpa, native, flex"),
        ("sdpa,eager,sdpa", "--attention sdpa,sdpa: these run as one backend here; give it once"),
        (",", "--attention ',': name a backend, or several: e.g. sdpa,flex"),
        ("sdpa,flex", "--attention sdpa,flex: model.attention=flex: torch has no FlexAttention backward on a CPU"),
    ],
)
def test_a_bad_list_of_backends_is_one_line_before_any_timing(tmp_path, monkeypatch, given, said):
    from posbench import bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("timed"))
    res = CliRunner().invoke(app, ["bench", "--quick", "--attention", given, "--out", str(tmp_path / "b.csv")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert said in " ".join(res.output.split()) and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "b.csv").exists()


def test_rows_name_the_cpu_and_its_threads(tmp_path):
    from posbench.bench import BenchSettings, device_name, run_bench

    s = BenchSettings(batch_size=2, steps=1, rounds=2, warmup=0, multiples=(1,))
    rows, _ = run_bench(ModelConfig(n_layer=1, d_model=32, n_head=2), ["nope"], s)
    assert {r["device"] for r in rows} == {device_name(torch.device("cpu"))}
    assert device_name(torch.device("cpu")).endswith(f", {torch.get_num_threads()} threads")


def test_a_longer_train_len_is_not_stopped_by_the_configs_test_lengths(tmp_path, small_peak):
    """The bench measures at its own multiples; the default eval.lengths (100..200) are not its."""
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--quick",
            "--schemes",
            "nope",
            "--set",
            "model.train_len=300",
            "--set",
            "model.n_layer=1",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    lens = sorted(int(r["eval_len"]) for r in csv.DictReader(out.open()) if r["measurement"] == "eval")
    assert lens == [300, 4800, 9600]


def test_rounds_is_checked_and_used(tmp_path, monkeypatch, small_peak):
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(app, ["bench", "--quick", "--rounds", "1", "--out", str(out)])
    assert res.exit_code != 0 and "--rounds 1: at least two rounds are needed" in res.output
    assert "Traceback" not in res.output and not out.exists()
    import posbench.bench as bench

    seen = []
    real = bench.time_interleaved
    monkeypatch.setattr(bench, "time_interleaved", lambda steps, s, *a: seen.append(s.rounds) or real(steps, s, *a))
    res = CliRunner().invoke(
        app, ["bench", "--quick", "--rounds", "2", "--schemes", "nope", "--set", "model.n_layer=1", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert seen == [2]


@pytest.mark.parametrize("mode", [["--data"], ["--task", "copy"]])
@pytest.mark.parametrize("rounds", ["0", "-3"])
def test_the_data_and_task_benchmarks_refuse_rounds_that_time_nothing(tmp_path, mode, rounds):
    res = CliRunner().invoke(app, ["bench", *mode, "--rounds", rounds])
    assert res.exit_code == 2 and f"--rounds {rounds} must be positive" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_bench_task_times_a_step_whole_and_in_parts_on_the_same_instances(tmp_path):
    from posbench.tasks import PAD, build_task

    tiny = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "train.batch_size=16"]
    res = CliRunner().invoke(app, ["bench", "--task", "copy", "--schemes", "alibi", "--rounds", "1", *tiny])
    assert res.exit_code == 0, res.output
    assert "task copy, alibi: one training step on the CPU, 4 layers, batch 16" in res.output  # the recipe's depth
    rows = {}
    for line in res.output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 4 and cells[0] and cells[1][:1].isdigit():
            rows[cells[0]] = cells
    assert list(rows) == ["padded whole", "2 parts by length", "3 parts by length", "4 parts by length"]
    assert rows["padded whole"][2] == "1.00" and all(float(r[1]) > 0 for r in rows.values())
    batches = build_task("copy", {}).batches(0, 16)
    batches()  # the warm-up round's batch
    x, _ = batches()  # the last round's: every stream draws the same instances
    assert rows["padded whole"][3] == f"{100 * float((x == PAD).float().mean()):.0f}%"
    padding = [int(r[3].rstrip("%")) for r in rows.values()]
    assert padding == sorted(padding, reverse=True) and padding[2] < padding[0] / 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--task", "lm"], "--task lm: a corpus's batches are all one length; give a task, e.g. --task copy"),
        (["--task", "copy", "--data"], "--data and --task are two benchmarks: give one"),
        (["--task", "copi"], "unknown task 'copi' (did you mean 'copy'?)"),
        (["--data", "--quick", "--set", "data.path=/no/such.txt"], "data.path '/no/such.txt' matches no file"),
    ],
)
def test_bench_task_refuses_bad_input_in_one_line(args, message):
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


# --- a time stands where a second round confirms it ------------------------------------------


def test_the_fastest_round_stands_only_where_another_comes_within_agree_of_it():
    """Load only adds time, so the fastest round is the estimate; a lone one (one round, or a
    lucky round among stalled ones) is no estimate."""
    from posbench.bench import AGREE, confirmed

    assert confirmed([0.02]) is None  # one round: nothing to confirm it
    assert confirmed([0.9, 0.02, 0.02 * AGREE, 2.0]) == 0.02
    assert confirmed([0.9, 0.02, 0.02 * AGREE * 1.01, 2.0]) is None


def test_quick_mode_times_enough_rounds_for_two_to_agree_and_warms_past_the_first_step():
    """--quick times rounds that can confirm each other, past the first, slow step of each model
    (AdamW allocating its state): one round of two steps on a busy machine can read 30 times
    slow."""
    from posbench.bench import BenchSettings

    quick = BenchSettings.quick()
    assert quick.rounds >= 3 and quick.warmup >= 2 and quick.rounds < BenchSettings().rounds


def test_bench_shows_no_rate_its_rounds_did_not_confirm(tmp_path, monkeypatch):
    """Round times stood in for by hand: NoPE's agree, RoPE's fastest round is alone and the
    matmul's disagree. NoPE gets its tokens/s, RoPE a — with no ratio or MFU, every MFU a —,
    and a line below the tables names them."""
    import posbench.bench as bench
    from posbench.bench import AGREE

    nope = [0.010, 0.010 * AGREE, 0.5, 0.4, 0.3]
    rounds = {"matmul peak": [0.3, 0.9, 0.6, 1.2, 0.45], "nope": nope, "rope": [0.010, 0.5, 0.9, 0.2, 0.3]}
    monkeypatch.setattr(bench, "time_interleaved", lambda steps, s, *a: {k: rounds[k] for k in steps})
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(
        app, ["bench", "--quick", "--schemes", "rope", "--set", "model.n_layer=1", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    train = {r["scheme"]: r for r in csv.DictReader(out.open()) if r["measurement"] == "train"}
    quick = bench.BenchSettings.quick()
    assert float(train["nope"]["tokens_per_s"]) == pytest.approx(quick.batch_size * 100 / min(nope))
    assert train["rope"]["tokens_per_s"] == train["rope"]["ratio_vs_nope"] == ""
    assert train["nope"]["mfu"] == train["rope"]["mfu"] == ""
    text = " ".join(res.output.split())
    assert f"rope {train['rope']['attention']} unconfirmed" in text and "fp32 matmul peak —" in text
    assert f"no two of the {quick.rounds} rounds came within {AGREE - 1:.0%} of each other for rope, the matmul" in text


# --- a first call's time apart from the steady state -----------------------------------------


FIRST_S = 0.05  # the fake first step's sleep: a lower bound, never a speed to assert


def test_the_first_step_is_timed_alone_before_the_rounds_and_its_seconds_are_written(tmp_path, monkeypatch, small_peak):
    """A fake step sleeps on its first call only (as compiling, or AdamW allocating its state, takes
    time once): each model's first_call_s is at least that sleep, the rounds start after exactly
    one call, and the CSV and the table carry the same number."""
    import time

    import posbench.bench as bench
    from posbench.console import _seconds

    calls = {}

    def fake_step_fn(model, batch_size, T):
        name = model.cfg.scheme
        calls[name] = 0

        def step():
            calls[name] += 1
            if calls[name] == 1:
                time.sleep(FIRST_S)

        return step

    before_rounds = []
    real = bench.time_interleaved
    monkeypatch.setattr(bench, "_train_step_fn", fake_step_fn)
    monkeypatch.setattr(
        bench, "time_interleaved", lambda steps, s, *a: before_rounds.append(dict(calls)) or real(steps, s, *a)
    )
    out = tmp_path / "bench.csv"
    res = CliRunner().invoke(
        app, ["bench", "--quick", "--schemes", "rope", "--set", "model.n_layer=1", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert before_rounds == [{"nope": 1, "rope": 1}]  # the first call, and only it, before the rounds
    quick = bench.BenchSettings.quick()
    assert calls == {s: 1 + quick.warmup + quick.rounds * quick.steps for s in ("nope", "rope")}
    train = {r["scheme"]: r for r in csv.DictReader(out.open()) if r["measurement"] == "train"}
    for s, r in train.items():
        seconds = float(r["first_call_s"])
        assert seconds >= FIRST_S, (s, seconds)
        line = next(line for line in res.output.splitlines() if line.startswith(f"│ {s} "))
        assert line.rstrip(" │").endswith(_seconds(seconds)), line


def test_a_first_call_is_timed_to_the_end_of_its_queued_work():
    """On a GPU a step returns before its kernels run; the clock stops at `sync`, as in the
    rounds. A fake device queues the work a call asks for and does it when synced."""
    from posbench.bench import time_first_calls

    queued = []

    def sync():
        while queued:
            time.sleep(queued.pop())

    first = time_first_calls({"nope": lambda: queued.append(FIRST_S)}, sync)
    assert first["nope"] >= FIRST_S and not queued


def test_the_table_says_what_a_first_call_pays_for_on_each_device():
    """A CPU's first step is warm-up (or a C kernel's first build); a GPU's compiles, and its
    first forward at each length, which compiles flex for that length, gets a table of its own."""
    from posbench.console import bench_table

    def rows(eval_s):
        where = {"device": "somewhere", "attention": "flex"}
        speed = {"tokens_per_s": 9e4, "ratio_vs_nope": 1.0, "mfu": 0.07, "peer_tokens_per_s": None, "peer_ratio": None}
        train = {"scheme": "nope", "measurement": "train", "first_call_s": 41.27, **speed, **where}
        evals = [
            {"scheme": "nope", "measurement": "eval", "eval_len": L, "peak_mem_mb": 1.0, "first_call_s": s, **where}
            for L, s in ((1024, eval_s), (4096, eval_s and 2 * eval_s))
        ]
        return [train, *evals]

    def shown(device, eval_s):
        console = Console(file=io.StringIO(), width=120)
        console.print(bench_table(rows(eval_s), 1e12, ModelConfig(), torch.device(device), None, rounds=3))
        return " ".join(console.file.getvalue().split())

    gpu = shown("cuda", 12.345)
    assert "41.3" in gpu and "first step s" in gpu and "compiling kernels where the backend does" in gpu
    assert "first forward (s), batch 1, compilation included" in gpu and "12.3" in gpu and "24.7" in gpu
    cpu = shown("cpu", None)
    assert "otherwise it is warm-up only" in cpu and "first forward" not in cpu


def test_auto_beside_a_backend_it_runs_as_for_some_schemes_is_refused(monkeypatch):
    """On a GPU auto is flex for a table's schemes and sdpa for the rest: beside either, some
    scheme would be timed twice under one backend. On a CPU it is native (where the kernels
    build) or sdpa for every scheme."""
    from posbench.bench import check_backends

    monkeypatch.setattr(attention, "flex_learns_biases", lambda: True)
    cuda = torch.device("cuda")
    check_backends(["sdpa", "flex"], cuda, 64)
    for other in ("sdpa", "flex"):
        with pytest.raises(PosbenchError, match=f"--attention auto,{other}: these run as one backend here"):
            check_backends(["auto", other], cuda, 64)
    check_backends(["auto", "eager"], cuda, 64)
    cpu_auto = attention.backend_for("auto", torch.device("cpu"), 64)
    with pytest.raises(PosbenchError, match=f"--attention auto,{cpu_auto}: these run as one backend here"):
        check_backends(["auto", cpu_auto], torch.device("cpu"), 64)


def test_bench_data_times_both_tokenizers_and_a_fetch_against_a_step_leaving_the_config_as_it_was(tmp_path):
    """`bench --data` prepares the corpus twice (bytes, then a BPE of the config's vocabulary) and
    times a memory-mapped batch against a step of a model of that vocabulary, built on a copy of
    the config's model."""
    from posbench.bench_data import data_benchmark
    from posbench.config import load_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(2000)))
    sets = [
        f"data.path={corpus}",
        "data.tokenizer=bpe",
        "data.vocab_size=300",
        "model.d_model=32",
        "model.n_head=2",
        "model.n_layer=1",
    ]
    cfg = load_config(None, [*sets, "train.batch_size=4"], {})
    before = cfg.model.vocab_size
    rows = dict(data_benchmark(cfg, rounds=2))
    assert cfg.model.vocab_size == before  # the BPE's vocabulary is the benchmark's model's alone
    assert rows["what"] == "value"
    mb = corpus.stat().st_size / 1e6
    prepared = [k for k in rows if k.startswith("prepare, ")]
    assert len(prepared) == 2 and prepared[0] == "prepare, bytes" and "300" in prepared[1], prepared
    for k in prepared:
        assert f"({mb:.1f} MB in " in rows[k] and float(rows[k].split()[0]) > 0, rows[k]
    fetch = rows["fetch a batch from the memory map (4 x 100 tokens)"]
    step = rows["one training step (1 layers, width 32)"]
    f, s = float(fetch.split()[0]), float(step.split()[0])
    share = float(rows["fetch's share of a step"].rstrip("%"))
    assert f > 0 and s > 0 and share == pytest.approx(100 * f / (f + s), abs=0.1)  # from the rounded times
