"""Pretraining corpus: streaming readers -> tokenised binary shards -> fixed-length windows.

Three modules, one per step: :mod:`dgemma.data.documents` (read), this one (tokenise and shard,
``dgemma prepare corpus``), :mod:`dgemma.data.windows` (load for training).

Pipeline (``dgemma prepare corpus``):

1. **Read** documents lazily from ``.txt``, ``.jsonl`` and ``.parquet`` files (paths, folders or
   globs). Nothing holds more than one document (txt, jsonl) or one record batch (parquet) at a
   time, so memory does not grow with the corpus.
2. **Tokenise** batches of documents in a process pool with a bounded number of batches in
   flight, appending EOS after every document, and stream the ids into fixed-size shards
   ``{split}_{k:05d}.bin`` (little-endian ``uint16`` when the vocabulary fits, else ``uint32``).
   ``manifest.json`` is written last, atomically: a directory with a manifest is complete.
3. **Load** the shards as memory-mapped, non-overlapping windows of ``seq_len`` tokens over the
   concatenated stream (:class:`TokenWindows`). Windows cross document and shard boundaries: the
   stream is packed, shards are only storage, and no token is lost at a shard edge.

Text documents: a ``.txt`` file holds one document per block of lines separated by blank lines
(a whole-file document would make a multi-GB file one string); a block longer than
``max_doc_chars`` is cut at a line boundary into several documents.

The held-out split takes documents ``i`` with ``floor((i+1) f) > floor(i f)``: exactly
``floor(n f)`` documents, spread evenly over the corpus (every source is represented) and
independent of batching and worker count. The output is the same for any number of workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from dgemma.data.documents import ReadStats, check_on_error, iter_documents, resolve_inputs
from dgemma.data.tokenizers import Tokenizer as Wrapper, load_tokenizer
from dgemma.errors import DGemmaError
from dgemma.models.pretrained import resolve

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<mask>")
"""Special tokens of a tokenizer trained here, with ids 0, 1, 2, 3 in this order."""
PAD_ID, EOS_ID, BOS_ID, MASK_ID = range(4)
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


# -- tokenizer --------------------------------------------------------------------------------
def _evenly(fraction: float, i: int) -> bool:
    """Item ``i`` of a stream belongs to an evenly spread ``fraction`` of it."""
    return int((i + 1) * fraction) > int(i * fraction)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 50257, *, out_path: str | Path,
                        max_chars: int = 200_000_000, min_frequency: int = 2, show_progress: bool = False):
    """Train a byte-level BPE tokenizer (GPT-2 style) on at most ``max_chars`` characters of ``texts``.

    Special tokens ``<pad>``, ``<eos>``, ``<bos>``, ``<mask>`` get ids 0-3, the 256 byte symbols
    follow, merges fill the rest up to ``vocab_size`` (fewer if the sample has too few repeated
    pairs). Any text round-trips through encode/decode. ``out_path`` is a folder or a path named
    ``tokenizer.json``; ``tokenizer_config.json`` is written beside it so that
    :func:`dgemma.data.tokenizers.load_tokenizer` and ``transformers`` know the special tokens.
    Returns the ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise DGemmaError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + len(alphabet)} "
                          f"(4 special tokens + 256 bytes), got {vocab_size}")
    out = Path(out_path)
    if out.suffix == ".json" and out.name != "tokenizer.json":
        raise DGemmaError(f"out_path must be a folder or a path named tokenizer.json, got {out}")
    folder = out.parent if out.suffix == ".json" else out

    def capped() -> Iterator[str]:
        left = max_chars
        for text in texts:
            if left <= 0:
                return
            yield text[:left]
            left -= len(text)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=show_progress)
    tok.train_from_iterator(capped(), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    Wrapper(tok, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                  "mask_token": "<mask>"}).save(folder)
    return tok


def _tokenizer_file(spec: str | Path) -> Path:
    """``tokenizer.json`` of a name (``gemma3-270m``), a folder or the file itself."""
    path = Path(resolve(spec)).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DGemmaError(f"no tokenizer at {spec}: give a tokenizer.json, a folder holding one, or 'gemma3-270m'")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- tokenising into shards -------------------------------------------------------------------
_WORKER_TOKENIZER = None


def _init_worker(tokenizer_path: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one Rust thread per worker process
    torch.set_num_threads(1)
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(tokenizer_path)


def _encode_batch(texts: list[str], eos_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    return _encode(_WORKER_TOKENIZER, texts, eos_id, dtype)


def _encode(tokenizer, texts: list[str], eos_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, lengths)``: the documents' ids each followed by EOS, and each length (EOS included)."""
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for x in ids:
        flat[pos:pos + len(x)] = x
        pos += len(x)
        flat[pos] = eos_id
        pos += 1
    return flat, lengths


def shard_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class _ShardWriter:
    """Appends ids to ``{split}_{k:05d}.bin`` files of exactly ``shard_tokens`` tokens (the last may
    be shorter). Each shard is written under a ``.tmp`` name and renamed when complete."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self._file = None
        self._fill = 0

    def _name(self) -> str:
        return f"{self.split}_{len(self.shards):05d}.bin"

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                self._file = open(self.out_dir / (self._name() + ".tmp"), "wb")
            take = min(self.shard_tokens - self._fill, ids.size)
            ids[:take].tofile(self._file)
            self._fill += take
            ids = ids[take:]
            if self._fill == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.close()
        name = self._name()
        os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)
        self.shards.append({"file": name, "tokens": self._fill})
        self._file, self._fill = None, 0

    def close(self) -> dict:
        if self._file is not None:
            self._finish()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards),
                "documents": self.documents}


def _batches(docs: Iterator[str], batch_chars: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def ordered_bounded(submit, jobs: Iterable[tuple], limit: int) -> Iterator[tuple]:
    """``(tag, submit(job).result())`` for ``(job, tag)`` in ``jobs``, in order, with at most ``limit``
    jobs submitted and not yet consumed. ``Executor.map`` and ``Pool.imap`` instead pull every job
    from the iterator up front, which turns a lazy reader into an unbounded queue of documents."""
    pending: deque = deque()
    for job, tag in jobs:
        pending.append((submit(job), tag))
        if len(pending) >= limit:
            future, tag = pending.popleft()
            yield tag, future.result()
    while pending:
        future, tag = pending.popleft()
        yield tag, future.result()


def _clear_out_dir(out_dir: Path, overwrite: bool) -> None:
    old = [p for p in out_dir.iterdir() if p.name == MANIFEST or p.suffix in (".bin", ".tmp")] \
        if out_dir.is_dir() else []
    if old and not overwrite:
        raise DGemmaError(f"{out_dir} already holds a prepared corpus ({old[0].name}, ...); "
                          "pass overwrite=True / --overwrite or choose another folder")
    manifest = out_dir / MANIFEST
    if manifest.exists():
        manifest.unlink()  # first: from here on the folder never claims to be complete
    for p in old:
        p.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def prepare_corpus(inputs: str | Path | Sequence[str | Path], *, tokenizer: str | Path | None, out_dir: str | Path,
                   vocab_size: int = 50257, shard_tokens: int = 100_000_000, workers: int | None = None,
                   val_fraction: float = 0.001, text_field: str = "text", on_error: str = "raise",
                   bpe_max_chars: int = 200_000_000, batch_chars: int = 1 << 20, max_doc_chars: int = 1_000_000,
                   overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenise ``inputs`` into ``out_dir`` (shards + ``manifest.json``) and return the manifest.

    Without ``tokenizer``, a byte-level BPE of ``vocab_size`` is first trained on an evenly
    spread sample of at most ``bpe_max_chars`` characters and saved to ``out_dir/tokenizer/``
    (a second streaming pass over the inputs).

    ``workers`` processes (default: all CPUs; 0 or 1 tokenises in this process) encode batches
    of about ``batch_chars`` characters, at most ``2 * workers`` batches in flight
    (:func:`ordered_bounded`), so memory stays flat however large the corpus. Workers are spawned, not
    forked, so no Rust or OpenMP thread pool of this process is inherited; a worker that dies
    raises instead of hanging the pool.
    """
    check_on_error(on_error)
    if not 0.0 <= val_fraction < 1.0:
        raise DGemmaError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DGemmaError(f"shard_tokens must be positive, got {shard_tokens}")
    files = resolve_inputs(inputs)
    out_dir = Path(out_dir)
    _clear_out_dir(out_dir, overwrite)
    total_bytes = sum(os.path.getsize(p) for p in files)
    workers = (os.cpu_count() or 1) if workers is None else workers
    read = dict(text_field=text_field, on_error=on_error, max_doc_chars=max_doc_chars)
    started = time.time()

    if tokenizer is None:
        fraction = min(1.0, bpe_max_chars / max(total_bytes, 1))
        sample = (d for i, d in enumerate(iter_documents(files, **read)) if _evenly(fraction, i))
        train_bpe_tokenizer(sample, vocab_size, out_path=out_dir / "tokenizer", max_chars=bpe_max_chars,
                            show_progress=progress)
        tok_path = out_dir / "tokenizer" / "tokenizer.json"
    else:
        tok_path = _tokenizer_file(tokenizer)
    tok = load_tokenizer(tok_path)
    if tok.eos_id is None:
        raise DGemmaError(f"tokenizer {tok_path} has no eos token; documents need one as separator")
    vocab = tok.vocab_size
    dtype = shard_dtype(vocab)
    writers = {"train": _ShardWriter(out_dir, "train", dtype, shard_tokens),
               "val": _ShardWriter(out_dir, "val", dtype, shard_tokens)}
    stats = ReadStats()
    batches = _batches(iter_documents(files, stats=stats, **read), batch_chars)

    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    doc_index, tokens = 0, 0

    def consume(ids: np.ndarray, lengths: np.ndarray, read_bytes: int) -> None:
        nonlocal doc_index, tokens
        idx = np.arange(doc_index, doc_index + len(lengths))
        is_val = np.floor((idx + 1) * val_fraction) > np.floor(idx * val_fraction)
        doc_index += len(lengths)
        tokens += ids.size
        per_token = np.repeat(is_val, lengths)
        writers["val"].write(ids[per_token])
        writers["val"].documents += int(is_val.sum())
        writers["train"].write(ids[~per_token])
        writers["train"].documents += int((~is_val).sum())
        bar.update(read_bytes - bar.n)
        bar.set_postfix(docs=doc_index, tokens=tokens, refresh=False)

    try:
        if workers <= 1:
            for batch in batches:
                consume(*_encode(tok, batch, tok.eos_id, dtype.str), stats.bytes)
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor
            from concurrent.futures.process import BrokenProcessPool

            try:
                with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                         initargs=(str(tok_path),)) as pool:
                    def submit(batch):
                        return pool.submit(_encode_batch, batch, tok.eos_id, dtype.str)

                    jobs = ((batch, stats.bytes) for batch in batches)
                    for nbytes, (ids, lengths) in ordered_bounded(submit, jobs, 2 * workers):
                        consume(ids, lengths, nbytes)
            except BrokenProcessPool:
                raise DGemmaError("a tokenizer worker process died (out of memory, or it could not start: a "
                                  "script calling prepare_corpus needs an `if __name__ == '__main__':` guard, "
                                  "as worker processes are spawned); use workers=0 to tokenise in-process") from None
    finally:
        bar.close()
        splits = {name: w.close() for name, w in writers.items()}
    if doc_index == 0:
        raise DGemmaError(f"no documents in {len(files)} input file(s) (all empty, or every record skipped)")

    try:
        tok_ref = str(tok_path.resolve().relative_to(out_dir.resolve()))
    except ValueError:
        tok_ref = str(tok_path.resolve())
    manifest = {
        "format": "dgemma-corpus",
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "byteorder": "little",
        "vocab_size": vocab,
        "requested_vocab_size": vocab_size if tokenizer is None else None,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "pad_id": tok.pad_id,
        "tokenizer": {"path": tok_ref, "sha256": _sha256(tok_path), "trained": tokenizer is None},
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "total_tokens": tokens,
        "documents": doc_index,
        "splits": splits,
        "inputs": [str(p) for p in files],
        "input_bytes": total_bytes,
        "text_field": text_field,
        "empty_documents": stats.empty,
        "skipped_records": stats.skipped,
        "skipped_examples": stats.errors,
        "seconds": round(time.time() - started, 1),
    }
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out_dir / MANIFEST)
    return manifest
