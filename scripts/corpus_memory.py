"""Peak memory of ``prepare_corpus`` at two corpus sizes: streaming means it must not grow.

Writes synthetic JSONL corpora (Zipf-distributed pseudo-words, streamed to disk in chunks, never
held in memory), trains one BPE tokenizer on a capped sample, then tokenises each corpus in a fresh
subprocess and reports that process's peak RSS and its largest worker's (``ru_maxrss`` of self and
of children). A flat pipeline shows the same peaks at both sizes; holding the corpus as Python
strings would alone cost more than the corpus size.

    python scripts/corpus_memory.py --sizes-mb 20 200 --workers 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MEASURE = r"""
import json, resource, sys, time
from dgemma.data.corpus import prepare_corpus, train_bpe_tokenizer
from dgemma.data.documents import iter_documents
if __name__ == "__main__":
    kw = json.loads(sys.argv[1])
    t = time.time()
    if kw.pop("baseline", False):
        r = {}
    elif kw.pop("bpe", False):
        train_bpe_tokenizer(iter_documents(kw["inputs"]), kw["vocab_size"], out_path=kw["out"],
                            max_chars=kw["max_chars"])
        r = {}
    else:
        m = prepare_corpus(**kw)
        r = {"tokens": m["total_tokens"], "documents": m["documents"], "shards": len(m["splits"]["train"]["shards"])}
    print(json.dumps({**r, "seconds": time.time() - t,
                      "self_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "workers_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_corpus(folder: Path, megabytes: int, *, seed: int = 0, file_mb: int = 50) -> int:
    """JSONL files totalling ``megabytes`` MB of documents, written chunk by chunk."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lengths = rng.integers(2, 11, size=30_000)
    words = np.array(["".join(rng.choice(letters, n)) for n in lengths])
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    p /= p.sum()
    folder.mkdir(parents=True, exist_ok=True)
    target, written, k = megabytes * 1_000_000, 0, 0
    while written < target:
        with open(folder / f"part_{k:04d}.jsonl", "w") as f:
            size = 0
            while size < file_mb * 1_000_000 and written + size < target:
                lines = []
                for n in rng.lognormal(6.0, 0.8, size=200).astype(int) + 20:
                    ws = words[rng.choice(len(words), n, p=p)]
                    text = " ".join(ws[: n // 2]) + ".\n\n" + " ".join(ws[n // 2:]) + "."
                    lines.append(json.dumps({"text": text}) + "\n")
                chunk = "".join(lines)
                f.write(chunk)
                size += len(chunk)
            written += size
        k += 1
    return written


def run(kwargs: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(kwargs)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 200])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--bpe-max-chars", type=int, default=5_000_000)
    ap.add_argument("--dir", help="work folder to keep the corpora (default: a temporary one, removed afterwards)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        corpora = []
        for mb in args.sizes_mb:
            t = time.time()
            nbytes = write_corpus(root / f"corpus_{mb}mb", mb)
            corpora.append((mb, nbytes))
            print(f"wrote {nbytes / 1e6:.0f} MB in {time.time() - t:.0f} s", flush=True)
        base = run({"baseline": True})
        print(f"baseline (python + import dgemma.data.corpus): peak RSS {base['self_peak_mb']:.0f} MB", flush=True)
        tok = root / "tokenizer"
        bpe = run({"bpe": True, "inputs": [str(root / f"corpus_{args.sizes_mb[0]}mb")], "out": str(tok),
                   "vocab_size": args.vocab_size, "max_chars": args.bpe_max_chars})
        print(f"BPE {args.vocab_size} on {args.bpe_max_chars / 1e6:.0f}M chars: {bpe['seconds']:.0f} s, "
              f"peak RSS {bpe['self_peak_mb']:.0f} MB", flush=True)
        rows = []
        for mb, nbytes in corpora:
            r = run({"inputs": [str(root / f"corpus_{mb}mb")], "out_dir": str(root / f"out_{mb}mb"),
                     "tokenizer": str(tok), "workers": args.workers, "progress": False, "overwrite": True})
            rows.append({**r, "mb": nbytes / 1e6})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'corpus MB':>9} {'tokens':>12} {'docs':>8} {'s':>6} {'MB/s':>5} {'main peak MB':>12} "
          f"{'worker peak MB':>14}")
    for r in rows:
        print(f"{r['mb']:9.0f} {r['tokens']:12d} {r['documents']:8d} {r['seconds']:6.0f} {r['mb'] / r['seconds']:5.1f} "
              f"{r['self_peak_mb']:12.0f} {r['workers_peak_mb']:14.0f}")

if __name__ == "__main__":
    main()
