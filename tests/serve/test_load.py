"""A bounded load test on loopback (marker ``load``): ``scripts/load_test.py``'s clients against a real
``dgemma serve`` serving the tiny text model with the default 4 job slots.

32 concurrent streaming clients for ``DGEMMA_LOAD_SECONDS`` (default 60) measured seconds after a
5 s warm-up (98 s in all on the shared 2-core machine, so it is marked ``slow`` too unless set to
30 s or less), a tenth of them leaving every stream after its first chunk, malformed and
oversized bodies interleaved. Asserted: no problem seen by the clients (every status expected,
every error in OpenAI's shape, every 429 with ``Retry-After``, every stream ending in ``[DONE]``),
the server alive, no job left running and none failed, no thread left behind once idle, RSS
growth under 10% after the warm-up. It prints p50/p99 time to first chunk and tokens/s.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="the server needs fastapi and uvicorn")
httpx = pytest.importorskip("httpx", reason="the load test needs httpx")
psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("DGEMMA_LOAD_SECONDS", "60"))
CLIENTS = int(os.environ.get("DGEMMA_LOAD_CLIENTS", "32"))

WARMUP = 5.0
# SECONDS + 20 to 40 s in all (start, warm-up, the idle wait of the thread check): 98 s at the default
# 60 on the shared 2-core machine, so `slow` too unless DGEMMA_LOAD_SECONDS is cut to 30 or less
pytestmark = [pytest.mark.load] + ([pytest.mark.slow] if SECONDS > 30 else [])


def _load_script():
    spec = importlib.util.spec_from_file_location("load_test", REPO / "scripts" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_serve_under_load(serve_process, tiny_text_model):
    load = _load_script()
    server = serve_process("--text-model", str(tiny_text_model), "--sudoku-checkpoint", "none")
    try:
        proc = psutil.Process(server.proc.pid)
        model = "tiny_text"
        httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "steps": 1},
                   timeout=120).raise_for_status()  # loads the model
        idle_threads = proc.num_threads()
        load_avg = os.getloadavg()[0]
        report = asyncio.run(load.run_load(server.url, model=model, clients=CLIENTS, seconds=SECONDS, warmup=WARMUP,
                                           max_tokens=64, leave_max_tokens=96, probe=load.process_probe(proc.pid)))
        s = report.summary()
        print(f"\nload: {CLIENTS} clients, {s['seconds']} s measured: ttfc p50 {s['ttfc_p50_s']} s, p99 "
              f"{s['ttfc_p99_s']} s; {s['tokens_per_second']} tokens/s ({s['tokens']} tokens in {s['streams']} "
              f"streams); {s['disconnects']} disconnects, {s['refused_429']} x 429, {s['malformed_400']} x 400, "
              f"{s['oversized_413']} x 413; server RSS {s['rss_mib_warm']} -> {s['rss_mib_end']} MiB, threads "
              f"{s['threads_warm']} -> {s['threads_end']} (idle {idle_threads}); jobs {s['jobs']}; load average "
              f"{load_avg:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        assert not report.problems, report.problems[:10]
        assert server.proc.poll() is None  # alive
        assert report.streams > 0 and report.disconnects > 0 and report.refused > 0
        assert report.malformed > 0 and report.oversized > 0
        jobs = s["jobs"]
        assert jobs["failed"] == 0 and jobs["started"] == jobs["done"] + jobs["cancelled"]
        assert jobs["cancelled"] >= 1  # leavers' jobs; one that finished before its disconnect arrived is done
        assert s["rss_mib_end"] < 1.10 * s["rss_mib_warm"], "RSS grew by 10% or more after the warm-up"
        # the sampling pool keeps its 4 threads; the helper threads of run_in_threadpool (anyio's,
        # up to 40 under load) are pruned by the next call once they have idled 10 s
        time.sleep(11)
        httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "steps": 1},
                   timeout=60).raise_for_status()
        assert proc.num_threads() <= idle_threads + 4 + 2, f"{proc.num_threads()} threads, {idle_threads} before"
    finally:
        server.stop()
