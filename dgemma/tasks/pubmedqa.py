"""PubMedQA (labelled set PQA-L): the official files, the split, the prompt, the decision and its metrics.

``ori_pqal.json`` maps PubMed ids to items with QUESTION, CONTEXTS, LONG_ANSWER and
final_decision; ``test_ground_truth.json`` maps the 500 test ids to their decisions. Ids in the
ground-truth file are the ``test`` split; of the other 500, in file order, the first 50 are
``train_eval`` and 450 are ``train``. The prompt is ``Context:\n{contexts}\n\nQuestion: {question}``
(contexts capped at 4,000 characters) under :data:`SYSTEM_PROMPT`; the target is ``LONG_ANSWER``
then `` The answer is: {yes|no|maybe}`` (``--verdict last``, the default), or the verdict first:
``The answer is: {decision}. LONG_ANSWER`` under :data:`SYSTEM_PROMPT_FIRST` (``--verdict first``;
each record says which in its ``verdict`` field). Scoring reads the decision back with one regex
(:func:`extract_decision`, no fallback) and the explanation's BLEU against LONG_ANSWER.
Majority class on the test split: yes, 276 of 500 (55.2%). Pure Python at import (sacrebleu is
imported where BLEU is computed).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from dgemma.errors import DGemmaError
from dgemma.tasks.base import Task

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
SYSTEM_PROMPT_FIRST = (
    "You are a biomedical research assistant. Read the context from a PubMed abstract and answer "
    'the question. Begin with "The answer is: " followed by exactly one of yes, no or maybe, then '
    "explain your reasoning in a few sentences based on the context."
)
VERDICTS = ("last", "first")
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


def _check_verdict(verdict: str) -> None:
    if verdict not in VERDICTS:
        raise DGemmaError(f"PubMedQA verdict position must be 'last' or 'first', got {verdict!r}")


def format_target(long_answer: str, decision: str, verdict: str = "last") -> str:
    """``LONG_ANSWER + " The answer is: {decision}"`` (``verdict="last"``), or
    ``"The answer is: {decision}. " + LONG_ANSWER`` (``"first"``): the sentence the metric's regex
    reads back.

    Verdict first puts the one token the metric reads in a response's first canvas, where a
    block-diffusion decoder writes it from the question and context alone; verdict last makes it
    follow 30-60 tokens of the model's own parallel text, which it was trained to trust as the
    reference explanation.
    """
    if decision not in LABELS:
        raise DGemmaError(f"PubMedQA decision must be yes, no or maybe, got {decision!r}")
    _check_verdict(verdict)
    return f"The answer is: {decision}. {long_answer}" if verdict == "first" else f"{long_answer} The answer is: {decision}"


def make_record(pmid: str, item: dict, verdict: str = "last") -> dict:
    """The JSONL record of one item: ``{id, system, prompt, response, label, long_answer, verdict}``."""
    return {
        "id": pmid,
        "system": SYSTEM_PROMPT_FIRST if verdict == "first" else SYSTEM_PROMPT,
        "prompt": format_prompt(item["CONTEXTS"], item["QUESTION"]),
        "response": format_target(item["LONG_ANSWER"], item["final_decision"], verdict),
        "label": item["final_decision"],
        "long_answer": item["LONG_ANSWER"],
        "verdict": verdict,
    }


def write_splits(source_dir, out_dir, verdict: str = "last") -> dict:
    """Write ``train.jsonl``, ``train_eval.jsonl``, ``test.jsonl`` and ``meta.json``; return the meta."""
    _check_verdict(verdict)
    items, test = load(source_dir)
    splits = split_ids(items, test)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label_counts = {}
    for name, ids in splits.items():
        records = [make_record(pmid, items[pmid], verdict) for pmid in ids]
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
        "system": SYSTEM_PROMPT_FIRST if verdict == "first" else SYSTEM_PROMPT,
        "verdict": verdict,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


# ------------------------------------------------------------------------------------ metrics
DECISION_RE = re.compile(r"the answer is[:\s]+\b(yes|no|maybe)\b")


def extract_decision(text: str) -> str | None:
    """The decision after the first "the answer is" (any case), or None.

    Deliberately no fallback: searching the text for a bare yes/no/maybe would read
    "yesterday" as yes, "not" never, "notably" as no, and turn an unanswered output into a
    lucky guess. The word boundaries in the regex enforce the same thing after the marker.
    """
    if not isinstance(text, str):
        return None
    m = DECISION_RE.search(text.lower())
    return m.group(1) if m else None


VERDICT_SENTENCE_RE = re.compile(r"the answer is[:\s]*(?:\b(?:yes|no|maybe)\b)?\.?", re.IGNORECASE)


def _bleu_hypothesis(text: str, verdict: str = "last") -> str:
    """The explanation part of an output: the text before "the answer is" (verdict last), or
    after the verdict sentence "The answer is: X." (verdict first). The target adds that sentence
    to LONG_ANSWER, so leaving it in would cap a perfect output below 100."""
    m = VERDICT_SENTENCE_RE.search(text)
    if not m:
        return text.strip()
    return (text[m.end():] if verdict == "first" else text[: m.start()]).strip()


def _f1(tp: int, n_pred: int, n_label: int) -> float:
    return 2 * tp / (n_pred + n_label) if n_pred + n_label else 0.0


def pubmedqa_metrics(texts, labels, long_answers, verdicts=None) -> dict:
    """PubMedQA metrics over a batch.

    Keys: ``accuracy`` (unparsed outputs count as wrong), ``macro_f1``, ``f1_{yes,no,maybe}``,
    ``bleu`` (mean sacrebleu sentence BLEU, smooth 'floor', effective order, of the explanation
    before "the answer is", or after the verdict sentence where ``verdicts[k] == "first"``, against
    LONG_ANSWER), ``label_{c}`` and ``pred_{c}`` counts,
    ``unparsed`` and ``count``.

    ``macro_f1`` averages F1 over the classes that occur among the labels or the predictions. A
    class with neither has an undefined F1 (0/0): counting it as 0 would punish a perfect model
    on a batch without, say, maybes, and counting it as 1 would reward nothing; so it is left out
    of the average and its ``f1_{c}`` is reported as 0.0 next to ``label_{c}`` = ``pred_{c}`` = 0.
    Unparsed outputs predict no class: they lower the recall of their true class only.
    """
    texts, labels, long_answers = list(texts), list(labels), list(long_answers)
    if not len(texts) == len(labels) == len(long_answers):
        raise DGemmaError(
            f"pubmedqa_metrics: got {len(texts)} texts, {len(labels)} labels and {len(long_answers)} long answers; "
            "they must be the same length"
        )
    for k, label in enumerate(labels):
        if label not in LABELS:
            raise DGemmaError(f"pubmedqa_metrics: label {k} must be yes, no or maybe, got {label!r}")
    preds = [extract_decision(t) for t in texts]
    n = len(labels)
    out: dict = {"count": n, "accuracy": sum(p == y for p, y in zip(preds, labels)) / n if n else 0.0}
    present = []
    for c in LABELS:
        n_label = sum(y == c for y in labels)
        n_pred = sum(p == c for p in preds)
        tp = sum(p == c and y == c for p, y in zip(preds, labels))
        out[f"f1_{c}"] = _f1(tp, n_pred, n_label)
        out[f"label_{c}"] = n_label
        out[f"pred_{c}"] = n_pred
        if n_label or n_pred:
            present.append(out[f"f1_{c}"])
    out["macro_f1"] = sum(present) / len(present) if present else 0.0
    out["unparsed"] = sum(p is None for p in preds)
    verdicts = ["last"] * n if verdicts is None else list(verdicts)
    if len(verdicts) != n:
        raise DGemmaError(f"pubmedqa_metrics: got {len(verdicts)} verdict positions for {n} texts")
    for v in verdicts:
        _check_verdict(v)
    out["bleu"] = _mean_bleu(texts, long_answers, verdicts)
    return out


def _mean_bleu(texts: list[str], refs: list[str], verdicts: list[str]) -> float:
    if not texts:
        return 0.0
    from sacrebleu.metrics import BLEU

    bleu = BLEU(smooth_method="floor", effective_order=True)
    total = 0.0
    for t, r, v in zip(texts, refs, verdicts):
        total += bleu.sentence_score(_bleu_hypothesis(t if isinstance(t, str) else "", v), [r]).score
    return total / len(texts)


# ------------------------------------------------------------------------------------ the task
class PubMedQATask(Task):
    """Eval splits ``test`` (the 500 official test items) and ``train_eval`` (50 held-out
    non-test items), read from ``<data.path>/<split>.jsonl``."""

    name = "pubmedqa"
    splits = ("test", "train_eval")
    primary = ("accuracy", "macro_f1", "bleu")
    fields = ("label", "long_answer")
    prepare_help = "write PubMedQA train/train_eval/test JSONL from the official files"

    def add_prepare_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--source", required=True, help="folder with ori_pqal.json and test_ground_truth.json")
        parser.add_argument("--out", required=True, help="output folder")
        parser.add_argument("--verdict", choices=VERDICTS, default="last",
                            help='where the target puts "The answer is: X": after the explanation (default) or first')

    def prepare(self, args: argparse.Namespace) -> str:
        c = write_splits(args.source, args.out, args.verdict)["counts"]
        return (f"pubmedqa: {c['train']} train, {c['train_eval']} train_eval, {c['test']} test, "
                f"verdict {args.verdict} -> {args.out}")

    def key_tokens(self, cfg, tokenizer):
        """The verdict: the tokens of ``" yes"`` / ``" no"`` / ``" maybe"`` in "The answer is: X"
        (the first occurrence for a verdict-first target, the last for verdict-last). It is one
        of ~50 scored tokens of an answer, and the only one the accuracy reads."""
        ids = {label: tokenizer.encode(" " + label) for label in LABELS}

        def fn(record: dict, response: list[int]) -> list[int]:
            word = ids[record["label"]]
            at = [i for i in range(len(response) - len(word) + 1) if response[i:i + len(word)] == word]
            if not at:
                raise DGemmaError(f"PubMedQA record {record.get('id', '?')!r}: its response does not contain "
                                  f"its verdict {record['label']!r} as tokens")
            i = at[0] if record.get("verdict", "last") == "first" else at[-1]
            return list(range(i, i + len(word)))

        return fn

    def score(self, texts, records) -> dict:
        return pubmedqa_metrics(texts, [r["label"] for r in records], [r["long_answer"] for r in records],
                                [r.get("verdict", "last") for r in records])

    def score_one(self, text: str, record: dict) -> dict:
        m = pubmedqa_metrics([text], [record["label"]], [record["long_answer"]], [record.get("verdict", "last")])
        return {"prediction": extract_decision(text), "label": record["label"], "accuracy": m["accuracy"],
                "bleu": m["bleu"]}
