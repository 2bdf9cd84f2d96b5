"""``dgemma bench SUITE [--out results/] [--quick] [--sudoku-workdir DIR] [--pubmedqa-workdir DIR]
[--dtype auto|float32|bfloat16] [--budget S] [--repeats N] [--no-profile]
[--only step_cost [--compile] | --only adapted]``

SUITE is ``decode``, ``loss``, ``attention``, ``train``, ``gpu`` or ``all`` (every suite in that
order; ``gpu`` notes and skips itself without a CUDA device). Each suite prints its table and its
ratios and writes ``<out>/<suite>.json``; ``all`` also writes ``<out>/all.json`` with every ratio.
Figures are medians over timed repeats after warm-up, and every comparison is a ratio against a
baseline measured in the same process (docs/benchmarks.md).

``--quick`` runs each suite on a tiny random model in seconds (what the tests run): the numbers
mean nothing, the tables and JSON have their full shape. ``--budget`` caps each suite's seconds
(rows beyond it are skipped and listed); the defaults keep ``all`` under 15 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dgemma import shipped
from dgemma.errors import DGemmaError

CHOICES = ("decode", "loss", "attention", "train", "gpu", "all")
ALL = ("decode", "loss", "attention", "train", "gpu")
# ``all`` on a CPU: seconds for the suites' rows together (model loading and start-up come on top),
# shared in proportion to each suite's own default, so the whole run stays under 15 minutes
ALL_BUDGET_S = 750.0
SHARE = {"decode": 400.0, "loss": 100.0, "attention": 80.0, "train": 170.0, "gpu": 0.0}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dgemma bench", description="benchmarks with in-process baselines")
    p.add_argument("suite", choices=CHOICES)
    p.add_argument("--out", default="results", help="folder for <suite>.json (default: results/)")
    p.add_argument("--quick", action="store_true", help="tiny random model, seconds: checks the plumbing only")
    sudoku, pubmedqa = (path.relative_to(shipped.REPO) for path in (shipped.SUDOKU, shipped.PUBMEDQA))
    p.add_argument("--sudoku-workdir", default=None,
                   help=f"trained Sudoku run for the decode suite (default: {sudoku})")
    p.add_argument("--pubmedqa-workdir", default=None,
                   help=f"adapted PubMedQA run (its AR fine-tune in DIR/ar) for the decode suite (default: {pubmedqa})")
    p.add_argument("--pubmedqa-steps", metavar="N,N", default=None,
                   help="decode: the adapted PubMedQA rows' steps per canvas, comma-separated (default 32,16,8)")
    p.add_argument("--pubmedqa-prefix", metavar="TEXT", default=None,
                   help="decode: a response prefix both PubMedQA decoders get, e.g. 'The answer is:' (pinned in "
                        "the canvas, prefilled for AR; default: the run's eval_ds.response_prefix)")
    p.add_argument("--pubmedqa-no-repeat", action="store_true",
                   help="decode: the adapted PubMedQA diffusion rows commit no token equal to a neighbour's, the "
                        "runner-up instead (eval_ds.commit_no_repeat; default: the run's own)")
    p.add_argument("--pubmedqa-shortlist", metavar="K", type=int, default=None,
                   help="decode: the adapted PubMedQA reused-keys rows again with a shortlist of each position's "
                        "K likeliest tokens (approximate; CanvasSampler.shortlist; 0: no such rows; default: the "
                        "run's interactive setting, eval_ds.interactive_shortlist)")
    p.add_argument("--pubmedqa-b1", metavar="N", type=int, default=None,
                   help="decode: how many of the shipped test questions the adapted PubMedQA batch-1 rows decode, "
                        "one at a time (default 4; up to the 16 shipped: a batch-1 ratio on 4 moves with their "
                        "answers' lengths)")
    p.add_argument("--budget", type=float, default=None, help="seconds per suite (default: the suite's own)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default: the suite's own)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler runs of worse-than-baseline rows")
    p.add_argument("--only", choices=["step_cost", "adapted"],
                   help="decode: only the per-forward cost rows (step_cost), or only the trained Sudoku and "
                        "PubMedQA models' rows, quality next to speed (adapted)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="decode: the models' dtype (auto: bf16 where the CPU/GPU has native bf16 units; "
                        "a trained run's auto is its training precision)")
    p.add_argument("--compile", action="store_true",
                   help="decode --only step_cost: also time the forwards compiled (dgemma/models/compiled.py; "
                        "about a minute of compiling per kind of call on a CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cpu; the gpu suite uses cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's, = cores)")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        raise DGemmaError(f"--repeats must be >= 1, got {args.repeats}")
    if args.budget is not None and args.budget <= 0:
        raise DGemmaError(f"--budget must be > 0 seconds, got {args.budget}")
    if args.pubmedqa_steps is not None:
        try:
            args.pubmedqa_steps = tuple(int(x) for x in args.pubmedqa_steps.split(","))
        except ValueError:
            raise DGemmaError(f"--pubmedqa-steps takes step counts like 16,10, got {args.pubmedqa_steps!r}") from None
        if min(args.pubmedqa_steps) < 1:
            raise DGemmaError(f"--pubmedqa-steps must be >= 1, got {args.pubmedqa_steps}")
    if args.pubmedqa_b1 is not None and args.pubmedqa_b1 < 1:
        raise DGemmaError(f"--pubmedqa-b1 must be >= 1, got {args.pubmedqa_b1}")
    if args.pubmedqa_shortlist is not None and args.pubmedqa_shortlist < 0:
        raise DGemmaError(f"--pubmedqa-shortlist must be >= 0, got {args.pubmedqa_shortlist}")
    if args.pubmedqa_prefix == "":
        raise DGemmaError("--pubmedqa-prefix is empty: give the text every answer starts with, or leave it out")
    return args


def _print_result(result: dict) -> None:
    from dgemma.bench.common import ratios_table

    for t in result["tables"]:
        print(t, end="\n\n")
    if result["ratios"]:
        print(ratios_table(result), end="\n\n")
    for n in result["notes"]:
        print(f"note: {n}")
    if result["skipped"]:
        print(f"skipped ({len(result['skipped'])}): " + "; ".join(result["skipped"]))
    print(f"[{result['suite']}: {result['seconds']:.0f} s]", flush=True)


def run(argv: list[str]) -> int:
    import torch

    from dgemma.bench import attention, decode, gpu, loss, train
    from dgemma.bench.common import Context, jsonable, write_result
    from dgemma.device import keep_freed_heap

    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.suite == "decode" and not args.quick:  # as the decoding commands run (cli/main.py:DECODING_VERBS)
        keep_freed_heap()
    modules = {"decode": decode, "loss": loss, "attention": attention, "train": train, "gpu": gpu}
    ctx = Context(out=Path(args.out), quick=args.quick, profile="quick" if args.quick else "cpu",
                  device=args.device or "cpu", budget_s=args.budget, repeats=args.repeats,
                  do_profile=not args.no_profile, sudoku_workdir=args.sudoku_workdir,
                  pubmedqa_workdir=args.pubmedqa_workdir, pubmedqa_steps=args.pubmedqa_steps,
                  pubmedqa_prefix=args.pubmedqa_prefix,
                  pubmedqa_no_repeat=args.pubmedqa_no_repeat, pubmedqa_shortlist=args.pubmedqa_shortlist,
                  pubmedqa_b1=args.pubmedqa_b1,
                  dtype=args.dtype, compile=args.compile)
    if ctx.device.startswith("cuda") and not args.quick and args.suite != "gpu":
        ctx.profile = "gpu"
    torch.manual_seed(0)
    if args.compile and args.only != "step_cost":
        raise DGemmaError("--compile applies to decode --only step_cost")
    if args.only and args.suite != "decode":
        raise DGemmaError(f"--only {args.only} belongs to the decode suite, not {args.suite}")
    if args.only == "adapted":
        result = modules["decode"].run(ctx, adapted_only=True)
        result["command"] = "dgemma bench " + " ".join(argv)
        path = write_result(result, ctx.out)
        _print_result(result)
        print(f"wrote {path}", flush=True)
        return 0
    if args.only:
        from dgemma.bench import step_cost
        from dgemma.device import resolve_dtype

        result = step_cost.run(ctx, (resolve_dtype(args.dtype, ctx.device),))
        result["command"] = "dgemma bench " + " ".join(argv)
        path = write_result(result, ctx.out)
        _print_result(result)
        print(f"wrote {path}", flush=True)
        return 0
    suites = ALL if args.suite == "all" else (args.suite,)
    started = time.perf_counter()
    summary = {"suites": {}, "ratios": [], "command": "dgemma bench " + " ".join(argv)}
    plan_all = args.suite == "all" and args.budget is None and not args.quick and ctx.profile == "cpu"
    for i, name in enumerate(suites):
        if plan_all:
            spent = time.perf_counter() - started
            left = sum(SHARE[n] for n in suites[i:]) or 1.0
            ctx.budget_s = max(20.0, (ALL_BUDGET_S - spent) * SHARE[name] / left) if SHARE[name] else None
        result = modules[name].run(ctx)
        result["command"] = summary["command"]
        path = write_result(result, ctx.out)
        _print_result(result)
        print(f"wrote {path}\n", flush=True)
        summary["suites"][name] = {"json": str(path), "seconds": result["seconds"], "skipped": len(result["skipped"])}
        summary["ratios"] += [{**r, "name": f"{name}: {r['name']}"} for r in result["ratios"]]
        if name == "decode":  # the 270M and its transformers twin are not needed by later suites
            ctx.cache.clear()
    if args.suite == "all":
        summary["seconds"] = time.perf_counter() - started
        ctx.out.mkdir(parents=True, exist_ok=True)
        (ctx.out / "all.json").write_text(json.dumps(jsonable(summary), indent=2) + "\n")
        print(f"dgemma bench all: {summary['seconds']:.0f} s, {len(summary['ratios'])} ratios; wrote {ctx.out / 'all.json'}")
    sys.stdout.flush()
    return 0
