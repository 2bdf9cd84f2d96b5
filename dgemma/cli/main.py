"""``dgemma VERB ...``: one module per verb under ``dgemma/cli/``."""

from __future__ import annotations

import argparse
import importlib
import sys

from dgemma.errors import DGemmaError

VERBS = {
    "prepare": "dgemma.cli.prepare",
    "train": "dgemma.cli.train",
    "solve": "dgemma.cli.solve",
    "generate": "dgemma.cli.generate",
    "eval": "dgemma.cli.eval",
    "plot": "dgemma.cli.plot",
    "export": "dgemma.cli.export",
    "average": "dgemma.cli.average",
    "bench": "dgemma.cli.bench",
    "serve": "dgemma.cli.serve",
    "lm-eval": "dgemma.cli.lm_eval",
}

# verbs that only decode: glibc keeps their big freed tensors mapped (dgemma/device.py:keep_freed_heap)
DECODING_VERBS = ("solve", "generate", "eval", "serve", "lm-eval")


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dgemma", description="DiffusionGemma in PyTorch")
    parser.add_argument("verb", choices=sorted(VERBS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        parser.error(f"unknown verb {verb!r}; choose one of {', '.join(sorted(VERBS))}")
    module = importlib.import_module(VERBS[verb])
    if verb in DECODING_VERBS and from_command_line:  # a process of its own, not a caller's (tests)
        from dgemma.device import keep_freed_heap

        keep_freed_heap()
    try:
        return int(module.run(rest) or 0)
    except DGemmaError as e:  # one clear line, no trace from deep inside torch
        print(f"dgemma {verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
