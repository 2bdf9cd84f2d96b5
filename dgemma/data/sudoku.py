"""The Sudoku board library: grid checks, a bitmask solver, a unique-puzzle generator, Kaggle CSVs.

Grids and puzzles are 81-character strings in row-major order, ``"0"`` for a blank (docs/design.md §5).
Everything here is pure Python (plus numpy only for seeding), so it runs anywhere the tests do.
The task built on it (prompts, preparation, scoring) is :mod:`dgemma.tasks.sudoku`.
"""

from __future__ import annotations

import csv as _csv
import logging
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dgemma.errors import DGemmaError

log = logging.getLogger(__name__)

DIFFICULTIES = ("easy", "medium", "hard")
DIFFICULTY_CLUES = {"easy": (40, 50), "medium": (30, 39), "hard": (22, 29)}
"""Clue ranges the generator draws targets from; the buckets themselves are :func:`difficulty`."""

PUZZLE_COLUMNS = ("puzzle", "quizzes")
SOLUTION_COLUMNS = ("solution", "solutions")

_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_FULL = 0x3FE
_POP = [bin(m).count("1") for m in range(1024)]
_DIGITS_OF = [[d for d in range(1, 10) if m >> d & 1] for m in range(1024)]
_UNITS = (
    [("row", r, [r * 9 + c for c in range(9)]) for r in range(9)]
    + [("column", c, [r * 9 + c for r in range(9)]) for c in range(9)]
    + [("box", b, [i for i in range(81) if _BOX[i] == b]) for b in range(9)]
)


class Puzzle(NamedTuple):
    """A puzzle, its solution and the number of clues it actually kept."""

    puzzle: str
    solution: str
    clues: int


class CsvRow(NamedTuple):
    """One accepted CSV row; ``row`` is its 1-based row number in the file (header = row 1)."""

    row: int
    puzzle: str
    solution: str


class CsvData(NamedTuple):
    """What :func:`read_csv` kept, the warnings for the rows it skipped, and their row numbers."""

    rows: list[CsvRow]
    warnings: list[str]
    skipped: list[int]


def _cell(i: int) -> str:
    return f"row {_ROW[i] + 1}, column {_COL[i] + 1}"


def structure_groups() -> list[list[int]]:
    """``[rows, columns, boxes]``: each cell's row, column and 3x3 box (0-8), cells in reading order.

    The ``canvas_position_groups`` of a model whose canvas is the 81 cells (digit tokens), so
    every cell knows where it sits (see ``dgemma/models/structure.py``):

    >>> rows, cols, boxes = structure_groups()
    >>> rows[:12], cols[:12], boxes[:12]
    ([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2], [0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0])
    >>> boxes[27], boxes[80]
    (3, 8)
    """
    return [list(_ROW), list(_COL), list(_BOX)]


def difficulty(clues: int) -> str:
    """Bucket of a puzzle by its clue count (docs/design.md §5): easy >= 40, medium 30-39, hard < 30."""
    if clues >= 40:
        return "easy"
    if clues >= 30:
        return "medium"
    return "hard"


_bucket = difficulty


def count_clues(puzzle: str) -> int:
    """Number of non-blank cells of an 81-character puzzle string."""
    return 81 - puzzle.count("0")


def _conflict(puzzle: str) -> str | None:
    """Describe the first digit repeated inside a row, column or box, or None if there is none."""
    for kind, k, cells in _UNITS:
        seen: dict[str, int] = {}
        for i in cells:
            d = puzzle[i]
            if d == "0":
                continue
            if d in seen:
                return f"digit {d} appears twice in {kind} {k + 1} ({_cell(seen[d])} and {_cell(i)})"
            seen[d] = i
    return None


def grid_error(grid: str) -> str | None:
    """Why ``grid`` is not a completed valid Sudoku grid, or None if it is one."""
    if not isinstance(grid, str) or len(grid) != 81:
        n = len(grid) if isinstance(grid, str) else type(grid).__name__
        return f"a grid needs 81 characters, got {n}"
    for i, ch in enumerate(grid):
        if ch not in "123456789":
            return f"{ch!r} at {_cell(i)} is not a digit 1-9"
    return _conflict(grid)


def is_valid_grid(grid: str) -> bool:
    """True for a completed grid (81 digits 1-9) with every row, column and box a permutation."""
    return grid_error(grid) is None


def is_consistent(puzzle: str) -> bool:
    """True when no clue of an 81-character ``0``-blank puzzle repeats in a row, column or box."""
    return _conflict(puzzle) is None


def _masks(g: list[int]) -> tuple[list[int], list[int], list[int]] | None:
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, d in enumerate(g):
        if d:
            bit = 1 << d
            if (rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]]) & bit:
                return None
            rows[_ROW[i]] |= bit
            cols[_COL[i]] |= bit
            boxes[_BOX[i]] |= bit
    return rows, cols, boxes


def _search(g, rows, cols, boxes, limit, rnd=None, ban_cell=-1, ban_bit=0, out=None) -> int:
    """Count completions of ``g`` up to ``limit`` by backtracking on the most constrained cell.

    ``ban_cell``/``ban_bit`` forbid one digit at one cell (the uniqueness test of clue removal),
    ``rnd`` shuffles the digit order (random grids), ``out`` receives the first solution found.
    ``g`` and the masks are restored before returning.
    """
    best, best_m, best_n = -1, 0, 10
    for i in range(81):
        if g[i]:
            continue
        m = _FULL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
        if i == ban_cell:
            m &= ~ban_bit
        n = _POP[m]
        if n < best_n:
            best, best_m, best_n = i, m, n
            if n <= 1:
                break
    if best < 0:
        if out is not None and not out:
            out.extend(g)
        return 1
    if best_n == 0:
        return 0
    r, c, b = _ROW[best], _COL[best], _BOX[best]
    digits = _DIGITS_OF[best_m]
    if rnd is not None and best_n > 1:
        digits = digits[:]
        rnd.shuffle(digits)
    total = 0
    for d in digits:
        bit = 1 << d
        g[best] = d
        rows[r] |= bit
        cols[c] |= bit
        boxes[b] |= bit
        total += _search(g, rows, cols, boxes, limit - total, rnd, ban_cell, ban_bit, out)
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        g[best] = 0
        if total >= limit:
            break
    return total


def count_solutions(puzzle: str, limit: int = 2) -> int:
    """Number of solutions of a puzzle, counted up to ``limit`` (2 answers "is it unique?")."""
    g = [int(ch) for ch in parse_puzzle(puzzle)]
    masks = _masks(g)
    return 0 if masks is None else _search(g, *masks, limit)


def solve(puzzle: str) -> str | None:
    """One solution of the puzzle (the first the search finds), or None if it has none."""
    g = [int(ch) for ch in parse_puzzle(puzzle)]
    masks = _masks(g)
    out: list[int] = []
    if masks is None or not _search(g, *masks, 1, out=out):
        return None
    return "".join(map(str, out))


def _pyrandom(rng) -> random.Random:
    """A fast ``random.Random`` drawn from a numpy Generator, an int seed or a ``random.Random``."""
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, (int, np.integer)):
        rng = np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return random.Random(int(rng.integers(2**63)))
    raise DGemmaError(f"rng must be a numpy Generator, an int seed or random.Random, got {type(rng).__name__}")


def random_grid(rng) -> str:
    """A solved grid by randomized backtracking (about a millisecond each)."""
    rnd = _pyrandom(rng)
    g = [0] * 81
    out: list[int] = []
    _search(g, [0] * 9, [0] * 9, [0] * 9, 1, rnd, out=out)
    return "".join(map(str, out))


def _shuffled_lines(rnd: random.Random) -> list[int]:
    groups = [0, 1, 2]
    rnd.shuffle(groups)
    lines = []
    for g in groups:
        inner = [0, 1, 2]
        rnd.shuffle(inner)
        lines.extend(g * 3 + k for k in inner)
    return lines


def _transform(boards: tuple[str, ...], rng) -> tuple[str, ...]:
    """One random validity-preserving map, drawn once and applied to every board (blanks stay 0)."""
    rnd = _pyrandom(rng)
    rows, cols = _shuffled_lines(rnd), _shuffled_lines(rnd)
    if rnd.random() < 0.5:
        order = [rows[i] * 9 + cols[j] for j in range(9) for i in range(9)]
    else:
        order = [rows[i] * 9 + cols[j] for i in range(9) for j in range(9)]
    labels = list("123456789")
    rnd.shuffle(labels)
    table = str.maketrans("123456789", "".join(labels))
    return tuple("".join(b[k] for k in order).translate(table) for b in boards)


def transform_grid(grid: str, rng) -> str:
    """A random validity-preserving image of a solved grid (docs/design.md §11's cheap transforms).

    Digit relabelling, row swaps within bands, column swaps within stacks, band and stack swaps
    and an optional transpose: each maps valid grids to valid grids.
    """
    return _transform((grid,), rng)[0]


def transform_puzzle(puzzle: str, solution: str, rng) -> tuple[str, str]:
    """The same random map as :func:`transform_grid` applied to a puzzle and its solution.

    The maps permute cells within the symmetry group of the rules and relabel digits, so a
    puzzle with exactly one solution keeps exactly one (the image of the old one) and its clue
    count: one generated unique puzzle yields up to 9! x 6^8 x 2 distinct ones for free.
    """
    return _transform((puzzle, solution), rng)


def generate_grids(n: int, *, seed: int = 0, pool: int = 2000) -> list[str]:
    """``n`` distinct solved grids: up to ``pool`` by backtracking, the rest by transforms of those.

    Use for training volume; evaluation puzzles should come from fresh grids
    (:func:`generate_puzzles` does that), not from the transformed pool.
    """
    if n < 0 or pool < 1:
        raise DGemmaError(f"generate_grids: n must be >= 0 and pool >= 1, got n={n}, pool={pool}")
    rnd = _pyrandom(seed)
    base = [random_grid(rnd) for _ in range(min(n, pool))]
    out = list(dict.fromkeys(base))
    seen = set(out)
    while len(out) < n:
        g = transform_grid(rnd.choice(base), rnd)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def make_puzzle(solution: str, clues: int, rng, unique: bool = True) -> Puzzle:
    """Blank cells of ``solution`` in random order until ``clues`` remain.

    With ``unique=True`` a cell is blanked only if no other digit fits there afterwards, i.e. the
    puzzle keeps exactly one solution; one pass over all cells leaves a minimal puzzle, since a
    clue that could not go stays needed as more clues go. When a grid cannot get down to
    ``clues`` that way, the closest puzzle reached is returned and ``Puzzle.clues`` says how many
    it kept. With ``unique=False`` exactly ``81 - clues`` random cells are blanked.
    """
    err = grid_error(solution)
    if err:
        raise DGemmaError(f"make_puzzle: solution is not a valid grid: {err}")
    if not isinstance(clues, (int, np.integer)) or not 0 <= clues <= 81:
        raise DGemmaError(f"make_puzzle: clues must be an integer in 0..81, got {clues!r}")
    rnd = _pyrandom(rng)
    order = list(range(81))
    rnd.shuffle(order)
    g = [int(ch) for ch in solution]
    if not unique:
        for i in order[: 81 - clues]:
            g[i] = 0
        return Puzzle("".join(map(str, g)), solution, int(clues))
    rows, cols, boxes = _masks(g)
    kept = 81
    for i in order:
        if kept <= clues:
            break
        d = g[i]
        bit = 1 << d
        r, c, b = _ROW[i], _COL[i], _BOX[i]
        g[i] = 0
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        if _search(g, rows, cols, boxes, 1, ban_cell=i, ban_bit=bit):
            g[i] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
        else:
            kept -= 1
    return Puzzle("".join(map(str, g)), solution, kept)


def _clue_ranges(n: int, clues, level) -> list[tuple[int, int]]:
    if (clues is None) == (level is None):
        raise DGemmaError("generate_puzzles: give exactly one of clues=(lo, hi) or difficulty=...")
    if clues is not None:
        try:
            lo, hi = (int(x) for x in clues)
        except (TypeError, ValueError):
            raise DGemmaError(f"generate_puzzles: clues must be a pair (lo, hi), got {clues!r}") from None
        if not 0 <= lo <= hi <= 81:
            raise DGemmaError(f"generate_puzzles: clues must satisfy 0 <= lo <= hi <= 81, got ({lo}, {hi})")
        return [(lo, hi)] * n
    if level == "mixed":
        return [DIFFICULTY_CLUES[DIFFICULTIES[k % 3]] for k in range(n)]
    if level not in DIFFICULTY_CLUES:
        raise DGemmaError(f"difficulty must be one of easy, medium, hard, mixed; got {level!r}")
    return [DIFFICULTY_CLUES[level]] * n


def generate_puzzles(
    n: int,
    *,
    seed: int,
    clues: tuple[int, int] | None = None,
    difficulty: str | None = None,
    unique: bool = True,
    max_tries: int = 50,
) -> list[dict]:
    """``n`` puzzles as records ``{puzzle, solution, clues, difficulty}``, each from a fresh grid.

    Each puzzle draws a target clue count uniformly from its range (``clues`` inclusive, or the
    bucket's :data:`DIFFICULTY_CLUES`; ``'mixed'`` cycles easy, medium, hard so every split of the
    file keeps the buckets balanced). A grid whose minimal unique puzzle stays above the range is
    discarded for a new one, so every record lies in its range; after ``max_tries`` grids the
    range is declared unreachable rather than silently widened.
    """
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise DGemmaError(f"generate_puzzles: n must be a non-negative integer, got {n!r}")
    ranges = _clue_ranges(int(n), clues, difficulty)
    rnd = _pyrandom(seed)
    out = []
    for k, (lo, hi) in enumerate(ranges):
        for _ in range(max_tries):
            p = make_puzzle(random_grid(rnd), rnd.randint(lo, hi), rnd, unique)
            if lo <= p.clues <= hi:
                break
        else:
            raise DGemmaError(
                f"generate_puzzles: puzzle {k}: no unique puzzle with {lo}-{hi} clues after {max_tries} "
                f"grids (greedy removal rarely goes below ~22 clues); raise the range or pass unique=False"
            )
        out.append({"puzzle": p.puzzle, "solution": p.solution, "clues": p.clues, "difficulty": _bucket(p.clues)})
    return out


def parse_puzzle(s: str) -> str:
    """Validate a user-supplied puzzle and return it as 81 characters ``0``-``9``.

    Whitespace anywhere is dropped (so the 81 space-separated digits of a prompt parse back) and
    ``.`` means blank. Anything else is an error rather than a guess: a wrong length, a stray
    character or a clue repeated in a row, column or box would only make the model's task
    undefined, and the message names the position so the input can be fixed.
    """
    if not isinstance(s, str):
        raise DGemmaError(f"puzzle must be a string of 81 digits, got {type(s).__name__}")
    p = "".join(s.split()).replace(".", "0")
    if len(p) != 81:
        raise DGemmaError(f"puzzle must have 81 cells (digits 0-9 or '.'), got {len(p)} after removing whitespace")
    for i, ch in enumerate(p):
        if ch not in "0123456789":
            raise DGemmaError(f"puzzle has {ch!r} at cell {i + 1} ({_cell(i)}); only digits 0-9 and '.' are allowed")
    err = _conflict(p)
    if err:
        raise DGemmaError(f"puzzle has contradictory clues: {err}")
    return p


def parse_solution(s: str) -> str:
    """Validate a solution (whitespace dropped) as a completed valid grid; return 81 digits 1-9."""
    if not isinstance(s, str):
        raise DGemmaError(f"solution must be a string of 81 digits, got {type(s).__name__}")
    g = "".join(s.split())
    err = grid_error(g)
    if err:
        raise DGemmaError(f"solution is not a valid completed grid: {err}")
    return g


def _read_header(path: Path, header: list[str]) -> tuple[int, int]:
    names = [h.strip().lower() for h in header]
    for p_name, s_name in zip(PUZZLE_COLUMNS, SOLUTION_COLUMNS):
        if p_name in names and s_name in names:
            return names.index(p_name), names.index(s_name)
    raise DGemmaError(
        f"{path}: row 1: expected a header with columns 'puzzle,solution' or 'quizzes,solutions', "
        f"got {','.join(header)!r}"
    )


def _row_error(puzzle: str, solution: str) -> str | None:
    """Why a CSV row cannot be used, or None. Puzzles may use '.' for blanks; solutions may not."""
    if len(puzzle) != 81:
        return f"puzzle has {len(puzzle)} characters, expected 81"
    for i, ch in enumerate(puzzle):
        if ch not in "0123456789":
            return f"puzzle has non-digit {ch!r} at cell {i + 1}"
    if len(solution) != 81:
        return f"solution has {len(solution)} characters, expected 81"
    for i, ch in enumerate(solution):
        if ch not in "123456789":
            return f"solution has {ch!r} at cell {i + 1}; a solution needs digits 1-9"
    err = _conflict(solution)
    if err:
        return f"solution is not a valid grid: {err}"
    for i, (p, s) in enumerate(zip(puzzle, solution)):
        if p != "0" and p != s:
            return f"solution contradicts puzzle at cell {i + 1} ({_cell(i)}): clue {p}, solution {s}"
    return None


def read_csv(path) -> CsvData:
    """Read a Kaggle-layout Sudoku CSV (``puzzle,solution`` or ``quizzes,solutions`` header).

    Extra columns are ignored and ``.`` in a puzzle means blank. A row with a wrong length,
    non-digits, an invalid solution grid or a solution that contradicts its puzzle is skipped and
    reported with its row number (the header is row 1): bad rows are never kept, since one bad
    target poisons training and one bad label skews an evaluation. Empty lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise DGemmaError(f"Sudoku CSV not found: {path}")
    rows: list[CsvRow] = []
    warnings: list[str] = []
    skipped: list[int] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = _csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise DGemmaError(f"{path}: the file is empty; expected a 'puzzle,solution' header and rows")
        ip, is_ = _read_header(path, header)
        need = max(ip, is_) + 1
        for fields in reader:
            line = reader.line_num
            if not fields or all(not x.strip() for x in fields):
                continue
            if len(fields) < need:
                err = f"expected {need} columns, got {len(fields)}"
            else:
                puzzle = fields[ip].strip().replace(".", "0")
                solution = fields[is_].strip()
                err = _row_error(puzzle, solution)
            if err:
                warnings.append(f"{path.name}: row {line}: {err}")
                skipped.append(line)
            else:
                rows.append(CsvRow(line, puzzle, solution))
    for w in warnings[:20]:
        log.warning("skipped %s", w)
    if len(warnings) > 20:
        log.warning("skipped %d more malformed rows in %s", len(warnings) - 20, path)
    return CsvData(rows, warnings, skipped)


