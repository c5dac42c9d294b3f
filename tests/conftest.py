"""Shared fixtures: a tiny model config and a tiny corpus, so no test needs the network."""

import random

import pytest
import torch

from posbench.check import tiny_config as tiny  # noqa: F401  (the tests' tiny model size)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture
def corpus_file(tmp_path):
    """~40 kB of deterministic pseudo-English, enough for a 16-token model to learn something."""
    rng = random.Random(0)
    words = "the king and queen of a castle to be or not that is question my lord".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(800)]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
