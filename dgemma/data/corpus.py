"""Pretraining corpus: streaming readers -> tokenised binary shards -> fixed-length windows.

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

import glob as _glob
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dgemma.data.sft import DataOrder
from dgemma.data.tokenizers import Tokenizer as Wrapper, load_tokenizer
from dgemma.errors import DGemmaError
from dgemma.models.pretrained import resolve

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<mask>")
"""Special tokens of a tokenizer trained here, with ids 0, 1, 2, 3 in this order."""
PAD_ID, EOS_ID, BOS_ID, MASK_ID = range(4)
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_MAX_SHOWN_ERRORS = 20


# -- reading ----------------------------------------------------------------------------------
@dataclass
class ReadStats:
    """Counters a reader updates as it goes; pass one in to see what was read and skipped."""

    files: int = 0
    documents: int = 0
    bytes: int = 0
    empty: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def bad(self, message: str, on_error: str) -> None:
        if on_error == "raise":
            raise DGemmaError(f"{message} (pass on_error='skip' / --on-error skip to skip such records)")
        self.skipped += 1
        if len(self.errors) < _MAX_SHOWN_ERRORS:
            self.errors.append(message)


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise DGemmaError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DGemmaError(f"{path}: unknown extension {path.suffix or '(none)'!r}; expected one of "
                          f"{', '.join(FORMATS)}")
    return fmt


def _files_under(folder: Path) -> list[Path]:
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not found:
        raise DGemmaError(f"no {', '.join(FORMATS)} files under {folder}")
    return found


def resolve_inputs(inputs: str | Path | Sequence[str | Path]) -> list[Path]:
    """Files named by paths, folders (searched recursively, hidden files skipped) and globs.

    A named file or glob match with an unknown extension is an error (it is probably a mistake);
    a folder contributes only its ``.txt``/``.jsonl``/``.parquet`` files. Order is kept, sorted
    within a folder or glob, and duplicates are dropped.
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        text = os.path.expanduser(str(item))
        if any(c in text for c in "*?["):
            matches = sorted(_glob.glob(text, recursive=True))
            if not matches:
                raise DGemmaError(f"no files match {text!r}")
        elif not os.path.exists(text):
            raise DGemmaError(f"no such file or folder: {text}")
        else:
            matches = [text]
        for m in map(Path, matches):
            if m.is_dir():
                files.extend(_files_under(m))
            else:
                _format(m)
                files.append(m)
    if not files:
        raise DGemmaError("no input files given")
    return list(dict.fromkeys(files))


def read_txt(path: str | Path, *, stats: ReadStats | None = None,
             max_doc_chars: int = 1_000_000) -> Iterator[str]:
    """Documents of a text file: blocks of lines separated by blank (whitespace-only) lines.

    Lines keep their newlines inside a document; the trailing newline is dropped. Invalid UTF-8
    is replaced (U+FFFD) rather than failing a multi-GB file on one bad byte.
    """
    stats = stats if stats is not None else ReadStats()
    lines: list[str] = []
    size = 0
    with open(path, "rb") as f:
        for raw in f:
            stats.bytes += len(raw)
            if not raw.strip():
                if lines:
                    stats.documents += 1
                    yield "".join(lines).rstrip("\r\n")
                    lines, size = [], 0
                continue
            line = raw.decode("utf-8", errors="replace")
            if size and size + len(line) > max_doc_chars:
                stats.documents += 1
                yield "".join(lines).rstrip("\r\n")
                lines, size = [], 0
            lines.append(line)
            size += len(line)
    if lines:
        stats.documents += 1
        yield "".join(lines).rstrip("\r\n")


def read_jsonl(path: str | Path, *, text_field: str = "text", on_error: str = "raise",
               stats: ReadStats | None = None) -> Iterator[str]:
    """The ``text_field`` string of each JSON line. A broken line (bad JSON, not an object, field
    missing or not a string) raises naming ``file:line``, or with ``on_error="skip"`` is counted
    in ``stats.skipped`` (the first few messages in ``stats.errors``). Empty texts are skipped.
    """
    _check_on_error(on_error)
    stats = stats if stats is not None else ReadStats()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            stats.bytes += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                stats.bad(f"{path}:{n}: invalid JSON ({getattr(e, 'msg', e)})", on_error)
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                what = "not a JSON object" if not isinstance(record, dict) else f"no string field {text_field!r}"
                stats.bad(f"{path}:{n}: {what}", on_error)
                continue
            if not text.strip():
                stats.empty += 1
                continue
            stats.documents += 1
            yield text


def read_parquet(path: str | Path, *, text_field: str = "text", on_error: str = "raise",
                 stats: ReadStats | None = None, batch_rows: int = 1024) -> Iterator[str]:
    """The string column ``text_field``, read one record batch at a time (within row groups).

    A missing or non-string column is always an error; a null value is a broken record
    (``file:row N``) handled per ``on_error``. Byte progress is the file size spread over rows.
    """
    _check_on_error(on_error)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DGemmaError("reading Parquet needs pyarrow: pip install pyarrow") from None
    stats = stats if stats is not None else ReadStats()
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise DGemmaError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DGemmaError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise DGemmaError(f"{path}: column {text_field!r} has type {kind}, expected a string")
    total_rows, size = max(pf.metadata.num_rows, 1), os.path.getsize(path)
    row, counted = 0, 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                stats.bad(f"{path}:row {row}: null {text_field!r}", on_error)
            elif not text.strip():
                stats.empty += 1
            else:
                stats.documents += 1
                yield text
        done = size * row // total_rows
        stats.bytes += done - counted
        counted = done
    stats.bytes += size - counted


def iter_documents(inputs: str | Path | Sequence[str | Path], *, text_field: str = "text",
                   on_error: str = "raise", stats: ReadStats | None = None,
                   max_doc_chars: int = 1_000_000) -> Iterator[str]:
    """Every document of every input file, in order (see :func:`resolve_inputs`)."""
    _check_on_error(on_error)
    files = resolve_inputs(inputs)
    stats = stats if stats is not None else ReadStats()
    for path in files:
        stats.files += 1
        fmt = _format(path)
        if fmt == "txt":
            yield from read_txt(path, stats=stats, max_doc_chars=max_doc_chars)
        elif fmt == "jsonl":
            yield from read_jsonl(path, text_field=text_field, on_error=on_error, stats=stats)
        else:
            yield from read_parquet(path, text_field=text_field, on_error=on_error, stats=stats)


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
    _check_on_error(on_error)
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


# -- loading ----------------------------------------------------------------------------------
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
