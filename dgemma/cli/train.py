"""``dgemma train --cfg=FILE [--cfg.a.b=value ...]`` (also under ``torchrun ... -m dgemma train``).

With ``--cfg.train.eval_every=N`` the first of the task's evaluators (``sample_ar_steps{N}``), or
the one ``train.eval_name`` names (``train_eval_sample_ar_steps16``, ``train_eval_ar_greedy``),
runs on the live model every N steps and at the end; its headline metrics go to TensorBoard and
``metrics.jsonl`` (split ``eval``), its files to ``WORKDIR/eval/``.
"""

from __future__ import annotations

import os

from dgemma.errors import DGemmaError


def eval_hook(trainer, step: int) -> dict:
    """Evaluate the model being trained (rank 0 of a single process or DDP run)."""
    from dgemma.eval.harness import default_evaluators, parse_evaluator, run_evaluators
    from dgemma.tasks import get_task
    from dgemma.training.runs import Run

    cfg = trainer.cfg
    task = get_task(cfg.data.task).configure(cfg)
    run = Run(cfg, trainer.model.eval(), trainer.tokenizer, step, trainer.workdir / "checkpoints" / f"step_{step:08d}",
              "average" if trainer.ema is not None else "raw",  # the trainer applies the average around hooks
              "adapter" if cfg.lora.enabled else "none")
    chosen = [parse_evaluator(cfg.train.eval_name, task)] if cfg.train.eval_name else default_evaluators(cfg, task)[:1]
    try:
        with trainer.autocast():  # the training dtype: bf16 where it is native
            results = run_evaluators(run, task, chosen, out_dir=trainer.workdir, ar_max_tokens=0)
    finally:
        trainer.model.train()
    return {f"{r['eval_name']}/{k}": v for r in results for k, v in r["metrics"].items() if k in task.primary}


def run(argv: list[str]) -> int:
    from dgemma.training.config import parse_cli
    from dgemma.training.trainer import train

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nEvery setting is --cfg.SECTION.FIELD=VALUE; see docs/reference/config.md.")
        return 0
    cfg, rest = parse_cli(argv)
    if rest:
        raise DGemmaError(f"unexpected arguments {rest}; every setting is --cfg.KEY=VALUE")
    hooks = []
    if cfg.train.eval_every and not (cfg.train.distributed == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        hooks = [eval_hook]
    out = train(cfg, hooks=hooks)
    if out and int(os.environ.get("RANK", "0")) == 0:
        print(f"[dgemma] done: step {cfg.train.steps}, loss {out['loss']:.4f}")
    return 0
