"""OpenAI-compatible routes of ``dgemma serve``: any OpenAI client can sample the served models.

Routes (mounted by :func:`dgemma.serve.app.create_app`)
    ``GET  /v1/models``             the served models (:func:`served_models`)
    ``POST /v1/completions``        a raw text prompt (no chat markup), :class:`CompletionRequest`
    ``POST /v1/chat/completions``   messages rendered with the tokenizer's chat template, :class:`ChatRequest`

What is honoured. ``max_tokens`` (chat: ``max_completion_tokens`` too) sets the canvases to
sample, ``ceil(max_tokens / canvas_size)``, and cuts the output at ``max_tokens``;
``temperature`` is the step's; ``top_p`` filters the step's distribution
(:class:`~dgemma.diffusion.wrappers.TopPStep`; refused with ``entropy_bound``, a no-op at
temperature 0); ``stop`` (a string or up to 4) cuts the text before the first match with
``finish_reason: "stop"``, as does an EOS or end-of-turn token; ``n`` samples the prompt ``n``
times in one batch, choice ``i`` from its own stream seeded by ``(seed, i)``, so the same seed
gives the same choices and the first of ``n`` is the answer of ``n = 1``; ``seed`` (unset: a
random one, reported in the response's ``dgemma.seed``). Diffusion settings are extra body
fields (``extra_body`` in the openai client): ``steps``, ``step_type``, ``early_stopping``,
``threshold``, ``self_condition`` and ``no_repeat`` (the commit step's rule against repeated
neighbours, ``eval_ds.commit_no_repeat``); unset ones take the model's defaults, as in the playground.
Chat takes vLLM's ``continue_final_message``: the last message is an assistant message that
the answer must begin with; its tokens are pinned at the start of the first canvas (a run's
``eval_ds.response_prefix``, replaced), count in ``usage.prompt_tokens`` and not in
``max_tokens``, and the reply is what the model writes after them. Anything a
diffusion sampler cannot do (``logprobs``, ``echo``, ``best_of``, ``suffix``, penalties,
tools, a JSON ``response_format``) is refused with a 400 that names the parameter; an unknown
parameter too. ``logit_bias`` (token id -> bias in [-100, 100]) is added to those logits at
every denoising step, on top of the model's own bias (a run's ``eval_ds.logit_bias``).

Streaming (``stream: true``) is Server-Sent Events in OpenAI's chunk format: ``data: {json}``
lines and a last ``data: [DONE]``. A diffusion sampler commits a whole canvas at once, not a
token at a time, so there is **one chunk per committed canvas per choice** (its ``text`` or
``delta.content`` is the text that canvas added, possibly empty when all of it is held back
because it may begin a stop string), the last one carrying ``finish_reason``; chat streams
start with one ``{"role": "assistant"}`` chunk per choice, and ``stream_options:
{"include_usage": true}`` adds a chunk with ``usage`` and no choices before ``[DONE]``.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (``invalid_request_error``), 404 for an unknown model (``model_not_found``), 413 for a
body over the limit, 429 with ``Retry-After`` when ``max_jobs`` requests are sampling, 503
when a model cannot load. An error after a stream started arrives as one ``data: {"error":
...}`` event. Requests share the playground's job pool, limits and cancellation: a client that
disconnects, streaming or not, stops its sampler at the next step.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from dgemma.diffusion.sampler import check_logit_bias
from dgemma.diffusion.wrappers import emitted_canvases
from dgemma.errors import DGemmaError
from dgemma.sampling import resolve_prefix
from dgemma.serve.engine import (Cancelled, Engine, Plan, SampleParams, ServeError, _validation_message, load_engine,
                                 make_plan, openai_error, run_job, run_sampler, start_job, stream_job, sudoku_hints,
                                 with_prefix)
from dgemma.data.sudoku import parse_puzzle

__all__ = ["CompletionRequest", "ChatRequest", "Choices", "served_models", "render_messages", "build_plan",
           "sample_work", "encode_event", "refuse_unsupported", "validation_error"]

router = APIRouter(prefix="/v1")
STARTED = int(time.time())
MAX_STOPS = 4


# ----------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints take; the unsupported ones exist only to be refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-monitoring id
    # diffusion settings (extra_body); unset: the model's defaults
    steps: int | None = Field(None, ge=1)
    step_type: str | None = None
    early_stopping: str | None = None
    threshold: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    self_condition: bool | None = None  # False: every step gets the zero self-conditioning signal (faster)
    no_repeat: bool | None = None  # commit step: no token equal to a neighbour's (eval_ds.commit_no_repeat)
    # refused unless neutral (see refuse_unsupported)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    logprobs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[dict] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's extension (extra_body): the last message is the start of the assistant's answer, which
    # the model continues; its tokens are pinned in the first canvas and the reply is what follows
    continue_final_message: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None


def _refuse(param: str, why: str) -> ServeError:
    return ServeError(f"{param} is not supported: {why}", 400, param=param, code="unsupported_parameter")


def refuse_unsupported(req: _Sampling) -> None:
    """400 for every parameter set to something a diffusion sampler cannot honour."""
    if req.logprobs not in (None, False, 0) or getattr(req, "top_logprobs", None):
        raise _refuse("logprobs", "a diffusion sampler commits canvases in parallel and has no left-to-right "
                                  "token probabilities")
    if req.presence_penalty or req.frequency_penalty:
        raise _refuse("presence_penalty" if req.presence_penalty else "frequency_penalty",
                      "the denoising steps have no penalty hooks")
    if req.stream_options is not None and not req.stream:
        raise ServeError("stream_options is only allowed when stream is true", 400, param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise _refuse("echo", "the prompt is not scored")
        if req.best_of not in (None, 1, req.n):
            raise _refuse("best_of", "samples are not ranked (no likelihoods); ask for n choices instead")
        if req.suffix:
            raise _refuse("suffix", "infilling after a suffix is not implemented")
    if isinstance(req, ChatRequest):
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise _refuse(name, "this model has no tool calling")
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none"):
                raise _refuse(name, "this model has no tool calling")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _refuse("response_format", "only plain text is generated")


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A request that does not parse, in OpenAI's error shape, ``param`` naming the first bad field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    parts = []
    for p in first.get("loc", ()):
        if p == "body":
            continue
        if isinstance(p, str) and not p.isidentifier():  # pydantic's union tags: "list[str]", "function-after"
            break
        parts.append(str(p))
    param = ".".join(parts) or None
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error")
        return JSONResponse(openai_error("the request body is not valid JSON" + (f" ({why})" if why else ""), 400,
                                         None, "invalid_json"), status_code=400)
    message = (f"Unrecognized request argument supplied: {param}" if first.get("type") == "extra_forbidden"
               else _validation_message(exc))
    return JSONResponse(openai_error(message, 400, param), status_code=400)


# ----------------------------------------------------------------------------------- models
def _model_name(source: str) -> str:
    return Path(source).name or source


def served_models(app) -> dict[str, str]:
    """``{model id: role}`` for every available model: the id is its source's name (a workdir's
    folder name, ``gemma3-270m``), with ``-<role>`` appended when two share a name. The role
    names (``text``, ``sudoku``) are accepted in requests too."""
    ids: dict[str, str] = {}
    for role, slot in app.state.models.items():
        d = slot.describe()
        if not d["available"]:
            continue
        name = _model_name(d["source"])
        ids[f"{name}-{role}" if name in ids else name] = role
    return ids


def _resolve(app, name: str) -> tuple[str, str]:
    ids = served_models(app)
    if name in ids:
        return name, ids[name]
    for model_id, role in ids.items():
        if role == name:
            return model_id, role
    have = ", ".join(ids) or "none"
    raise ServeError(f"The model {name!r} does not exist on this server; it serves: {have}", 404, param="model",
                     code="model_not_found")


@router.get("/models")
def list_models(request: Request):
    data = []
    for model_id, role in served_models(request.app).items():
        d = request.app.state.models[role].describe()
        data.append({"id": model_id, "object": "model", "created": STARTED, "owned_by": "dgemma",
                     "dgemma": {"role": role, "source": d["source"], "loaded": d["loaded"], "kind": d.get("kind"),
                                "canvas_size": d.get("canvas_size"), "step_types": d.get("step_types"),
                                "defaults": d.get("defaults")}})
    return {"object": "list", "data": data}


@router.get("/models/{model_id}")
def get_model(model_id: str, request: Request):
    model_id, _ = _resolve(request.app, model_id)
    return next(m for m in list_models(request)["data"] if m["id"] == model_id)


# ----------------------------------------------------------------------------------- prompts
def _text_of(message: ChatMessage, i: int) -> str:
    if message.content is None:
        raise ServeError(f"messages.{i}.content is required", 400, param=f"messages.{i}.content")
    if isinstance(message.content, str):
        return message.content
    out = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ServeError(f"messages.{i}.content: only text parts are supported, got a {part.get('type')!r} part",
                             400, param=f"messages.{i}.content")
        out.append(part["text"])
    return "".join(out)


def render_messages(tokenizer, messages: list[ChatMessage]) -> tuple[str, str]:
    """``(prompt text, last user turn)``: the messages through ``tokenizer.render_chat`` (a
    ``developer`` message is a system message); a tokenizer without a chat template (the
    character tokenizers of from-scratch runs) takes one user turn, after an optional system
    message, through its ``chat_prompt``."""
    turns = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise ServeError(f"messages.{i}.role {m.role!r} is not supported; use system, user or assistant", 400,
                             param=f"messages.{i}.role")
        turns.append({"role": role, "content": _text_of(m, i)})
    if turns[-1]["role"] != "user":
        raise ServeError("the last message must be a user message (the model answers it)", 400, param="messages")
    try:
        if hasattr(tokenizer, "render_chat"):
            return tokenizer.render_chat(turns, add_generation_prompt=True), turns[-1]["content"]
        if len(turns) > 2 or (len(turns) == 2 and turns[0]["role"] != "system"):
            raise DGemmaError("this model's tokenizer has no chat template: send one user message (after an optional "
                              "system message), or use /v1/completions")
        system = turns[0]["content"] if len(turns) == 2 else None
        return tokenizer.chat_prompt(turns[-1]["content"], system=system), turns[-1]["content"]
    except DGemmaError as e:
        raise ServeError(str(e), 400, param="messages") from None


def _encode(engine: Engine, text: str, param: str) -> list[int]:
    try:
        return engine.tokenizer.encode(text, add_bos=True)
    except DGemmaError as e:
        raise ServeError(str(e), 400, param=param) from None


def _pins(engine: Engine, text: str) -> list[int] | None:
    """A Sudoku run trained with pinned clues gets them pinned here too, when the prompt is a puzzle."""
    cfg = engine.info.cfg
    if cfg is None or cfg.data.task != "sudoku" or not getattr(cfg.data, "pin_clues", False):
        return None
    try:
        return sudoku_hints(engine, parse_puzzle(text))
    except DGemmaError:
        return None


def build_plan(engine: Engine, req: _Sampling, prompt_ids: list[int], limits, *, max_tokens: int | None,
               prompt_param: str, prefix_tokens: int = 0) -> tuple[Plan, int]:
    """The sampler plan of an OpenAI request and its token budget (new tokens, which follow the
    ``prefix_tokens`` an answer is forced to start with in the canvas); :class:`ServeError` names
    the parameter at fault."""
    info, c, k = engine.info, engine.info.canvas_size, prefix_tokens
    if len(prompt_ids) > info.prompt_len:
        raise ServeError(f"the prompt is too long: {len(prompt_ids)} tokens; the limit is {info.prompt_len} tokens",
                         400, param=prompt_param, code="context_length_exceeded")
    room = (info.max_positions - len(prompt_ids)) // c * c
    if room < 1:
        raise ServeError(f"the prompt's {len(prompt_ids)} tokens leave no room for a canvas of {c} in the model's "
                         f"{info.max_positions} positions", 400, param=prompt_param, code="context_length_exceeded")
    # unset: the model's default canvases, if they fit, less the prefix
    max_tokens = max_tokens or max(min(info.max_canvases * c, room) - k, 1)
    plus = f" plus the final message's {k} tokens" if k else ""
    cap = limits.max_canvases * c
    if max_tokens + k > cap:
        raise ServeError(f"max_tokens {max_tokens}{plus} is over the limit of {cap} ({limits.max_canvases} canvases "
                         f"of {c} tokens)", 400, param="max_tokens")
    if max_tokens + k > room:
        raise ServeError(f"max_tokens {max_tokens}{plus} does not fit: the model has {info.max_positions} positions, "
                         f"and the prompt's {len(prompt_ids)} tokens leave room for {room} ({room // c} canvases of "
                         f"{c})", 400, param="max_tokens", code="context_length_exceeded")
    if req.steps is not None and req.steps > limits.max_steps:
        raise ServeError(f"steps {req.steps} is over the limit of {limits.max_steps}", 400, param="steps")
    if req.n > limits.max_choices:
        raise ServeError(f"n {req.n} is over the limit of {limits.max_choices}", 400, param="n")
    params = SampleParams(step_type=req.step_type, num_steps=req.steps, temperature=req.temperature,
                          early_stopping=req.early_stopping, threshold=req.threshold, seed=req.seed,
                          self_condition=req.self_condition, no_repeat=req.no_repeat)
    try:
        plan = make_plan(engine, params, prompt_ids, limits, math.ceil((max_tokens + k) / c))
    except DGemmaError as e:
        param = next((p for p in ("step_type", "early_stopping") if str(e).startswith(p)), None)
        raise ServeError(str(e), 400, param=param) from None
    plan.rows, plan.row_seeds, plan.top_p = req.n, True, 1.0 if req.top_p is None else req.top_p
    if plan.top_p < 1 and plan.settings["step_type"] == "entropy_bound":
        raise ServeError("top_p is not available with the entropy_bound step (it measures the entropy of the full "
                         "distribution); use step_type commit, confidence or ddim, or leave top_p at 1", 400,
                         param="top_p")
    if req.logit_bias:
        bias = request_logit_bias(req.logit_bias, engine.model.config.vocab_size)
        plan.sampler = replace(plan.sampler, logit_bias={**(plan.sampler.logit_bias or {}), **bias})
        plan.settings["request_logit_bias"] = {str(k): v for k, v in bias.items()}
    plan.settings.update(top_p=plan.top_p, n=req.n, max_tokens=max_tokens)
    return plan, max_tokens


def request_logit_bias(raw: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (JSON keys, so strings) to a bias in [-100, 100], added
    to those logits at every denoising step and on top of the model's own (``eval_ds.logit_bias``)."""
    out = {}
    for k, v in raw.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ServeError(f"logit_bias keys must be token ids, got {k!r}", 400, param="logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ServeError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}", 400,
                             param="logit_bias")
        out[tid] = float(v)
    try:
        check_logit_bias(out, vocab_size)
    except DGemmaError as e:
        raise ServeError(str(e), 400, param="logit_bias") from None
    return out


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ServeError(f"stop has {len(stops)} sequences; the limit is {MAX_STOPS}", 400, param="stop")
    if any(not s for s in stops):
        raise ServeError("stop sequences must not be empty", 400, param="stop")
    return stops


# ----------------------------------------------------------------------------------- sampling
class _AllFinished(Exception):
    """Every choice has finished (stop, length): the sampler need not finish its canvases."""


class Choices:
    """What the choices have produced: tokens, text, what was streamed, and why each ended.

    :meth:`add` takes one emitted canvas of one choice and returns the text to stream: the new
    text, less a tail that may be the start of a stop string (or a split UTF-8 character), which
    waits for the next canvas. A stop string ends the choice at its first match, a stop token
    (EOS, end-of-turn) at the token, ``max_tokens`` at that many tokens. The first ``skip`` tokens
    of every choice are a forced prefix the client sent (``continue_final_message``): not returned,
    not counted, and no stop string can match inside them.
    """

    def __init__(self, tokenizer, n: int, *, stop_ids, stops: list[str], max_tokens: int, skip: int = 0):
        self.tok, self.stop_ids, self.stops, self.max_tokens = tokenizer, set(stop_ids), stops, max_tokens
        self.skip = [skip] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.sent = [""] * n
        self.finish: list[str | None] = [None] * n

    @property
    def done(self) -> bool:
        return all(self.finish)

    def add(self, i: int, canvas: list[int]) -> str:
        canvas, self.skip[i] = canvas[self.skip[i]:], max(self.skip[i] - len(canvas), 0)
        cut = next((k + 1 for k, x in enumerate(canvas) if x in self.stop_ids), None)
        toks = (self.tokens[i] + canvas[:cut])[: self.max_tokens]
        text = self.tok.decode(toks)
        hits = [k for s in self.stops if (k := text.find(s)) >= 0]
        if hits:
            text, self.finish[i] = text[: min(hits)], "stop"
            toks = toks[: self._covering(toks, len(text))]
        elif toks and toks[-1] in self.stop_ids:
            self.finish[i] = "stop"
        elif len(toks) >= self.max_tokens:
            self.finish[i] = "length"
        self.tokens[i], self.text[i] = toks, text
        safe = text if self.finish[i] else text[: len(text) - self._held(text)]
        delta = safe[len(self.sent[i]):] if safe.startswith(self.sent[i]) else ""
        self.sent[i] += delta
        return delta

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may begin a stop string or a split character."""
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        while held < len(text) and text[len(text) - held - 1] == "\ufffd":
            held += 1
        return held

    def _covering(self, toks: list[int], chars: int) -> int:
        """The fewest leading tokens whose text reaches ``chars`` characters (the usage count of a
        choice cut by a stop string)."""
        lo, hi = 0, len(toks)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tok.decode(toks[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _usage(prompt_tokens: int, choices: Choices) -> dict:
    completion = sum(map(len, choices.tokens))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def sample_work(engine: Engine, plan: Plan, job, *, chat: bool, model_id: str, stops: list[str], max_tokens: int,
                stream: bool, include_usage: bool, prefix_tokens: int = 0) -> Callable:
    """The job of one request: ``work(emit)`` samples, streams one chunk per committed canvas
    per choice when ``stream``, and returns the whole response (what a non-streaming request
    answers)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    head = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": model_id}
    num_steps = plan.settings["num_steps"]

    def piece(i: int, text: str, finish: str | None) -> dict:
        if chat:
            return {"index": i, "delta": {"content": text} if text or not finish else {}, "logprobs": None,
                    "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

    def work(emit):
        choices = Choices(engine.tokenizer, plan.rows, stop_ids=engine.stop_ids, stops=stops, max_tokens=max_tokens,
                          skip=prefix_tokens)
        t0 = time.perf_counter()
        if stream and chat:
            for i in range(plan.rows):
                emit("chunk", {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})

        def on_step(*, canvas, step, t, rows, tokens, committed, argmax, done, reused=False) -> None:
            if job.cancel.is_set():
                raise Cancelled
            job.steps += 1
            final = emitted_canvases(tokens, committed, argmax, last=step == num_steps - 1)
            for j in done.nonzero().flatten().tolist():
                i = rows[j]
                if choices.finish[i]:
                    continue
                delta = choices.add(i, final[j].tolist())
                if stream:
                    emit("chunk", {**head, "choices": [piece(i, delta, choices.finish[i])]})
            if choices.done:
                raise _AllFinished

        try:
            run_sampler(engine, plan, on_step, guesses=False)  # it reads only the emitted canvases
        except _AllFinished:
            pass
        for i in range(plan.rows):  # the sampler ran out of canvases: the token budget is spent
            if choices.finish[i] is None:
                choices.finish[i] = "length"
                if stream:
                    emit("chunk", {**head, "choices": [piece(i, choices.text[i][len(choices.sent[i]):], "length")]})
        usage = _usage(len(plan.prompt_ids) + prefix_tokens, choices)  # the prefix is the client's text
        extra = {"dgemma": {**plan.settings, "seconds": round(time.perf_counter() - t0, 4)}}
        if stream:
            if include_usage:
                emit("chunk", {**head, "choices": [], "usage": usage})
            emit("done", {})
        if chat:
            out = [{"index": i, "message": {"role": "assistant", "content": choices.text[i]}, "logprobs": None,
                    "finish_reason": choices.finish[i]} for i in range(plan.rows)]
        else:
            out = [{"index": i, "text": choices.text[i], "logprobs": None, "finish_reason": choices.finish[i]}
                   for i in range(plan.rows)]
        return {"id": rid, "object": obj, "created": created, "model": model_id, "system_fingerprint": None,
                "choices": out, "usage": usage, **extra}

    return work


def encode_event(event: str, data: dict) -> bytes:
    """One SSE event of an OpenAI stream: ``data: {json}``, ``data: [DONE]``, or an error."""
    if event == "done":
        return b"data: [DONE]\n\n"
    if event == "error":
        data = openai_error(data["error"], 500)
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _respond(request: Request, req: _Sampling, engine: Engine, model_id: str, plan: Plan, max_tokens: int,
                   stops: list[str], chat: bool, prefix_tokens: int = 0):
    app = request.app
    job = start_job(app, "chat" if chat else "completion")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    work = sample_work(engine, plan, job, chat=chat, model_id=model_id, stops=stops, max_tokens=max_tokens,
                       stream=req.stream, include_usage=include_usage, prefix_tokens=prefix_tokens)
    if req.stream:
        return stream_job(app.state.executor, app.state.jobs, job, work, encode=encode_event)
    try:
        return await run_job(app.state.executor, app.state.jobs, job, work, request)
    except Cancelled:
        raise ServeError("the request was cancelled (the client left, or the server is shutting down)", 503,
                         code="cancelled") from None


def _check_chars(text: str, limits, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise ServeError(f"the prompt is too long: {len(text)} characters; the limit is {limits.max_prompt_chars} "
                         f"characters", 400, param=param, code="context_length_exceeded")


@router.post("/completions")
async def completions(req: CompletionRequest, request: Request):
    limits = request.app.state.limits
    model_id, role = _resolve(request.app, req.model)
    refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ServeError("prompt must be a string (or a list of one string): token-id prompts and several "
                             "prompts per request are not supported; send one request per prompt", 400,
                             param="prompt")
        prompt = prompt[0]
    _check_chars(prompt, limits, "prompt")
    stops = _stops(req.stop)
    engine = await load_engine(request.app, role)
    ids = await run_in_threadpool(_encode, engine, prompt, "prompt")
    plan, max_tokens = build_plan(engine, req, ids, limits, max_tokens=req.max_tokens, prompt_param="prompt")
    plan.hints = _pins(engine, prompt)
    return await _respond(request, req, engine, model_id, plan, max_tokens, stops, chat=False)


def _continued(fn):
    """``fn()``, a bad final message to continue (``continue_final_message``) answered as a 400."""
    try:
        return fn()
    except DGemmaError as e:
        raise ServeError(f"continue_final_message: {e}", 400, param="messages") from None


@router.post("/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    limits = request.app.state.limits
    model_id, role = _resolve(request.app, req.model)
    refuse_unsupported(req)
    _check_chars("".join(m.content if isinstance(m.content, str) else json.dumps(m.content)
                         for m in req.messages), limits, "messages")
    stops = _stops(req.stop)
    engine = await load_engine(request.app, role)
    messages, prefix = req.messages, None
    if req.continue_final_message:
        if len(messages) < 2 or messages[-1].role != "assistant":
            raise ServeError("continue_final_message: the messages must end with a user message and then an assistant "
                             "message, the start of the answer to continue", 400, param="messages")
        messages, prefix = messages[:-1], _text_of(messages[-1], len(messages) - 1)
    text, last_user = render_messages(engine.tokenizer, messages)
    ids = await run_in_threadpool(_encode, engine, text, "messages")
    k = _continued(lambda: len(resolve_prefix(prefix, engine.tokenizer)))
    plan, max_tokens = build_plan(engine, req, ids, limits, max_tokens=req.max_completion_tokens or req.max_tokens,
                                  prompt_param="messages", prefix_tokens=k)
    plan.hints = _pins(engine, last_user)
    _continued(lambda: with_prefix(engine, plan, prefix))
    return await _respond(request, req, engine, model_id, plan, max_tokens, stops, chat=True, prefix_tokens=k)

