"""CPU training hands freed heap memory back (dgemma/device.py:release_free_heap).

glibc keeps chunks freed below the top of its heap; a training step that frees activations of a
new size each step then grows the process without bound. The test builds exactly that heap: many
64 KiB blocks (below the mmap threshold, so on the heap), written to, all freed but the topmost,
which pins the heap so that free() alone returns nothing.
"""

import ctypes
import platform

import pytest

from dgemma.device import _glibc, release_free_heap, resident_gib

glibc = pytest.mark.skipif(platform.system() != "Linux" or _glibc() is None, reason="needs glibc on Linux")


@glibc
def test_release_free_heap_returns_what_free_kept():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB blocks stay on the heap
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() itself gives nothing back
    size, n = 64 << 10, 4096  # 256 MiB
    try:
        blocks = [libc.malloc(size) for _ in range(n)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks[:-1]:
            libc.free(b)
        before = resident_gib()
        assert release_free_heap()
        after = resident_gib()
        assert before - after > 0.2  # most of the 256 MiB came back
        libc.free(blocks[-1])
    finally:
        libc.mallopt(-1, 128 << 10)  # glibc's defaults
        libc.mallopt(-3, 128 << 10)



KEEP = """
import sys, torch, dgemma
from dgemma.device import heap_policy, resident_gib
changed = dgemma.keep_freed_heap() if sys.argv[1] == "keep" else False
t = torch.ones(64 << 20)  # 256 MiB, far above glibc's default mmap threshold
del t
print(changed, heap_policy(), resident_gib())
"""


@glibc
@pytest.mark.parametrize("mode", ["keep", "default", "user_env"])
def test_keep_freed_heap_keeps_a_big_freed_tensor_mapped(mode):
    """Decoding's heap policy (dgemma/device.py:keep_freed_heap), in a process of its own: a freed
    256 MiB tensor stays resident (reused by the next pass without page faults) where the policy
    is on; by default glibc unmaps it, and a user's own MALLOC_* setting wins."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **({"MALLOC_TOP_PAD_": str(1 << 20)} if mode == "user_env" else {}))
    arg = "default" if mode == "default" else "keep"
    out = subprocess.run([sys.executable, "-c", KEEP, arg], capture_output=True, text=True, env=env, check=True)
    changed, policy, rss = out.stdout.split()
    kept = mode == "keep"
    assert (changed == "True") == kept and policy == ("kept" if kept else "default")
    base = subprocess.run([sys.executable, "-c", "import torch; from dgemma.device import resident_gib; "
                           "print(resident_gib())"], capture_output=True, text=True, env=env, check=True)
    grown = float(rss) - float(base.stdout)
    assert grown > 0.2 if kept else grown < 0.1
