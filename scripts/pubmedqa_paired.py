"""Paired comparison of PubMedQA evaluations on the same questions: each decoder's accuracy and
mean BLEU against a baseline's, with 95% paired-bootstrap intervals.

    python scripts/pubmedqa_paired.py BASELINE.jsonl OTHER.jsonl [OTHER.jsonl ...] [--resamples 10000]

The files are the per-question JSONL that ``dgemma eval`` writes (``eval/<name>/step_N.jsonl``);
each row's ``score`` holds its ``accuracy`` (0/1) and sentence ``bleu``, the numbers whose means
the eval JSON reports. Issue #16 asks for BLEU within 10% of the AR fine-tune's and accuracy
within 2 points of it: a ratio or a difference on 500 questions has a sampling spread of its own,
which one mean hides. The bootstrap resamples questions, the same ones for both decoders (paired),
so the spread of what the two share cancels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def load(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: r["score"] for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", type=Path)
    p.add_argument("others", type=Path, nargs="+")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    base = load(args.baseline)
    print(f"baseline {args.baseline}: {len(base)} questions\n")
    print("| decoder | n | accuracy % | - baseline, points [95%] | BLEU | / baseline [95%] |\n|---|---|---|---|---|---|")
    for path in [args.baseline, *args.others]:
        other = load(path)
        ids = sorted(set(base) & set(other))
        if len(ids) != len(other) or len(ids) != len(base):
            raise SystemExit(f"{path}: {len(other)} questions, {len(ids)} shared with the baseline's {len(base)}")
        acc = torch.tensor([[other[i]["accuracy"], base[i]["accuracy"]] for i in ids], dtype=torch.float64)
        bleu = torch.tensor([[other[i]["bleu"], base[i]["bleu"]] for i in ids], dtype=torch.float64)
        g = torch.Generator().manual_seed(args.seed)
        pick = torch.randint(len(ids), (args.resamples, len(ids)), generator=g)
        acc_m, bleu_m = acc[pick].mean(1), bleu[pick].mean(1)  # [R, 2]: resampled means, this / baseline
        diff = 100 * (acc_m[:, 0] - acc_m[:, 1])
        ratio = bleu_m[:, 0] / bleu_m[:, 1]
        lo_d, hi_d = torch.quantile(diff, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        lo_r, hi_r = torch.quantile(ratio, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        a, b = acc.mean(0).tolist(), bleu.mean(0).tolist()
        print(f"| {path} | {len(ids)} | {100 * a[0]:.1f} | {100 * (a[0] - a[1]):+.1f} [{lo_d:+.1f}, {hi_d:+.1f}] | "
              f"{b[0]:.2f} | {b[0] / b[1]:.3f} [{lo_r:.3f}, {hi_r:.3f}] |")


if __name__ == "__main__":
    main()
