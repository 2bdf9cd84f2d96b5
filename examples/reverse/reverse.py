#!/usr/bin/env python3
"""Reverse words with a trained run, from Python: open the checkpoint, build a sampler, decode.

    python examples/reverse/reverse.py --workdir runs/reverse hello world

prints one line per word: the word, the model's answer and whether it is right. This is what
``dgemma eval`` does for every eval record, written out with the library's own pieces so it can
be copied into other code: ``load_run`` (config + latest complete checkpoint), the run's noise
process, a denoising step, ``CanvasSampler`` and the tokenizer.
"""

from __future__ import annotations

import argparse

import torch

from dgemma.data.chat import encode_prompt_text
from dgemma.diffusion.sampler import CanvasSampler
from dgemma.diffusion.steps import build_step
from dgemma.training.runs import load_run

PROMPT = "reverse: {word}"  # the prompt format of make_data.py: the model only knows this one


def reverse_words(workdir: str, words: list[str], *, steps: int = 8, seed: int = 0) -> list[str]:
    """The run's answers for ``words`` (greedy ``commit`` sampling, ``steps`` denoising steps)."""
    run = load_run(workdir, device="cpu")
    cfg, tok = run.cfg, run.tokenizer
    prompts = [encode_prompt_text(tok, PROMPT.format(word=w), cfg.data.prompt_len)[0] for w in words]
    width = max(map(len, prompts))
    ids = torch.full((len(words), width), tok.pad_id, dtype=torch.long)  # right padded
    valid = torch.zeros(len(words), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], valid[i, : len(p)] = torch.tensor(p), True
    noise = run.noise()
    sampler = CanvasSampler(noise=noise, step=build_step("commit", noise=noise, temperature=0.0), num_steps=steps,
                            canvas_size=cfg.diffusion.canvas_size, max_canvases=cfg.diffusion.num_canvases,
                            stop_ids=(tok.eos_id, tok.end_of_turn_id), temperature=1.0)
    result = sampler(run.model, ids, valid, generator=torch.Generator().manual_seed(seed))
    return [tok.decode(t) for t in result.tokens]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="reverse words with a trained reverse run")
    p.add_argument("--workdir", default="runs/reverse", help="the training workdir (default runs/reverse)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas (default 8)")
    p.add_argument("words", nargs="+", help="lowercase words (a-z)")
    args = p.parse_args(argv)
    for word, answer in zip(args.words, reverse_words(args.workdir, args.words, steps=args.steps)):
        print(f"{word} -> {answer} ({'right' if answer == word[::-1] else 'wrong, expected ' + word[::-1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
