#!/usr/bin/env python3
"""The GPU benchmarks in one prepared script: ``python scripts/gpu_bench.py [--out DIR] [--budget S]``.

Runs ``dgemma bench gpu`` (dgemma/bench/gpu.py) from this checkout: one LoRA training step of
the Gemma 3 270M against transformers + peft with MFU, block-diffusion decoding against AR
decoding of the same weights (and transformers' generate) at batch 1 and 16, the chunked loss
against full logits up to 32k tokens, and eager / sdpa / flex / compiled flex attention, all in
bf16, in under 8 minutes. It prints one table per suite and writes ``DIR/gpu.json`` (default
``results/gpu``).

It installs nothing and downloads nothing: dgemma is imported from this checkout, and the Gemma
3 270M weights are read from dgemma's cache (``$DGEMMA_CACHE`` or ``~/.cache/dgemma``) when it is
there; without it every suite uses a random init of the same architecture and says so (speed does
not depend on the weights' values). transformers and peft are used when installed; without them
their baselines are skipped with a note. Exits with status 1 and a message when there is no CUDA
device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/gpu", help="folder for gpu.json (default: results/gpu)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the suites together (default 420)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler runs")
    p.add_argument("--sudoku-workdir", default=None, help="trained Sudoku run (default: checkpoints/sudoku_avg)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine. "
              "On a CPU, use `dgemma bench all`.", file=sys.stderr)
        return 1
    sys.path.insert(0, str(REPO))  # this checkout's dgemma, installed or not
    os.chdir(REPO)  # relative paths (checkpoints/, results/) are the repo's
    from dgemma.bench import gpu
    from dgemma.bench.common import Context, ratios_table, write_result

    started = time.perf_counter()
    ctx = Context(out=Path(args.out), profile="gpu", device="cuda", budget_s=args.budget,
                  do_profile=not args.no_profile, sudoku_workdir=args.sudoku_workdir, allow_convert=False)
    result = gpu.run(ctx)
    result["command"] = "python scripts/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_result(result, ctx.out)
    for t in result["tables"]:
        print(t, end="\n\n")
    print(ratios_table(result), end="\n\n")
    for n in result["notes"]:
        print(f"note: {n}")
    if result["skipped"]:
        print(f"skipped ({len(result['skipped'])}): " + "; ".join(result["skipped"]))
    print(f"gpu_bench: {time.perf_counter() - started:.0f} s on {torch.cuda.get_device_name()}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
