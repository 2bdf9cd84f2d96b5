"""The playground server: input validation, the event streams, lazy loading, concurrency and
client disconnects (a live uvicorn in a thread for the last two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="the playground needs fastapi (pip install fastapi uvicorn httpx)")
httpx = pytest.importorskip("httpx", reason="the playground tests need httpx")
pytest.importorskip("uvicorn", reason="the playground needs uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from dgemma import shipped  # noqa: E402
from dgemma.data.sudoku import generate_puzzles  # noqa: E402
from dgemma.errors import DGemmaError  # noqa: E402
from dgemma.serve.app import create_app  # noqa: E402
from dgemma.serve.engine import Limits, ModelSlot, is_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

PUZZLE = generate_puzzles(1, seed=5, difficulty="easy")[0]["puzzle"]


def events(lines) -> list[tuple[str, dict]]:
    """Parse an SSE body (an iterable of lines) into ``(event, data)`` pairs."""
    out, event = [], "message"
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            out.append((event, json.loads(line[5:])))
    return out


@pytest.fixture
def client(tiny_run):
    app = create_app(sudoku=tiny_run, text=tiny_run)
    with TestClient(app) as c:
        yield c


def solve(client, **body):
    return client.post("/api/sudoku/solve", json={"puzzle": PUZZLE, **body})


# ------------------------------------------------------------------------------------- the hook
def test_on_step_hook_reports_every_step_and_changes_nothing(tiny_run):
    from dgemma.diffusion.sampler import CanvasSampler
    from dgemma.diffusion.steps import build_step
    from dgemma.training.runs import load_run

    run = load_run(tiny_run, device="cpu")
    noise = run.noise()
    ids = torch.tensor([[2] + [5] * 81, [2] + [6] * 81])
    valid = torch.ones_like(ids, dtype=torch.bool)
    calls = []

    def sample(hook):
        s = CanvasSampler(noise=noise, step=build_step("commit", noise=noise), num_steps=9, canvas_size=81,
                          record=True, on_step=hook)
        return s(run.model, ids, valid, generator=torch.Generator().manual_seed(0))

    plain = sample(None)
    hooked = sample(lambda **kw: calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}))
    assert hooked.tokens == plain.tokens and hooked.trajectories == plain.trajectories
    assert [c["step"] for c in calls] == list(range(9)) and all(c["rows"] == [0, 1] for c in calls)
    for c in calls:
        for j in (0, 1):
            rec = plain.trajectories[j][c["step"]]
            assert c["tokens"][j].tolist() == rec["tokens"] and c["committed"][j].tolist() == rec["committed"]
            assert c["argmax"][j].tolist() == rec["argmax"]
    assert calls[-1]["done"].all() and not calls[0]["done"].any()


def test_a_run_decodes_with_its_own_eval_settings(tiny_run_sc, tmp_path):
    """The playground and the OpenAI API decode a run as its evaluations do: the request's settings
    on top of the run's ``eval_ds`` (commit blocks, ranking, the self-conditioning switch, the
    confidence threshold), not on top of the rules' bare defaults."""
    import shutil

    from dgemma.serve.engine import Engine, SampleParams, _run_info, make_plan, plan_sampler
    from dgemma.training.config import load_config
    from dgemma.training.runs import load_run

    work = tmp_path / "run"
    shutil.copytree(tiny_run_sc, work)
    raw = json.loads((work / "config.json").read_text())
    raw["eval_ds"].update(commit_block=3, commit_stable_first=False, self_condition=False, confidence_threshold=0.8,
                          commit_no_repeat=True)
    (work / "config.json").write_text(json.dumps(raw))
    cfg, limits = load_config(str(work / "config.json")), Limits()
    run = load_run(work, device="cpu")
    engine = Engine(_run_info(work, cfg, limits), run.model, run.tokenizer, run.noise())
    plan = make_plan(engine, SampleParams(step_type="commit", num_steps=3), [2, 5, 6], limits)
    sampler = plan_sampler(engine, plan, on_step=None)
    assert (sampler.step.block, sampler.step.stable_first, sampler.self_condition) == (3, False, False)
    assert sampler.step.no_repeat is True and plan.settings["no_repeat"] is True  # the run's eval_ds
    plan = make_plan(engine, SampleParams(step_type="commit", num_steps=3, no_repeat=False), [2, 5, 6], limits)
    assert plan_sampler(engine, plan, on_step=None).step.no_repeat is False and plan.settings["no_repeat"] is False
    assert plan.settings["commit_block"] == 3 and plan.settings["self_condition"] is False
    plan = make_plan(engine, SampleParams(step_type="confidence", num_steps=3), [2, 5, 6], limits)
    assert plan_sampler(engine, plan, on_step=None).step.threshold == 0.8  # the run's, not 0.9
    plan = make_plan(engine, SampleParams(step_type="confidence", threshold=0.5), [2, 5, 6], limits)
    assert plan_sampler(engine, plan, on_step=None).step.threshold == 0.5  # the request's wins

    # the page's self-conditioning switch starts at the run's setting, and a model without the
    # block has no switch and reports none
    assert engine.info.defaults["self_condition"] is False and engine.info.defaults["no_repeat"] is True
    raw["eval_ds"].pop("self_condition")
    (work / "config.json").write_text(json.dumps(raw))
    assert _run_info(work, load_config(str(work / "config.json")), limits).defaults["self_condition"] is True
    raw["model"]["self_conditioning"] = False
    (work / "config.json").write_text(json.dumps(raw))
    assert _run_info(work, load_config(str(work / "config.json")), limits).defaults["self_condition"] is None
    run.model.self_conditioning = None
    plan = make_plan(engine, SampleParams(step_type="commit", num_steps=3, self_condition=True), [2, 5, 6], limits)
    assert plan.settings["self_condition"] is None


def test_on_step_hook_exception_aborts_sampling(tiny_run):
    from dgemma.diffusion.sampler import CanvasSampler
    from dgemma.diffusion.steps import build_step
    from dgemma.training.runs import load_run

    run = load_run(tiny_run, device="cpu")
    noise = run.noise()
    seen = []

    def hook(**kw):
        seen.append(kw["step"])
        if kw["step"] == 2:
            raise KeyboardInterrupt  # any exception unwinds the sampler

    s = CanvasSampler(noise=noise, step=build_step("commit", noise=noise), num_steps=30, canvas_size=81, on_step=hook)
    ids = torch.tensor([[2] + [5] * 81])
    with pytest.raises(KeyboardInterrupt):
        s(run.model, ids, torch.ones_like(ids, dtype=torch.bool), generator=torch.Generator().manual_seed(0))
    assert seen == [0, 1, 2]


# ------------------------------------------------------------------------------------- pages and info
def test_page_and_static_files_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and "dgemma playground" in page.text
    for name in ("app.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200


def test_info_describes_both_models_without_loading_them(client, tiny_run):
    info = client.get("/api/info").json()
    s, t = info["models"]["sudoku"], info["models"]["text"]
    assert s["available"] and not s["loaded"] and s["source"] == str(tiny_run)
    assert s["process"] == "absorbing" and "ddim" not in s["step_types"] and "commit" in s["step_types"]
    assert s["defaults"]["num_steps"] == 81 and s["canvas_size"] == 81 and s["prompt_len"] == 82
    assert not t["loaded"]
    assert info["limits"]["max_steps"] == 512


def test_an_unadapted_base_is_flagged_untrained_and_a_run_is_not(tiny_run, tiny_text_model):
    from dgemma.cli.serve import parse, resolve_models

    with TestClient(create_app(sudoku=tiny_run, text=str(tiny_text_model))) as c:
        models = c.get("/api/info").json()["models"]
    assert "untrained" in models["text"]["warning"] and models["sudoku"]["warning"] is None
    # the default text model: the shipped adapted run where it exists, else the base (flagged)
    _, text = resolve_models(parse([]))
    from dgemma.cli.serve import ADAPTED_TEXT, DEFAULT_TEXT

    assert text == (str(ADAPTED_TEXT) if (ADAPTED_TEXT / "config.json").is_file() else DEFAULT_TEXT)


def test_random_puzzle_by_difficulty(client):
    from dgemma.data.sudoku import count_solutions

    for level, (lo, hi) in {"easy": (40, 50), "hard": (22, 29)}.items():
        d = client.get("/api/sudoku/random", params={"difficulty": level, "seed": 3}).json()
        assert d["difficulty"] == level and lo <= d["clues"] <= hi and count_solutions(d["puzzle"]) == 1
    bad = client.get("/api/sudoku/random", params={"difficulty": "fiendish"})
    assert bad.status_code == 400 and "easy, medium or hard" in bad.json()["error"]
    bad = client.get("/api/sudoku/random", params={"seed": -1})
    assert bad.status_code == 400 and "seed: Input should be greater than or equal to 0" in bad.json()["error"]


def test_workdirs_are_told_from_model_folders(tiny_run, tmp_path):
    from dgemma.serve.engine import is_run

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert is_run(tiny_run) and not is_run(hf) and not is_run(tmp_path)
    slot = ModelSlot("text", hf, limits=Limits())
    assert slot.describe()["kind"] == "pretrained"


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("puzzle, message", [
    ("123", "puzzle must have 81 cells"),
    ("x" + PUZZLE[1:], "puzzle has 'x' at cell 1 (row 1, column 1)"),
    ("55" + "0" * 79, "digit 5 appears twice in row 1"),
])
def test_bad_puzzle_is_refused_with_its_reason(client, puzzle, message):
    r = client.post("/api/sudoku/solve", json={"puzzle": puzzle})
    assert r.status_code == 400 and message in r.json()["error"]
    assert client.get("/api/status").json()["started"] == 0  # nothing ran


@pytest.mark.parametrize("body, message", [
    ({"step_type": "ddim"}, "needs uniform noise"),
    ({"step_type": "magic"}, "choose one of commit, confidence"),
    ({"num_steps": 10_000}, "over the limit of 512"),
    ({"num_steps": 0}, "num_steps: Input should be greater than or equal to 1"),
    ({"num_steps": "many"}, "num_steps: Input should be a valid integer"),
    ({"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ({"early_stopping": "soon"}, "early_stopping 'soon' is unknown"),
    ({"delay_ms": 60_000}, "delay_ms 60000 is over the limit of 2000"),
    ({"threshold": 2}, "threshold: Input should be less than or equal to 1"),
    ({"colour": "blue"}, "colour: is not a known setting"),
])
def test_bad_settings_are_refused(client, body, message):
    r = solve(client, **body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


def test_missing_puzzle_and_broken_json_are_refused(client):
    r = client.post("/api/sudoku/solve", json={})
    assert r.status_code == 400 and r.json()["error"] == "puzzle: is required"
    r = client.post("/api/sudoku/solve", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_text_prompts_are_validated(tiny_run):
    app = create_app(sudoku=None, text=tiny_run, limits=Limits(max_prompt_chars=500, max_canvases=4))
    with TestClient(app) as c:
        gen = lambda **b: c.post("/api/text/generate", json=b)  # noqa: E731
        r = gen(prompt="1" * 100)  # the run's prompt_len is 82 tokens
        assert r.status_code == 400
        assert r.json()["error"] == "the prompt is too long: 101 tokens; the limit is 82 tokens"
        r = gen(prompt="1" * 501)
        assert r.status_code == 400 and r.json()["error"] == ("the prompt is too long: 501 characters; "
                                                              "the limit is 500 characters")
        assert "the prompt is empty" in gen(prompt="  ").json()["error"]
        assert "not in the 'digits' tokenizer" in gen(prompt="hello").json()["error"]
        assert "max_canvases 5 is over the limit of 4" in gen(prompt="1", max_canvases=5).json()["error"]
        assert "exceed the model's 256 positions" in gen(prompt="1", max_canvases=4).json()["error"]
        assert "the response prefix is empty" in gen(prompt="1", prefix="").json()["error"]
        assert "nothing would be left to generate" in gen(prompt="1", prefix="1" * 81, max_canvases=1).json()["error"]
        assert c.get("/api/status").json()["started"] == 0


def test_text_answer_starts_with_the_requested_prefix(tiny_run):
    """The Text panel's "answer starts with": the prefix's tokens are committed in the first canvas
    from the first step on, the answer begins with them, and the start event reports the prefix."""
    app = create_app(sudoku=None, text=tiny_run)
    with TestClient(app) as c:
        with c.stream("POST", "/api/text/generate", json={"prompt": "123", "num_steps": 3, "prefix": "4567",
                                                         "seed": 1}) as r:
            assert r.status_code == 200
            evs = events(r.iter_lines())
    assert evs[0][1]["prefix"] == "4567"
    steps = [d for e, d in evs if e == "step" and d["canvas"] == 0]
    assert steps and all(d["tokens"][:4] == [["4", True], ["5", True], ["6", True], ["7", True]] for d in steps)
    assert evs[-1][0] == "done" and evs[-1][1]["text"].startswith("4567")


def test_oversized_body_is_refused(tiny_run):
    app = create_app(sudoku=tiny_run, text=None, limits=Limits(max_body_bytes=1000))
    with TestClient(app) as c:
        r = c.post("/api/sudoku/solve", json={"puzzle": "0" * 2000})
        assert r.status_code == 413 and "the limit is 1000" in r.json()["error"]


def test_missing_models_answer_503_with_a_hint(tmp_path):
    app = create_app(sudoku=tmp_path / "nowhere", text=None)
    with TestClient(app) as c:
        info = c.get("/api/info").json()["models"]
        assert not info["sudoku"]["available"]
        assert "dgemma train --cfg=configs/sudoku_small.py" in info["sudoku"]["error"]
        assert not info["text"]["available"]
        r = c.post("/api/sudoku/solve", json={"puzzle": PUZZLE})
        assert r.status_code == 503 and "no sudoku model at" in r.json()["error"]
        r = c.post("/api/text/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and "no text model is configured" in r.json()["error"]


# ------------------------------------------------------------------------------------- streams
def test_solve_streams_every_step_then_the_board(client):
    with client.stream("POST", "/api/sudoku/solve",
                       json={"puzzle": PUZZLE, "step_type": "commit", "num_steps": 81, "seed": 1}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        evs = events(r.iter_lines())
    kinds = [e for e, _ in evs]
    # a canvas ends at the step that commits its last cell, the 81st at the latest (the sampler's
    # settled rows): with the clues pinned the commit schedule may get there a step or two early
    n = kinds.count("step")
    assert 60 < n <= 81 and kinds == ["start"] + ["step"] * n + ["done"]
    start, steps, done = evs[0][1], [d for e, d in evs if e == "step"], evs[-1][1]
    assert start["puzzle"] == PUZZLE and start["seed"] == 1 and start["num_steps"] == 81
    clues = {i for i, ch in enumerate(PUZZLE) if ch != "0"}
    committed = [d["canvas_committed"] for d in steps]
    assert committed == sorted(committed) and committed[-1] == 81  # commits are final; the last step commits all
    for d in steps:
        assert len(d["cells"]) == 81
        assert all(d["cells"][i] == [PUZZLE[i], "clue"] for i in clues)  # the board always keeps the clues
        assert d["settled"] == sum(k == "committed" for _, k in d["cells"])
    # a prefill, then a forward at each step whose canvas changed since the last (else its logits are reused)
    settled = [len(clues)] + committed
    fwd = 1 + sum(i == 0 or settled[i] > settled[i - 1] for i in range(n))
    assert [d["step"] for d in steps] == list(range(1, n + 1)) and steps[-1]["forwards"] == fwd < n + 1
    assert len({json.dumps(d["cells"]) for d in steps}) > 2  # the board changes as it fills in
    assert {k for _, k in done["cells"]} <= {"clue", "committed", "empty"}
    s = done["stats"]
    assert s["forward_passes"] == fwd and s["steps_used"] == [n]
    assert s["tokens_per_forward"] == pytest.approx(81 / fwd, abs=1e-3)
    assert isinstance(done["solved"], bool) and done["verdict"]
    status = client.get("/api/status").json()
    assert status["done"] == 1 and status["jobs"][0]["steps"] == n


def test_pinned_clues_stay_in_the_models_answer(client):
    """The tiny run trained with data.pin_clues: the clues are pinned in the canvas, so the raw
    answer keeps every one of them (the trainer's rule, dgemma/tasks/sudoku.py:SudokuTask.hints)."""
    assert client.get("/api/info").json()["models"]["sudoku"]["pin_clues"]
    with client.stream("POST", "/api/sudoku/solve", json={"puzzle": PUZZLE, "num_steps": 30, "seed": 2}) as r:
        evs = events(r.iter_lines())
    assert evs[0][1]["pinned_clues"] is True
    clues = [i for i, ch in enumerate(PUZZLE) if ch != "0"]
    assert evs[1][1]["canvas_committed"] >= len(clues)  # pinned from the first step
    done = evs[-1][1]
    assert done["solution"] is not None and all(done["solution"][i] == PUZZLE[i] for i in clues)
    assert "contradicts" not in done["verdict"]


def test_verified_solve_streams_its_rounds_and_matches_dgemma_solve(client, tiny_run):
    """verify_rounds runs `dgemma solve`'s verified solve (the same boards, rounds and passes for
    the same seed and settings), streams every round, and keeps model-only and verified apart."""
    from dgemma.eval.sudoku_verify import DEFAULT_VARIANTS, solve_run
    from dgemma.training.runs import load_run

    puzzle = generate_puzzles(1, seed=3, difficulty="hard")[0]["puzzle"]
    body = {"puzzle": puzzle, "step_type": "commit", "num_steps": 81, "temperature": 0.0, "early_stopping": "none",
            "seed": 0, "verify_rounds": 3, "verify_variants": 1}
    with client.stream("POST", "/api/sudoku/solve", json=body) as r:
        assert r.status_code == 200
        evs = events(r.iter_lines())
    kinds = [e for e, _ in evs]
    assert kinds[0] == "start" and kinds[-1] == "done" and evs[0][1]["verify_rounds"] == 3
    done = evs[-1][1]
    run = load_run(tiny_run)
    [ref] = solve_run(run, puzzle, rounds=3, num_steps=81, step_type="commit", seed=0, variants=1)
    assert ref.rounds >= 1  # the tiny model breaks a rule: the rounds are exercised
    v, m = done["verified"], done["model_only"]
    assert (done["solved"], v["rounds"], v["forward_passes"], v["round_passes"]) == \
        (ref.valid, ref.rounds, ref.passes, ref.round_passes)
    assert (m["solution"], m["solved"], m["forward_passes"]) == (ref.model_grid, ref.model_valid, ref.model_passes)
    assert "".join(d or "0" for d, _ in done["cells"]) == ref.grid
    rounds = [d for e, d in evs if e == "round"]
    assert [d["round"] for d in rounds] == list(range(1, ref.rounds + 1)) and v["renoised"] == [d["renoised"] for d in rounds]
    # every forward pass of every round streamed a step, except each round's prefill; steps that
    # reused the last forward's logits streamed too, and the streamed forward count is exact
    assert kinds.count("step") >= ref.passes - (ref.rounds + 1)
    assert [d for e, d in evs if e == "step"][-1]["forwards"] == ref.passes
    assert done["verdict"].startswith("verified:" if ref.valid else "not solved:")
    assert m["verdict"] and ("solved" in m["verdict"]) == ref.model_valid
    for bad in (-1, 33, "x"):
        r = client.post("/api/sudoku/solve", json={**body, "verify_rounds": bad})
        assert r.status_code == 400 and "verify_rounds" in r.json()["error"]
        r = client.post("/api/sudoku/solve", json={**body, "verify_variants": bad if bad != -1 else 0})
        assert r.status_code == 400 and "verify_variants" in r.json()["error"]
    # the default: dgemma solve's variants, batched (the same board and passes as dgemma solve)
    with client.stream("POST", "/api/sudoku/solve", json={**body, "verify_variants": None}) as r:
        done = events(r.iter_lines())[-1][1]
    [ref] = solve_run(run, puzzle, rounds=3, num_steps=81, step_type="commit", seed=0, batch_size=DEFAULT_VARIANTS)
    assert done["verified"]["variants"] == DEFAULT_VARIANTS > 1
    assert (done["solved"], done["verified"]["forward_passes"], "".join(d or "0" for d, _ in done["cells"])) == \
        (ref.valid, ref.passes, ref.grid)


def test_same_seed_gives_the_same_board(client):
    def board(seed):
        with client.stream("POST", "/api/sudoku/solve", json={"puzzle": PUZZLE, "num_steps": 20, "temperature": 1.0,
                                                              "seed": seed}) as r:
            return events(r.iter_lines())[-1][1]["cells"]

    assert board(7) == board(7)


def test_text_model_loads_on_first_request_and_streams_canvases(tiny_run):
    app = create_app(sudoku=None, text=tiny_run)
    with TestClient(app) as c:
        slot: ModelSlot = app.state.models["text"]
        assert not slot.loaded
        assert not c.get("/api/info").json()["models"]["text"]["loaded"]
        with c.stream("POST", "/api/text/generate", json={"prompt": "123", "num_steps": 5, "step_type": "confidence",
                                                         "threshold": 0.5}) as r:
            assert r.status_code == 200
            evs = events(r.iter_lines())
        assert slot.loaded and c.get("/api/info").json()["models"]["text"]["loaded"]
    names = [e for e, _ in evs]
    assert names[0] == "start" and names[-1] == "done" and "canvas" in names
    steps = [d for e, d in evs if e == "step"]
    assert 1 <= len(steps) <= 5 and all(len(d["tokens"]) == 81 for d in steps)
    assert all(isinstance(p, str) and isinstance(s, bool) for d in steps for p, s in d["tokens"])
    assert evs[0][1]["threshold"] == 0.5 and evs[0][1]["prompt_tokens"] == 4
    done = evs[-1][1]
    assert done["stats"]["tokens"] == len(evs[names.index("canvas")][1]["tokens"])


@pytest.mark.parametrize("fused", [True, False])
def test_text_stream_counts_the_forwards_the_sampler_took(tiny_text_model, monkeypatch, fused):
    """Over several canvases the streamed forward count is the sampler's own: each finished canvas
    is appended within the next canvas's first pass, so it adds no forward (eval_ds.fuse_append);
    appended apart, each costs one."""
    import functools

    import dgemma.serve.engine as engine_mod

    monkeypatch.setattr(engine_mod, "SamplerConfig", functools.partial(engine_mod.SamplerConfig, fuse_append=fused))
    app = create_app(sudoku=None, text=tiny_text_model)
    with TestClient(app) as c:
        body = {"prompt": "the cat", "num_steps": 3, "seed": 0, "max_canvases": 3}
        with c.stream("POST", "/api/text/generate", json=body) as r:
            evs = events(r.iter_lines())
    steps = [d for e, d in evs if e == "step"]
    canvases = len({d["canvas"] for d in steps})
    assert canvases > 1  # an untrained base runs to max_canvases
    appends = 0 if fused else canvases - 1
    assert steps[-1]["forwards"] == evs[-1][1]["stats"]["forward_passes"] == 1 + len(steps) + appends


# ------------------------------------------------------------------------------------- live server
def _read_until(lines, event: str) -> dict:
    current = None
    for line in lines:
        if line.startswith("event:"):
            current = line[6:].strip()
        elif line.startswith("data:") and current == event:
            return json.loads(line[5:])
    raise AssertionError(f"the stream ended before a {event!r} event")


def _wait_for(predicate, timeout: float = 20.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


SLOW = {"puzzle": PUZZLE, "num_steps": 400, "delay_ms": 100}  # 40 s if nobody stops it


def test_client_disconnect_stops_sampling(tiny_run, live_server):
    server = live_server(create_app(sudoku=tiny_run, text=None))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/api/sudoku/solve", json=SLOW) as r:
            assert r.status_code == 200
            first = _read_until(r.iter_lines(), "step")
            assert first["step"] == 1
        # the connection is closed: the server must notice and stop the sampler
        job = _wait_for(lambda: next((j for j in http.get("/api/status").json()["jobs"]
                                      if j["status"] != "running"), None))
        assert job["status"] == "cancelled"
        steps = job["steps"]
        time.sleep(0.6)
        status = http.get("/api/status").json()
        assert status["running"] == 0 and status["cancelled"] == 1
        assert status["jobs"][0]["steps"] == steps < 20  # stopped for good, long before its 400 steps


def test_slow_request_does_not_block_others(tiny_run, live_server):
    server = live_server(create_app(sudoku=tiny_run, text=tiny_run))
    with httpx.Client(base_url=server.url, timeout=30) as slow, httpx.Client(base_url=server.url, timeout=30) as http:
        with slow.stream("POST", "/api/sudoku/solve", json=SLOW) as r:
            lines = r.iter_lines()
            _read_until(lines, "step")
            t0 = time.monotonic()
            assert http.get("/api/info").status_code == 200
            assert http.get("/api/sudoku/random", params={"difficulty": "easy"}).status_code == 200
            fast = http.post("/api/sudoku/solve", json={"puzzle": PUZZLE, "num_steps": 3})
            assert fast.status_code == 200 and events(fast.text.splitlines())[-1][0] == "done"
            text = http.post("/api/text/generate", json={"prompt": "12", "num_steps": 3})
            assert events(text.text.splitlines())[-1][0] == "done"
            took = time.monotonic() - t0
            status = http.get("/api/status").json()
            assert status["running"] == 1 and status["done"] == 2  # the slow one is still going
            assert _read_until(lines, "step")["step"] >= 2  # and still streaming
        assert took < 20, f"other requests took {took:.1f} s while a slow one ran"


def test_full_server_refuses_with_429_and_retry_after(tiny_run, live_server):
    server = live_server(create_app(sudoku=tiny_run, text=None, limits=Limits(max_jobs=1)))
    with httpx.Client(base_url=server.url, timeout=30) as slow, httpx.Client(base_url=server.url, timeout=30) as http:
        with slow.stream("POST", "/api/sudoku/solve", json=SLOW) as r:
            lines = r.iter_lines()  # kept: a dropped iterator may close the connection, and cancel the job
            _read_until(lines, "step")
            busy = http.post("/api/sudoku/solve", json={"puzzle": PUZZLE, "num_steps": 3})
            assert busy.status_code == 429 and "1 sampling requests are running (the limit)" in busy.json()["error"]
            assert 1 <= int(busy.headers["Retry-After"]) <= 30
        _wait_for(lambda: http.get("/api/status").json()["running"] == 0)
        again = http.post("/api/sudoku/solve", json={"puzzle": PUZZLE, "num_steps": 3})
        assert again.status_code == 200  # the cancelled job gave its slot back


# ------------------------------------------------------------------------------------- the CLI
def test_cli_resolves_models(tiny_run, tmp_path):
    from dgemma.cli.serve import ADAPTED_TEXT, parse, resolve_models

    text = str(ADAPTED_TEXT) if is_run(ADAPTED_TEXT) else "gemma3-270m"  # the shipped adapter where present
    assert resolve_models(parse(["--checkpoint", str(tiny_run)])) == (str(tiny_run), text)
    assert resolve_models(parse(["--text-model", "none", "--sudoku-checkpoint", "none"])) == (None, None)
    assert resolve_models(parse([])) == (str(shipped.SUDOKU), text)
    with pytest.raises(DGemmaError, match="pass one"):
        resolve_models(parse(["--checkpoint", str(tiny_run), "--sudoku-checkpoint", str(tiny_run)]))
    with pytest.raises(DGemmaError, match="no such workdir"):
        resolve_models(parse(["--text-model", str(tmp_path / "missing")]))
    with pytest.raises(DGemmaError, match="not a training workdir"):
        resolve_models(parse(["--checkpoint", str(tmp_path)]))
    with pytest.raises(DGemmaError, match="--port must be in 0..65535"):
        parse(["--port", "70000"])


def test_cli_serves_on_loopback(tiny_run):
    cmd = [sys.executable, "-m", "dgemma", "serve", "--port", "0", "--sudoku-checkpoint", str(tiny_run),
           "--text-model", "none", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("[dgemma] serving the playground at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        info = httpx.get(url + "api/info", timeout=30).json()
        assert info["models"]["sudoku"]["source"] == str(tiny_run) and not info["models"]["text"]["available"]
    finally:
        proc.terminate()
        proc.wait(30)
