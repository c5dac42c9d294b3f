"""Where tensors run: the device a setting names, and the precision it computes in."""

from __future__ import annotations

import contextlib

import torch

from posbench.errors import PosbenchError


def pick_device(name: str, hint: str = "--device cpu runs on the CPU") -> torch.device:
    """auto (cuda if present, else cpu), cpu, cuda or cuda:N; a missing GPU is one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PosbenchError(f"train.device={name}: no CUDA device is available here ({hint})")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise PosbenchError(f"train.device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def computed_on(device: torch.device) -> dict:
    """What decides a record's last digits beyond its attention backend: the device (a GPU
    computes in bf16 autocast, a CPU in fp32), torch's CPU threads, and the versions."""
    from posbench import __version__

    return {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "posbench": __version__,
    }


def autocast(device: torch.device):
    """bf16 on GPUs; CPUs stay fp32, the tested default."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
