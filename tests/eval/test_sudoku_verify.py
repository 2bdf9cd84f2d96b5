"""Verified Sudoku solving: the rule checks, the round loop (scripted sampler) and a tiny real run."""

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from dgemma.data.char_tokenizer import CharTokenizer
from dgemma.data.sudoku import generate_puzzles
from dgemma.diffusion.sampler import SampleResult
from dgemma.errors import DGemmaError
from dgemma.eval.sudoku_verify import (BranchSearch, _Log, branch_options, duplicate_groups, evaluate_verified,
                                       is_solution, legal_logits, offending_cells, solution_error, solve_run,
                                       solve_verified, summarize)

REC = generate_puzzles(1, seed=3, difficulty="medium")[0]
PUZZLE, SOLUTION = REC["puzzle"], REC["solution"]
TOK = CharTokenizer.named("digits")


def _broken(solution: str) -> str:
    """The solution with its first blank's digit swapped for the next blank's digit in the same row."""
    g = list(solution)
    blanks = [i for i in range(81) if PUZZLE[i] == "0"]
    a = blanks[0]
    b = next(i for i in blanks if i // 9 == a // 9 and solution[i] != solution[a])
    g[a] = solution[b]
    return "".join(g)


def test_rule_checks():
    assert is_solution(SOLUTION, PUZZLE) and solution_error(SOLUTION, PUZZLE) is None
    bad = _broken(SOLUTION)
    assert not is_solution(bad, PUZZLE)
    cells = offending_cells(bad, PUZZLE)
    assert cells and all(PUZZLE[i] == "0" for i in cells)  # clues are never offenders
    assert all(len(g) == 2 for g in duplicate_groups(bad))
    relabelled = SOLUTION.translate(str.maketrans("12", "21"))  # a valid grid that changes clues
    assert solution_error(relabelled, "0" * 81) is None and "clue" in solution_error(relabelled, PUZZLE)
    assert "81 characters" in solution_error("12", PUZZLE)
    assert duplicate_groups("0" + SOLUTION[1:]) == [[0]]  # a cell without a digit is broken alone


def test_legal_logits_rule_out_what_a_committed_peer_holds():
    digits = torch.tensor(TOK.encode("123456789"))
    tokens = torch.full((1, 81), int(digits[0]))
    committed = torch.zeros(1, 81, dtype=torch.bool)
    for i, d in enumerate("12345678"):  # row 1: 12345678_
        tokens[0, i], committed[0, i] = int(digits[int(d) - 1]), True
    tokens[0, 17], committed[0, 17] = int(digits[8]), True  # a 9 in row 2, box 3
    logits = torch.randn(1, 81, len(TOK))
    out = legal_logits(logits, tokens, committed, digits)
    ok = lambda i: [TOK.decode([int(t)]) for t in (out[0, i] > -float("inf")).nonzero().squeeze(1)]  # noqa: E731
    # row 1's last cell: 1-8 in its row, 9 in its box: dead, so left as the model has it; committed cells too
    assert torch.equal(out[0, 8], logits[0, 8]) and torch.equal(out[0, :8], logits[0, :8])
    assert ok(9) == ["4", "5", "6", "7", "8"]  # row 2, box 1: 1-3 in its box, 9 in its row
    assert ok(80) == list("12345678")  # column 9 holds the 9
    assert ok(40) == list("12346789")  # the centre: column 5 holds the 5; non-digit tokens are ruled out too


# ------------------------------------------------------------------------------ the branch search
def _decoded(grid: str) -> _Log:
    """A log of ``grid`` decoded blank by blank in cell order, the cells of its duplicates last,
    each digit at p = 0.999 with a runner-up at 0.0005 and a third choice at 0.0004."""
    log = _Log(1)
    log.tokens[0] = torch.tensor(TOK.encode(grid))
    dup = {i for g in duplicate_groups(grid) for i in g}
    blanks = sorted((i for i in range(81) if PUZZLE[i] == "0"), key=lambda i: (i in dup, i))
    for t, i in enumerate(blanks):
        log.rank[0, i] = t + 1
        log.conf[0, i] = 0.999
        other = [d for d in "123456789" if d != grid[i]]
        log.alt[0, i] = torch.tensor(TOK.encode(other[0] + other[1]))
        log.altp[0, i] = torch.tensor([0.0005, 0.0004])
    return log


def _set(log, cell, conf, alts):
    log.conf[0, cell] = conf
    log.alt[0, cell] = torch.tensor(TOK.encode("".join(d for d, _ in alts)))
    log.altp[0, cell] = torch.tensor([p for _, p in alts])


def test_branches_lie_before_the_first_duplicate_cheapest_first_third_choices_too():
    import math

    bad = _broken(SOLUTION)
    dup = {i for g in duplicate_groups(bad) for i in g}
    blanks = [i for i in range(81) if PUZZLE[i] == "0"]
    x, y = [i for i in blanks if i not in dup][1:3]
    log = _decoded(bad)
    bound = min(max(float(log.rank[0, i]) for i in g if PUZZLE[i] == "0") for g in duplicate_groups(bad))
    _set(log, x, 0.6, [("8", 0.3), ("9", 0.1)])
    _set(log, y, 0.9, [("7", 0.05), ("6", 0.04)])
    opts = branch_options(PUZZLE, bad, log, 0)
    upto = {i for i in blanks if log.rank[0, i] <= bound}
    assert {cell for _, cell, _ in opts} == upto and len(upto) < len(blanks)  # up to the first duplicate
    assert opts[0][1:] == (x, TOK.encode("8")[0]) and opts[0][0] == pytest.approx(math.log(2))
    assert opts[1][1:] == (x, TOK.encode("9")[0]) and opts[1][0] == pytest.approx(math.log(6))  # the third choice
    assert opts[2][1:] == (y, TOK.encode("7")[0])
    log.forced[0, x] = True  # a branch's pin is not branched again
    assert x not in {cell for _, cell, _ in branch_options(PUZZLE, bad, log, 0)}


def test_branch_search_tries_the_cheapest_path_across_the_tree_once():
    """The class docstring's example: a child's cheap branch comes before a root's dear one."""
    import math

    bad = _broken(SOLUTION)
    dup = {i for g in duplicate_groups(bad) for i in g}
    blanks = [i for i in range(81) if PUZZLE[i] == "0" and i not in dup]  # the duplicates are decoded last
    x, y, z = blanks[1:4]
    root = _decoded(bad)
    _set(root, x, 0.6, [("8", 0.3), ("9", 0.01)])
    _set(root, y, 0.9, [("7", 0.05), ("6", 0.01)])
    search = BranchSearch(PUZZLE)
    search.add(root, 0, bad)
    (plan, src, cost), = search.pop(1)
    assert plan.pivot == x and plan.pins[x] == TOK.encode("8")[0] and cost == pytest.approx(math.log(2))
    clue = TOK.encode(PUZZLE)
    assert plan.pins == [clue[i] if PUZZLE[i] != "0" else int(root.tokens[0, i]) if i == blanks[0] else
                         TOK.encode("8")[0] if i == x else -1 for i in range(81)]  # the prefix before x is kept
    child = _decoded(bad)
    child.forced[0, x] = True
    _set(child, z, 0.5, [("5", 0.4), ("4", 0.05)])
    search.add(child, 0, bad, cost)
    (plan, _, cost), = search.pop(1)
    assert plan.pivot == z and cost == pytest.approx(math.log(2) + math.log(0.5 / 0.4))
    search.add(child, 0, bad, cost)  # the same board again: its branches pin nothing new
    seen = [tuple(p.pins) for p, _, _ in search.pop(1000)]
    assert len(seen) == len(set(seen)) and not search.frontier


# ------------------------------------------------------------------------------ scripted sampler
@dataclass(kw_only=True)
class Scripted:
    """A stand-in CanvasSampler: call k fills every free cell from ``answers[min(k, -1)]`` and
    keeps every pin; records the hints of each call."""

    answers: list
    step: object = field(default_factory=lambda: SimpleNamespace(temperature=0.0))
    num_steps: int = 81
    canvas_size: int = 81
    max_canvases: int = 1
    on_step: object = None
    calls: list = field(default_factory=list)

    def __call__(self, model, ids, valid, *, generator, hints=None):
        answer = TOK.encode(self.answers[min(len(self.calls), len(self.answers) - 1)])
        self.calls.append((self.num_steps, None if hints is None else hints.tolist()))
        rows = []
        for j in range(ids.shape[0]):
            h = hints[j].tolist() if hints is not None else [-1] * 81
            rows.append([h[i] if h[i] >= 0 else answer[i] for i in range(81)])
        return SampleResult(rows, [1 + self.num_steps] * len(rows), [[self.num_steps]] * len(rows), 0.01)


MODEL = torch.nn.Linear(1, 1)


def _solve(answers, rounds, **kw):
    sampler = Scripted(answers=answers)
    return solve_verified(MODEL, TOK, [PUZZLE], sampler=sampler, rounds=rounds, **kw)[0], sampler


def test_a_valid_first_board_takes_no_rounds():
    seen = []
    s, sampler = _solve([SOLUTION], rounds=8, on_round=lambda *a: seen.append(a))
    assert s.valid and s.model_valid and s.grid == SOLUTION
    assert s.rounds == 0 and s.passes == s.model_passes == 82 and s.round_passes == [82] and not seen
    assert len(sampler.calls) == 1


def test_a_broken_board_is_never_reported_valid():
    bad = _broken(SOLUTION)
    s, sampler = _solve([bad], rounds=5)
    assert not s.valid and not s.model_valid and s.grid == bad and s.error
    assert s.rounds == 5 and len(s.round_passes) == 6 and s.passes == sum(s.round_passes)
    assert len(sampler.calls) == 6
    summary = summarize([s])
    assert summary["model_only"]["valid"] == 0 and summary["verified"]["valid"] == 0
    assert summary["verified"]["unsolved"] == 1 and summary["verified"]["mean_rounds"] == 5


@dataclass(kw_only=True)
class PerRow(Scripted):
    """Round 0 answers ``answers[0]``; in later calls row ``j`` answers ``rows[j % len(rows)]``."""

    rows: list = field(default_factory=list)

    def __call__(self, model, ids, valid, *, generator, hints=None):
        res = Scripted.__call__(self, model, ids, valid, generator=generator, hints=hints)
        if len(self.calls) == 1:
            return res
        out = []
        for j, row in enumerate(res.tokens):
            answer = TOK.encode(self.rows[j % len(self.rows)])
            h = hints[j].tolist()
            out.append([h[i] if h[i] >= 0 else answer[i] for i in range(81)])
        return SampleResult(out, res.forward_passes, res.steps_used, res.seconds)


def test_variants_try_several_reruns_in_one_batch_and_keep_a_valid_one():
    bad = _broken(SOLUTION)
    sampler = PerRow(answers=[bad], rows=[bad, SOLUTION, bad])
    seen = []
    s = solve_verified(MODEL, TOK, [PUZZLE], sampler=sampler, rounds=4, variants=3,
                       on_round=lambda k, rows, plans: seen.append((k, rows)))[0]
    assert s.valid and s.grid == SOLUTION and not s.model_valid and s.rounds == 1 and seen == [(1, [0])]
    steps, hints = sampler.calls[1]
    assert len(sampler.calls) == 2 and len(hints) == 3  # one call, three re-runs side by side
    assert s.round_passes == [82, 3 * (1 + steps)] and s.passes == sum(s.round_passes)  # every variant is paid for
    with pytest.raises(DGemmaError, match="variants must be an integer >= 1"):
        solve_verified(MODEL, TOK, [PUZZLE], sampler=sampler, variants=0)


def test_rounds_zero_verifies_without_renoising():
    s, sampler = _solve([_broken(SOLUTION)], rounds=0)
    assert not s.valid and s.rounds == 0 and len(sampler.calls) == 1


def test_a_later_round_fixes_it_and_pins_keep_the_clues():
    bad = _broken(SOLUTION)
    s, sampler = _solve([bad, bad, SOLUTION], rounds=8)
    assert s.valid and not s.model_valid and s.rounds == 2 and s.grid == SOLUTION
    assert s.model_grid == bad  # the model-only answer is kept apart
    clue_tok = TOK.encode(PUZZLE)
    for k, (steps, hints) in enumerate(sampler.calls):
        row = hints[0]
        assert all(row[i] == clue_tok[i] for i in range(81) if PUZZLE[i] != "0"), k
        if k:  # a round re-noises something, and takes one step per re-noised cell (rounded up to 8)
            free = sum(h < 0 for h in row)
            assert free >= 1 and steps == min(81, 8 * -(-free // 8)) and free == s.renoised[k - 1]


def test_clues_are_pinned_in_later_rounds_even_when_round_0_does_not_pin():
    s, sampler = _solve([_broken(SOLUTION), SOLUTION], rounds=3, pin_clues=False)
    assert sampler.calls[0][1] is None and sampler.calls[1][1] is not None and s.valid


def test_bad_arguments_are_clear_errors():
    with pytest.raises(DGemmaError, match="rounds must be an integer >= 0"):
        _solve([SOLUTION], rounds=-1)
    with pytest.raises(DGemmaError, match="81 cells"):
        solve_verified(MODEL, TOK, ["123"], sampler=Scripted(answers=[SOLUTION]))
    with pytest.raises(DGemmaError, match="a Sudoku board needs 81"):
        solve_verified(MODEL, TOK, [PUZZLE], sampler=Scripted(answers=[SOLUTION], canvas_size=40))
    bpe = SimpleNamespace(encode=lambda s: [1] * (len(s) // 3))
    with pytest.raises(DGemmaError, match="one token per cell"):
        solve_verified(MODEL, bpe, [PUZZLE], sampler=Scripted(answers=[SOLUTION]))


# ------------------------------------------------------------------------------ a tiny real run
@pytest.fixture(scope="module")
def tiny(tiny_run):
    from dgemma.training.runs import load_run

    return load_run(tiny_run, device="cpu")


def _plain(s):
    return {k: v for k, v in dataclasses.asdict(s).items() if "seconds" not in k}


def test_tiny_run_is_checked_reproducible_and_keeps_clues(tiny):
    from dgemma.cli.solve import solve

    puzzles = [r["puzzle"] for r in generate_puzzles(3, seed=5, difficulty="easy")]
    a = solve_run(tiny, puzzles, rounds=3, seed=1)
    b = solve_run(tiny, puzzles, rounds=3, seed=1)
    assert [_plain(x) for x in a] == [_plain(x) for x in b]  # same seed, same output
    c = solve_run(tiny, puzzles, rounds=3, seed=1, variants=3)
    old = solve(puzzles, tiny, steps=81, step_type="commit", seed=1)  # dgemma solve --no-verify
    for s, o in [*zip(a, old), *zip(c, old)]:
        assert s.valid == is_solution(s.grid, s.puzzle) and s.model_valid == is_solution(s.model_grid, s.puzzle)
        assert s.model_valid == o["valid"]
        if len(o["grid"]) == 81:
            assert s.model_grid == o["grid"]
        assert all(p == "0" or p == g for p, g in zip(s.puzzle, s.grid))  # pinned clues survive every round
        assert s.rounds == (0 if s.model_valid else (3 if not s.valid else s.rounds)) <= 3
        assert len(s.round_passes) == s.rounds + 1 and s.passes == sum(s.round_passes)


def test_evaluate_verified_keeps_model_only_equal_to_the_plain_evaluator(tiny, tmp_path):
    from dgemma.eval.harness import evaluate
    from dgemma.tasks.sudoku import generate_eval_puzzles

    records = generate_eval_puzzles(6, seed=11)
    out = evaluate_verified(tiny, "sudoku", rounds=2, records=records)
    plain = evaluate(tiny, "sudoku", eval_name="plain", num_steps=81, step_type="commit", temperature=0.0,
                     early_stopping=None, records=records, out_dir=tmp_path, ar_max_tokens=0)
    assert {k: out["model_only"][k] for k in plain["metrics"]} == plain["metrics"]
    v = out["verified"]
    assert v["solved"] + v["unsolved"] == 6 == out["num_examples"] and len(out["examples"]) == 6
    assert v["valid_accuracy"] == v["solved"] / 6  # a verified answer is valid or absent, never wrong
    assert out["eval_name"] == "verified_steps81_rounds2" and out["settings"]["rounds"] == 2
    assert sum(v["rounds_histogram"].values()) == 6


def test_dgemma_eval_runs_the_verified_evaluator_beside_the_plain_one(tiny_run, tmp_path, capsys):
    """``--eval_names=verified_steps81_rounds2`` is an evaluator of its own: its own files, model-only
    and verified kept apart (two table rows), model-only equal to the plain greedy evaluator."""
    import json

    from dgemma.cli.main import main

    args = ["eval", f"--cfg.workdir={tiny_run}", "--eval_names=sample_ar_steps81,verified_steps81_rounds2",
            "--cfg.eval_ds.num_examples=6", "--cfg.eval_ds.step_type=commit", "--cfg.eval_ds.temperature=0",
            "--cfg.eval_ds.early_stopping=none", f"--out={tmp_path}", "--ar_max_tokens=0"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "verified_steps81_rounds2 model-only" in table and "verified_steps81_rounds2 verified" in table
    plain = json.loads(next((tmp_path / "eval" / "sample_ar_steps81").glob("step_*.json")).read_text())
    folder = tmp_path / "eval" / "verified_steps81_rounds2"
    ver = json.loads(next(folder.glob("step_*.json")).read_text())
    assert {k: ver["model_only"][k] for k in plain["metrics"]} == plain["metrics"]
    assert ver["verified"]["solved"] + ver["verified"]["unsolved"] == 6 and "examples" not in ver
    lines = next(folder.glob("step_*.jsonl")).read_text().splitlines()
    assert len(lines) == 6 and {"model_grid", "grid", "valid", "rounds"} <= set(json.loads(lines[0]))
    with pytest.raises(DGemmaError, match="verified solving is for the sudoku task"):
        from dgemma.eval.harness import parse_evaluator
        from dgemma.tasks import get_task

        parse_evaluator("verified_steps8_rounds2", get_task("pubmedqa"))
