"""Sudoku: prompts, preparation, training stream, clue pinning, answer extraction and scoring.

Grids and puzzles are 81-character strings in row-major order, ``"0"`` for a blank. The rules
(checks, solver, generator, CSV reading) are the pure board library :mod:`dgemma.data.sudoku`;
this module is what makes them a task: the prompt (the puzzle as 81 space-separated digits under
:data:`SYSTEM_PROMPT`), the response (the solution the same way), ``dgemma prepare sudoku``, the
endless training stream (:class:`SudokuStream`) or prepared files, the pinned clues of
infilling (``data.pin_clues``), the held-out eval puzzles and the metrics (overall and per
difficulty bucket: easy >= 40 clues, medium 30-39, hard < 30). Pure Python at import.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from dgemma.data.sudoku import (DIFFICULTIES, count_clues, difficulty, generate_puzzles, grid_error, parse_puzzle,
                                parse_solution, random_grid, read_csv, transform_grid, transform_puzzle)
from dgemma.data.sudoku import difficulty as bucket_of  # write_splits' argument shadows the name
from dgemma.errors import DGemmaError
from dgemma.tasks.base import Task, canvas_shape, count, data_dir

SYSTEM_PROMPT = (
    "Solve the following Sudoku puzzle. Empty cells are represented by 0. Output ONLY the solved puzzle"
)

_ANSWER_MARK = re.compile(r"the answer is", re.IGNORECASE)


def format_prompt(puzzle: str) -> str:
    """The user turn of docs/design.md §5: the puzzle as 81 space-separated digits (0 for a blank)."""
    return " ".join(parse_puzzle(puzzle))



def format_response(solution: str) -> str:
    """The target of docs/design.md §5: the solution as 81 space-separated digits; must be a valid grid."""
    return " ".join(parse_solution(solution))



def extract_digits(text: str) -> str | None:
    """The model's 81 answer digits from decoded text, or None.

    If the text says "the answer is" (any case), the first 81 digits after its last occurrence
    are the answer, and fewer than 81 there gives None: an announced answer that is incomplete is
    wrong, and taking digits from before the announcement would grade the working, not the
    answer. Otherwise the last 81 digits of the text (trailing digits are where a model that
    reasons first puts its grid).
    """
    if not isinstance(text, str):
        return None
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        digits = [ch for ch in text[marks[-1].end():] if "0" <= ch <= "9"]
        return "".join(digits[:81]) if len(digits) >= 81 else None
    digits = [ch for ch in text if "0" <= ch <= "9"]
    return "".join(digits[-81:]) if len(digits) >= 81 else None



def make_record(id: str, puzzle: str, solution: str) -> dict:
    """The JSONL record of one puzzle: ids, the strings, clue count, bucket and the chat texts."""
    clues = count_clues(puzzle)
    return {
        "id": id,
        "puzzle": puzzle,
        "solution": solution,
        "clues": clues,
        "difficulty": difficulty(clues),
        "system": SYSTEM_PROMPT,
        "prompt": format_prompt(puzzle),
        "response": format_response(solution),
    }



def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)



def split_sizes(n: int) -> tuple[int, int]:
    """90/10 split sizes: ``ceil(0.9 n)`` train, the rest eval (100 -> 90/10, 20 -> 18/2)."""
    n_train = (9 * n + 9) // 10
    return n_train, n - n_train



def write_splits(out_dir, *, csv=None, n: int | None = None, seed: int = 0, difficulty: str = "mixed") -> dict:
    """Write ``train.jsonl``, ``eval.jsonl`` (90/10 in file order) and ``meta.json``; return the meta.

    Source: a Kaggle CSV (``csv=``; ``difficulty`` other than ``'mixed'`` keeps only that bucket)
    or the generator (``n=`` unique puzzles, ``seed``, ``difficulty``). Exactly one is required.
    """
    if (csv is None) == (n is None):
        raise DGemmaError("sudoku write_splits: give exactly one of csv=FILE or n=COUNT")
    if difficulty not in (*DIFFICULTIES, "mixed"):
        raise DGemmaError(f"difficulty must be one of easy, medium, hard, mixed; got {difficulty!r}")
    warnings: list[str] = []
    skipped: list[int] = []
    if csv is not None:
        data = read_csv(csv)
        warnings, skipped = data.warnings, data.skipped
        kept = [r for r in data.rows if difficulty == "mixed" or bucket_of(count_clues(r.puzzle)) == difficulty]
        if not kept:
            raise DGemmaError(
                f"{csv}: no usable rows (difficulty={difficulty}, {len(data.rows)} valid, {len(skipped)} malformed)"
            )
        records = [make_record(f"row{r.row}", r.puzzle, r.solution) for r in kept]
        source = f"csv:{Path(csv).resolve()}"
    else:
        recs = generate_puzzles(n, seed=seed, difficulty=difficulty)
        records = [make_record(f"gen-s{seed}-{k:06d}", r["puzzle"], r["solution"]) for k, r in enumerate(recs)]
        source = "generator"
    n_train, _ = split_sizes(len(records))
    splits = {"train": records[:n_train], "eval": records[n_train:]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, recs in splits.items():
        _write_jsonl(out / f"{name}.jsonl", recs)
    meta = {
        "task": "sudoku",
        "source": source,
        "seed": seed if csv is None else None,
        "difficulty": difficulty,
        "counts": {name: len(recs) for name, recs in splits.items()},
        "difficulty_counts": {
            name: {b: sum(r["difficulty"] == b for r in recs) for b in DIFFICULTIES} for name, recs in splits.items()
        },
        "skipped_rows": skipped,
        "warnings": warnings[:1000],
        "system": SYSTEM_PROMPT,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta



def puzzle_hint(puzzle: str, tokenizer) -> list[int]:
    """The clue tokens of ``puzzle`` at their cells, ``-1`` at blanks (needs one token per cell)."""
    ids = tokenizer.encode(puzzle)
    if len(ids) != 81:
        raise DGemmaError("pinning Sudoku clues needs one token per cell (data.tokenizer='digits'); this "
                          f"tokenizer maps the 81 cells to {len(ids)} tokens")
    return [tok if puzzle[i] != "0" else -1 for i, tok in enumerate(ids)]



def clue_hint(record: dict, response_ids: list[int], tokenizer) -> list[int]:
    """Pin the clues of ``record["puzzle"]`` in the solution canvas (infilling): token ids where
    the puzzle has a digit, ``-1`` at blanks.

    Needs one token per cell, in order (the ``digits`` tokenizer); a tokenizer that merges or
    splits digits cannot say which canvas position holds which cell, so it is refused.
    """
    puzzle, solution = record["puzzle"], record["solution"]
    if len(response_ids) < 81 or tokenizer.decode(response_ids[:81]) != solution:
        raise DGemmaError("pinning Sudoku clues needs one token per cell (data.tokenizer='digits'); "
                          "this tokenizer does not map the 81 solution digits to 81 tokens")
    return puzzle_hint(puzzle, tokenizer)


# ------------------------------------------------------------------------------------ training stream
class SudokuStream:
    """An endless, indexable stream of Sudoku training examples, generated on the fly.

    Example ``i`` is a pure function of ``(seed, i)``: a transformed image of a grid from a small
    seeded pool (docs/design.md §11: transforms make ~274k distinct grids/s) with a random number of cells
    blanked. Uniqueness is not required for training (a model trained on non-unique random blanks
    still solves unique puzzles), which is what makes generation free. Evaluation uses held-out
    unique puzzles drawn from fresh grids (``dgemma prepare sudoku``), never this pool.

    ``unique_share`` > 0 draws that share of the examples from a pool of ``unique_pool`` puzzles
    with exactly one solution and ``unique_clues`` clues (generated once, from grids of their own
    seed, never the evaluation seed), each shown as a fresh :func:`transform_puzzle` image. A
    random blanking of 17-29 cells has many solutions, so its target is one guess among them and
    its loss cannot reach zero; on a unique puzzle every blank is determined, which is what the
    hard evaluation boards ask for. Building the pool takes about a second per 60 hard puzzles.
    """

    def __init__(self, tokenizer, *, prompt_len: int, num_canvases: int, canvas_size: int, seed: int = 0,
                 clues: tuple[int, int] = (17, 50), pool: int = 512, size: int = 10_000_000, hint_fn=None,
                 response_end: str = "end_of_turn", unique_share: float = 0.0, unique_pool: int = 2000,
                 unique_clues: tuple[int, int] = (22, 35)):
        if not 0.0 <= unique_share <= 1.0:
            raise DGemmaError(f"the share of unique puzzles must be in [0, 1], got {unique_share}")
        rnd = random.Random(seed)
        self.pool = [random_grid(rnd) for _ in range(pool)]
        self.tokenizer, self.seed, self.clues, self.size = tokenizer, seed, clues, size
        self.unique_share = unique_share
        self.unique = []
        if unique_share > 0:
            if unique_pool < 1:
                raise DGemmaError(f"a share of unique puzzles needs a pool of at least 1, got {unique_pool}")
            import numpy as np

            recs = generate_puzzles(unique_pool, seed=np.random.default_rng([seed, 0x50D0]), clues=unique_clues)
            self.unique = [(r["puzzle"], r["solution"]) for r in recs]
        self.kw = {"prompt_len": prompt_len, "num_canvases": num_canvases, "canvas_size": canvas_size,
                   "hint_fn": hint_fn, "response_end": response_end}
        self.prompt_len, self.pad_id = prompt_len, tokenizer.pad_id

    def __len__(self) -> int:
        return self.size

    def record(self, i: int) -> dict:
        rnd = random.Random(self.seed * 1_000_003 + i)
        if self.unique_share and rnd.random() < self.unique_share:
            puzzle, solution = transform_puzzle(*rnd.choice(self.unique), rnd)
        else:
            solution = transform_grid(rnd.choice(self.pool), rnd)
            keep = set(rnd.sample(range(81), rnd.randint(*self.clues)))
            puzzle = "".join(c if n in keep else "0" for n, c in enumerate(solution))
        return {"id": f"stream-{i}", "system": SYSTEM_PROMPT, "prompt": format_prompt(puzzle),
                "response": format_response(solution), "puzzle": puzzle, "solution": solution}

    def example(self, i: int):
        from dgemma.data.sft import encode_example  # torch: imported by the trainer, not by this module

        return encode_example(self.tokenizer, self.record(i), **self.kw)

    def batch(self, indices: list[int]):
        from dgemma.data.sft import collate

        return collate([self.example(i) for i in indices], prompt_len=self.prompt_len, pad_id=self.pad_id)


# ------------------------------------------------------------------------------------ metrics
METRICS = (
    "accuracy",
    "cell_accuracy",
    "blank_accuracy",
    "exact_mask_accuracy",
    "partial_mask_accuracy",
    "valid_accuracy",
)


def score_sudoku(text: str, puzzle: str, solution: str) -> dict:
    """Score one decoded output against its puzzle and solution.

    The answer is the 81 digits :func:`~dgemma.data.sudoku.extract_digits` finds; without them
    every metric is 0 (an output we cannot read has solved nothing and kept no clue).
    ``cell_accuracy`` divides the correctly filled blanks by 81, the reference's definition, kept
    so numbers stay comparable; ``blank_accuracy`` divides by the number of blanks (1.0 for a
    puzzle without blanks when the output is correct). ``partial_mask_accuracy`` is the fraction
    of clues unchanged (1.0 for a puzzle without clues). ``valid_accuracy`` accepts any completed
    valid grid that keeps every clue, so a puzzle with several solutions is not marked wrong.
    Returns the metrics plus ``parsed``, ``prediction``, ``clues`` and ``difficulty``.
    """
    puzzle = parse_puzzle(puzzle)
    solution = parse_solution(solution)
    for i, (p, s) in enumerate(zip(puzzle, solution)):
        if p != "0" and p != s:
            raise DGemmaError(f"solution contradicts its puzzle at cell {i + 1}: clue {p}, solution {s}")
    clues = count_clues(puzzle)
    pred = extract_digits(text)
    out = {"parsed": pred is not None, "prediction": pred, "clues": clues, "difficulty": difficulty(clues)}
    if pred is None:
        return {**out, **{m: 0.0 for m in METRICS}}
    blank_hits = sum(p == "0" and a == s for p, a, s in zip(puzzle, pred, solution))
    clue_kept = sum(p != "0" and a == p for p, a in zip(puzzle, pred))
    blanks = 81 - clues
    correct = pred == solution
    kept_all = clue_kept == clues
    out.update(
        accuracy=float(correct),
        cell_accuracy=blank_hits / 81,
        blank_accuracy=blank_hits / blanks if blanks else float(correct),
        exact_mask_accuracy=float(kept_all),
        partial_mask_accuracy=clue_kept / clues if clues else 1.0,
        valid_accuracy=float(kept_all and grid_error(pred) is None),
    )
    return out


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0


def aggregate_sudoku(scores: list[dict]) -> dict:
    """Average per-example scores into the metric keys; an empty bucket reports 0.0, count 0.

    0.0 (not NaN or a missing key) keeps every key present and every value a float for
    TensorBoard and JSONL; ``count_<bucket>`` = 0 says the zero is no measurement.
    """
    out: dict = {m: _mean(scores, m) for m in METRICS}
    out["count"] = len(scores)
    for b in DIFFICULTIES:
        rows = [s for s in scores if s["difficulty"] == b]
        out.update({f"{m}_{b}": _mean(rows, m) for m in METRICS})
        out[f"count_{b}"] = len(rows)
    return out


def sudoku_metrics(texts, puzzles, solutions) -> dict:
    """Sudoku metrics over a batch: the six metrics, again per bucket, and counts.

    Keys: ``accuracy``, ``cell_accuracy``, ``blank_accuracy``, ``exact_mask_accuracy``,
    ``partial_mask_accuracy``, ``valid_accuracy``, each also with ``_easy``/``_medium``/``_hard``,
    plus ``count`` and ``count_easy``/``count_medium``/``count_hard``. Buckets come from the
    puzzle's clue count; a bucket with no items reports 0.0 for its metrics and count 0.
    """
    texts, puzzles, solutions = list(texts), list(puzzles), list(solutions)
    if not len(texts) == len(puzzles) == len(solutions):
        raise DGemmaError(
            f"sudoku_metrics: got {len(texts)} texts, {len(puzzles)} puzzles and {len(solutions)} solutions; "
            "they must be the same length"
        )
    scores = []
    for k, (t, p, s) in enumerate(zip(texts, puzzles, solutions)):
        try:
            scores.append(score_sudoku(t, p, s))
        except DGemmaError as e:
            raise DGemmaError(f"sudoku_metrics: example {k}: {e}") from None
    return aggregate_sudoku(scores)


# ------------------------------------------------------------------------------------ eval puzzles
SUDOKU_EVAL_SEED = 7_919
"""Seed of the generated Sudoku eval puzzles (``eval_ds.puzzle_seed``'s default): one fixed
held-out set for every run and sampling seed, so numbers compare across runs
(``--cfg.eval_ds.puzzle_seed=N`` picks another). They come from fresh grids, never the training
stream's pool."""


def eval_puzzle_seed(cfg) -> int:
    return cfg.eval_ds.puzzle_seed


def generate_eval_puzzles(n: int, *, seed: int) -> list[dict]:
    """``n`` unique-solution puzzles from fresh grids, easy/medium/hard in turn (any prefix is
    balanced, and the first ``k`` of ``n`` equal those of ``k``), as prepared-file records."""
    recs = generate_puzzles(n, seed=seed, difficulty="mixed")
    return [make_record(f"gen-eval-s{seed}-{k:06d}", r["puzzle"], r["solution"]) for k, r in enumerate(recs)]


def _rows(rows: list[int], shown: int = 10) -> str:
    head = ", ".join(map(str, rows[:shown]))
    return head + (f", ... ({len(rows) - shown} more)" if len(rows) > shown else "")


# ------------------------------------------------------------------------------------ the task
class SudokuTask(Task):
    """Eval split ``eval``: ``<data.path>/eval.jsonl`` (``dgemma prepare sudoku``), or without a
    ``data.path`` unique puzzles generated from fresh grids with :data:`SUDOKU_EVAL_SEED`,
    difficulties cycling easy, medium, hard. Training: the prepared ``train.jsonl``, or without a
    ``data.path`` the endless generated stream."""

    name = "sudoku"
    splits = ("eval",)
    primary = ("accuracy", "cell_accuracy", "valid_accuracy")
    viz = "sudoku"
    fields = ("puzzle", "solution")
    prepare_help = "write Sudoku train/eval JSONL from a Kaggle CSV or the generator"

    def record(self, puzzle: str, id: str = "puzzle") -> dict:
        """The prompt record of one board to solve (``{id, system, prompt, puzzle}``)."""
        puzzle = parse_puzzle(puzzle)
        return {"id": id, "system": SYSTEM_PROMPT, "prompt": format_prompt(puzzle), "puzzle": puzzle}

    def add_prepare_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, help="output folder for train.jsonl, eval.jsonl, meta.json")
        src = parser.add_mutually_exclusive_group(required=True)
        src.add_argument("--csv", help="Kaggle-layout CSV (puzzle,solution or quizzes,solutions)")
        src.add_argument("--n", type=int, help="number of unique puzzles to generate")
        parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
        parser.add_argument("--difficulty", choices=["easy", "medium", "hard", "mixed"], default="mixed",
                            help="clue bucket: easy >= 40, medium 30-39, hard < 30; mixed cycles them (CSV: keeps all)")

    def prepare(self, args: argparse.Namespace) -> str:
        meta = write_splits(args.out, csv=args.csv, n=args.n, seed=args.seed, difficulty=args.difficulty)
        c, skipped = meta["counts"], meta["skipped_rows"]
        skip = f"; skipped {len(skipped)} malformed rows: {_rows(skipped)}" if skipped else ""
        return f"sudoku: {c['train']} train, {c['eval']} eval from {meta['source']} -> {args.out}{skip}"

    def hints(self, cfg, tokenizer):
        if not cfg.data.pin_clues:
            return None
        from functools import partial

        return partial(clue_hint, tokenizer=tokenizer)

    def train_data(self, cfg, tokenizer):
        if cfg.data.path:
            return super().train_data(cfg, tokenizer)
        return SudokuStream(tokenizer, seed=cfg.data.seed, hint_fn=self.hints(cfg, tokenizer),
                            unique_share=cfg.data.sudoku_unique, unique_pool=cfg.data.sudoku_unique_pool,
                            unique_clues=tuple(cfg.data.sudoku_unique_clues), **canvas_shape(cfg))

    def source(self, cfg, split: str) -> str:
        if data_dir(cfg) is not None:
            return super().source(cfg, split)
        return f"generator(seed={eval_puzzle_seed(cfg)}, difficulty=mixed, unique=True)"

    def load(self, cfg, split: str | None = None, limit: int | None = None) -> list[dict]:
        if data_dir(cfg) is not None:
            return super().load(cfg, split, limit)
        self.check_split(split or self.default_split)
        return generate_eval_puzzles(count(cfg, limit), seed=eval_puzzle_seed(cfg))

    def score(self, texts, records) -> dict:
        return sudoku_metrics(texts, [r["puzzle"] for r in records], [r["solution"] for r in records])

    def score_one(self, text: str, record: dict) -> dict:
        return score_sudoku(text, record["puzzle"], record["solution"])
