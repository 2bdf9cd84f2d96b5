"""``dgemma generate``: a run's sampler on prompts from the command line or a file."""

import json
import subprocess
import sys

import pytest

from dgemma.cli import generate
from dgemma.errors import DGemmaError

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dgemma", "generate", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})


def test_run_prompts_jsonl_and_seed(tiny_run, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PUZZLE}) + "\n\n" + json.dumps({"prompt": PUZZLE[::-1]}) + "\n")
    out = tmp_path / "o.jsonl"
    r = cli("--checkpoint", str(tiny_run), "--file", str(prompts), "--out", str(out), "--steps", "4", "--seed", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["prompt"] for x in rows] == [PUZZLE, PUZZLE[::-1]]
    assert all(x["tokens"] > 0 and x["forward_passes"] >= 2 and x["settings"]["num_steps"] == 4 for x in rows)
    assert "untrained" not in r.stderr and "tokens/s" in r.stderr
    again = tmp_path / "again.jsonl"
    cli("--checkpoint", str(tiny_run), "--file", str(prompts), "--out", str(again), "--steps", "4", "--seed", "3")
    assert [json.loads(x)["output"] for x in again.read_text().splitlines()] == [x["output"] for x in rows]
    assert all(x["settings"]["self_condition"] is True for x in rows)  # the run's default
    plain = tmp_path / "plain.jsonl"
    r = cli("--checkpoint", str(tiny_run), "--file", str(prompts), "--out", str(plain), "--steps", "4",
            "--no-self-condition", "--no-repeat", "--reuse-canvas-keys", "--shortlist", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(json.loads(x)["settings"]["self_condition"] is False for x in plain.read_text().splitlines())
    assert all(json.loads(x)["settings"]["commit_no_repeat"] is True for x in plain.read_text().splitlines())
    assert all(x["settings"]["commit_no_repeat"] is False for x in rows)  # the run's default
    assert all(json.loads(x)["settings"]["reuse_canvas_keys"] is True for x in plain.read_text().splitlines())
    assert all(x["settings"]["reuse_canvas_keys"] is False for x in rows)
    assert all(json.loads(x)["settings"]["shortlist"] == 8 for x in plain.read_text().splitlines())
    assert all(x["settings"]["shortlist"] == 0 for x in rows)
    conf = tmp_path / "conf.jsonl"
    r = cli("--checkpoint", str(tiny_run), "--file", str(prompts), "--out", str(conf), "--steps", "4",
            "--step-type", "confidence", "--threshold", "0.5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert all((s["step_type"], s["confidence_threshold"]) == ("confidence", 0.5)
               for s in (json.loads(x)["settings"] for x in conf.read_text().splitlines()))
    pre = tmp_path / "prefix.jsonl"
    r = cli("--checkpoint", str(tiny_run), "--file", str(prompts), "--out", str(pre), "--steps", "4", "--prefix", "53")
    assert r.returncode == 0, r.stderr[-2000:]
    rows_pre = [json.loads(x) for x in pre.read_text().splitlines()]
    assert all(x["output"].startswith("53") and len(x["settings"]["prefix"]) == 2 for x in rows_pre)
    assert all(x["settings"]["prefix"] == [] for x in rows)  # none unless asked


def test_unadapted_base_warns(tiny_text_model):
    r = cli("--pretrained", str(tiny_text_model), "hello world", "--steps", "2", "--canvases", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "diffusion modules are untrained" in r.stderr


def test_bad_input_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = cli("--checkpoint", str(tmp_path / "missing"), "hi")
    assert r.returncode == 2 and "no checkpoint at" in r.stderr and "Traceback" not in r.stderr
    args = generate.parse(["--file", str(bad)])
    with pytest.raises(DGemmaError, match=r"bad.jsonl:2: a JSONL prompt needs a string field 'prompt'"):
        generate.read_prompts(args)
    with pytest.raises(DGemmaError, match="--steps must be >= 1"):
        generate.parse(["x", "--steps", "0"])
    with pytest.raises(DGemmaError, match=r"--threshold must lie in \[0, 1\], got 1.5"):
        generate.parse(["x", "--threshold", "1.5"])
    with pytest.raises(DGemmaError, match="--prefix is empty"):
        generate.parse(["x", "--prefix", ""])


def test_examples_shipped_with_a_model(tiny_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    examples = [{"id": "a", "prompt": f"Context:\nx\n\nQuestion: {PUZZLE}", "label": "yes"},
                {"id": "b", "prompt": PUZZLE[::-1], "label": "no"}]
    (run / "examples.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    listed = cli("--checkpoint", str(run), "--list-examples")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.splitlines() == [f"0\tyes\t{PUZZLE}", f"1\tno\t{PUZZLE[::-1]}"]
    out = tmp_path / "o.jsonl"
    r = cli("--checkpoint", str(run), "--example", "1", "--out", str(out), "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["prompt"] == PUZZLE[::-1] and row["label"] == "no"
    bad = cli("--checkpoint", str(run), "--example", "2")
    assert bad.returncode != 0 and "examples 0..1" in bad.stderr


def test_a_run_decodes_interactively_with_its_interactive_settings(tiny_run, tmp_path):
    """``eval_ds.interactive_steps`` / ``interactive_early_stopping`` set what generate, the
    playground, load_model and the lm-eval model decode with unless asked; unset, the run's first
    evaluation (``steps[0]``, ``early_stopping``). ``interactive_self_condition`` /
    ``interactive_no_repeat`` / ``interactive_reuse_canvas_keys`` replace their ``eval_ds``
    counterparts for the same front ends, and not for ``dgemma eval`` (its tables stay as measured).
    The shipped PubMedQA adapter names 16 steps and no early stop: its first evaluation (8 steps)
    loses a fifth of the test verdicts."""
    import shutil

    from dgemma import shipped
    from dgemma.eval import harness
    from dgemma.lm_eval_model import DGemmaLM
    from dgemma.sampling import interactive_cfg, load_model
    from dgemma.serve.engine import Limits, ModelSlot
    from dgemma.tasks import get_task
    from dgemma.training.config import load_config
    from dgemma.training.runs import load_run

    work = tmp_path / "run"
    shutil.copytree(tiny_run, work)
    raw = json.loads((work / "config.json").read_text())

    def front_ends(**eval_ds):
        raw["eval_ds"].update(steps=[3, 5], early_stopping="entropy", **eval_ds)
        (work / "config.json").write_text(json.dumps(raw))
        cfg = load_config(str(work / "config.json"))
        info = ModelSlot("text", work, limits=Limits()).info()  # the playground's and the OpenAI API's
        serve = info.defaults
        lm = DGemmaLM(run=str(work), device="cpu")
        model = load_model(work, device="cpu")
        r = cli("--checkpoint", str(work), PUZZLE, "--out", str(tmp_path / "o.jsonl"))
        assert r.returncode == 0, r.stderr[-2000:]
        gen = json.loads((tmp_path / "o.jsonl").read_text())["settings"]
        m, ls, se = model.defaults, lm.run_settings, info.cfg.eval_ds
        flags = {(m.self_condition, m.commit_no_repeat, m.reuse_canvas_keys, m.shortlist),
                 (se.self_condition, serve["no_repeat"], se.reuse_canvas_keys, se.shortlist),
                 (ls.self_condition, ls.commit_no_repeat, ls.reuse_canvas_keys, ls.shortlist),
                 (gen["self_condition"], gen["commit_no_repeat"], gen["reuse_canvas_keys"], gen["shortlist"])}
        return {(m.num_steps, m.early_stopping), (serve["num_steps"], serve["early_stopping"]),
                (lm.steps, lm.early_stopping or "none"), (gen["num_steps"], gen["early_stopping"]),
                (interactive_cfg(cfg).eval_ds.steps[0], interactive_cfg(cfg).eval_ds.early_stopping)}, flags

    assert front_ends() == ({(3, "entropy")}, {(True, False, False, 0)})
    steps, flags = front_ends(interactive_steps=5, interactive_early_stopping="none", interactive_self_condition=False,
                              interactive_no_repeat=True, interactive_reuse_canvas_keys=True, interactive_shortlist=64)
    assert steps == {(5, "none")} and flags == {(False, True, True, 64)}
    r = cli("--checkpoint", str(work), PUZZLE, "--out", str(tmp_path / "o.jsonl"), "--self-condition",
            "--allow-repeats", "--no-reuse-canvas-keys", "--shortlist", "0")  # asked: each default turned back off
    assert r.returncode == 0, r.stderr[-2000:]
    gen = json.loads((tmp_path / "o.jsonl").read_text())["settings"]
    assert (gen["self_condition"], gen["commit_no_repeat"], gen["reuse_canvas_keys"], gen["shortlist"]) == (
        True, False, False, 0)
    run = load_run(work)
    evaluated = harness.build_sampler(run, get_task("sudoku").configure(run.cfg), num_steps=3, step_type="commit",
                                      temperature=0.0, early_stopping=None)[0]  # dgemma eval: the run's eval_ds
    assert (evaluated.self_condition, evaluated.step.no_repeat, evaluated.reuse_canvas_keys, evaluated.shortlist) == (
        True, False, False, 0)
    assert front_ends(interactive_steps=5, interactive_early_stopping=None)[0] == {(5, "entropy")}
    lm = DGemmaLM(run=str(work), device="cpu", early_stopping="none")  # asked: none, over the run's rule
    assert lm.early_stopping is None
    shipped_cfg = load_config(str(shipped.PUBMEDQA / "config.json"))
    e = interactive_cfg(shipped_cfg).eval_ds  # measured on all 500 test questions (the card, 2026-12-07)
    assert (e.steps, e.early_stopping, e.self_condition, e.reuse_canvas_keys, e.commit_no_repeat, e.shortlist) == (
        [16], "none", False, True, True, 256)
    assert shipped_cfg.eval_ds.self_condition and not shipped_cfg.eval_ds.commit_no_repeat  # what dgemma eval reports
    assert shipped_cfg.eval_ds.shortlist == 0
