"""Reverse a word (``reverse: hello`` -> ``olleh``): the worked example of docs/guides/new-task.md.

A whole task in one file: ``dgemma prepare reverse`` writes random lowercase words (nothing to
memorise; the eval words never occur in training), the prompt is the raw text ``reverse: WORD``
after BOS (no chat markup, so a character tokenizer works), the response the reversed word, and
the task scores its own way: exact answers, the share of letters in place, the right length, and
exact answers by word length (where a model's weak spot shows).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
from pathlib import Path

from dgemma.errors import DGemmaError
from dgemma.tasks.base import Task

PROMPT = "reverse: {word}"
ANSWER = re.compile(r"[a-z]+")


def make_records(n: int, rng: random.Random, *, min_len: int, max_len: int, seen: set[str], split: str) -> list[dict]:
    """``n`` records of distinct random words not in ``seen`` (which grows with them)."""
    out = []
    while len(out) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        if word in seen:
            continue
        seen.add(word)
        out.append({"id": f"{split}-{len(out):05d}", **prompt_record(word), "response": word[::-1]})
    return out


def prompt_record(word: str) -> dict:
    """The prompt of one word, as training and sampling encode it: ``prompt_text`` is taken as is
    (after BOS), with no chat markup."""
    prompt = PROMPT.format(word=word)
    return {"prompt": prompt, "prompt_text": prompt, "word": word}


def extract(text: str) -> str | None:
    """The answer in a decoded output: its first run of lowercase letters, or None (no guess)."""
    m = ANSWER.search(text or "")
    return m.group(0) if m else None


def score_one(text: str, reference: str) -> dict:
    """``accuracy`` (exact, 0/1), ``char_accuracy`` (share of reference letters in place), ``length_ok``."""
    answer = extract(text)
    if answer is None:
        return {"answer": None, "accuracy": 0.0, "char_accuracy": 0.0, "length_ok": 0.0}
    hits = sum(a == b for a, b in zip(answer, reference))
    return {"answer": answer, "accuracy": float(answer == reference), "char_accuracy": hits / len(reference),
            "length_ok": float(len(answer) == len(reference))}


class ReverseTask(Task):
    name = "reverse"
    splits = ("eval",)
    primary = ("accuracy", "char_accuracy")
    fields = ("word",)
    prepare_help = "write random-word reversal train/eval JSONL (the new-task guide's example)"

    def add_prepare_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="output folder for train.jsonl and eval.jsonl")
        parser.add_argument("--train", type=int, default=20_000, help="training words (default 20000)")
        parser.add_argument("--eval", type=int, default=200, help="eval words (default 200)")
        parser.add_argument("--min-len", type=int, default=3, help="shortest word (default 3)")
        parser.add_argument("--max-len", type=int, default=6, help="longest word (default 6)")
        parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")

    def prepare(self, args: argparse.Namespace) -> str:
        if not 1 <= args.min_len <= args.max_len:
            raise DGemmaError(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
        rng, seen = random.Random(args.seed), set()
        kw = {"min_len": args.min_len, "max_len": args.max_len, "seen": seen}
        splits = {"eval": make_records(args.eval, rng, split="eval", **kw),
                  "train": make_records(args.train, rng, split="train", **kw)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, records in splits.items():
            (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return f"reverse: {len(splits['train'])} train, {len(splits['eval'])} eval -> {out}"

    def score_one(self, text: str, record: dict) -> dict:
        return score_one(text, record["response"])

    def score(self, texts, records) -> dict:
        rows = [score_one(t, r["response"]) for t, r in zip(texts, records, strict=True)]
        out: dict = {k: sum(s[k] for s in rows) / len(rows) if rows else 0.0
                     for k in ("accuracy", "char_accuracy", "length_ok")}
        out["count"] = len(rows)
        for n in sorted({len(r["word"]) for r in records}):
            hits = [s["accuracy"] for s, r in zip(rows, records) if len(r["word"]) == n]
            out[f"accuracy_len{n}"] = sum(hits) / len(hits)
        return out
