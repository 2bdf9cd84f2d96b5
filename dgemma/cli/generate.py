"""``dgemma generate "PROMPT"`` (or ``--file``): answer prompts with a trained diffusion model.

The default model is the shipped PubMedQA adapter, ``checkpoints/pubmedqa_270m`` (Gemma 3 270M
made into a diffusion model by ``configs/sft_pubmedqa_cpu.py``); ``--checkpoint DIR`` takes any
training workdir. ``--pretrained SRC`` loads a base model as it is (``gemma3-270m``, a Gemma 3
folder or ``.gguf``): its diffusion modules are untrained, so it says so on stderr, and its text
is not what a trained model writes.

``--example K`` answers held-out question K of the model's ``examples.jsonl`` (the shipped adapter
carries test-set questions; ``--list-examples`` prints them). ``--file F`` reads prompts from a text file (one per line) or a JSONL file (``{"prompt": ...,
"system": ...}`` per line, e.g. ``data/pubmedqa/test.jsonl``); ``--out F.jsonl`` writes one
record per prompt (prompt, output, tokens, forward passes, seconds, settings). Sampler settings
default to the run's interactive settings (``dgemma/sampling.py:interactive_cfg``: its ``eval_ds``
with each ``interactive_*`` field in place; 16 steps, no early stop, no signal, reused keys and no
repeats for the shipped adapter).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dgemma import shipped
from dgemma.errors import DGemmaError

SHIPPED = shipped.PUBMEDQA
UNTRAINED_WARNING = ("warning: {src} is a base model whose diffusion modules are untrained; its denoised text "
                     "is not what an adapted model writes (train one with configs/sft_pubmedqa_cpu.py, or use "
                     "the shipped checkpoints/pubmedqa_270m)")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dgemma generate", description="sample text with a diffusion model")
    p.add_argument("prompt", nargs="?", help="the prompt (or use --file, or --example)")
    p.add_argument("--example", type=int, metavar="K", action="append",
                   help="held-out question K of the model's examples.jsonl (repeatable; --list-examples shows them)")
    p.add_argument("--list-examples", action="store_true", help="print the model's held-out example questions")
    p.add_argument("--file", help="prompts: a text file (one per line) or JSONL with a 'prompt' field")
    p.add_argument("--out", help="write one JSON record per prompt to this JSONL file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help=f"a training workdir (default {SHIPPED.name} as shipped)")
    src.add_argument("--pretrained", metavar="SRC", help="an unadapted base: gemma3-270m, a Gemma 3 folder or .gguf")
    p.add_argument("--system", help="a system instruction (default: the record's, or none)")
    p.add_argument("--steps", type=int, help="denoising steps per canvas (default: the run's eval_ds.interactive_steps, "
                                              "else its first eval_ds.steps)")
    p.add_argument("--step-type", choices=["ddim", "commit", "confidence", "entropy_bound"])
    p.add_argument("--temperature", type=float)
    p.add_argument("--threshold", type=float, metavar="P",
                   help="confidence step: commit every position whose probability exceeds P (default: the run's, "
                        "else 0.9)")
    p.add_argument("--early-stopping", choices=["none", "entropy", "stable_confident"])
    p.add_argument("--canvases", type=int, help="canvases at most (default: the run's)")
    p.add_argument("--self-condition", dest="self_condition", action=argparse.BooleanOptionalAction, default=None,
                   help="feed each step the last prediction; --no-self-condition: the zero signal (faster; "
                        "docs/concepts/self-conditioning.md). Default: the run's interactive setting")
    p.add_argument("--no-repeat", dest="no_repeat", action="store_true", default=None,
                   help="commit step: no token equal to a neighbour's, the runner-up instead "
                        "(docs/concepts/samplers.md)")
    p.add_argument("--allow-repeats", dest="no_repeat", action="store_false",
                   help="commit step: a token may equal a neighbour's (turns a run's --no-repeat default off)")
    p.add_argument("--reuse-canvas-keys", dest="reuse_canvas_keys", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="approximate and faster, without the signal: a pass recomputes only the canvas positions "
                        "the step reads and those that changed (docs/concepts/samplers.md); "
                        "--no-reuse-canvas-keys: every pass whole")
    p.add_argument("--shortlist", metavar="K", type=int, default=None,
                   help="approximate and faster, without the signal: a canvas's first pass keeps each "
                        "position's K likeliest tokens, its later passes score only those (0: the whole "
                        "vocabulary; docs/concepts/samplers.md). Default: the run's interactive setting")
    p.add_argument("--prefix", metavar="TEXT",
                   help="text every answer starts with, pinned at the start of the first canvas (e.g. the shipped "
                        "adapter's \"The answer is:\"); it must end where the answers' tokens do")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = p.parse_args(argv)
    if not args.prompt and not args.file and not args.example and not args.list_examples:
        p.error("give a prompt, --file or --example K")
    for name in ("steps", "canvases", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DGemmaError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threshold is not None and not 0.0 <= args.threshold <= 1.0:
        raise DGemmaError(f"--threshold must lie in [0, 1], got {args.threshold}")
    if args.prefix is not None and not args.prefix:
        raise DGemmaError("--prefix is empty: give the text every answer starts with, or leave it out")
    return args


def read_prompts(args) -> list[dict]:
    """Records ``{"prompt", "system"?, ...}`` from the argument and/or ``--file``."""
    records = [{"prompt": args.prompt}] if args.prompt else []
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise DGemmaError(f"prompt file not found: {path}")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DGemmaError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                    raise DGemmaError(f"{path}:{n}: a JSONL prompt needs a string field 'prompt'")
                records.append(rec)
            else:
                records.append({"prompt": line})
    if args.system is not None:
        records = [{**r, "system": args.system} for r in records]
    return records


def read_examples(source) -> list[dict]:
    """The held-out questions shipped beside a model (``examples.jsonl``), numbered from 0."""
    path = Path(source) / "examples.jsonl"
    if not path.is_file():
        raise DGemmaError(f"{source} has no examples.jsonl (the shipped checkpoints/pubmedqa_270m has test questions)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run(argv: list[str]) -> int:
    args = parse(argv)
    source = args.pretrained or args.checkpoint or SHIPPED
    if not args.pretrained and not Path(source).exists():
        raise DGemmaError(f"no checkpoint at {source}: train one with `dgemma train --cfg=configs/sft_pubmedqa_cpu.py "
                          f"--cfg.workdir={source}`, or pass --checkpoint DIR / --pretrained gemma3-270m")
    if args.list_examples or args.example:
        examples = read_examples(args.checkpoint or SHIPPED)
        if args.list_examples:
            for k, ex in enumerate(examples):
                q = ex["prompt"].split("Question:")[-1].strip()
                print(f"{k}\t{ex.get('label', '-')}\t{q}")
            return 0
        bad = [k for k in args.example if not 0 <= k < len(examples)]
        if bad:
            raise DGemmaError(f"--example {bad[0]}: the model has examples 0..{len(examples) - 1}")
    from dgemma.sampling import SamplerConfig, load_model, resolve_prefix  # after parse: --help loads no torch

    records = read_prompts(args) + [examples[k] for k in args.example or []]
    model = load_model(source, dtype=args.dtype, pretrained=bool(args.pretrained))
    if not model.trained:
        print("[dgemma] " + UNTRAINED_WARNING.format(src=source), file=sys.stderr)
    settings = model.settings(SamplerConfig(num_steps=args.steps, step_type=args.step_type, temperature=args.temperature,
                                            early_stopping=args.early_stopping, max_canvases=args.canvases,
                                            confidence_threshold=args.threshold,
                                            self_condition=args.self_condition, commit_no_repeat=args.no_repeat,
                                            reuse_canvas_keys=args.reuse_canvas_keys, shortlist=args.shortlist,
                                            prefix=None if args.prefix is None else resolve_prefix(args.prefix,
                                                                                                   model.tokenizer)))
    outputs = model.generate(records, settings, batch_size=args.batch_size, seed=args.seed)
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    try:
        for rec, o in zip(records, outputs):
            if out:
                out.write(json.dumps({"prompt": rec["prompt"], **({"label": rec["label"]} if "label" in rec else {}),
                                      "output": o.text, "tokens": o.tokens,
                                      "forward_passes": o.forward_passes, "seconds": o.seconds,
                                      "settings": settings.as_dict(), "model": str(source)}) + "\n")
            else:
                print(o.text, flush=True)
    finally:
        if out:
            out.close()
    total_tok, total_s = sum(o.tokens for o in outputs), sum(o.seconds for o in outputs)
    print(f"[dgemma] {len(outputs)} prompt(s), {total_tok} tokens in {total_s:.2f} s "
          f"({total_tok / max(total_s, 1e-9):.1f} tokens/s; {settings.describe()})", file=sys.stderr)
    return 0
