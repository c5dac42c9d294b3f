"""Synthetic tasks: each generator checked by independent code, exact match through the real
decoding, the loss mask, train/test disjointness, one-line errors and a run end to end."""

import collections
import csv
import dataclasses
import json
import random
import re
import shutil
import sys

import pytest
import torch
import torch.nn as nn
from conftest import ROOT, invoke, report_refused

from posbench.accuracy import bytes_right, decode, exact, score
from posbench.config import ModelConfig, TrainConfig, load_config, load_sweep
from posbench.errors import PosbenchError
from posbench.measures.exact_match.records import buckets
from posbench.model import TransformerLM
from posbench.resolve import resolve
from posbench.tasks import END, FILLER, IGNORE, PAD, TASKS, Task, build_task, pack

SMALL = {"train_max": 6, "test_max": 9, "test_count": 12}
SYMBOLS = set(range(33, 127))  # printable ASCII but space
LOWER = set(b"abcdefghijklmnopqrstuvwxyz")


def instances(name, n, count=40, seed=0, **options):
    task = build_task(name, options)
    rng = random.Random(seed)
    return task, [task.make(n, rng) for _ in range(count)]


def body(prompt: bytes, head: bytes) -> bytes:
    """What lies between the task's `head:` and the final '='."""
    assert prompt.startswith(head + b":") and prompt.endswith(b"=")
    return prompt[len(head) + 1 : -1]


@pytest.mark.parametrize("n", [1, 2, 7, 20])
def test_copy_reverse_and_sort_answers_are_the_string_itself_reversed_and_sorted(n):
    for name in ("copy", "reverse", "sort"):
        _, made = instances(name, n)
        for prompt, answer in made:
            s = body(prompt, name.encode())
            assert len(s) == n and set(s) <= (LOWER if name == "sort" else SYMBOLS - set(b":=."))
            assert answer.endswith(END)
            got = answer[:-1]
            if name == "copy":
                assert got == s
            elif name == "reverse":
                assert all(got[i] == s[n - 1 - i] for i in range(n))
            else:
                assert all(a <= b for a, b in zip(got, got[1:])) and collections.Counter(got) == collections.Counter(s)


@pytest.mark.parametrize("n", [1, 2, 7, 20, 40])
def test_repeat_answers_its_one_character_n_times(n):
    _, made = instances("repeat", n, count=200)
    for prompt, answer in made:
        s = body(prompt, b"repeat")
        assert len(s) == n and len(set(s)) == 1 and s[0] in SYMBOLS - set(b":=.")
        assert prompt == b"repeat:" + s[:1] * n + b"=" and answer == s[:1] * n + END
    assert len({p[len("repeat:")] for p, _ in made}) > 50  # the character is drawn, not fixed


@pytest.mark.parametrize("n", [1, 2, 7, 20, 40])
def test_replace_answers_n_copies_of_b_for_n_copies_of_a(n):
    _, made = instances("replace", n, count=200)
    for prompt, answer in made:
        m = re.fullmatch(rb"replace:(.)>(.):(.*)=", prompt, re.S)
        a, b, s = m.group(1), m.group(2), m.group(3)
        assert a != b and {a[0], b[0]} <= SYMBOLS - set(b":=>.")
        assert s == a * n and answer == b * n + END
    assert len({p[len("replace:") :][:3] for p, _ in made}) > 150  # both characters drawn
    _, made = instances("replace", n, alphabet="xy")
    assert {p + a for p, a in made} == {f"replace:{x}>{y}:{x * n}={y * n}.".encode() for x, y in ("xy", "yx")}


def test_copy_and_reverse_draw_from_90_printable_symbols_and_sort_from_a_to_z():
    """With a-z a length-20 string repeats a bigram 22% of the time, so copying by content is
    ambiguous; the NoPE study draws from 100 symbols. Sort keeps a-z; a-z stays an option."""
    for name, delimiters in [("copy", b":=."), ("reverse", b":=."), ("repeat", b":=."), ("replace", b":=>.")]:
        task = build_task(name, {})
        alphabet = task.opt["alphabet"].encode()
        assert len(set(alphabet)) == len(alphabet) >= 90
        assert set(alphabet) <= SYMBOLS - set(delimiters)
    for name in ("copy", "reverse"):
        _, made = instances(name, 20, count=500)
        assert len({c for p, _ in made for c in body(p, name.encode())}) >= 90  # drawn from all of it
        _, made = instances(name, 20, alphabet="abcdefghijklmnopqrstuvwxyz")
        assert {c for p, _ in made for c in body(p, name.encode())} <= LOWER
    assert build_task("sort", {}).opt["alphabet"] == "abcdefghijklmnopqrstuvwxyz"
    assert {c for p, _ in instances("sort", 20)[1] for c in body(p, b"sort")} <= LOWER
    with pytest.raises(PosbenchError, match="uses '>', which the task's instances use as delimiters"):
        build_task("replace", {"alphabet": "a>b"})
    with pytest.raises(PosbenchError, match="replace draws two distinct characters"):
        build_task("replace", {"alphabet": "a"})


@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_addition_answers_are_the_sum_of_two_n_digit_numbers(n):
    _, made = instances("addition", n)
    for prompt, answer in made:
        a, b = body(prompt, b"add").split(b"+")
        assert len(a) == len(b) == n and (n == 1 or (a[:1] != b"0" and b[:1] != b"0"))
        assert answer.endswith(END) and int(answer[:-1]) == int(a.decode()) + int(b.decode())


@pytest.mark.parametrize("n", [1, 3, 20])
def test_parity_says_whether_the_count_of_ones_is_even(n):
    _, made = instances("parity", n)
    for prompt, answer in made:
        bits = body(prompt, b"parity")
        assert len(bits) == n and set(bits) <= {ord("0"), ord("1")}
        ones = sum(1 for c in bits if c == ord("1"))
        assert answer == (b"odd." if ones % 2 else b"even.")


@pytest.mark.parametrize("n,depth", [(1, 0), (1, 1), (10, 0), (10, 4), (10, 10), (33, 17)])
def test_passkey_puts_the_key_after_exactly_depth_filler_words(n, depth):
    task = build_task("passkey", {})
    prompt, answer = task.make_at(n, depth, 48213)
    words = body(prompt, b"passkey").decode().split(" ")
    at = words.index("key")
    assert at == depth and words[at + 1] == "48213" and answer == b"48213."
    filler = words[:at] + words[at + 2 :]
    assert len(filler) == n and all(w in FILLER for w in filler)
    for prompt, answer in instances("passkey", n)[1]:  # random depths and keys
        words = body(prompt, b"passkey").decode().split(" ")
        assert answer == words[words.index("key") + 1].encode() + END and len(answer) == 6


@pytest.mark.parametrize("n", [1, 2, 26, 40])
def test_recall_answers_the_value_stored_under_the_queried_key(n):
    _, made = instances("recall", n)
    for prompt, answer in made:
        m = re.fullmatch(rb"recall:(.*)\?(.)=", prompt)
        pairs, key = m.group(1), m.group(2)
        keys, values = pairs[0::2], pairs[1::2]
        assert len(keys) == n and len(set(keys)) == n and key in keys
        assert answer == values[keys.index(key) : keys.index(key) + 1] + END


@pytest.mark.parametrize("name", list(TASKS))
def test_every_instance_fits_the_task_s_stated_longest_and_train_len_is_the_longest(name):
    task = build_task(name, {})
    rng = random.Random(1)
    for n in (1, 2, 5, task.train_max):
        made = [task.make(n, rng) for _ in range(300)]
        assert max(len(p) + len(a) for p, a in made) <= task.longest(n)
    made = [task.make(task.train_max, rng) for _ in range(300)]
    assert task.train_len == task.longest(task.train_max) >= max(len(p) + len(a) for p, a in made)


@pytest.mark.parametrize(
    "name,options,n",
    [
        ("parity", {}, 3),
        ("copy", {"alphabet": "ab"}, 3),
        ("addition", {}, 1),
        ("sort", {"alphabet": "xyz"}, 2),
        ("repeat", {}, 5),  # one instance per character of the default alphabet, at any length
        ("replace", {"alphabet": "abcd"}, 4),  # 4 x 3 ordered pairs a != b
    ],
)
def test_space_counts_the_distinct_instances(name, options, n):
    task, made = instances(name, n, count=5000, **options)
    assert task.space(n) == len({p + a for p, a in made})


@pytest.mark.parametrize("name", list(TASKS))
def test_training_never_draws_a_test_instance_and_the_test_set_is_fixed(name):
    task = build_task(name, SMALL)
    test = task.test_set()
    assert test == build_task(name, SMALL).test_set()  # from the fixed test seed alone
    assert {n for n, _, _ in test} == set(range(1, 10))
    held = {p + a for _, p, a in test}
    batches = task.batches(seed=3, batch_size=8, test=test)
    drawn = [batches.instance() for _ in range(2000)]
    assert not held & {p + a for p, a in drawn}
    for n in range(1, 10):  # at most half of a small length goes to the test, and never a repeat
        at = [p + a for m, p, a in test if m == n]
        assert len(at) == len(set(at)) <= SMALL["test_count"]
        if task.space(n) is not None:
            assert len(at) <= task.space(n) // 2


def test_tiny_lengths_still_train_parity_of_one_bit_on_the_other_instance():
    task = build_task("parity", SMALL)
    tested = [p + a for n, p, a in task.test_set() if n == 1]
    assert len(tested) == 1  # two instances in all: one is tested, the other trained on
    batches = task.batches(0, 1)
    drawn = {p + a for p, a in (batches.instance() for _ in range(500)) if len(p) == len("parity:0=")}
    assert drawn == {b"parity:0=even.", b"parity:1=odd."} - set(tested)


def test_the_loss_mask_covers_exactly_the_answer_bytes():
    made = [(b"copy:ab=", b"ab."), (b"add:7+5=", b"12."), (b"parity:1=", b"odd.")]
    x, y = pack(made)
    T = max(len(p) + len(a) for p, a in made) - 1
    assert x.shape == y.shape == (3, T)
    for i, (p, a) in enumerate(made):
        seq = list(p + a)
        scored = [t for t in range(T) if y[i, t] != IGNORE]
        assert [seq[t + 1] for t in scored] == list(a)  # the answer bytes, each predicted from the byte before
        assert scored == list(range(len(p) - 1, len(p) + len(a) - 1))
        assert x[i, : len(seq) - 1].tolist() == seq[:-1] and (x[i, len(seq) - 1 :] == PAD).all()


def test_a_batch_in_parts_is_the_same_instances_sorted_by_length_each_part_padded_to_its_own_longest():
    task = build_task("copy", {})
    test = task.test_set()
    whole = task.batches(5, 64, test)
    cut = task.batches(5, 64, test, parts=3)
    for _ in range(3):
        x, y = whole()
        parts = cut()
        assert [p[0].shape[0] for p in parts] == [21, 21, 22]

        def rows(x, y):
            return [(tuple(r.tolist()), tuple(t.tolist())) for r, t in zip(x, y)]

        def trimmed(x, y):  # each instance without its padding
            return sorted((tuple(v for v in r if v != PAD), tuple(v for v in t if v != IGNORE)) for r, t in rows(x, y))

        assert trimmed(x, y) == sorted(i for p in parts for i in trimmed(*p))  # the same instances
        lengths = [[int((r != PAD).sum()) for r in p[0]] for p in parts]
        for i, (px, _) in enumerate(parts):
            assert px.shape[1] == max(lengths[i])  # padded to its own longest
            if i:
                assert min(lengths[i]) >= max(lengths[i - 1])  # shortest first
        assert sum(p[0].numel() for p in parts) < 0.8 * x.numel()  # fewer padded bytes
    assert whole.get_state() == cut.get_state()  # the instance stream is the same


@pytest.mark.parametrize("scheme", ["nope", "sinusoidal", "t5", "rope"])
def test_a_step_in_parts_has_the_whole_batch_s_loss_and_gradient(scheme):
    from posbench.train import loss_backward

    task = build_task("reverse", {"train_max": 12})
    whole, parts = task.batches(1, 24)(), task.batches(1, 24, parts=4)()  # the same instances
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(scheme=scheme, n_layer=2, d_model=32, n_head=2, train_len=task.train_len))
    grads = []
    for batch in (whole, parts):
        model.zero_grad(set_to_none=True)
        loss = loss_backward(model, batch, torch.device("cpu"), compiling=False)
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    (l1, g1), (l2, g2) = grads
    assert torch.allclose(l1, l2, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g1, g2))
    assert l1 > 1.0  # an untrained model: a loss a per-part mean would change


class Oracle(nn.Module):
    """Emits the right next byte of whichever test instance it is reading, `shift` bytes off."""

    def __init__(self, test, shift=0):
        super().__init__()
        self.answers = {p: a for _, p, a in test}
        self.shift = shift

    def forward(self, tokens):
        B, T = tokens.shape
        logits = torch.zeros(B, T, 256)
        for b in range(B):
            row = bytes(tokens[b].tolist())
            prompt = next(p for p in self.answers if row.startswith(p))
            answer = self.answers[prompt] + b"#" * 4
            for t in range(len(prompt) - 1, T):
                logits[b, t, answer[t - len(prompt) + 1 + self.shift]] = 1.0
        return logits


def test_an_oracle_scores_every_instance_and_one_byte_off_scores_none():
    test = build_task("copy", SMALL).test_set() + build_task("addition", SMALL).test_set()
    rows = score(Oracle(test), test, "cpu")
    assert all(r["correct"] == r["instances"] > 0 for r in rows)
    assert decode(Oracle(test), [(p, a) for _, p, a in test], "cpu") == [a for _, _, a in test]
    for shift in (1, -1):  # a decoder that reads one position off
        assert all(r["correct"] == 0 for r in score(Oracle(test, shift), test, "cpu"))


def test_one_wrong_byte_costs_only_its_instance():
    test = build_task("copy", SMALL).test_set()
    wrong = test[5]

    class MostlyRight(Oracle):
        def forward(self, tokens):
            logits = super().forward(tokens)
            for b in range(tokens.size(0)):
                if bytes(tokens[b].tolist()).startswith(wrong[1]):
                    logits[b, -1] = 0
                    logits[b, -1, ord("z")] = 1.0  # one byte of its answer wrong: the last one read
            return logits

    rows = {r["length"]: r for r in score(MostlyRight(test), test, "cpu")}
    n_wrong = wrong[0]
    assert rows[n_wrong]["correct"] == rows[n_wrong]["instances"] - 1
    assert all(r["correct"] == r["instances"] for n, r in rows.items() if n != n_wrong)


@pytest.mark.parametrize("scheme", ["alibi", "rope", "learned"])
def test_scoring_in_one_pass_equals_greedy_decoding(scheme):
    """exact() scores teacher-forced; it must agree with real greedy decoding, instance by instance,
    on a model that gets some right and some wrong."""
    torch.manual_seed(0)
    task = build_task("copy", {"train_max": 3, "test_max": 5, "test_count": 40, "alphabet": "ab"})
    model = TransformerLM(ModelConfig(scheme=scheme, n_layer=1, d_model=32, n_head=2, train_len=task.train_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = task.batches(0, 32)
    for _ in range(60):  # partly trained: a mix of right and wrong answers
        x, y = batches()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    pairs = [(p, a) for _, p, a in task.test_set()]
    hits = exact(model.eval(), pairs, "cpu")
    assert hits == [ans == a for ans, (_, a) in zip(decode(model.eval(), pairs, "cpu"), pairs)]
    assert 0 < sum(hits) < len(hits)


def test_a_scheme_that_draws_positions_per_call_is_scored_by_decoding_itself():
    """noisy_rope draws its positions per forward call, so a prefix decoded alone meets other
    positions than inside one teacher-forced pass, and the pass's verdict differs from greedy
    decoding's on some instances here: exact() decodes for it (entering eval mode restarts the
    draws, so both decodings see the same positions), and score's counts are decoding's."""
    torch.manual_seed(0)
    task = build_task("copy", {"train_max": 3, "test_max": 5, "test_count": 40, "alphabet": "ab"})
    cfg = ModelConfig(scheme="noisy_rope", n_layer=1, d_model=32, n_head=2, train_len=task.train_len)
    model = TransformerLM(dataclasses.replace(cfg, options={"max_pos": 16}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = task.batches(0, 32)
    for _ in range(150):
        x, y = batches()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not model.scheme.prefix_consistent
    pairs = [(p, a) for _, p, a in task.test_set()]
    greedy = [ans == a for ans, (_, a) in zip(decode(model.eval(), pairs, "cpu"), pairs)]
    one_pass = [n == len(a) for n, (_, a) in zip(bytes_right(model.eval(), pairs, "cpu"), pairs)]
    assert one_pass != greedy  # the pass alone would not be greedy decoding here
    assert exact(model.eval(), pairs, "cpu") == greedy
    model.eval()
    rows = score(model, task.test_set(), "cpu")
    assert sum(r["correct"] for r in rows) == sum(greedy)


def test_buckets_are_each_length_to_12_then_halves_each_of_the_first_five_past_n_and_thirds():
    """At most ten columns by default: a table of a task tested to 2N reads on one screen."""
    assert buckets(5, 10) == [(n, n) for n in range(1, 11)]
    assert buckets(20, 40) == [
        (1, 10),
        (11, 20),
        (21, 21),
        (22, 22),
        (23, 23),
        (24, 24),
        (25, 25),
        (26, 30),
        (31, 35),
        (36, 40),
    ]
    b = buckets(25, 100)
    assert b[:3] == [(1, 13), (14, 25), (26, 26)] and (30, 30) in b and b[-3:] == [(31, 54), (55, 77), (78, 100)]
    assert buckets(20, 40, [10, 30]) == [(1, 10), (11, 20), (21, 30), (31, 40)]
    for spans in (buckets(20, 40), b, buckets(7, 100, [50])):  # they tile 1..test_max
        assert [n for lo, hi in spans for n in range(lo, hi + 1)] == list(range(1, spans[-1][1] + 1))


# --- the recipe ---------------------------------------------------------------------------------


def _recipe(cfg) -> dict:
    t = cfg.train
    return {
        "steps": t.steps,
        "batch_size": t.batch_size,
        "n_layer": cfg.model.n_layer,
        "lr": t.lr,
        "min_lr": t.min_lr,
        "warmup_steps": t.warmup_steps,
    }


def test_a_task_run_takes_its_tasks_recipe_where_the_config_leaves_it_out(tmp_path):
    recipe = Task.budget
    lm = _recipe(resolve(load_config(None)).cfg)
    assert lm["n_layer"] == ModelConfig.n_layer and lm["lr"] == TrainConfig.lr  # perplexity keeps its own
    assert all(lm[k] != recipe[k] for k in ("n_layer", "lr", "min_lr", "warmup_steps"))  # so the task's shows
    assert _recipe(resolve(load_config(None, values={"task": "sort"})).cfg) == recipe
    for task, own in (
        ("copy", {"steps": 2000}),
        ("reverse", {"steps": 8000}),
        ("passkey", {"steps": 800, "batch_size": 32, "warmup_steps": 40}),
        ("repeat", {"steps": 2000, "warmup_steps": 100}),
        ("replace", {"steps": 2000, "warmup_steps": 100}),
    ):
        assert _recipe(resolve(load_config(None, values={"task": task})).cfg) == {**recipe, **own}
    # a key the config gives wins, from a flag or from a file (a run's own config.yaml among them)
    cfg = resolve(load_config(None, ["model.n_layer=2", "train.lr=0.003"], values={"task": "sort"})).cfg
    assert _recipe(cfg) == {**recipe, "n_layer": 2, "lr": 0.003}
    path = tmp_path / "c.yaml"
    path.write_text("task: sort\nmodel: {n_layer: 3}\ntrain: {warmup_steps: 7}\n")
    assert _recipe(resolve(load_config(path)).cfg) == {**recipe, "n_layer": 3, "warmup_steps": 7}


def test_a_task_run_sets_t5s_bias_up_as_the_study_did_where_the_config_leaves_it_out(tmp_path):
    """T5's and hybrid's tables start at zero and are added as is on a task (the NoPE study's
    HF T5 starts them near zero, in logit units); perplexity keeps x-transformers' setup; an
    option the config gives wins, one key at a time; a scheme not trained gets nothing."""
    from posbench.schemes import SCHEMES

    def options(*overrides, task="copy", schemes="[t5,hybrid,nope]"):
        cfg = resolve(load_config(None, [f"schemes={schemes}", *overrides], values={"task": task})).cfg
        return {s: (o.get("init"), o.get("scale")) for s, o in cfg.scheme_options.items()}

    default = (SCHEMES["t5"].options["init"], SCHEMES["t5"].options["scale"])
    assert default == ("normal", "sqrt_head_dim")
    assert Task.scheme_setup == {s: {"init": "zeros", "scale": "none"} for s in ("t5", "hybrid")}
    for task in ("repeat", "replace", "copy", "reverse", "sort"):
        assert options(task=task) == {"t5": ("zeros", "none"), "hybrid": ("zeros", "none"), "nope": (None, None)}
    assert options(task="lm") == {"t5": default, "hybrid": default, "nope": (None, None)}
    assert options("scheme_options.t5.scale=sqrt_head_dim")["t5"] == ("zeros", "sqrt_head_dim")
    path = tmp_path / "c.yaml"
    path.write_text("task: copy\nschemes: [t5]\nscheme_options: {t5: {init: normal, scale: sqrt_head_dim}}\n")
    cfg = resolve(load_config(path)).cfg
    assert (cfg.scheme_options["t5"]["init"], cfg.model_for("t5").options["scale"]) == default
    assert options(schemes="[nope]") == {"nope": (None, None)}
    path.write_text("task: copy\nschemes: [t5]\nsweep: {scheme_options.t5.init: [normal, zeros]}\n")
    swept = [resolve(cfg).cfg.scheme_options["t5"] for _, cfg in load_sweep(path)]  # a sweep's axis is given too
    assert [(o["init"], o["scale"]) for o in swept] == [("normal", "none"), ("zeros", "none")]


def test_a_plugin_task_gets_the_built_in_recipe(tmp_path, monkeypatch):
    (tmp_path / "echo_task.py").write_text(  # a module name of its own: sys.modules keeps the first import
        "from posbench.tasks import Task\n"
        "class Echo(Task):\n"
        "    name = 'echo'\n"
        "    def make(self, n, rng):\n"
        "        return b'e:' + b'a' * n + b'=', b'a' * n + b'.'\n"
        "    def longest(self, n):\n"
        "        return 2 * n + 4\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _recipe(resolve(load_config(None, values={"task": "echo_task:Echo"})).cfg) == Task.budget
    cfg = resolve(load_config(None, ["schemes=[t5]"], values={"task": "echo_task:Echo"})).cfg
    assert {k: cfg.scheme_options["t5"][k] for k in ("init", "scale")} == Task.scheme_setup["t5"]


# --- the command line ---------------------------------------------------------------------------

TINY = [
    "--set",
    "model.n_layer=1",
    "--set",
    "model.d_model=32",
    "--set",
    "model.n_head=2",
    "--set",
    "train.steps=30",
    "--set",
    "train.warmup_steps=5",
    "--set",
    "task_options.train_max=4",
    "--set",
    "task_options.test_max=7",
    "--set",
    "task_options.test_count=8",
]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--task", "copi"], "unknown task 'copi' (did you mean 'copy'?)"),
        (
            ["--task", "copy", "--set", "task_options.train_mx=5"],
            "task_options.train_mx: unknown option of task 'copy' (did you mean 'train_max'?)",
        ),
        (
            ["--task", "copy", "--set", "task_options.test_max=10", "--set", "task_options.train_max=20"],
            "task_options.test_max=10 is shorter than task_options.train_max=20",
        ),
        (["--task", "posbench.config:ModelConfig"], "ModelConfig is not a subclass of posbench.tasks.Task"),
        (
            ["--task", "copy", "--set", "task_options.alphabet=ab=c"],
            "uses '=', which the task's instances use as delimiters",
        ),
        (["--task", "recall", "--set", "task_options.test_max=60"], "recall's keys are distinct"),
        (["--task", "copy", "--train-len", "50"], "a task's are task_options.train_max and test_max"),
        (["--task", "copy", "--set", "model.train_len=50"], "model.train_len=50: a task derives it"),
        (
            ["--task", "copy", "--rope-scaling", "yarn"],
            "eval.perplexity.rope_scaling is an option of the perplexity measure",
        ),
        (
            ["--task", "copy", "--protocol", "sliding"],
            "eval.perplexity.protocol is an option of the perplexity measure",
        ),
        (
            ["--set", "eval.exact_match.buckets=[50]"],
            "eval.exact_match.buckets is an option of the exact_match measure",
        ),
        (["--set", "task_options.train_max=5"], "task_options are set but task is lm"),
        (["--task", "posbench.tasks:Task"], "task 'posbench.tasks:Task': Task does not define make or longest"),
        (
            ["--task", "copy", "--set", "task_options.test_max=100000000"],
            # copy's longest instance of length n: 'copy:' + n + '=' + n + '.', 2n + 7 bytes
            f"test_max=100000000 with test_count=50 makes a test set of up to {50 * 10**8 * (2 * 10**8 + 7):,} bytes",
        ),
        (["--task", "copy", "--set", "task_options.test_count=20000000"], "posbench scores at most 1,000,000,000"),
    ],
)
def test_bad_task_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    res = invoke("extrapolate", "--set", f"out_dir={tmp_path / 'r'}", *args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert message in " ".join(res.output.split()) and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "r").exists()


def test_a_task_runs_end_to_end_resumes_and_reports(tmp_path):
    out = tmp_path / "r"
    args = [
        "extrapolate",
        "--task",
        "reverse",
        "--schemes",
        "alibi,learned",
        "--seeds",
        "0,1",
        "--set",
        f"out_dir={out}",
        "--set",
        "scheme_options.learned.max_len=20",
        *TINY,
    ]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert "train_len 18 (its longest training instance)" in " ".join(res.output.split())
    exp = out / "reverse"  # a task's runs go to results/<task>
    runs = sorted(p.name for p in exp.iterdir() if p.is_dir())
    assert runs == ["alibi-seed0", "alibi-seed1", "learned-seed0", "learned-seed1"]
    rows = {r: list(csv.DictReader((exp / r / "eval.csv").open())) for r in runs}
    for r in runs:  # the same test lengths and counts in every run
        assert [(x["length"], x["instances"]) for x in rows[r]] == [
            (x["length"], x["instances"]) for x in rows[runs[0]]
        ]
        assert {x["task"] for x in rows[r]} == {"reverse"} and {x["metric"] for x in rows[r]} == {"exact_match"}
    # learned's 20 positions reach reverse:abcde=edcba. (20 bytes, read to its 19th), not n = 6 (22 bytes)
    status = {int(x["length"]): x["status"] for x in rows["learned-seed0"]}
    assert status == {1: "ok", 2: "ok", 3: "ok", 4: "ok", 5: "ok", 6: "beyond-max-len", 7: "beyond-max-len"}
    prompts = [
        [ln for ln in (exp / r / "samples.txt").read_text().splitlines() if ln.startswith("prompt")] for r in runs
    ]
    assert prompts[0] and all(p == prompts[0] for p in prompts)  # the same instances for every scheme and seed
    log = [json.loads(line) for line in (exp / "alibi-seed0" / "train_log.jsonl").read_text().splitlines()]
    assert {line["parts"] for line in log} == {3}  # a CPU step's batch, cut by length
    config = (exp / "alibi-seed0" / "config.yaml").read_text()
    assert "task: reverse" in config and "test_max: 7" in config and "train_len: 18" in config
    summary = list(csv.DictReader((exp / "summary.csv").open()))
    assert {"task", "metric", "bucket", "split", "value"} <= set(summary[0])
    assert {r["split"] for r in summary if r["bucket"] in ("5", "6", "7")} == {"out"}
    assert {r["split"] for r in summary if r["bucket"] in ("1", "4")} == {"in"}
    md = (exp / "summary.md").read_text()
    assert "| in-dist |" in md and "| 7 | " in md and "—" in md
    before = (exp / "summary.csv").read_text()

    res = invoke(*args)  # resume: nothing retrained, nothing rescored
    assert res.exit_code == 0 and res.output.count("already trained") == 4
    (exp / "summary.csv").unlink()
    assert invoke("report", exp).exit_code == 0
    assert (exp / "summary.csv").read_text() == before
    res = invoke("report", exp, "--buckets", "2,4")
    assert res.exit_code == 0, res.output
    buckets = {r["bucket"] for r in csv.DictReader((exp / "summary-buckets-2-4.csv").open())}
    assert buckets == {"1-2", "3-4", "5-7", "in", "out"} and (exp / "summary.csv").read_text() == before
    res = invoke("evaluate", exp / "alibi-seed0")
    assert res.exit_code == 0 and "samples.txt" in res.output


def test_a_report_joining_lm_and_task_runs_is_one_line_and_keeps_their_records(tmp_path):
    """Whichever comes first, the other's eval.csv is never called malformed (whose fix reads
    'delete it')."""
    from conftest import smoke_experiment

    lm, _, _ = smoke_experiment(tmp_path, "--schemes", "nope", "--set", "train.steps=5")
    res = invoke("extrapolate", "--task", "copy", "--schemes", "nope", "--set", f"out_dir={tmp_path}", *TINY)
    assert res.exit_code == 0, res.output
    task = tmp_path / "copy"
    before = (task / "nope-seed0" / "eval.csv").read_text()
    for dirs in ([lm, task], [task, lm]):
        res = invoke("report", *dirs, "--out", tmp_path / "joined")
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert "malformed" not in res.output and "mixes" in res.output and len(res.output.strip().splitlines()) <= 2
    assert (task / "nope-seed0" / "eval.csv").read_text() == before and not (tmp_path / "joined").exists()


@pytest.mark.parametrize("edges", ["0,5", "-5", "5,-10"])
def test_a_bucket_that_ends_at_no_length_is_one_line(tmp_path, edges):
    res = invoke("report", tmp_path, "--buckets", edges)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"--buckets {edges}: a bucket ends at a positive length" in res.output, res.output


@pytest.mark.parametrize(
    "edges, said",
    [("5,5", "--buckets 5,5: 5 listed more than once"), ("10,99", "--buckets: 99 is past the longest test length, 40")],
)
def test_a_bucket_listed_twice_or_past_every_length_is_refused_not_dropped(tmp_path, edges, said):
    """The committed task reference is tested to 40: an end past it, or one given twice, was
    dropped in silence and the report written without it."""
    res = invoke("report", ROOT / "results" / "reference-tasks", "--buckets", edges, "--out", tmp_path / "view")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert said in " ".join(res.output.split()) and not (tmp_path / "view").exists()


def test_a_user_s_task_loads_as_module_colon_class(tmp_path, monkeypatch):
    """The example docs/tasks.md shows is examples/my_tasks.py's code; copied into a user's
    working folder as my_tasks.py, it trains and reports as `my_tasks:Increment`."""
    example = (ROOT / "examples" / "my_tasks.py").read_text()
    shown = (ROOT / "docs" / "tasks.md").read_text().split("```python\n# examples/my_tasks.py\n")[1].split("```")[0]
    assert shown.strip() == example[example.index("from posbench.tasks") :].strip()
    (tmp_path / "my_tasks.py").write_text(example)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = invoke(
        "extrapolate", "--task", "my_tasks:Increment", "--schemes", "nope", "--set", f"out_dir={tmp_path / 'r'}", *TINY
    )
    assert res.exit_code == 0, res.output
    run = tmp_path / "r" / "my_tasks_Increment" / "nope-seed0"
    assert "inc:" in (run / "samples.txt").read_text()
    # a report learns a task's lengths from its class: a module that only the records name
    # (a later process, or a results folder from someone else) is said before it is imported
    monkeypatch.delitem(sys.modules, "my_tasks")
    res = invoke("report", run.parent)
    assert res.exit_code == 0, res.output
    assert res.output.startswith(
        f"note: {run} names task 'my_tasks:Increment', not one of posbench's: importing module 'my_tasks' "
        f"({tmp_path / 'my_tasks.py'})\n"
    ), res.output


def test_a_task_plugin_that_fails_to_build_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "bad_tasks.py").write_text(
        "from posbench.tasks import Task\n"
        "\n\nclass NoLongest(Task):\n    def make(self, n, rng):\n        return b'a=', b'a.'\n"
        "\n\nclass Good(NoLongest):\n    def longest(self, n):\n        return 3\n"
        "\n\nclass Broken(Good):\n    def __init__(self, options):\n        raise ValueError('nope')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    res = invoke("extrapolate", "--task", "bad_tasks:Broken", "--set", f"out_dir={tmp_path / 'r'}")
    assert res.exit_code == 2 and "task 'bad_tasks:Broken' failed to build (ValueError: nope)" in res.output
    with pytest.raises(PosbenchError, match="no 'Missing'"):
        build_task("bad_tasks:Missing", {})
    with pytest.raises(PosbenchError, match="NoLongest does not define longest; a task defines make"):
        build_task("bad_tasks:NoLongest", {})
    assert build_task("bad_tasks:Good", {}).train_len == 3  # an inherited make counts
    assert issubclass(TASKS["copy"], Task)


# --- the report of a task's runs ----------------------------------------------------------------


def test_a_diverged_task_run_is_named_and_the_other_schemes_are_tabled(tmp_path, task_smoke):
    """A run folder holding config.yaml and diverged.json, with no weights and no rows, is a run
    that diverged: the report tables the other schemes and names the diverged run, on the
    screen and in summary.md."""
    exp = shutil.copytree(task_smoke, tmp_path / "copy")
    run = exp / "alibi-seed0"
    for name in ("model.pt", "eval.csv", "samples.txt"):
        (run / name).unlink()
    (run / "diverged.json").write_text('{"status": "diverged", "step": 3, "loss": "nan"}')
    res = invoke("report", exp)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert re.search(r"^\W*nope\s", res.output, re.M), res.output  # nope's row of the table
    said = "".join(res.output.split()).replace("".join(str(tmp_path).split()), "")  # unwrapped, no paths
    assert "alibi" in said and "diverged" in said, res.output
    md = (exp / "summary.md").read_text()
    assert "| nope |" in md
    assert any("alibi" in ln and "diverged" in ln for ln in md.splitlines()), md


def test_a_task_run_another_process_holds_is_reported_as_still_running(tmp_path, task_smoke):
    """A run folder without eval.csv whose lock another process holds is in progress: the report
    tables the other schemes and says the run is still running in another process."""
    from posbench.files import exclusive

    exp = shutil.copytree(task_smoke, tmp_path / "copy")
    (exp / "alibi-seed0" / "eval.csv").unlink()
    with exclusive(exp / ".alibi-seed0.lock") as mine:
        assert mine
        res = invoke("report", exp)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    said = " ".join(res.output.replace(str(tmp_path), "").split())
    assert "still running in another process" in said and "alibi" in said, res.output
    assert "| nope |" in (exp / "summary.md").read_text()


def test_the_latex_of_a_task_table_escapes_its_grid_point(tmp_path):
    """Every table's caption in summary.tex names its grid point, with LaTeX's special
    characters (& and # among them) escaped."""
    path = tmp_path / "alphabets.yaml"
    path.write_text(f"""
name: alphabets
out_dir: {tmp_path / "r"}
task: copy
model: {{n_layer: 1, n_head: 2, d_model: 32}}
train: {{steps: 2, batch_size: 8, warmup_steps: 1, threads: 1}}
task_options: {{train_max: 3, test_max: 5, test_count: 4}}
sweep: {{schemes: [nope], task_options.alphabet: ["ab&", "cd#"]}}
""")
    res = invoke("sweep", path)
    assert res.exit_code == 0, res.output
    tex = (tmp_path / "r" / "alphabets" / "summary.tex").read_text()
    assert "ab\\&" in tex and "cd\\#" in tex, tex
    assert "ab&" not in tex and "cd#" not in tex, tex


def test_joining_task_experiments_that_share_a_scheme_and_seed_is_one_line(tmp_path):
    """Two task experiments that both hold a run of one (scheme, seed) do not join: one line
    naming it, and no joined folder."""
    from conftest import task_experiment

    a = task_experiment(tmp_path, "nope", name="a")
    b = task_experiment(tmp_path, "nope", name="b")
    res = invoke("report", a, b)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "both hold nope seed 0" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "a+b").exists()


def test_a_one_seed_task_table_claims_no_interval(task_smoke):
    """With one seed there is no interval: the description, the caption and the terminal say
    so, and no cell carries a ±."""
    exp = task_smoke
    md, tex = (exp / "summary.md").read_text(), (exp / "summary.tex").read_text()
    assert "1 seed: no interval; use --seeds 0,1,2" in md and "95% interval" not in md and "±" not in md
    assert "1 seed: no interval" in tex and "95\\% interval" not in tex


def test_a_task_with_nothing_left_to_train_on_stops_with_one_line_not_forever():
    """Training redraws an instance held out for the test set; a task whose every instance is
    held out would redraw forever: after REDRAWS draws in a row it stops, naming the task."""
    from posbench.tasks.generators import REDRAWS

    class Few(Task):
        name = "few"

        def make(self, n, rng):
            return b"few:a=", b"a" + END

        def longest(self, n):
            return 8

    task = Few({"train_max": 3})
    batches = task.batches(0, 4, test=[(1, b"few:a=", b"a" + END)])
    with pytest.raises(PosbenchError, match=f"task 'few': {REDRAWS:,} draws in a row were all held out"):
        batches()
    assert task.batches(0, 4, test=[])()[0].shape[0] == 4  # nothing held out: a batch, as ever


def test_a_task_runs_rows_name_the_weights_that_scored_them(task_smoke, tmp_path):
    """As perplexity's rows do: model.pt's sha256 (16 digits) on every row, so rows that other
    weights scored are refused by report in one line; eval_log.jsonl says where they were scored."""
    import csv
    import json
    import shutil

    from posbench.experiment.records import weights_record

    exp = shutil.copytree(task_smoke, tmp_path / "copy")
    for run in ("nope-seed0", "alibi-seed0"):
        own = weights_record(exp / run)["sha256"][:16]
        rows = list(csv.DictReader(open(exp / run / "eval.csv")))
        assert {r["weights"] for r in rows} == {own}
        (scored,) = [json.loads(line) for line in (exp / run / "eval_log.jsonl").read_text().splitlines()]
        assert (scored["measure"], scored["device"]) == ("exact_match", "cpu")
        assert scored["lengths"] == sorted({int(r["length"]) for r in rows})
    path = exp / "alibi-seed0" / "eval.csv"  # as another training's alibi seed 0 would have scored it
    path.write_text(path.read_text().replace(weights_record(exp / "alibi-seed0")["sha256"][:16], "0" * 16))
    assert "its eval.csv holds rows scored by other weights" in report_refused(exp)
