"""``dgemma prepare TARGET``: build caches and data sets.

Targets: ``gemma3-270m`` (convert the GGUF package once to a safetensors cache),
``sudoku``, ``pubmedqa``.
"""

from __future__ import annotations

import argparse


def _rows(rows: list[int], shown: int = 10) -> str:
    head = ", ".join(map(str, rows[:shown]))
    return head + (f", ... ({len(rows) - shown} more)" if len(rows) > shown else "")


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgemma prepare")
    sub = parser.add_subparsers(dest="target", required=True)
    g = sub.add_parser("gemma3-270m", help="convert the gemma3-270m GGUF package to a safetensors cache")
    g.add_argument("--force", action="store_true", help="rebuild the cache even if it exists")
    s = sub.add_parser("sudoku", help="write Sudoku train/eval JSONL from a Kaggle CSV or the generator")
    s.add_argument("--out", required=True, help="output folder for train.jsonl, eval.jsonl, meta.json")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", help="Kaggle-layout CSV (puzzle,solution or quizzes,solutions)")
    src.add_argument("--n", type=int, help="number of unique puzzles to generate")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    s.add_argument(
        "--difficulty",
        choices=["easy", "medium", "hard", "mixed"],
        default="mixed",
        help="clue bucket: easy >= 40, medium 30-39, hard < 30; mixed cycles them (CSV: keeps all)",
    )
    p = sub.add_parser("pubmedqa", help="write PubMedQA train/train_eval/test JSONL from the official files")
    p.add_argument("--source", required=True, help="folder with ori_pqal.json and test_ground_truth.json")
    p.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    if args.target == "gemma3-270m":
        from dgemma.models.weights import prepare_gemma3_270m

        print(prepare_gemma3_270m(force=args.force))
    elif args.target == "sudoku":
        from dgemma.data.sudoku import write_splits

        meta = write_splits(args.out, csv=args.csv, n=args.n, seed=args.seed, difficulty=args.difficulty)
        c, skipped = meta["counts"], meta["skipped_rows"]
        skip = f"; skipped {len(skipped)} malformed rows: {_rows(skipped)}" if skipped else ""
        print(f"sudoku: {c['train']} train, {c['eval']} eval from {meta['source']} -> {args.out}{skip}")
    elif args.target == "pubmedqa":
        from dgemma.data.pubmedqa import write_splits

        meta = write_splits(args.source, args.out)
        c = meta["counts"]
        print(f"pubmedqa: {c['train']} train, {c['train_eval']} train_eval, {c['test']} test -> {args.out}")
    return 0
