"""The `native` attention backend: C kernels for the CPU, built once and cached.

C kernels compiled on first use with the machine's C compiler, cached, and called through
ctypes, on CPU tensors in fp32. The eager formula in posbench/attention.py is their reference;
tests check every kernel against it.

- attention.c: causal attention with no bias, a fixed bias or a learned one, fused, and
  Transformer-XL's relative position term computed inside its tiles;
- cope.c: CoPE's whole attention, behind CoPE's `attend` hook.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from posbench.files import cache_dir

# tried in order; the first that compiles is kept. -march=native is why the cache key names
# the CPU, and without -fopenmp the kernel runs on one thread
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)

_loaded: dict[str, Optional[ctypes.CDLL]] = {}
unavailable: dict[str, str] = {}  # kernel name -> why its PyTorch twin runs instead


class BuildError(Exception):
    pass


def load(name: str, building: Optional[Callable[[Path], None]] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernel `name`, or None (the reason goes to `unavailable[name]`). `building`
    hears of a first build, with the cache folder, before the compiler runs."""
    if name not in _loaded:
        lib = None
        switch = os.environ.get("POSBENCH_NATIVE", "1")
        if switch.strip().lower() in ("0", "false", "no", "off"):
            unavailable[name] = f"turned off by POSBENCH_NATIVE={switch}"
        else:
            try:
                lib = _declare(name, ctypes.CDLL(str(_build(name, building))))
            except (BuildError, OSError) as e:
                unavailable[name] = str(e)
        _loaded[name] = lib
    return _loaded[name]


def require(name: str) -> ctypes.CDLL:
    """The compiled kernel `name`, for code that has already chosen it: a missing one is a bug."""
    lib = load(name)
    if lib is None:
        raise RuntimeError(f"the {name} kernel is unavailable: {unavailable.get(name)}")
    return lib


def _cpu_fingerprint() -> str:
    """What -march=native compiled for: a cached kernel is never run on another CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(name: str, building: Optional[Callable[[Path], None]] = None) -> Path:
    source = Path(__file__).with_name(f"{name}.c")
    cc = shlex.split(os.environ.get("CC") or "cc")  # CC may carry words: "ccache gcc"
    if not cc or shutil.which(cc[0]) is None:
        raise BuildError(f"no C compiler found (tried {' '.join(cc)!r}; set CC to use another)")
    key = "\n".join([" ".join(cc), _compiler_version(cc), repr(FLAG_SETS), _cpu_fingerprint()])
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # vmath.h
    key = hashlib.sha256(source.read_bytes() + headers + key.encode()).hexdigest()[:16]
    folder = cache_dir() / "native" / key
    lib = folder / f"{name}.so"
    if lib.exists():
        return lib
    if building is not None:
        building(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"tmp-{name}-", suffix=".so", dir=folder)
        os.close(fd)
    except OSError as e:
        raise BuildError(f"cannot write the kernel cache {folder}: {e.strerror}") from None
    tmp = Path(tmp_name)
    error = ""
    for flags in FLAG_SETS:
        cmd = [*cc, *flags, "-shared", "-fPIC", str(source), "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            error = str(e)
            continue
        if done.returncode == 0:
            os.replace(tmp, lib)  # atomic: two processes may build at once; one file wins whole
            return lib
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no message"]
        error = next((line.strip() for line in lines if "error" in line.lower()), lines[-1].strip())
    tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if empty: nothing was built under this key
    raise BuildError(f"{' '.join(cc)} could not compile {source.name}: {error}")


def _compiler_version(cc: list[str]) -> str:
    try:
        done = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
        return (done.stdout.splitlines() or [""])[0]
    except (OSError, subprocess.TimeoutExpired):
        return ""


P, I, F, N = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long  # noqa: E741  pointer, int, float, long
# each kernel's C functions: argument types, or (return type, argument types)
SIGNATURES: dict[str, dict[str, list | tuple]] = {
    "cope": {
        "cope_scratch": (N, [I, I, I, I]),
        "cope_forward": [P] * 7 + [I, I, I, I, I, I, I, F, P, I],
        "cope_backward": [P] * 12 + [I, I, I, I, I, I, I, F, P, I],
    },
    "attention": {
        "attention_scratch": (N, [I, I, I, I]),  # (return type, argument types) where it returns one
        "attention_forward": [P] * 9 + [I, I, I, I, I, I, F, P, I],
        "attention_backward": [P] * 16 + [I, I, I, I, I, I, F, P, I],
    },
}


def _declare(name: str, lib: ctypes.CDLL) -> ctypes.CDLL:
    for fn, sig in SIGNATURES.get(name, {}).items():
        restype, argtypes = sig if isinstance(sig, tuple) else (None, sig)
        getattr(lib, fn).argtypes = argtypes
        if restype is not None:
            getattr(lib, fn).restype = restype
    return lib


def _fits_kernel(*tensors) -> bool:
    """fp32 CPU tensors, outside autocast (whose matmuls would hand the C bf16 buffers) and
    outside torch.compile (its tracer cannot follow raw pointers into C: it crashed)."""
    if torch.compiler.is_compiling():
        return False
    fp32_cpu = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
    return fp32_cpu and not torch.is_autocast_enabled("cpu")


def _applies(kernel: str, D: int, *tensors) -> bool:
    """Whether `kernel` can take these tensors at all: a head dim its register tiles take, fp32
    on a CPU outside autocast, and the kernel built."""
    return D in ATTENTION_HEAD_DIMS and _fits_kernel(*tensors) and load(kernel) is not None


def cope_attention(q, k, v, table, qpos, kpos) -> Optional[torch.Tensor]:
    """CoPE's whole causal attention through cope.c, or None where the kernel does not apply
    (the caller then takes the generic path with CoPE.bias). The kernel
    takes positions 0..Tk-1 for the keys and the last Tq of them for the queries."""
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    shaped = k.shape == v.shape == (B, H, Tk, D) and Tq <= Tk and table.dim() == 2 and table.size(0) == D
    shaped = shaped and table.size(1) >= 1  # a table with no positions would be read at -1
    if not shaped or not _applies("cope", D, q, k, v, table):
        return None
    if not (torch.equal(kpos, torch.arange(Tk, device=kpos.device)) and torch.equal(qpos, kpos[Tk - Tq :])):
        return None
    return CoPEAttention.apply(q, k, v, table)


class CoPEAttention(torch.autograd.Function):
    """softmax(q.k / sqrt(d) + CoPE's bias, future masked) v, forward and backward in cope.c,
    in attention.c's register tiles: the backward recomputes gates, positions and
    probabilities from the saved log-sum-exp, so nothing (T, T) is kept or written."""

    @staticmethod
    def forward(ctx, q, k, v, table):
        if not _fits_kernel(q, k, v, table):
            raise RuntimeError("CoPEAttention takes fp32 CPU tensors outside autocast (use cope_attention)")
        lib = require("cope")
        q, k, v, table = _rows(q), _rows(k), _rows(v), table.contiguous()
        B, H, Tq, D = q.shape
        Tk, P = k.size(2), table.size(1)
        out = _head_major(B, H, Tq, D)
        lse = torch.empty(B, H, Tq, dtype=torch.float32)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads, lib.cope_scratch(Tk, D, P, 0), dtype=torch.float32)
        st = _strides(q, k, v, None, out)
        lib.cope_forward(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            table.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            st.data_ptr(),
            B,
            H,
            Tq,
            Tk,
            D,
            P,
            Tk - Tq,
            D**-0.5,
            scratch.data_ptr(),
            threads,
        )
        ctx.save_for_backward(q, k, v, table, out, lse)
        return out

    @staticmethod
    @once_differentiable  # the C works in place: no graph through it, so no second derivative
    def backward(ctx, d_out):
        lib = load("cope")
        q, k, v, table, out, lse = ctx.saved_tensors
        B, H, Tq, D = q.shape
        Tk, P = k.size(2), table.size(1)
        d_out = _rows(d_out)
        d_q, d_k, d_v = _grads_of(q, k)
        d_table = torch.empty(B * H, P, D, dtype=torch.float32)  # per pair, summed below
        threads = torch.get_num_threads()
        scratch = torch.empty(threads, lib.cope_scratch(Tk, D, P, 1), dtype=torch.float32)
        st = _strides(q, k, v, None, out, d_out, d_q, d_k, d_v)
        lib.cope_backward(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            table.data_ptr(),
            out.data_ptr(),
            d_out.data_ptr(),
            d_q.data_ptr(),
            d_k.data_ptr(),
            d_v.data_ptr(),
            d_table.data_ptr(),
            lse.data_ptr(),
            st.data_ptr(),
            B,
            H,
            Tq,
            Tk,
            D,
            P,
            Tk - Tq,
            D**-0.5,
            scratch.data_ptr(),
            threads,
        )
        return d_q, d_k, d_v, d_table.sum(0).t()


ATTENTION_HEAD_DIMS = range(8, 257, 8)  # attention.c's register tiles take 8 floats at a time


def build_for(cfgs, note: Callable[[str], None]) -> None:
    """Build the C kernels the runs of `cfgs` (an experiment's config, or a sweep's grid points,
    whose schemes may need kernels of their own) take under `auto` on a CPU, once, before any
    worker starts; `note` says a build, and where auto cannot use a kernel. A backend named
    outright is checked when the model runs; a GPU takes SDPA or flex."""
    from posbench.device import pick_device
    from posbench.schemes import SCHEMES

    first = cfgs[0]
    device = pick_device(first.train.device)
    if first.model.attention != "auto" or device.type != "cpu":
        return
    needed: set = set()  # the schemes' own kernels, each scheme with its options
    for c in cfgs:
        for s in c.schemes:
            needed |= set(SCHEMES.lookup(s).kernels_for(c.scheme_options.get(s, {}), c.model.train_len))
    own = sorted(needed)
    loaded = {
        name: load(name, lambda folder: note(f"building the C kernels, once (cached in {folder})"))
        for name in ("attention", *own)
    }
    why = why_not(first.model.head_dim, device)
    if why:
        note(f"attention runs on SDPA, a few times slower on a CPU: the native backend cannot run ({why})")
    for name in [] if why else [n for n in own if loaded[n] is None]:
        note(f"{name} trains on its PyTorch path, several times slower: its C kernel cannot run ({unavailable[name]})")


def why_not(
    head_dim: int, device: torch.device, compiling: bool = False, dtype: torch.dtype = torch.float32
) -> Optional[str]:
    """Why the native backend cannot run a model with this head size here, or None if it can."""
    if device.type != "cpu":
        return f"it runs on a CPU, not {device.type}"
    if dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return "it computes in fp32 only, outside autocast"
    if compiling:
        return "torch.compile cannot trace into the C kernels"
    if head_dim not in ATTENTION_HEAD_DIMS:
        return f"the head size {head_dim} is not a multiple of 8 between 8 and 256"
    if load("attention") is None:
        return f"the attention kernel is unavailable ({unavailable['attention']})"
    return None


def attention(q, k, v, bias, q0: int) -> Optional[torch.Tensor]:
    """softmax(q.k / sqrt(d) + bias, future masked) v through attention.c, for queries q0..q0+Tq-1
    against keys 0..Tk-1 (q0 + Tq = Tk) and a bias of shape (B or 1, H, Tq, Tk) or None; None
    where the kernel does not apply.

    Where q, k and v are the head-major views of one (B, T, 3 H D) projection (the model's qkv),
    the kernel takes that projection whole and returns its gradient as one tensor, where three
    separate ones would make autograd's split backward copy them into one (a cat per layer)."""
    B, H, Tq, D = q.shape
    tensors = (q, k, v) if bias is None else (q, k, v, bias)
    shaped = q0 >= 0 and k.shape == v.shape == (B, H, q0 + Tq, D)  # no broadcasting: the C indexes every pair
    if not shaped or not _applies("attention", D, *tensors):
        return None
    if bias is not None:  # batch and heads may be shared (stride 0); rows made contiguous first,
        bias = _rows(bias).expand(B, H, Tq, q0 + Tq)  # or the expand would be copied B times
    base = q._base  # nn.Linear's output, or the 2-D product it is a view of
    if base is not None and q0 == 0 and base.is_contiguous() and base.numel() == 3 * q.numel():
        packed = base.view(B, Tq, 3 * H * D)
        if _views_of(packed, q, k, v):
            return PackedAttention.apply(packed, bias, H)
    return Attention.apply(q, k, v, bias, q0)


def qkv_views(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (B, H, T, D) query, key and value views of a (B, T, 3 H D) projection."""
    B, T, C3 = qkv.shape
    return qkv.view(B, T, 3, n_head, C3 // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)


def _views_of(packed, q, k, v) -> bool:
    """Whether q, k and v are exactly qkv_views(packed): the same memory, the same layout."""
    B, H, T, D = q.shape
    if packed.shape != (B, T, 3 * H * D) or not packed.is_contiguous():
        return False
    return all(
        t.shape == w.shape and t.stride() == w.stride() and t.data_ptr() == w.data_ptr()
        for t, w in zip((q, k, v), qkv_views(packed, H))
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim: the C reads rows of (batch, head) pairs in place."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _head_major(B, H, T, D) -> torch.Tensor:
    """A (B, H, T, D) view of (B, T, H, D) memory: the layout the output projection reads."""
    return torch.empty(B, T, H, D, dtype=torch.float32).transpose(1, 2)  # fp32 whatever the default dtype


def _grads_of(q, k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty gradients of q, k and v (v shaped as k) in the layout the kernels write."""
    return _head_major(*q.shape), _head_major(*k.shape), _head_major(*k.shape)


def _strides(*tensors) -> torch.Tensor:
    """(batch, head, row) strides of each (B, H, T, D) tensor; a missing one is zeros."""
    return torch.tensor([t.stride()[:3] if t is not None else (0, 0, 0) for t in tensors], dtype=torch.long)


def _forward(q, k, v, bias, q0, rel=(None, None)):
    """attention.c's forward: the output, the log-sum-exp, and q, k, v, bias and the relative
    term's (qr, rk) as the C read them."""
    extra = [t for t in (bias, *rel) if t is not None]
    if not _fits_kernel(q, k, v, *extra):
        raise RuntimeError("Attention takes fp32 CPU tensors outside autocast (use native.attention)")
    lib = require("attention")
    q, k, v = _rows(q), _rows(k), _rows(v)
    bias = None if bias is None else _rows(bias)
    qr, rk = (None if t is None else _rows(t) for t in rel)
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    out = _head_major(B, H, Tq, D)
    lse = torch.empty(B, H, Tq, dtype=torch.float32)  # log-sum-exp of each row's scores
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, lib.attention_scratch(Tk, D, 0, qr is not None), dtype=torch.float32)
    st = _strides(q, k, v, bias, out, None, None, None, None, qr, rk)
    lib.attention_forward(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        _ptr(bias),
        _ptr(qr),
        _ptr(rk),
        out.data_ptr(),
        lse.data_ptr(),
        st.data_ptr(),
        B,
        H,
        Tq,
        Tk,
        D,
        q0,
        D**-0.5,
        scratch.data_ptr(),
        threads,
    )
    return out, lse, (q, k, v, bias, qr, rk)


def _backward(q0, q, k, v, bias, out, lse, d_out, d_q, d_k, d_v, want_bias_grad: bool, rel=(None, None)):
    """attention.c's backward into d_q, d_k, d_v (any (B, H, T, D) views); the bias's gradient;
    with a relative term (qr, rk), also qr's gradient and rk's per batch row, (B, H, Tk, D)."""
    lib = load("attention")
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    d_out = _rows(d_out)
    d_s = torch.empty(B, H, Tq, Tk, dtype=torch.float32) if want_bias_grad else None  # the bias's gradient
    qr, rk = rel
    d_qr = None if qr is None else torch.empty(B, H, Tq, D, dtype=torch.float32)
    d_rk = None if qr is None else torch.empty(B, H, Tk, D, dtype=torch.float32)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, lib.attention_scratch(Tk, D, 1, qr is not None), dtype=torch.float32)
    st = _strides(q, k, v, bias, out, d_out, d_q, d_k, d_v, qr, rk, d_qr, d_rk)
    lib.attention_backward(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        _ptr(bias),
        _ptr(qr),
        _ptr(rk),
        out.data_ptr(),
        d_out.data_ptr(),
        d_q.data_ptr(),
        d_k.data_ptr(),
        d_v.data_ptr(),
        _ptr(d_qr),
        _ptr(d_rk),
        lse.data_ptr(),
        _ptr(d_s),
        st.data_ptr(),
        B,
        H,
        Tq,
        Tk,
        D,
        q0,
        D**-0.5,
        scratch.data_ptr(),
        threads,
    )
    return d_s if qr is None else (d_s, d_qr, d_rk)


class Attention(torch.autograd.Function):
    """Causal attention, optionally biased, forward and backward in attention.c. The backward
    recomputes the probabilities from the saved log-sum-exp, so nothing (T, T) is kept."""

    @staticmethod
    def forward(ctx, q, k, v, bias, q0):
        out, lse, read = _forward(q, k, v, bias, q0)
        ctx.save_for_backward(*read[:4], out, lse)
        ctx.q0 = q0
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        d_q, d_k, d_v = _grads_of(q, k)
        d_s = _backward(ctx.q0, q, k, v, bias, out, lse, d_out, d_q, d_k, d_v, ctx.needs_input_grad[3])
        return d_q, d_k, d_v, d_s, None


class PackedAttention(torch.autograd.Function):
    """Attention over qkv_views(qkv, H), with the gradient of qkv written in place as one tensor."""

    @staticmethod
    def forward(ctx, qkv, bias, H):
        out, lse, (_, _, _, bias, _, _) = _forward(*qkv_views(qkv, H), bias, 0)
        ctx.save_for_backward(qkv, bias, out, lse)
        ctx.H = H
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        qkv, bias, out, lse = ctx.saved_tensors
        d_qkv = torch.empty_like(qkv)
        d_s = _backward(
            0, *qkv_views(qkv, ctx.H), bias, out, lse, d_out, *qkv_views(d_qkv, ctx.H), ctx.needs_input_grad[1]
        )
        return d_qkv, d_s, None


def attention_applies(q, k, v) -> bool:
    """Whether attention.c can take these q, k, v at all (fp32 on a CPU outside autocast, a head
    dim it tiles, the kernel built): a cheap check before preparing its other inputs."""
    return _applies("attention", q.size(-1), q, k, v)


def relative_attention(q, k, v, qr, rk) -> Optional[torch.Tensor]:
    """softmax((q.k + qr.rk[i - j]) / sqrt(d), future masked) v through attention.c: a relative
    term whose (T, T) scores are never written (Transformer-XL's position term). Queries are
    the last Tq of the Tk positions; rk is (H, Tk, D), row d for distance d. None where the
    kernel does not apply."""
    B, H, Tq, D = q.shape
    Tk = k.size(2)
    shaped = k.shape == v.shape == (B, H, Tk, D) and Tq <= Tk and qr.shape == q.shape and rk.shape == (H, Tk, D)
    if not shaped or not _applies("attention", D, q, k, v, qr, rk):
        return None
    return RelativeAttention.apply(q, k, v, qr, rk)


class RelativeAttention(torch.autograd.Function):
    """Causal attention with a relative term, forward and backward in attention.c."""

    @staticmethod
    def forward(ctx, q, k, v, qr, rk):
        q0 = k.size(2) - q.size(2)
        out, lse, (q, k, v, _, qr, rk) = _forward(q, k, v, None, q0, (qr, rk.expand(q.size(0), *rk.shape)))
        ctx.save_for_backward(q, k, v, qr, rk, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, qr, rk, out, lse = ctx.saved_tensors
        d_q, d_k, d_v = _grads_of(q, k)
        _, d_qr, d_rk = _backward(k.size(2) - q.size(2), q, k, v, None, out, lse, d_out, d_q, d_k, d_v, False, (qr, rk))
        return d_q, d_k, d_v, d_qr, d_rk.sum(0)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()
