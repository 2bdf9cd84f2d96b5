"""Supervised fine-tuning data: records -> token ids -> fixed-shape batches, in a resumable order.

A record is a dict with ``prompt``, ``response`` and optionally ``system`` (what ``dgemma
prepare`` writes as JSONL). The prompt is rendered in the chat format, tokenised and truncated
from the left to ``prompt_len`` (the end of a prompt — the question and the model-turn marker —
matters most; BOS is kept); the response plus end-of-turn is cut into canvases.

Batches have fixed shapes (``[B, prompt_len]`` and ``[B, num_canvases * canvas_size]``) so
compiled kernels and FlexAttention block masks never see a new shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dgemma.data.chat import encode_prompt_text, render_prompt
from dgemma.data.chunker import Canvases, chunk_response, collate_canvases
from dgemma.errors import DGemmaError


@dataclass
class Example:
    prompt_ids: list[int]
    canvases: Canvases
    truncated: bool
    record: dict
    hint: list[int] | None = None  # per canvas position: a pinned token id, or -1 (infilling)
    weight: list[float] | None = None  # per canvas position: the loss weight (key tokens), else 1


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file; a broken line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DGemmaError(f"data file not found: {path}")
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DGemmaError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
    return rows


def encode_prompt(tokenizer, record: dict, prompt_len: int) -> tuple[list[int], bool]:
    """Chat-formatted, tokenised prompt, left-truncated to ``prompt_len`` keeping BOS first.

    The text is :func:`dgemma.data.chat.render_prompt`'s: a pre-rendered ``prompt_text``, a chat
    ``history``, or one user turn ``prompt`` (+ ``system``).
    """
    return encode_prompt_text(tokenizer, render_prompt(tokenizer, record), prompt_len)


def pin_rows(pins: list[list[int]], width: int, device=None) -> torch.Tensor:
    """``[B, width]`` sampler hints from each row's pinned response tokens, counted from the first
    response position and padded with ``-1`` (free): ``[[7, 8], []]``, width 3 ->
    ``[[7, 8, -1], [-1, -1, -1]]``."""
    return torch.tensor([(list(p) + [-1] * width)[:width] for p in pins], dtype=torch.long, device=device)


def encode_prompts(tokenizer, records: list[dict], prompt_len: int, *, pad_to: int | None = None,
                   device=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``(ids, valid, n_truncated)``: padded to the longest prompt, or ``pad_to``."""
    enc = [encode_prompt(tokenizer, r, prompt_len) for r in records]
    width = pad_to or max(len(ids) for ids, _ in enc)
    ids = torch.full((len(enc), width), tokenizer.pad_id, dtype=torch.long)
    valid = torch.zeros(len(enc), width, dtype=torch.bool)
    for i, (row, _) in enumerate(enc):
        ids[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    return ids.to(device), valid.to(device), sum(t for _, t in enc)


def response_end_id(tokenizer, response_end: str = "end_of_turn") -> int:
    """The id appended to every response (``data.response_end``): ``<end_of_turn>`` as in Gemma's
    chat format, or EOS. A fine-tune of Gemma 3 270M needs EOS: its ``<end_of_turn>`` row is a
    near-duplicate of thousands of untrained rows, so the tied head cannot rank it first
    (``dgemma/diffusion/sampler.py:stop_aliases``)."""
    if response_end == "eos":
        return tokenizer.eos_id
    if response_end != "end_of_turn":
        raise DGemmaError(f"data.response_end must be 'end_of_turn' or 'eos', got {response_end!r}")
    end = getattr(tokenizer, "end_of_turn_id", None)
    if end is None:
        raise DGemmaError("this tokenizer has no <end_of_turn> token: set data.response_end='eos'")
    return end


def encode_example(tokenizer, record: dict, *, prompt_len: int, num_canvases: int, canvas_size: int,
                   hint_fn=None, response_end: str = "end_of_turn", key_fn=None, key_weight: float = 1.0) -> Example:
    """``hint_fn(record, response_ids) -> list[int] | None`` pins known response tokens (``-1`` = free);
    ``key_fn(record, response_ids) -> list[int]`` names the key positions of the response (PubMedQA's
    verdict), whose loss is weighted ``key_weight``."""
    for key in ("prompt", "response"):
        if not isinstance(record.get(key), str):
            raise DGemmaError(f"record {record.get('id', '?')!r} has no string field {key!r}")
    prompt, truncated = encode_prompt(tokenizer, record, prompt_len)
    response = tokenizer.encode(record["response"]) + [response_end_id(tokenizer, response_end)]
    canvases = chunk_response(response, num_canvases=num_canvases, canvas_size=canvas_size,
                              eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    hint = None
    if hint_fn is not None and (pins := hint_fn(record, response)) is not None:
        width = num_canvases * canvas_size
        hint = (list(pins) + [-1] * width)[:width]
    weight = None
    if key_fn is not None and key_weight != 1.0:
        width = num_canvases * canvas_size
        weight = [1.0] * width
        for k in key_fn(record, response):
            if 0 <= k < width:  # a key token cut off with the response's end is not trained anyway
                weight[k] = key_weight
    return Example(prompt, canvases, truncated, record, hint, weight)


def collate(examples: list[Example], *, prompt_len: int, pad_id: int) -> dict[str, Tensor]:
    """Right-pad prompts to ``prompt_len`` and stack canvases into one batch dict."""
    b = len(examples)
    prompt_ids = torch.full((b, prompt_len), pad_id, dtype=torch.long)
    prompt_valid = torch.zeros(b, prompt_len, dtype=torch.bool)
    for i, ex in enumerate(examples):
        prompt_ids[i, : len(ex.prompt_ids)] = torch.tensor(ex.prompt_ids)
        prompt_valid[i, : len(ex.prompt_ids)] = True
    c = collate_canvases([ex.canvases for ex in examples])
    out = {"prompt_ids": prompt_ids, "prompt_valid": prompt_valid, "canvas_ids": c["tokens"],
           "canvas_valid": c["valid"], "canvas_mask": c["canvas_mask"]}
    if any(ex.hint is not None for ex in examples):
        width = c["tokens"].shape[1]
        out["canvas_hint"] = torch.tensor([ex.hint or [-1] * width for ex in examples], dtype=torch.long)
    if any(ex.weight is not None for ex in examples):
        width = c["tokens"].shape[1]
        out["canvas_weight"] = torch.tensor([ex.weight or [1.0] * width for ex in examples], dtype=torch.float32)
    return out


def trim_prompt_padding(batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Drop the prompt columns that are padding in every row of every micro-batch.

    Prompts are right-padded and every position and mask is computed from ``prompt_valid``,
    so the trailing all-pad columns change no result; they only cost FLOPs (PubMedQA's prompts
    have a median of ~380 of 1,024 tokens). One width for the whole step keeps the
    micro-batches alike. Example: valid rows ``[1 1 1 0 0]`` and ``[1 1 0 0 0]`` -> width 3.
    """
    width = max(int(b["prompt_valid"].sum(-1).max()) if b["prompt_valid"].numel() else 0 for b in batches)
    return [{**b, "prompt_ids": b["prompt_ids"][:, :width], "prompt_valid": b["prompt_valid"][:, :width]}
            for b in batches]


class DataOrder:
    """A seeded, shuffled, resumable order over ``n`` examples, sharded across ranks.

    Epoch ``e`` is ``randperm(n)`` from a generator seeded by ``(seed, e)``; the state is just
    ``(epoch, offset)``, saved in checkpoints so a resumed run continues the exact order. Each
    global batch takes ``batch * world`` consecutive indices; rank ``r`` gets its slice.
    """

    def __init__(self, n: int, *, seed: int, rank: int = 0, world: int = 1):
        if n == 0:
            raise DGemmaError("the training set is empty")
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.epoch, self.offset = 0, 0
        self._perm: Tensor | None = None

    def _permutation(self) -> Tensor:
        """Kept as a tensor: as a list, a 10M-example stream's order costs ~700 MB and a second."""
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.n, generator=g)
        return self._perm

    def next_batch(self, batch: int) -> list[int]:
        """Indices for this rank's share of the next global batch (wraps into the next epoch)."""
        out = []
        for _ in range(batch * self.world):
            if self.offset == self.n:
                self.epoch, self.offset, self._perm = self.epoch + 1, 0, None
            out.append(int(self._permutation()[self.offset]))
            self.offset += 1
        return out[self.rank * batch:(self.rank + 1) * batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise DGemmaError(f"data order was saved for n={state['n']} seed={state['seed']}, "
                              f"this run has n={self.n} seed={self.seed}: the data set or seed changed")
        self.epoch, self.offset, self._perm = state["epoch"], state["offset"], None


class SFTData:
    """A pre-tokenised JSONL data set with :meth:`batch` drawing from a :class:`DataOrder`."""

    def __init__(self, path: str | Path | None, tokenizer, *, prompt_len: int, num_canvases: int, canvas_size: int,
                 limit: int | None = None, records: list[dict] | None = None, hint_fn=None,
                 response_end: str = "end_of_turn", key_fn=None, key_weight: float = 1.0):
        records = (read_jsonl(path) if records is None else records)[:limit]
        self.prompt_len, self.pad_id = prompt_len, tokenizer.pad_id
        self.examples = [encode_example(tokenizer, r, prompt_len=prompt_len, num_canvases=num_canvases,
                                        canvas_size=canvas_size, hint_fn=hint_fn, response_end=response_end,
                                        key_fn=key_fn, key_weight=key_weight)
                         for r in records]
        self.num_truncated = sum(ex.truncated for ex in self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices: list[int]) -> dict[str, Tensor]:
        return collate([self.examples[i] for i in indices], prompt_len=self.prompt_len, pad_id=self.pad_id)
