"""The :class:`Task` protocol: everything dgemma knows about one task, in one object.

A task owns, start to finish:

- **preparation**: the ``dgemma prepare NAME`` sub-command (:meth:`Task.add_prepare_args`,
  :meth:`Task.prepare`) that writes ``train.jsonl`` and the eval splits as records
  ``{id, prompt, response, system?, ...}``; the prompt and response texts are built there;
- **training data**: :meth:`Task.train_data`, the fixed-shape batches the trainer draws, and
  :meth:`Task.hints` (tokens pinned in the canvas, e.g. Sudoku's clues) and :meth:`Task.key_tokens`
  (the tokens the metric reads, e.g. PubMedQA's verdict, for ``diffusion.key_token_weight``);
- **evaluation**: its splits and where they come from (:meth:`Task.source`, :meth:`Task.load`),
  what ends a response (:meth:`Task.stop_ids`), how the answer is read out of the text and
  scored (:meth:`Task.score`, :meth:`Task.score_one`), and which metrics head the summary
  table (:attr:`Task.primary`).

The defaults fit a task whose ``dgemma prepare`` writes ``<dir>/train.jsonl`` and
``<dir>/<split>.jsonl``: a subclass then only builds records and scores texts (see
``docs/guides/new-task.md``). Module-level imports stay torch-free; torch-backed pieces are
imported where they are used, so ``dgemma.tasks`` loads in the light processes (metrics, CLI help).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dgemma.errors import DGemmaError


def response_stop_ids(tokenizer) -> tuple[int, ...]:
    """EOS and end-of-turn, the ids that end a response (those the tokenizer has)."""
    ids = (tokenizer.eos_id, getattr(tokenizer, "end_of_turn_id", None))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def data_dir(cfg) -> Path | None:
    """The prepared folder ``data.path`` names (its parent if it names a file), or None."""
    if not cfg.data.path:
        return None
    path = Path(cfg.data.path)
    return path if path.is_dir() or not path.suffix else path.parent


def canvas_shape(cfg) -> dict:
    """The keyword arguments every training data set takes: prompt length, canvas geometry and
    the token that ends a response."""
    return {"prompt_len": cfg.data.prompt_len, "num_canvases": cfg.diffusion.num_canvases,
            "canvas_size": cfg.diffusion.canvas_size, "response_end": cfg.data.response_end}


def count(cfg, limit: int | None) -> int:
    return cfg.eval_ds.num_examples if limit is None else min(limit, cfg.eval_ds.num_examples)


class Task:
    """Base task: prepared JSONL folders, responses ending at EOS or end-of-turn."""

    name: str = ""
    splits: tuple[str, ...] = ()  # eval splits; the first is the default
    primary: tuple[str, ...] = ("accuracy",)  # the metrics of the summary table
    viz: str = "text"  # how visualize.py draws a canvas: "text" or "sudoku"
    fields: tuple[str, ...] = ()  # record keys the scorer needs besides prompt and response
    prepare_help: str | None = None  # set: ``dgemma prepare NAME`` exists, with this help line

    # ------------------------------------------------------------------------ preparation
    def add_prepare_args(self, parser: argparse.ArgumentParser) -> None:
        """The arguments of ``dgemma prepare NAME`` (``--out`` is the convention)."""

    def prepare(self, args: argparse.Namespace) -> str:
        """Write the task's files as ``args`` asks; return one summary line for the terminal."""
        raise DGemmaError(f"task {self.name!r} has nothing to prepare")

    # ------------------------------------------------------------------------ training
    def hints(self, cfg, tokenizer):
        """``fn(record, response_ids) -> pins | None`` pinning known response tokens, or None.
        Only tasks that define pins accept ``data.pin_clues``."""
        if cfg.data.pin_clues:
            raise DGemmaError(f"data.pin_clues is for the sudoku task, not {cfg.data.task!r}")
        return None

    def key_tokens(self, cfg, tokenizer):
        """``fn(record, response_ids) -> positions`` of the response tokens the metric reads (their
        loss is weighted ``diffusion.key_token_weight``), or None: the task has no such tokens."""
        return None

    def key_args(self, cfg, tokenizer) -> dict:
        """``key_fn`` / ``key_weight`` for the training set; an error when a weight is asked of a
        task that names no key tokens."""
        w = cfg.diffusion.key_token_weight
        if w == 1.0:
            return {}
        fn = self.key_tokens(cfg, tokenizer)
        if fn is None:
            raise DGemmaError(f"diffusion.key_token_weight={w}: task {self.name!r} names no key tokens")
        return {"key_fn": fn, "key_weight": w}

    def train_data(self, cfg, tokenizer):
        """The training set: an object with ``len()`` and ``batch(indices) -> dict`` of
        fixed-shape tensors. Default: ``<data.path>/train.jsonl`` (or ``data.path`` itself, a file)."""
        from dgemma.data.sft import SFTData

        if not cfg.data.path:
            raise DGemmaError(f"data.path is not set for task {self.name!r}: run `dgemma prepare {self.name} "
                              f"--out DIR` and pass --cfg.data.path=DIR")
        path = Path(cfg.data.path)
        return SFTData(path / "train.jsonl" if path.is_dir() else path, tokenizer,
                       hint_fn=self.hints(cfg, tokenizer), **self.key_args(cfg, tokenizer), **canvas_shape(cfg))

    # ------------------------------------------------------------------------ evaluation
    @property
    def default_split(self) -> str:
        if not self.splits:
            raise DGemmaError(f"task {self.name!r} has no eval splits")
        return self.splits[0]

    def configure(self, cfg) -> "Task":
        """The task with the config's scoring settings bound (most tasks have none)."""
        return self

    def check_split(self, split: str) -> str:
        if split not in self.splits:
            raise DGemmaError(f"task {self.name!r} has no eval split {split!r}; choose one of {list(self.splits)}")
        return split

    def source(self, cfg, split: str) -> str:
        """Where :meth:`load` reads ``split`` from (recorded next to every metric)."""
        d = data_dir(cfg)
        if d is None:
            raise DGemmaError(f"data.path is not set: run `dgemma prepare {self.name} --out DIR ...` and pass "
                              f"--cfg.data.path=DIR")
        return str(d / f"{self.check_split(split)}.jsonl")

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        """The first ``eval_ds.num_examples`` records of ``split`` (default split if None), or
        fewer when ``limit`` is smaller."""
        from dgemma.data.sft import read_jsonl

        split = self.check_split(split or self.default_split)
        records = read_jsonl(self.source(cfg, split))[: count(cfg, limit)]
        if not records:
            raise DGemmaError(f"{self.source(cfg, split)} holds no records")
        for r in records:
            self.check_record(r)
        return records

    def check_record(self, record: dict) -> None:
        missing = [k for k in ("prompt", "response", *self.fields) if k not in record]
        if missing:
            raise DGemmaError(f"{self.name} record {record.get('id', '?')!r} lacks {missing}")

    def stop_ids(self, tokenizer) -> tuple[int, ...]:
        return response_stop_ids(tokenizer)

    def reference(self, record: dict) -> str:
        return record["response"]

    def score(self, texts: list[str], records: list[dict]) -> dict:
        """Metrics over a batch of decoded responses: ``{name: float | int}``."""
        raise NotImplementedError

    def score_one(self, text: str, record: dict) -> dict:
        """One example's scores (written beside its output in the eval JSONL)."""
        raise NotImplementedError
