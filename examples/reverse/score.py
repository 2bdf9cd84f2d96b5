#!/usr/bin/env python3
"""Task-specific scoring for "reverse a word": an extract function, a score function, a report.

``dgemma eval`` already scores the ``completion`` task with the generic metrics (exact match,
ROUGE-L, BLEU, chrF; see docs/reference/metrics.md). A task usually wants a few numbers of its
own as well; this script computes them from the per-example outputs ``dgemma eval`` writes::

    python examples/reverse/score.py runs/reverse/eval/sample_ar_steps8/step_300.jsonl

- :func:`extract` reads the answer out of the decoded text (here: the first run of letters);
- :func:`score` compares one answer with its reference (exact, per-character, length);
- the report averages them overall and by word length, where a model's weak spot shows.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

ANSWER = re.compile(r"[a-z]+")


def extract(text: str) -> str | None:
    """The answer in a decoded output: its first run of lowercase letters, or None (no answer).

    No fallback guess: an output without letters has answered nothing and scores 0.
    """
    m = ANSWER.search(text or "")
    return m.group(0) if m else None


def score(output: str, reference: str) -> dict:
    """``exact`` (0/1), ``char_accuracy`` (share of reference positions right) and ``length_ok`` (0/1)."""
    answer = extract(output)
    if answer is None:
        return {"exact": 0.0, "char_accuracy": 0.0, "length_ok": 0.0}
    hits = sum(a == b for a, b in zip(answer, reference))
    return {"exact": float(answer == reference), "char_accuracy": hits / len(reference),
            "length_ok": float(len(answer) == len(reference))}


def report(rows: list[dict]) -> dict:
    """Mean scores over the rows of an eval outputs JSONL, overall and per reference length."""
    scores = [score(r["output"], r["reference"]) for r in rows]
    out = {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]} if scores else {}
    out["count"] = len(scores)
    by_len = defaultdict(list)
    for r, s in zip(rows, scores):
        by_len[len(r["reference"])].append(s["exact"])
    out["exact_by_length"] = {n: sum(v) / len(v) for n, v in sorted(by_len.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="score reverse-a-word outputs written by dgemma eval")
    p.add_argument("outputs", help="an eval outputs file: WORKDIR/eval/<eval_name>/step_<S>.jsonl")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.outputs).read_text().splitlines() if line.strip()]
    print(json.dumps(report(rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
