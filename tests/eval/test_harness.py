"""The eval harness on a tiny Sudoku run trained for two steps: files, keys, seeding, names."""

import json
from pathlib import Path

import pytest

from dgemma.errors import DGemmaError
from dgemma.eval import harness
from dgemma.sampling import max_canvases
from dgemma.eval.harness import Evaluator, default_evaluators, evaluate, parse_evaluator, run_evaluators
from dgemma.tasks import TASKS, get_task
from dgemma.tasks.sudoku import SUDOKU_EVAL_SEED, generate_eval_puzzles
from dgemma.training.config import apply_overrides, load_config
from dgemma.training.runs import load_run
from dgemma.training.trainer import train

REPO = Path(__file__).resolve().parents[2]
TINY = ["--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64", "--cfg.model.num_hidden_layers=1",
        "--cfg.model.layer_types=full_attention", "--cfg.data.batch_size=4", "--cfg.train.steps=2",
        "--cfg.train.checkpoint_every=2", "--cfg.train.log_every=1", "--cfg.eval_ds.num_examples=6",
        "--cfg.eval_ds.batch_size=4", "--cfg.eval_ds.steps=3", "--cfg.eval_ds.early_stopping=entropy"]
TOP_KEYS = {"eval_name", "task", "split", "source", "checkpoint_step", "num_examples", "metrics", "stats", "settings"}
SETTINGS_KEYS = {"seed", "num_steps", "step_type", "step_args", "temperature", "early_stopping", "stopping",
                 "canvas_size", "max_canvases", "stop_ids", "noise", "schedule", "batch_size", "num_batches",
                 "prompt_len", "device", "dtype", "threads", "pin_clues", "min_stop_prob", "stop_alias_cos", "logit_bias",
                 "self_condition",
                 "weights", "lora", "compiled", "fuse_append", "reuse_canvas_keys", "shortlist",
                 "response_prefix"}
STATS_KEYS = {"examples", "tokens", "forward_passes", "tokens_per_forward", "tokens_per_second", "seconds",
              "prefill_seconds", "decode_tokens_per_second",
              "canvases", "mean_steps_per_canvas", "early_stopped_canvases", "truncated_prompts", "ar_examples",
              "ar_max_new_tokens", "ar_tokens", "ar_forward_passes", "ar_tokens_per_forward",
              "ar_tokens_per_second", "ar_seconds", "ar_prefill_seconds", "ar_decode_tokens_per_second",
              "speedup_vs_ar"}
EXAMPLE_KEYS = {"index", "id", "system", "prompt", "output", "reference", "score", "tokens", "forward_passes",
                "steps_used"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("run")
    cfg = apply_overrides(load_config(REPO / "configs" / "sudoku_small.py"), [f"--cfg.workdir={wd}", *TINY])
    train(cfg)
    return wd


def load(workdir, *extra):
    return load_run(workdir, overrides=list(extra), device="cpu")


def run_one(run, out, name="sample_ar_steps3", early_stopping=None, temperature=1.0, **kw):
    task = get_task("sudoku")
    return evaluate(run, task, eval_name=name, num_steps=3, step_type="commit", temperature=temperature,
                    early_stopping=early_stopping, out_dir=out, ar_max_tokens=kw.pop("ar_max_tokens", 8), **kw)


def outputs(out, name="sample_ar_steps3", step=2):
    lines = (Path(out) / "eval" / name / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def test_files_and_exact_keys(workdir, tmp_path):
    result = run_one(load(workdir), tmp_path)
    saved = json.loads((tmp_path / "eval" / "sample_ar_steps3" / "step_2.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert set(saved) == TOP_KEYS
    assert set(saved["settings"]) == SETTINGS_KEYS
    assert set(saved["stats"]) == STATS_KEYS
    assert saved["checkpoint_step"] == 2 and saved["task"] == "sudoku" and saved["split"] == "eval"
    assert saved["num_examples"] == 6 and saved["metrics"]["count"] == 6
    assert {saved["metrics"][f"count_{b}"] for b in ("easy", "medium", "hard")} == {2}
    s = saved["settings"]
    assert (s["seed"], s["num_steps"], s["step_type"], s["temperature"]) == (0, 3, "commit", 1.0)
    assert s["stopping"] == {"rule": "none"} and s["early_stopping"] is None
    assert s["stop_ids"] == [1, 3]


def test_jsonl_one_line_per_example(workdir, tmp_path):
    run_one(load(workdir), tmp_path)
    rows = outputs(tmp_path)
    assert len(rows) == 6 and [r["index"] for r in rows] == list(range(6))
    assert all(set(r) == EXAMPLE_KEYS for r in rows)
    puzzles = generate_eval_puzzles(6, seed=SUDOKU_EVAL_SEED)
    assert [r["reference"] for r in rows] == [p["response"] for p in puzzles]
    assert all(r["score"]["clues"] == p["clues"] for r, p in zip(rows, puzzles))


def test_stats(workdir, tmp_path):
    st = run_one(load(workdir), tmp_path)["stats"]
    assert st["canvases"] == 6 and st["mean_steps_per_canvas"] == 3.0
    assert st["forward_passes"] == 6 * (1 + 3)  # prefill + 3 steps, one canvas each
    assert st["tokens_per_forward"] == pytest.approx(st["tokens"] / st["forward_passes"])
    assert st["ar_examples"] == 4 and st["ar_max_new_tokens"] == 8 and st["ar_tokens"] <= 32
    assert st["speedup_vs_ar"] == pytest.approx(st["tokens_per_second"] / st["ar_tokens_per_second"])
    for p in ("", "ar_"):  # the prompts' encoding is part of the time; the decode rate leaves it out
        assert 0 < st[f"{p}prefill_seconds"] < st[f"{p}seconds"]
        assert st[f"{p}decode_tokens_per_second"] == pytest.approx(
            st[f"{p}tokens"] / (st[f"{p}seconds"] - st[f"{p}prefill_seconds"]))


def test_same_seed_same_outputs(workdir, tmp_path):
    run = load(workdir)
    for d in ("a", "b"):
        run_one(run, tmp_path / d)
    run_one(load(workdir, "--cfg.eval_ds.seed=1"), tmp_path / "c")
    a, b, c = (outputs(tmp_path / d) for d in "abc")
    assert [r["output"] for r in a] == [r["output"] for r in b]
    assert [r["output"] for r in a] != [r["output"] for r in c]
    assert [r["reference"] for r in a] == [r["reference"] for r in c]  # same puzzles, other sampling seed
    assert json.loads((tmp_path / "c/eval/sample_ar_steps3/step_2.json").read_text())["settings"]["seed"] == 1


def test_eval_num_batches_caps_examples(workdir, tmp_path):
    result = run_one(load(workdir, "--cfg.aux.eval_num_batches=1"), tmp_path)
    assert result["num_examples"] == 4 and len(outputs(tmp_path)) == 4
    assert result["settings"]["num_batches"] == 1


def test_early_stopping_names_and_settings(workdir, tmp_path):
    run = load(workdir)
    task = get_task("sudoku")
    evs = default_evaluators(run.cfg, task)
    assert [e.name for e in evs] == ["sample_ar_steps3", "sample_ar_steps3_early_stopping"]
    assert [e.early_stopping for e in evs] == [False, True]
    off = apply_overrides(run.cfg, ["--cfg.eval_ds.early_stopping=none", "--cfg.eval_ds.steps=32,64"])
    assert [e.name for e in default_evaluators(off, task)] == ["sample_ar_steps32", "sample_ar_steps64"]
    results = run_evaluators(run, task, evs, out_dir=tmp_path, ar_max_tokens=0)
    es = json.loads((tmp_path / "eval" / "sample_ar_steps3_early_stopping" / "step_2.json").read_text())
    assert es == json.loads(json.dumps(results[1]))
    assert es["settings"]["early_stopping"] == "entropy"
    assert es["settings"]["stopping"] == {"rule": "entropy", "threshold": 0.05}
    assert results[0]["settings"]["stopping"] == {"rule": "none"}
    assert es["stats"]["ar_tokens_per_second"] is None and es["stats"]["speedup_vs_ar"] is None


def test_tensorboard_tags(workdir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_one(load(workdir), tmp_path)
    acc = EventAccumulator(str(tmp_path / "eval" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/sample_ar_steps3/accuracy", "eval/sample_ar_steps3/cell_accuracy_hard",
            "eval/sample_ar_steps3/tokens_per_forward", "eval/sample_ar_steps3/ar_tokens_per_second"} <= tags
    assert [e.step for e in acc.Scalars("eval/sample_ar_steps3/accuracy")] == [2]


def test_visualize_writes_first_k(workdir, tmp_path):
    run_one(load(workdir), tmp_path, visualize=2)
    viz = tmp_path / "eval" / "sample_ar_steps3" / "viz"
    assert sorted(p.name for p in viz.iterdir()) == ["step_2_ex0.gif", "step_2_ex0.png", "step_2_ex1.gif",
                                                     "step_2_ex1.png"]


def test_recording_does_not_change_outputs(workdir, tmp_path):
    run = load(workdir)
    run_one(run, tmp_path / "a", visualize=5)
    run_one(run, tmp_path / "b")
    assert [r["output"] for r in outputs(tmp_path / "a")] == [r["output"] for r in outputs(tmp_path / "b")]


# ------------------------------------------------------------------------------- names, tasks
def test_parse_evaluator():
    sudoku, pubmed = get_task("sudoku"), get_task("pubmedqa")
    assert parse_evaluator("sample_ar_steps32", sudoku) == Evaluator("sample_ar_steps32", "eval", 32, False)
    assert parse_evaluator("sample_ar_steps64_early_stopping", pubmed).split == "test"
    ev = parse_evaluator("train_eval_sample_ar_steps8_early_stopping", pubmed)
    assert (ev.split, ev.num_steps, ev.early_stopping) == ("train_eval", 8, True)
    for bad in ("sample_ar_steps", "sample_ar_steps0", "steps32", "sample_ar_steps32_early"):
        with pytest.raises(DGemmaError, match="bad evaluator name"):
            parse_evaluator(bad, sudoku)
    with pytest.raises(DGemmaError, match="no eval split 'train_eval'"):
        parse_evaluator("train_eval_sample_ar_steps8", sudoku)


def test_generated_sudoku_eval_set_is_held_out():
    from dgemma.data.char_tokenizer import CharTokenizer
    from dgemma.data.sudoku import count_solutions
    from dgemma.tasks.sudoku import SudokuStream
    from dgemma.training.config import Config

    recs = generate_eval_puzzles(9, seed=SUDOKU_EVAL_SEED)
    assert recs == generate_eval_puzzles(9, seed=SUDOKU_EVAL_SEED)
    assert recs[:4] == generate_eval_puzzles(4, seed=SUDOKU_EVAL_SEED)
    assert [r["difficulty"] for r in recs] == ["easy", "medium", "hard"] * 3
    assert all(count_solutions(r["puzzle"]) == 1 for r in recs)
    assert len({r["puzzle"] for r in recs}) == 9
    assert Config().eval_ds.puzzle_seed == SUDOKU_EVAL_SEED
    other = apply_overrides(Config(), ["--cfg.eval_ds.puzzle_seed=5"])
    assert get_task("sudoku").load(other, limit=3) == generate_eval_puzzles(3, seed=5) != recs[:3]
    pool = set(SudokuStream(CharTokenizer.named("digits"), prompt_len=82, num_canvases=1, canvas_size=81,
                            seed=0).pool)
    assert not pool & {r["solution"] for r in recs}


def test_sudoku_stream_unique_share():
    """A share of unique puzzles: those records have one solution (their clues' count in the pool's
    range), the rest are the random blanks of the plain stream; the pool comes from its own seed
    (not the eval puzzles'); a share of 0 leaves the plain stream's records as they were."""
    from dgemma.data.char_tokenizer import CharTokenizer
    from dgemma.data.sudoku import count_clues, count_solutions
    from dgemma.tasks.sudoku import SudokuStream

    kw = {"prompt_len": 82, "num_canvases": 1, "canvas_size": 81}
    tok = CharTokenizer.named("digits")
    plain = SudokuStream(tok, **kw)
    assert [plain.record(i) for i in range(5)] == [SudokuStream(tok, **kw, unique_share=0.0).record(i)
                                                   for i in range(5)]
    mixed = SudokuStream(tok, **kw, unique_share=0.5, unique_pool=30)
    assert mixed.unique == SudokuStream(tok, **kw, unique_share=0.5, unique_pool=30).unique  # seeded
    assert all(count_solutions(p) == 1 and 22 <= count_clues(p) <= 35 for p, _ in mixed.unique)
    eval_recs = generate_eval_puzzles(30, seed=SUDOKU_EVAL_SEED)
    assert not {s for _, s in mixed.unique} & {r["solution"] for r in eval_recs}
    recs = [mixed.record(i) for i in range(60)]
    assert recs == [mixed.record(i) for i in range(60)]
    unique = [r for r in recs if count_solutions(r["puzzle"]) == 1 and 22 <= count_clues(r["puzzle"]) <= 35]
    assert 15 <= len(unique) <= 50
    assert all(c in ("0", s) for r in recs for c, s in zip(r["puzzle"], r["solution"]))
    all_unique = SudokuStream(tok, **kw, unique_share=1.0, unique_pool=5)
    assert all(count_solutions(all_unique.record(i)["puzzle"]) == 1 for i in range(10))
    with pytest.raises(DGemmaError, match="share of unique puzzles"):
        SudokuStream(tok, **kw, unique_share=1.5)


def test_sudoku_unique_refused_where_it_cannot_apply(tmp_path):
    from dgemma.data.char_tokenizer import CharTokenizer
    from dgemma.training.config import Config
    from dgemma.training.trainer import build_train_data

    tok = CharTokenizer.named("digits")
    cfg = apply_overrides(Config(), ["--cfg.data.task=pubmedqa", "--cfg.data.sudoku_unique=0.5"])
    with pytest.raises(DGemmaError, match="sudoku_unique=0.5 is for the sudoku task"):
        build_train_data(cfg, tok)
    cfg = apply_overrides(Config(), [f"--cfg.data.path={tmp_path}", "--cfg.data.sudoku_unique=0.5"])
    with pytest.raises(DGemmaError, match="generated stream"):
        build_train_data(cfg, tok)
    with pytest.raises(DGemmaError, match="sudoku_unique must be in"):
        apply_overrides(Config(), ["--cfg.data.sudoku_unique=2"])
    cfg = apply_overrides(Config(), ["--cfg.data.sudoku_unique=0.25", "--cfg.data.sudoku_unique_pool=4",
                                     "--cfg.data.prompt_len=82", "--cfg.diffusion.canvas_size=81",
                                     "--cfg.diffusion.num_canvases=1"])
    data = build_train_data(cfg, tok)
    assert data.unique_share == 0.25 and len(data.unique) == 4
    narrow = build_train_data(apply_overrides(cfg, ["--cfg.data.sudoku_unique_clues=[24,25]"]), tok)
    assert {81 - p.count("0") for p, _ in narrow.unique} <= {24, 25}
    with pytest.raises(DGemmaError, match="sudoku_unique_clues must be"):
        apply_overrides(Config(), ["--cfg.data.sudoku_unique_clues=[30,20]"])


def test_task_loading_from_prepared_dir(tmp_path):
    from dgemma.tasks.sudoku import write_splits
    from dgemma.training.config import Config

    write_splits(tmp_path / "s", n=20, seed=3)
    cfg = apply_overrides(Config(), [f"--cfg.data.path={tmp_path / 's'}", "--cfg.eval_ds.num_examples=1"])
    task = get_task("sudoku")
    assert task.source(cfg, "eval") == str(tmp_path / "s" / "eval.jsonl")
    recs = task.load(cfg)
    assert len(recs) == 1 and recs[0]["id"].startswith("gen-s3-")
    assert len(task.load(apply_overrides(cfg, ["--cfg.eval_ds.num_examples=99"]))) == 2
    with pytest.raises(DGemmaError, match="data.path is not set"):
        get_task("pubmedqa").load(Config())
    with pytest.raises(DGemmaError, match="unknown task .mmlu.; choose one of"):
        get_task("mmlu")


def test_pubmedqa_scoring_is_pure():
    task = TASKS["pubmedqa"]
    recs = [{"prompt": "p", "response": "Because. The answer is: yes", "label": "yes", "long_answer": "Because."},
            {"prompt": "p", "response": "No. The answer is: no", "label": "no", "long_answer": "No."}]
    texts = ["Because. The answer is: yes", "It was yesterday."]
    m = task.score(texts, recs)
    assert m["accuracy"] == 0.5 and m["unparsed"] == 1 and m["count"] == 2
    one = task.score_one(texts[0], recs[0])
    assert one["prediction"] == "yes" and one["accuracy"] == 1.0 and one["bleu"] == pytest.approx(100.0)
    assert task.score_one(texts[1], recs[1])["prediction"] is None


def test_stop_ids_are_eos_and_end_of_turn():
    from dgemma.data.char_tokenizer import CharTokenizer

    tok = CharTokenizer.named("digits")
    assert get_task("sudoku").stop_ids(tok) == (tok.eos_id, tok.end_of_turn_id)


def test_max_canvases_precedence():
    from dgemma.training.config import Config

    cfg = apply_overrides(Config(), ["--cfg.diffusion.num_canvases=2"])
    assert max_canvases(cfg) == 2
    assert max_canvases(apply_overrides(cfg, ["--cfg.eval_ds.max_canvases=3"])) == 3
    assert max_canvases(apply_overrides(cfg, ["--cfg.eval_ds.max_canvases=3", "--cfg.aux.num_canvases=4"])) == 4


def test_rule_settings_reach_step_and_stopping_rule(workdir, tmp_path):
    run = load(workdir, "--cfg.eval_ds.step_type=confidence", "--cfg.eval_ds.confidence_threshold=0.8",
               "--cfg.eval_ds.stop_confidence_threshold=0.01")
    task = get_task("sudoku")
    _, plain = harness.build_sampler(run, task, num_steps=2, step_type="confidence", temperature=0.0,
                                     early_stopping=None)
    _, es = harness.build_sampler(run, task, num_steps=2, step_type="confidence", temperature=0.0,
                                  early_stopping="stable_confident")
    assert plain["step_args"]["threshold"] == 0.8 and plain["stopping"] == {"rule": "none"}
    assert es["stopping"] == {"rule": "stable_confident", "stability_threshold": 1, "confidence_threshold": 0.01}
    _, block = harness.build_sampler(load(workdir, "--cfg.eval_ds.commit_block=9"), task, num_steps=2,
                                     step_type="commit", temperature=0.0, early_stopping=None)
    assert block["step_args"]["block"] == 9 and block["step_args"]["order"] == "confidence"
    _, margin = harness.build_sampler(load(workdir, "--cfg.eval_ds.commit_order=margin"), task, num_steps=2,
                                      step_type="commit", temperature=0.0, early_stopping=None)
    assert margin["step_args"]["order"] == "margin" and margin["step_args"]["stable_first"] is True
    _, alone = harness.build_sampler(load(workdir, "--cfg.eval_ds.commit_stable_first=false"), task, num_steps=2,
                                     step_type="commit", temperature=0.0, early_stopping=None)
    assert alone["step_args"]["stable_first"] is False and alone["step_args"]["no_repeat"] is False
    _, norep = harness.build_sampler(load(workdir, "--cfg.eval_ds.commit_no_repeat=true"), task, num_steps=2,
                                     step_type="commit", temperature=0.0, early_stopping=None)
    assert norep["step_args"]["no_repeat"] is True
    assert margin["self_condition"] is True
    plain, settings = harness.build_sampler(load(workdir, "--cfg.eval_ds.self_condition=false"), task, num_steps=2,
                                            step_type="commit", temperature=0.0, early_stopping=None)
    assert settings["self_condition"] is False and plain.self_condition is False
    assert margin["fuse_append"] is True
    own, settings = harness.build_sampler(load(workdir, "--cfg.eval_ds.fuse_append=false"), task, num_steps=2,
                                          step_type="commit", temperature=0.0, early_stopping=None)
    assert settings["fuse_append"] is False and own.fuse_append is False
    assert margin["reuse_canvas_keys"] is False and own.reuse_canvas_keys is False  # exact by default
    approx, settings = harness.build_sampler(load(workdir, "--cfg.eval_ds.reuse_canvas_keys=true"), task, num_steps=2,
                                             step_type="commit", temperature=0.0, early_stopping=None)
    assert settings["reuse_canvas_keys"] is True and approx.reuse_canvas_keys is True


def test_pinned_clues_reach_the_sampler(workdir):
    run = load(workdir, "--cfg.data.pin_clues=true")
    task = get_task("sudoku")
    recs = task.load(run.cfg, limit=2)
    sampler, settings = harness.build_sampler(run, task, num_steps=2, step_type="commit", temperature=1.0,
                                              early_stopping=None)
    assert settings["pin_clues"] is True
    gen = harness.generate(run, sampler, recs, batch_size=2, record_first=2)
    for i, r in enumerate(recs):
        first = gen.trajectories[i][0]
        clues = [n for n, d in enumerate(r["puzzle"]) if d != "0"]
        assert all(first["committed"][n] for n in clues)
        assert run.tokenizer.decode([first["tokens"][n] for n in clues]) == "".join(r["puzzle"][n] for n in clues)


def test_pins_force_a_prefix_per_record_and_the_rest_is_unchanged(workdir):
    """``pins`` fixes each record's first response tokens (a forced prefix, pubmedqa_distill's verdict).

    Rows are independent: a row that pins nothing decodes what it decodes without pins. (With
    ``pin_clues`` the pins replace the clue hints, so there an empty pin frees the clues too.)"""
    run = load(workdir, "--cfg.data.pin_clues=false")
    task = get_task("sudoku")
    recs = task.load(run.cfg, limit=4)
    sampler, _ = harness.build_sampler(run, task, num_steps=3, step_type="commit", temperature=0.0,
                                       early_stopping=None)
    free = harness.generate(run, sampler, recs, batch_size=4)
    prefix = run.tokenizer.encode("987")
    pinned = harness.generate(run, sampler, recs, batch_size=4, pins=[prefix, [], prefix, []])
    for i in (0, 2):
        assert pinned.tokens[i][:len(prefix)] == prefix
        assert free.tokens[i][:len(prefix)] != prefix  # the pin changed something
    for i in (1, 3):
        assert pinned.tokens[i] == free.tokens[i]


def test_generic_completion_task(tmp_path):
    from dgemma.training.config import Config

    rows = [{"prompt": "2+2=", "completion": "The answer is 4"}, {"prompt": "3+3=", "completion": "The answer is 6"}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = apply_overrides(Config(), ["--cfg.data.task=completion", f"--cfg.data.path={tmp_path / 'train.jsonl'}",
                                     r"--cfg.eval_ds.regex=answer is (?P<answer>\d+)"])
    task = get_task("completion").configure(cfg)
    assert task.source(cfg, "eval") == str(tmp_path / "eval.jsonl")
    recs = task.load(cfg)
    assert [r["response"] for r in recs] == ["The answer is 4", "The answer is 6"]
    m = task.score(["so the answer is 4", "The answer is 6"], recs)
    assert m["answer_accuracy"] == 1.0 and m["exact_match"] == 0.5
    assert task.score_one("answer is 5", recs[0])["answer_correct"] == 0.0
    other = apply_overrides(cfg, [f"--cfg.eval_ds.path={tmp_path / 'other.jsonl'}"])
    assert task.source(other, "eval") == str(tmp_path / "other.jsonl")
