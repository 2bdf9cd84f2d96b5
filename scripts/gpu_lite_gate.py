#!/usr/bin/env python3
"""The Lite GPU gate in one prepared script: ``python scripts/gpu_lite_gate.py [--out DIR] [--peak-tflops X] [--smoke]``.

For ``configs/lite_343m.py`` on one GPU (H100 / H200 / A100), in under 8 minutes: training MFU
(FLOPs counted analytically, attention of the block-causal encoder and the canvas decoder and the
self-conditioning pass included: dgemma/bench/lite_gate.py), tokens/s and peak memory at Lite's own
micro-batch 8 x 4,096 tokens (bf16 autocast, FlexAttention, AdamW, the trainer's own step), then
the ``commit`` sampler's tokens/s and tokens per forward at 16, 32 and 64 steps against greedy AR
decoding with the KV cache of the same-size AR baseline (``configs/lite_343m_ar.py``). It prints a
table and writes ``DIR/lite_gate.json`` (default ``results/gpu_lite``).

It installs nothing, downloads nothing and reads no corpus: random weights, random tokens (speed
does not depend on their values). MFU needs the device's dense BF16 peak: known device names are
looked up (``PEAK_BF16_TFLOPS`` in dgemma/bench/common.py); ``--peak-tflops`` overrides.

``--attention`` picks the training attention: ``recipe`` (default: the config's flex as the
trainer calls it, compiled once per process on CUDA by the model) or ``sdpa``. If the recipe's
flex fails on the GPU, the run records why and measures with sdpa.

``--smoke`` runs the same code path on the CPU with ``configs/lite_debug.py`` (and
``configs/lite_debug_ar.py``) in seconds: a check that the script works, not a measurement.
Without ``--smoke`` and without a CUDA device it exits with status 1.
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
    p.add_argument("--out", default=None, help="folder for lite_gate.json (default results/gpu_lite, "
                                               "results/gpu_lite_smoke with --smoke)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak of this device, TFLOP/s")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 8; 2 with --smoke)")
    p.add_argument("--attention", default="recipe", choices=("recipe", "sdpa"),
                   help="training attention: the config's (flex, as the trainer calls it: compiled on CUDA) or "
                        "sdpa (default recipe)")
    p.add_argument("--smoke", action="store_true", help="configs/lite_debug.py on the CPU, in seconds")
    args = p.parse_args(argv)

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_lite_gate: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --smoke for the CPU check", file=sys.stderr)
        return 1
    sys.path.insert(0, str(REPO))  # this checkout's dgemma, installed or not
    os.chdir(REPO)  # configs/ are the repo's
    from dgemma.bench.lite_gate import gate_table, run_gate

    started = time.perf_counter()
    out = args.out or ("results/gpu_lite_smoke" if args.smoke else "results/gpu_lite")
    result = run_gate(smoke=args.smoke, device="cpu" if args.smoke else "cuda", peak_override=args.peak_tflops,
                      out=out, steps=args.steps, attention=args.attention)
    print(gate_table(result))
    print(f"gpu_lite_gate: {time.perf_counter() - started:.0f} s; wrote {out}/lite_gate.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
