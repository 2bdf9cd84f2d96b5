"""The serving core both front ends share: models, jobs, limits, streams and sampling work.

:class:`ModelSlot` loads a model (a training run or a pretrained base) on first use into an
:class:`Engine`; :class:`Jobs` is the bounded pool of sampling jobs (429 with ``Retry-After``
when full); :func:`stream_job` and :func:`run_job` run a job's sampler in a worker thread and
hand its events to the event loop; :func:`make_plan` turns request parameters into sampler
settings, validated against :class:`Limits`. The playground routes (``dgemma/serve/app.py``) and
the OpenAI-compatible routes (``dgemma/serve/openai_api.py``) are built on this module and
import nothing from each other but the app factory's mounting of the second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from dgemma.data.chat import render_prompt
from dgemma.data.sudoku import count_clues, grid_error
from dgemma.device import resolve_dtype
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.sampler import pin_prefix
from dgemma.diffusion.schedules import get_schedule
from dgemma.diffusion.steps import STEPS
from dgemma.diffusion.stopping import STOPPING
from dgemma.errors import DGemmaError
from dgemma.eval.sudoku_verify import DEFAULT_VARIANTS, round_steps, solve_verified
from dgemma.eval.visualize import Frame, sudoku_cells, token_piece
from dgemma.models.pretrained import load_pretrained
from dgemma.sampling import (SamplerConfig, build_rules, build_sampler, eval_settings, interactive_cfg, max_canvases,
                             resolve_prefix)
from dgemma.tasks import get_task, response_stop_ids
from dgemma.tasks.sudoku import extract_digits
from dgemma.training.config import load_config
from dgemma.training.runs import load_run
from dgemma.training.trainer import derive_seed

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PRETRAINED = "gemma3-270m"
HEARTBEAT_S = 2.0  # an SSE comment while a step takes longer, so a dead client is noticed
SUDOKU_HINT = ("train one with `dgemma train --cfg=configs/sudoku_small.py --cfg.workdir=runs/sudoku_small` "
               "and pass --sudoku-checkpoint runs/sudoku_small (or any Sudoku workdir)")


@dataclass
class Limits:
    """What one request may ask for; every refusal message quotes the limit it hit."""

    max_steps: int = 512  # denoising steps per canvas
    max_canvases: int = 16  # text canvases per request
    max_prompt_tokens: int = 1024  # text prompts of a pretrained model (a run uses its data.prompt_len)
    max_prompt_chars: int = 32_000  # refused before tokenising
    max_delay_ms: int = 2000  # the slow-motion delay per step
    max_jobs: int = 4  # sampling requests running at once
    max_body_bytes: int = 1 << 20
    max_choices: int = 8  # the OpenAI API's n


class Cancelled(Exception):
    """Raised inside the sampler's ``on_step`` hook when the job's client has gone."""


class ServeError(DGemmaError):
    """A refusal with its HTTP status, raised by the helpers both APIs share and answered in the
    shape of the route's API (:func:`error_response`). ``param`` and ``code`` fill OpenAI's
    error fields; ``headers`` go on the response (``Retry-After``)."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


OPENAI_PREFIX = "/v1/"
OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(path: str, message: str, status: int = 400, *, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An error in the shape of the API ``path`` belongs to: OpenAI's under ``/v1/``, the
    playground's ``{"error": message}`` elsewhere."""
    body = openai_error(message, status, param, code) if path.startswith(OPENAI_PREFIX) else {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


# ----------------------------------------------------------------------------------- models
UNTRAINED_WARNING = ("an unadapted base model: its diffusion modules are untrained, so its denoised text is not "
                     "what an adapted model writes (train one with configs/sft_pubmedqa_cpu.py)")


@dataclass
class ModelInfo:
    """What the page needs to know about a model, readable without loading its weights."""

    source: str
    kind: str  # "run" (a training workdir) or "pretrained" (gemma3-270m, a HF folder, a .gguf)
    process: str  # "absorbing" or "uniform"
    canvas_size: int
    max_canvases: int  # the default canvas count of a text request
    prompt_len: int  # the longest prompt accepted, in tokens
    max_positions: int
    defaults: dict
    entropy_threshold: float = 0.05
    task: str | None = None
    cfg: Any = None  # a run's Config (None for a pretrained model)
    examples: list = field(default_factory=list)  # a run's examples.jsonl: held-out prompts to try

    @property
    def step_types(self) -> list[str]:
        return [s for s, rule in STEPS.items() if not rule.needs_uniform or self.process == "uniform"]

    def as_dict(self) -> dict:
        return {"source": self.source, "kind": self.kind, "process": self.process, "canvas_size": self.canvas_size,
                "max_canvases": self.max_canvases, "prompt_len": self.prompt_len, "task": self.task,
                "pin_clues": bool(self.cfg is not None and getattr(self.cfg.data, "pin_clues", False)),
                "step_types": self.step_types, "defaults": self.defaults, "examples": self.examples,
                "warning": UNTRAINED_WARNING if self.kind == "pretrained" else None}


@dataclass
class Engine:
    """A loaded model ready to sample."""

    info: ModelInfo
    model: Any
    tokenizer: Any
    noise: Any

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return response_stop_ids(self.tokenizer)


def _run_info(workdir: Path, cfg, limits: Limits) -> ModelInfo:
    e = cfg.eval_ds  # interactive_cfg's
    defaults = {"step_type": e.step_type if e.step_type in STEPS else "commit",
                "num_steps": min(e.steps[0], limits.max_steps),
                "temperature": e.temperature, "early_stopping": e.early_stopping or "none",
                "threshold": e.confidence_threshold,
                # the page's switch: None where the model has no self-conditioning block
                "self_condition": bool(e.self_condition) if cfg.model.self_conditioning else None,
                "no_repeat": bool(e.commit_no_repeat)}  # the commit step's (the Text panel's switch)
    max_pos = cfg.model.max_position_embeddings
    return ModelInfo(str(workdir), "run", cfg.diffusion.process, cfg.diffusion.canvas_size,
                     min(max_canvases(cfg), limits.max_canvases), cfg.data.prompt_len, max_pos, defaults,
                     e.entropy_threshold, cfg.data.task, cfg, read_examples(workdir))


def read_examples(workdir: Path, limit: int = 20) -> list[dict]:
    """``workdir/examples.jsonl``: held-out prompts shipped with a model (``{"prompt", "system"?,
    "id"?, "label"?}`` per line), offered by the page; an unreadable line is skipped."""
    path = Path(workdir) / "examples.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                out.append({k: rec[k] for k in ("id", "system", "prompt", "label") if k in rec})
            if len(out) == limit:
                break
    return out


def _pretrained_info(source: str, limits: Limits, max_positions: int = 32_768) -> ModelInfo:
    defaults = {"step_type": "confidence", "num_steps": 32, "temperature": 0.0, "early_stopping": "none",
                "threshold": 0.9, "self_condition": None,  # load_pretrained builds no self-conditioning block
                "no_repeat": False}
    return ModelInfo(source, "pretrained", "uniform", 32, 4, limits.max_prompt_tokens, max_positions, defaults)


def is_run(source) -> bool:
    """A training workdir: ``config.json`` and ``checkpoints/`` (a Hugging Face folder has a
    ``config.json`` too, but weights beside it instead of checkpoints)."""
    p = Path(source)
    return (p / "config.json").is_file() and ((p / "checkpoints").is_dir() or not any(p.glob("*.safetensors")))


class ModelSlot:
    """One panel's model: described from its source at once, loaded (once) on first use.

    ``source`` is a training workdir, ``"gemma3-270m"``, a Hugging Face Gemma 3 folder or a
    ``.gguf``; ``engine`` hands over a model already built (tests). Loading is serialised by a
    lock, so concurrent first requests load it once.
    """

    def __init__(self, role: str, source: str | Path | None, *, limits: Limits, device: str | None = None,
                 engine: Engine | None = None, hint: str = "", dtype: str = "auto"):
        self.role, self.limits, self.device, self.hint, self.dtype = role, limits, device, hint, dtype
        self.source = None if source is None else str(source)
        self._engine = engine
        self._info: ModelInfo | None = engine.info if engine else None
        self._lock = threading.Lock()
        self.load_error: str | None = None
        self.load_seconds: float | None = None

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def info(self) -> ModelInfo:
        """The model's description; DGemmaError when there is no usable source."""
        if self._info is not None:
            return self._info
        if self.source is None:
            raise DGemmaError(f"no {self.role} model is configured" + (f": {self.hint}" if self.hint else ""))
        src = Path(self.source)
        if is_run(src):
            self._info = _run_info(src, interactive_cfg(load_config(src / "config.json")), self.limits)
        elif self.source == PRETRAINED or src.exists():
            self._info = _pretrained_info(self.source, self.limits)
        else:
            raise DGemmaError(f"no {self.role} model at {self.source}" + (f": {self.hint}" if self.hint else ""))
        return self._info

    def describe(self) -> dict:
        try:
            info = self.info().as_dict()
            error = self.load_error
        except DGemmaError as e:
            info, error = {"source": self.source}, str(e)
        return {"role": self.role, "available": error is None or self.loaded, "loaded": self.loaded,
                "error": error, **info}

    def get(self) -> Engine:
        """The loaded engine (blocking; call from a worker thread)."""
        if self._engine is not None:
            return self._engine
        with self._lock:
            if self._engine is None:
                info = self.info()
                t0 = time.perf_counter()
                log.info("loading the %s model from %s", self.role, info.source)
                try:
                    self._engine = self._load(info)
                except DGemmaError as e:
                    self.load_error = str(e)
                    raise
                self.load_seconds, self.load_error = time.perf_counter() - t0, None
                log.info("loaded the %s model in %.1f s", self.role, self.load_seconds)
        return self._engine

    def _load(self, info: ModelInfo) -> Engine:
        if info.kind == "run":
            run = load_run(info.source, device=self.device, dtype=self.dtype)
            return Engine(info, run.model, run.tokenizer, run.noise())

        model, tokenizer = load_pretrained(info.source)
        if tokenizer is None:
            raise DGemmaError(f"{info.source} has no tokenizer.json: the text panel needs one")
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = model.to(device=device, dtype=resolve_dtype(self.dtype, device)).eval()
        info.max_positions = model.config.max_position_embeddings
        return Engine(info, model, tokenizer, UniformNoise(model.config.vocab_size, get_schedule("linear")))


# ----------------------------------------------------------------------------------- jobs
@dataclass
class Job:
    id: int
    kind: str
    cancel: threading.Event = field(default_factory=threading.Event)
    steps: int = 0  # denoising steps completed
    status: str = "running"  # running | done | cancelled | failed
    started: float = field(default_factory=time.time)
    ended: float | None = None

    def as_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "steps": self.steps, "status": self.status,
                "seconds": (self.ended or time.time()) - self.started}


class Jobs:
    """The sampling jobs: at most ``max_running`` at once; outcome counts; the latest 50."""

    def __init__(self, max_running: int):
        self.max_running = max_running
        self._lock = threading.Lock()
        self._next = 1
        self.running: dict[int, Job] = {}
        self.recent: deque[Job] = deque(maxlen=50)
        self.counts = {"started": 0, "done": 0, "cancelled": 0, "failed": 0}
        self.closing = False  # set by stop_all_jobs: no new job starts

    def start(self, kind: str) -> Job | None:
        with self._lock:
            if self.closing or len(self.running) >= self.max_running:
                return None
            job = Job(self._next, kind)
            self._next += 1
            self.running[job.id] = job
            self.recent.append(job)
            self.counts["started"] += 1
            return job

    def finish(self, job: Job, status: str) -> None:
        with self._lock:
            if job.status != "running":
                return
            job.status, job.ended = status, time.time()
            self.running.pop(job.id, None)
            self.counts[status] += 1

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the median length of the last finished jobs
        (a slot frees about that often per running job), 1 to 30."""
        with self._lock:
            spans = sorted(j.ended - j.started for j in self.recent if j.ended is not None)
        return min(30, max(1, math.ceil(spans[len(spans) // 2]))) if spans else 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"running": len(self.running), "max_running": self.max_running, **self.counts,
                    "jobs": [j.as_dict() for j in reversed(self.recent)][:20]}


def stop_all_jobs(app: FastAPI) -> None:
    """Cancel every running job and start no new one (the server is stopping): their streams
    end with an ``error`` event at the next step, so connections close without waiting."""
    jobs: Jobs = app.state.jobs
    with jobs._lock:
        jobs.closing = True
        running = list(jobs.running.values())
    for job in running:
        job.cancel.set()


class BodyLimit:
    """ASGI middleware: a request whose Content-Length is over ``limit`` bytes gets 413 unread;
    one without a Content-Length (chunked) gets 413 as soon as what it sent passes the limit
    (an HTTPException, which FastAPI's body parsing lets through)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = dict(scope.get("headers") or []).get(b"content-length", b"")
        if size.isdigit() and int(size) > self.limit:
            response = error_response(scope.get("path", ""), f"the request body is {int(size)} bytes; the limit "
                                      f"is {self.limit}", 413, code="request_too_large")
            await response(scope, receive, send)
            return
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"the request body is over the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


class JobStream(StreamingResponse):
    """A streaming response that cancels its job however the response ends (disconnect included)."""

    def __init__(self, content, job: Job, **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def stream_job(executor: ThreadPoolExecutor, jobs: Jobs, job: Job, work: Callable,
               encode: Callable[[str, dict], bytes] = _sse) -> JobStream:
    """Run ``work(emit)`` in ``executor`` and stream what it emits; ``emit(event, data)`` raises
    :class:`Cancelled` once the job is cancelled. ``encode(event, data)`` writes one event
    (errors are ``("error", {"error": message})``); the default is the playground's SSE."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down)
            job.cancel.set()

    def emit(event: str, data: dict) -> None:
        if job.cancel.is_set():
            raise Cancelled
        put(encode(event, data))

    def runner() -> None:
        status = "failed"
        try:
            work(emit)
            status = "done"
        except Cancelled:
            status = "cancelled"
            if jobs.closing:
                put(encode("error", {"error": "the server is shutting down"}))
        except DGemmaError as e:
            put(encode("error", {"error": str(e)}))
        except Exception as e:  # a bug: tell the page, keep the trace in the log
            log.exception("sampling job %d failed", job.id)
            put(encode("error", {"error": f"internal error: {type(e).__name__}: {e}"}))
        finally:
            jobs.finish(job, "cancelled" if status == "failed" and job.cancel.is_set() else status)
            put(None)

    executor.submit(runner)

    async def body():
        getter = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=HEARTBEAT_S)
                if not done:
                    yield b": working\n\n"
                    continue
                item, getter = getter.result(), None
                if item is None:
                    break
                yield item
        finally:
            job.cancel.set()
            if getter is not None:
                getter.cancel()

    return JobStream(body(), job, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def run_job(executor: ThreadPoolExecutor, jobs: Jobs, job: Job, work: Callable, request: Request | None = None):
    """Run ``work(emit)`` in ``executor`` and return its result: a response that is not a
    stream. ``emit`` sends nothing; it raises :class:`Cancelled` once the job is cancelled, as
    the sampler's hook should. The job is cancelled when ``request``'s client disconnects
    (polled every half second) or when the awaiting task is cancelled; errors propagate."""
    status = "failed"

    def emit(event: str, data: dict) -> None:
        if job.cancel.is_set():
            raise Cancelled

    def runner():
        nonlocal status
        try:
            out = work(emit)
            status = "done"
            return out
        except Cancelled:
            status = "cancelled"
            raise
        finally:
            jobs.finish(job, "cancelled" if status == "failed" and job.cancel.is_set() else status)

    try:
        future = asyncio.wrap_future(executor.submit(runner))
    except RuntimeError:  # the pool is shut down: the server is stopping
        jobs.finish(job, "cancelled")
        raise ServeError("the server is shutting down", 503, code="shutting_down") from None
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.5)
            if done:
                return future.result()
            if request is not None and not job.cancel.is_set() and await request.is_disconnected():
                job.cancel.set()  # nobody will read the answer: stop sampling at the next step
    finally:
        job.cancel.set()


# ----------------------------------------------------------------------------------- requests
class SampleParams(BaseModel):
    """Sampler settings; unset ones take the model's defaults (``/api/info``)."""

    model_config = ConfigDict(extra="forbid")

    step_type: str | None = None
    num_steps: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0, allow_inf_nan=False)
    early_stopping: str | None = None  # none | entropy | stable_confident
    threshold: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)  # the confidence step's
    self_condition: bool | None = None  # False: every step gets the zero self-conditioning signal (faster)
    no_repeat: bool | None = None  # commit step: no token equal to a neighbour's (eval_ds.commit_no_repeat)
    delay_ms: int = Field(0, ge=0)  # slow motion: a pause after every step, for watching
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


MAX_VERIFY_ROUNDS = 32
MAX_VERIFY_VARIANTS = 32


class SolveRequest(SampleParams):
    puzzle: str = Field(max_length=4096)
    # re-noising rounds for a board that breaks a rule (dgemma/eval/sudoku_verify.py); None: the
    # model's single answer, valid or not
    verify_rounds: int | None = Field(None, ge=0, le=MAX_VERIFY_ROUNDS)
    # re-runs a broken board tries per round, batched; None: dgemma solve's default
    verify_variants: int | None = Field(None, ge=1, le=MAX_VERIFY_VARIANTS)


class TextRequest(SampleParams):
    prompt: str
    system: str | None = None  # a system instruction, rendered as the chat template does
    max_canvases: int | None = Field(None, ge=1)
    prefix: str | None = None  # the answer starts with this text, pinned in the first canvas (see with_prefix)


def _bad(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query")]
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        elif err.get("type") == "missing":
            msg = "is required"
        elif err.get("type") == "extra_forbidden":
            msg = "is not a known setting"
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


@dataclass
class Plan:
    """A validated request: the sampler settings, the prompt ids and any pinned canvas tokens."""

    settings: dict
    prompt_ids: list[int]
    sampler: Any  # the SamplerConfig (dgemma/sampling.py), checked by build_rules
    max_canvases: int
    seed: int
    delay_s: float
    hints: list[int] | None = None  # [max_canvases * C] token ids pinned in the canvas, -1 = free
    rows: int = 1  # samples of the prompt (the OpenAI API's n)
    row_seeds: bool = False  # row i draws from its own stream seeded by (seed, i): see run_sampler
    top_p: float = 1.0


def make_plan(engine: Engine, req: SampleParams, prompt_ids: list[int], limits: Limits,
              max_canvases: int | None = None) -> Plan:
    """Validate the settings against the model and the limits; DGemmaError says what is wrong. A
    run's other decoding settings are its evaluations' (``eval_ds``, via ``eval_settings``)."""
    info, d = engine.info, engine.info.defaults
    step_type = req.step_type or d["step_type"]
    if step_type not in info.step_types:
        why = (" (it needs uniform noise; this model uses absorbing noise)"
               if step_type in STEPS and STEPS[step_type].needs_uniform else "")
        raise DGemmaError(f"step_type {step_type!r} is not available for this model{why}; "
                          f"choose one of {', '.join(info.step_types)}")
    num_steps = req.num_steps or d["num_steps"]
    if num_steps > limits.max_steps:
        raise DGemmaError(f"num_steps {num_steps} is over the limit of {limits.max_steps}")
    temperature = d["temperature"] if req.temperature is None else req.temperature
    rule = req.early_stopping or d["early_stopping"]
    if rule not in STOPPING:
        raise DGemmaError(f"early_stopping {rule!r} is unknown; choose one of {', '.join(STOPPING)}")
    if req.delay_ms > limits.max_delay_ms:
        raise DGemmaError(f"delay_ms {req.delay_ms} is over the limit of {limits.max_delay_ms}")
    n_canvas = info.max_canvases if max_canvases is None else max_canvases
    if n_canvas > limits.max_canvases:
        raise DGemmaError(f"max_canvases {n_canvas} is over the limit of {limits.max_canvases}")
    if len(prompt_ids) > info.prompt_len:
        raise DGemmaError(f"the prompt is too long: {len(prompt_ids)} tokens; the limit is {info.prompt_len} tokens")
    if len(prompt_ids) + n_canvas * info.canvas_size > info.max_positions:
        raise DGemmaError(f"{len(prompt_ids)} prompt tokens plus {n_canvas} canvases of {info.canvas_size} exceed "
                          f"the model's {info.max_positions} positions; ask for fewer canvases")
    threshold = (d.get("threshold", 0.9) if req.threshold is None else req.threshold) \
        if step_type == "confidence" else None
    if info.cfg is not None:  # a run decodes as its evaluations do (eval_ds: commit blocks, order, signal ...)
        sampler = replace(eval_settings(info.cfg, num_steps=num_steps, step_type=step_type, temperature=temperature,
                                        early_stopping=rule, tokenizer=engine.tokenizer),
                          entropy_threshold=info.entropy_threshold, max_canvases=n_canvas,
                          confidence_threshold=threshold)
    else:
        sampler = SamplerConfig(num_steps=num_steps, step_type=step_type, temperature=temperature,
                                early_stopping=rule, entropy_threshold=info.entropy_threshold, max_canvases=n_canvas,
                                confidence_threshold=threshold, logit_bias={})
    if req.self_condition is not None:
        sampler = replace(sampler, self_condition=req.self_condition)
    if req.no_repeat is not None:
        sampler = replace(sampler, commit_no_repeat=req.no_repeat)
    build_rules(sampler, engine.noise)  # bad settings fail here, before a job starts
    rules = sampler.resolved()
    seed = random.randrange(2**31) if req.seed is None else req.seed
    settings = {"step_type": step_type, "num_steps": num_steps, "temperature": temperature, "early_stopping": rule,
                "threshold": threshold, "max_canvases": n_canvas, "canvas_size": info.canvas_size,
                "seed": seed, "delay_ms": req.delay_ms, "prompt_tokens": len(prompt_ids),
                "commit_block": sampler.commit_block,
                "no_repeat": bool(rules.commit_no_repeat) if step_type == "commit" else None,
                "self_condition": rules.self_condition if engine.model.self_conditioning is not None else None,
                "logit_bias": info.cfg.eval_ds.logit_bias if info.cfg is not None else None,
                "prefix": info.cfg.eval_ds.response_prefix if info.cfg is not None else None}
    return Plan(settings, prompt_ids, sampler, n_canvas, seed, req.delay_ms / 1000)


def with_prefix(engine: Engine, plan: Plan, text: str | None) -> None:
    """Force the plan's answers to begin with ``text`` (None: leave the plan as it is): its tokens
    are pinned at the first canvas's first positions (``eval_ds.response_prefix``'s mechanism,
    which a request's prefix replaces), so the model writes what follows them and spends no step
    on them. Checked here, before a job starts: an empty prefix, one that fills the canvases, or
    one that clashes with pinned clues raises DGemmaError."""
    if text is None:
        return
    ids = resolve_prefix(text, engine.tokenizer)
    hints = None if plan.hints is None else torch.tensor([plan.hints])
    pin_prefix(hints, ids, 1, plan.max_canvases * engine.info.canvas_size)
    plan.sampler = replace(plan.sampler, prefix=ids)
    plan.settings["prefix"] = text


def sudoku_hints(engine: Engine, puzzle: str) -> list[int] | None:
    """The clues pinned in the canvas, for a run trained with ``data.pin_clues`` (else None),
    built by the trainer's own rule (``dgemma/tasks/sudoku.py:SudokuTask.hints``). It reads only
    the puzzle's clues, so any digits stand in for the unknown solution."""
    cfg = engine.info.cfg
    if cfg is None or not getattr(cfg.data, "pin_clues", False):
        return None
    fn = get_task(cfg.data.task).hints(cfg, engine.tokenizer)
    filler = puzzle.replace("0", "1")
    return list(fn({"puzzle": puzzle, "solution": filler}, engine.tokenizer.encode(filler)))


def encode_user_prompt(engine: Engine, record: dict) -> list[int]:
    """The chat-formatted prompt ids (with BOS), never truncated: too long is the caller's error."""
    return engine.tokenizer.encode(render_prompt(engine.tokenizer, record), add_bos=True)


# ----------------------------------------------------------------------------------- sampling
class Progress:
    """The sampler's ``on_step`` hook for one prompt: counts forwards, honours cancel and delay,
    and turns each step into ``(canvas, step, t, pieces, emitted)`` for :meth:`emit_step`.

    ``pieces`` are ``(token, settled)`` per canvas position: a settled position shows its token,
    a noisy one the model's current guess (its argmax). Settled means committed, or for a step
    that commits nothing (``ddim``, ``entropy_bound``: ``Step.commits`` false) equal to the guess. ``emitted`` is the canvas the
    sampler emits when this step ends it (its tokens after the last step, the argmax on an early
    stop), else None.
    """

    def __init__(self, job: Job, plan: Plan, emit: Callable, piece: Callable[[int], str]):
        self.job, self.plan, self.emit, self.piece = job, plan, emit, piece
        self.commits = STEPS[plan.settings["step_type"]].commits
        self.num_steps = plan.settings["num_steps"]
        self.forwards = 1  # the prefill
        self.own_appends = plan.sampler.fuse_append is False  # else an append rides on a canvas's first pass
        self.canvas = 0
        self.earlier: list[int] = []  # tokens emitted by finished canvases
        self.t0 = time.perf_counter()
        self.slept = 0.0
        self.canvas_committed = 0  # committed positions of the current canvas (pinned ones included)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, *, canvas, step, t, rows, tokens, committed, argmax, done, reused=False) -> None:
        if self.job.cancel.is_set():
            raise Cancelled
        if canvas != self.canvas:
            self.canvas, self.forwards = canvas, self.forwards + self.own_appends  # the previous canvas's append
        self.forwards += not reused  # a reused forward's logits cost no pass
        self.job.steps += 1
        toks, com, guess = tokens[0].tolist(), committed[0].tolist(), argmax[0].tolist()
        self.canvas_committed = sum(com)
        pieces = [(x, True) if (c if self.commits else x == g) else (g, False) for x, c, g in zip(toks, com, guess)]
        emitted = (toks if step == self.num_steps - 1 else guess) if bool(done[0]) else None
        self.emit_step(canvas, step, t, pieces, emitted)
        if emitted is not None:
            self.earlier += emitted
        if self.plan.delay_s > 0:
            t1 = time.perf_counter()
            cancelled = self.job.cancel.wait(self.plan.delay_s)
            self.slept += time.perf_counter() - t1
            if cancelled:
                raise Cancelled

    def emit_step(self, canvas, step, t, pieces, emitted) -> None:
        raise NotImplementedError

    def common(self, canvas: int, step: int, t: float) -> dict:
        return {"canvas": canvas, "step": step + 1, "num_steps": self.num_steps, "t": round(t, 4),
                "canvas_committed": self.canvas_committed, "forwards": self.forwards,
                "elapsed": round(self.elapsed() - self.slept, 4),
                "slept": round(self.slept, 3)}

    def stats(self, result) -> dict:
        s = result.stats()
        compute = max(s["seconds"] - self.slept, 1e-9)
        return {"tokens": s["tokens"], "forward_passes": s["forward_passes"],
                "tokens_per_forward": round(s["tokens_per_forward"], 4),
                "tokens_per_second": round(s["tokens"] / compute, 2), "seconds": round(compute, 4),
                "delay_seconds": round(self.slept, 3), "steps_used": result.steps_used[0],
                "mean_steps_per_canvas": round(s["mean_steps_per_canvas"], 3)}


def plan_sampler(engine: Engine, plan: Plan, on_step: Callable, generators=None, guesses: bool = True):
    """The plan's :class:`~dgemma.diffusion.sampler.CanvasSampler` for the engine's model, ``on_step``
    its hook; ``guesses=False`` for a hook that never reads the model's guesses at open positions."""
    return build_sampler(replace(plan.sampler, top_p=plan.top_p), noise=engine.noise,
                         canvas_size=engine.info.canvas_size, stop_ids=engine.stop_ids, generators=generators,
                         on_step=on_step, hook_reads_guesses=guesses)


def run_sampler(engine: Engine, plan: Plan, on_step: Callable, guesses: bool = True):
    """Sample ``plan.rows`` rows of the plan's prompt. With ``plan.row_seeds`` row ``i`` draws
    from its own generator seeded by ``derive_seed(seed, i)`` (:class:`~dgemma.diffusion.wrappers.RowSeeded`),
    so the first of ``n`` samples is the one sample of ``n = 1``; otherwise one generator
    seeded by ``seed`` serves the batch (the playground's rule). ``guesses``: see :func:`plan_sampler`
    (the page draws the guesses; the OpenAI API reads only what is emitted, and then the LM head
    runs only where the step reads, as in ``dgemma generate``)."""
    dev = engine.device
    gens = None
    if plan.row_seeds:
        gens = [torch.Generator(device=dev).manual_seed(derive_seed(plan.seed, i)) for i in range(plan.rows)]
    sampler = plan_sampler(engine, plan, on_step, generators=gens, guesses=guesses)
    ids = torch.tensor([plan.prompt_ids] * plan.rows, dtype=torch.long, device=dev)
    valid = torch.ones_like(ids, dtype=torch.bool)
    if engine.model.config.attn_implementation == "flex" and ids.shape[1] < engine.info.prompt_len:
        pad = engine.info.prompt_len - ids.shape[1]  # flex kernels are compiled for the trained shape
        ids = torch.cat([ids, ids.new_full((plan.rows, pad), engine.tokenizer.pad_id or 0)], 1)
        valid = torch.cat([valid, valid.new_zeros((plan.rows, pad))], 1)
    gen = torch.Generator(device=dev).manual_seed(plan.seed)
    hints = None
    if plan.hints is not None:
        width = plan.max_canvases * engine.info.canvas_size
        hints = torch.tensor([(plan.hints + [-1] * width)[:width]] * plan.rows, dtype=torch.long, device=dev)
    return sampler(engine.model, ids, valid, generator=gen, **({} if hints is None else {"hints": hints}))


class SudokuProgress(Progress):
    def __init__(self, *a, puzzle: str, stop_ids, **kw):
        super().__init__(*a, **kw)
        self.puzzle, self.stop_ids = puzzle, stop_ids

    def cells(self, pieces) -> list[list[str]]:
        frame = Frame([(x, True) for x in self.earlier] + list(pieces), "")
        return [[d, k] for d, k in sudoku_cells(frame, self.puzzle, self.piece, self.stop_ids)]

    def next_round(self, num_steps: int) -> None:
        """A verified solve's next round: a fresh board of ``num_steps`` steps, one more prefill."""
        self.num_steps, self.canvas, self.earlier = num_steps, 0, []
        self.forwards += 1

    def emit_step(self, canvas, step, t, pieces, emitted) -> None:
        cells = self.cells(pieces)
        settled = sum(k == "committed" for _, k in cells)
        self.emit("step", {**self.common(canvas, step, t), "cells": cells, "settled": settled,
                           "tokens_per_forward": round(settled / self.forwards, 4)})


def board_verdict(puzzle: str, text: str) -> tuple[str | None, bool, str]:
    """``(81 digits or None, solved, verdict)`` of a model's decoded answer to ``puzzle``."""
    pred = extract_digits(text)
    if pred is None:
        return None, False, f"not a solution: the output holds {sum(c.isdigit() for c in text)} digits, not 81"
    changed = [i for i, (p, a) in enumerate(zip(puzzle, pred)) if p != "0" and p != a]
    err = grid_error(pred)
    if changed:
        i = changed[0]
        return pred, False, (f"not a solution: the model's answer contradicts {len(changed)} clue(s), the first at "
                             f"row {i // 9 + 1}, column {i % 9 + 1} (the board keeps the clues)")
    if err:
        return pred, False, f"not a valid solution: {err}"
    return pred, True, "solved: a valid grid that keeps every clue"


def solve_work(engine: Engine, plan: Plan, job: Job, puzzle: str, verify_rounds: int | None = None,
               verify_variants: int | None = None) -> Callable:
    """The model's answer, streamed step by step; with ``verify_rounds`` the verified solve of
    ``dgemma solve`` (round 0 is the same answer), its rounds streamed too, and the ``done``
    event keeps the model-only and the verified figures apart."""
    def work(emit):
        emit("start", {"puzzle": puzzle, "clues": count_clues(puzzle), **plan.settings})
        progress = SudokuProgress(job, plan, emit, token_piece(engine.tokenizer), puzzle=puzzle,
                                  stop_ids=engine.stop_ids)
        if verify_rounds is not None:
            return verified_work(engine, plan, progress, emit, puzzle, verify_rounds,
                                 DEFAULT_VARIANTS if verify_variants is None else verify_variants)
        result = run_sampler(engine, plan, progress)
        tokens = result.tokens[0]
        progress.earlier = []
        cells = [[d, "empty" if k == "noisy" else k] for d, k in progress.cells([(x, True) for x in tokens])]
        pred, solved, verdict = board_verdict(puzzle, engine.tokenizer.decode(tokens))
        emit("done", {"cells": cells, "solution": pred, "solved": solved, "verdict": verdict,
                      "stats": progress.stats(result)})

    return work


def verified_work(engine: Engine, plan: Plan, progress: "SudokuProgress", emit, puzzle: str, rounds: int,
                  variants: int = 1) -> None:
    """:func:`~dgemma.eval.sudoku_verify.solve_verified` with the plan's sampler, ``progress`` as
    its step hook (so every round animates and a cancel stops it), a ``round`` event per round.
    A round's variants run as one batch; the board animates its first one."""
    num_steps = plan.sampler.num_steps

    def on_round(k, rows, plans):
        renoised = sum(p < 0 for p in plans[0].pins)
        progress.next_round(round_steps(renoised, num_steps))
        emit("round", {"round": k, "rounds": rounds, "rule": plans[0].rule, "renoised": renoised,
                       "num_steps": progress.num_steps, "forwards": progress.forwards})

    sampler = plan_sampler(engine, plan, progress)
    t0 = time.perf_counter()
    [s] = solve_verified(engine.model, engine.tokenizer, [puzzle], sampler=sampler, rounds=rounds,
                         prompt_len=engine.info.prompt_len, pin_clues=plan.hints is not None, seed=plan.seed,
                         batch_size=variants, on_round=on_round, variants=variants)
    seconds = max(time.perf_counter() - t0 - progress.slept, 1e-9)
    _, model_solved, model_verdict = board_verdict(puzzle, s.model_text)
    if s.valid:
        how = "the model's first board" if s.rounds == 0 else f"after {s.rounds} round(s) of re-noising"
        verdict = f"verified: a valid grid that keeps every clue ({how}, {s.passes} forward passes)"
    else:
        verdict = (f"not solved: still breaks a rule after {s.rounds} round(s) of re-noising ({s.error}); "
                   f"{s.passes} forward passes")
    cells = [[d if d != "0" else "", "clue" if c != "0" else ("committed" if d != "0" else "empty")]
             for d, c in zip(s.grid, puzzle)]
    emit("done", {"cells": cells, "solution": s.grid if "0" not in s.grid else None, "solved": s.valid,
                  "verdict": verdict,
                  "model_only": {"solution": s.model_grid, "solved": model_solved, "verdict": model_verdict,
                                 "forward_passes": s.model_passes},
                  "verified": {"solved": s.valid, "rounds": s.rounds, "max_rounds": rounds, "variants": variants,
                               "forward_passes": s.passes, "round_passes": s.round_passes, "renoised": s.renoised,
                               "seconds": round(seconds, 4)},
                  "stats": {"forward_passes": s.passes, "seconds": round(seconds, 4),
                            "delay_seconds": round(progress.slept, 3)}})


class TextProgress(Progress):
    def __init__(self, *a, stop_ids, **kw):
        super().__init__(*a, **kw)
        self.stop_ids = stop_ids

    def emit_step(self, canvas, step, t, pieces, emitted) -> None:
        settled = sum(s for _, s in pieces) + len(self.earlier)
        self.emit("step", {**self.common(canvas, step, t), "tokens": [[self.piece(x), s] for x, s in pieces],
                           "tokens_per_forward": round(settled / self.forwards, 4)})
        if emitted is not None:
            cut = next((n + 1 for n, x in enumerate(emitted) if x in self.stop_ids), None)
            self.emit("canvas", {"canvas": canvas, "steps": step + 1, "ended": cut is not None,
                                 "tokens": [[self.piece(x), True] for x in emitted[:cut]]})


def text_work(engine: Engine, plan: Plan, job: Job, prompt: str) -> Callable:
    def work(emit):
        emit("start", {"prompt": prompt, **plan.settings})
        progress = TextProgress(job, plan, emit, token_piece(engine.tokenizer), stop_ids=engine.stop_ids)
        result = run_sampler(engine, plan, progress)
        tokens = result.tokens[0]
        emit("done", {"text": engine.tokenizer.decode(tokens), "stats": progress.stats(result),
                      "ended": bool(tokens) and tokens[-1] in engine.stop_ids})

    return work


async def load_engine(app: FastAPI, role: str) -> Engine:
    """The ``role`` model, loaded on first use in a worker thread; :class:`ServeError` (503)
    when it is missing or fails to load (the trace goes to the log)."""
    s: ModelSlot = app.state.models[role]
    try:
        return await run_in_threadpool(s.get)
    except DGemmaError as e:
        raise ServeError(f"the {role} model is not available: {e}", 503, code="model_not_available") from None
    except Exception as e:  # a broken checkpoint, out of memory...: say so, keep the trace in the log
        log.exception("loading the %s model failed", role)
        s.load_error = f"{type(e).__name__}: {e}"
        raise ServeError(f"the {role} model failed to load: {s.load_error}", 503, code="model_not_available") from None


def start_job(app: FastAPI, kind: str) -> Job:
    """A slot in the job pool, or :class:`ServeError`: 429 with ``Retry-After`` when
    ``max_jobs`` requests are sampling, 503 while the server shuts down."""
    jobs: Jobs = app.state.jobs
    job = jobs.start(kind)
    if job is not None:
        return job
    if jobs.closing:
        raise ServeError("the server is shutting down", 503, code="shutting_down")
    wait = jobs.retry_after()
    raise ServeError(f"the server is busy: {jobs.max_running} sampling requests are running (the limit); "
                     f"retry after {wait} s", 429, code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
