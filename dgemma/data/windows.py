"""Training windows over a prepared corpus: memory-mapped shards as one packed token stream.

:class:`TokenWindows` cuts the concatenated stream of a split's shards into non-overlapping
windows of ``seq_len`` tokens; windows cross document and shard boundaries (shards are only
storage, and no token is lost at a shard edge). :class:`CorpusData` is the trainer's data set
over them. Step 3 of the corpus pipeline (:mod:`dgemma.data.corpus` writes the shards).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dgemma.data.corpus import FORMAT_VERSION, MANIFEST
from dgemma.data.sft import DataOrder
from dgemma.errors import DGemmaError


def load_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DGemmaError(f"no {MANIFEST} in {folder}: run `dgemma prepare corpus` (an interrupted run "
                          "leaves shards without a manifest; rerun it with --overwrite)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DGemmaError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format") != "dgemma-corpus" or manifest.get("version") != FORMAT_VERSION:
        raise DGemmaError(f"{path} is not a dgemma corpus manifest of version {FORMAT_VERSION}")
    return manifest


class TokenWindows:
    """Non-overlapping windows of ``seq_len`` tokens over the concatenated shards of one split.

    Window ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len)`` of the packed stream; it may span
    documents and shards; the final partial window is dropped. Shards are memory-mapped lazily
    (and not pickled), so the object is cheap to copy into data-loader workers.
    """

    def __init__(self, folder: str | Path, split: str = "train", seq_len: int = 4096):
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        if split not in self.manifest["splits"]:
            raise DGemmaError(f"no split {split!r} in {self.folder} (have {', '.join(self.manifest['splits'])})")
        if seq_len < 1:
            raise DGemmaError(f"seq_len must be positive, got {seq_len}")
        self.split, self.seq_len = split, seq_len
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.files, sizes = [], []
        for shard in self.manifest["splits"][split]["shards"]:
            path = self.folder / shard["file"]
            expected = shard["tokens"] * self.dtype.itemsize
            actual = path.stat().st_size if path.is_file() else None
            if actual != expected:
                raise DGemmaError(f"{path}: expected {expected} bytes from the manifest, found "
                                  f"{'no file' if actual is None else actual}; the corpus folder is damaged")
            self.files.append(path)
            sizes.append(shard["tokens"])
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.total_tokens = int(self.starts[-1])
        if self.total_tokens < seq_len:
            raise DGemmaError(f"the {split} split of {self.folder} has {self.total_tokens} tokens, "
                              f"fewer than one window of {seq_len}")
        self._maps: dict[int, np.memmap] = {}

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def __len__(self) -> int:
        return self.total_tokens // self.seq_len

    def _map(self, k: int) -> np.memmap:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.files[k], dtype=self.dtype, mode="r")
        return self._maps[k]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream, as int64."""
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self.starts[k])
            hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            out[pos - start:pos - start + hi - lo] = self._map(k)[lo:hi]
            pos += hi - lo
            k += 1
        return out

    def __getitem__(self, i: int) -> Tensor:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        i %= n
        return torch.from_numpy(self.tokens(i * self.seq_len, (i + 1) * self.seq_len))


WindowSampler = DataOrder
"""Seeded shuffled window order with ``(epoch, offset)`` state and per-rank slices of each global
batch; the same object SFT uses (``WindowSampler(len(windows), seed=, rank=, world=)``)."""


class CorpusData:
    """Lite training batches: each window is a sequence of ``seq_len // canvas_size`` canvases.

    There is no prompt (``prompt_ids`` is ``[B, 0]``); every token is valid and every canvas
    selectable, in the batch layout of :func:`dgemma.data.sft.collate`.
    """

    def __init__(self, folder: str | Path, seq_len: int, canvas_size: int, split: str = "train"):
        if canvas_size < 1 or seq_len % canvas_size:
            raise DGemmaError(f"seq_len {seq_len} must be a multiple of canvas_size {canvas_size}")
        self.windows = TokenWindows(folder, split, seq_len)
        self.manifest = self.windows.manifest
        self.seq_len, self.canvas_size = seq_len, canvas_size
        self.num_canvases = seq_len // canvas_size
        self.eos_id, self.vocab_size = self.manifest["eos_id"], self.manifest["vocab_size"]
        self.tokenizer_path = Path(folder) / self.manifest["tokenizer"]["path"]

    def __len__(self) -> int:
        return len(self.windows)

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        b = len(indices)
        canvas = torch.stack([self.windows[int(i)] for i in indices]) if b else \
            torch.zeros(0, self.seq_len, dtype=torch.long)
        return {"prompt_ids": torch.zeros(b, 0, dtype=torch.long),
                "prompt_valid": torch.zeros(b, 0, dtype=torch.bool),
                "canvas_ids": canvas,
                "canvas_valid": torch.ones(b, self.seq_len, dtype=torch.bool),
                "canvas_mask": torch.ones(b, self.num_canvases, dtype=torch.bool)}
