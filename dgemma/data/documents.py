"""Documents of a pretraining corpus, read lazily from ``.txt``, ``.jsonl`` and ``.parquet`` files.

Inputs are paths, folders or globs (:func:`resolve_inputs`). Nothing holds more than one document
(txt, jsonl) or one record batch (parquet) at a time, so memory does not grow with the corpus. A
``.txt`` file holds one document per block of lines separated by blank lines (a whole-file
document would make a multi-GB file one string); a block longer than ``max_doc_chars`` is cut at
a line boundary into several documents. Broken records fail the run or, with ``on_error="skip"``,
are counted in :class:`ReadStats`. Step 1 of ``dgemma prepare corpus`` (:mod:`dgemma.data.corpus`).
"""

from __future__ import annotations

import glob as _glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dgemma.errors import DGemmaError

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
_MAX_SHOWN_ERRORS = 20


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


def check_on_error(on_error: str) -> None:
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
    check_on_error(on_error)
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
    check_on_error(on_error)
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
    check_on_error(on_error)
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
