"""The benchmark: training throughput, FLOP utilisation and evaluation memory, side by side.

The machine is shared and noisy, so every number that matters is a ratio taken in one process:
each scheme against NoPE, posbench against a peer library, model FLOP/s against a large fp32
matmul measured in the same run. Schemes, peers and the matmul are timed in interleaved rounds
(matmul, nope, t5, ..., then t5, matmul, nope, ...) and each keeps its fastest round, so a burst of
load hits all of them alike; the order is shuffled each round, so no model always follows the matmul.
A time stands only where a second round confirms it: on a busy machine a step with all cores'
threads waits at every op for the one that was descheduled, and a round can run 30x slow.
Each model's first step is timed alone before the rounds and shown apart from them: it is where
kernels compile (flex's on a GPU, the C kernels on a CPU) and AdamW allocates its state, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from posbench.config import ModelConfig
from posbench.device import autocast
from posbench.errors import PosbenchError, first_line
from posbench.files import write_rows
from posbench.model import TransformerLM

BENCH_COLUMNS = [
    "scheme",
    "measurement",
    "tokens_per_s",
    "ratio_vs_nope",
    "mfu",
    "peer_tokens_per_s",
    "peer_ratio",
    "eval_len",
    "peak_mem_mb",
    "first_call_s",
    "device",
    "attention",
]
EVAL_MULTIPLES = (1, 4, 16, 64)
PEERS = ("x-transformers",)
AGREE = 1.25  # the fastest round stands when another comes within 25% of it


@dataclasses.dataclass
class BenchSettings:
    batch_size: int = 32
    steps: int = 4  # timed steps per round
    # many short rounds: a burst of load spoils a few, the minimum skips them
    rounds: int = 30
    warmup: int = 3  # untimed steps after the first (timed apart by time_first_calls), before the rounds
    multiples: tuple = EVAL_MULTIPLES

    @classmethod
    def quick(cls) -> BenchSettings:
        # one round cannot tell a step from a stalled one, so five, of which two must agree;
        # 16x and 32x are long enough that the query blocks dominate: linear memory doubles
        return cls(batch_size=4, steps=2, rounds=5, warmup=2, multiples=(1, 16, 32))


def confirmed(rounds: list[float]) -> Optional[float]:
    """The fastest of a function's round times, if a second round came within AGREE of it; else
    None. Load only ever adds time, so the fastest round is the best estimate, but only when it
    is not alone: a lone fast round is luck, and a run whose rounds all disagree (a machine
    busy throughout) has no time worth printing."""
    fastest = sorted(rounds)[:2]
    return fastest[0] if len(fastest) == 2 and fastest[1] <= AGREE * fastest[0] else None


PEAK_N = 2048  # the matmul that MFU is measured against on a CPU: 2048 x 2048 by 2048 x 2048, fp32
PEAK_N_CUDA = 8192  # on a GPU, in bf16 (training runs under bf16 autocast there): 2048 is too small to fill it


def peak_size(device: torch.device) -> int:
    return PEAK_N_CUDA if device.type == "cuda" else PEAK_N


def matmul_step_fn(n: int = PEAK_N, device: torch.device = torch.device("cpu")) -> Callable[[], None]:
    """One large matmul in the dtype training computes in: fp32 on a CPU, bf16 on a GPU. It is
    timed in the same interleaved rounds as the training steps, so the peak and the model's
    FLOP/s see the same load and their ratio (MFU) is fair."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return lambda: a @ b


def model_flops_per_token(cfg: ModelConfig, model: nn.Module) -> float:
    """6N for the matmul weights (the tied output head included, the lookup table not), plus
    12 * layers * d_model * T for the q.k and attention-times-v products (PaLM's count)."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and "scheme" not in name)
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.train_len


def _train_step_fn(model: nn.Module, batch_size: int, T: int) -> Callable[[], None]:
    """posbench/train.py's step (bf16 autocast on a GPU, fp32 on a CPU; AdamW with the default
    config's decay and clipping) on random tokens, on the model's device; posbench's models and
    the peer's take the same step."""
    from posbench.config import TrainConfig
    from posbench.train import make_optimizer, train_step

    device = next(model.parameters()).device
    params = list(model.parameters())  # once: model.parameters() walks every module each call
    tc = TrainConfig()
    opt = make_optimizer(model, 1e-4, tc.weight_decay)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch_size, T + 1), generator=gen).to(device)
    batch = (x[:, :-1], x[:, 1:])  # (B, T) inputs and targets

    return lambda: train_step(model, opt, params, batch, device, tc.grad_clip)


def time_first_calls(steps: dict[str, Callable[[], None]], sync: Callable[[], None]) -> dict[str, float]:
    """Seconds of each function's first call, alone, before any warm-up or round. It is paid
    once, so it is kept out of the steady state: AdamW allocates its state there, a GPU compiles
    flex's kernels (in this order: a later model may reuse what an earlier one compiled), and a
    CPU builds posbench's C kernels if none is cached yet."""
    first = {}
    for name, fn in steps.items():
        sync()  # the clock starts when nothing else is queued
        t = time.perf_counter()
        fn()
        sync()
        first[name] = time.perf_counter() - t
    return first


def time_interleaved(
    steps: dict[str, Callable[[], None]], s: BenchSettings, sync: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Seconds per step of each function in each of its interleaved rounds (`confirmed` picks
    the time that stands). `sync` waits for queued work (a GPU's), so a round's clock stops
    when its steps are done."""
    for fn in steps.values():
        for _ in range(s.warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in steps}
    order, shuffle = list(steps), random.Random(0).shuffle
    for _ in range(s.rounds):
        # a new order each round (the same in every run): whatever runs right after the 2048²
        # matmul finds its data pushed out of cache, and with one fixed order that would always
        # be NoPE, the baseline of every ratio (a little slower)
        shuffle(order)
        for name in order:
            t = time.perf_counter()
            for _ in range(s.steps):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - t) / s.steps)
    return times


def first_forward_s(model: TransformerLM, T: int) -> float:
    """Seconds of a GPU's first no-grad forward of length T, under bf16 autocast: where flex
    compiles (and autotunes) its kernels for this length, so it is timed apart and run before
    eval_peak_memory_mb reads the memory an evaluation holds."""
    device = next(model.parameters()).device
    x = torch.randint(0, 256, (1, T)).to(device)
    with torch.no_grad(), autocast(device):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        model(x)
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def eval_peak_memory_mb(model: TransformerLM, T: int) -> float:
    """Peak bytes held by tensors during one no-grad forward of length T, beyond what was held
    before it (the weights). On a CPU from the profiler's allocation events (the process's RSS
    is too coarse and never goes down); on a GPU from the CUDA allocator's peak, under the bf16
    autocast that evaluation runs in (after first_forward_s, whose compiling holds buffers no
    evaluation does)."""
    device = next(model.parameters()).device
    x = torch.randint(0, 256, (1, T)).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad(), autocast(device):
            model(x)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with torch.no_grad():
        return peak_tensor_bytes(lambda: model(x)) / 2**20


def peak_tensor_bytes(fn: Callable[[], object]) -> int:
    """The most bytes that the tensors fn() makes on the CPU hold at once, from the profiler's
    allocation events (what was held before fn ran is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


@contextlib.contextmanager
def _quiet_fd2():
    """The profiler's C++ side writes start/stop lines straight to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def xtransformers_model(scheme: str, cfg: ModelConfig) -> Optional[nn.Module]:
    """The same shape in lucidrains' x-transformers, for the schemes it has; None otherwise."""
    from x_transformers import Decoder, TransformerWrapper

    kinds = {
        "nope": ({"use_abs_pos_emb": False}, {}),
        "sinusoidal": ({"scaled_sinu_pos_emb": True}, {}),
        "learned": ({}, {}),
        "rope": ({"use_abs_pos_emb": False}, {"rotary_pos_emb": True, "rotary_emb_dim": cfg.head_dim}),
        "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}),
        "t5": ({"use_abs_pos_emb": False}, {"rel_pos_bias": True}),
    }
    if scheme not in kinds:
        return None
    wrapper, layers = kinds[scheme]
    decoder = Decoder(dim=cfg.d_model, depth=cfg.n_layer, heads=cfg.n_head, attn_dim_head=cfg.head_dim, **layers)
    return TransformerWrapper(num_tokens=cfg.vocab_size, max_seq_len=cfg.train_len, attn_layers=decoder, **wrapper)


def _peer_step(scheme: str, cfg: ModelConfig, batch_size: int, device: torch.device) -> Optional[Callable[[], None]]:
    """The peer's training step for this scheme (None if it has no such scheme), tried once
    here so that a shape the peer cannot build is one clear error, not a crash mid-timing."""
    try:
        model = xtransformers_model(scheme, cfg)
        if model is None:
            return None
        model.to(device)
        step = _train_step_fn(model, batch_size, cfg.train_len)
        step()
    except Exception as e:  # the peer's own code: any failure is its, not the user's config
        raise PosbenchError(
            f"--peer x-transformers cannot train {scheme} at this size "
            f"(d_model {cfg.d_model}, {cfg.n_head} heads): {type(e).__name__}: {first_line(e)}"
        ) from None
    return step


def _import_peer(peer: str):
    if peer not in PEERS:
        raise PosbenchError(f"--peer {peer}: unknown peer; valid peers: {', '.join(PEERS)}")
    try:
        import loguru  # x-transformers logs warnings through loguru; keep the table clean

        loguru.logger.remove()
        import x_transformers  # noqa: F401
    except ImportError:
        raise PosbenchError(
            "--peer x-transformers needs the peer extra: pip install -e '.[peer]' (it keeps the installed torch)"
        ) from None


def check_backends(backends: list[str], device: torch.device, head_dim: int) -> None:
    """`--attention a,b,...` for side-by-side timing: each a backend that runs here, no two of
    them running as one for any scheme (auto is one of the others: on a GPU flex for a table's
    schemes, sdpa for the rest), else one line naming them."""
    from posbench.attention import FLEX_CANNOT_TRAIN_ON_CPU, backend_for
    from posbench.config import ATTENTION_BACKENDS

    for b in backends:
        if b not in ATTENTION_BACKENDS:
            expected = ", ".join(ATTENTION_BACKENDS)
            raise PosbenchError(f"--attention {','.join(backends)}: {b!r} is not one of {expected}")
    if "flex" in backends and device.type == "cpu":  # the bench times training steps
        raise PosbenchError(f"--attention {','.join(backends)}: {FLEX_CANNOT_TRAIN_ON_CPU}")
    for table in (False, True):  # a scheme without a table over distances, then one with
        runs_as: dict[str, list[str]] = {}
        for b in backends:
            runs_as.setdefault(backend_for(b, device, head_dim, table=table), []).append(b)
        twice = [given for given in runs_as.values() if len(given) > 1]
        if twice:
            raise PosbenchError(f"--attention {','.join(twice[0])}: these run as one backend here; give it once")


def run_bench(
    cfg: ModelConfig,
    schemes: list[str],
    settings: BenchSettings,
    peer: Optional[str] = None,
    progress: Callable[[str], None] = lambda msg: None,
    options: Optional[dict[str, dict]] = None,
    device: torch.device = torch.device("cpu"),
    backends: Optional[list[str]] = None,
) -> tuple[list[dict], float]:
    """Rows of bench.csv and the measured matmul peak (FLOP/s). `options`: each scheme's own
    (the config's scheme_options), so the numbers describe the models a run would train.
    `device`: cpu (fp32, the tested default) or cuda (bf16 autocast, as training runs there).
    `backends`: attention backends to time side by side in the same rounds (default: the
    config's); every ratio is to NoPE under the first. A time no second round confirms is None,
    and so is every number built on it (its tokens/s, its ratio to NoPE, its MFU; the peak and
    every MFU where the matmul's is unconfirmed)."""
    if peer:
        _import_peer(peer)
    schemes = ["nope"] + [s for s in schemes if s != "nope"]  # NoPE is every ratio's baseline
    backends = backends or [cfg.attention]
    pairs = [(s, b) for s in schemes for b in backends]
    name = {(s, b): s if len(backends) == 1 else f"{s} {b}" for s, b in pairs}  # a step's name in the rounds
    T = cfg.train_len
    n = peak_size(device)
    models, steps = {}, {"matmul peak": matmul_step_fn(n, device)}
    for s, b in pairs:
        torch.manual_seed(0)
        mc = dataclasses.replace(cfg, scheme=s, attention=b, options=dict((options or {}).get(s, {})))
        models[s, b] = TransformerLM(mc).to(device)
        steps[name[s, b]] = _train_step_fn(models[s, b], settings.batch_size, T)
        if peer and b == backends[0]:
            other = _peer_step(s, mc, settings.batch_size, device)
            if other is not None:
                steps[f"peer:{s}"] = other
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    progress(f"timing each model's first training step: {', '.join(name.values())}")
    first = time_first_calls({name[p]: steps[name[p]] for p in pairs}, sync)  # a peer's first ran in _peer_step
    progress(f"timing training steps: {len(steps) - 1} models and the matmul peak x {settings.rounds} rounds")
    sec = {key: confirmed(rounds) for key, rounds in time_interleaved(steps, settings, sync).items()}
    peak = 2 * n**3 / sec["matmul peak"] if sec["matmul peak"] else None
    tokens = settings.batch_size * T
    base = sec[name["nope", backends[0]]]
    rows = []
    for s, b in pairs:
        own = sec[name[s, b]]
        tps = tokens / own if own else None
        peer_tps = tokens / sec[f"peer:{s}"] if b == backends[0] and sec.get(f"peer:{s}") else None
        rows.append(
            {
                "scheme": s,
                "measurement": "train",
                "tokens_per_s": tps,
                "ratio_vs_nope": base / own if base and tps else None,
                "mfu": tps * model_flops_per_token(models[s, b].cfg, models[s, b]) / peak if tps and peak else None,
                "peer_tokens_per_s": peer_tps,
                "peer_ratio": tps / peer_tps if tps and peer_tps else None,
                "first_call_s": first[name[s, b]],
                "device": device_name(device),
                "attention": models[s, b].backend(device),
            }
        )
    # said now, so a bench stopped during the memory part (flex compiles a kernel per length) keeps them
    progress("training speed: " + ", ".join(map(speed_words, rows)))
    longest = max(settings.multiples) * T
    for s, b in pairs:
        model = models[s, b].eval()
        grow = {k: longest for k in ("max_len", "max_pos") if k in model.scheme.options}  # learned, randomized
        if model.max_len is not None and model.max_len < longest and grow:
            # positions as many as the longest length: what the memory of that length would be
            mc = dataclasses.replace(model.cfg, options={**model.cfg.options, **grow})
            model = TransformerLM(mc).to(device).eval()
        for m in settings.multiples:
            L = m * T
            mb = seconds = None
            if model.max_len is None or L <= model.max_len:
                # the first forward at this length, where a GPU compiles flex for it; a CPU's runs
                # under the profiler that reads its memory, whose start-up and bookkeeping would be
                # most of that time (its first start took 1 s, the forward 2 ms, at T = 100)
                seconds = first_forward_s(model, L) if device.type == "cuda" else None
                mb = eval_peak_memory_mb(model, L)
            took = f", first forward {seconds:.1f} s" if seconds is not None else ""
            progress(f"evaluation memory: {name[s, b]} at {L}: {'—' if mb is None else f'{mb:,.1f} MB'}{took}")
            rows.append(
                {
                    "scheme": s,
                    "measurement": "eval",
                    "eval_len": L,
                    "peak_mem_mb": mb,
                    "first_call_s": seconds,
                    "device": device_name(device),
                    "attention": model.backend(device),
                }
            )
    return rows, peak


def speed_words(row: dict) -> str:
    """'rope sdpa 59,272 tokens/s (0.94x NoPE)', or what could not be confirmed."""
    who = f"{row['scheme']} {row['attention']}"
    if row["tokens_per_s"] is None:
        return f"{who} unconfirmed"
    ratio = f"{row['ratio_vs_nope']:.2f}x NoPE" if row["ratio_vs_nope"] is not None else "NoPE unconfirmed"
    return f"{who} {row['tokens_per_s']:,.0f} tokens/s ({ratio})"


def device_name(device: torch.device) -> str:
    """What the numbers were measured on: the GPU's name, or the CPU's model and thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"{model or 'CPU'}, {torch.get_num_threads()} threads"


def write_bench(rows: list[dict], path) -> None:
    """bench.csv: one row per (scheme, measurement); blank where a value does not apply."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_rows(path, rows, BENCH_COLUMNS)


def writable_csv(path: Path) -> Path:
    """`path`, or path/bench.csv when it is a folder. The CSV is written beside itself and renamed
    over the old one, so it must be a plain file (or nothing yet) in a folder that can be made
    and written; a symlink is followed, so its target is what gets replaced."""
    if path.is_dir():
        path = path / "bench.csv"
    path = path.resolve()
    if path.exists() and not path.is_file():
        raise PosbenchError(f"--out {path}: exists and is not a plain file")
    if path.is_file() and path.stat().st_size and not is_bench_csv(path):
        raise PosbenchError(
            f"--out {path}: exists and is not a bench CSV (its first line is not bench's header), "
            "so it is kept; name a new file, a bench CSV to replace, or a folder"
        )
    folder = path.parent
    while not folder.exists():  # the nearest folder that exists must let us make the rest
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise PosbenchError(f"--out {path}: cannot write in {folder}")
    return path


def is_bench_csv(path: Path) -> bool:
    """Whether `path` starts as the header posbench bench writes (an older bench's too)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return False
    return first.startswith("scheme,measurement,")
