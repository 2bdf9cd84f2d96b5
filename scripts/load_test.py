#!/usr/bin/env python3
"""A bounded load test of a running ``dgemma serve``'s OpenAI API, on loopback or anywhere.

Usage::

    python scripts/load_test.py --url http://127.0.0.1:8000 [--model NAME] [--clients 32] [--seconds 60]
        [--prompt TEXT] [--max-tokens 64] [--steps 16] [--leave-max-tokens N] [--pid PID]

``--clients`` concurrent clients send streaming ``/v1/completions`` requests back to back for
``--seconds``. A tenth of them (at least one) leave every stream after its first chunk (a
disconnect mid-stream, which must cancel the job); every client sends a malformed body (broken
JSON) or an oversized one (past the 1 MiB limit) instead of every fifth request, and expects a
400 or 413 in OpenAI's error shape. A 429 must carry ``Retry-After``; the client then waits a
jittered fraction of it. The first ``--warmup`` seconds are not measured. It prints
time to first chunk (the first committed canvas) at p50 and p99, output tokens per second
(all completed streams together) and every count, and exits 1 on a problem: an unexpected
status, a stream without ``[DONE]``, a 429 without ``Retry-After``, or jobs still running
afterwards (``GET /api/status``). With ``--pid`` (the server's process id) it also reports
the server's RSS and thread count after the warm-up and at the end.

``tests/serve/test_load.py`` runs :func:`run_load` against a ``dgemma serve`` it starts.
Needs httpx (and psutil for ``--pid``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Report:
    seconds: float = 0.0  # the measured window (after the warm-up)
    streams: int = 0  # completed streams
    disconnects: int = 0  # streams left after their first chunk
    refused: int = 0  # 429s (each with Retry-After), warm-up included
    malformed: int = 0  # broken-JSON bodies answered 400, warm-up included
    oversized: int = 0  # bodies over the limit answered 413, warm-up included
    tokens: int = 0  # output tokens of the completed streams (their usage chunks)
    ttfc: list[float] = field(default_factory=list)  # seconds to the first chunk, every accepted stream
    problems: list[str] = field(default_factory=list)
    server: dict = field(default_factory=dict)  # what the probe saw: rss and threads after warm-up and at the end

    def percentile(self, q: float) -> float | None:
        if not self.ttfc:
            return None
        xs = sorted(self.ttfc)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        p50, p99 = self.percentile(0.5), self.percentile(0.99)
        return {"seconds": round(self.seconds, 1), "streams": self.streams, "disconnects": self.disconnects,
                "refused_429": self.refused, "malformed_400": self.malformed, "oversized_413": self.oversized,
                "tokens": self.tokens, "tokens_per_second": round(self.tokens_per_second, 1),
                "ttfc_p50_s": None if p50 is None else round(p50, 3),
                "ttfc_p99_s": None if p99 is None else round(p99, 3),
                "problems": len(self.problems), **self.server}


def _openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


async def _client(k: int, url: str, body: dict, report: Report, *, warm: float, end: float, leaves: bool,
                  body_limit: int, leave_max_tokens: int | None) -> None:
    rnd = random.Random(k)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        n = 0
        while time.monotonic() < end:
            n += 1
            measured = time.monotonic() >= warm
            if n % 5 == 0:  # a bad body instead of every fifth request
                broken = (n // 5 + k) % 2 == 1  # alternately broken JSON and oversized (odd clients start broken)
                oversized = b'{"prompt": "' + b"x" * (body_limit + 1024) + b'"}'
                content = b'{"model": "x", "prompt": ' if broken else oversized
                r = await http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
                expected = 400 if broken else 413
                if r.status_code != expected or not _openai_error(r):
                    report.problems.append(f"a {'broken' if broken else 'oversized'} body got {r.status_code}: "
                                           f"{r.text[:200]}")
                elif broken:  # refusals are counted from the start: they are checks, not measurements
                    report.malformed += 1
                else:
                    report.oversized += 1
                continue
            t0 = time.monotonic()
            req = {**body, "seed": rnd.randrange(2**31)}
            if leaves and leave_max_tokens:
                req["max_tokens"] = leave_max_tokens
            async with http.stream("POST", "/v1/completions", json=req) as r:
                if r.status_code == 429:
                    wait = r.headers.get("retry-after")
                    if not (wait and wait.isdigit()):
                        report.problems.append(f"a 429 without Retry-After: {dict(r.headers)}")
                        wait = "1"
                    report.refused += 1
                    await asyncio.sleep(int(wait) * rnd.uniform(0.2, 1.0))
                    continue
                if r.status_code != 200:
                    report.problems.append(f"a stream got {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                first, done, tokens = None, False, 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        report.problems.append(f"an error event: {chunk['error']}")
                        break
                    if chunk.get("choices") and first is None:
                        first = time.monotonic() - t0
                        if leaves:
                            break  # leave mid-stream: closing the response drops the connection
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            if first is not None and measured:
                report.ttfc.append(first)
            if leaves:
                report.disconnects += int(measured and first is not None)
            elif not done:
                report.problems.append("a stream ended without data: [DONE]")
            elif measured and time.monotonic() <= end:
                report.streams += 1
                report.tokens += tokens


async def run_load(url: str, *, model: str, clients: int = 32, seconds: float = 60.0, warmup: float = 10.0,
                   prompt: str = "The capital of France is", max_tokens: int = 64, steps: int = 16,
                   leave_max_tokens: int | None = None, body_limit: int = 1 << 20, probe=None) -> Report:
    """Run the load described in the module docstring against ``url``; ``probe()`` (optional)
    returns a dict of server figures, taken after the warm-up (keys suffixed ``_warm``) and at
    the end (``_end``). ``leave_max_tokens`` (default ``max_tokens``) sizes the requests of the
    clients that leave: more canvases after the first make it likelier that the job is still
    sampling when the disconnect arrives (one that ends first counts as done, not cancelled)."""
    report = Report()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "steps": steps}
    start = time.monotonic()
    warm, end = start + warmup, start + warmup + seconds
    leavers = max(1, clients // 10)

    async def probe_after_warmup():
        await asyncio.sleep(warmup)
        if probe is not None:
            report.server.update({f"{k}_warm": v for k, v in probe().items()})

    tasks = [asyncio.create_task(_client(k, url, body, report, warm=warm, end=end, leaves=k < leavers,
                                         body_limit=body_limit, leave_max_tokens=leave_max_tokens))
             for k in range(clients)]
    await asyncio.gather(probe_after_warmup(), *tasks)
    report.seconds = min(time.monotonic(), end) - warm
    if probe is not None:
        report.server.update({f"{k}_end": v for k, v in probe().items()})
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:  # every job must end
        deadline = time.monotonic() + 30
        while (status := (await http.get("/api/status")).json())["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    if status["running"]:
        report.problems.append(f"{status['running']} jobs still running 30 s after the load")
    if status["failed"]:
        report.problems.append(f"{status['failed']} jobs failed")
    report.server["jobs"] = {k: status[k] for k in ("started", "done", "cancelled", "failed")}
    return report


def process_probe(pid: int):
    """RSS (MiB) and thread count of a process (psutil)."""
    import psutil

    proc = psutil.Process(pid)
    return lambda: {"rss_mib": round(proc.memory_info().rss / 2**20, 1), "threads": proc.num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="a model id of GET /v1/models (default: the first)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds, after the warm-up")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=16, help="denoising steps per canvas")
    p.add_argument("--leave-max-tokens", type=int, help="max_tokens of the clients that leave (default --max-tokens)")
    p.add_argument("--pid", type=int, help="the server's process id: report its RSS and threads")
    args = p.parse_args(argv)
    url = args.url.rstrip("/")
    model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": args.prompt, "max_tokens": 1,
                                              "steps": 1}, timeout=300)  # loads the model before the clock starts
    report = asyncio.run(run_load(url, model=model, clients=args.clients, seconds=args.seconds, warmup=args.warmup,
                                  prompt=args.prompt, max_tokens=args.max_tokens, steps=args.steps,
                                  leave_max_tokens=args.leave_max_tokens,
                                  probe=process_probe(args.pid) if args.pid else None))
    print(json.dumps(report.summary(), indent=2))
    for problem in report.problems[:20]:
        print("problem:", problem, file=sys.stderr)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
