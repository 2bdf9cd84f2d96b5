"""Small-row products for decoding on a CPU: ``smallm.c``, compiled here on first use.

Decoding multiplies a few rows (one for an AR step at batch 1, the 4-16 a denoising step reads)
by every weight of the model, so it is bound by how fast the weights stream from memory. MKL and
oneDNN reach a fraction of that on such products: on an AMD EPYC (AVX2, 2 threads) the 18
layers' seven projections took 24.5 ms for one row and 36 ms for seven with them, against 13 and
22-24 ms with this kernel, and the LM head's four rows 38 ms against 23 (``docs/benchmarks.md``,
2026-12-07, evening). :func:`smallm_linear` is ``x @ W.T`` (the projections and the LM head) in
fp32 on CPUs with AVX2 and FMA, and in bf16 on CPUs with AVX512-BF16 (an AMD EPYC of that kind:
the 18 layers' projections for 1 / 16 / 32 rows in 20 / 20 / 30 ms against PyTorch's 27 / 39 / 39,
the LM head in 18 / 22 / 41 against 28 / 32 / 47; level at 64 rows, so bf16 stops at 32).
:func:`probs_embed` is ``probs @ E`` (the self-conditioning signal; in bf16 18 / 32 ms for 1 / 16
rows against PyTorch's 30 / 42). Their sums are
batch-invariant (``smallm.c``): a row's result does not depend on the other rows of the call or
on the thread count. They are ordered differently from MKL's, so results differ from PyTorch's
in the last bits (about 1e-7 relative in fp32; in bf16, at most one rounding step of the output).

The shared library is built once per source version with the C compiler (``$CC``, else ``cc``)
into ``cache_root()/kernels`` (about a second) and loaded with ``ctypes``. Where that cannot
happen (not Linux on an x86-64 with AVX2 and FMA, no C compiler) or ``DGEMMA_SMALLM=0`` is set,
:func:`kernel` is None and callers keep PyTorch's products; a failed build says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from dgemma.device import linux_cpu_flags

SOURCE = Path(__file__).with_name("smallm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS = 64  # at most this many fp32 rows of x go to the kernel (level with MKL at ~96: a prefill keeps MKL)
MAX_ROWS_BF16 = 32  # bf16: level with oneDNN at ~64
SIGNAL_ROWS_BF16 = 24  # bf16 probs @ E: level with oneDNN at ~28
BF16_FLAGS = {"avx512f", "avx512bw", "avx512_bf16"}


def supported() -> bool:
    """x86-64 with AVX2 and FMA, on Linux (where the flags can be read), and not switched off."""
    if os.environ.get("DGEMMA_SMALLM", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return {"avx2", "fma"} <= linux_cpu_flags()


def build(out_dir: Path) -> Path:
    """Compile ``smallm.c`` into ``out_dir`` (named by a hash of the source and flags; an existing
    build is reused) and return the library's path. Raises ``RuntimeError`` with the compiler's
    message when it fails."""
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = out_dir / f"smallm-{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then renamed: no half-written library
        part = Path(tmp) / lib.name
        cmd = [os.environ.get("CC", "cc"), *FLAGS, str(SOURCE), "-o", str(part)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"{' '.join(cmd)}: {e}") from e
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(part, lib)
    return lib


@functools.cache
def kernel():
    """The compiled library (``ctypes``: ``smallm_linear``, ``smallm_probs_embed``), or None where it
    cannot run here."""
    if not supported():
        return None
    from dgemma.models.pretrained import cache_root  # (pretrained imports the model, which imports this)

    try:
        lib = ctypes.CDLL(str(build(cache_root() / "kernels")))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"dgemma: the small-row CPU kernel is unavailable, decoding keeps PyTorch's products ({e})",
                      stacklevel=2)
        return None
    ptr, n = ctypes.c_void_p, ctypes.c_long
    lib.smallm_linear.argtypes = [ptr] * 3 + [n] * 3 + [ctypes.c_int]
    lib.smallm_probs_embed.argtypes = [ptr] * 4 + [n] * 3 + [ctypes.c_int]
    lib.smallm_probs_chunks.argtypes = [n]
    lib.smallm_probs_chunks.restype = n
    lib.smallm_linear.restype = lib.smallm_probs_embed.restype = None
    if hasattr(lib, "smallm_linear_bf16"):  # (a compiler older than AVX512-BF16 leaves them out)
        lib.smallm_linear_bf16.argtypes = lib.smallm_linear.argtypes
        lib.smallm_probs_embed_bf16.argtypes = lib.smallm_probs_embed.argtypes
        lib.smallm_linear_bf16.restype = lib.smallm_probs_embed_bf16.restype = None
    return lib


@functools.cache
def bf16_kernel() -> bool:
    """Whether :func:`smallm_linear` takes bf16 here: the library has it and the CPU has AVX512-BF16."""
    return BF16_FLAGS <= linux_cpu_flags() and kernel() is not None and hasattr(kernel(), "smallm_linear_bf16")


def takes(rows: int, weight: Tensor) -> bool:
    """Whether ``rows`` rows against ``weight`` are the kernel's size here (fp32: 1-64, bf16: 1-32)."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:
        return 1 <= rows <= MAX_ROWS and kernel() is not None
    return weight.dtype == torch.bfloat16 and 1 <= rows <= MAX_ROWS_BF16 and bf16_kernel()


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`smallm_linear` computes ``x [M, K] @ weight [N, K].T``: on a CPU, both fp32 (1-64
    rows, ``K`` a multiple of 8) or both bf16 (1-32 rows, ``K`` a multiple of 32), packed, the same
    ``K``, and a kernel for that dtype on this machine. Anything else (a mismatch included, which
    ``linear`` then reports) is not its work."""
    return (x.dim() == weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.dtype == weight.dtype
            and x.shape[1] % (8 if x.dtype == torch.float32 else 32) == 0 and x.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous() and takes(x.shape[0], weight))


def smallm_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [M, K] @ weight [N, K].T`` (fp32 or bf16, CPU; bf16 accumulates in fp32 and rounds once)
    through the kernel, on PyTorch's thread count. Check :func:`fits` first."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    lib = kernel()
    run = lib.smallm_linear if x.dtype == torch.float32 else lib.smallm_linear_bf16
    run(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def probs_fit(probs: Tensor, weight: Tensor) -> bool:
    """Whether :func:`probs_embed` computes ``probs [M, V] @ weight [V, D]``: on a CPU, both fp32
    (2-64 packed rows: oneDNN is a little faster for one; ``D`` a multiple of 8) or both bf16 (1-24
    rows, ``D`` a multiple of 32, AVX512-BF16), a packed weight of the same ``V``, and a kernel here."""
    if not (probs.dim() == weight.dim() == 2 and probs.shape[1] == weight.shape[0] and probs.dtype == weight.dtype
            and probs.device.type == weight.device.type == "cpu" and probs.is_contiguous()
            and weight.is_contiguous()):
        return False
    if probs.dtype == torch.float32:
        return 2 <= probs.shape[0] <= MAX_ROWS and weight.shape[1] % 8 == 0 and kernel() is not None
    return (probs.dtype == torch.bfloat16 and 1 <= probs.shape[0] <= SIGNAL_ROWS_BF16 and weight.shape[1] % 32 == 0
            and bf16_kernel())


def probs_embed(probs: Tensor, weight: Tensor) -> Tensor:
    """``probs [M, V] @ weight [V, D]`` (fp32 or bf16, CPU; fp32 sums, rounded once for bf16): the
    self-conditioning signal's product, each row of the embedding read once against every row of
    ``probs``. The vocabulary's fixed chunks are summed apart and then in order, so the result does
    not depend on the thread count or on the other rows. Check :func:`probs_fit` first."""
    m, v = probs.shape
    d = weight.shape[1]
    lib = kernel()
    part = torch.empty(lib.smallm_probs_chunks(v), m, d, dtype=torch.float32)
    y = torch.empty(m, d, dtype=probs.dtype)
    run = lib.smallm_probs_embed if probs.dtype == torch.float32 else lib.smallm_probs_embed_bf16
    run(probs.data_ptr(), weight.data_ptr(), y.data_ptr(), part.data_ptr(), m, v, d, torch.get_num_threads())
    return y
