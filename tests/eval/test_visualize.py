"""Denoising pictures from hand-made trajectories: cell kinds, colours, frames, files."""

import json

from PIL import Image

from dgemma.data.char_tokenizer import CharTokenizer
from dgemma.eval import visualize as viz

TOK = CharTokenizer.named("digits")
D = {str(d): TOK.encode(str(d))[0] for d in range(10)}  # digit -> token id
MASK, EOS = TOK.mask_id, TOK.eos_id
PUZZLE = "5" + "0" * 80  # one clue, in cell 0


def step(canvas, i, tokens, committed, argmax, t=0.5):
    return {"canvas": canvas, "step": i, "t": t, "tokens": tokens, "committed": committed, "argmax": argmax}


def board_trajectory():
    """Two steps of an 81-cell canvas: cell 1 committed at the first, the rest masked with guesses."""
    guess = [D["7"]] * 81
    s0 = step(0, 0, [MASK, D["3"]] + [MASK] * 79, [False, True] + [False] * 79, guess, t=1.0)
    s1 = step(0, 1, [D["5"], D["3"], D["4"]] + [MASK] * 78, [True, True, True] + [False] * 78, guess)
    return [s0, s1]


def pixel(img, row, col, dx=3, dy=3):
    x, y = viz.cell_origin(row, col)
    return img.getpixel((x + dx, y + dy))


def test_three_cell_kinds_have_distinct_colours():
    frames = viz.trajectory_frames(board_trajectory(), output=[], canvas_size=81)
    cells = viz.sudoku_cells(frames[0], PUZZLE, viz.token_piece(TOK), stop_ids=(EOS,))
    assert cells[:3] == [("5", "clue"), ("3", "committed"), ("7", "noisy")]
    img = viz.render_sudoku(cells, "step 1")
    clue, committed, noisy = pixel(img, 0, 0), pixel(img, 0, 1), pixel(img, 0, 2)
    assert (clue, committed, noisy) == (viz.CLUE_BG, viz.COMMITTED_BG, viz.NOISY_BG)
    assert len({clue, committed, noisy}) == 3
    assert pixel(img, 8, 8) == viz.NOISY_BG


def test_digit_colours_differ_by_kind():
    cells = [("8", "clue"), ("8", "committed"), ("8", "noisy")] + [("", "noisy")] * 78
    img = viz.render_sudoku(cells)

    def channel_minima(col):
        x, y = viz.cell_origin(0, col)
        box = img.crop((x + 4, y + 4, x + viz.CELL - 4, y + viz.CELL - 4))
        return [lo for lo, _ in box.getextrema()]

    clue, committed, noisy = channel_minima(0), channel_minima(1), channel_minima(2)
    assert max(clue) < 60  # black digit
    assert committed[0] < 100 and committed[2] > 200  # blue digit: red drops, blue stays
    assert min(noisy) > 120  # faint guess


def test_digits_fill_in_order_and_committed_stop_ends_answer():
    frame = viz.Frame([(D["1"], True), (D["2"], False), (EOS, False), (D["3"], True), (EOS, True), (D["4"], True)],
                      "x")
    cells = viz.sudoku_cells(frame, "0" * 81, viz.token_piece(TOK), stop_ids=(EOS,))
    assert cells[:4] == [("1", "committed"), ("2", "noisy"), ("3", "committed"), ("", "noisy")]
    assert len(cells) == 81


def test_ddim_trajectory_counts_agreement_as_committed():
    s = step(0, 0, [D["1"], D["2"]], [False, False], [D["1"], D["9"]])
    frames = viz.trajectory_frames([s], output=[D["1"], D["9"]], canvas_size=2)
    assert frames[0].pieces == [(D["1"], True), (D["9"], False)]
    assert frames[-1].pieces == [(D["1"], True), (D["9"], True)] and frames[-1].title == "output"


def test_earlier_canvases_shown_committed():
    s = step(1, 0, [MASK, MASK], [False, False], [D["5"], D["6"]])
    frame = viz.trajectory_frames([s], output=[D["1"], D["2"], D["5"], D["6"]], canvas_size=2)[0]
    assert frame.pieces == [(D["1"], True), (D["2"], True), (D["5"], False), (D["6"], False)]
    assert frame.title.startswith("canvas 1  step 1")


def test_gif_and_strip(tmp_path):
    traj = board_trajectory()
    out = [D["5"], D["3"], D["4"]] + [D["1"]] * 78
    gif, png = viz.visualize_example("sudoku", traj, out, TOK, tmp_path / "ex0", canvas_size=81,
                                     stop_ids=(EOS,), puzzle=PUZZLE)
    with Image.open(gif) as im:
        assert im.n_frames == 3  # two steps and the output
    with Image.open(png) as im:
        board = viz.render_sudoku([("", "noisy")] * 81)
        assert im.size == (3 * board.width + 2 * 4, board.height)


def test_text_frames_grey_out_noisy_tokens(tmp_path):
    piece = viz.token_piece(TOK)
    committed, noisy = viz.render_text_frames([viz.Frame([(D["8"], True)], ""), viz.Frame([(D["8"], False)], "")],
                                              piece)
    assert committed.size == noisy.size
    assert committed.convert("L").getextrema()[0] < 60
    assert noisy.convert("L").getextrema()[0] > 150
    traj = [step(0, i, [D["1"]] * 4, [i > 0] * 4, [D["2"]] * 4) for i in range(2)]
    gif, png = viz.visualize_example("text", traj, [D["1"]] * 4, TOK, tmp_path / "t", canvas_size=4)
    with Image.open(gif) as im:
        assert im.n_frames > 1
    assert png.is_file()


def test_pick_keeps_first_and_last():
    assert viz.pick(3, 8) == [0, 1, 2]
    assert viz.pick(20, 5) == [0, 5, 10, 14, 19]


def test_plot_reads_last_value_per_step_and_eval_files(tmp_path):
    from dgemma.cli.plot import plot, read_eval_files, read_metrics

    rows = [{"step": 1, "split": "train", "loss": 3.0, "lr": 1e-3, "grad_norm": 2.0},
            {"step": 2, "split": "train", "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0},
            {"step": 2, "event": "rollback"},
            {"step": 2, "split": "train", "loss": 2.5, "lr": 1e-3, "grad_norm": 1.5},
            {"step": 2, "split": "eval", "sample_ar_steps8/accuracy": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    (tmp_path / "eval" / "sample_ar_steps8").mkdir(parents=True)
    (tmp_path / "eval" / "sample_ar_steps8" / "step_2.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}}))
    train, evals = read_metrics(tmp_path)
    assert train["loss"] == {1: 3.0, 2: 2.5}
    assert evals["sample_ar_steps8/accuracy"] == {2: 0.25}
    assert read_eval_files(tmp_path) == {"sample_ar_steps8": {2: 0.5}}
    out = plot(tmp_path, tmp_path / "c.png")
    with Image.open(out) as im:
        assert im.size[1] > im.size[0]  # four stacked panels
