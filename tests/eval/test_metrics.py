import subprocess
import sys

import pytest
import sacrebleu

from dgemma.errors import DGemmaError
from dgemma.tasks.pubmedqa import extract_decision, pubmedqa_metrics
from dgemma.tasks.sudoku import score_sudoku, sudoku_metrics

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"  # 30 clues
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
METRICS = (
    "accuracy",
    "cell_accuracy",
    "blank_accuracy",
    "exact_mask_accuracy",
    "partial_mask_accuracy",
    "valid_accuracy",
)


def _set(s, i, d):
    return s[:i] + d + s[i + 1 :]


def _two_wrong_blanks_one_changed_clue():
    out = _set(SOLUTION, 2, "1")  # cell 3 is a blank (solution 4)
    out = _set(out, 3, "1")  # cell 4 is a blank (solution 6)
    return _set(out, 0, "9")  # cell 1 is the clue 5


def test_registry_tasks_score_with_their_metric_modules():
    from dgemma.tasks import get_task

    texts, recs = ["The answer is: yes"], [{"label": "yes", "long_answer": "x"}]
    assert get_task("pubmedqa").score(texts, recs) == pubmedqa_metrics(texts, ["yes"], ["x"])
    grid = {"puzzle": SOLUTION, "solution": SOLUTION}
    assert get_task("sudoku").score([SOLUTION], [grid]) == sudoku_metrics([SOLUTION], [SOLUTION], [SOLUTION])


def test_sudoku_three_example_batch():
    texts = ["The answer is: " + " ".join(SOLUTION), _two_wrong_blanks_one_changed_clue(), "I cannot solve this."]
    m = sudoku_metrics(texts, [PUZZLE] * 3, [SOLUTION] * 3)
    expected = {
        "accuracy": 1 / 3,
        "cell_accuracy": (51 / 81 + 49 / 81 + 0) / 3,
        "blank_accuracy": (1 + 49 / 51 + 0) / 3,
        "exact_mask_accuracy": 1 / 3,
        "partial_mask_accuracy": (1 + 29 / 30 + 0) / 3,
        "valid_accuracy": 1 / 3,
    }
    keys = set(METRICS) | {f"{k}_{b}" for k in METRICS for b in ("easy", "medium", "hard")}
    assert set(m) == keys | {"count", "count_easy", "count_medium", "count_hard"}
    for k, v in expected.items():
        assert m[k] == pytest.approx(v) and m[f"{k}_medium"] == pytest.approx(v)
        assert m[f"{k}_easy"] == 0.0 and m[f"{k}_hard"] == 0.0
    assert m["cell_accuracy"] == pytest.approx(100 / 243)
    assert m["blank_accuracy"] == pytest.approx(100 / 153)
    assert m["partial_mask_accuracy"] == pytest.approx(59 / 90)
    assert (m["count"], m["count_easy"], m["count_medium"], m["count_hard"]) == (3, 0, 3, 0)


def test_score_sudoku_per_example():
    s = score_sudoku(_two_wrong_blanks_one_changed_clue(), PUZZLE, SOLUTION)
    assert s["parsed"] and s["clues"] == 30 and s["difficulty"] == "medium"
    assert (s["accuracy"], s["exact_mask_accuracy"], s["valid_accuracy"]) == (0.0, 0.0, 0.0)
    assert s["cell_accuracy"] == pytest.approx(49 / 81)
    assert s["blank_accuracy"] == pytest.approx(49 / 51)
    assert s["partial_mask_accuracy"] == pytest.approx(29 / 30)
    bad = score_sudoku("1 2 3", PUZZLE, SOLUTION)
    assert not bad["parsed"] and bad["prediction"] is None
    assert all(bad[k] == 0.0 for k in METRICS)


def test_valid_accuracy_accepts_another_solution():
    other = SOLUTION.translate(str.maketrans("12", "21"))  # a different valid grid
    s = score_sudoku(other, "0" * 81, SOLUTION)
    assert (s["accuracy"], s["valid_accuracy"]) == (0.0, 1.0)
    assert (s["exact_mask_accuracy"], s["partial_mask_accuracy"]) == (1.0, 1.0)
    assert s["cell_accuracy"] == pytest.approx(63 / 81) and s["blank_accuracy"] == pytest.approx(63 / 81)
    assert s["difficulty"] == "hard"


def test_sudoku_buckets_and_errors():
    easy = "0" * 36 + SOLUTION[36:]  # 45 clues
    hard = "0" * 60 + SOLUTION[60:]  # 21 clues
    m = sudoku_metrics([SOLUTION, "nothing"], [easy, hard], [SOLUTION, SOLUTION])
    assert (m["count"], m["count_easy"], m["count_medium"], m["count_hard"]) == (2, 1, 0, 1)
    assert m["accuracy_easy"] == 1.0 and m["accuracy_hard"] == 0.0 and m["accuracy"] == 0.5
    assert m["cell_accuracy_easy"] == pytest.approx(36 / 81) and m["blank_accuracy_easy"] == 1.0
    assert m["valid_accuracy_medium"] == 0.0
    empty = sudoku_metrics([], [], [])
    assert empty["count"] == 0 and empty["accuracy"] == 0.0
    with pytest.raises(DGemmaError, match="same length"):
        sudoku_metrics(["x"], [PUZZLE], [])
    with pytest.raises(DGemmaError, match="example 0: solution contradicts its puzzle at cell 1"):
        sudoku_metrics(["x"], ["1" + PUZZLE[1:]], [SOLUTION])


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Because of X. The answer is: yes", "yes"),
        ("THE ANSWER IS maybe.", "maybe"),
        ("the answer is:no", "no"),
        ("The answer is\nno", "no"),
        ("The answer is yesterday's result", None),
        ("The answer is: not clear", None),
        ("yes", None),
        ("The answer: yes", None),
        ("the answer is: maybe. The answer is: yes", "maybe"),
        ("", None),
    ],
)
def test_extract_decision(text, expected):
    assert extract_decision(text) == expected


def test_pubmedqa_hand_computed():
    la = ["Long one.", "Long two.", "Long three.", "Long four."]
    texts = [
        "Long one. The answer is: yes",
        "Other words. The answer is: yes",
        "No decision at all",
        "Long four. The answer is: yes",
    ]
    m = pubmedqa_metrics(texts, ["yes", "no", "maybe", "yes"], la)
    assert m["accuracy"] == 0.5
    assert m["f1_yes"] == pytest.approx(0.8)  # tp 2, 3 predicted, 2 labelled
    assert m["f1_no"] == 0.0 and m["f1_maybe"] == 0.0
    assert m["macro_f1"] == pytest.approx(4 / 15)
    assert (m["label_yes"], m["label_no"], m["label_maybe"]) == (2, 1, 1)
    assert (m["pred_yes"], m["pred_no"], m["pred_maybe"]) == (3, 0, 0)
    assert m["unparsed"] == 1 and m["count"] == 4
    def bleu(hyp, ref):
        return sacrebleu.sentence_bleu(hyp, [ref], smooth_method="floor", use_effective_order=True).score

    scores = [100.0, bleu("Other words.", "Long two."), bleu("No decision at all", "Long three."), 100.0]
    assert m["bleu"] == pytest.approx(sum(scores) / 4)


def test_pubmedqa_absent_class_left_out_of_macro_f1():
    m = pubmedqa_metrics(["The answer is: yes", "the answer is: no"], ["yes", "no"], ["a", "b"])
    assert m["macro_f1"] == 1.0 and m["f1_maybe"] == 0.0 and m["accuracy"] == 1.0


def test_pubmedqa_errors():
    with pytest.raises(DGemmaError, match="same length"):
        pubmedqa_metrics(["x"], ["yes", "no"], ["a"])
    with pytest.raises(DGemmaError, match="label 1 must be yes, no or maybe, got 'Yes'"):
        pubmedqa_metrics(["x", "y"], ["yes", "Yes"], ["a", "b"])


def test_tasks_and_metrics_do_not_import_torch():
    # dgemma/__init__ imports the model (torch); stub the top package to see what the tasks pull in
    code = (
        "import sys, types, importlib.util\n"
        "pkg = types.ModuleType('dgemma')\n"
        "pkg.__path__ = importlib.util.find_spec('dgemma').submodule_search_locations\n"
        "sys.modules['dgemma'] = pkg\n"
        "import dgemma.eval, dgemma.eval.generic, dgemma.tasks, dgemma.tasks.sudoku, dgemma.tasks.pubmedqa\n"
        "assert dgemma.tasks.sudoku.sudoku_metrics and dgemma.tasks.pubmedqa.pubmedqa_metrics\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
