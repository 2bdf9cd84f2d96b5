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


def main(argv: list[str] | None = None) -> int:
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
    try:
        return int(module.run(rest) or 0)
    except DGemmaError as e:  # one clear line, no trace from deep inside torch
        print(f"dgemma {verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
