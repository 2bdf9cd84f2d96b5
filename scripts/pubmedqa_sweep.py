"""Tokens per forward against quality for the adapted PubMedQA model: its commit sampler at several
step counts and commit blocks, beside its AR fine-tune, on the first N test questions.

    python scripts/pubmedqa_sweep.py [--workdir checkpoints/pubmedqa_270m] [--questions 32] [--batch 16]

How far the 2.5x-AR decoding target is: a denoising pass of this model costs about two AR steps
at batch 1 (docs/benchmarks.md), so the sampler must commit about 5 tokens a pass at the AR
fine-tune's quality. Each row decodes the same questions through ``dgemma/eval/harness.py``
(greedy, no early stop, the run's own sampler settings except the ones named) and scores them
with the task (accuracy, unparsed verdicts, BLEU, macro-F1). Time is at batch ``--batch``, so
compare ``tok/fwd`` and quality across rows, not seconds with the batch-1 tables.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from dgemma.eval import harness
from dgemma.tasks import get_task
from dgemma.training.runs import load_run

# (row name, step rule, steps, eval_ds overrides); blocks of 4 are the shipped evaluations' setting. The
# confidence rule's steps are a ceiling: it commits every position above the threshold, so its pace follows the
# model's certainty and a canvas ends as soon as every position is committed.
VARIANTS = [("S=32 block 4", "commit", 32, {}), ("S=16 block 4", "commit", 16, {}),
            ("S=16 block 8", "commit", 16, {"commit_block": 8}), ("S=8 block 4", "commit", 8, {}),
            ("S=8 block 8", "commit", 8, {"commit_block": 8}), ("S=8 no block", "commit", 8, {"commit_block": None}),
            ("S=8 block 4, margin order", "commit", 8, {"commit_order": "margin"}),
            ("S=8 block 4, confidence only", "commit", 8, {"commit_stable_first": False}),
            ("S=4 block 4", "commit", 4, {})]
VARIANTS += [(f"S={n} block 4", "commit", n, {}) for n in (12, 10)]  # between the 16- and 8-step rows
VARIANTS += [(f"S={n} block 4, no self-conditioning", "commit", n, {"self_condition": False})
             for n in (32, 16, 12, 10, 8, 4)]
VARIANTS += [(f"S={n} block 4, no repeat", "commit", n, {"commit_no_repeat": True}) for n in (16, 8, 4)]
VARIANTS += [(f"S={n} block 4, no repeat, no self-conditioning", "commit", n,
              {"commit_no_repeat": True, "self_condition": False}) for n in (16, 8, 4)]
VARIANTS += [(f"p>{p} block {b or 'none'}, S<=32", "confidence", 32, {"confidence_threshold": p, "commit_block": b})
             for p, b in [(0.9, 4), (0.7, 4), (0.5, 4), (0.3, 4), (0.9, 8), (0.7, 8), (0.9, None), (0.7, None),
                          (0.5, None)]]  # dParallel decodes at 0.5 over a whole 32-token block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="checkpoints/pubmedqa_270m", help="the adapter")
    p.add_argument("--step", type=int, default=None, help="the adapter's checkpoint (default: its latest)")
    p.add_argument("--ar", default="checkpoints/pubmedqa_270m/ar", help="the AR fine-tune of the same weights")
    p.add_argument("--questions", type=int, default=32, help="first N test questions")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", nargs="*", help="only the rows whose name starts with one of these (the AR row: 'AR')")
    p.add_argument("--prefix", help="a forced response prefix for both decoders, e.g. 'The answer is:' "
                                    "(eval_ds.response_prefix)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    diff = load_run(Path(args.workdir), step=args.step, dtype=args.dtype)
    diff.cfg.eval_ds = dataclasses.replace(diff.cfg.eval_ds, response_prefix=args.prefix)
    task = get_task("pubmedqa").configure(diff.cfg)
    questions = task.load(diff.cfg, "test", limit=args.questions)
    base = diff.cfg.eval_ds
    dtype = next(diff.model.parameters()).dtype
    print(f"{len(questions)} test questions, batch {args.batch}, {dtype}, LoRA {diff.lora}, "
          f"response prefix {args.prefix!r}\n")
    print("| row | tok/fwd | s | accuracy | unparsed | BLEU | macro-F1 |\n|---|---|---|---|---|---|---|")

    def show(name: str, run, gen, steps: int = 0) -> None:
        st = gen.stats(steps)
        _, m = gen.scored(task, run.tokenizer)
        print(f"| {name} | {st['tokens_per_forward']:.2f} | {st['seconds']:.1f} | {m['accuracy']:.3f} | "
              f"{m['unparsed']} | {m['bleu']:.2f} | {m['macro_f1']:.3f} |", flush=True)

    def wanted(name: str) -> bool:
        return not args.rows or any(name.startswith(r) for r in args.rows)

    if wanted("AR"):
        ar = load_run(Path(args.ar), dtype=args.dtype)
        ar.cfg.eval_ds = dataclasses.replace(ar.cfg.eval_ds, response_prefix=args.prefix)
        ar_tokens = ar.cfg.diffusion.canvas_size * harness.max_canvases(ar.cfg)
        show("AR fine-tune", ar, harness.generate_ar(ar, task, questions, batch_size=args.batch,
                                                     max_new_tokens=ar_tokens))
    for name, step_type, steps, overrides in filter(lambda v: wanted(v[0]), VARIANTS):
        diff.cfg.eval_ds = dataclasses.replace(base, **overrides)
        sampler, _ = harness.build_sampler(diff, task, num_steps=steps, step_type=step_type, temperature=0.0,
                                           early_stopping=None)
        show(name, diff, harness.generate(diff, sampler, questions, batch_size=args.batch, seed=base.seed), steps)


if __name__ == "__main__":
    main()
