"""The new-task guide, run as written: docs/guides/new-task.md's commands, at a smaller scale.

Every ``python examples/reverse/...`` and ``dgemma ...`` line of the guide's ``bash`` blocks runs
in a temporary folder that sees the repo's ``examples/`` (a symlink), in the guide's order, with
size flags appended so the whole walk takes seconds: fewer rows, a one-layer model, two training
steps. Then the files and metric keys the guide promises are checked. Editing a command in the
guide, the example scripts or their config changes what this test runs.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guides" / "new-task.md"
STEPS = 2
SMALL = {  # appended to the guide's commands (argparse and --cfg overrides: later wins)
    "prepare": ["--train", "128", "--eval", "6"],
    "train": ["--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64", "--cfg.model.num_hidden_layers=1",
              "--cfg.model.layer_types=full_attention", "--cfg.data.batch_size=8", f"--cfg.train.steps={STEPS}",
              f"--cfg.train.checkpoint_every={STEPS}", "--cfg.train.log_every=1"],
    "eval": ["--cfg.eval_ds.batch_size=3", "--ar_max_tokens=4"],
}


def guide_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", GUIDE.read_text(), re.M | re.S)


def guide_commands() -> list[list[str]]:
    """The guide's runnable lines, in order, as argv lists."""
    out = []
    for block in guide_blocks("bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv and (argv[0] == "dgemma" or argv[:2][-1].startswith("examples/reverse/")):
                out.append(argv)
    return out


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    exe = [sys.executable, "-m", "dgemma"] if argv[0] == "dgemma" else [sys.executable]
    extra = SMALL.get(argv[1], [])
    argv = [a.replace("step_300", f"step_{STEPS}") for a in argv[1:]] + extra
    r = subprocess.run(exe + argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(exe + argv)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Run every command of the guide once; returns the folder and each command's stdout."""
    cwd = tmp_path_factory.mktemp("walk")
    (cwd / "examples").symlink_to(REPO / "examples")
    outputs = {}
    for argv in guide_commands():
        outputs[" ".join(argv)] = run(argv, cwd).stdout
    return cwd, outputs


def test_the_guide_has_the_whole_walk():
    firsts = [" ".join(a[:2]) for a in guide_commands()]
    for expected in ("dgemma prepare", "dgemma train", "dgemma eval", "dgemma plot",
                     "python examples/reverse/reverse.py"):
        assert expected in firsts, f"{expected} is no longer a command of {GUIDE.name}"
    assert firsts.index("dgemma prepare") < firsts.index("dgemma train") < firsts.index("dgemma eval") \
        < firsts.index("python examples/reverse/reverse.py")


def test_data_and_run_files(walked):
    cwd, _ = walked
    data = cwd / "data" / "reverse"
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (data / "eval.jsonl").read_text().splitlines()]
    assert len(rows) == 128 and len(evals) == 6
    assert all(r["prompt"] == r["prompt_text"] == f"reverse: {r['response'][::-1]}" == f"reverse: {r['word']}"
               for r in rows + evals)
    assert not {r["word"] for r in rows} & {r["word"] for r in evals}
    wd = cwd / "runs" / "reverse"
    assert (wd / "config.json").is_file() and (wd / "metrics.jsonl").is_file() and list((wd / "tb").iterdir())
    assert (wd / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").is_file()
    assert (wd / "plots" / "curves.png").stat().st_size > 0


def test_eval_files_and_metric_keys(walked):
    cwd, outputs = walked
    eval_dir = cwd / "runs" / "reverse" / "eval"
    assert {p.name for p in eval_dir.iterdir()} >= {"sample_ar_steps8", "sample_ar_steps4", "sample_ar_steps2",
                                                     "sample_ar_steps1", "tb"}
    result = json.loads((eval_dir / "sample_ar_steps8" / f"step_{STEPS}.json").read_text())
    assert result["task"] == "reverse" and result["checkpoint_step"] == STEPS and result["num_examples"] == 6
    assert result["source"].endswith("data/reverse/eval.jsonl")
    lengths = {len(json.loads(x)["word"]) for x in (cwd / "data" / "reverse" / "eval.jsonl").read_text().splitlines()}
    assert set(result["metrics"]) == {"count", "accuracy", "char_accuracy", "length_ok",
                                      *(f"accuracy_len{n}" for n in lengths)}
    assert {"tokens_per_forward", "mean_steps_per_canvas", "ar_tokens_per_second", "speedup_vs_ar"} <= set(result["stats"])
    assert result["settings"]["step_type"] == "commit" and result["settings"]["num_steps"] == 8
    rows = [json.loads(x) for x in (eval_dir / "sample_ar_steps8" / f"step_{STEPS}.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {"prompt", "output", "reference", "score"} <= set(rows[0])
    table = next(v for k, v in outputs.items() if k == "dgemma eval --cfg.workdir=runs/reverse")
    assert "sample_ar_steps8" in table and "char_accuracy" in table


def test_reverse_script(walked):
    _, outputs = walked
    reverse = next(v for k, v in outputs.items() if k.startswith("python examples/reverse/reverse.py"))
    lines = reverse.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("hello -> ")


def test_the_guides_python_snippet_runs():
    snippets = [b for b in guide_blocks("python") if b.lstrip().startswith(("from ", "import "))]
    assert snippets
    for code in snippets:
        exec(compile(code, str(GUIDE), "exec"), {})


def test_the_guides_config_and_task_are_the_files():
    shown = [b for b in guide_blocks("python") if "def get_config" in b or "class ReverseTask" in b]
    assert shown == [(REPO / "dgemma" / "tasks" / "reverse.py").read_text(),
                     (REPO / "examples" / "reverse" / "config.py").read_text()]


def test_the_task_is_registered_and_scores_its_own_way():
    from dgemma.tasks import TASKS
    from dgemma.tasks.reverse import ReverseTask, extract, prompt_record

    assert isinstance(TASKS["reverse"], ReverseTask)
    assert extract("  olleh<eos>") == "olleh" and extract("123") is None
    recs = [{**prompt_record(w), "response": w[::-1]} for w in ("hello", "abc", "abcd")]
    m = TASKS["reverse"].score(["olleh", "cba", "dcxa"], recs)
    assert m["accuracy"] == 2 / 3 and m["char_accuracy"] == (1 + 1 + 0.75) / 3 and m["length_ok"] == 1.0
    assert (m["accuracy_len3"], m["accuracy_len4"], m["accuracy_len5"]) == (1.0, 0.0, 1.0)
    assert TASKS["reverse"].score_one("", recs[0]) == {"answer": None, "accuracy": 0.0, "char_accuracy": 0.0,
                                                        "length_ok": 0.0}
