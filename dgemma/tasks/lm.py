"""Language modelling (Lite pretraining): ``corpus``, fixed windows over tokenised shards.

``dgemma prepare corpus`` tokenises text, JSONL or Parquet files into binary shards with a
manifest (:func:`dgemma.data.corpus.prepare_corpus`); training draws windows of ``prompt_len +
num_canvases * canvas_size`` tokens, every canvas scored. There is no prompt/response scoring:
a corpus run is evaluated by ``dgemma eval --task=lm`` (held-out loss, the NELBO bound on
perplexity and generation speed against an AR baseline, :mod:`dgemma.eval.lite`).
"""

from __future__ import annotations

import argparse
import os

from dgemma.errors import DGemmaError
from dgemma.tasks.base import Task


class CorpusTask(Task):
    name = "corpus"
    splits = ()
    primary = ()
    prepare_help = "tokenise a pretraining corpus (text/JSONL/Parquet files) into binary shards"

    def add_prepare_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--input", action="extend", nargs="+", required=True, metavar="PATH",
                            help="file, folder or glob (quote it); repeatable")
        parser.add_argument("--out", required=True, help="output folder for shards and manifest.json")
        parser.add_argument("--tokenizer", help="tokenizer.json, a folder holding one, or gemma3-270m; "
                                                "default: train a byte-level BPE into OUT/tokenizer")
        parser.add_argument("--vocab-size", type=int, default=50257,
                            help="BPE vocabulary when training (default 50257)")
        parser.add_argument("--bpe-max-chars", type=int, default=200_000_000,
                            help="characters sampled evenly from the corpus to train BPE (default 2e8)")
        parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                            help="tokeniser processes (default: all CPUs; 0 = in this process)")
        parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
        parser.add_argument("--val-fraction", type=float, default=0.001,
                            help="share of documents held out (default 0.001)")
        parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
        parser.add_argument("--on-error", choices=["raise", "skip"], default="raise",
                            help="a broken JSONL line or null Parquet value: fail (default) or skip and count")
        parser.add_argument("--overwrite", action="store_true", help="replace a corpus already in --out")

    def prepare(self, args: argparse.Namespace) -> str:
        from dgemma.data.corpus import prepare_corpus

        m = prepare_corpus(args.input, tokenizer=args.tokenizer, out_dir=args.out, vocab_size=args.vocab_size,
                           shard_tokens=args.shard_tokens, workers=args.workers, val_fraction=args.val_fraction,
                           text_field=args.text_field, on_error=args.on_error, bpe_max_chars=args.bpe_max_chars,
                           overwrite=args.overwrite)
        tr, va = m["splits"]["train"], m["splits"]["val"]
        skip = f"; skipped {m['skipped_records']} broken records" if m["skipped_records"] else ""
        return (f"corpus: {m['documents']} documents, {tr['tokens']} train tokens in {len(tr['shards'])} shards, "
                f"{va['tokens']} val tokens ({m['dtype']}, vocab {m['vocab_size']}, tokenizer "
                f"{m['tokenizer']['path']}){skip} -> {args.out}")

    def train_data(self, cfg, tokenizer):
        from dgemma.data.windows import CorpusData

        if not cfg.data.path:
            raise DGemmaError("task 'corpus' needs data.path: a directory written by `dgemma prepare corpus`")
        return CorpusData(cfg.data.path, cfg.data.prompt_len + cfg.diffusion.num_canvases * cfg.diffusion.canvas_size,
                          cfg.diffusion.canvas_size)

    def load(self, cfg, split=None, limit=None):
        raise DGemmaError("a corpus run has no prompt/response eval split: run `dgemma eval --task=lm "
                          "--cfg.workdir=DIR` (held-out loss, NELBO, generation speed)")
