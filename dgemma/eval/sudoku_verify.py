"""Verified Sudoku solving: the model answers, the rules check, the cells that broke them are re-noised.

Round 0 is one plain sampler run: the model-only answer (``dgemma solve --no-verify``, the
``sample_ar_steps{N}`` evaluators). A board that breaks a rule (a digit twice in a row, column or
box, or a cell without a digit) goes through up to ``rounds`` more rounds, each with the clues and
the cells it still trusts pinned as hints and the rest re-noised. Every digit comes from the
model; the rules decide which cells are pinned and, in the re-runs, which digits a cell may still
take (:func:`legal_logits`: none that a committed cell of its row, column or box holds, so a cell
left one digit commits it first). A board is reported valid only
after :func:`is_solution` checked it, so verified mode never passes off a wrong board: a puzzle
still broken after ``rounds`` rounds is reported unsolved.

Which cells a round re-noises. Measured on 60 generated hard puzzles (seed 2024, not the eval
set) with ``checkpoints/sudoku_small``: a wrong board is not a few bad cells but a wrong branch,
13-37 of ~55 blanks wrong, most of them committed with probability ~1.0 because an earlier wrong
commit forced them, and only 2-10 cells in duplicates. So neither the duplicates nor the least
confident cells locate the error (re-noising both, greedily, solved 3 of 25 failures in 16
rounds). The commit order does: the first wrong commit is no later than ``bound``, the earliest
time by which some duplicate had both of its cells committed. So a round *branches*:

- a branch of a decoded broken board picks a pivot among its commits up to ``bound`` and one of
  the model's alternatives there (its second or third digit at commit time); every cell committed
  before the pivot (duplicates excepted) stays pinned, the pivot is pinned to that digit, the
  rest is re-noised and decoded greedily. Re-noising the pivot alone would be pointless: from the
  same pinned prefix a greedy sampler makes the same choice again. A branch's own pin is not a
  pivot again while it stays pinned.
- the branches of every board decoded so far wait in one queue per puzzle
  (:class:`BranchSearch`), cheapest first: a branch costs its parent's cost plus
  ``log(p(committed digit) / p(alternative))``, the model's own doubt at the pivot. This is a
  limited-discrepancy search: the board that overrules the model where it was least sure comes
  first, whether that place is in the first board or in a re-run. Each round tries the
  ``variants`` cheapest branches of each broken board side by side in one batch and keeps a
  valid one; a puzzle that runs out of branches re-samples every blank at temperature 1 (the
  seeded generator) instead.

History, measured with ``checkpoints/sudoku_deep`` (step 3,000), 8 rounds of 8 variants. The
earlier rule took, in rounds 1-4, the 1st ... 8th least confident commit of the last round's best
board (runner-up digit only) and in rounds 5-8 eight draws at T = 1; its best variant became the
next round's board, so a right branch that broke a rule elsewhere was lost. On 384 fresh hard
puzzles (``generate_puzzles(384, seed=2718, difficulty="hard")``, 333 model-only) it verified 374
in 197 passes a board; the queue verifies 383 in 127. Of the 44 model-only failures among the 768
held-out boards it left 2 unsolved, the queue none (offering all eight other digits instead of
two: 2 unsolved). At the first wrong commit of those 44 boards the right digit was the model's
runner-up in 42. The issue's 21-clue puzzle
(``800000000003600000070090200050007000000045700000100030001000068008500010090000400``) takes 17
rounds (4,000 passes, 52 s at batch 1).

Variants. Measured on the 256 held-out hard puzzles with ``checkpoints/sudoku_wide`` (167
model-only) and the earlier rule, solved after 8 rounds: 1 variant 227 (223 with the
legal-digit rule), 8 variants 249 (251 with it, 340 passes a board on average), 16 variants 253
(594 passes); 8 variants for 16 rounds 253 (396 passes). Wider rounds find the branch a
narrow one misses in fewer rounds.

Cost: a round runs one denoising step per re-noised cell, rounded up to a multiple of 8 and
capped at the sampler's ``num_steps`` (one cell per step or fewer, as round 0 at 81 steps);
rows that round alike share one sampler call. A branch's steps depend on the row alone;
re-samples draw from the one seeded generator, so, as with any sampling at T > 0, their draws
depend on the batch (same puzzles, batch size and seed: same answers). Passes are the
sampler's forward passes (a prefill plus one per step), summed over rounds and variants.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from dgemma.data.sft import encode_prompts, pin_rows
from dgemma.data.sudoku import _UNITS, grid_error, parse_puzzle
from dgemma.errors import DGemmaError
from dgemma.sampling import build_sampler, eval_settings
from dgemma.tasks import get_task
from dgemma.tasks.sudoku import SYSTEM_PROMPT, format_prompt, puzzle_hint

DEFAULT_ROUNDS = 24
"""Default ``--rounds``, measured with ``checkpoints/sudoku_deep`` ("Verified solving" in its
README): the 768 held-out boards need at most 6 rounds, fresh hard puzzles at most 8, and the
issue's 21-clue puzzle 17. Rounds only run for a board still broken, so the cap costs time on
the rare board the search cannot mend."""
DEFAULT_VARIANTS = 8
"""Re-runs a broken board tries per round (``--variants``)."""
RESAMPLE_TEMPERATURE = 1.0
STEP_QUANTUM = 8  # a round's steps: re-noised cells rounded up to a multiple of this


@dataclass
class VerifiedSolve:
    """One puzzle's answer. ``grid``/``valid`` are the verified figures, ``model_*`` round 0's alone.

    ``grid`` is 81 characters with ``0`` where the canvas held no digit; ``valid`` is True only
    for a completed valid grid that keeps every clue. ``rounds`` counts the re-noising rounds
    run (0 when the first board was valid), ``passes`` the forward passes of all rounds, round 0
    included. ``seconds`` are this row's share of its sampler calls (a call's time split evenly
    over its rows). ``renoised`` is the number of cells each round re-noised, ``round_passes``
    the passes of each round, round 0 first.
    """

    puzzle: str
    grid: str
    valid: bool
    rounds: int
    passes: int
    seconds: float
    model_grid: str
    model_valid: bool
    model_passes: int
    model_seconds: float
    model_text: str = ""  # round 0's decoded canvas, as the plain evaluators score it
    renoised: list[int] = field(default_factory=list)
    round_passes: list[int] = field(default_factory=list)  # round 0 first

    @property
    def error(self) -> str | None:
        """Why ``grid`` is not a solution of ``puzzle``, or None."""
        return solution_error(self.grid, self.puzzle)


def solution_error(grid: str, puzzle: str) -> str | None:
    """Why ``grid`` is not a completed valid grid keeping every clue of ``puzzle``, or None."""
    err = grid_error(grid)
    if err:
        return err
    for i, (p, g) in enumerate(zip(puzzle, grid)):
        if p != "0" and p != g:
            return f"clue {p} at row {i // 9 + 1}, column {i % 9 + 1} became {g}"
    return None


def is_solution(grid: str, puzzle: str) -> bool:
    """True for a completed valid grid (every row, column and box 1-9 once) that keeps the clues."""
    return solution_error(grid, puzzle) is None


def duplicate_groups(grid: str) -> list[list[int]]:
    """Cells of every digit repeated inside a unit (one list per unit and digit), then every
    cell without a digit 1-9 alone: the cells a broken board is broken at."""
    groups = []
    for _, _, cells in _UNITS:
        seen: dict[str, list[int]] = {}
        for i in cells:
            if grid[i] in "123456789":
                seen.setdefault(grid[i], []).append(i)
        groups += [g for g in seen.values() if len(g) > 1]
    return groups + [[i] for i, ch in enumerate(grid) if ch not in "123456789"]


def offending_cells(grid: str, puzzle: str) -> set[int]:
    """Non-clue cells of ``grid`` that take part in a broken rule (see :func:`duplicate_groups`)."""
    return {i for g in duplicate_groups(grid) for i in g if puzzle[i] == "0"}


# ------------------------------------------------------------------------------------ recording
class _Log:
    """Per row and cell: token, commit time (rank), the model's probability of the committed
    digit, its next ``ALTS`` digits and their probabilities (best first), and whether a branch
    pinned it."""

    FIELDS = ("tokens", "rank", "conf", "alt", "altp", "forced")
    ALTS = 2  # a branch pins the runner-up or the third choice (all eight: fewer boards solved)

    def __init__(self, n: int):
        self.tokens = torch.full((n, 81), -1, dtype=torch.long)
        self.rank = torch.zeros(n, 81, dtype=torch.float64)
        self.conf = torch.zeros(n, 81)
        self.alt = torch.full((n, 81, self.ALTS), -1, dtype=torch.long)
        self.altp = torch.zeros(n, 81, self.ALTS)
        self.forced = torch.zeros(n, 81, dtype=torch.bool)

    def take(self, rows: list[int]) -> "_Log":
        """A new log holding copies of ``rows`` (a row may appear more than once)."""
        out = _Log(len(rows))
        index = torch.tensor(rows, dtype=torch.long)
        for name in self.FIELDS:
            setattr(out, name, getattr(self, name)[index])
        return out

    def put(self, row: int, other: "_Log", j: int) -> None:
        """Overwrite ``row`` with ``other``'s row ``j``."""
        for name in self.FIELDS:
            getattr(self, name)[row] = getattr(other, name)[j]


_PEERS = torch.zeros(81, 81)
for _, _, _cells in _UNITS:
    for _i in _cells:
        _PEERS[_i, _cells] = 1.0
_PEERS.fill_diagonal_(0.0)  # [81, 81]: 1 where two cells share a row, column or box


def legal_logits(logits: torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor,
                 digit_ids: torch.Tensor) -> torch.Tensor:
    """``logits [B, 81, V]`` with, at every open cell, each token the rules rule out at ``-inf``:
    every non-digit token and every digit a committed peer (same row, column or box) holds.

    The model's preferences among the digits still legal are kept, so a cell whose peers hold
    eight digits is certain of the ninth. A dead cell (its peers hold all nine) is left as the
    model has it: the board it ends in breaks a rule, and the next round sees where. Example:
    row 1 committed as ``12345678_`` leaves its last cell only ``9``.
    """
    dev = logits.device
    digit_ids = digit_ids.to(dev)
    held = committed[..., None] & (tokens[..., None] == digit_ids)  # [B, 81, 9]
    used = torch.einsum("ij,bjd->bid", _PEERS.to(dev), held.float()) > 0  # [B, 81, 9]
    live = ~committed & ~used.all(-1)  # [B, 81] open cells with a legal digit
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=dev)
    allowed[..., digit_ids] = ~used
    block = live[..., None] & ~allowed
    return logits.masked_fill(block, float("-inf"))


class _Tap:
    """A sampler step wrapped to report, after each call, the cells it committed and the model's
    next digits there (the step's own attributes pass through, so the sampler treats it as the
    step). A step that commits nothing (ddim, entropy_bound) reports every open cell at its last
    step. The sampler's ``on_step`` hook reads the report: it knows which rows ran. With
    ``legal``, the step sees :func:`legal_logits` (the verified rounds decode within the rules)."""

    def __init__(self, step, digit_ids: torch.Tensor, legal: bool = False):
        self.inner, self.digit_ids, self.last, self.legal = step, digit_ids, None, legal

    def __getattr__(self, name):
        if name in ("inner", "digit_ids", "last", "legal"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, state, logits, t, s, *, generator, is_last):
        if self.legal and logits.shape[1] == 81:
            logits = legal_logits(logits, state.tokens, state.committed, self.digit_ids)
        out = self.inner(state, logits, t, s, generator=generator, is_last=is_last)
        new = out.committed & ~state.committed
        if is_last:
            new = new | ~state.committed
        self.last = None
        if bool(new.any()):
            probs = torch.softmax(logits.float(), -1)  # the model's own probabilities, untempered
            chosen = probs.gather(-1, out.tokens.unsqueeze(-1)).squeeze(-1)
            digits = probs[..., self.digit_ids].masked_fill(self.digit_ids == out.tokens.unsqueeze(-1), -1.0)
            altp, k = digits.topk(_Log.ALTS, -1)  # [B, 81, ALTS] the next digits, best first
            self.last = (new, chosen, self.digit_ids[k], altp.clamp(min=0.0))
        return out


def cell_token_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer.encode("123456789")
    if len(ids) != 9:
        raise DGemmaError("verified Sudoku solving pins cells, so it needs one token per cell "
                          f"(data.tokenizer='digits'); this tokenizer maps the digits 1-9 to {len(ids)} tokens")
    return torch.tensor(ids, dtype=torch.long)


def _grid(tokens: torch.Tensor, digit_ids: torch.Tensor) -> str:
    lut = {int(t): str(d + 1) for d, t in enumerate(digit_ids)}
    return "".join(lut.get(int(t), "0") for t in tokens)


def _sample(model, sampler, digit_ids, prompt, hints, generator, log: _Log, rows: list[int], base: torch.Tensor,
            num_steps: int, legal: bool = False):
    """One sampler call on ``rows``; writes their tokens and commit records into ``log``."""
    ids, valid = prompt
    dev = ids.device
    tap = _Tap(sampler.step, digit_ids.to(dev), legal)
    outer = sampler.on_step
    index = torch.tensor(rows, dtype=torch.long)

    def on_step(**kw):
        if outer is not None:
            outer(**kw)
        if tap.last is None:
            return
        new, chosen, alt, altp = (x.cpu() for x in tap.last)
        r = index[torch.tensor(kw["rows"], dtype=torch.long)]
        log.conf[r] = torch.where(new, chosen, log.conf[r])
        log.alt[r] = torch.where(new[..., None], alt, log.alt[r])
        log.altp[r] = torch.where(new[..., None], altp, log.altp[r])
        log.rank[r] = torch.where(new, base[r, None] + kw["step"], log.rank[r])
        log.forced[r] &= ~new  # re-decided by the model: no longer a branch's pin

    res = dataclasses.replace(sampler, step=tap, on_step=on_step, num_steps=num_steps)(
        model, ids, valid, generator=generator, hints=hints)
    for j, toks in enumerate(res.tokens):
        t = torch.tensor((list(toks) + [-1] * 81)[:81], dtype=torch.long)
        if hints is not None:  # a canvas cut at a stop token still keeps its pins
            h = hints[j, :81].cpu()
            t = torch.where(h >= 0, h, t)
        log.tokens[rows[j]] = t
    return res


# ------------------------------------------------------------------------------------ planning
class Plan(NamedTuple):
    pins: list[int]  # token per cell, -1 = re-noised
    base: float  # commit rank the re-run's first step gets
    pivot: int | None  # the cell a branch pinned to its runner-up digit
    rule: str  # "branch" | "resample"


class Branch(NamedTuple):
    """A branch not yet tried: pin ``token`` at ``pivot`` of a decoded board (``parent``)."""

    cost: float  # the discrepancies so far: sum of log(p(model's digit) / p(pinned digit))
    order: int  # ties: the order found
    parent: int  # index of the decoded board it branches from
    pivot: int
    token: int


def resample_plan(puzzle: str, log: _Log, row: int) -> Plan:
    """Every blank re-noised (the clues pinned): an independent draw."""
    return Plan([int(log.tokens[row, i]) if puzzle[i] != "0" else -1 for i in range(81)], 0.0, None, "resample")


def branch_options(puzzle: str, grid: str, log: _Log, row: int) -> list[tuple[float, int, int]]:
    """``(cost, cell, token)`` of every branch of a broken decoded board: each cell committed no
    later than the first completed duplicate (the first wrong commit is among them) and not itself
    a branch's pin, with each of its alternative digits; the cost is ``log(p(committed) / p(alt))``,
    so the branches the model found closest come first."""
    clue = [ch != "0" for ch in puzzle]
    rank, conf = log.rank[row], log.conf[row]
    free = [i for i in range(81) if not clue[i]]
    bound = math.inf  # the first wrong commit happened no later than this
    for g in duplicate_groups(grid):
        ranks = [float(rank[i]) for i in g if not clue[i]]
        if ranks:
            bound = min(bound, max(ranks))
    upto = [i for i in free if float(rank[i]) <= bound]
    out = []
    for i in upto:
        if log.forced[row, i]:
            continue
        for a in range(_Log.ALTS):
            tok, p = int(log.alt[row, i, a]), float(log.altp[row, i, a])
            if tok >= 0 and p > 0 and tok != int(log.tokens[row, i]):
                out.append((math.log(max(float(conf[i]), 1e-30)) - math.log(p), i, tok))
    return sorted(out, key=lambda o: (o[0], float(rank[o[1]])))


def branch_plan(puzzle: str, grid: str, log: _Log, row: int, pivot: int, token: int) -> Plan:
    """The pins of a branch: the clues, every cell committed before ``pivot`` except those in a
    duplicate, and ``token`` at ``pivot``; the rest is re-noised."""
    rank, tokens = log.rank[row], log.tokens[row]
    bad = {i for g in duplicate_groups(grid) for i in g}
    pins = [int(tokens[i]) if puzzle[i] != "0" or (float(rank[i]) < float(rank[pivot]) and i not in bad) else -1
            for i in range(81)]
    pins[pivot] = token
    return Plan(pins, float(rank[pivot]) + 1, pivot, "branch")


class BranchSearch:
    """One broken puzzle's search tree: the boards decoded so far and the branches not yet tried,
    cheapest first (a limited-discrepancy search: a branch's cost is the sum of
    :func:`branch_options`' costs along its path, so every path that departs from the model's
    greedy choices where it was least sure is tried before one that overrules a confident choice).

    Example: a root board whose cell 10 was committed at p = 0.6 with runner-up 0.3 (cost
    log 2 = 0.69) and cell 20 at 0.9 with 0.05 (2.9). Branching at 10 decodes a board whose cell 30
    was committed at 0.5 after 0.4 (0.22): its branch costs 0.69 + 0.22 = 0.91 and is tried before
    cell 20's.
    """

    def __init__(self, puzzle: str):
        self.puzzle, self.boards, self.frontier, self.tried = puzzle, [], [], set()
        self.order = itertools.count()

    def add(self, log: _Log, row: int, grid: str, cost: float = 0.0) -> None:
        """Queue the branches of a decoded broken board (``log``'s ``row``) reached at ``cost``."""
        node = len(self.boards)
        self.boards.append((log.take([row]), grid))
        for c, cell, tok in branch_options(self.puzzle, grid, log, row):
            heapq.heappush(self.frontier, Branch(cost + c, next(self.order), node, cell, tok))

    def pop(self, k: int) -> list[tuple[Plan, _Log, float]]:
        """Up to ``k`` cheapest untried branches: their plan, their parent's log row, their cost.
        Two paths that pin the same cells alike are one branch: it is tried once."""
        out = []
        while self.frontier and len(out) < k:
            b = heapq.heappop(self.frontier)
            src, grid = self.boards[b.parent]
            plan = branch_plan(self.puzzle, grid, src, 0, b.pivot, b.token)
            if tuple(plan.pins) not in self.tried:
                self.tried.add(tuple(plan.pins))
                out.append((plan, src, b.cost))
        return out


def round_steps(free: int, num_steps: int) -> int:
    """The denoising steps of a round that re-noised ``free`` cells (at most ``num_steps``)."""
    return max(1, min(num_steps, STEP_QUANTUM * math.ceil(free / STEP_QUANTUM)))


# ------------------------------------------------------------------------------------ solving
def solve_verified(model, tokenizer, puzzles: list[str] | str, *, sampler, rounds: int = DEFAULT_ROUNDS,
                   prompt_len: int = 82, pin_clues: bool = True, seed: int = 0, batch_size: int = 64,
                   on_round: Callable | None = None, legal: bool = True,
                   variants: int = DEFAULT_VARIANTS) -> list[VerifiedSolve]:
    """Solve ``puzzles`` with ``model`` and verify each board, re-noising up to ``rounds`` times.

    ``sampler`` is a :class:`~dgemma.diffusion.sampler.CanvasSampler` whose canvas holds the 81
    cells (:func:`run_sampler` builds a run's).
    Its round-0 output, batch by batch of ``batch_size`` with one generator seeded by ``seed``,
    is exactly what ``dgemma solve --no-verify`` prints; ``pin_clues`` pins the clues in round 0
    as the run was trained (later rounds always pin them). ``on_round(round, rows, plans)``, if
    given, is called before each re-run with the puzzle indices and their :class:`Plan`.
    The same inputs and seed give the same answers. Returns one :class:`VerifiedSolve` each.
    """
    if isinstance(puzzles, str):
        puzzles = [puzzles]
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise DGemmaError(f"rounds must be an integer >= 0, got {rounds!r}")
    if batch_size < 1:
        raise DGemmaError(f"batch_size must be >= 1, got {batch_size}")
    if not isinstance(variants, int) or isinstance(variants, bool) or variants < 1:
        raise DGemmaError(f"variants must be an integer >= 1, got {variants!r}")
    if sampler.canvas_size * sampler.max_canvases < 81:
        raise DGemmaError(f"the sampler's canvas holds {sampler.canvas_size * sampler.max_canvases} tokens; "
                          "a Sudoku board needs 81")

    puzzles = [parse_puzzle(p) for p in puzzles]
    digit_ids = cell_token_ids(tokenizer)
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    n, width = len(puzzles), sampler.canvas_size * sampler.max_canvases
    records = [{"prompt": format_prompt(p), "system": SYSTEM_PROMPT} for p in puzzles]
    clue_pins = [puzzle_hint(p, tokenizer) for p in puzzles]
    log = _Log(n)
    passes, seconds, used = [0] * n, [0.0] * n, [0] * n
    renoised: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n

    def prompt(rows):
        ids, valid, _ = encode_prompts(tokenizer, [records[r] for r in rows], prompt_len, device=dev)
        return ids, valid

    def hints_of(pins):
        return pin_rows(pins, width, dev)

    round_passes: list[list[int]] = [[] for _ in range(n)]

    def account(rows, res):
        for j, r in enumerate(rows):
            passes[r] += res.forward_passes[j]
            round_passes[r].append(res.forward_passes[j])
            seconds[r] += res.seconds / len(rows)

    base = torch.zeros(n, dtype=torch.float64)
    for lo in range(0, n, batch_size):
        rows = list(range(lo, min(n, lo + batch_size)))
        hints = hints_of([clue_pins[r] for r in rows]) if pin_clues else None
        res = _sample(model, sampler, digit_ids, prompt(rows), hints, gen, log, rows, base, sampler.num_steps)
        account(rows, res)
        for j, r in enumerate(rows):
            texts[r] = tokenizer.decode(res.tokens[j])
    model_grids = [_grid(log.tokens[r], digit_ids) for r in range(n)]
    model_passes, model_seconds = list(passes), list(seconds)

    resampler = sampler
    step = sampler.step
    if hasattr(step, "temperature") and not callable(step.temperature):
        step = copy.copy(step)
        step.temperature = RESAMPLE_TEMPERATURE
        resampler = dataclasses.replace(sampler, step=step)
    grids = list(model_grids)
    trees = {r: BranchSearch(puzzles[r]) for r in range(n) if not is_solution(grids[r], puzzles[r])}
    for r, tree in trees.items():
        tree.add(log, r, grids[r])
    for k in range(1, rounds + 1):
        todo = [r for r in range(n) if not is_solution(grids[r], puzzles[r])]
        if not todo:
            break
        # each broken board tries `variants` re-runs: its cheapest untried branches, then
        # independent draws if it has too few; one scratch row each, batched together; board
        # todo[t]'s re-runs are scratch rows t * variants ... (t + 1) * variants - 1
        pairs, plans, srcs, costs = [], [], [], []
        for r in todo:
            picks = trees[r].pop(variants)
            picks += [(resample_plan(puzzles[r], log, r), log.take([r]), 0.0)] * (variants - len(picks))
            for plan, src, cost in picks:
                pairs.append(r), plans.append(plan), srcs.append(src), costs.append(cost)
        if on_round is not None:
            on_round(k, todo, [plans[t * variants] for t in range(len(todo))])
        scratch = _Log(len(pairs))
        sbase = torch.zeros(len(pairs), dtype=torch.float64)
        for j, plan in enumerate(plans):
            scratch.put(j, srcs[j], 0)
            sbase[j] = plan.base
            if plan.pivot is not None:  # a branch's pin: never a pivot again while pinned
                scratch.forced[j, plan.pivot] = True
        free = [sum(p < 0 for p in plan.pins) for plan in plans]  # re-noised cells of each re-run
        groups: dict[tuple[int, str], list[int]] = {}
        for j, f in enumerate(free):
            groups.setdefault((round_steps(f, sampler.num_steps), plans[j].rule), []).append(j)
        spent = {r: [0, 0.0] for r in todo}  # passes and seconds of all of a board's variants
        for (steps, how), members in sorted(groups.items()):
            for lo in range(0, len(members), batch_size):
                rows = members[lo:lo + batch_size]
                s = sampler if how == "branch" else resampler
                res = _sample(model, s, digit_ids, prompt([pairs[j] for j in rows]),
                              hints_of([plans[j].pins for j in rows]), gen, scratch, rows, sbase, steps, legal)
                for i, j in enumerate(rows):
                    spent[pairs[j]][0] += res.forward_passes[i]
                    spent[pairs[j]][1] += res.seconds / len(rows)
        for t, r in enumerate(todo):  # keep a valid re-run if any, else the one with the fewest broken cells
            cands = range(t * variants, (t + 1) * variants)
            boards = {j: _grid(scratch.tokens[j], digit_ids) for j in cands}
            best = min(cands, key=lambda j: (not is_solution(boards[j], puzzles[r]),
                                             len(offending_cells(boards[j], puzzles[r]))))
            log.put(r, scratch, best)
            base[r] = sbase[best]
            renoised[r].append(free[best])
            used[r] += 1
            passes[r] += spent[r][0]
            seconds[r] += spent[r][1]
            round_passes[r].append(spent[r][0])
            grids[r] = boards[best]
            if not is_solution(grids[r], puzzles[r]):
                for j in cands:
                    if plans[j].rule == "branch":
                        trees[r].add(scratch, j, boards[j], costs[j])
    return [VerifiedSolve(puzzles[r], grids[r], is_solution(grids[r], puzzles[r]), used[r], passes[r], seconds[r],
                          model_grids[r], is_solution(model_grids[r], puzzles[r]), model_passes[r], model_seconds[r],
                          texts[r], renoised[r], round_passes[r]) for r in range(n)]


def run_sampler(run, *, num_steps: int = 81, step_type: str = "commit", temperature: float = 0.0):
    """The sampler ``dgemma solve`` uses for a run: its eval settings, greedy, no early stopping."""
    settings = eval_settings(run.cfg, num_steps=num_steps, step_type=step_type, temperature=temperature,
                             early_stopping=None, tokenizer=run.tokenizer)
    return build_sampler(settings, noise=run.noise(), canvas_size=run.cfg.diffusion.canvas_size,
                         stop_ids=get_task("sudoku").stop_ids(run.tokenizer))


def solve_run(run, puzzles: list[str] | str, *, rounds: int = DEFAULT_ROUNDS, num_steps: int = 81,
              step_type: str = "commit", seed: int = 0, batch_size: int = 64,
              on_round: Callable | None = None, legal: bool = True,
              variants: int = DEFAULT_VARIANTS) -> list[VerifiedSolve]:
    """:func:`solve_verified` with a training run's model, tokenizer, sampler and clue pinning."""
    return solve_verified(run.model, run.tokenizer, puzzles, sampler=run_sampler(run, num_steps=num_steps,
                          step_type=step_type), rounds=rounds, prompt_len=run.cfg.data.prompt_len,
                          pin_clues=bool(run.cfg.data.pin_clues), seed=seed, batch_size=batch_size, on_round=on_round,
                          legal=legal, variants=variants)


# ------------------------------------------------------------------------------------ reporting
def summarize(solves: list[VerifiedSolve]) -> dict:
    """Model-only and verified figures, kept apart: valid count and rate, passes, seconds."""
    n = max(len(solves), 1)
    model = {"valid": sum(s.model_valid for s in solves), "passes": sum(s.model_passes for s in solves),
             "seconds": sum(s.model_seconds for s in solves)}
    ver = {"valid": sum(s.valid for s in solves), "passes": sum(s.passes for s in solves),
           "seconds": sum(s.seconds for s in solves), "rounds": sum(s.rounds for s in solves),
           "unsolved": sum(not s.valid for s in solves)}
    for d in (model, ver):
        d.update(count=len(solves), valid_rate=d["valid"] / n, mean_passes=d["passes"] / n,
                 boards_per_second=len(solves) / max(d["seconds"], 1e-9))
    ver["mean_rounds"] = ver["rounds"] / n
    return {"model_only": model, "verified": ver}


def evaluate_verified(run, task="sudoku", *, rounds: int = DEFAULT_ROUNDS, records: list[dict] | None = None,
                      num_steps: int = 81, step_type: str | None = None, batch_size: int | None = None,
                      seed: int | None = None, split: str | None = None, variants: int = 1) -> dict:
    """Score verified solving on a run, model-only and verified apart; returns a JSON-able dict.

    Call it like :func:`dgemma.eval.harness.evaluate`: ``evaluate_verified(run, "sudoku",
    rounds=8)`` scores the task's held-out records (``task.load``: the 768 generated puzzles of
    seed 7919 unless ``data.path`` is set), or pass ``records`` (dicts with ``puzzle`` and
    ``solution``). ``step_type``, ``batch_size`` and ``seed`` default to the run's ``eval_ds``;
    sampling is greedy without early stopping, as ``dgemma solve``. The keys:

    - ``model_only``: ``task.score`` of round 0's decoded canvases (the same numbers as the
      ``sample_ar_steps{num_steps}`` evaluator with a greedy config) plus ``mean_passes``,
      ``seconds`` and ``boards_per_second``;
    - ``verified``: ``task.score`` of the verified answers, where a puzzle still broken after
      ``rounds`` rounds counts as no answer (every metric 0: verified mode declines, it never
      answers wrong), plus ``solved``, ``unsolved``, ``mean_rounds``, ``mean_passes``,
      ``rounds_histogram`` (rounds used -> puzzles solved with that many; ``"unsolved"``),
      ``seconds`` (round 0 included) and ``boards_per_second``;
    - ``settings``, ``eval_name`` (``verified_steps{N}_rounds{K}``, ``_variants{W}`` appended for
      more than one variant), ``checkpoint_step``, and
      ``examples``: one dict per record for a ``step_<S>.jsonl`` (pop it before writing the
      summary JSON).
    """
    cfg, e = run.cfg, run.cfg.eval_ds
    task = (get_task(task) if isinstance(task, str) else task).configure(cfg)
    if task.name != "sudoku":
        raise DGemmaError(f"verified solving is for the sudoku task, not {task.name!r}")
    split = task.check_split(split or task.default_split)
    records = task.load(cfg, split) if records is None else records
    step_type = step_type or e.step_type
    seed = e.seed if seed is None else seed
    batch_size = batch_size or e.batch_size
    t0 = time.perf_counter()
    solves = solve_run(run, [r["puzzle"] for r in records], rounds=rounds, num_steps=num_steps, step_type=step_type,
                       seed=seed, batch_size=batch_size, variants=variants)
    wall = time.perf_counter() - t0
    summary = summarize(solves)
    model = {**task.score([s.model_text for s in solves], records), **{
        k: summary["model_only"][k] for k in ("mean_passes", "seconds", "boards_per_second")}}
    answers = [" ".join(s.grid) if s.valid else "" for s in solves]
    hist: dict[str, int] = {}
    for s in solves:
        key = str(s.rounds) if s.valid else "unsolved"
        hist[key] = hist.get(key, 0) + 1
    ver = {**task.score(answers, records), "solved": summary["verified"]["valid"],
           "unsolved": summary["verified"]["unsolved"], "rounds_histogram": hist, **{
               k: summary["verified"][k] for k in ("mean_rounds", "mean_passes", "seconds", "boards_per_second")}}
    examples = [{"index": i, "id": r.get("id"), "puzzle": s.puzzle, "reference": r.get("solution"),
                 "model_grid": s.model_grid, "model_valid": s.model_valid, "model_passes": s.model_passes,
                 "grid": s.grid if s.valid else None, "valid": s.valid, "rounds": s.rounds, "passes": s.passes,
                 "renoised": s.renoised} for i, (r, s) in enumerate(zip(records, solves))]
    settings = {"rounds": rounds, "variants": variants, "legal_only": True, "num_steps": num_steps,
                "step_type": step_type, "temperature": 0.0,
                "resample_temperature": RESAMPLE_TEMPERATURE, "seed": seed, "batch_size": batch_size,
                "pin_clues": bool(cfg.data.pin_clues), "device": str(next(run.model.parameters()).device),
                "threads": torch.get_num_threads(), "wall_seconds": wall}
    name = f"verified_steps{num_steps}_rounds{rounds}" + (f"_variants{variants}" if variants > 1 else "")
    return {"eval_name": name, "task": task.name, "split": split,
            "source": task.source(cfg, split), "checkpoint_step": run.step, "num_examples": len(records),
            "model_only": model, "verified": ver, "settings": settings, "examples": examples}
