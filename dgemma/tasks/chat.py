"""Your own data: ``chat`` (conversations) and ``completion`` (prompt -> completion) JSONL.

Nothing to prepare: ``data.path`` is a JSONL file (chat also takes a Hugging Face dataset name),
read and checked line by line by :mod:`dgemma.data.chat`; a bad line stops the run, or with
``data.on_error=skip`` is counted and skipped. Eval records come from ``eval_ds.path``, else
``eval.jsonl`` beside ``data.path``. Scoring is :mod:`dgemma.eval.generic` against the reference
response: exact match, ROUGE-L, BLEU, chrF and, with ``eval_ds.regex`` (a named group
``answer``), answer accuracy under ``eval_ds.normalizer``.
"""

from __future__ import annotations

import logging

from dgemma.errors import DGemmaError
from dgemma.eval.generic import generic_metrics, score_example
from dgemma.tasks.base import Task, canvas_shape, count, data_dir

log = logging.getLogger("dgemma")


class _RecordsTask(Task):
    splits = ("eval",)
    primary = ("answer_accuracy", "exact_match", "rouge_l", "bleu")
    regex: str | None = None
    normalizer: str = "default"
    needs: str = ""  # what data.path must name (for the error when it is missing)

    def configure(self, cfg) -> "_RecordsTask":
        task = type(self)()
        task.regex, task.normalizer = cfg.eval_ds.regex, cfg.eval_ds.normalizer
        return task

    def read(self, cfg, path: str, *, tokenizer, split: str, train: bool) -> tuple[list[dict], list]:
        """``(records, problems)`` of the file at ``path`` (eval records: the last turn only)."""
        raise NotImplementedError

    def train_data(self, cfg, tokenizer):
        from dgemma.data.chat import skipped_summary, truncation_summary
        from dgemma.data.sft import SFTData

        if not cfg.data.path:
            raise DGemmaError(f"task {self.name!r} needs data.path: {self.needs}")
        records, problems = self.read(cfg, cfg.data.path, tokenizer=tokenizer, split=cfg.data.split, train=True)
        if problems:
            msg = skipped_summary(problems, kept=len(records), source=cfg.data.path)
            print(f"[dgemma] {msg}", flush=True)
            log.warning(msg)
        data = SFTData(None, tokenizer, records=records, **canvas_shape(cfg))
        n, msg = truncation_summary([ex.truncated for ex in data.examples], prompt_len=cfg.data.prompt_len)
        if n:
            print(f"[dgemma] {msg}", flush=True)
            log.info(msg)
        data.skipped = len(problems)
        return data

    def source(self, cfg, split: str) -> str:
        self.check_split(split)
        if cfg.eval_ds.path:
            return cfg.eval_ds.path
        d = data_dir(cfg)
        if d is None:
            raise DGemmaError(f"task {self.name!r} needs eval_ds.path (an eval JSONL) or data.path with an "
                              f"eval.jsonl beside it")
        return str(d / "eval.jsonl")

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        from dgemma.data.chat import skipped_summary

        src = self.source(cfg, split or self.default_split)
        records, problems = self.read(cfg, src, tokenizer=None, split="test", train=False)
        if problems:
            log.warning(skipped_summary(problems, kept=len(records), source=src))
        if not records:
            raise DGemmaError(f"{src} holds no usable records")
        return records[: count(cfg, limit)]

    def score(self, texts, records) -> dict:
        return generic_metrics(texts, [r["response"] for r in records], regex=self.regex, normalizer=self.normalizer)

    def score_one(self, text: str, record: dict) -> dict:
        return score_example(text, record["response"], regex=self.regex, normalizer=self.normalizer)


class ChatTask(_RecordsTask):
    """``{"messages": [{role, content}, ...]}`` lines rendered with the model's chat template."""

    name = "chat"
    needs = "a chat JSONL file or a Hugging Face dataset name"

    def read(self, cfg, path, *, tokenizer, split, train):
        from dgemma.data.chat import load_chat_records

        return load_chat_records(path, tokenizer, split=split, supervise=cfg.data.supervise if train else "last",
                                 on_error=cfg.data.on_error)


class CompletionTask(_RecordsTask):
    """``{"prompt", "completion"}`` lines: the prompt as is after BOS, the completion as the response."""

    name = "completion"
    needs = "a JSONL file of {prompt, completion} rows"

    def read(self, cfg, path, *, tokenizer, split, train):
        from dgemma.data.chat import load_completion_records

        return load_completion_records(path, on_error=cfg.data.on_error)
