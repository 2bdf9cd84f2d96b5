"""``dgemma bench``: every suite runs in ``--quick`` mode (a tiny random model, seconds) and writes
its table and a JSON with the expected keys and ratio fields; the timing and memory helpers are
checked on their own. Nothing here asserts a speed: ``--quick`` numbers mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dgemma.bench import common
from dgemma.cli import bench as bench_cli
from dgemma.cli.main import main
from dgemma.errors import DGemmaError
from dgemma.sampling import interactive_cfg

REPO = Path(__file__).resolve().parents[2]
SUITES = ("decode", "loss", "attention", "train", "gpu")
HEAD = {"suite", "schema", "date", "command", "quick", "profile", "machine", "method", "settings", "rows", "ratios",
        "profiles", "notes", "skipped", "tables", "seconds"}


@pytest.fixture(scope="module")
def quick_all(tmp_path_factory):
    """``dgemma bench all --quick`` once for the module, as a user runs it (a fresh process, so the
    CLI's OpenMP setting applies before torch loads): (out dir, printed text)."""
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run([sys.executable, "-m", "dgemma", "bench", "all", "--quick", "--out", str(out),
                        "--sudoku-workdir", str(out / "no-such-run"), "--pubmedqa-workdir", str(out / "no-such-run")],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


@pytest.fixture
def one_thread():
    """In-process suites run single-threaded: on a shared 2-core machine two spinning OpenMP
    threads can make tiny models many times slower (the CLI avoids it; pytest loaded torch first)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load(out: Path, suite: str) -> dict:
    return json.loads((out / f"{suite}.json").read_text())


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_writes_json_with_the_common_head(quick_all, suite):
    out, _ = quick_all
    r = _load(out, suite)
    assert HEAD <= set(r), HEAD - set(r)
    assert r["suite"] == suite and r["quick"] is True
    assert {"nproc", "cpu_model", "torch_threads", "torch", "load_average"} <= set(r["machine"])
    assert "median" in r["method"]["timing"] and r["method"]["memory"]
    for ratio in r["ratios"]:
        assert {"name", "value", "baseline", "higher_is_better", "worse_than_baseline"} <= set(ratio)


def test_all_prints_tables_and_ratios_and_writes_a_summary(quick_all):
    out, text = quick_all
    for title in ("== decode:", "== loss:", "== attention:", "== train:", "ratios against the baseline"):
        assert title in text
    summary = json.loads((out / "all.json").read_text())
    assert set(summary["suites"]) == set(SUITES)
    assert summary["ratios"] and all(r["name"].split(":")[0] in SUITES for r in summary["ratios"])


def test_decode_rows_and_ratios(quick_all):
    r = _load(quick_all[0], "decode")
    kinds = {row["kind"] for row in r["rows"]}
    assert {"ar", "hf_generate", "diffusion", "diffusion_nocache"} <= kinds
    diff = [row for row in r["rows"] if row["kind"] == "diffusion"]
    assert {row["step"] for row in diff} == {"ddim", "commit", "confidence"}
    assert {row["early_stop"] for row in diff} == {False, True}
    assert {row["batch"] for row in r["rows"]} == {1, 4}
    for row in r["rows"]:
        assert {"median_s", "times_s", "repeats", "tokens", "forward_passes", "tokens_per_forward",
                "tokens_per_s"} <= set(row)
        assert row["median_s"] > 0 and row["repeats"] >= 1
    for row in diff:
        if row["prompt_len"] == r["settings"]["lm"]["prompt_len"]:  # (the cache comparison uses a longer prompt)
            assert row["vs_ar"] is not None and row["vs_hf"] is not None
        assert row["tokens"] == row["batch"] * 8  # no stop token: every row emits the whole canvas
        assert row["forward_passes"] == row["batch"] * (1 + row["steps"])  # prefill + one per step
    nocache = next(row for row in r["rows"] if row["kind"] == "diffusion_nocache")
    assert nocache["cache_speedup"] is not None
    hf = next(row for row in r["rows"] if row["kind"] == "hf_generate")
    assert hf["greedy_tokens_equal_to_ours"] == 1.0  # same weights, same greedy tokens
    assert any("kv-cache vs no cache" in x["name"] for x in r["ratios"])
    assert any("vs transformers generate" in x["name"] for x in r["ratios"])
    assert any("Sudoku part skipped" in n for n in r["notes"])  # no run at --sudoku-workdir: a note, no failure


def test_loss_rows_pair_full_and_chunked(quick_all):
    r = _load(quick_all[0], "loss")
    timed = [row for row in r["rows"] if not row.get("memory_only")]
    assert {row["impl"] for row in timed} == {"full", "chunked"}
    for row in timed:
        assert row["peak_bytes"] > 0 and row["largest_tensor_bytes"] > 0
    chunked = [row for row in r["rows"] if row["impl"] == "chunked"]
    assert all(row["memory_saving"] is not None for row in chunked)
    assert all(row["loss_rel_diff"] < 1e-5 for row in chunked if "loss_rel_diff" in row)
    # the chunked loss never holds [N, V]: its largest tensor is [chunk, V] fp32, the full one's grows with N
    n_max = max(row["tokens"] for row in timed)
    full = next(row for row in timed if row["impl"] == "full" and row["tokens"] == n_max and not row["weight_grad"])
    ch = next(row for row in timed if row["impl"] == "chunked" and row["tokens"] == n_max and not row["weight_grad"])
    assert full["largest_tensor_bytes"] == n_max * r["settings"]["vocab"] * 4
    assert ch["largest_tensor_bytes"] == r["settings"]["chunk_tokens"] * r["settings"]["vocab"] * 4
    assert any(row.get("memory_only") for row in r["rows"])


def test_attention_backends_agree_and_have_ratios(quick_all):
    r = _load(quick_all[0], "attention")
    assert {row["backend"] for row in r["rows"]} == {"eager", "sdpa", "flex"}
    assert {row["mode"] for row in r["rows"]} == {"train", "decode"}
    for row in r["rows"]:
        if row["backend"] != "eager":
            assert row["vs_eager"] is not None
            assert row["max_abs_diff"] < 1e-4


def test_train_compares_the_same_step(quick_all):
    r = _load(quick_all[0], "train")
    rows = {(row["kind"], row["impl"]): row for row in r["rows"]}
    assert set(rows) == {(k, i) for k in ("causal_lm", "diffusion") for i in ("dgemma", "transformers+peft")}
    for kind in ("causal_lm", "diffusion"):
        d = rows[(kind, "dgemma")]
        assert d["speed"] is not None and d["memory_saving"] is not None
        assert d["loss_rel_diff"] < 1e-4  # step 0 is the base model on both sides: the same loss
        assert d["flops_per_step"] > 0 and d["peak_bytes"] > 0
    assert r["settings"]["trainable_params"]["dgemma"] == r["settings"]["trainable_params"]["transformers+peft"]


def test_gpu_suite_without_cuda_is_a_note(quick_all):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = _load(quick_all[0], "gpu")
    assert r["skipped"] and "no CUDA device" in r["notes"][0]


def test_decode_with_a_sudoku_run_puts_accuracy_next_to_speed(tmp_path, one_thread):
    """The Sudoku part on an untrained ``configs/sudoku_small.py`` model (accuracy ~0: the keys matter)."""
    from dgemma.bench import decode
    from dgemma.training.config import load_config
    from dgemma.training.runs import Run
    from dgemma.training.trainer import build_model

    cfg = load_config(REPO / "configs" / "sudoku_small.py")
    model, tok = build_model(cfg)
    run = Run(cfg, model.eval(), tok, 0, tmp_path / "checkpoints" / "step_0")
    ctx = common.Context(out=tmp_path, quick=True, profile="quick", verbose=False, do_profile=False)
    r = decode.run(ctx, sudoku_run=run)
    rows = [row for row in r["rows"] if row["model"] == "sudoku"]
    diff = [row for row in rows if row["kind"] == "diffusion"]
    assert {row["step"] for row in diff} == {"commit", "confidence"}  # absorbing noise: no ddim
    for row in diff:
        assert {"accuracy", "cell_accuracy", "tokens_per_s", "vs_ar", "n_puzzles"} <= set(row)
        assert 0.0 <= row["accuracy"] <= 1.0
    assert {row["kind"] for row in rows} >= {"ar", "hf_generate"}
    assert any(name.startswith("sudoku most accurate") for name in (x["name"] for x in r["ratios"]))
    assert any("accuracy next to speed" in t for t in r["tables"])


PUBMEDQA = REPO / "checkpoints" / "pubmedqa_270m"


@pytest.mark.skipif(not (PUBMEDQA / "ar" / "config.json").is_file(), reason="no shipped PubMedQA pair")
def test_decode_puts_the_adapted_pubmedqa_pair_side_by_side(tmp_path, one_thread):
    """``dgemma bench decode --only adapted``: the shipped adapter and its AR fine-tune on two shipped
    test questions (``--quick``: one canvas, 2 steps): each row's accuracy is the task's score of what that decoder wrote, and the
    ratio compares it with the AR row of its batch."""
    from dgemma.bench import decode, fixtures
    from dgemma.tasks import get_task

    # what a user types for the trained models' rows alone
    assert main(["bench", "decode", "--only", "adapted", "--quick", "--out", str(tmp_path), "--pubmedqa-workdir",
                 str(PUBMEDQA), "--sudoku-workdir", str(tmp_path / "none")]) == 0
    r = _load(tmp_path, "decode")
    assert {row["model"] for row in r["rows"]} == {"pubmedqa"}  # no Gemma LM rows, no Sudoku run here
    rows = r["rows"]
    ctx = common.Context(out=tmp_path, quick=True, profile="quick", verbose=False, do_profile=False,
                         pubmedqa_workdir=str(PUBMEDQA))
    diff_run, ar_run, questions = fixtures.pubmedqa_runs(ctx)[0]
    # a self-conditioned run's rows come again without the signal
    signals = [True, False] if diff_run.cfg.eval_ds.self_condition else [False]
    # and once more with partial passes (reused canvas keys: without the signal only), and those again
    # with the LM head on the shortlist the run's users decode with (eval_ds.interactive_shortlist)
    sl = interactive_cfg(diff_run.cfg).eval_ds.shortlist
    assert r["settings"]["pubmedqa"]["shortlist"] == sl
    assert [(row["kind"], row["batch"], row["self_condition"], row["reuse_canvas_keys"], row["shortlist"])
            for row in rows] == \
        [(kind, b, s, k, n) for b in (1, 2) for kind, s, k, n in
         [("ar", None, None, 0)] + [("diffusion", s, False, 0) for s in signals] + [("diffusion", False, True, 0)]
         + [("diffusion", False, True, sl)] * bool(sl)]
    assert str(next(diff_run.model.parameters()).dtype) == r["settings"]["pubmedqa"]["dtype"]
    assert (r["settings"]["pubmedqa"]["lora"], r["settings"]["pubmedqa"]["ar_lora"]) == ("merged", "merged")
    for row in rows:
        assert row["n_questions"] == row["batch"] and 0 < row["tokens"] <= 32 * row["batch"]
        assert {"accuracy", "macro_f1", "bleu", "unparsed", "tokens_per_s"} <= set(row)
    ar2, d2 = [row for row in rows if row["batch"] == 2][:2]
    assert d2["vs_ar"] == pytest.approx(d2["tokens_per_s"] / ar2["tokens_per_s"])
    # the same after the prompts' encoding, which both decoders do alike (the prefill is part of each row's time)
    for row in (ar2, d2):
        assert 0 < row["prefill_s"] < row["seconds"]
        assert row["decode_tokens_per_s"] == pytest.approx(row["tokens"] / (row["seconds"] - row["prefill_s"]))
    assert d2["decode_vs_ar"] == pytest.approx(d2["decode_tokens_per_s"] / ar2["decode_tokens_per_s"])
    assert d2["steps"] == 2 and d2["forward_passes"] >= 2
    # the AR row's accuracy is the task's score of a greedy decode of the same questions
    from dgemma.eval import harness
    task = get_task("pubmedqa").configure(diff_run.cfg)
    gen = harness.generate_ar(ar_run, task, questions[:2], batch_size=2, max_new_tokens=32)
    assert task.score([ar_run.tokenizer.decode(t) for t in gen.tokens], gen.records)["accuracy"] == ar2["accuracy"]
    assert any(x["name"].startswith("pubmedqa diffusion S=2 vs AR fine-tune b2") for x in r["ratios"])
    # a row and its ratio say "no signal" exactly when it decodes otherwise than the run does
    default = signals[0]
    for row in (x for x in rows if x["kind"] == "diffusion"):
        assert (" no signal" in row["name"]) == (row["self_condition"] != default)
        assert (" reused keys" in row["name"]) == row["reuse_canvas_keys"]
    named = [x["name"] for x in r["ratios"] if x["name"].startswith("pubmedqa diffusion")]
    assert sum("without the signal" in n for n in named) == sum(
        x["self_condition"] != default for x in rows if x["kind"] == "diffusion")
    assert sum("reused canvas keys" in n for n in named) == 2 * (1 + bool(sl))
    # a model without the block decodes with no signal: one row a setting, neither called "no signal"
    diff_run.model.self_conditioning = None
    ctx.sudoku_workdir = str(tmp_path / "none")
    r2 = decode.run(ctx, pubmedqa_runs=(diff_run, ar_run, questions), adapted_only=True)
    plain = [x for x in r2["rows"] if x["kind"] == "diffusion"]
    assert [(x["self_condition"], x["reuse_canvas_keys"]) for x in plain] == \
        ([(False, False), (False, True)] + [(False, True)] * bool(sl)) * 2
    assert not any("no signal" in x["name"] for x in plain)
    assert not any("without the signal" in x["name"] for x in r2["ratios"])
    assert "self-conditioning off" in r2["settings"]["pubmedqa"]["sampler"]
    assert any("adapted PubMedQA" in t for t in r["tables"])
    assert r["settings"]["pubmedqa"]["response_prefix"] is None and r["settings"]["pubmedqa"]["steps"] == [2]
    # --pubmedqa-steps / --pubmedqa-prefix / --pubmedqa-no-repeat / --pubmedqa-shortlist: other step counts,
    # the answer template given to both decoders, the diffusion rows decoded with the no-repeat rule, and
    # the reused-keys rows again with a shortlist, each said so
    assert not r["settings"]["pubmedqa"]["commit_no_repeat"]
    ctx.pubmedqa_steps, ctx.pubmedqa_prefix, ctx.pubmedqa_no_repeat = (3,), "The answer is:", True
    ctx.pubmedqa_shortlist, ctx.pubmedqa_b1 = 64, 2  # --pubmedqa-b1: batch 1 decodes both questions, one at a time
    r3 = decode.run(ctx, pubmedqa_runs=(diff_run, ar_run, questions), adapted_only=True)
    assert r3["settings"]["pubmedqa"]["batch1_questions"] == 2
    assert {x["n_questions"] for x in r3["rows"]} == {2}
    assert r3["settings"]["pubmedqa"]["response_prefix"] == "The answer is:"
    assert {x["steps"] for x in r3["rows"] if x["kind"] == "diffusion"} == {3}
    named = [x["name"] for x in r3["ratios"] if x["name"].startswith("pubmedqa")]
    assert named and all(", template pinned, no repeats (acc" in n for n in named)
    assert all(x["name"].endswith(" no repeats") == (x["kind"] == "diffusion") for x in r3["rows"])
    assert [(x["batch"], x["reuse_canvas_keys"], x["shortlist"]) for x in r3["rows"] if x["kind"] == "diffusion"] \
        == [(b, k, n) for b in (1, 2) for k, n in ((False, 0), (True, 0), (True, 64))]
    assert all((" shortlist 64 " in x["name"]) == (x["shortlist"] == 64) for x in r3["rows"])
    assert sum(", shortlist 64" in n for n in named) == 2
    assert diff_run.cfg.eval_ds.response_prefix == ar_run.cfg.eval_ds.response_prefix == "The answer is:"
    assert r3["settings"]["pubmedqa"]["commit_no_repeat"] and diff_run.cfg.eval_ds.commit_no_repeat
    assert harness.build_sampler(diff_run, task, num_steps=3, step_type="commit", temperature=0.0,
                                 early_stopping=None)[0].step.no_repeat
    assert bench_cli.parse(["decode", "--pubmedqa-no-repeat"]).pubmedqa_no_repeat
    for bad, message in ((["--pubmedqa-steps", "16,x"], "takes step counts"), (["--pubmedqa-steps", "0"], ">= 1"),
                         (["--pubmedqa-prefix", ""], "is empty"), (["--pubmedqa-shortlist", "-1"], ">= 0"),
                         (["--pubmedqa-b1", "0"], ">= 1")):
        with pytest.raises(DGemmaError, match=message):
            bench_cli.parse(["decode", *bad])
    ctx.pubmedqa_b1 = 3  # more than the profile decodes: said, nothing run
    with pytest.raises(DGemmaError, match="--pubmedqa-b1 3: this profile decodes 2"):
        decode.run(ctx, pubmedqa_runs=(diff_run, ar_run, questions), adapted_only=True)


@pytest.mark.parametrize("compile_", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_step_cost_rows_are_ratios_of_forwards_timed_in_one_run(tmp_path, one_thread, compile_):
    """``decode --only step_cost`` on the tiny model: one row per implementation and canvas size,
    ``vs_ar_step`` = the row's time over its own implementation's C = 1 step, ``vs_transformers`` =
    dgemma's time over transformers' at the same C (compiled rows too, with their compile time)."""
    from dgemma.bench import step_cost

    ctx = common.Context(out=tmp_path, quick=True, profile="quick", verbose=False, do_profile=False,
                         compile=compile_)
    r = step_cost.run(ctx, (torch.float32,))
    rows = [x for x in r["rows"] if x["kind"] == "step_cost"]
    appends = {x["canvas"]: x for x in r["rows"] if x["kind"] == "append_cost"}
    heads = {x["rows"]: x for x in r["rows"] if x["kind"] == "head_cost"}
    assert sorted(appends) == [16, 32] and sorted(heads) == [1, 4] and len(r["rows"]) == len(rows) + 4
    for x in heads.values():  # PyTorch's linear against fast_linear: the same logits up to fp32 rounding
        assert x["fast_vs_linear"] == pytest.approx(x["fast_s"] / x["linear_s"]) and x["max_abs_diff"] < 1e-4
    for x in appends.values():  # one forward of 2C tokens against the two it replaces: the same logits
        assert x["fused_vs_apart"] == pytest.approx(x["fused_s"] / x["apart_s"]) and x["max_abs_diff"] < 1e-4
    impls = ["dgemma", "transformers"] + (["dgemma-compiled"] if compile_ else [])
    assert sorted({(x["impl"], x["canvas"]) for x in rows}) == sorted((i, c) for i in impls for c in (1, 16, 32))
    by = {(x["impl"], x["canvas"]): x for x in rows}
    for (impl, c), x in by.items():
        assert x["kind"] == "step_cost" and x["dtype"] == "float32" and x["median_s"] > 0
        assert x["vs_ar_step"] == pytest.approx(x["median_s"] / by[(impl, 1)]["median_s"])
        if impl != "transformers":
            assert x["vs_transformers"] == pytest.approx(x["median_s"] / by[("transformers", c)]["median_s"])
    if compile_:
        assert by[("dgemma-compiled", 1)]["compile_s"] > 0 and by[("dgemma-compiled", 16)]["compile_s"] > 0
        assert "compile_s" not in by[("dgemma-compiled", 32)]  # dynamic shapes: no recompile for C = 32
        assert all(by[("dgemma-compiled", c)]["argmax_agree_eager"] == 1.0 for c in (1, 16, 32))  # fp32
    assert len(r["ratios"]) == 3 * (len(impls) - 1)


def test_the_step_cost_command_runs_only_the_step_cost_rows(tmp_path, one_thread, capsys):
    """What a user types: ``dgemma bench decode --only step_cost`` writes step_cost rows only (and
    the append and LM-head rows);
    ``--compile`` elsewhere is refused with one line."""
    assert main(["bench", "decode", "--only", "step_cost", "--quick", "--out", str(tmp_path), "--dtype",
                 "float32"]) == 0
    r = _load(tmp_path, "decode")
    assert r["settings"]["only"] == "step_cost" and r["rows"]
    assert {row["kind"] for row in r["rows"]} == {"step_cost", "append_cost", "head_cost"}
    assert "== decode --only step_cost" in capsys.readouterr().out
    assert main(["bench", "decode", "--compile", "--quick", "--out", str(tmp_path)]) == 2
    assert "--compile applies to decode --only step_cost" in capsys.readouterr().err


# -- helpers -------------------------------------------------------------------------------------
def test_memory_tracker_counts_new_tensors_not_views_of_old_ones():
    w = torch.randn(1000, 64)
    h = torch.randn(256, 64)

    def f():
        z = h @ w.T  # new [256, 1000] fp32: 1,024,000 bytes; w.T is a view of a tensor made before
        y = z.relu()  # a second one while z is alive
        del z
        return y.sum()

    peak, largest = common.peak_memory(f)
    assert peak == 2 * 256 * 1000 * 4 and largest == 256 * 1000 * 4


def test_measure_takes_the_median_and_caps_repeats():
    calls = []
    m = common.measure(lambda: calls.append(1) or len(calls), warmup=2, repeats=5)
    assert len(calls) == 7 and m.repeats == 5 and m.warmup == 2 and m.result == 7
    assert m.median_s == sorted(m.times_s)[2]
    m = common.measure(lambda: sum(range(20000)), warmup=0, repeats=50, max_seconds=0.0)
    assert m.repeats == 1  # the cap stops after the first timed call
    ms = common.measure_interleaved({"a": lambda: 1, "b": lambda: 2}, repeats=3)
    assert ms["a"].repeats == ms["b"].repeats == 3 and ms["b"].result == 2


def test_table_and_ratio_helpers():
    text = common.format_table([{"a": "x", "b": 1.23456, "c": None}], [("a", "A"), ("b", "B"), ("c", "C")], title="T")
    assert text.splitlines()[0] == "T" and "1.235" in text and text.rstrip().endswith("-")
    assert common.ratio(2.0, 4.0) == 0.5 and common.ratio(1.0, 0.0) is None and common.ratio(None, 1.0) is None
    r = {"ratios": []}
    common.add_ratio(r, "x", 0.5, baseline="b")
    assert r["ratios"][0]["worse_than_baseline"] is True


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["bench", "decode", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_gpu_script_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_bench.py")], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 1
    assert "no CUDA device" in r.stdout + r.stderr
