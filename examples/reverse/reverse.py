#!/usr/bin/env python3
"""Reverse words with a trained run, from Python: the public API and the task's own pieces.

    python examples/reverse/reverse.py --workdir runs/reverse hello world

prints one line per word: the word, the model's answer and whether it is right.
``dgemma.load_model`` opens the run's latest checkpoint with its eval settings as defaults; the
task builds the prompt exactly as training did (``dgemma/tasks/reverse.py:prompt_record``) and
reads the answer back (``dgemma/tasks/reverse.py:extract``).
"""

from __future__ import annotations

import argparse

import dgemma
from dgemma.tasks.reverse import extract, prompt_record


def reverse_words(workdir: str, words: list[str], *, steps: int = 8, seed: int = 0) -> list[str | None]:
    """The run's answers for ``words`` (the run's sampler, ``steps`` denoising steps, greedy)."""
    model = dgemma.load_model(workdir, device="cpu")
    outputs = model.generate([prompt_record(w) for w in words], dgemma.SamplerConfig(num_steps=steps),
                             batch_size=len(words), seed=seed)
    return [extract(o.text) for o in outputs]


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
