"""``dgemma prepare TARGET``: build caches and data sets.

Targets: ``gemma3-270m`` (convert the GGUF package once to a safetensors cache),
``sudoku``, ``pubmedqa``, ``corpus`` (tokenise a pretraining corpus into binary shards).
"""

from __future__ import annotations

import argparse
import os


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
    cp = sub.add_parser("corpus", help="tokenise text/JSONL/Parquet files into binary shards for pretraining")
    cp.add_argument("--input", action="extend", nargs="+", required=True, metavar="PATH",
                   help="file, folder or glob (quote it); repeatable")
    cp.add_argument("--out", required=True, help="output folder for shards and manifest.json")
    cp.add_argument("--tokenizer", help="tokenizer.json, a folder holding one, or gemma3-270m; "
                                       "default: train a byte-level BPE into OUT/tokenizer")
    cp.add_argument("--vocab-size", type=int, default=50257, help="BPE vocabulary when training (default 50257)")
    cp.add_argument("--bpe-max-chars", type=int, default=200_000_000,
                   help="characters sampled evenly from the corpus to train BPE (default 2e8)")
    cp.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokeniser processes (default: all CPUs; 0 = in this process)")
    cp.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    cp.add_argument("--val-fraction", type=float, default=0.001, help="share of documents held out (default 0.001)")
    cp.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    cp.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                   help="a broken JSONL line or null Parquet value: fail (default) or skip and count")
    cp.add_argument("--overwrite", action="store_true", help="replace a corpus already in --out")
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
    elif args.target == "corpus":
        from dgemma.data.corpus import prepare_corpus

        m = prepare_corpus(args.input, tokenizer=args.tokenizer, out_dir=args.out, vocab_size=args.vocab_size,
                           shard_tokens=args.shard_tokens, workers=args.workers, val_fraction=args.val_fraction,
                           text_field=args.text_field, on_error=args.on_error, bpe_max_chars=args.bpe_max_chars,
                           overwrite=args.overwrite)
        tr, va = m["splits"]["train"], m["splits"]["val"]
        skip = f"; skipped {m['skipped_records']} broken records" if m["skipped_records"] else ""
        print(f"corpus: {m['documents']} documents, {tr['tokens']} train tokens in {len(tr['shards'])} shards, "
              f"{va['tokens']} val tokens ({m['dtype']}, vocab {m['vocab_size']}, tokenizer {m['tokenizer']['path']})"
              f"{skip} -> {args.out}")
    return 0
