"""The OpenAI-compatible API of ``dgemma serve``, driven by the official ``openai`` client against
a real ``dgemma serve`` process on 127.0.0.1 (a random free port) serving two tiny models: an
untrained 2-layer Gemma 3 with a byte-level BPE tokenizer (any text, the chat template) and the
tiny Sudoku run (digits). A few cases that need a one-slot server run uvicorn in a thread."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="the server needs fastapi and uvicorn")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx")
openai = pytest.importorskip("openai", reason="pip install openai (the dev extra has it)")

from dgemma.data.sudoku import generate_puzzles  # noqa: E402

FAST = {"steps": 4}  # denoising steps per canvas: the tiny model needs no more to exercise the API


@pytest.fixture(scope="module")
def server(serve_process, tiny_text_model, tiny_run):
    s = serve_process("--text-model", str(tiny_text_model), "--sudoku-checkpoint", str(tiny_run), "--max-jobs", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    from dgemma.data.tokenizers import load_tokenizer

    return load_tokenizer(tiny_text_model)


def complete(client, **kw):
    args = {"model": "tiny_text", "prompt": "The capital of France is", "max_tokens": 64, "temperature": 1.0,
            "seed": 1, **kw}
    args["extra_body"] = {**FAST, **args.get("extra_body", {})}
    return client.completions.create(**args)


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


# ------------------------------------------------------------------------------------- models
def test_models_are_listed_by_name(client, server, tiny_run):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny_text", "tiny_sudoku"}
    assert models["tiny_sudoku"].owned_by == "dgemma" and models["tiny_sudoku"].dgemma["source"] == str(tiny_run)
    assert client.models.retrieve("tiny_text").id == "tiny_text"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found" and "it serves: tiny_sudoku, tiny_text" in e.value.message


# ------------------------------------------------------------------------------------- completions
def test_completion_counts_its_tokens(client, tokenizer):
    prompt = "The capital of France is"
    r = complete(client, prompt=prompt, max_tokens=40)
    assert r.object == "text_completion" and r.model == "tiny_text" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(tokenizer.encode(prompt, add_bos=True))
    assert 1 <= u.completion_tokens <= 40 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 40  # cut at max_tokens, inside the second canvas of 32
    assert r.dgemma["seed"] == 1 and r.dgemma["num_steps"] == 4 and r.dgemma["max_canvases"] == 2


def test_same_seed_same_output_and_n_choices(client):
    one = complete(client, seed=7)
    three = complete(client, seed=7, n=3)
    assert complete(client, seed=7, n=3).choices == three.choices  # reproducible
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice i draws from its own (seed, i) stream
    assert len({c.text for c in three.choices}) == 3  # and the streams differ
    assert complete(client, seed=8).choices[0].text != one.choices[0].text
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once


def test_streaming_sends_one_chunk_per_canvas_and_the_same_text(client):
    plain = complete(client, seed=3, n=2, max_tokens=96)
    chunks = list(complete(client, seed=3, n=2, max_tokens=96, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage  # include_usage: the last chunk
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(p.text for p in mine) == plain.choices[i].text
        assert [p.finish_reason for p in mine][-1] == plain.choices[i].finish_reason
        assert all(p.finish_reason is None for p in mine[:-1])
        assert 1 <= len(mine) <= 3  # at most one chunk per committed canvas: 96 tokens are 3 canvases of 32
    assert len({c.id for c in chunks}) == 1


def test_stream_wire_format(server):
    """What the client parses for us: ``data: {json}`` events (a comment while a step is slow) and a
    last ``data: [DONE]``, as text/event-stream."""
    body = {"model": "tiny_text", "prompt": "hello", "max_tokens": 64, "seed": 1, "stream": True, **FAST}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line and not line.startswith(":")]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) <= 2 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["object"] == "text_completion" and c["model"] == "tiny_text" for c in chunks)


def test_stop_strings_cut_the_output(client):
    full = complete(client, seed=11, max_tokens=96).choices[0].text
    start = next(i for i in range(4, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[start:start + 2]
    cut = complete(client, seed=11, max_tokens=96, stop=[stop, "never-there"])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = complete(client, seed=11, max_tokens=96, stop=stop, stream=True)
    pieces = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in pieces) == full[:full.index(stop)] and pieces[-1].finish_reason == "stop"
    assert cut.usage.completion_tokens <= complete(client, seed=11, max_tokens=96).usage.completion_tokens


def test_self_condition_is_a_request_setting(client, tiny_run_sc, live_server):
    """``self_condition`` in the extra body switches the signal for one request, reported back;
    unset, the run's own setting (its ``eval_ds.self_condition``, True) holds. A model without a
    self-conditioning block (the tiny Sudoku run, like the shipped one) reports none."""
    from dgemma.serve.app import create_app

    puzzle = generate_puzzles(1, seed=5, difficulty="easy")[0]["puzzle"]
    server = live_server(create_app(sudoku=tiny_run_sc, text=None, device="cpu"))
    sc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    plain = sc.completions.create(model="tiny_sudoku_sc", prompt=puzzle, extra_body={"steps": 4})
    off = sc.completions.create(model="tiny_sudoku_sc", prompt=puzzle, extra_body={"steps": 4, "self_condition": False})
    assert plain.dgemma["self_condition"] is True and off.dgemma["self_condition"] is False
    norep = sc.completions.create(model="tiny_sudoku_sc", prompt=puzzle,
                                  extra_body={"steps": 4, "step_type": "commit", "no_repeat": True})
    assert norep.dgemma["no_repeat"] is True
    assert plain.dgemma["no_repeat"] is (False if plain.dgemma["step_type"] == "commit" else None)  # the run's: off
    with pytest.raises(openai.BadRequestError):
        sc.completions.create(model="tiny_sudoku_sc", prompt=puzzle, extra_body={"self_condition": "sometimes"})
    none = client.completions.create(model="tiny_sudoku", prompt=puzzle, extra_body={"steps": 4, "self_condition": False})
    assert none.dgemma["self_condition"] is None


def test_sudoku_completion_keeps_the_pinned_clues(client):
    puzzle = generate_puzzles(1, seed=5, difficulty="easy")[0]["puzzle"]
    r = client.completions.create(model="tiny_sudoku", prompt=puzzle, extra_body={"steps": 20})
    text = r.choices[0].text
    assert r.usage.prompt_tokens == 82 and r.dgemma["canvas_size"] == 81
    assert all(text[i] == ch for i, ch in enumerate(puzzle) if ch != "0" and i < len(text))


def test_logit_bias_steers_every_position(client, tokenizer):
    """OpenAI's ``logit_bias``: +100 on one token makes it the argmax everywhere, so a greedy
    completion is that token repeated (the tiny model is untrained: nothing else would do it); an
    empty bias changes nothing; bad keys and values are 400s that name it. (-100 and the exact
    additive shift: tests/diffusion/test_logit_bias.py.)"""
    greedy = {"temperature": 0.0, "extra_body": {"steps": 4, "step_type": "confidence"}}
    tid = tokenizer.encode(" the")[0]
    r = complete(client, max_tokens=32, logit_bias={str(tid): 100}, **greedy)
    ids = tokenizer.encode(r.choices[0].text)
    assert r.choices[0].text == tokenizer.decode([tid] * 32) and r.usage.completion_tokens == 32, ids
    assert r.dgemma["request_logit_bias"] == {str(tid): 100.0}
    plain = complete(client, max_tokens=32, **greedy)
    assert plain.choices[0].text != r.choices[0].text
    assert complete(client, max_tokens=32, logit_bias={}, **greedy).choices == plain.choices  # empty: no change
    for bias, message in (({"x": 1}, "keys must be token ids"), ({"5": 101}, "number in [-100, 100]"),
                          ({"99999999": 1}, "not in the vocabulary"), ({"5": "a"}, "must be numbers")):
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, logit_bias=bias)
        assert e.value.param == "logit_bias" and message in e.value.message, (bias, e.value.message)


# ------------------------------------------------------------------------------------- chat
def test_chat_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model="tiny_text", messages=messages, max_tokens=32, seed=2,
                                       extra_body=FAST)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tokenizer.encode(tokenizer.render_chat(messages), add_bos=True))
    chunks = list(client.chat.completions.create(model="tiny_text", messages=messages, max_tokens=32, seed=2,
                                                 stream=True, extra_body=FAST))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_continues_the_final_assistant_message(client, tokenizer, tiny_text_model):
    """vLLM's ``continue_final_message``: the reply is what follows the assistant's start, which is
    pinned at the start of the first canvas. Reference: the same engine sampling the conversation
    without that message, the start's tokens pinned as hints, with the API's per-choice seeding
    (greedy, but this model's noise is uniform: the first canvas is drawn)."""
    from dgemma.serve.engine import Limits, ModelSlot, SampleParams, make_plan, run_sampler

    msgs, start = [{"role": "user", "content": "hello world"}], "Well, the"
    kw = {"model": "tiny_text", "max_tokens": 40, "temperature": 0.0, "seed": 0,
          "extra_body": {**FAST, "continue_final_message": True}}
    r = client.chat.completions.create(messages=msgs + [{"role": "assistant", "content": start}], **kw)
    pre = tokenizer.encode(start)
    prompt = tokenizer.encode(tokenizer.render_chat(msgs, add_generation_prompt=True), add_bos=True)
    assert r.usage.prompt_tokens == len(prompt) + len(pre) and r.dgemma["prefix"] == start
    assert 1 <= r.usage.completion_tokens <= 40 and r.dgemma["max_canvases"] == 2  # 40 new + the start's tokens

    engine = ModelSlot("text", tiny_text_model, limits=Limits(), device="cpu").get()
    plan = make_plan(engine, SampleParams(num_steps=4, temperature=0.0, seed=0), prompt, Limits(), 2)
    plan.hints, plan.row_seeds = list(pre) + [-1] * (2 * engine.info.canvas_size - len(pre)), True
    toks = run_sampler(engine, plan, on_step=None).tokens[0]
    assert toks[:len(pre)] == pre
    new = toks[len(pre):]
    new = new[: next((i + 1 for i, t in enumerate(new) if t in engine.stop_ids), len(new))][:40]
    assert r.usage.completion_tokens == len(new)
    assert r.choices[0].message.content == tokenizer.decode(new)
    chunks = list(client.chat.completions.create(messages=msgs + [{"role": "assistant", "content": start}],
                                                 stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content

    for messages, why in [(msgs, "must end with a user message and then an assistant message"),
                          ([{"role": "assistant", "content": start}], "must end with a user message"),
                          (msgs + [{"role": "assistant", "content": ""}], "the response prefix is empty"),
                          (msgs + [{"role": "assistant", "content": "a b " * 40}], "plus the final message's")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=messages, **kw)
        assert e.value.param in ("messages", "max_tokens") and why in e.value.message, e.value.message


def test_chat_refuses_what_it_cannot_do(client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "the last message must be a user message"),
        ({"messages": msgs, "logprobs": True}, "logprobs", "logprobs is not supported"),
        ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "no tool calling"),
        ({"messages": msgs, "top_p": 0.5, "extra_body": {"step_type": "entropy_bound"}}, "top_p", "entropy_bound"),
        ({"messages": msgs, "n": 9}, "n", "n 9 is over the limit of 8"),
    ]
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny_text", **kw)
        assert e.value.param == param and message in e.value.message, (kw, e.value.message)
        assert e.value.type == "invalid_request_error"


# ------------------------------------------------------------------------------------- errors
def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, model="nope")
    assert e.value.status_code == 404 and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, max_tokens=10_000)
    assert e.value.param == "max_tokens" and "over the limit of 512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, max_tokens=120)  # 4 canvases of 32 after a 6-token prompt: past the 128 positions
    assert e.value.code == "context_length_exceeded" and "leave room for 96" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"stepz": 3})
    assert e.value.param == "stepz" and e.value.message.endswith("Unrecognized request argument supplied: stepz")
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"steps": 0})
    assert e.value.param == "steps"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, model="tiny_sudoku", prompt="letters")
    assert e.value.param == "prompt" and "not in the 'digits' tokenizer" in e.value.message

    url = server.url + "/v1/completions"
    r = httpx.post(url, content=b'{"model": "tiny_text", "prompt": ', headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    r = httpx.post(url, json={"model": "tiny_text", "prompt": "x" * (1 << 20)}, timeout=30)  # past the 1 MiB limit
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, content=iter([b'{"prompt": "', b"x" * (1 << 20), b'"}']), timeout=30)  # chunked: no length
    assert r.status_code == 413 and "over the limit of 1048576 bytes" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(server.url + "/api/text/generate", json={}).json() == {"error": "prompt: is required"}
    assert server.status()["failed"] == 0


# ------------------------------------------------------------------------------------- capacity, disconnects
SLOW = {"steps": 8000, "step_type": "ddim"}  # ~7 s a canvas (ddim commits nothing, so no canvas ends early)


@pytest.fixture
def one_slot(tiny_text_model, live_server):
    from dgemma.serve.app import create_app
    from dgemma.serve.engine import Limits

    server = live_server(create_app(sudoku=None, text=tiny_text_model, limits=Limits(max_jobs=1, max_steps=8000)))
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_over_capacity_is_429_with_retry_after(one_slot):
    server, client = one_slot
    msgs = [{"role": "user", "content": "hi"}]
    stream = client.chat.completions.create(model="tiny_text", messages=msgs, max_tokens=96, stream=True,
                                            extra_body=SLOW)
    next(iter(stream))  # the role chunk: the job holds the slot
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny_text", messages=msgs, max_tokens=32, extra_body=FAST)
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 30
    stream.close()
    _wait_for(lambda: httpx.get(server.url + "/api/status").json()["running"] == 0)
    assert client.chat.completions.create(model="tiny_text", messages=msgs, max_tokens=32, extra_body=FAST).choices


def test_disconnects_cancel_the_job(one_slot):
    server, client = one_slot
    status = lambda: httpx.get(server.url + "/api/status").json()  # noqa: E731
    stream = client.completions.create(model="tiny_text", prompt="hi", max_tokens=96, stream=True, extra_body=SLOW)
    next(iter(stream))
    stream.close()  # a streaming client leaves after its first canvas
    _wait_for(lambda: status()["cancelled"] == 1 and status()["running"] == 0)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client gives up waiting
        httpx.post(server.url + "/v1/completions", json={"model": "tiny_text", "prompt": "hi", "max_tokens": 96,
                                                         **SLOW}, timeout=1.0)
    _wait_for(lambda: status()["cancelled"] == 2 and status()["running"] == 0)
    steps = status()["jobs"][0]["steps"]
    time.sleep(0.6)
    assert status()["jobs"][0]["steps"] == steps < 8000  # stopped for good, inside its first canvas


def test_the_api_runs_the_lm_head_only_where_the_step_reads(tiny_run, live_server, tmp_path, monkeypatch):
    """The API's hook reads only the canvases the sampler emits, never the model's guesses, so for
    a run that commits in blocks without a self-conditioning signal the LM head runs only where the
    step reads (as in ``dgemma generate``), and the completion is the one of a sampler that reads
    every open position."""
    import shutil

    import dgemma.diffusion.sampler as sampler_mod
    import dgemma.serve.openai_api as api
    from dgemma.serve.app import create_app

    work = tmp_path / "blocks"
    shutil.copytree(tiny_run, work)
    raw = json.loads((work / "config.json").read_text())
    raw["eval_ds"].update(commit_block=3)
    (work / "config.json").write_text(json.dumps(raw))
    head_rows, asked, force = [], [], {}
    real_head, real_run = sampler_mod.vocab_logits, api.run_sampler

    def counting(model, hidden, tokens, open_, **kw):
        head_rows.append(int(open_.sum()))
        return real_head(model, hidden, tokens, open_, **kw)

    def run(engine, plan, on_step, guesses=True):
        asked.append(guesses)
        return real_run(engine, plan, on_step, guesses=force.get("guesses", guesses))

    monkeypatch.setattr(sampler_mod, "vocab_logits", counting)
    monkeypatch.setattr(api, "run_sampler", run)
    server = live_server(create_app(sudoku=work, text=None, device="cpu"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    puzzle = generate_puzzles(1, seed=5, difficulty="easy")[0]["puzzle"]
    ask = {"model": "blocks", "prompt": puzzle, "temperature": 0, "seed": 3, "extra_body": {"steps": 8}}
    fast = client.completions.create(**ask)
    fast_rows = sum(head_rows)
    head_rows.clear()
    force["guesses"] = True  # the same request through a sampler whose hook reads the guesses
    slow = client.completions.create(**ask)
    assert asked == [False, False]
    assert fast.choices[0].text == slow.choices[0].text and len(fast.choices[0].text) > 40
    assert fast_rows < sum(head_rows)
