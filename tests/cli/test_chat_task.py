"""The chat task end to end on the command line: a chat JSONL of the user's own trains and
evaluates; malformed files give file:line messages and skip/fail per data.on_error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TINY = ["--cfg.init.base=null", "--cfg.lora.enabled=false", "--cfg.model.vocab_size=262144",
        "--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64", "--cfg.model.num_hidden_layers=2",
        "--cfg.model.num_attention_heads=2", "--cfg.model.num_key_value_heads=1", "--cfg.model.head_dim=16",
        "--cfg.model.query_pre_attn_scalar=16", "--cfg.model.layer_types=sliding_attention,full_attention",
        "--cfg.diffusion.canvas_size=16", "--cfg.data.prompt_len=96", "--cfg.data.batch_size=2",
        "--cfg.train.steps=2", "--cfg.train.checkpoint_every=2", "--cfg.train.threads=2",
        "--cfg.optim.warmup_steps=1", "--cfg.diffusion.loss_chunk_tokens=64"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from dgemma.models.pretrained import prepare_gemma3_270m

    return str(prepare_gemma3_270m())  # the cache folder holds tokenizer.json (built once, ~100 s)


def dgemma(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "dgemma", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def test_chat_train_then_eval(tmp_path, gemma_tokenizer):
    train = tmp_path / "train.jsonl"
    rows = [json.loads(line) for line in (ROOT / "examples/arithmetic/data/train.jsonl").open()][:16]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    work = tmp_path / "run"
    r = dgemma("train", "--cfg=configs/sft_chat.py", f"--cfg.workdir={work}", f"--cfg.data.path={train}",
               f"--cfg.data.tokenizer={gemma_tokenizer}", *TINY)
    assert r.returncode == 0, r.stderr[-2000:]
    r = dgemma("eval", "--task=chat", f"--cfg.workdir={work}", f"--cfg.eval_ds.path={evals}",
               "--cfg.eval_ds.steps=4", "--cfg.eval_ds.batch_size=4", "--cfg.eval_ds.early_stopping=null")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((work / "eval/sample_ar_steps4/step_2.json").read_text())
    for key in ("answer_accuracy", "exact_match", "bleu", "chrf", "rouge_l"):
        assert key in out["metrics"]
    lines = (work / "eval/sample_ar_steps4/step_2.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_malformed_chat_file_is_reported_by_line(tmp_path, gemma_tokenizer):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is 4."}]}
    bad.write_text(json.dumps(good) + "\n" + "{not json\n"
                   + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ["train", "--cfg=configs/sft_chat.py", f"--cfg.workdir={tmp_path / 'w'}", f"--cfg.data.path={bad}",
            f"--cfg.data.tokenizer={gemma_tokenizer}", *TINY]
    r = dgemma(*args)
    assert r.returncode == 2
    assert f"{bad}:2:" in r.stderr and "invalid JSON" in r.stderr
    r = dgemma(*args, "--cfg.data.on_error=skip", "--cfg.data.batch_size=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipped 2" in (r.stdout + r.stderr)
