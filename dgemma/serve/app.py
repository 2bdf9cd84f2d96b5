"""The playground server: a FastAPI app that streams the canvas sampler's steps to a browser.

Routes
    ``GET  /``                    the page (``static/index.html``, ``app.js``, ``style.css``)
    ``GET  /api/info``            both models (source, loaded, noise, canvas geometry, defaults,
                                  step types) and the request limits; loads nothing
    ``GET  /api/status``          sampling jobs: how many run, counts by outcome, the latest few
    ``GET  /api/sudoku/random``   ``?difficulty=easy|medium|hard`` -> a generated unique puzzle
    ``POST /api/sudoku/solve``    JSON :class:`SolveRequest` -> an event stream (``verify_rounds``:
                                  the verified solve, its rounds as ``round`` events)
    ``POST /api/text/generate``   JSON :class:`TextRequest` -> an event stream

A stream is Server-Sent Events (``text/event-stream``; the page reads it with ``fetch`` since
``EventSource`` cannot POST): ``start`` (the settings used, seed included), one ``step`` per
denoising step (the board's 81 cells, or the current canvas's tokens, each settled or noisy),
``canvas`` (text: a canvas was emitted), then ``done`` (the output and its statistics) or
``error``. Bad input never starts a stream: it gets HTTP 400 and ``{"error": "..."}``; a
missing model gets 503 with the same shape, a full server 429 with a ``Retry-After`` header.

The OpenAI-compatible routes under ``/v1`` (``dgemma/serve/openai_api.py``) share the models,
the job pool, the limits and cancellation; their errors take OpenAI's shape
(:func:`error_response` picks the shape from the path).

Threads. Sampling never runs on the event loop: each request's sampler runs in a pool of
``max_jobs`` threads and hands its events to the loop with ``call_soon_threadsafe``, so one slow
request delays no other (more than ``max_jobs`` at once are refused with 429). Loading a model
(the text model is loaded on the first text request) runs in the loop's default thread pool.

Cancellation. Every job has a cancel flag, set when its response ends for any reason: the client
disconnected (Starlette cancels the streaming task), pressed Stop (the same thing), or the
stream finished. The sampler's ``on_step`` hook checks the flag at every step and raises
:class:`Cancelled`, which unwinds the sampler and frees the thread; ``/api/status`` counts the
job as ``cancelled`` and its ``steps`` stop growing.
"""

from __future__ import annotations

import contextlib
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma import shipped
from dgemma.errors import DGemmaError
from dgemma.eval.sudoku_verify import cell_token_ids
from dgemma.serve.engine import (OPENAI_PREFIX, PRETRAINED, STATIC, SUDOKU_HINT, BodyLimit, Engine, JobStream, Jobs,
                                 Limits, ModelSlot, ServeError, SolveRequest, TextRequest, _bad, _validation_message,
                                 encode_user_prompt, error_response, load_engine, make_plan, solve_work, start_job,
                                 stop_all_jobs, stream_job, sudoku_hints, text_work, with_prefix)
from dgemma.data.sudoku import generate_puzzles, parse_puzzle
from dgemma.serve.openai_api import router, validation_error
from dgemma.tasks.sudoku import SYSTEM_PROMPT, format_prompt

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- the app
def create_app(*, sudoku: str | Path | Engine | None = shipped.SUDOKU,
               text: str | Path | Engine | None = PRETRAINED, device: str | None = None,
               limits: Limits | None = None, dtype: str = "auto") -> FastAPI:
    """The playground app (``dtype``: the models' inference dtype, see ``dgemma/device.py:resolve_dtype``).

    ``sudoku`` and ``text`` are each a training workdir, ``"gemma3-270m"`` (text), a Hugging
    Face Gemma 3 folder or ``.gguf`` (text), a ready :class:`Engine`, or None for no model.
    Nothing is loaded here: each model loads on its panel's first request.
    """
    limits = limits or Limits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        stop_all_jobs(app)
        app.state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dgemma playground", docs_url=None, redoc_url=None, lifespan=lifespan)
    slot = lambda role, src, hint="": ModelSlot(  # noqa: E731
        role, None if isinstance(src, Engine) else src, limits=limits, device=device,
        engine=src if isinstance(src, Engine) else None, hint=hint, dtype=dtype)
    app.state.limits = limits
    app.state.models = {"sudoku": slot("sudoku", sudoku, SUDOKU_HINT), "text": slot("text", text)}
    app.state.jobs = Jobs(limits.max_jobs)
    app.state.executor = ThreadPoolExecutor(max_workers=limits.max_jobs, thread_name_prefix="dgemma-sample")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        if request.url.path.startswith(OPENAI_PREFIX):
            return validation_error(exc)
        return _bad(_validation_message(exc))

    @app.exception_handler(ServeError)
    async def _refused(request: Request, exc: ServeError):
        return error_response(request.url.path, str(exc), exc.status, param=exc.param, code=exc.code,
                              headers=exc.headers)

    @app.exception_handler(DGemmaError)
    async def _user_error(request: Request, exc: DGemmaError):
        return error_response(request.url.path, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith(OPENAI_PREFIX) or exc.status_code == 413:
            return error_response(request.url.path, str(exc.detail), exc.status_code, headers=exc.headers,
                                  code="request_too_large" if exc.status_code == 413 else None)
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # still JSON, so the page can show it
        log.exception("request %s %s failed", request.method, request.url.path)
        return error_response(request.url.path, f"internal error: {type(exc).__name__}: {exc}", 500)

    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return Response(status_code=204)

    @app.get("/api/info")
    def info():
        return {"models": {k: s.describe() for k, s in app.state.models.items()},
                "limits": {k: getattr(limits, k) for k in ("max_steps", "max_canvases", "max_prompt_chars",
                                                             "max_delay_ms", "max_jobs")},
                "difficulties": ["easy", "medium", "hard"]}

    @app.get("/api/status")
    def status():
        return app.state.jobs.snapshot()

    @app.get("/api/sudoku/random")
    def random_puzzle(difficulty: str = "medium", seed: int | None = Query(None, ge=0, le=2**63 - 1)):
        if difficulty not in ("easy", "medium", "hard"):
            return _bad(f"difficulty must be easy, medium or hard, got {difficulty!r}")
        seed = random.randrange(2**31) if seed is None else seed
        rec = generate_puzzles(1, seed=seed, difficulty=difficulty)[0]
        return {"puzzle": rec["puzzle"], "clues": rec["clues"], "difficulty": rec["difficulty"], "seed": seed}

    def _start(kind: str, make_work) -> JobStream:
        job = start_job(app, kind)
        return stream_job(app.state.executor, app.state.jobs, job, make_work(job))

    @app.post("/api/sudoku/solve")
    async def solve(req: SolveRequest):
        try:
            puzzle = parse_puzzle(req.puzzle)
        except DGemmaError as e:
            return _bad(str(e))
        engine = await load_engine(app, "sudoku")
        try:
            ids = encode_user_prompt(engine, {"system": SYSTEM_PROMPT, "prompt": format_prompt(puzzle)})
            plan = make_plan(engine, req, ids, limits)
            plan.hints = sudoku_hints(engine, puzzle)
            plan.settings["pinned_clues"] = plan.hints is not None
            plan.settings["verify_rounds"] = req.verify_rounds
            plan.settings["verify_variants"] = req.verify_variants
            if req.verify_rounds is not None:
                cell_token_ids(engine.tokenizer)  # verification pins cells: one token per cell
        except DGemmaError as e:
            return _bad(str(e))
        return _start("sudoku", lambda job: solve_work(engine, plan, job, puzzle, req.verify_rounds,
                                                       req.verify_variants))

    @app.post("/api/text/generate")
    async def generate(req: TextRequest):
        if not req.prompt.strip():
            return _bad("the prompt is empty")
        if len(req.prompt) + len(req.system or "") > limits.max_prompt_chars:
            return _bad(f"the prompt is too long: {len(req.prompt)} characters; the limit is "
                        f"{limits.max_prompt_chars} characters")
        if req.max_canvases is not None and req.max_canvases > limits.max_canvases:
            return _bad(f"max_canvases {req.max_canvases} is over the limit of {limits.max_canvases}")
        engine = await load_engine(app, "text")
        try:
            record = {"prompt": req.prompt, **({"system": req.system} if req.system and req.system.strip() else {})}
            ids = await run_in_threadpool(encode_user_prompt, engine, record)
            plan = make_plan(engine, req, ids, limits, req.max_canvases)
            with_prefix(engine, plan, req.prefix)
        except DGemmaError as e:
            return _bad(str(e))
        return _start("text", lambda job: text_work(engine, plan, job, req.prompt))

    app.include_router(router)
    return app
