"""CPU smoke test of the command line: prepare, train a few steps of a tiny model, eval and plot,
for each task, through ``python -m dgemma`` in subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PUBMEDQA = Path(__file__).parents[2].parent / "shared" / "data" / "pubmedqa"
TINY = ["--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64", "--cfg.model.num_hidden_layers=1",
        "--cfg.model.layer_types=full_attention", "--cfg.data.batch_size=4", "--cfg.train.steps=2",
        "--cfg.train.checkpoint_every=2", "--cfg.train.log_every=1"]
# configs/sft_pubmedqa_tiny.py (LoRA on a tiny random base), or the same shape from sudoku_small.py
PUBMEDQA_CONFIG = ["--cfg=configs/sft_pubmedqa_tiny.py"] if (REPO / "configs" / "sft_pubmedqa_tiny.py").is_file() else [
    "--cfg=configs/sudoku_small.py", *TINY, "--cfg.data.task=pubmedqa", "--cfg.model.self_conditioning=true",
    "--cfg.model.canvas_position_groups=null",
    "--cfg.data.prompt_len=64", "--cfg.diffusion.process=uniform", "--cfg.diffusion.canvas_size=16",
    "--cfg.diffusion.num_canvases=2", "--cfg.diffusion.selfcond_prob=0.5", "--cfg.diffusion.ar_loss_weight=1.0",
    "--cfg.eval_ds.step_type=ddim", "--cfg.eval_ds.temperature=0.7", "--cfg.eval_ds.early_stopping=entropy"]
EVAL_KEYS = {"eval_name", "task", "split", "source", "checkpoint_step", "num_examples", "metrics", "stats", "settings"}


def dgemma(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "dgemma", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    if ok:
        assert r.returncode == 0, f"dgemma {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}"
    return r


def read_eval(workdir: Path, name: str, step: int = 2) -> tuple[dict, list[dict]]:
    d = workdir / "eval" / name
    result = json.loads((d / f"step_{step}.json").read_text())
    rows = [json.loads(x) for x in (d / f"step_{step}.jsonl").read_text().splitlines()]
    assert set(result) == EVAL_KEYS and result["eval_name"] == name and result["checkpoint_step"] == step
    assert len(rows) == result["num_examples"] == result["metrics"]["count"]
    assert {"prompt", "output", "reference", "score"} <= set(rows[0])
    return result, rows


def test_sudoku_prepare_train_eval_plot(tmp_path):
    data, wd = tmp_path / "data", tmp_path / "run"
    dgemma("prepare", "sudoku", "--out", data, "--n", "20", "--seed", "1")
    assert [len((data / f).read_text().splitlines()) for f in ("train.jsonl", "eval.jsonl")] == [18, 2]
    dgemma("train", "--cfg=configs/sudoku_small.py", f"--cfg.workdir={wd}", f"--cfg.data.path={data}", *TINY)
    assert (wd / "config.json").is_file() and (wd / "checkpoints" / "step_00000002").is_dir()
    r = dgemma("eval", f"--cfg.workdir={wd}", "--cfg.eval_ds.steps=3", "--cfg.eval_ds.early_stopping=entropy",
               "--visualize=1", "--ar_max_tokens=8")
    assert "sample_ar_steps3_early_stopping" in r.stdout and "cell_accuracy" in r.stdout
    for name in ("sample_ar_steps3", "sample_ar_steps3_early_stopping"):
        result, rows = read_eval(wd, name)
        assert result["task"] == "sudoku" and result["source"] == str(data / "eval.jsonl")
        assert result["num_examples"] == 2 and {"accuracy_hard", "valid_accuracy"} <= set(result["metrics"])
        assert result["stats"]["ar_tokens_per_second"] > 0
        assert {p.name for p in (wd / "eval" / name / "viz").iterdir()} == {"step_2_ex0.gif", "step_2_ex0.png"}
    assert list((wd / "eval" / "tb").glob("events.out.tfevents.*"))
    r = dgemma("plot", f"--cfg.workdir={wd}")
    assert Path(r.stdout.strip()) == wd / "plots" / "curves.png" and (wd / "plots" / "curves.png").stat().st_size
    r = dgemma("eval", "--task=sudoku", ok=False)
    assert r.returncode == 2 and "missing --cfg.workdir" in r.stderr


def byte_level_tokenizer(train_jsonl: Path, out: Path) -> Path:
    """A 300-token byte-level BPE with Gemma's special-token names, trained on a few prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(x)["prompt"][:1000] for x in train_jsonl.read_text().splitlines()[:40]]
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


@pytest.mark.skipif(not (PUBMEDQA / "ori_pqal.json").is_file(), reason=f"PubMedQA data not found at {PUBMEDQA}")
def test_pubmedqa_prepare_train_eval(tmp_path):
    data, wd = tmp_path / "data", tmp_path / "run"
    dgemma("prepare", "pubmedqa", "--source", PUBMEDQA, "--out", data)
    tok = byte_level_tokenizer(data / "train.jsonl", tmp_path / "tok")
    dgemma("train", *PUBMEDQA_CONFIG, f"--cfg.workdir={wd}", "--cfg.train.steps=2", "--cfg.train.checkpoint_every=2",
           f"--cfg.data.path={data}", f"--cfg.data.tokenizer={tok}", "--cfg.model.vocab_size=304")
    names = ["sample_ar_steps3", "train_eval_sample_ar_steps3_early_stopping"]
    r = dgemma("eval", "--cfg=configs/sudoku_small.py", f"--cfg.workdir={wd}", "--task=pubmedqa",
               f"--eval_names={','.join(names)}", "--cfg.eval_ds.num_examples=3", "--cfg.eval_ds.batch_size=2",
               "--visualize=1", "--ar_max_tokens=8")
    assert all(n in r.stdout for n in names) and "macro_f1" in r.stdout and "is not read" in r.stderr
    for name, split in zip(names, ("test", "train_eval")):
        result, rows = read_eval(wd, name)
        assert result["split"] == split and result["source"] == str(data / f"{split}.jsonl")
        assert result["num_examples"] == 3
        assert {"accuracy", "macro_f1", "bleu", "unparsed"} <= set(result["metrics"])
        assert {"prediction", "label", "accuracy", "bleu"} == set(rows[0]["score"])
        s = result["settings"]
        assert (s["step_type"], s["temperature"], s["max_canvases"]) == ("ddim", 0.7, 2)
        assert (wd / "eval" / name / "viz" / "step_2_ex0.gif").is_file()
    _, rows = read_eval(wd, names[0])
    test_ids = [json.loads(x)["id"] for x in (data / "test.jsonl").read_text().splitlines()[:3]]
    assert [r["id"] for r in rows] == test_ids
