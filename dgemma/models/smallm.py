"""Small-row fp32 products for CPUs with AVX2: ``smallm.c``, compiled here on first use.

Decoding multiplies a few rows (one for an AR step at batch 1, the 4-16 a denoising step reads)
by every weight of the model, so it is bound by how fast the weights stream from memory. MKL and
oneDNN reach a fraction of that on such products: on an AMD EPYC (AVX2, 2 threads) the 18
layers' seven projections took 24.5 ms for one row and 36 ms for seven with them, against 13 and
22-24 ms with this kernel, and the LM head's four rows 38 ms against 23 (``docs/benchmarks.md``,
2026-12-07, evening). :func:`smallm_linear` is ``x @ W.T`` (the projections and the LM head);
:func:`probs_embed` is ``probs @ E`` (the self-conditioning signal). Their sums are
batch-invariant (``smallm.c``): a row's result does not depend on the other rows of the call or
on the thread count. They are ordered differently from MKL's, so results differ from PyTorch's
in the last bits (about 1e-7 relative).

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
MAX_ROWS = 64  # at most this many rows of x go to the kernel (level with MKL at ~96: a prefill keeps MKL)


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
    return lib


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`smallm_linear` computes ``x [M, K] @ weight [N, K].T``: fp32 on a CPU, 1-64
    packed rows, a packed weight of the same ``K``, ``K`` a multiple of 8, and a kernel on this
    machine. Anything else (a mismatch included, which ``linear`` then reports) is not its work."""
    return (x.dim() == weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.shape[1] % 8 == 0 and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu" and x.is_contiguous() and weight.is_contiguous()
            and kernel() is not None)


def smallm_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [M, K] @ weight [N, K].T`` (fp32, CPU) through the kernel, on PyTorch's thread count.
    Check :func:`fits` first."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    kernel().smallm_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def probs_fit(probs: Tensor, weight: Tensor) -> bool:
    """Whether :func:`probs_embed` computes ``probs [M, V] @ weight [V, D]``: fp32 on a CPU, 2-64
    packed rows (oneDNN is a little faster for one), a packed weight of the same ``V``, ``D`` a
    multiple of 8, and a kernel here."""
    return (probs.dim() == weight.dim() == 2 and 2 <= probs.shape[0] <= MAX_ROWS
            and probs.shape[1] == weight.shape[0] and weight.shape[1] % 8 == 0
            and probs.dtype == weight.dtype == torch.float32 and probs.device.type == weight.device.type == "cpu"
            and probs.is_contiguous() and weight.is_contiguous() and kernel() is not None)


def probs_embed(probs: Tensor, weight: Tensor) -> Tensor:
    """``probs [M, V] @ weight [V, D]`` (fp32, CPU): the self-conditioning signal's product, each
    row of the embedding read once against every row of ``probs``. The vocabulary's fixed chunks
    are summed apart and then in order, so the result does not depend on the thread count or on
    the other rows. Check :func:`probs_fit` first."""
    m, v = probs.shape
    d = weight.shape[1]
    lib = kernel()
    part = torch.empty(lib.smallm_probs_chunks(v), m, d, dtype=probs.dtype)
    y = torch.empty(m, d, dtype=probs.dtype)
    lib.smallm_probs_embed(probs.data_ptr(), weight.data_ptr(), y.data_ptr(), part.data_ptr(), m, v, d,
                           torch.get_num_threads())
    return y
