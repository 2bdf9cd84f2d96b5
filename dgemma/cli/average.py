"""``dgemma average RUN RUN [...] --out DIR [--weights W W ...] [--steps S S ...]``.

Writes a new run whose weights are the weighted mean of finished runs of one architecture (a
"model soup", :func:`dgemma.training.average.average_runs`): each source's moving average where
it has one, its raw weights otherwise. The result opens like any workdir (``dgemma eval``,
``solve --checkpoint``, ``serve``, ``export``), not for resuming training.
"""

from __future__ import annotations

import argparse


def run(argv: list[str]) -> int:
    from dgemma.training.average import average_runs

    parser = argparse.ArgumentParser(prog="dgemma average", description=__doc__.split("\n\n")[1])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="training workdirs (two or more)")
    parser.add_argument("--out", required=True, help="the new workdir (must hold no checkpoint yet)")
    parser.add_argument("--weights", type=float, nargs="+", default=None,
                        help="one weight per run, positive, summing to 1 (default: equal)")
    parser.add_argument("--steps", type=int, nargs="+", default=None,
                        help="one checkpoint step per run (default: each run's latest)")
    parser.add_argument("--step", type=int, default=None, help="the new checkpoint's step (default: the largest)")
    args = parser.parse_args(argv)
    path = average_runs(args.runs, args.out, weights=args.weights, steps=args.steps, step=args.step)
    print(f"[dgemma] averaged {len(args.runs)} runs into {path}")
    return 0
