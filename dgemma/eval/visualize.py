"""Pictures of a canvas being denoised: an animated GIF and a static PNG strip per example.

Input is one row's trajectory from :class:`~dgemma.diffusion.sampler.SampleResult` (``record=True``):
one dict per denoising step with the canvas index, step, time, ``tokens`` (x_t after the step),
``committed`` and ``argmax`` (the model's current guess). A position counts as *committed* when
the step committed it; for steps that commit nothing (``ddim``) it counts as committed once its
token equals the model's guess. Uncommitted positions are *noisy*: drawn faint, showing the guess.
Earlier canvases of the example are drawn as committed; the last frame is the emitted output.

Sudoku: a 9x9 board. Clues (from the puzzle) are black on grey, committed cells blue on white,
noisy cells a faint guess on light grey. Digits are read from the canvas in order, so a response
of 81 space-separated digits fills the board row by row. Text: the tokens flowed in lines,
committed ones black, noisy ones light grey.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

CLUE_BG, CLUE_FG = (185, 185, 185), (0, 0, 0)
COMMITTED_BG, COMMITTED_FG = (255, 255, 255), (25, 75, 215)
NOISY_BG, NOISY_FG = (236, 236, 236), (175, 175, 175)
TEXT_FG, TEXT_NOISY_FG, HEADER_FG = (0, 0, 0), (180, 180, 180), (90, 90, 90)
GRID_FG = (40, 40, 40)
CELL, MARGIN, HEADER = 28, 8, 20
TEXT_WIDTH = 720


@dataclass
class Frame:
    """One picture's content: ``(piece, committed)`` per canvas position, in order, and a title."""

    pieces: list[tuple[int, bool]]  # (token id shown, committed)
    title: str


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: bitmap font only
        return ImageFont.load_default()


def trajectory_frames(trajectory: Sequence[dict], output: Sequence[int], canvas_size: int) -> list[Frame]:
    """Frames for every recorded step, then the emitted output (all committed)."""
    commits = any(any(s["committed"]) for s in trajectory)
    frames = []
    for s in trajectory:
        done = [(t, True) for t in output[: s["canvas"] * canvas_size]]
        now = []
        for tok, com, guess in zip(s["tokens"], s["committed"], s["argmax"]):
            settled = com if commits else tok == guess
            now.append((tok, True) if settled else (guess, False))
        frames.append(Frame(done + now, f"canvas {s['canvas']}  step {s['step'] + 1}  t={s['t']:.2f}"))
    frames.append(Frame([(t, True) for t in output], "output"))
    return frames


def sudoku_cells(frame: Frame, puzzle: str, piece: Callable[[int], str],
                 stop_ids: Sequence[int] = ()) -> list[tuple[str, str]]:
    """``(digit or "", kind)`` for the 81 cells; kind is ``clue``, ``committed`` or ``noisy``.

    Digits are taken in order from the shown pieces; a committed stop token ends the answer, a
    guessed one is skipped.
    """
    cells: list[tuple[str, str]] = []
    for tok, committed in frame.pieces:
        if tok in stop_ids:
            if committed:
                break
            continue
        cells += [(ch, "committed" if committed else "noisy") for ch in piece(tok) if ch.isdigit()]
        if len(cells) >= 81:
            break
    cells = (cells + [("", "noisy")] * 81)[:81]
    return [(p, "clue") if p not in "0." else c for p, c in zip(puzzle, cells)]


def cell_origin(row: int, col: int) -> tuple[int, int]:
    """Top-left pixel of a cell in a rendered board."""
    return MARGIN + col * CELL, HEADER + MARGIN + row * CELL


def render_sudoku(cells: Sequence[tuple[str, str]], title: str = "") -> Image.Image:
    size = 9 * CELL + 2 * MARGIN
    img = Image.new("RGB", (size, size + HEADER), "white")
    draw = ImageDraw.Draw(img)
    font, small = _font(18), _font(12)
    draw.text((MARGIN, 3), title, fill=HEADER_FG, font=small)
    colours = {"clue": (CLUE_BG, CLUE_FG), "committed": (COMMITTED_BG, COMMITTED_FG), "noisy": (NOISY_BG, NOISY_FG)}
    for i, (digit, kind) in enumerate(cells):
        x, y = cell_origin(i // 9, i % 9)
        bg, fg = colours[kind]
        draw.rectangle([x, y, x + CELL, y + CELL], fill=bg)
        if digit:
            draw.text((x + CELL / 2, y + CELL / 2), digit, fill=fg, font=font, anchor="mm")
    for k in range(10):
        w = 3 if k % 3 == 0 else 1
        x0, y0 = cell_origin(k, k)
        draw.line([MARGIN, y0, MARGIN + 9 * CELL, y0], fill=GRID_FG, width=w)
        draw.line([x0, HEADER + MARGIN, x0, HEADER + MARGIN + 9 * CELL], fill=GRID_FG, width=w)
    return img


def _layout(frame: Frame, piece: Callable[[int], str], font, width: int, stop_ids) -> tuple[list, int]:
    """``[(x, y, text, colour)]`` of the flowed tokens and the height they need."""
    line_h = font.size + 5 if hasattr(font, "size") else 14
    x, y, out = MARGIN, HEADER + MARGIN, []
    for tok, committed in frame.pieces:
        colour = TEXT_FG if committed else TEXT_NOISY_FG
        for n, part in enumerate(piece(tok).split("\n")):
            if n:
                x, y = MARGIN, y + line_h
            w = font.getlength(part)
            if x + w > width - MARGIN and x > MARGIN:
                x, y = MARGIN, y + line_h
                part = part.lstrip()
                w = font.getlength(part)
            out.append((x, y, part, colour))
            x += w
        if committed and tok in stop_ids:
            break
    return out, y + line_h + MARGIN


def render_text_frames(frames: Sequence[Frame], piece: Callable[[int], str], stop_ids: Sequence[int] = (),
                       width: int = TEXT_WIDTH) -> list[Image.Image]:
    """Equal-sized images of the flowed tokens of each frame."""
    font, small = _font(13), _font(12)
    layouts = [_layout(f, piece, font, width, stop_ids) for f in frames]
    height = max(h for _, h in layouts)
    images = []
    for f, (items, _) in zip(frames, layouts):
        img = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(img)
        draw.text((MARGIN, 3), f.title, fill=HEADER_FG, font=small)
        for x, y, text, colour in items:
            draw.text((x, y), text, fill=colour, font=font)
        images.append(img)
    return images


def save_gif(images: Sequence[Image.Image], path: str | Path, ms: int = 150, hold_ms: int = 1500) -> Path:
    """An endlessly looping GIF; the last frame (the output) is held longer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    durations = [ms] * (len(images) - 1) + [hold_ms]
    images[0].save(path, save_all=True, append_images=list(images[1:]), duration=durations, loop=0)
    return path


def pick(n: int, k: int) -> list[int]:
    """``min(n, k)`` evenly spaced indices of ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def save_strip(images: Sequence[Image.Image], path: str | Path, *, max_frames: int = 8,
               horizontal: bool = True, gap: int = 4) -> Path:
    """Evenly spaced frames side by side (or stacked) in one PNG."""
    chosen = [images[i] for i in pick(len(images), max_frames)]
    w, h = chosen[0].size
    size = (len(chosen) * (w + gap) - gap, h) if horizontal else (w, len(chosen) * (h + gap) - gap)
    strip = Image.new("RGB", size, "white")
    for i, img in enumerate(chosen):
        strip.paste(img, (i * (w + gap), 0) if horizontal else (0, i * (h + gap)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strip.save(path)
    return path


def token_piece(tokenizer) -> Callable[[int], str]:
    """Token id -> its text (special tokens by name), cached."""
    cache: dict[int, str] = {}

    def piece(tok: int) -> str:
        if tok not in cache:
            cache[tok] = tokenizer.decode([tok], skip_special=False)
        return cache[tok]

    return piece


def visualize_example(kind: str, trajectory: Sequence[dict], output: Sequence[int], tokenizer, out_stem: str | Path,
                      *, canvas_size: int, stop_ids: Sequence[int] = (), puzzle: str | None = None) -> list[Path]:
    """Write ``<out_stem>.gif`` and ``<out_stem>.png`` for one example; ``kind`` is ``sudoku`` or ``text``."""
    frames = trajectory_frames(trajectory, output, canvas_size)
    piece = token_piece(tokenizer)
    if kind == "sudoku":
        images = [render_sudoku(sudoku_cells(f, puzzle or "0" * 81, piece, stop_ids), f.title) for f in frames]
    else:
        images = render_text_frames(frames, piece, stop_ids)
    return [save_gif(images, f"{out_stem}.gif"),
            save_strip(images, f"{out_stem}.png", horizontal=kind == "sudoku")]
