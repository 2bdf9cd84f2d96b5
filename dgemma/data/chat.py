"""Chat and completion data: validated readers and conversion to SFT records (the ``chat`` and
``completion`` tasks).

Sources
    * chat JSONL, one conversation a line: ``{"messages": [{"role": ..., "content": ...}, ...]}``
      (other keys on the line are kept, e.g. an ``id``);
    * a Hugging Face dataset (name or local path, and a split) with a ``messages`` column, read
      with ``datasets`` when that optional package is installed;
    * completion JSONL: ``{"prompt": ..., "completion": ...}``.

Validation
    Every row is checked before anything is tokenised, and every problem is reported as
    ``"{file}:{line}: {what}"`` (``"{name}[{split}] row {i}: {what}"`` for a Hugging Face
    dataset, ``i`` counting from 0 as ``dataset[i]`` does). With ``on_error="fail"`` the first
    problem is raised as :class:`~dgemma.errors.DGemmaError`, with the number of further
    problems in the same source; with ``on_error="skip"`` bad rows are left out and the problems
    are *returned*, so the caller prints and logs how many rows were skipped (see
    :func:`skipped_summary`); the readers also log a warning with the count. Nothing is dropped
    silently. Blank lines are not rows and are passed over.

    A conversation is valid when: it is a JSON object with a ``messages`` list; each message is
    an object with ``role`` in ``system``/``user``/``assistant`` and string ``content``; a
    ``system`` message, if any, comes first; the other roles alternate starting with ``user``
    (Gemma's template, :meth:`~dgemma.data.tokenizers.Tokenizer.render_chat`, refuses anything
    else, and it is better to learn that here, with a file and line, than mid-tokenisation);
    there is at least one user turn; it ends with an assistant turn; and no assistant turn is
    empty or whitespace-only (an empty supervised turn would teach the model to say nothing,
    and an empty one in the history is almost always a broken export).

Records
    :func:`chat_to_records` turns a conversation into SFT records for
    :func:`dgemma.data.sft.encode_example`: ``prompt_text`` is the conversation *up to* the
    supervised assistant turn, already rendered by the tokenizer's chat template with the
    opening of the model's turn (``render_chat(history, add_generation_prompt=True)``), and
    ``response`` is that assistant turn's content, stripped as the template strips it. By default
    only the final assistant turn is supervised (the history is context and carries no loss);
    ``supervise="all"`` makes one record per assistant turn, each with its own history. The
    records also carry ``prompt`` (the last user turn, for display and logs) and ``system``
    when the conversation has one. A completion row becomes ``prompt_text`` = the raw prompt
    (no chat markup) and ``response`` = the completion.

    Each chat record also keeps ``history`` (the messages before the supervised turn), so a
    record made without a tokenizer (``tokenizer=None``, e.g. when an eval task loads its
    records before the model's tokenizer is known) carries no ``prompt_text`` and is rendered
    when encoded. :func:`render_prompt` is the one rule for a record's prompt string:
    ``prompt_text`` as is, else ``history`` through ``render_chat``, else the single user turn
    ``prompt`` (with ``system``) through ``chat_prompt``. ``encode_prompt`` in
    ``dgemma/data/sft.py`` is to use it (see :func:`encode_prompt_text`); until it does, a chat
    record is encoded from its last user turn alone.

This module imports neither torch nor ``datasets`` at import time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from dgemma.errors import DGemmaError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
ON_ERROR = ("fail", "skip")
SUPERVISE = ("last", "all")
JSONL_SUFFIXES = (".jsonl", ".json")


# -- validation -------------------------------------------------------------------------------------
def conversation_problem(row) -> str | None:
    """What is wrong with one chat row (a parsed JSON value), or None when it is valid.

    The rules are listed in the module docstring. Messages are counted from 0 in the messages
    (``message 2``), as they are indexed in the JSON list.
    """
    if not isinstance(row, dict):
        return f"expected a JSON object with a 'messages' list, got {_kind(row)}"
    messages = row.get("messages")
    if messages is None:
        return "no 'messages' field"
    if not isinstance(messages, list):
        return f"'messages' must be a list of messages, got {_kind(messages)}"
    if not messages:
        return "'messages' is empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} must be an object with 'role' and 'content', got {_kind(m)}"
        if "role" not in m:
            return f"message {i} has no 'role'"
        role = m["role"]
        if role not in ROLES:
            return f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}"
        if "content" not in m:
            return f"message {i} ({role}) has no 'content'"
        if not isinstance(m["content"], str):
            return f"message {i} ({role}) content must be a string, got {_kind(m['content'])}"
    start = 1 if messages[0]["role"] == "system" else 0
    for i, m in enumerate(messages[start:], start):
        if m["role"] == "system":
            return f"message {i} is a system message; only the first message may be one"
    if not any(m["role"] == "user" for m in messages):
        return "no user turn"
    for i, m in enumerate(messages[start:], start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if m["role"] != expected:
            return (f"message {i} is {m['role']!r} where {expected!r} was expected; turns must alternate "
                    "user/assistant (after one optional system message)")
    if messages[-1]["role"] != "assistant":
        return f"the conversation ends with a {messages[-1]['role']!r} turn, not an assistant turn"
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            return f"message {i} is an empty assistant turn"
    return None


def completion_problem(row) -> str | None:
    """What is wrong with one completion row, or None: ``prompt`` must be a string (it may be
    empty: unconditional generation) and ``completion`` a non-empty, non-blank string."""
    if not isinstance(row, dict):
        return f"expected a JSON object with 'prompt' and 'completion', got {_kind(row)}"
    for key in ("prompt", "completion"):
        if key not in row:
            return f"no {key!r} field"
        if not isinstance(row[key], str):
            return f"{key!r} must be a string, got {_kind(row[key])}"
    if not row["completion"].strip():
        return "empty completion"
    return None


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise DGemmaError(f"on_error must be 'fail' or 'skip', got {on_error!r}")


def _finish(records: list[dict], problems: list[str], on_error: str, source: str) -> tuple[list[dict], list[str]]:
    """Raise on the first problem (``fail``) or log the skip count (``skip``)."""
    if problems and on_error == "fail":
        more = len(problems) - 1
        tail = f" (and {more} more bad row{'s' if more != 1 else ''} in {source})" if more else ""
        raise DGemmaError(f"{problems[0]}{tail}; fix the data or set data.on_error='skip' to skip bad rows")
    if problems:
        log.warning(skipped_summary(problems, kept=len(records), source=source))
    return records, problems


def _read_rows(path: str | Path, check, on_error: str) -> tuple[list[dict], list[str]]:
    """Parse and check a JSONL file line by line; each kept row gets ``source`` = ``"file:line"``."""
    _check_on_error(on_error)
    path = Path(path)
    if not path.is_file():
        raise DGemmaError(f"data file not found: {path}")
    records, problems = [], []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(f"{path}:{n}: not UTF-8 text (byte {e.start} of the line)")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})")
                continue
            if (what := check(row)) is not None:
                problems.append(f"{path}:{n}: {what}")
                continue
            records.append({**row, "source": f"{path}:{n}"})
    return _finish(records, problems, on_error, str(path))


def read_chat_jsonl(path: str | Path, *, on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """Read chat JSONL; returns ``(conversations, problems)``.

    Each conversation is the line's object plus ``source`` = ``"file:line"``. See the module
    docstring for the checks and for ``on_error``.
    """
    return _read_rows(path, conversation_problem, on_error)


def read_completion_jsonl(path: str | Path, *, on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """Read ``{"prompt", "completion"}`` JSONL; returns ``(rows, problems)`` as :func:`read_chat_jsonl`."""
    return _read_rows(path, completion_problem, on_error)


def load_hf_chat(name_or_path: str, split: str = "train", *, on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """Read a Hugging Face dataset with a ``messages`` column; returns ``(conversations, problems)``.

    Uses ``datasets.load_dataset(name_or_path, split=split)`` (or ``load_from_disk`` for a folder
    written by ``save_to_disk``). ``datasets`` is optional: without it, or when loading fails (no
    network, unknown name or split), the error is one line saying what to do. Rows are checked
    as JSONL lines are; a problem reads ``"{name}[{split}] row {i}: {what}"``.
    """
    _check_on_error(on_error)
    try:
        import datasets
    except ImportError:
        raise DGemmaError(
            f"{name_or_path!r} is not a JSONL file, so it would be read as a Hugging Face dataset, which "
            "needs the optional 'datasets' package: pip install datasets (or convert the data to chat JSONL)"
        ) from None
    source = f"{name_or_path}[{split}]"
    try:
        folder = Path(name_or_path).expanduser()
        if folder.is_dir() and ((folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(folder))
            if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):  # a DatasetDict
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name_or_path, split=split)
    except Exception as e:  # network, hub, missing split, bad files: all arrive as assorted types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DGemmaError(
            f"cannot load Hugging Face dataset {source}: {type(e).__name__}{': ' + first if first else ''} "
            "(check the name and split, and network access or HF_HUB_OFFLINE with a local cache; "
            "or give a chat JSONL file)"
        ) from None
    records, problems = [], []
    for i, row in enumerate(ds):
        if (what := conversation_problem(row)) is not None:
            problems.append(f"{source} row {i}: {what}")
            continue
        records.append({**row, "source": f"{source} row {i}"})
    return _finish(records, problems, on_error, source)


def is_jsonl_source(source: str | Path) -> bool:
    """True when ``source`` names a local JSONL file (it exists as a file, or ends in ``.jsonl``
    or ``.json``); anything else is taken for a Hugging Face dataset name or folder, so a
    mistyped file name is reported as a missing file, not as an unknown dataset."""
    p = Path(source).expanduser()
    return p.is_file() or p.suffix.lower() in JSONL_SUFFIXES


def read_chat(source: str | Path, *, split: str = "train", on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """Conversations from a chat JSONL file or a Hugging Face dataset (see :func:`is_jsonl_source`)."""
    if is_jsonl_source(source):
        return read_chat_jsonl(source, on_error=on_error)
    return load_hf_chat(str(source), split, on_error=on_error)


# -- records ----------------------------------------------------------------------------------------
def chat_to_records(conversation, tokenizer=None, *, supervise: str = "last") -> list[dict]:
    """SFT records for one conversation: one for its final assistant turn (``supervise="last"``)
    or one per assistant turn (``"all"``), in conversation order.

    ``conversation`` is a row with ``messages`` (as :func:`read_chat_jsonl` returns) or the
    messages list itself. Each record has ``history`` (the ``{"role", "content"}`` messages
    before the supervised turn), ``prompt_text`` when a ``tokenizer`` is given (the history
    rendered by ``tokenizer.render_chat(history, add_generation_prompt=True)``, no BOS: the
    encoder adds it), ``response`` (the turn's content stripped, exactly as the template writes a
    model turn), ``prompt`` (the last user turn's content), ``turn`` (which assistant turn,
    from 0), ``system`` when there is one, and ``id``/``source`` copied from the row when present.
    An invalid conversation raises :class:`~dgemma.errors.DGemmaError` (validate with the
    readers first to get file and line).
    """
    if supervise not in SUPERVISE:
        raise DGemmaError(f"supervise must be 'last' or 'all', got {supervise!r}")
    row = {"messages": conversation} if isinstance(conversation, list) else conversation
    if (what := conversation_problem(row)) is not None:
        where = row.get("source") if isinstance(row, dict) else None
        raise DGemmaError(f"{where}: {what}" if where else f"invalid conversation: {what}")
    if tokenizer is not None:
        _need_template(tokenizer)
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    chosen = turns if supervise == "all" else turns[-1:]
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    extra = {k: row[k] for k in ("id", "source") if k in row}
    records = []
    for i in chosen:
        history = messages[:i]
        record = {**extra}
        if tokenizer is not None:
            record["prompt_text"] = tokenizer.render_chat(history, add_generation_prompt=True)
        record.update(history=history, prompt=history[-1]["content"], response=messages[i]["content"].strip(),
                      turn=turns.index(i))
        if system is not None:
            record["system"] = system
        records.append(record)
    return records


def _need_template(tokenizer) -> None:
    if not hasattr(tokenizer, "render_chat"):
        raise DGemmaError(f"chat data needs a tokenizer with a chat template (render_chat); "
                          f"{type(tokenizer).__name__} has none")


def chats_to_records(conversations: Iterable, tokenizer=None, *, supervise: str = "last") -> list[dict]:
    """:func:`chat_to_records` over many conversations, concatenated."""
    return [r for c in conversations for r in chat_to_records(c, tokenizer, supervise=supervise)]


def completion_to_record(row: dict) -> dict:
    """An SFT record for a completion row: the raw prompt (no chat markup) and the completion.

    ``prompt_text`` is encoded as is (after BOS); the prompt and the completion are tokenised
    separately, so a completion that continues a word mid-way is split at the join the way the
    model will see it at inference time.
    """
    if (what := completion_problem(row)) is not None:
        where = row.get("source") if isinstance(row, dict) else None
        raise DGemmaError(f"{where}: {what}" if where else f"invalid completion row: {what}")
    record = {k: row[k] for k in ("id", "source") if k in row}
    record.update(prompt_text=row["prompt"], prompt=row["prompt"], response=row["completion"])
    return record


def load_chat_records(source: str | Path, tokenizer=None, *, split: str = "train", supervise: str = "last",
                      on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """SFT records from chat JSONL or a Hugging Face dataset: ``(records, problems)``."""
    conversations, problems = read_chat(source, split=split, on_error=on_error)
    return chats_to_records(conversations, tokenizer, supervise=supervise), problems


def load_completion_records(path: str | Path, *, on_error: str = "fail") -> tuple[list[dict], list[str]]:
    """SFT records from completion JSONL: ``(records, problems)``."""
    rows, problems = read_completion_jsonl(path, on_error=on_error)
    return [completion_to_record(r) for r in rows], problems


# -- prompts ----------------------------------------------------------------------------------------
def left_truncate(ids: Sequence[int], prompt_len: int, keep_first: bool = True) -> tuple[list[int], bool]:
    """Cut ``ids`` to at most ``prompt_len`` tokens from the left; returns ``(ids, truncated)``.

    The end of a prompt (the latest turn and the opening of the model's turn) matters most, so
    the oldest tokens go. ``keep_first`` keeps ``ids[0]`` (BOS) in front of the kept tail.

    >>> left_truncate([2, 10, 11, 12, 13], 3)
    ([2, 12, 13], True)
    >>> left_truncate([2, 10, 11, 12, 13], 3, keep_first=False)
    ([11, 12, 13], True)
    >>> left_truncate([2, 10], 3)
    ([2, 10], False)
    """
    if prompt_len < 1:
        raise DGemmaError(f"prompt_len must be >= 1, got {prompt_len}")
    ids = list(ids)
    if len(ids) <= prompt_len:
        return ids, False
    if keep_first:
        return [ids[0]] + ids[len(ids) - prompt_len + 1:], True
    return ids[len(ids) - prompt_len:], True


def render_prompt(tokenizer, record: dict) -> str:
    """A record's prompt string, before tokenisation (no BOS).

    ``prompt_text`` when present (chat records made with a tokenizer, completion rows: raw
    text); else ``history`` rendered with ``tokenizer.render_chat(..., add_generation_prompt=True)``;
    else the one user turn ``prompt`` (and ``system``) through ``tokenizer.chat_prompt``, which is
    what every other task's records use.
    """
    if record.get("prompt_text") is not None:
        return record["prompt_text"]
    if record.get("history") is not None:
        _need_template(tokenizer)
        return tokenizer.render_chat(record["history"], add_generation_prompt=True)
    if not isinstance(record.get("prompt"), str):
        raise DGemmaError(f"record {record.get('id', '?')!r} has no prompt_text, history or string prompt")
    return tokenizer.chat_prompt(record["prompt"], system=record.get("system"))


def encode_prompt_text(tokenizer, text: str, prompt_len: int) -> tuple[list[int], bool]:
    """Tokenise a rendered prompt with BOS and :func:`left_truncate` it, keeping BOS:
    ``encode_prompt_text(tok, render_prompt(tok, record), prompt_len)`` is ``encode_prompt``."""
    return left_truncate(tokenizer.encode(text, add_bos=True), prompt_len, keep_first=True)


def truncation_summary(truncated: Iterable[bool], *, prompt_len: int) -> tuple[int, str]:
    """Count truncated prompts; returns ``(count, one-line message)`` for the caller to print and log.

    >>> truncation_summary([True, False, False, False], prompt_len=256)
    (1, '1 of 4 prompts (25.0%) were longer than prompt_len=256 and were truncated from the left')
    """
    flags = [bool(t) for t in truncated]
    count, total = sum(flags), len(flags)
    if not count:
        return 0, f"no prompt of {total} was longer than prompt_len={prompt_len}"
    return count, (f"{count} of {total} prompts ({100 * count / total:.1f}%) were longer than "
                   f"prompt_len={prompt_len} and were truncated from the left")


def skipped_summary(problems: Sequence[str], *, kept: int, source: str) -> str:
    """One line for the log and the console: how many rows were skipped and the first problem."""
    if not problems:
        return f"{source}: {kept} rows, none skipped"
    n = len(problems)
    return (f"{source}: skipped {n} bad row{'s' if n != 1 else ''} of {n + kept} "
            f"(on_error='skip'); first: {problems[0]}")
