"""A real headless Chromium drives the playground: it loads the page, solves a puzzle with the
shipped Sudoku checkpoint (``dgemma/shipped.py:SUDOKU``; a tiny run trained here when it is not
there yet), sees the board change at least twice before it is complete, and saves screenshots
in the test's output folder (``playground.png``: the whole page when done, ``sudoku_midsolve.png``:
the board halfway). Set ``DGEMMA_SCREENSHOT_DIR`` to copy them somewhere (docs/img).

Needs Chromium (Debian: ``apt-get install -y chromium``) and ``pip install playwright``; the
browser that ``playwright install`` downloads is not used. Skipped, with the reason, without them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the playground needs fastapi and uvicorn")
pytest.importorskip("uvicorn", reason="the playground needs fastapi and uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the browser itself comes from "
                                                            "apt-get install chromium)")

CHROMIUM = os.environ.get("DGEMMA_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set DGEMMA_CHROMIUM)",
                allow_module_level=True)

from dgemma import shipped  # noqa: E402
from dgemma.data.sudoku import generate_puzzles  # noqa: E402
from dgemma.serve.app import create_app  # noqa: E402
from dgemma.serve.engine import is_run  # noqa: E402

SHIPPED = shipped.SUDOKU
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Records the board after every DOM change: digits ('.' when empty), each cell's kind initial
# (c clue, k committed, n noisy, e empty) and the board state.
OBSERVE = """() => {
  const board = document.getElementById('board');
  window.__snaps = [];
  const snap = () => {
    const cells = Array.from(board.children);
    return {digits: cells.map(c => c.textContent || '.').join(''),
            kinds: cells.map(c => ({clue: 'c', committed: 'k', noisy: 'n', empty: 'e'})[c.dataset.kind]).join(''),
            state: board.dataset.state};
  };
  new MutationObserver(() => {
    const s = snap(), last = window.__snaps[window.__snaps.length - 1];
    if (!last || last.digits !== s.digits || last.kinds !== s.kinds || last.state !== s.state) window.__snaps.push(s);
  }).observe(board, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


@contextlib.contextmanager
def open_page(url: str):
    """Debian's Chromium, headless, with a fresh user data dir, on the playground at ``url`` once
    it is ready: yields ``(page, problems)``, the page's uncaught errors collected in ``problems``."""
    profile = tempfile.mkdtemp(prefix="dgemma-chromium-")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=ARGS, headless=True,
                                                   viewport={"width": 1280, "height": 1000})
        try:
            page = ctx.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            yield page, problems
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def sudoku_checkpoint(request) -> Path:
    if is_run(SHIPPED):
        return SHIPPED
    return request.getfixturevalue("tiny_run")


def test_browser_solves_a_puzzle_step_by_step(sudoku_checkpoint, live_server, tmp_path):
    server = live_server(create_app(sudoku=sudoku_checkpoint, text=None, device="cpu"))
    puzzle = generate_puzzles(1, seed=11, difficulty="easy")[0]["puzzle"]
    with open_page(server.url) as (page, problems):
        assert "training run" in page.inner_text("#s-model")

        # a bad puzzle gets the server's message in the page
        page.fill("#puzzle", puzzle[:80])
        page.click("#solve")
        page.wait_for_selector("#board[data-state='error']", timeout=30_000)
        assert "puzzle must have 81 cells" in page.inner_text("#s-error")

        page.fill("#puzzle", puzzle)
        page.select_option("#s-step_type", "commit")
        page.fill("#s-num_steps", "81")
        page.fill("#s-temperature", "0")
        page.select_option("#s-early_stopping", "none")
        page.fill("#s-delay_ms", "40")  # slow motion, so every step is painted
        assert page.is_checked("#s-verify")  # the page verifies by default; first the model alone
        page.uncheck("#s-verify")
        page.evaluate(OBSERVE)
        page.click("#solve")
        page.wait_for_function("Number(document.getElementById('board').dataset.step) >= 56", timeout=60_000)
        page.locator("#s-output").screenshot(path=str(tmp_path / "sudoku_midsolve.png"))
        page.wait_for_selector("#board[data-state='done']", timeout=120_000)
        assert page.is_hidden("#s-error")
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        snaps = page.evaluate("window.__snaps")
        status, verdict = page.inner_text("#s-status"), page.inner_text("#s-verdict")

        # the verified solve: model-only and verified figures side by side, never one number
        hard = generate_puzzles(1, seed=3, difficulty="hard")[0]["puzzle"]
        page.fill("#puzzle", hard)
        page.fill("#s-delay_ms", "0")
        page.check("#s-verify")
        page.fill("#s-verify_rounds", "2")
        page.click("#solve")
        page.wait_for_selector("#board[data-state='done']", timeout=120_000)
        v_status, v_verdict = page.inner_text("#s-status"), page.inner_text("#s-verdict")

    assert not problems, problems
    clues = [i for i, ch in enumerate(puzzle) if ch != "0"]
    # the board changed at least twice while still incomplete (noisy cells left) ...
    partial = {(s["digits"], s["kinds"]) for s in snaps if s["state"] == "solving" and "n" in s["kinds"]}
    assert len(partial) >= 2, f"the board changed only {len(partial)} time(s) before completing"
    committed = [s["kinds"].count("k") for s in snaps if s["state"] == "solving"]
    assert committed[-1] > committed[0]  # cells were committed one step after another
    # ... and ended complete: nothing noisy, clues kept (a cell stays empty only if the model's
    # answer ended early, which the tiny stand-in model may do)
    final = snaps[-1]
    assert final["state"] == "done" and set(final["kinds"]) <= {"c", "k", "e"}
    assert all(final["digits"][i] == puzzle[i] and final["kinds"][i] == "c" for i in clues)
    # the canvas ends at the step that commits its last cell: the 81st at the latest; a prefill and
    # one forward per step, less the steps after one that committed nothing (they reuse its logits)
    m = re.match(r"done · steps (\d+) · (\d+) forwards", status)
    blanks = puzzle.count("0")
    assert m and 60 < int(m[1]) <= 81 and blanks // 2 < int(m[2]) <= min(int(m[1]), blanks) + 1 and verdict, status
    assert re.match(r"done · model alone: \d+ forwards, (valid|not valid) · verified: \d of up to 2 rounds, "
                    r"\d+ forwards", v_status), v_status
    assert re.search(r"^(verified|not solved): .* — model alone: ", v_verdict), v_verdict
    for name in ("playground.png", "sudoku_midsolve.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    print(f"\nscreenshots: {tmp_path / 'playground.png'} and {tmp_path / 'sudoku_midsolve.png'}")
    if os.environ.get("DGEMMA_SCREENSHOT_DIR"):
        out = Path(os.environ["DGEMMA_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        for name in ("playground.png", "sudoku_midsolve.png"):
            shutil.copy(tmp_path / name, out / name)


PUBMEDQA = shipped.PUBMEDQA


@pytest.mark.skipif(not is_run(PUBMEDQA), reason="checkpoints/pubmedqa_270m is not there")
def test_browser_answers_a_pubmedqa_question_with_the_shipped_adapter(live_server, tmp_path):
    """The Text panel defaults to a trained model: the shipped PubMedQA adapter (no untrained
    warning), offers its held-out test questions, and answers one with a verdict."""
    import json

    examples = [json.loads(x) for x in (PUBMEDQA / "examples.jsonl").read_text().splitlines()]
    server = live_server(create_app(sudoku=None, text=PUBMEDQA, device="cpu"))
    with open_page(server.url) as (page, problems):
        model_line = page.inner_text("#t-model")
        assert "training run" in model_line and "warning" not in model_line, model_line
        assert page.locator("#t-example option").count() == len(examples) + 1
        page.select_option("#t-example", "0")
        assert page.input_value("#prompt") == examples[0]["prompt"]
        assert page.input_value("#system") == examples[0]["system"]
        page.fill("#t-num_steps", "16")
        page.fill("#t-max_canvases", "1")  # the verdict comes first: one canvas holds it
        # the run's interactive settings (eval_ds.interactive_*): no signal, no repeats
        assert page.is_visible("#t-self_condition") and not page.is_checked("#t-self_condition")
        assert page.is_visible("#t-no_repeat") and page.is_checked("#t-no_repeat")

        def generate() -> tuple[str, dict]:
            """Press Generate; the answer once done and the request body the page sent."""
            with page.expect_request("**/api/text/generate") as sent:
                page.click("#generate")
            page.wait_for_selector("#canvases[data-state='done']", timeout=180_000)
            return page.inner_text("#canvases"), json.loads(sent.value.post_data)

        text, body = generate()
        status = page.inner_text("#t-status")
        page.screenshot(path=str(tmp_path / "pubmedqa.png"), full_page=True)

        # the switch: on, the page asks for the signal, and the answer keeps its form
        page.check("#t-self_condition")
        text_on, body_on = generate()
        page.uncheck("#t-self_condition")

        # the no-repeat switch: shown for the commit step, on as the run has it, sent when cleared
        page.uncheck("#t-no_repeat")
        text_rep, body_rep = generate()
        page.select_option("#t-step_type", "confidence")
        assert not page.is_visible("#t-no_repeat")  # a commit-step rule

        # "answer starts with": the template pinned, so 8 steps keep its words (free, they can drop one)
        page.select_option("#t-step_type", "commit")
        page.uncheck("#t-no_repeat")
        page.fill("#t-num_steps", "8")
        page.fill("#answer-prefix", "The answer is:")
        text_pre, body_pre = generate()
    assert not problems, problems
    assert body_pre["prefix"] == "The answer is:"
    assert re.search(r"^\s*canvas 1.*\n?The answer is: (yes|no|maybe)", text_pre), text_pre
    assert "prefix" not in body  # the field left empty sends none
    assert body["no_repeat"] is True and body_rep["no_repeat"] is False
    assert re.search(r"The answer is: (yes|no|maybe)", text_rep), text_rep
    assert re.search(r"The answer is: (yes|no|maybe)", text), text
    assert "done" in status, status
    assert body["self_condition"] is False and body_on["self_condition"] is True
    assert re.search(r"The answer is: (yes|no|maybe)", text_on), text_on
