"""Sudoku metrics from decoded text (docs/design.md §5), overall and per difficulty bucket."""

from __future__ import annotations

from dgemma.data.sudoku import (
    DIFFICULTIES,
    count_clues,
    difficulty,
    extract_digits,
    grid_error,
    parse_puzzle,
    parse_solution,
)
from dgemma.errors import DGemmaError

METRICS = (
    "accuracy",
    "cell_accuracy",
    "blank_accuracy",
    "exact_mask_accuracy",
    "partial_mask_accuracy",
    "valid_accuracy",
)


def score_sudoku(text: str, puzzle: str, solution: str) -> dict:
    """Score one decoded output against its puzzle and solution.

    The answer is the 81 digits :func:`~dgemma.data.sudoku.extract_digits` finds; without them
    every metric is 0 (an output we cannot read has solved nothing and kept no clue).
    ``cell_accuracy`` divides the correctly filled blanks by 81, the reference's definition, kept
    so numbers stay comparable; ``blank_accuracy`` divides by the number of blanks (1.0 for a
    puzzle without blanks when the output is correct). ``partial_mask_accuracy`` is the fraction
    of clues unchanged (1.0 for a puzzle without clues). ``valid_accuracy`` accepts any completed
    valid grid that keeps every clue, so a puzzle with several solutions is not marked wrong.
    Returns the metrics plus ``parsed``, ``prediction``, ``clues`` and ``difficulty``.
    """
    puzzle = parse_puzzle(puzzle)
    solution = parse_solution(solution)
    for i, (p, s) in enumerate(zip(puzzle, solution)):
        if p != "0" and p != s:
            raise DGemmaError(f"solution contradicts its puzzle at cell {i + 1}: clue {p}, solution {s}")
    clues = count_clues(puzzle)
    pred = extract_digits(text)
    out = {"parsed": pred is not None, "prediction": pred, "clues": clues, "difficulty": difficulty(clues)}
    if pred is None:
        return {**out, **{m: 0.0 for m in METRICS}}
    blank_hits = sum(p == "0" and a == s for p, a, s in zip(puzzle, pred, solution))
    clue_kept = sum(p != "0" and a == p for p, a in zip(puzzle, pred))
    blanks = 81 - clues
    correct = pred == solution
    kept_all = clue_kept == clues
    out.update(
        accuracy=float(correct),
        cell_accuracy=blank_hits / 81,
        blank_accuracy=blank_hits / blanks if blanks else float(correct),
        exact_mask_accuracy=float(kept_all),
        partial_mask_accuracy=clue_kept / clues if clues else 1.0,
        valid_accuracy=float(kept_all and grid_error(pred) is None),
    )
    return out


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0


def aggregate_sudoku(scores: list[dict]) -> dict:
    """Average per-example scores into the docs/design.md §5 keys; an empty bucket reports 0.0, count 0.

    0.0 (not NaN or a missing key) keeps every key present and every value a float for
    TensorBoard and JSONL; ``count_<bucket>`` = 0 says the zero is no measurement.
    """
    out: dict = {m: _mean(scores, m) for m in METRICS}
    out["count"] = len(scores)
    for b in DIFFICULTIES:
        rows = [s for s in scores if s["difficulty"] == b]
        out.update({f"{m}_{b}": _mean(rows, m) for m in METRICS})
        out[f"count_{b}"] = len(rows)
    return out


def sudoku_metrics(texts, puzzles, solutions) -> dict:
    """Sudoku metrics over a batch: the six docs/design.md §5 metrics, again per bucket, and counts.

    Keys: ``accuracy``, ``cell_accuracy``, ``blank_accuracy``, ``exact_mask_accuracy``,
    ``partial_mask_accuracy``, ``valid_accuracy``, each also with ``_easy``/``_medium``/``_hard``,
    plus ``count`` and ``count_easy``/``count_medium``/``count_hard``. Buckets come from the
    puzzle's clue count; a bucket with no items reports 0.0 for its metrics and count 0.
    """
    texts, puzzles, solutions = list(texts), list(puzzles), list(solutions)
    if not len(texts) == len(puzzles) == len(solutions):
        raise DGemmaError(
            f"sudoku_metrics: got {len(texts)} texts, {len(puzzles)} puzzles and {len(solutions)} solutions; "
            "they must be the same length"
        )
    scores = []
    for k, (t, p, s) in enumerate(zip(texts, puzzles, solutions)):
        try:
            scores.append(score_sudoku(t, p, s))
        except DGemmaError as e:
            raise DGemmaError(f"sudoku_metrics: example {k}: {e}") from None
    return aggregate_sudoku(scores)
