"""Synthetic tasks' generators: the registry, one generator per task, the fixed test set and the batches.

A task makes instances as byte strings, a prompt and an answer, e.g. b"copy:abc=" + b"abc.".
The answer always ends in END, so a model that stops one byte early or late is wrong. An
instance has a length n (the string's length, the digits, the pairs...). Training draws n
uniformly from 1..train_max; the test set holds up to test_count instances of every length
1..test_max, drawn from a fixed seed, so every scheme and seed meets the same ones, and
training never draws one of them.
"""

from __future__ import annotations

import math
import random
from typing import Optional

from posbench.errors import PosbenchError
from posbench.registry import Registry, check_options
from posbench.tasks.corpus import LM

END = b"."  # every answer's last byte
PAD = 0  # the byte that pads a batch's short instances; never scored
IGNORE = -100  # the target of a position the loss skips (F.cross_entropy's ignore_index)
TEST_SEED = "posbench-test"  # the test set's seed: fixed, so every run meets the same instances
TEST_BYTES_LIMIT = 10**9  # the test set's bytes, at most: past it scoring would take days, and building it hangs
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CPU_PARTS = 3  # a training batch on the CPU, cut into parts by length (docs/performance.md measures it)


def symbols(syntax: bytes) -> str:
    """Printable ASCII but space (unreadable in samples.txt) and a task's delimiters: 91 symbols for
    copy. With a-z, 22% of length-20 strings repeat a bigram, so a small model cannot copy by content
    and falls back to copying by position; with 91, 2% do (docs/tasks.md)."""
    return "".join(chr(c) for c in range(33, 127) if c not in syntax)


class Task:
    """Base of every task. Subclass it, set `name`, `description` and any extra `options`,
    and write `make` and `longest` (and `space` where the instances are few). Register it in
    TASKS, or load it as module:Class (docs/tasks.md, "Write your own task")."""

    name = "task"
    description = ""
    syntax = b":=" + END  # bytes an alphabet may not use: they delimit the prompt and answer
    options: dict = {"train_max": 20, "test_max": None, "test_count": 50}
    # the recipe, where the config leaves these keys out: steps and batch_size (train.*), depth
    # (model.n_layer) and the AdamW schedule (train.lr, min_lr, warmup_steps); docs/tasks.md
    # has the runs that chose it
    budget: dict = {"steps": 4000, "batch_size": 64, "n_layer": 4, "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 200}
    # schemes set up as the NoPE study's model (HF T5) sets up T5's bias, where the config leaves
    # the option out: its table starts near zero, N(0, d_model^-0.5), and is added to the logits
    # as is; started at zero and added as is here. Perplexity keeps x-transformers' N(0, 1) x
    # sqrt(d_head) (lucidrains/x-transformers `RelativePositionBias`). docs/tasks.md, "The recipe", has the runs
    scheme_setup: dict = {s: {"init": "zeros", "scale": "none"} for s in ("t5", "hybrid")}

    def __init__(self, options: Optional[dict] = None, where: str = "task_options"):
        options = dict(options or {})
        self.validate_options(options, where)
        self.opt = {**self.options, **options}
        self.train_max = self.opt["train_max"]
        self.test_max = self.opt["test_max"] or 2 * self.train_max
        if self.test_max < self.train_max:
            raise PosbenchError(
                f"{where}.test_max={self.test_max} is shorter than {where}.train_max={self.train_max}; "
                f"test lengths must reach at least the training ones"
            )
        self.check(where)
        most = self.opt["test_count"] * self.test_max * self.longest(self.test_max)  # every length's longest
        if most > TEST_BYTES_LIMIT:
            raise PosbenchError(
                f"{where}: test_max={self.test_max} with test_count={self.opt['test_count']} makes a test set "
                f"of up to {most:,} bytes (instances of up to {self.longest(self.test_max):,}); posbench scores "
                f"at most {TEST_BYTES_LIMIT:,}: lower test_max or test_count"
            )
        # the test holds out half of a length's instances: none of one. A small alphabet has the
        # fewest at the shortest lengths, which are checked (every length would cost seconds)
        shortest = range(1, min(self.test_max, 8) + 1)
        few = next((n for n in shortest if (self.space(n) or 2) < 2), None)
        if few is not None:
            key = f"{where}.alphabet" if "alphabet" in self.opt else where
            raise PosbenchError(
                f"{key}: task {self.name} has {self.space(few)} distinct instance(s) of length {few}, too few to "
                f"hold any out for the test (it takes half of each length's); give a longer alphabet",
                key,
            )

    @classmethod
    def validate_options(cls, given: dict, where: str = "task_options") -> None:
        """Unknown keys (with a did-you-mean), wrong types and non-positive sizes, one line each."""
        check_options(cls.options, given, where, owner=f" of task '{cls.name}'")
        test_max = given.get("test_max")
        if test_max is not None and (isinstance(test_max, bool) or not isinstance(test_max, int)):
            raise PosbenchError(f"{where}.test_max: expected int, got {test_max!r}")
        if test_max is not None and test_max <= 0:
            raise PosbenchError(f"{where}.test_max={test_max} must be positive")

    def check(self, where: str) -> None:
        """Options that depend on each other; the alphabet checks of alphabet tasks."""
        for key in ("alphabet", "values"):
            if key not in self.opt:
                continue
            text = self.opt[key]
            if not text or not text.isascii() or not text.isprintable():
                raise PosbenchError(f"{where}.{key}={text!r}: expected printable ASCII characters")
            if len(set(text)) != len(text):
                raise PosbenchError(f"{where}.{key}={text!r} lists a character more than once")
            clash = sorted(set(text.encode()) & set(self.syntax))
            if clash:
                raise PosbenchError(
                    f"{where}.{key}={text!r} uses {bytes(clash).decode()!r}, which the task's instances use "
                    "as delimiters"
                )

    # --- what a task defines ------------------------------------------------------------------

    def make(self, n: int, rng: random.Random) -> tuple[bytes, bytes]:
        """One instance of length n: (prompt, answer), the answer ending in END."""
        raise NotImplementedError

    def longest(self, n: int) -> int:
        """The longest prompt + answer, in bytes, at length n."""
        raise NotImplementedError

    def space(self, n: int) -> Optional[int]:
        """How many distinct instances length n has (None: too many to matter)."""
        return None

    # --- derived ---------------------------------------------------------------------------------

    @property
    def train_len(self) -> int:
        """The longest training sequence, the model's model.train_len."""
        return max(self.longest(n) for n in range(1, self.train_max + 1))

    def test_set(self) -> list[tuple[int, bytes, bytes]]:
        """(n, prompt, answer) for every length 1..test_max: test_count distinct instances each,
        from TEST_SEED. Where a length has few instances (parity of 3 bits has 8), the test takes
        at most half of them, so that training, which never draws a test instance, keeps the
        other half of every length."""
        out = []
        for n in range(1, self.test_max + 1):
            space = self.space(n)
            want = self.opt["test_count"] if space is None else min(self.opt["test_count"], space // 2)
            rng = random.Random(f"{TEST_SEED}-{self.name}-{n}")
            seen: dict[bytes, tuple[bytes, bytes]] = {}
            for _ in range(50 * want):  # a task with fewer instances than space() says stops here
                if len(seen) >= want:
                    break
                prompt, answer = self.make(n, rng)
                seen.setdefault(prompt + answer, (prompt, answer))
            out += [(n, p, a) for p, a in seen.values()]
        return out

    def batches(self, seed: int, batch_size: int, test: Optional[list] = None, parts: int = 1) -> Batches:
        return Batches(self, seed, batch_size, test if test is not None else self.test_set(), parts)


REDRAWS = 10_000  # a draw held out this often in a row: the task has (almost) nothing left to train on


class Batches:
    """Training batches: n ~ U(1..train_max), instances redrawn until none is a test instance,
    padded with PAD on the right, the loss on the answer bytes alone. The order follows the seed.

    With `parts` > 1 a batch comes as that many parts: its instances sorted by length, cut into
    runs of equal count, each padded to its own longest. Training takes the parts as one step
    (the same gradient, in fewer padded bytes: a batch padded whole is about 40% padding)."""

    def __init__(self, task: Task, seed: int, batch_size: int, test: list, parts: int = 1):
        self.task, self.batch_size, self.parts = task, batch_size, max(1, min(parts, batch_size))
        self.rng = random.Random(seed)
        self.held_out = {p + a for n, p, a in test if n <= task.train_max}

    def instance(self, n: Optional[int] = None) -> tuple[bytes, bytes]:
        """A training instance of length n (None: n ~ U(1..train_max)), never a test instance."""
        for _ in range(REDRAWS):
            prompt, answer = self.task.make(n or self.rng.randint(1, self.task.train_max), self.rng)
            if prompt + answer not in self.held_out:
                return prompt, answer
        raise PosbenchError(
            f"task '{self.task.name}': {REDRAWS:,} draws in a row were all held out for its test set, so it has "
            f"too few distinct training instances up to train_max={self.task.train_max}; raise train_max"
        )

    def get_state(self) -> list:
        """Where the instance stream stands, for a training checkpoint."""
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def set_state(self, state: list) -> None:
        version, internal, gauss = state
        self.rng.setstate((version, tuple(internal), gauss))

    def __call__(self, gen=None):
        """Inputs (B, T) and targets (B, T), int64; targets are IGNORE outside the answers. With
        parts > 1, a list of such pairs, shortest instances first."""
        instances = [self.instance() for _ in range(self.batch_size)]
        if self.parts == 1:
            return pack(instances)
        instances.sort(key=lambda inst: len(inst[0]) + len(inst[1]))
        cuts = [len(instances) * i // self.parts for i in range(self.parts + 1)]
        return [pack(instances[a:b]) for a, b in zip(cuts, cuts[1:])]


def pack(instances: list[tuple[bytes, bytes]]):
    """Instances as next-byte inputs and targets, (B, T) each, T the longest instance less one.
    The target at position t is byte t+1, scored only when byte t+1 belongs to the answer."""
    import torch  # the tasks themselves are plain bytes: reports read them without torch

    T = max(len(p) + len(a) for p, a in instances) - 1
    x = torch.full((len(instances), T), PAD, dtype=torch.long)
    y = torch.full((len(instances), T), IGNORE, dtype=torch.long)
    for i, (p, a) in enumerate(instances):
        seq = torch.tensor(list(p + a), dtype=torch.long)
        x[i, : len(seq) - 1] = seq[:-1]
        y[i, len(p) - 1 : len(seq) - 1] = seq[len(p) :]  # the answer's bytes, predicted from the byte before
    return x, y


# --- the tasks ------------------------------------------------------------------------------------


class Copy(Task):
    name = "copy"
    description = "a random string -> the same string"
    options = {**Task.options, "alphabet": symbols(Task.syntax)}
    budget = {**Task.budget, "steps": 2000}  # every seed scheme learns it at 2,000, at each of 3 seeds

    def make(self, n, rng):
        s = self.string(n, rng)
        return f"{self.name}:".encode() + s + b"=", self.solve(s) + END

    def string(self, n: int, rng: random.Random) -> bytes:
        """The prompt's string of length n."""
        return "".join(rng.choice(self.opt["alphabet"]) for _ in range(n)).encode()

    def solve(self, s: bytes) -> bytes:
        return s

    def longest(self, n):
        return len(self.name) + 2 * n + 3

    def space(self, n):
        return len(self.opt["alphabet"]) ** n


class Reverse(Copy):
    name = "reverse"
    description = "a random string -> it reversed"
    budget = {**Task.budget, "steps": 8000}  # learned's seed 2: 61% exact in distribution at 4,000, 82% at 6,000

    def solve(self, s):
        return s[::-1]


class Sort(Copy):
    name = "sort"
    description = "a random string -> its characters sorted (in the alphabet's byte order)"
    # a small alphabet, as the study's single-digit sort: repeated characters are part of sorting
    options = {**Task.options, "alphabet": LETTERS}
    budget = Task.budget  # not copy's 2,000 steps: sort was measured at 4,000

    def solve(self, s):
        return bytes(sorted(s))


class Repeat(Copy):
    """The NoPE study's repeat-one-char: the answer is trivial, only where it ends is not."""

    name = "repeat"
    description = "one character n times -> the same string"
    budget = {**Task.budget, "steps": 2000, "warmup_steps": 100}  # every seed scheme learns it in these

    def string(self, n, rng):
        return (rng.choice(self.opt["alphabet"]) * n).encode()

    def space(self, n):
        return len(self.opt["alphabet"])


class Replace(Task):
    """The NoPE study's replace-char: n copies of a, answered with n copies of b."""

    name = "replace"
    description = "n copies of a character a, and b -> n copies of b"
    syntax = b":=>" + END
    budget = {**Task.budget, "steps": 2000, "warmup_steps": 100}  # every seed scheme learns it in these
    options = {**Task.options, "alphabet": symbols(syntax)}

    def check(self, where):
        super().check(where)
        if len(self.opt["alphabet"]) < 2:
            raise PosbenchError(
                f"{where}.alphabet={self.opt['alphabet']!r}: replace draws two distinct characters; give at least two"
            )

    def make(self, n, rng):
        a, b = rng.sample(self.opt["alphabet"], 2)
        return f"replace:{a}>{b}:{a * n}=".encode(), (b * n).encode() + END

    def longest(self, n):
        return len("replace:a>b:") + n + 1 + n + 1

    def space(self, n):
        k = len(self.opt["alphabet"])
        return k * (k - 1)


class Addition(Task):
    name = "addition"
    description = "two n-digit numbers -> their sum"
    syntax = b":=+" + END

    def make(self, n, rng):
        lo = 0 if n == 1 else 10 ** (n - 1)  # n digits, no leading zero
        a, b = rng.randrange(lo, 10**n), rng.randrange(lo, 10**n)
        return f"add:{a}+{b}=".encode(), str(a + b).encode() + END

    def longest(self, n):
        return 4 + 2 * n + 2 + (n + 1) + 1

    def space(self, n):
        return (10 if n == 1 else 9 * 10 ** (n - 1)) ** 2


class Parity(Task):
    name = "parity"
    description = "a bit string -> even or odd, its count of 1s"

    def make(self, n, rng):
        bits = "".join(rng.choice("01") for _ in range(n))
        return f"parity:{bits}=".encode(), (b"even" if bits.count("1") % 2 == 0 else b"odd") + END

    def longest(self, n):
        return 8 + n + 5

    def space(self, n):
        return 2**n


FILLER = "the grass is green the sky is blue the sun is yellow here we go there and back again".split()


class Passkey(Task):
    """Filler words with a 5-digit key at a random depth (landmark attention's passkey test)."""

    name = "passkey"
    description = "n filler words with a 5-digit key at a random depth -> the key"
    budget = {**Task.budget, "steps": 800, "batch_size": 32, "warmup_steps": 40}  # its instances are 5x longer

    def make(self, n, rng):
        return self.make_at(n, rng.randint(0, n), rng.randrange(10000, 100000))

    def make_at(self, n: int, depth: int, key: int) -> tuple[bytes, bytes]:
        """The key after `depth` of the n filler words."""
        words = [FILLER[i % len(FILLER)] for i in range(n)]
        words.insert(depth, f"key {key}")
        return f"passkey:{' '.join(words)}=".encode(), f"{key}".encode() + END

    def longest(self, n):
        words = [FILLER[i % len(FILLER)] for i in range(n)]
        return 8 + len(" ".join(words + ["key 12345"])) + 1 + 6

    def space(self, n):
        return 90000 * (n + 1)


class Recall(Task):
    """Associative recall (zoology's MQAR, one query): n key-value pairs, then a key."""

    name = "recall"
    description = "n key-value pairs, then one of the keys -> its value"
    syntax = b":=?" + END
    options = {**Task.options, "alphabet": LETTERS + LETTERS.upper(), "values": "0123456789"}

    def check(self, where):
        super().check(where)
        if self.test_max > len(self.opt["alphabet"]):
            raise PosbenchError(
                f"{where}.test_max={self.test_max}: recall's keys are distinct, and its alphabet has "
                f"{len(self.opt['alphabet'])}; give a longer alphabet or a smaller test_max"
            )

    def make(self, n, rng):
        keys = rng.sample(self.opt["alphabet"], n)
        values = [rng.choice(self.opt["values"]) for _ in range(n)]
        q = rng.randrange(n)
        pairs = "".join(k + v for k, v in zip(keys, values))
        return f"recall:{pairs}?{keys[q]}=".encode(), values[q].encode() + END

    def longest(self, n):
        return 7 + 2 * n + 3 + 2

    def space(self, n):
        return math.perm(len(self.opt["alphabet"]), n) * len(self.opt["values"]) ** n * n


def _check_plugin(name: str, cls: type) -> None:
    missing = [m for m in ("make", "longest") if getattr(cls, m) is getattr(Task, m)]
    if missing:
        raise PosbenchError(
            f"task '{name}': {cls.__name__} does not define {' or '.join(missing)}; "
            f"a task defines make(n, rng) and longest(n)"
        )


TASKS = Registry(
    "task",
    {
        name: f"posbench.tasks.generators:{cls}"
        for name, cls in (
            ("copy", "Copy"),
            ("reverse", "Reverse"),
            ("sort", "Sort"),
            ("repeat", "Repeat"),
            ("replace", "Replace"),
            ("addition", "Addition"),
            ("parity", "Parity"),
            ("passkey", "Passkey"),
            ("recall", "Recall"),
        )
    },
    base="posbench.tasks:Task",
    example="my_tasks:Increment",
    also=(LM,),
    check=_check_plugin,
)


def build_task(name: str, options: dict) -> Task:
    return TASKS.build(name, options)


def task_derived(run: dict, key: str) -> bool:
    """Whether a run's task set `key` of its flattened config (config.flat) itself: train_len
    always, a task option where it is the task's default (test_max's, None, is 2 train_max)."""
    if run.get("task") in (None, LM) or key not in run:
        return False
    if key == "model.train_len":
        return True
    option = key.removeprefix("task_options.")
    defaults = TASKS.lookup(run["task"]).options
    if option == "test_max":
        return run[key] == 2 * run.get("task_options.train_max", defaults["train_max"])
    return option != key and option in defaults and run[key] == defaults[option]
