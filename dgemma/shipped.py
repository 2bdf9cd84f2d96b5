"""The trained checkpoints shipped in this repository's ``checkpoints/``, by role: the one place
that names them, so a better one replaces its predecessor everywhere at once.

- ``SUDOKU``: the default of ``dgemma solve``, the playground's Sudoku panel and ``dgemma bench
  decode``'s Sudoku rows (``checkpoints/sudoku_avg``: the weight average of ``checkpoints/sudoku_deep``,
  8 layers of width 128 deepened from ``checkpoints/sudoku_wide``, and its continuation on harder
  puzzles ``checkpoints/sudoku_deep_hard``; its README has the held-out figures, model only and
  verified apart). ``checkpoints/sudoku_small`` stays beside it as what the README's 14-minute
  quickstart recipe gives; the other three are its sources.
- ``PUBMEDQA``: the default of ``dgemma generate`` and the playground's Text panel (the Gemma 3
  270M adapted on PubMedQA, its AR twin in ``ar/``).

Absolute paths inside a source checkout, so the defaults hold from any working directory.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUDOKU = REPO / "checkpoints" / "sudoku_avg"
PUBMEDQA = REPO / "checkpoints" / "pubmedqa_270m"
