"""One GPU, about 8 minutes: fine-tune configs/sft_sudoku.py (LoRA r8 on Gemma 3 270M) and
evaluate ``sample_ar_steps64`` on 256 held-out puzzles; prints the metrics (issue: tasks, "On a
GPU"). Installs nothing: run it where dgemma and its dependencies (and the gemma3-270m package,
or a built ~/.cache/dgemma cache) are present.

    python scripts/gpu_sft_sudoku.py --minutes 8 --workdir /tmp/sft_sudoku_gpu
    python scripts/gpu_sft_sudoku.py --smoke            # a CPU dry run at toy sizes

The step budget comes from timing the first steps; the LR schedule is set to that many steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=8.0, help="training budget (evaluation comes on top)")
    ap.add_argument("--workdir", default="/tmp/sft_sudoku_gpu")
    ap.add_argument("--puzzles", type=int, default=6000, help="generated puzzles (90/10 split)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on any device, to check the script")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --smoke for a CPU dry run")
        return 2

    from dgemma.tasks.sudoku import write_splits
    from dgemma.eval.harness import Evaluator, run_evaluators
    from dgemma.training.config import apply_overrides, load_config
    from dgemma.training.runs import load_run
    from dgemma.training.trainer import Trainer

    work = Path(args.workdir)
    data = work.parent / (work.name + "_data")
    if not (data / "train.jsonl").exists():
        t0 = time.time()
        write_splits(data, n=args.puzzles if not args.smoke else 40, seed=0)
        print(f"[gpu_sft_sudoku] {args.puzzles} puzzles in {time.time() - t0:.0f}s -> {data}")
    overrides = [f"--cfg.workdir={work}", f"--cfg.data.path={data}", "--cfg.train.checkpoint_every=100000",
                 "--cfg.train.log_every=10", "--cfg.eval_ds.steps=64", "--cfg.eval_ds.early_stopping=null",
                 "--cfg.eval_ds.num_examples=256", "--cfg.eval_ds.batch_size=64"]
    if args.smoke:
        overrides += ["--cfg.init.base=null", "--cfg.lora.enabled=false", "--cfg.data.tokenizer=digits",
                      "--cfg.model.vocab_size=16", "--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64",
                      "--cfg.model.num_hidden_layers=2", "--cfg.model.num_attention_heads=2",
                      "--cfg.model.num_key_value_heads=1", "--cfg.model.head_dim=16",
                      "--cfg.model.query_pre_attn_scalar=16",
                      "--cfg.model.layer_types=sliding_attention,full_attention", "--cfg.data.prompt_len=82",
                      "--cfg.diffusion.canvas_size=96", "--cfg.data.batch_size=4", "--cfg.eval_ds.num_examples=4",
                      "--cfg.eval_ds.steps=4", "--cfg.eval_ds.batch_size=4"]
    else:
        overrides += ["--cfg.model.attn_implementation=sdpa", "--cfg.train.dtype=bfloat16"]
    cfg = apply_overrides(load_config(ROOT / "configs/sft_sudoku.py"), overrides)

    probe = apply_overrides(cfg, [f"--cfg.workdir={work}_probe", "--cfg.train.steps=4", "--cfg.train.resume=false"])
    t0 = time.time()
    Trainer(probe).run()
    per_step = max((time.time() - t0) / 4, 1e-3)  # includes start-up: a conservative estimate
    steps = 6 if args.smoke else max(50, int(args.minutes * 60 / per_step))
    cfg = apply_overrides(cfg, [f"--cfg.train.steps={steps}", f"--cfg.optim.warmup_steps={min(100, steps // 10)}"])
    print(f"[gpu_sft_sudoku] ~{per_step:.2f}s/step -> {steps} steps")
    t0 = time.time()
    last = Trainer(cfg).run()
    train_s = time.time() - t0

    run = load_run(work, device="cuda" if torch.cuda.is_available() else "cpu")
    res = run_evaluators(run, "sudoku", [Evaluator("sample_ar_steps64" if not args.smoke else "sample_ar_steps4",
                                                   "eval", 64 if not args.smoke else 4, False)])[0]
    metrics = res["metrics"] if "metrics" in res else res
    keys = ["accuracy", "accuracy_easy", "accuracy_medium", "accuracy_hard", "cell_accuracy", "blank_accuracy",
            "valid_accuracy", "count"]
    print("\n| metric | value |\n|---|---|")
    print(f"| train steps | {steps} |\n| train seconds | {train_s:.0f} |\n| final loss | {last.get('loss', float('nan')):.4f} |")
    for k in keys:
        if k in metrics:
            print(f"| {k} | {metrics[k]:.4f} |" if isinstance(metrics[k], float) else f"| {k} | {metrics[k]} |")
    stats = res.get("stats", {})
    for k in ("tokens_per_forward", "tokens_per_second", "speedup_vs_ar"):
        if k in stats:
            print(f"| {k} | {stats[k]:.3f} |")
    (work / "gpu_summary.json").write_text(json.dumps({"steps": steps, "train_seconds": train_s, "result": res},
                                                      indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
