"""`dgemma train --cfg.train.eval_every=N` evaluates the live model and logs the eval split."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_periodic_eval_during_training(tmp_path):
    work = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "dgemma", "train", "--cfg=configs/sft_sudoku_tiny.py",
                        f"--cfg.workdir={work}", "--cfg.train.steps=2", "--cfg.train.eval_every=1",
                        "--cfg.eval_ds.num_examples=4", "--cfg.eval_ds.steps=4", "--cfg.eval_ds.batch_size=4",
                        "--cfg.train.threads=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    evals = [json.loads(line) for line in (work / "metrics.jsonl").open() if '"split": "eval"' in line]
    assert [e["step"] for e in evals] == [1, 2]
    assert "sample_ar_steps4/accuracy" in evals[0]
    assert (work / "eval/sample_ar_steps4/step_2.json").is_file()
