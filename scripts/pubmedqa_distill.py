"""Self-distillation data for the PubMedQA adapter: its own slow, careful answers as new targets.

    python scripts/pubmedqa_distill.py --out data/pubmedqa_distill [--workdir checkpoints/pubmedqa_270m]
        [--steps 32] [--split train] [--batch 16]

Why: a denoiser can commit many positions in one pass only where it is sure of each of them on
its own. Trained on reference answers, whose wording varies freely for the same question, its
per-position distributions stay spread, so fast decoding (few passes a canvas) writes doubled
words and drops the verdict's fixed words (checkpoints/pubmedqa_270m/sweep_2026-12-05.md).
Sequence-level distillation (Kim & Rush 2016; the standard recipe for non-autoregressive
translation) replaces each target with what the model itself writes when decoded slowly: one
answer per question, a deterministic function of the prompt, which a fine-tune on it learns to
predict with sharper marginals, so that fewer passes give the same text.

The records keep every field of ``DATA/SPLIT.jsonl`` (id, prompt, label, long answer) and replace
``response`` with the decoded answer (its stop token dropped: the data pipeline appends the
run's own). Only the training split is distilled by default, so the held-out and test questions
stay unseen. The other splits are copied unchanged, with a ``meta.json`` that names the teacher.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from dgemma.data.sft import read_jsonl
from dgemma.eval import harness
from dgemma.tasks import get_task
from dgemma.tasks.pubmedqa import format_target
from dgemma.training.runs import load_run


def verdict_hints(tokenizer, records: list[dict]) -> list[list[int]]:
    """Per record, the token ids of its label's verdict sentence as the data was prepared
    (``dgemma/tasks/pubmedqa.py:format_target``, verdict first: "The answer is: X."), which must be
    how its reference answer starts once tokenized."""
    rows = []
    for r in records:
        verdict = format_target("", r["label"], "first").rstrip()
        ids = tokenizer.encode(verdict)
        if tokenizer.encode(r["response"])[: len(ids)] != ids:
            raise SystemExit(f"record {r['id']}: the reference answer does not start with {verdict!r} as tokens "
                             f"(prepare the data with --verdict first)")
        rows.append(ids)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="checkpoints/pubmedqa_270m", help="the teacher adapter")
    p.add_argument("--out", required=True, help="a new data folder (the teacher's data folder layout)")
    p.add_argument("--split", default="train")
    p.add_argument("--steps", type=int, default=32, help="steps per canvas (the teacher's slow decoding; a ceiling "
                   "with --threshold)")
    p.add_argument("--threshold", type=float, default=None,
                   help="decode with the confidence step at this threshold instead of the commit step")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--limit", type=int, default=None, help="first N questions of the split only")
    p.add_argument("--pin-verdict", action="store_true",
                   help="pin each answer's first words to the reference verdict (\"The answer is: X.\"), so the "
                        "labels stay in the targets and the teacher writes only the explanation")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists: choose a new folder (nothing was written)")
    run = load_run(Path(args.workdir), dtype=args.dtype)
    task = get_task("pubmedqa").configure(run.cfg)
    src = Path(run.cfg.data.path)
    records = read_jsonl(src / f"{args.split}.jsonl")[: args.limit]
    for r in records:
        task.check_record(r)
    if args.threshold is not None:
        run.cfg.eval_ds = dataclasses.replace(run.cfg.eval_ds, confidence_threshold=args.threshold)
    step_type = "commit" if args.threshold is None else "confidence"
    sampler, settings = harness.build_sampler(run, task, num_steps=args.steps, step_type=step_type, temperature=0.0,
                                              early_stopping=None)
    hints = verdict_hints(run.tokenizer, records) if args.pin_verdict else None
    t0 = time.time()
    gen = harness.generate(run, sampler, records, batch_size=args.batch, seed=run.cfg.eval_ds.seed, pins=hints)
    stop = set(sampler.stop_ids)
    texts = [run.tokenizer.decode([t for t in toks if t not in stop]).strip() for toks in gen.tokens]
    _, metrics = gen.scored(task, run.tokenizer)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.glob("*.jsonl"):
        if f.stem != args.split:
            shutil.copy(f, tmp / f.name)
    with open(tmp / f"{args.split}.jsonl", "w") as fh:
        for r, text in zip(records, texts):
            fh.write(json.dumps({**r, "response": text, "reference_response": r["response"]}) + "\n")
    meta = json.loads((src / "meta.json").read_text())
    meta["distilled"] = {"split": args.split, "teacher": str(args.workdir), "questions": len(records),
                         "settings": settings, "teacher_metrics": metrics, "stats": gen.stats(args.steps),
                         "seconds": time.time() - t0}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(out)
    print(json.dumps({k: metrics[k] for k in ("accuracy", "unparsed", "bleu")}), f"{time.time() - t0:.0f} s -> {out}")


if __name__ == "__main__":
    main()
