"""The trained checkpoints shipped in this repository's ``checkpoints/``, by role: the one place
that names them, so a better one replaces its predecessor everywhere at once.

- ``SUDOKU``: the default of ``dgemma solve``, the playground's Sudoku panel and ``dgemma bench
  decode``'s Sudoku rows (``checkpoints/sudoku_wide``: width 128, 100.0 / 98.0 / 65.2% of easy /
  medium / hard held-out boards, model only; its README). ``checkpoints/sudoku_small`` stays
  beside it as what the README's 14-minute quickstart recipe gives.
- ``PUBMEDQA``: the default of ``dgemma generate`` and the playground's Text panel (the Gemma 3
  270M adapted on PubMedQA, its AR twin in ``ar/``).

Absolute paths inside a source checkout, so the defaults hold from any working directory.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUDOKU = REPO / "checkpoints" / "sudoku_wide"
PUBMEDQA = REPO / "checkpoints" / "pubmedqa_270m"
