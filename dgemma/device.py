"""Which floating-point type to compute in, decided from the hardware at run time.

bf16 pays on a CPU only where it has native bf16 matrix instructions (Intel AMX-BF16, the
AVX512-BF16 of Intel Cooper Lake+ and AMD Zen 4+, Arm's BF16 extension). Elsewhere oneDNN
emulates it and it is slower than fp32, so ``"auto"`` never assumes it: it reads the
processor's flags. On CUDA, ``"auto"`` is bf16 where the GPU supports it (Ampere and later).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

from dgemma.errors import DGemmaError

DTYPE_NAMES = ("auto", "float32", "bfloat16")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # Linux /proc/cpuinfo names


def linux_cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 | arm64
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_bf16_features() -> tuple[str, ...]:
    """The native bf16 matrix features of this CPU (empty: none)."""
    system = platform.system()
    if system == "Linux":
        flags = linux_cpu_flags()
        found = [f for f in CPU_BF16_FLAGS if f in flags]
        if "bf16" in flags and platform.machine() in ("aarch64", "arm64"):
            found.append("arm_bf16")
        return tuple(found)
    if system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ()
        return ("arm_bf16",) if out == "1" else ()
    return ()


def bf16_native(device: torch.device | str) -> bool:
    """Whether bf16 matrix work is native (faster than fp32) on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(cpu_bf16_features())
    return False


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``"auto" | "float32" | "bfloat16"`` -> the torch dtype to compute in on ``device``."""
    if name not in DTYPE_NAMES:
        raise DGemmaError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {name!r}")
    if name == "auto":
        return torch.bfloat16 if bf16_native(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def describe(device: torch.device | str) -> str:
    """One line for logs and result files: the device and why ``auto`` chose what it chose."""
    device = torch.device(device)
    if device.type == "cpu":
        feats = cpu_bf16_features()
        return f"cpu ({', '.join(feats) if feats else 'no native bf16'})"
    return str(device)


@functools.cache
def _glibc():
    """The C library when it is glibc on Linux (it has ``malloc_trim``), else None."""
    if platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim  # noqa: B018 (musl and others lack it)
    except (OSError, AttributeError):
        return None
    return lib


def release_free_heap() -> bool:
    """Hand the memory glibc's ``malloc`` holds in freed heap chunks back to the OS (``malloc_trim(0)``).

    A CPU training step allocates and frees activations of a different size at every step (the
    prompts are trimmed to each batch's longest), and glibc keeps the freed chunks for reuse:
    without jemalloc, a PubMedQA LoRA run's resident memory grew by ~0.85 GiB a step, to 21.6 GiB
    at step 90, and the kernel killed it. Trimming after each step costs milliseconds. Returns
    whether anything was released (False where the C library is not glibc).
    """
    lib = _glibc()
    return bool(lib is not None and lib.malloc_trim(0))


HEAP_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_heap() -> bool:
    """Let glibc serve big tensors from its heap and keep them there once freed (decoding only).

    A denoising pass allocates and frees vocabulary-sized tensors (at batch 16 on Gemma 3 270M,
    ~270 MB of canvas logits, the LM head's rows, their probabilities). Above its mmap threshold
    (at most 32 MB by default) glibc maps each one fresh and unmaps it on free, so every pass
    faults in hundreds of MB of zeroed pages. With the threshold and the trim threshold at 1 GiB
    the pages stay mapped and are reused: on the 2-core AMX Xeon (bf16, the PubMedQA adapter, 16
    questions at batch 16, 16 steps) a pass took 42 ms a row instead of 54, for 3.3-3.4 GiB
    resident instead of 1.7; batch 1 was unchanged (``docs/benchmarks.md``, 2026-12-05). Training
    keeps the default (its activations vary in size every step: ``release_free_heap``). Called by the
    decoding commands (``dgemma/cli/main.py:DECODING_VERBS``, ``dgemma bench decode``); leaves the
    heap alone where the user set any of ``HEAP_ENV`` or the C library is not glibc. Returns
    whether it changed the policy.
    """
    lib = _glibc()
    if lib is None or any(k in os.environ for k in HEAP_ENV):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = all(lib.mallopt(k, v) == 1 for k, v in ((m_mmap_threshold, 2**30), (m_trim_threshold, 2**30),
                                                   (m_top_pad, 2**28)))
    _HEAP["kept"] = _HEAP["kept"] or ok
    return ok


def heap_policy() -> str:
    """``"kept"`` once :func:`keep_freed_heap` changed glibc's policy in this process, else ``"default"``."""
    return "kept" if _HEAP["kept"] else "default"


_HEAP = {"kept": False}


def resident_gib() -> float | None:
    """This process's resident memory (GiB) from ``/proc/self/statm``; None off Linux."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` (a GPU runs asynchronously; a CPU or None: nothing to wait
    for), so that a clock read next measures it."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))
