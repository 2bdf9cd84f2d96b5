#!/usr/bin/env python3
"""Make the "reverse a word" data set: completion JSONL, one ``{"prompt", "completion"}`` a line.

Each row asks to reverse one lowercase word and gives the answer::

    {"prompt": "reverse: hello", "completion": "olleh", "id": "train-00000"}

Words are random strings of ``a``-``z`` (``--min-len`` to ``--max-len`` letters), so nothing can
be memorised: the eval split shares no word with the training split. Deterministic: the same
arguments write byte-identical files.

Usage: ``python examples/reverse/make_data.py --out DIR [--train 20000] [--eval 200] [--seed 0]``
writes ``DIR/train.jsonl`` and ``DIR/eval.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

PROMPT = "reverse: {word}"


def make_rows(n: int, rng: random.Random, *, min_len: int, max_len: int, exclude: set[str], split: str) -> list[dict]:
    """``n`` rows of distinct random words not in ``exclude`` (which grows with them)."""
    rows = []
    while len(rows) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        if word in exclude:
            continue
        exclude.add(word)
        rows.append({"prompt": PROMPT.format(word=word), "completion": word[::-1], "id": f"{split}-{len(rows):05d}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder for train.jsonl and eval.jsonl")
    p.add_argument("--train", type=int, default=20_000, help="training rows (default 20000)")
    p.add_argument("--eval", type=int, default=200, help="eval rows (default 200)")
    p.add_argument("--min-len", type=int, default=3, help="shortest word (default 3)")
    p.add_argument("--max-len", type=int, default=6, help="longest word (default 6)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    rng, seen = random.Random(args.seed), set()
    evals = make_rows(args.eval, rng, min_len=args.min_len, max_len=args.max_len, exclude=seen, split="eval")
    train = make_rows(args.train, rng, min_len=args.min_len, max_len=args.max_len, exclude=seen, split="train")
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evals)
    print(f"reverse: {len(train)} train, {len(evals)} eval -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
