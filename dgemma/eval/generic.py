"""Generic text metrics from decoded text: exact match, regex answers, BLEU, chrF and ROUGE-L.

For tasks without a dedicated metric module (the ``chat`` and ``completion`` tasks): each output
is compared with one reference string. Everything here is a pure function on strings;
:func:`generic_metrics` aggregates a batch, :func:`score_example` gives the per-example row for
the JSONL of outputs. Import-light: sacrebleu is imported only when BLEU or chrF is computed.

Keys of :func:`generic_metrics`: ``count``, ``exact_match``, ``rouge_l`` (means over examples),
``bleu`` and ``chrf`` (sacrebleu *corpus* scores, 0-100), and with an answer regex
``answer_accuracy`` and ``answer_parsed``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence

from dgemma.errors import DGemmaError

Normalizer = Callable[[str], str]

# A number: an optional sign (not after a letter or digit), digits, and any single punctuation
# mark between digits (3.5, 1,000, 1/2, 3:45, 3-5). normalize() keeps it whole.
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?\d+(?:[^\w\s]\d+)*")


def normalize(text: str, *, lower: bool = True, strip_punct: bool = True, collapse_ws: bool = True) -> str:
    """The default normaliser for exact match and answers.

    Always applies Unicode NFKC (full-width digits and compatibility forms become their plain
    equivalents: they are the same answer). Then, by flag: lowercase; remove punctuation
    (Unicode category P*) *except inside numbers*; collapse whitespace runs to one space and trim.

    Numbers are protected on purpose: stripping every punctuation mark, as SQuAD's normaliser
    does, turns ``-5`` into ``5``, ``3.5`` into ``35`` and ``1/2`` into ``12``, so a wrong sign
    or a misplaced decimal point would count as correct. Kept are a sign (``-``/``+``, the
    Unicode minus ``−`` read as ``-``) directly before digits and not after a letter, digit or
    dot, and a single punctuation mark *between* two digits (``3.5``, ``1,000``, ``1/2``,
    ``3:45``); a full stop after a number is still removed, so ``"The answer is -5."``
    normalises to ``"the answer is -5"``. Articles are not removed (unlike SQuAD): "a" vs "the"
    can be the answer in general tasks.

    >>> normalize("  The Answer is:  -1,250.5! ")
    'the answer is -1,250.5'
    >>> normalize("e-mail, well-known")
    'email wellknown'
    """
    if not isinstance(text, str):
        text = ""
    text = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
    if lower:
        text = text.lower()
    if strip_punct:
        parts, last = [], 0
        for m in _NUMBER.finditer(text):
            parts.append(_strip_punct(text[last:m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_strip_punct(text[last:]))
        text = "".join(parts)
    if collapse_ws:
        text = " ".join(text.split())
    return text


def _strip_punct(text: str) -> str:
    return "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))


def identity(text: str) -> str:
    """No normalisation (a non-string counts as the empty string)."""
    return text if isinstance(text, str) else ""


NORMALIZERS: dict[str, Normalizer] = {
    "default": normalize,
    "none": identity,
    "strip": lambda t: identity(t).strip(),
    "lower": lambda t: normalize(t, strip_punct=False),
}


def get_normalizer(normalizer: str | Normalizer | None) -> Normalizer:
    """A normaliser by name (``default``, ``none``, ``strip``, ``lower``), a callable, or None
    for ``default``. ``lower`` lowercases and collapses whitespace but keeps punctuation."""
    if normalizer is None:
        return normalize
    if callable(normalizer):
        return normalizer
    if normalizer not in NORMALIZERS:
        raise DGemmaError(f"unknown normalizer {normalizer!r}; choose one of {', '.join(NORMALIZERS)} "
                          "or pass a function")
    return NORMALIZERS[normalizer]


def _check_lengths(name: str, preds: Sequence, refs: Sequence) -> None:
    if len(preds) != len(refs):
        raise DGemmaError(f"{name}: got {len(preds)} outputs and {len(refs)} references; they must be the same length")


def _text(t) -> str:
    """Outputs that failed to decode (None) score as the empty string, never as an error."""
    return t if isinstance(t, str) else ""


def exact_match(preds: Sequence[str], refs: Sequence[str], normalizer: str | Normalizer | None = None) -> float:
    """Fraction of outputs equal to their reference after ``normalizer`` (default :func:`normalize`).

    Whole-string equality: an output that states the right answer inside a longer text does not
    count (use an answer regex for that). Pass ``normalizer="none"`` for byte-exact match.
    An empty batch scores 0.0.
    """
    _check_lengths("exact_match", preds, refs)
    norm = get_normalizer(normalizer)
    if not preds:
        return 0.0
    return sum(norm(_text(p)) == norm(_text(r)) for p, r in zip(preds, refs)) / len(preds)


def compile_pattern(pattern: str | re.Pattern, *, require: str | None = None) -> re.Pattern:
    """Compile an extractor regex; it must have named groups (and the group ``require``, if given).

    A pattern without named groups is refused: the extractor's output is the named groups, so
    such a pattern would extract nothing and make every answer "unparsed".
    """
    try:
        rx = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
    except re.error as e:
        raise DGemmaError(f"invalid regex {pattern!r}: {e}") from None
    if not rx.groupindex:
        raise DGemmaError(f"regex {rx.pattern!r} has no named group; write e.g. (?P<answer>-?\\d+)")
    if require is not None and require not in rx.groupindex:
        raise DGemmaError(f"regex {rx.pattern!r} has no group named {require!r}; write (?P<{require}>...)")
    return rx


def regex_extract(text: str, pattern: str | re.Pattern) -> dict | None:
    """The named groups of the *first* match of ``pattern`` in ``text``, or None when nothing matches.

    First, not last: the answer is the first one the model commits to, so an output that lists
    several candidate answers gets no credit for a later lucky one. The pattern is used as given
    (add ``(?i)`` for case-insensitive matching); there is no fallback search for a bare number,
    which would turn unanswered outputs into guesses. A named group that did not take part in
    the match is None.

    >>> regex_extract("So 3 + 4 = 7. The answer is 7.", r"The answer is (?P<answer>-?\\d+)")
    {'answer': '7'}
    """
    rx = compile_pattern(pattern)
    m = rx.search(text) if isinstance(text, str) else None
    return m.groupdict() if m else None


def bleu(preds: Sequence[str], refs: Sequence[str]) -> float:
    """sacrebleu **corpus** BLEU (0-100, default 13a tokenisation, case-sensitive, exp smoothing).

    Corpus BLEU pools n-gram counts over the batch before taking the geometric mean, the
    standard, comparable number; a mean of sentence BLEUs is dominated by the smoothing of short
    outputs. Per-example scores use :func:`sentence_bleu`. An empty batch scores 0.0.
    """
    _check_lengths("bleu", preds, refs)
    if not preds:
        return 0.0
    from sacrebleu.metrics import BLEU

    return float(BLEU().corpus_score([_text(p) for p in preds], [[_text(r) for r in refs]]).score)


def sentence_bleu(pred: str, ref: str) -> float:
    """sacrebleu sentence BLEU with 'floor' smoothing and effective order (as the PubMedQA
    metric): defined and non-zero for outputs shorter than four tokens."""
    from sacrebleu.metrics import BLEU

    return float(BLEU(smooth_method="floor", effective_order=True).sentence_score(_text(pred), [_text(ref)]).score)


def chrf(preds: Sequence[str], refs: Sequence[str]) -> float:
    """sacrebleu **corpus** chrF (0-100, character 6-grams, beta 2, no word n-grams: chrF, not
    chrF++). Character n-grams credit partly right words (inflections, numbers with a wrong
    digit) that BLEU scores as misses. An empty batch scores 0.0."""
    _check_lengths("chrf", preds, refs)
    if not preds:
        return 0.0
    from sacrebleu.metrics import CHRF

    return float(CHRF().corpus_score([_text(p) for p in preds], [[_text(r) for r in refs]]).score)


def sentence_chrf(pred: str, ref: str) -> float:
    """sacrebleu sentence chrF (0-100) of one output."""
    from sacrebleu.metrics import CHRF

    return float(CHRF().sentence_score(_text(pred), [_text(ref)]).score)


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F1 (0-1) on whitespace tokens: LCS length ``l``, precision ``l / len(pred)``,
    recall ``l / len(ref)``, F1 their harmonic mean (beta = 1, as the rouge-score package).

    Tokens are compared exactly (case and attached punctuation count); :func:`generic_metrics`
    passes normalised texts, which plays the part of rouge-score's lowercase/alphanumeric
    tokeniser. Two empty texts score 1.0 (they are equal, as exact match says); one empty 0.0.

    >>> rouge_l("the cat sat on the mat", "the cat lay on a mat")
    0.6666666666666666
    """
    p, r = _text(pred).split(), _text(ref).split()
    if not p and not r:
        return 1.0
    if not p or not r:
        return 0.0
    lcs = _lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def _answers(text: str, reference: str, rx: re.Pattern, norm: Normalizer) -> tuple[str | None, str]:
    """The output's answer (None when the regex finds none) and the reference's answer: the
    regex's ``answer`` group in the reference, or the whole reference when it does not match
    (a reference may be the bare answer, ``"42"``, or a full solution ending in the marker)."""
    m = rx.search(_text(text))
    pred = m.group("answer") if m else None
    mr = rx.search(_text(reference))
    ref = mr.group("answer") if mr and mr.group("answer") is not None else _text(reference)
    return (None if pred is None else norm(pred)), norm(ref)


def score_example(text: str, reference: str, *, regex: str | re.Pattern | None = None,
                  normalizer: str | Normalizer | None = None) -> dict:
    """Per-example scores for the outputs JSONL.

    Keys: ``exact_match`` (0/1), ``rouge_l``, ``bleu`` (:func:`sentence_bleu`), ``chrf``
    (:func:`sentence_chrf`); with ``regex``: ``extracted`` (all named groups of the first match,
    or None), and when it has an ``answer`` group, ``answer``, ``reference_answer`` (both
    normalised) and ``answer_correct`` (0/1; an output without a match is wrong).
    """
    norm = get_normalizer(normalizer)
    t, r = _text(text), _text(reference)
    out = {
        "exact_match": float(norm(t) == norm(r)),
        "rouge_l": rouge_l(norm(t), norm(r)),
        "bleu": sentence_bleu(t, r),
        "chrf": sentence_chrf(t, r),
    }
    if regex is not None:
        rx = compile_pattern(regex)
        out["extracted"] = regex_extract(t, rx)
        if "answer" in rx.groupindex:
            pred, ref = _answers(t, r, rx, norm)
            out.update(answer=pred, reference_answer=ref, answer_correct=float(pred is not None and pred == ref))
    return out


def generic_metrics(texts: Sequence[str], references: Sequence[str], *, regex: str | re.Pattern | None = None,
                    normalizer: str | Normalizer | None = None) -> dict:
    """Batch metrics: ``count``, ``exact_match``, ``rouge_l`` (mean), ``bleu``, ``chrf`` (corpus).

    With ``regex`` (which must have a named group ``answer``, e.g. ``The answer is
    (?P<answer>-?\\d+)``): ``answer_accuracy``, the fraction of outputs whose first match's answer
    equals the reference answer after ``normalizer`` (unmatched outputs are wrong: no fallback
    guess), and ``answer_parsed``, the fraction of outputs the regex matched at all. The
    reference answer is the regex's ``answer`` in the reference, or the whole reference when the
    regex does not match it. Every value is a float (0.0 for an empty batch) so the dict goes to
    TensorBoard and JSONL unchanged.
    """
    texts, references = list(texts), list(references)
    _check_lengths("generic_metrics", texts, references)
    norm = get_normalizer(normalizer)
    n = len(texts)
    nt = [norm(_text(t)) for t in texts]
    nr = [norm(_text(r)) for r in references]
    out: dict = {
        "count": n,
        "exact_match": sum(a == b for a, b in zip(nt, nr)) / n if n else 0.0,
        "rouge_l": sum(rouge_l(a, b) for a, b in zip(nt, nr)) / n if n else 0.0,
        "bleu": bleu(texts, references),
        "chrf": chrf(texts, references),
    }
    if regex is not None:
        rx = compile_pattern(regex, require="answer")
        answers = [_answers(t, r, rx, norm) for t, r in zip(texts, references)]
        out["answer_accuracy"] = sum(p is not None and p == r for p, r in answers) / n if n else 0.0
        out["answer_parsed"] = sum(p is not None for p, _ in answers) / n if n else 0.0
    return out
