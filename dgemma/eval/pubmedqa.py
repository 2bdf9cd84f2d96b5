"""PubMedQA metrics from decoded text (docs/design.md §5): decision accuracy, macro-F1, counts and BLEU."""

from __future__ import annotations

import re

from dgemma.errors import DGemmaError

LABELS = ("yes", "no", "maybe")
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


def _bleu_hypothesis(text: str) -> str:
    """The explanation part of an output: the text before "the answer is" (the target appends
    that sentence to LONG_ANSWER, so leaving it in would cap a perfect output below 100)."""
    m = re.search(r"the answer is", text, re.IGNORECASE)
    return (text[: m.start()] if m else text).strip()


def _f1(tp: int, n_pred: int, n_label: int) -> float:
    return 2 * tp / (n_pred + n_label) if n_pred + n_label else 0.0


def pubmedqa_metrics(texts, labels, long_answers) -> dict:
    """PubMedQA metrics over a batch.

    Keys: ``accuracy`` (unparsed outputs count as wrong), ``macro_f1``, ``f1_{yes,no,maybe}``,
    ``bleu`` (mean sacrebleu sentence BLEU, smooth 'floor', effective order, of the explanation
    before "the answer is" against LONG_ANSWER), ``label_{c}`` and ``pred_{c}`` counts,
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
    out["bleu"] = _mean_bleu(texts, long_answers)
    return out


def _mean_bleu(texts: list[str], refs: list[str]) -> float:
    if not texts:
        return 0.0
    from sacrebleu.metrics import BLEU

    bleu = BLEU(smooth_method="floor", effective_order=True)
    total = 0.0
    for t, r in zip(texts, refs):
        total += bleu.sentence_score(_bleu_hypothesis(t if isinstance(t, str) else ""), [r]).score
    return total / len(texts)
