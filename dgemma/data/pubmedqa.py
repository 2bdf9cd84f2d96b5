"""PubMedQA (labelled set PQA-L): load the official files, split, and build chat records (docs/design.md §5).

``ori_pqal.json`` maps PubMed ids to items with QUESTION, CONTEXTS, LONG_ANSWER and
final_decision; ``test_ground_truth.json`` maps the 500 test ids to their decisions.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from dgemma.errors import DGemmaError

ITEMS_FILE = "ori_pqal.json"
TEST_FILE = "test_ground_truth.json"
LABELS = ("yes", "no", "maybe")
CONTEXT_CHARS = 4000
TRAIN_EVAL_SIZE = 50
SYSTEM_PROMPT = (
    "You are a biomedical research assistant. Read the context from a PubMed abstract and answer "
    "the question. Explain your reasoning in a few sentences based on the context, then end with "
    '"The answer is: " followed by exactly one of yes, no or maybe.'
)
REQUIRED_FIELDS = {"QUESTION": str, "CONTEXTS": list, "LONG_ANSWER": str, "final_decision": str}


def _load_json(path: Path):
    """Parse a JSON file, turning a missing file or a syntax error into one DGemmaError line."""
    if not path.is_file():
        raise DGemmaError(f"PubMedQA file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DGemmaError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} (char {e.pos})"
        ) from None
    except UnicodeDecodeError as e:
        raise DGemmaError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _check_item(pmid: str, item, path: Path) -> None:
    """Require the fields the prompt and target use, with their types: a wrong or missing field
    would otherwise surface later as a garbled prompt or a KeyError without the item's id."""
    if not isinstance(item, dict):
        raise DGemmaError(f"{path}: item {pmid} is a {type(item).__name__}, expected an object")
    for field, kind in REQUIRED_FIELDS.items():
        if field not in item:
            raise DGemmaError(f"{path}: item {pmid} has no field {field!r}")
        if not isinstance(item[field], kind):
            raise DGemmaError(
                f"{path}: item {pmid}: field {field!r} should be a {kind.__name__}, got {type(item[field]).__name__}"
            )
    if not all(isinstance(c, str) for c in item["CONTEXTS"]):
        raise DGemmaError(f"{path}: item {pmid}: field 'CONTEXTS' should be a list of strings")
    if item["final_decision"] not in LABELS:
        raise DGemmaError(
            f"{path}: item {pmid}: final_decision must be yes, no or maybe, got {item['final_decision']!r}"
        )


def load(source_dir) -> tuple[dict[str, dict], dict[str, str]]:
    """Load and validate ``(items, test_labels)`` from a folder holding the two official files.

    Every test id must exist in ``ori_pqal.json`` with the same decision: the split is defined
    by the ground-truth file, and a silent mismatch would move items between train and test.
    """
    src = Path(source_dir)
    if not src.is_dir():
        raise DGemmaError(f"PubMedQA source directory not found: {src} (expected {ITEMS_FILE} and {TEST_FILE})")
    items_path, test_path = src / ITEMS_FILE, src / TEST_FILE
    items = _load_json(items_path)
    test = _load_json(test_path)
    if not isinstance(items, dict):
        raise DGemmaError(
            f"{items_path}: expected an object mapping PubMed ids to items, got {type(items).__name__}"
        )
    if not isinstance(test, dict):
        raise DGemmaError(
            f"{test_path}: expected an object mapping PubMed ids to yes/no/maybe, got {type(test).__name__}"
        )
    for pmid, item in items.items():
        _check_item(pmid, item, items_path)
    missing = [pmid for pmid in test if pmid not in items]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise DGemmaError(f"{test_path}: {len(missing)} test ids are not in {ITEMS_FILE}: {shown}")
    for pmid, label in test.items():
        if label != items[pmid]["final_decision"]:
            found = items[pmid]["final_decision"]
            raise DGemmaError(f"{test_path}: test id {pmid} is labelled {label!r} but {ITEMS_FILE} says {found!r}")
    return items, test


def split_ids(items: dict, test_ids) -> dict[str, list[str]]:
    """docs/design.md §5 split: ground-truth ids are ``test``; of the rest, in file order, the first 50
    are ``train_eval`` and the others ``train``."""
    test_ids = set(test_ids)
    rest = [pmid for pmid in items if pmid not in test_ids]
    return {
        "train": rest[TRAIN_EVAL_SIZE:],
        "train_eval": rest[:TRAIN_EVAL_SIZE],
        "test": [pmid for pmid in items if pmid in test_ids],
    }


def format_prompt(contexts: list[str], question: str) -> str:
    """``Context:\\n{contexts joined by newlines, first 4,000 characters}\\n\\nQuestion: {question}``."""
    return f"Context:\n{chr(10).join(contexts)[:CONTEXT_CHARS]}\n\nQuestion: {question}"


def format_target(long_answer: str, decision: str) -> str:
    """``LONG_ANSWER + " The answer is: {decision}"``, the tail the metric's regex reads back."""
    if decision not in LABELS:
        raise DGemmaError(f"PubMedQA decision must be yes, no or maybe, got {decision!r}")
    return f"{long_answer} The answer is: {decision}"


def make_record(pmid: str, item: dict) -> dict:
    """The JSONL record of one item: ``{id, system, prompt, response, label, long_answer}``."""
    return {
        "id": pmid,
        "system": SYSTEM_PROMPT,
        "prompt": format_prompt(item["CONTEXTS"], item["QUESTION"]),
        "response": format_target(item["LONG_ANSWER"], item["final_decision"]),
        "label": item["final_decision"],
        "long_answer": item["LONG_ANSWER"],
    }


def write_splits(source_dir, out_dir) -> dict:
    """Write ``train.jsonl``, ``train_eval.jsonl``, ``test.jsonl`` and ``meta.json``; return the meta."""
    items, test = load(source_dir)
    splits = split_ids(items, test)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label_counts = {}
    for name, ids in splits.items():
        records = [make_record(pmid, items[pmid]) for pmid in ids]
        tmp = out / f"{name}.jsonl.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        tmp.replace(out / f"{name}.jsonl")
        c = Counter(r["label"] for r in records)
        label_counts[name] = {k: c[k] for k in LABELS}
    meta = {
        "task": "pubmedqa",
        "source": str(Path(source_dir).resolve()),
        "counts": {name: len(ids) for name, ids in splits.items()},
        "label_counts": label_counts,
        "context_chars": CONTEXT_CHARS,
        "truncated_contexts": sum(len("\n".join(it["CONTEXTS"])) > CONTEXT_CHARS for it in items.values()),
        "system": SYSTEM_PROMPT,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta
