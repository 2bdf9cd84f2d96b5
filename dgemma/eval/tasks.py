"""Evaluation tasks: where a task's eval records come from, what ends a response, how it scores.

Splits (the first is the task's default):

- sudoku ``eval``: ``<data.path>/eval.jsonl`` (``dgemma prepare sudoku``); without a
  ``data.path``, unique puzzles generated from fresh grids with a fixed seed
  (:data:`SUDOKU_EVAL_SEED`), difficulties cycling easy, medium, hard;
- pubmedqa ``test``: ``<data.path>/test.jsonl``, the 500 official test items;
- pubmedqa ``train_eval``: ``<data.path>/train_eval.jsonl``, 50 held-out non-test items;
- chat, completion ``eval``: ``eval_ds.path``, else ``eval.jsonl`` beside ``data.path``.

Every split is capped at ``eval_ds.num_examples`` records, in file order. A response ends at EOS
or end-of-turn. Scoring is pure: ``score(texts, records) -> metrics`` delegates to the task's
metric module, ``score_one(text, record) -> dict`` scores one example.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dgemma.data import sudoku as sd
from dgemma.data.sft import read_jsonl
from dgemma.errors import DGemmaError
from dgemma.eval.generic import generic_metrics, score_example
from dgemma.eval.pubmedqa import extract_decision, pubmedqa_metrics
from dgemma.eval.sudoku import score_sudoku, sudoku_metrics

log = logging.getLogger("dgemma")

SUDOKU_EVAL_SEED = 7_919
"""Seed of the generated Sudoku eval puzzles: one fixed held-out set for every run and sampling
seed, so numbers compare across runs (``--cfg.aux.knobs.eval_puzzle_seed=N`` picks another).
They come from fresh grids, never the training stream's pool."""


def _data_dir(cfg) -> Path | None:
    if not cfg.data.path:
        return None
    path = Path(cfg.data.path)
    return path if path.is_dir() or not path.suffix else path.parent


def _count(cfg, limit: int | None) -> int:
    return cfg.eval_ds.num_examples if limit is None else min(limit, cfg.eval_ds.num_examples)



def response_stop_ids(tokenizer) -> tuple[int, ...]:
    """EOS and end-of-turn, the ids that end a response (those the tokenizer has)."""
    ids = (tokenizer.eos_id, getattr(tokenizer, "end_of_turn_id", None))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

class Task:
    """Base: records from ``<data.path>/<split>.jsonl``; responses end at EOS or end-of-turn."""

    name: str = ""
    splits: tuple[str, ...] = ()
    primary: tuple[str, ...] = ("accuracy",)  # the metrics of the summary table
    viz: str = "text"  # how visualize.py draws a canvas: "text" or "sudoku"
    fields: tuple[str, ...] = ()  # record keys the scorer needs besides prompt and response

    @property
    def default_split(self) -> str:
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
        d = _data_dir(cfg)
        if d is None:
            raise DGemmaError(f"data.path is not set: run `dgemma prepare {self.name} --out DIR ...` and pass "
                              f"--cfg.data.path=DIR")
        return str(d / f"{self.check_split(split)}.jsonl")

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        """The first ``eval_ds.num_examples`` records of ``split`` (default split if None), or
        fewer when ``limit`` is smaller."""
        split = self.check_split(split or self.default_split)
        records = read_jsonl(self.source(cfg, split))[: _count(cfg, limit)]
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
        raise NotImplementedError

    def score_one(self, text: str, record: dict) -> dict:
        raise NotImplementedError


class SudokuTask(Task):
    name = "sudoku"
    splits = ("eval",)
    primary = ("accuracy", "cell_accuracy", "valid_accuracy")
    viz = "sudoku"
    fields = ("puzzle", "solution")

    def source(self, cfg, split: str) -> str:
        if _data_dir(cfg) is not None:
            return super().source(cfg, split)
        return f"generator(seed={eval_puzzle_seed(cfg)}, difficulty=mixed, unique=True)"

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        if _data_dir(cfg) is not None:
            return super().load(cfg, split, limit)
        self.check_split(split or self.default_split)
        return generate_eval_puzzles(_count(cfg, limit), seed=eval_puzzle_seed(cfg))

    def score(self, texts, records) -> dict:
        return sudoku_metrics(texts, [r["puzzle"] for r in records], [r["solution"] for r in records])

    def score_one(self, text: str, record: dict) -> dict:
        return score_sudoku(text, record["puzzle"], record["solution"])


def eval_puzzle_seed(cfg) -> int:
    seed = cfg.aux.knobs.get("eval_puzzle_seed", SUDOKU_EVAL_SEED)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DGemmaError(f"aux.knobs.eval_puzzle_seed must be an integer, got {seed!r}")
    return seed


def generate_eval_puzzles(n: int, *, seed: int) -> list[dict]:
    """``n`` unique-solution puzzles from fresh grids, easy/medium/hard in turn (any prefix is
    balanced, and the first ``k`` of ``n`` equal those of ``k``), as prepared-file records."""
    recs = sd.generate_puzzles(n, seed=seed, difficulty="mixed")
    return [sd.make_record(f"gen-eval-s{seed}-{k:06d}", r["puzzle"], r["solution"]) for k, r in enumerate(recs)]


class PubMedQATask(Task):
    name = "pubmedqa"
    splits = ("test", "train_eval")
    primary = ("accuracy", "macro_f1", "bleu")
    fields = ("label", "long_answer")

    def score(self, texts, records) -> dict:
        return pubmedqa_metrics(texts, [r["label"] for r in records], [r["long_answer"] for r in records])

    def score_one(self, text: str, record: dict) -> dict:
        m = pubmedqa_metrics([text], [record["label"]], [record["long_answer"]])
        return {"prediction": extract_decision(text), "label": record["label"], "accuracy": m["accuracy"],
                "bleu": m["bleu"]}


class GenericTask(Task):
    """``chat`` and ``completion``: records from ``eval_ds.path``, else ``eval.jsonl`` beside
    ``data.path``, scored by :mod:`dgemma.eval.generic` against the response, with
    ``eval_ds.regex`` (a named group ``answer``) and ``eval_ds.normalizer``."""

    splits = ("eval",)
    primary = ("answer_accuracy", "exact_match", "rouge_l", "bleu")

    def __init__(self, name: str, regex: str | None = None, normalizer: str = "default"):
        self.name, self.regex, self.normalizer = name, regex, normalizer

    def configure(self, cfg) -> "GenericTask":
        return GenericTask(self.name, cfg.eval_ds.regex, cfg.eval_ds.normalizer)

    def source(self, cfg, split: str) -> str:
        self.check_split(split)
        if cfg.eval_ds.path:
            return cfg.eval_ds.path
        d = _data_dir(cfg)
        if d is None:
            raise DGemmaError(f"task {self.name!r} needs eval_ds.path (an eval JSONL) or data.path with an "
                              f"eval.jsonl beside it")
        return str(d / "eval.jsonl")

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        from dgemma.data.chat import load_chat_records, load_completion_records, skipped_summary

        src = self.source(cfg, split or self.default_split)
        if self.name == "chat":
            records, problems = load_chat_records(src, None, split="test", on_error=cfg.data.on_error)
        else:
            records, problems = load_completion_records(src, on_error=cfg.data.on_error)
        if problems:
            log.warning(skipped_summary(problems, kept=len(records), source=src))
        if not records:
            raise DGemmaError(f"{src} holds no usable records")
        return records[: _count(cfg, limit)]

    def score(self, texts, records) -> dict:
        return generic_metrics(texts, [r["response"] for r in records], regex=self.regex, normalizer=self.normalizer)

    def score_one(self, text: str, record: dict) -> dict:
        return score_example(text, record["response"], regex=self.regex, normalizer=self.normalizer)


TASKS: dict[str, Task] = {t.name: t for t in (SudokuTask(), PubMedQATask(), GenericTask("chat"),
                                              GenericTask("completion"))}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DGemmaError(f"unknown eval task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]
