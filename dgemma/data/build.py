"""Training data by task: one small builder per kind of source (docs/design.md §5, the chat/completion tasks).

Every builder returns an object with ``len()`` and ``batch(indices) -> dict`` of fixed-shape
tensors, which is all the trainer needs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dgemma.errors import DGemmaError

log = logging.getLogger("dgemma")


def _shape(cfg) -> dict:
    return {"prompt_len": cfg.data.prompt_len, "num_canvases": cfg.diffusion.num_canvases,
            "canvas_size": cfg.diffusion.canvas_size}


def hint_fn(cfg, tokenizer):
    """The infilling hints of a task, if the config asks for them (Sudoku: pinned clues)."""
    if not cfg.data.pin_clues:
        return None
    if cfg.data.task != "sudoku":
        raise DGemmaError(f"data.pin_clues is for the sudoku task, not {cfg.data.task!r}")
    from functools import partial

    from dgemma.data.sudoku import clue_hint

    return partial(clue_hint, tokenizer=tokenizer)


def _prepared(cfg, tokenizer):
    """A directory written by ``dgemma prepare`` (``train.jsonl``) or one JSONL file."""
    from dgemma.data.sft import SFTData

    if not cfg.data.path:
        raise DGemmaError(f"data.path is not set for task {cfg.data.task!r}: run `dgemma prepare "
                          f"{cfg.data.task} --out DIR` and pass --cfg.data.path=DIR")
    path = Path(cfg.data.path)
    return SFTData(path / "train.jsonl" if path.is_dir() else path, tokenizer, hint_fn=hint_fn(cfg, tokenizer),
                   **_shape(cfg))


def _sudoku(cfg, tokenizer):
    if cfg.data.path:
        return _prepared(cfg, tokenizer)
    from dgemma.data.sudoku_stream import SudokuStream

    return SudokuStream(tokenizer, seed=cfg.data.seed, hint_fn=hint_fn(cfg, tokenizer), **_shape(cfg))


def _records(cfg, tokenizer, records, problems, source):
    from dgemma.data.chat import skipped_summary, truncation_summary
    from dgemma.data.sft import SFTData

    if problems:
        msg = skipped_summary(problems, kept=len(records), source=source)
        print(f"[dgemma] {msg}", flush=True)
        log.warning(msg)
    data = SFTData(None, tokenizer, records=records, **_shape(cfg))
    count, msg = truncation_summary([ex.truncated for ex in data.examples], prompt_len=cfg.data.prompt_len)
    if count:
        print(f"[dgemma] {msg}", flush=True)
        log.info(msg)
    data.skipped = len(problems)
    return data


def _chat(cfg, tokenizer):
    from dgemma.data.chat import load_chat_records

    if not cfg.data.path:
        raise DGemmaError("task 'chat' needs data.path: a chat JSONL file or a Hugging Face dataset name")
    records, problems = load_chat_records(cfg.data.path, tokenizer, split=cfg.data.split,
                                          supervise=cfg.data.supervise, on_error=cfg.data.on_error)
    return _records(cfg, tokenizer, records, problems, cfg.data.path)


def _completion(cfg, tokenizer):
    from dgemma.data.chat import load_completion_records

    if not cfg.data.path:
        raise DGemmaError("task 'completion' needs data.path: a JSONL file of {prompt, completion} rows")
    records, problems = load_completion_records(cfg.data.path, on_error=cfg.data.on_error)
    return _records(cfg, tokenizer, records, problems, cfg.data.path)


def _corpus(cfg, tokenizer):
    """Lite pretraining: fixed windows over ``dgemma prepare corpus`` shards, all canvases."""
    from dgemma.data.corpus import CorpusData

    if not cfg.data.path:
        raise DGemmaError("task 'corpus' needs data.path: a directory written by `dgemma prepare corpus`")
    return CorpusData(cfg.data.path, cfg.data.prompt_len + cfg.diffusion.num_canvases * cfg.diffusion.canvas_size,
                      cfg.diffusion.canvas_size)


BUILDERS = {"sudoku": _sudoku, "pubmedqa": _prepared, "chat": _chat, "completion": _completion, "corpus": _corpus}


def build_train_data(cfg, tokenizer):
    try:
        builder = BUILDERS[cfg.data.task]
    except KeyError:
        raise DGemmaError(f"unknown task {cfg.data.task!r}; choose one of {sorted(BUILDERS)}") from None
    return builder(cfg, tokenizer)
