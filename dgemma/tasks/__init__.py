"""Tasks: one module per task, each one :class:`~dgemma.tasks.base.Task` that owns its data,
prompts, stop ids, answer extraction and scoring; :data:`TASKS` is the one registry that
``dgemma prepare``, the trainer (``data.task``) and ``dgemma eval`` (``--task``) read.

A new task is one new module here and one line in :data:`TASKS` (docs/guides/new-task.md).
"""

from __future__ import annotations

from dgemma.errors import DGemmaError
from dgemma.tasks.base import Task, response_stop_ids
from dgemma.tasks.chat import ChatTask, CompletionTask
from dgemma.tasks.lm import CorpusTask
from dgemma.tasks.pubmedqa import PubMedQATask
from dgemma.tasks.reverse import ReverseTask
from dgemma.tasks.sudoku import SudokuTask

TASKS: dict[str, Task] = {t.name: t for t in (
    SudokuTask(),
    PubMedQATask(),
    ChatTask(),
    CompletionTask(),
    CorpusTask(),
    ReverseTask(),
)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DGemmaError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Task", "get_task", "response_stop_ids"]
