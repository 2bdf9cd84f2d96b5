"""Task metrics computed on the host from decoded text (import-light: no torch here)."""

from dgemma.eval.pubmedqa import extract_decision, pubmedqa_metrics
from dgemma.eval.sudoku import score_sudoku, sudoku_metrics

__all__ = ["extract_decision", "pubmedqa_metrics", "score_sudoku", "sudoku_metrics"]
