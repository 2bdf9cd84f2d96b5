"""``dgemma prepare TARGET``: build caches and data sets.

Targets: ``gemma3-270m`` (convert the GGUF package once to a safetensors cache),
``sudoku``, ``pubmedqa``.
"""

from __future__ import annotations

import argparse


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgemma prepare")
    sub = parser.add_subparsers(dest="target", required=True)
    g = sub.add_parser("gemma3-270m", help="convert the gemma3-270m GGUF package to a safetensors cache")
    g.add_argument("--force", action="store_true", help="rebuild the cache even if it exists")
    args = parser.parse_args(argv)
    if args.target == "gemma3-270m":
        from dgemma.models.weights import prepare_gemma3_270m

        print(prepare_gemma3_270m(force=args.force))
    return 0
