"""The ``dgemma`` model of lm-evaluation-harness (dgemma/lm_eval_model.py): per-request seeding
that makes outputs independent of the batch, ``until`` and ``max_gen_toks``, the Monte-Carlo ELBO
behind ``loglikelihood``, and the harness's real command lines (lm-eval's own ``lm_eval``, which
finds ``--model dgemma`` through the installed ``dgemma-lm-eval.pth`` hook, and ``dgemma lm-eval``;
subprocesses) on local task YAMLs over local JSONL files: a generation task with the shipped Sudoku
checkpoint and a multiple-choice task with a tiny run. Offline: no hub."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="pip install lm-eval (the dev extra has it)")

from lm_eval.api.instance import Instance  # noqa: E402

from dgemma import shipped  # noqa: E402
from dgemma.data.sudoku import generate_puzzles  # noqa: E402
from dgemma.errors import DGemmaError  # noqa: E402
from dgemma.lm_eval_model import DGemmaLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIPPED = shipped.SUDOKU
needs_shipped = pytest.mark.skipif(not (SHIPPED / "checkpoints").is_dir(), reason=f"no {SHIPPED}")


def gen_requests(contexts, **gen_kwargs) -> list[Instance]:
    return [Instance("generate_until", {}, (c, gen_kwargs), i) for i, c in enumerate(contexts)]


def ll_requests(pairs) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def wrong(puzzle: str, solution: str) -> str:
    """The solution with two blank cells of different digits swapped: still 81 digits, now wrong."""
    s = list(solution)
    blanks = [i for i, ch in enumerate(puzzle) if ch == "0"]
    a = blanks[0]
    b = next(j for j in blanks if s[j] != s[a])
    s[a], s[b] = s[b], s[a]
    return "".join(s)


def spaced(digits: str) -> str:
    return " ".join(digits)  # the digits tokenizer skips spaces; lm-eval would read bare digits as a number


@pytest.fixture(scope="module")
def puzzles():
    return generate_puzzles(8, seed=3, difficulty="easy")


# ------------------------------------------------------------------------------------- generation
@needs_shipped
def test_generation_does_not_depend_on_the_batch(puzzles):
    hard = gen_requests([p["puzzle"] for p in generate_puzzles(8, seed=4, difficulty="hard")], until=[],
                        max_gen_toks=81)  # hard boards: at T=1 the samples differ from seed to seed
    outs = [DGemmaLM(run=str(SHIPPED), device="cpu", batch_size=b, temperature=1.0, steps=27).generate_until(hard)
            for b in (1, 3, 8)]
    assert outs[0] == outs[1] == outs[2]  # request i draws from its own (seed, i) stream
    other = DGemmaLM(run=str(SHIPPED), device="cpu", batch_size=8, temperature=1.0, steps=27, seed=1)
    assert other.generate_until(hard) != outs[0]
    easy = gen_requests([p["puzzle"] for p in puzzles], until=[], max_gen_toks=81)
    greedy = DGemmaLM(run=str(SHIPPED), device="cpu", batch_size=8).generate_until(easy)  # 81 commit steps, T=0
    assert sum(g == p["solution"] for g, p in zip(greedy, puzzles)) >= 7  # easy boards: ~100% (README)


def test_until_and_max_gen_toks(tiny_text_model):
    lm = DGemmaLM(pretrained=str(tiny_text_model), device="cpu", batch_size=2, temperature=1.0, steps=4)
    contexts = ["The capital of France is", "hello world"]
    full = lm.generate_until(gen_requests(contexts, max_gen_toks=64))
    assert DGemmaLM(pretrained=str(tiny_text_model), device="cpu", batch_size=1, temperature=1.0,
                    steps=4).generate_until(gen_requests(contexts, max_gen_toks=64)) == full
    stop = full[0][5:7]
    cut = lm.generate_until(gen_requests(contexts, until=[stop], max_gen_toks=64))
    assert cut[0] == full[0][:full[0].index(stop)] and cut[1] == full[1].split(stop)[0]
    toks = lm.generate_batch(contexts, [0, 1], max_toks=5, temperature=1.0)
    assert all(len(t) <= 5 for t in toks)
    assert lm.generate_until(gen_requests(contexts, max_gen_toks=5)) == [lm.tok_decode(t) for t in toks]
    assert lm.generate_until(gen_requests(contexts, max_gen_toks=64, do_sample=False)) == \
        lm.generate_until(gen_requests(contexts, max_gen_toks=64, temperature=0.0))
    with pytest.raises(DGemmaError, match="top_k=5 is not supported"):
        lm.generate_until(gen_requests(contexts, top_k=5))


# ------------------------------------------------------------------------------------- likelihoods
def test_elbo_is_seeded_and_does_not_depend_on_the_batch(tiny_run, tiny_text_model, puzzles):
    digits = [(p["puzzle"], " " + spaced(p["solution"])) for p in puzzles[:4]]
    text = [("The capital of", " France is Paris"), ("hello", " world 12345"), ("3.14", "159")]
    models = ({"run": str(tiny_run), "pin_clues": False}, {"pretrained": str(tiny_text_model)})
    for kw, pairs in zip(models, (digits, text)):
        one = DGemmaLM(**kw, device="cpu", batch_size=1, mc_samples=4).loglikelihood(ll_requests(pairs))
        many = DGemmaLM(**kw, device="cpu", batch_size=4, mc_samples=4).loglikelihood(ll_requests(pairs))
        assert [v for v, _ in one] == pytest.approx([v for v, _ in many], rel=1e-5)
        assert all(math.isfinite(v) and v < 0 and isinstance(g, bool) for v, g in one)
        again = DGemmaLM(**kw, device="cpu", batch_size=4, mc_samples=4).loglikelihood(ll_requests(pairs))
        assert again == many
        reseeded = DGemmaLM(**kw, device="cpu", batch_size=4, mc_samples=4, seed=1).loglikelihood(ll_requests(pairs))
        assert [v for v, _ in reseeded] != [v for v, _ in many]


@needs_shipped
def test_elbo_prefers_the_true_sudoku_solution():
    """With the clues pinned (as the run trained), the true solution scores far above one with two
    cells swapped: the bound carries the model's knowledge."""
    recs = generate_puzzles(8, seed=3, difficulty="medium")
    lm = DGemmaLM(run=str(SHIPPED), device="cpu", batch_size=8)
    pairs = [(r["puzzle"], " " + s) for r in recs for s in (r["solution"], wrong(r["puzzle"], r["solution"]))]
    ll = lm.loglikelihood(ll_requests(pairs))
    assert sum(ll[2 * i][0] > ll[2 * i + 1][0] for i in range(len(recs))) >= 7


def test_rolling_loglikelihood_sums_its_windows(tiny_text_model):
    lm = DGemmaLM(pretrained=str(tiny_text_model), device="cpu", batch_size=4, mc_samples=2)
    text = "The capital of France is Paris. " * 12  # more tokens than one window of 96
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tokens = lm.tok_encode(text, add_special_tokens=False)
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, lm.prefix_token_id, 96, 1)))
    assert len(windows) >= 2
    parts = lm.elbo([(ctx, cont, (0, 0, w)) for w, (ctx, cont) in enumerate(windows)])
    assert total == pytest.approx(sum(v for v, _ in parts)) and total < 0


# ------------------------------------------------------------------------------------- arguments
def test_a_run_generates_with_its_own_eval_settings(tiny_run, tmp_path):
    """Like ``dgemma eval``, generate and serve: a run's ``eval_ds`` (commit blocks, ranking, the
    self-conditioning switch, its confidence threshold) under the model args and the request."""
    import shutil

    work = tmp_path / "run"
    shutil.copytree(tiny_run, work)
    raw = json.loads((work / "config.json").read_text())
    raw["eval_ds"].update(commit_block=3, commit_stable_first=False, self_condition=False, confidence_threshold=0.8,
                          commit_no_repeat=True)
    (work / "config.json").write_text(json.dumps(raw))
    got = DGemmaLM(run=str(work), step_type="commit", steps=3)._settings_for(0.0, 1.0, 1)
    assert (got.commit_block, got.commit_stable_first, got.self_condition, got.num_steps) == (3, False, False, 3)
    assert got.commit_no_repeat is True
    assert DGemmaLM(run=str(work), step_type="confidence")._settings_for(0.0, 1.0, 1).confidence_threshold == 0.8
    lm = DGemmaLM(run=str(work), step_type="confidence", threshold=0.5)
    assert lm._settings_for(0.0, 1.0, 2).confidence_threshold == 0.5 and lm._settings_for(0.0, 1.0, 2).max_canvases == 2


def test_model_args_are_checked(tiny_run):
    from lm_eval.api.registry import get_model

    assert get_model("dgemma") is DGemmaLM
    with pytest.raises(DGemmaError, match="exactly one of run=DIR"):
        DGemmaLM(run=str(tiny_run), pretrained="gemma3-270m")
    with pytest.raises(DGemmaError, match=r"unknown dgemma model_args \['stepz'\]"):
        DGemmaLM(run=str(tiny_run), stepz=3)
    with pytest.raises(DGemmaError, match="auto is not supported"):
        DGemmaLM(run=str(tiny_run), batch_size="auto")
    with pytest.raises(DGemmaError, match="step_type 'magic' is unknown"):
        DGemmaLM(run=str(tiny_run), step_type="magic")
    lm = DGemmaLM.create_from_arg_string(f"run={tiny_run},batch_size=3,steps=5",
                                         {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert lm.batch_size == 3 and lm.steps == 5  # model_args win over --batch_size
    assert lm.device.type == ("cuda" if __import__("torch").cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------- the CLI
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{puzzle}}}}"
"""
GEN = TASK + """output_type: generate_until
doc_to_target: "{{{{solution}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 81
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
MC = TASK + """output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


LM_EVAL = Path(sys.executable).parent / "lm_eval"  # lm-eval's console script, beside this interpreter


def harness(tmp_path: Path, model_args: str, task: str, template: str, records: list[dict],
            cli: str = "lm_eval") -> tuple[dict, str]:
    """Write the task and its data, run ``lm_eval`` (or ``dgemma lm-eval run``) on them, return
    (results, log)."""
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "tasks").mkdir(exist_ok=True)
    (tmp_path / "tasks" / f"{task}.yaml").write_text(template.format(name=task, data=data))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    head = [str(LM_EVAL)] if cli == "lm_eval" else [sys.executable, "-m", "dgemma", "lm-eval", "run"]
    cmd = [*head, "--model", "dgemma", "--model_args", model_args, "--tasks", task, "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "8",
           "--output_path", str(tmp_path / "out")]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"][task], r.stderr


@needs_shipped
def test_cli_generation_task_on_the_shipped_sudoku_model(tmp_path, puzzles):
    records = [{"puzzle": spaced(p["puzzle"]), "solution": p["solution"]} for p in puzzles]
    res, _ = harness(tmp_path, f"run={SHIPPED},steps=81", "dgemma_sudoku_gen", GEN, records)
    assert res["exact_match,none"] >= 0.75  # 8 easy boards, clues pinned: the model solves ~all of them


def test_cli_multiple_choice_task_on_a_tiny_run(tmp_path, tiny_run, puzzles):
    records = [{"puzzle": spaced(p["puzzle"]), "label": 0,
                "choices": [spaced(p["solution"]), spaced(wrong(p["puzzle"], p["solution"]))]} for p in puzzles]
    res, log = harness(tmp_path, f"run={tiny_run},mc_samples=2", "dgemma_sudoku_mc", MC, records, cli="dgemma")
    assert 0.0 <= res["acc,none"] <= 1.0  # a 10-step model: any accuracy, but computed end to end
    assert "Monte-Carlo estimates of the diffusion ELBO" in log


def test_the_installed_hook_registers_dgemma_lazily_and_keeps_the_harness_models():
    """``dgemma-lm-eval.pth`` (setup.py) imports ``_dgemma_lm_eval_hook`` in every interpreter: it
    must import neither dgemma nor torch there, and once lm-eval loads its models ``dgemma`` must
    resolve beside them (the hook runs after lm-eval's own registrations, not instead)."""
    probe = ("import sys; start = {m for m in ('dgemma', 'torch', 'lm_eval') if m in sys.modules}; "
             "hooked = '_dgemma_lm_eval_hook' in sys.modules; "
             "from lm_eval.api.registry import get_model; "
             "print(sorted(start), hooked, get_model('dgemma').__name__, get_model('hf').__name__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[]", "True", "DGemmaLM", "HFLM"]
