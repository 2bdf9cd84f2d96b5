"""dgemma solve with the shipped checkpoint: validation, boards, verdicts, unseen puzzles."""

import pytest

from dgemma.cli.main import main
from dgemma.cli.solve import SHIPPED, board, solve
from dgemma.data.sudoku import generate_puzzles

pytestmark = pytest.mark.skipif(not SHIPPED.is_dir(), reason="checkpoints/sudoku_small is not in this checkout")


@pytest.mark.parametrize("bad, message", [
    ("12345", "81 cells"),
    ("x" + "0" * 80, "'x' at cell 1"),
    ("55" + "0" * 79, "contradictory clues"),
])
def test_bad_input_is_one_clear_line(bad, message, capsys):
    assert main(["solve", bad]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_file_errors_name_the_line(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("# puzzles\n" + "0" * 81 + "\n" + "1" * 80 + "\n")
    assert main(["solve", "--file", str(f)]) == 2
    assert f"{f}:3:" in capsys.readouterr().err


def test_solves_unseen_easy_puzzles():
    from dgemma.training.runs import load_run

    puzzles = [p.puzzle if hasattr(p, "puzzle") else p["puzzle"]
               for p in generate_puzzles(8, seed=12345, difficulty="easy")]
    run = load_run(SHIPPED, device="cpu")
    results = solve(puzzles, run, steps=81, step_type="commit", seed=0)
    assert all(r["keeps_clues"] for r in results)  # clues are pinned
    assert sum(r["valid"] for r in results) >= 5  # the shipped model solves ~84% of easy puzzles


def test_cli_prints_a_board_and_a_verdict(capsys):
    p = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
    code = main(["solve", p])
    out = capsys.readouterr().out
    assert out.count("+-------+-------+-------+") == 4
    assert ("valid solution, keeps every clue" in out) == (code == 0)


def test_board_layout():
    grid = "".join(str((i % 9) + 1) for i in range(81))
    lines = board(grid).splitlines()
    assert lines[1] == "| 1 2 3 | 4 5 6 | 7 8 9 |" and len(lines) == 13
