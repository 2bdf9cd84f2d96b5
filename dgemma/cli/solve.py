"""``dgemma solve "<81 digits>"`` (or ``--file``): solve Sudoku puzzles with a trained checkpoint.

The default checkpoint is the one shipped in ``checkpoints/sudoku_avg`` (``dgemma/shipped.py``; the
weight average of two runs, ``configs/sudoku_deep.py`` and ``configs/sudoku_deep_hard.py``);
``--checkpoint DIR`` takes any Sudoku workdir (for example ``checkpoints/sudoku_small``, the
quickstart recipe's). Input is validated first (length, characters, contradictory clues). By
default every board is verified against the rules and clues and, where it breaks one, re-run from
its doubtful early commits (a branch search) up to ``--rounds`` rounds, ``--variants`` re-runs a
round (``dgemma/eval/sudoku_verify.py``): a board is printed only once it is checked valid, and a
puzzle still broken after the last round is reported unsolved, never shown as an answer.
``--no-verify`` prints the model's single answer with its verdict, valid or not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dgemma import shipped
from dgemma.errors import DGemmaError

SHIPPED = shipped.SUDOKU


def board(grid: str) -> str:
    """An 81-character grid as a 9x9 board (blanks as ``.``)."""
    rows = []
    sep = "+-------+-------+-------+"
    for r in range(9):
        if r % 3 == 0:
            rows.append(sep)
        cells = [grid[r * 9 + c] if grid[r * 9 + c] != "0" else "." for c in range(9)]
        rows.append("| " + " | ".join(" ".join(cells[b * 3:(b + 1) * 3]) for b in range(3)) + " |")
    rows.append(sep)
    return "\n".join(rows)


def read_puzzles(args) -> list[str]:
    from dgemma.data.sudoku import parse_puzzle

    puzzles = []
    if args.puzzle:
        puzzles.append(parse_puzzle(args.puzzle))
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise DGemmaError(f"puzzle file not found: {path}")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                puzzles.append(parse_puzzle(text.split(",")[0]))
            except DGemmaError as e:
                raise DGemmaError(f"{path}:{n}: {e}") from None
    if not puzzles:
        raise DGemmaError('give a puzzle ("530070000600195000...", 81 digits, 0 or . for blanks) or --file FILE')
    return puzzles


def solve(puzzles: list[str], run, *, steps: int, step_type: str, seed: int, batch_size: int = 64) -> list[dict]:
    """Sample a solution for each puzzle; returns dicts with the grid and its checks."""
    import torch

    from dgemma.data.sudoku import is_valid_grid
    from dgemma.data.sft import encode_prompts, pin_rows
    from dgemma.eval.harness import build_sampler
    from dgemma.tasks import get_task
    from dgemma.tasks.sudoku import SYSTEM_PROMPT, extract_digits, format_prompt, puzzle_hint

    task = get_task("sudoku")
    sampler, _ = build_sampler(run, task, num_steps=steps, step_type=step_type, temperature=0.0,
                               early_stopping=None)
    width = sampler.max_canvases * sampler.canvas_size
    device = next(run.model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    out = []
    for lo in range(0, len(puzzles), batch_size):
        chunk = puzzles[lo:lo + batch_size]
        records = [{"prompt": format_prompt(p), "system": SYSTEM_PROMPT, "puzzle": p} for p in chunk]
        ids, valid, _ = encode_prompts(run.tokenizer, records, run.cfg.data.prompt_len, device=device)
        hints = None
        if run.cfg.data.pin_clues:
            hints = pin_rows([puzzle_hint(p, run.tokenizer) for p in chunk], width, device)
        res = sampler(run.model, ids, valid, generator=g, hints=hints)
        for p, toks in zip(chunk, res.tokens):
            grid = extract_digits(run.tokenizer.decode(toks)) or ""
            keeps = len(grid) == 81 and all(c == "0" or c == grid[i] for i, c in enumerate(p))
            out.append({"puzzle": p, "grid": grid, "valid": len(grid) == 81 and is_valid_grid(grid) and keeps,
                        "keeps_clues": keeps})
    return out


def _verdict(r) -> str:
    return "valid solution, keeps every clue" if r["valid"] else (
        "NOT a valid solution" + ("" if r["keeps_clues"] else " (changes a clue)"))


def _model_only(results: list[dict]) -> int:
    """Today's output: each answer and its verdict, valid or not (``--no-verify``)."""
    n_ok = 0
    for i, r in enumerate(results, 1):
        if len(results) > 1:
            print(f"puzzle {i}")
        print(board(r["grid"]) if len(r["grid"]) == 81 else f"(no 81-digit answer: {r['grid']!r})")
        print(_verdict(r))
        n_ok += r["valid"]
    if len(results) > 1:
        print(f"{n_ok}/{len(results)} valid")
    return 0 if n_ok == len(results) else 1


def _rounds(n: int) -> str:
    return f"{n} round" + "s" * (n != 1)


def _verified(solves, rounds: int) -> int:
    """Each verified board (only checked-valid ones are drawn), then model-only and verified
    figures on separate lines: one mixed number would hide what the re-noising bought."""
    from dgemma.eval.sudoku_verify import summarize

    for i, s in enumerate(solves, 1):
        if len(solves) > 1:
            print(f"puzzle {i}")
        if s.valid:
            print(board(s.grid))
            how = "the model's first board" if s.rounds == 0 else f"after {_rounds(s.rounds)} of re-noising"
            print(f"valid solution, keeps every clue (verified; {how})")
        else:
            print(f"NOT solved: still breaks the rules after {_rounds(s.rounds)} of re-noising ({s.error}); "
                  "no board is shown")
        print(f"model-only: {'valid' if s.model_valid else 'NOT valid'}, {s.model_passes} forward passes | "
              f"verified: {'valid' if s.valid else 'not solved'}, {_rounds(s.rounds)}, {s.passes} forward passes")
    if len(solves) > 1:
        m, v = (summarize(solves)[k] for k in ("model_only", "verified"))
        print(f"model-only: {m['valid']}/{m['count']} valid, {m['mean_passes']:.1f} forward passes per puzzle")
        print(f"verified (up to {_rounds(rounds)}): {v['valid']}/{v['count']} valid, {v['unsolved']} not solved, "
              f"{v['mean_rounds']:.2f} rounds and {v['mean_passes']:.1f} forward passes per puzzle")
    return 0 if all(s.valid for s in solves) else 1


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgemma solve", description=__doc__.splitlines()[0])
    parser.add_argument("puzzle", nargs="?", help="81 cells: digits, 0 or . for a blank (spaces ignored)")
    parser.add_argument("--file", help="one puzzle per line (a CSV's first column also works); # comments")
    parser.add_argument("--checkpoint", default=str(SHIPPED), help="a Sudoku training workdir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--steps", type=int, default=81, help="denoising steps")
    parser.add_argument("--step-type", default="commit", help="ddim | commit | confidence | entropy_bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64, help="boards denoised together (a --file's puzzles)")
    default_rounds, default_variants = _verify_defaults()
    parser.add_argument("--rounds", type=int, default=None,
                        help="re-noising rounds for a board that breaks a rule (default: %d)" % default_rounds)
    parser.add_argument("--variants", type=int, default=None,
                        help="re-runs a broken board tries per round, batched (default: %d)" % default_variants)
    parser.add_argument("--no-verify", action="store_true", help="print the model's single answer, valid or not")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="inference dtype (auto: the run's training precision; the shipped model trained in fp32)")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.no_verify:
        raise DGemmaError("--rounds and --no-verify exclude each other (--rounds=0 verifies without re-noising)")
    if args.rounds is not None and args.rounds < 0:
        raise DGemmaError(f"--rounds must be >= 0, got {args.rounds}")
    if args.variants is not None and args.no_verify:
        raise DGemmaError("--variants and --no-verify exclude each other (variants are re-runs of a broken board)")
    if args.variants is not None and args.variants < 1:
        raise DGemmaError(f"--variants must be >= 1, got {args.variants}")
    if args.batch_size < 1:
        raise DGemmaError(f"--batch-size must be >= 1, got {args.batch_size}")
    puzzles = read_puzzles(args)

    from dgemma.training.runs import load_run

    if not Path(args.checkpoint).is_dir():
        raise DGemmaError(f"checkpoint not found: {args.checkpoint} "
                          "(train one with configs/sudoku_small.py or configs/sudoku_deep.py)")
    t0 = time.perf_counter()
    run_ = load_run(args.checkpoint, step=args.step, device="cpu", dtype=args.dtype)
    t1 = time.perf_counter()
    if args.no_verify:
        results = solve(puzzles, run_, steps=args.steps, step_type=args.step_type, seed=args.seed,
                        batch_size=args.batch_size)
        _timing(len(puzzles), t1 - t0, time.perf_counter() - t1, "model only")
        return _model_only(results)
    from dgemma.eval.sudoku_verify import solve_run

    rounds = default_rounds if args.rounds is None else args.rounds
    variants = default_variants if args.variants is None else args.variants
    solves = solve_run(run_, puzzles, rounds=rounds, num_steps=args.steps, step_type=args.step_type, seed=args.seed,
                       batch_size=args.batch_size, variants=variants)
    _timing(len(puzzles), t1 - t0, time.perf_counter() - t1, f"verified, up to {_rounds(rounds)}")
    return _verified(solves, rounds)


def _timing(n: int, load_s: float, solve_s: float, mode: str) -> None:
    """Wall time on stderr (stdout stays the boards): loading apart from solving."""
    print(f"[dgemma] solve: {n} puzzle{'s' * (n != 1)} in {solve_s:.2f} s ({solve_s / max(n, 1):.2f} s a board, "
          f"{mode}) after loading the model in {load_s:.1f} s", file=sys.stderr)


def _verify_defaults() -> tuple[int, int]:
    """Verified mode's default rounds and variants (imported late: the module needs torch)."""
    from dgemma.eval.sudoku_verify import DEFAULT_ROUNDS, DEFAULT_VARIANTS

    return DEFAULT_ROUNDS, DEFAULT_VARIANTS
