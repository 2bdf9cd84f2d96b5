import json
import random

import numpy as np
import pytest

from dgemma.cli.main import main
from dgemma.data import sudoku as S
from dgemma.tasks import sudoku as T
from dgemma.errors import DGemmaError

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def test_known_puzzle_solves_uniquely():
    assert S.is_valid_grid(SOLUTION)
    assert S.count_clues(PUZZLE) == 30
    assert S.count_solutions(PUZZLE) == 1
    assert S.solve(PUZZLE) == SOLUTION
    assert S.count_solutions("0" * 81) == 2
    assert S.count_solutions("0" * 81, limit=5) == 5


def test_unsolvable_without_contradiction():
    # row 1 needs a 9 at its last cell, but column 9 already has one
    p = "123456780" + "000000009" + "0" * 63
    assert S.is_consistent(p)
    assert S.count_solutions(p) == 0
    assert S.solve(p) is None


def test_grid_validity():
    swapped = SOLUTION[1] + SOLUTION[0] + SOLUTION[2:]
    assert not S.is_valid_grid(swapped)
    assert "appears twice" in S.grid_error(swapped)
    assert not S.is_valid_grid(SOLUTION[:80])
    assert not S.is_valid_grid("0" + SOLUTION[1:])
    assert S.is_consistent(PUZZLE)
    assert not S.is_consistent("55" + "0" * 79)


@pytest.mark.parametrize(
    "clues,bucket", [(81, "easy"), (40, "easy"), (39, "medium"), (30, "medium"), (29, "hard"), (17, "hard")]
)
def test_difficulty_buckets(clues, bucket):
    assert S.difficulty(clues) == bucket


def test_random_grids_and_transforms():
    a = S.random_grid(np.random.default_rng(3))
    assert S.is_valid_grid(a)
    assert a == S.random_grid(np.random.default_rng(3))
    rnd = random.Random(0)
    images = {S.transform_grid(a, rnd) for _ in range(50)}
    assert all(S.is_valid_grid(g) for g in images)
    assert len(images) == 50
    grids = S.generate_grids(300, seed=1, pool=20)
    assert len(set(grids)) == 300
    assert all(S.is_valid_grid(g) for g in grids)
    assert S.generate_grids(300, seed=1, pool=20) == grids


def test_transform_puzzle_keeps_uniqueness_and_clues():
    recs = S.generate_puzzles(6, seed=11, clues=(24, 30))
    rnd = random.Random(1)
    for r in recs:
        images = {S.transform_puzzle(r["puzzle"], r["solution"], rnd) for _ in range(20)}
        assert len(images) == 20  # distinct images
        for puzzle, solution in images:
            assert S.is_valid_grid(solution) and S.count_clues(puzzle) == r["clues"]
            assert all(c in ("0", s) for c, s in zip(puzzle, solution))  # the clues agree with the solution
            assert S.count_solutions(puzzle) == 1 and S.solve(puzzle) == solution
    # one map for both boards: the transformed grid is the transform of the grid under the same draws
    g = recs[0]["solution"]
    assert S.transform_puzzle(g, g, random.Random(5)) == (S.transform_grid(g, random.Random(5)),) * 2


def test_make_puzzle_unique_and_closest():
    grid = S.random_grid(5)
    p = S.make_puzzle(grid, 35, np.random.default_rng(0))
    assert p.clues == 35 == S.count_clues(p.puzzle)
    assert S.count_solutions(p.puzzle) == 1
    assert all(c in ("0", s) for c, s in zip(p.puzzle, grid))
    low = S.make_puzzle(grid, 0, np.random.default_rng(0))
    assert 17 <= low.clues < 35 and low.clues == S.count_clues(low.puzzle)
    assert S.count_solutions(low.puzzle) == 1
    loose = S.make_puzzle(grid, 20, np.random.default_rng(0), unique=False)
    assert loose.clues == 20 == S.count_clues(loose.puzzle)
    with pytest.raises(DGemmaError, match="clues must be"):
        S.make_puzzle(grid, 82, 0)
    with pytest.raises(DGemmaError, match="not a valid grid"):
        S.make_puzzle(PUZZLE, 30, 0)


@pytest.mark.parametrize("level", ["easy", "medium", "hard"])
def test_generate_puzzles_per_bucket(level):
    recs = S.generate_puzzles(4, seed=7, difficulty=level)
    lo, hi = S.DIFFICULTY_CLUES[level]
    for r in recs:
        assert S.count_solutions(r["puzzle"]) == 1
        assert lo <= r["clues"] <= hi and r["clues"] == S.count_clues(r["puzzle"])
        assert r["difficulty"] == level == S.difficulty(r["clues"])
        assert S.is_valid_grid(r["solution"])
    assert recs == S.generate_puzzles(4, seed=7, difficulty=level)


def test_generate_puzzles_mixed_and_ranges():
    recs = S.generate_puzzles(6, seed=0, difficulty="mixed")
    assert [r["difficulty"] for r in recs] == ["easy", "medium", "hard"] * 2
    recs = S.generate_puzzles(3, seed=0, clues=(33, 34))
    assert all(33 <= r["clues"] <= 34 for r in recs)
    with pytest.raises(DGemmaError, match="exactly one"):
        S.generate_puzzles(1, seed=0)
    with pytest.raises(DGemmaError, match="difficulty must be one of"):
        S.generate_puzzles(1, seed=0, difficulty="insane")
    with pytest.raises(DGemmaError, match="0 <= lo <= hi <= 81"):
        S.generate_puzzles(1, seed=0, clues=(30, 20))
    with pytest.raises(DGemmaError, match="no unique puzzle with 10-12 clues"):
        S.generate_puzzles(1, seed=0, clues=(10, 12), max_tries=2)


def test_parse_puzzle():
    spaced = " ".join(PUZZLE)
    assert S.parse_puzzle(spaced) == PUZZLE
    assert S.parse_puzzle(PUZZLE.replace("0", ".")) == PUZZLE
    assert S.parse_puzzle("\n".join(PUZZLE[i : i + 9] for i in range(0, 81, 9))) == PUZZLE
    with pytest.raises(DGemmaError, match="81 cells .* got 80"):
        S.parse_puzzle(PUZZLE[:80])
    with pytest.raises(DGemmaError, match=r"'x' at cell 3 \(row 1, column 3\)"):
        S.parse_puzzle(PUZZLE[:2] + "x" + PUZZLE[3:])
    with pytest.raises(DGemmaError, match="contradictory clues: digit 5 appears twice in row 1"):
        S.parse_puzzle("5" + PUZZLE[1:8] + "5" + PUZZLE[9:])
    with pytest.raises(DGemmaError, match="got int"):
        S.parse_puzzle(5)


def test_prompt_and_response_format():
    assert T.SYSTEM_PROMPT == (
        "Solve the following Sudoku puzzle. Empty cells are represented by 0. Output ONLY the solved puzzle"
    )
    prompt = T.format_prompt(PUZZLE)
    assert prompt.split(" ") == list(PUZZLE) and prompt.startswith("5 3 0 0 7")
    assert T.format_response(SOLUTION) == " ".join(SOLUTION)
    with pytest.raises(DGemmaError, match="not a valid completed grid"):
        T.format_response(PUZZLE)


def test_extract_digits():
    assert T.extract_digits(" ".join(SOLUTION)) == SOLUTION
    assert T.extract_digits("Step 1 of 3: thinking\n" + SOLUTION + "\n") == SOLUTION
    assert T.extract_digits(PUZZLE + " so The Answer Is: " + SOLUTION + " (took 12 steps)") == SOLUTION
    assert T.extract_digits(SOLUTION + " the answer is 12") is None
    assert T.extract_digits(SOLUTION[:80]) is None
    assert T.extract_digits("") is None
    assert T.extract_digits(None) is None
    assert T.extract_digits("9" + SOLUTION) == SOLUTION


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_csv_reports_each_bad_row(tmp_path):
    bad_grid = SOLUTION[1] + SOLUTION[0] + SOLUTION[2:]
    contra = "6" + PUZZLE[1:]
    path = _write(
        tmp_path / "s.csv",
        [
            "id,puzzle,solution,clues",
            f"1,{PUZZLE},{SOLUTION},30",  # row 2 ok
            f"2,{PUZZLE[:80]},{SOLUTION},30",  # row 3 short puzzle
            f"3,{PUZZLE[:4]}a{PUZZLE[5:]},{SOLUTION},30",  # row 4 non-digit
            f"4,{contra},{SOLUTION},30",  # row 5 contradicts
            f"5,{PUZZLE.replace('3', '0')},{bad_grid},30",  # row 6 invalid grid
            f"6,{PUZZLE},{SOLUTION[:80]}0,30",  # row 7 blank in solution
            "7,123",  # row 8 missing column
            "",  # row 9 empty line, ignored
            f"8,{PUZZLE.replace('0', '.')},{SOLUTION},30",  # row 10 ok with dots
            f"9,{PUZZLE},{SOLUTION}9,30",  # row 11 long solution
        ],
    )
    data = S.read_csv(path)
    assert [(r.row, r.puzzle) for r in data.rows] == [(2, PUZZLE), (10, PUZZLE)]
    assert data.skipped == [3, 4, 5, 6, 7, 8, 11]
    w = data.warnings
    assert len(w) == 7
    assert "row 3: puzzle has 80 characters" in w[0]
    assert "row 4: puzzle has non-digit 'a' at cell 5" in w[1]
    assert "row 5: solution contradicts puzzle at cell 1 (row 1, column 1): clue 6, solution 5" in w[2]
    assert "row 6: solution is not a valid grid" in w[3]
    assert "row 7: solution has '0' at cell 81" in w[4]
    assert "row 8: expected 3 columns, got 2" in w[5]
    assert "row 11: solution has 82 characters" in w[6]


def test_read_csv_header_and_files(tmp_path):
    data = S.read_csv(_write(tmp_path / "k.csv", ["quizzes,solutions", f"{PUZZLE},{SOLUTION}"]))
    assert data.rows == [S.CsvRow(2, PUZZLE, SOLUTION)] and not data.warnings
    with pytest.raises(DGemmaError, match="row 1: expected a header"):
        S.read_csv(_write(tmp_path / "h.csv", [f"{PUZZLE},{SOLUTION}"]))
    with pytest.raises(DGemmaError, match="not found"):
        S.read_csv(tmp_path / "missing.csv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(DGemmaError, match="empty"):
        S.read_csv(tmp_path / "e.csv")


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_write_splits_from_csv(tmp_path):
    lines = ["puzzle,solution"] + [f"{PUZZLE},{SOLUTION}"] * 19 + [f"{PUZZLE[:80]},{SOLUTION}"]
    meta = T.write_splits(tmp_path / "out", csv=_write(tmp_path / "s.csv", lines))
    train, ev = _jsonl(tmp_path / "out" / "train.jsonl"), _jsonl(tmp_path / "out" / "eval.jsonl")
    assert meta["counts"] == {"train": 18, "eval": 1}
    assert meta["skipped_rows"] == [21]
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    assert len(train) == 18 and len(ev) == 1
    assert [r["id"] for r in train][:2] == ["row2", "row3"] and ev[0]["id"] == "row20"
    r = train[0]
    assert set(r) == {"id", "puzzle", "solution", "clues", "difficulty", "system", "prompt", "response"}
    assert (r["clues"], r["difficulty"], r["system"]) == (30, "medium", T.SYSTEM_PROMPT)
    assert r["prompt"] == " ".join(PUZZLE) and r["response"] == " ".join(SOLUTION)
    with pytest.raises(DGemmaError, match="no usable rows"):
        T.write_splits(tmp_path / "o2", csv=tmp_path / "s.csv", difficulty="easy")
    with pytest.raises(DGemmaError, match="exactly one"):
        T.write_splits(tmp_path / "o3", csv=tmp_path / "s.csv", n=3)


def test_split_sizes():
    assert T.split_sizes(100) == (90, 10)
    assert T.split_sizes(20) == (18, 2)
    assert T.split_sizes(1) == (1, 0)


def test_cli_prepare_sudoku_generated(tmp_path, capsys):
    out = tmp_path / "gen"
    assert main(["prepare", "sudoku", "--out", str(out), "--n", "10", "--seed", "3", "--difficulty", "mixed"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"sudoku: 9 train, 1 eval from generator -> {out}"
    recs = _jsonl(out / "train.jsonl") + _jsonl(out / "eval.jsonl")
    assert [r["difficulty"] for r in recs] == (["easy", "medium", "hard"] * 4)[:10]
    assert all(S.count_solutions(r["puzzle"]) == 1 for r in recs)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seed"] == 3 and meta["source"] == "generator"


def test_cli_prepare_sudoku_csv_reports_rows(tmp_path, capsys):
    csv = _write(tmp_path / "s.csv", ["puzzle,solution", f"{PUZZLE},{SOLUTION}", f"{PUZZLE},{PUZZLE}"])
    assert main(["prepare", "sudoku", "--out", str(tmp_path / "o"), "--csv", str(csv)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("sudoku: 1 train, 0 eval from csv:") and line.endswith("skipped 1 malformed rows: 3")
    assert main(["prepare", "sudoku", "--out", str(tmp_path / "o"), "--csv", str(tmp_path / "nope.csv")]) == 2
    assert "Sudoku CSV not found" in capsys.readouterr().err
