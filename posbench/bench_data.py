"""Benchmarks of the input side: tokenizing and fetching a corpus, and a task's batches.

`posbench bench --data`: how fast a corpus becomes tokens, and what share of a training step
fetching a batch from a memory-mapped (prepared) corpus takes. `posbench bench --task NAME`: a
task's training step with its batch padded whole against cut into parts by length."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from posbench.config import DataConfig, ExperimentConfig


def data_benchmark(cfg: ExperimentConfig, rounds: int = 30, reporter=None) -> list[list[str]]:
    """Rows of a table: `posbench prepare`'s throughput in MB/s with bytes and with a BPE (trained
    once and cached before the timing), then the milliseconds a batch takes to fetch from the BPE
    corpus's memory map against one training step of the config's model, interleaved and taken
    at their medians, and the fetch's share of the two."""
    import statistics

    import torch

    from posbench.data import CorpusBatches, load_corpus, shakespeare
    from posbench.model import TransformerLM
    from posbench.text import prepare, source_files
    from posbench.train import make_optimizer, train_step

    rows = [["what", "value"]]
    with tempfile.TemporaryDirectory() as tmp:
        source = cfg.data.path
        if source is None:  # the default corpus, as a file prepare reads
            source = str(Path(tmp) / "shakespeare.txt")
            Path(source).write_bytes(shakespeare(reporter))
        else:
            source_files(source)  # a corpus that is not there is named as data.path, not as prepare's SOURCE
        vocab = cfg.data.vocab_size or 2048
        prepared = {}
        for spec in ("bytes", "bpe"):
            data = DataConfig(path=source, tokenizer=spec, vocab_size=vocab if spec == "bpe" else None)
            if spec == "bpe":
                prepare(data, Path(tmp) / "warm", reporter)  # trains and caches the BPE: not timed
            start = time.perf_counter()
            meta = prepare(data, Path(tmp) / spec)
            seconds = time.perf_counter() - start
            size = (meta["train_bytes"] + meta["val_bytes"]) / 1e6
            rows.append(
                [f"prepare, {meta['tokenizer']}", f"{size / seconds:.1f} MB/s ({size:.1f} MB in {seconds:.2f} s)"]
            )
            prepared[spec] = Path(tmp) / spec
        corpus = load_corpus(DataConfig(path=str(prepared["bpe"])))
        model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
        torch.manual_seed(0)
        model = TransformerLM(model_cfg)
        opt, params = make_optimizer(model, 1e-4, cfg.train.weight_decay), list(model.parameters())
        batches = CorpusBatches(corpus, cfg.train.batch_size or 16, model_cfg.train_len)
        gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
        fetch, step = [], []
        for _ in range(rounds + 1):  # the first round, AdamW allocating its state, is not timed
            t0 = time.perf_counter()
            batch = batches(gen)
            t1 = time.perf_counter()
            train_step(model, opt, params, batch, cpu, cfg.train.grad_clip)
            t2 = time.perf_counter()
            fetch.append(t1 - t0)
            step.append(t2 - t1)
        f, s = statistics.median(fetch[1:]), statistics.median(step[1:])
        shape = f"{batches.batch_size} x {model_cfg.train_len} tokens"
        rows.append([f"fetch a batch from the memory map ({shape})", f"{1e3 * f:.3f} ms"])
        rows.append([f"one training step ({model_cfg.n_layer} layers, width {model_cfg.d_model})", f"{1e3 * s:.1f} ms"])
        rows.append(["fetch's share of a step", f"{100 * f / (f + s):.2f}%"])
    return rows


TASK_PARTS = (1, 2, 3, 4)  # a batch whole, then cut into 2, 3 and 4 parts by length


def task_benchmark(cfg: ExperimentConfig, scheme: str, rounds: int = 10, reporter=None) -> list[list[str]]:
    """Rows of a table: one training step of cfg.task at its recipe (the config's model and batch
    size) with `scheme`, on the same instances, with the batch padded whole and cut into 2, 3 and 4 parts by
    length: milliseconds a step (the fastest of `rounds` interleaved rounds, each on a fresh
    batch), its ratio to the whole batch's, and the share of the inputs that is padding."""
    import torch

    from posbench.model import TransformerLM
    from posbench.tasks import PAD, build_task
    from posbench.train import make_optimizer, train_step

    task = build_task(cfg.task, cfg.task_options)
    torch.manual_seed(0)
    model = TransformerLM(dataclasses.replace(cfg.model, scheme=scheme, options=cfg.scheme_options.get(scheme, {})))
    opt, params = make_optimizer(model, 1e-4, cfg.train.weight_decay), list(model.parameters())
    cpu = torch.device("cpu")
    cut = {k: task.batches(0, cfg.train.batch_size, parts=k) for k in TASK_PARTS}  # one stream each, the same
    best, padding = dict.fromkeys(TASK_PARTS, float("inf")), {}
    for r in range(rounds + 1):  # round 0 warms up
        for k in TASK_PARTS if r % 2 else TASK_PARTS[::-1]:
            batch = cut[k]()
            parts = batch if isinstance(batch, list) else [batch]
            padding[k] = sum(int((x == PAD).sum()) for x, _ in parts) / sum(x.numel() for x, _ in parts)
            start = time.perf_counter()
            train_step(model, opt, params, batch, cpu, cfg.train.grad_clip)
            if r:
                best[k] = min(best[k], time.perf_counter() - start)
        if reporter is not None:
            reporter(f"round {r} of {rounds}")
    whole = best[1]
    rows = [["batch", "ms a step", "x the whole batch's speed", "padding (last round)"]]
    for k in TASK_PARTS:
        name = "padded whole" if k == 1 else f"{k} parts by length"
        rows.append([name, f"{1e3 * best[k]:.1f}", f"{whole / best[k]:.2f}", f"{100 * padding[k]:.0f}%"])
    return rows


def task_benchmarks(
    cfg: ExperimentConfig, schemes: list[str], rounds: int, reporter=None
) -> Iterator[tuple[str, list]]:
    """`posbench bench --task`: a (title, table) per scheme of `task_benchmark`, each as it is
    timed, at the task's recipe (its depth and batch size); a task whose batches are not cut by
    length is refused before any is timed."""
    from posbench.errors import PosbenchError
    from posbench.resolve import resolve_training

    exp = resolve_training(cfg)
    why_not = exp.task.padding_benchmark()
    if why_not is not None:
        raise PosbenchError(f"--task {cfg.task}: {why_not}")
    cfg = exp.cfg
    title = "task {}, {}: one training step on the CPU, {} layers, batch {}"
    return (
        (title.format(cfg.task, s, cfg.model.n_layer, cfg.train.batch_size), task_benchmark(cfg, s, rounds, reporter))
        for s in schemes
    )
