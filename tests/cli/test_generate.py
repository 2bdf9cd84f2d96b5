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
            "--no-self-condition")
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(json.loads(x)["settings"]["self_condition"] is False for x in plain.read_text().splitlines())


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
