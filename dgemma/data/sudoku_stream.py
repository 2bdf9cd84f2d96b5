"""An endless, indexable stream of Sudoku training examples, generated on the fly.

Example ``i`` is a pure function of ``(seed, i)``: a transformed image of a grid from a small
seeded pool (docs/design.md §11: transforms make ~274k distinct grids/s) with a random number of cells
blanked. Uniqueness is not required for training (a model trained on non-unique random blanks
still solves unique puzzles), which is what makes generation free. Evaluation uses held-out
unique puzzles drawn from fresh grids (``dgemma prepare sudoku``), never this pool.
"""

from __future__ import annotations

import random

from dgemma.data.sft import Example, collate, encode_example
from dgemma.data.sudoku import SYSTEM_PROMPT, format_prompt, format_response, random_grid, transform_grid


class SudokuStream:
    def __init__(self, tokenizer, *, prompt_len: int, num_canvases: int, canvas_size: int, seed: int = 0,
                 clues: tuple[int, int] = (17, 50), pool: int = 512, size: int = 10_000_000, hint_fn=None):
        rnd = random.Random(seed)
        self.pool = [random_grid(rnd) for _ in range(pool)]
        self.tokenizer, self.seed, self.clues, self.size = tokenizer, seed, clues, size
        self.kw = {"prompt_len": prompt_len, "num_canvases": num_canvases, "canvas_size": canvas_size,
                   "hint_fn": hint_fn}
        self.prompt_len, self.pad_id = prompt_len, tokenizer.pad_id

    def __len__(self) -> int:
        return self.size

    def record(self, i: int) -> dict:
        rnd = random.Random(self.seed * 1_000_003 + i)
        solution = transform_grid(rnd.choice(self.pool), rnd)
        keep = set(rnd.sample(range(81), rnd.randint(*self.clues)))
        puzzle = "".join(c if n in keep else "0" for n, c in enumerate(solution))
        return {"id": f"stream-{i}", "system": SYSTEM_PROMPT, "prompt": format_prompt(puzzle),
                "response": format_response(solution), "puzzle": puzzle, "solution": solution}

    def example(self, i: int) -> Example:
        return encode_example(self.tokenizer, self.record(i), **self.kw)

    def batch(self, indices: list[int]):
        return collate([self.example(i) for i in indices], prompt_len=self.prompt_len, pad_id=self.pad_id)
