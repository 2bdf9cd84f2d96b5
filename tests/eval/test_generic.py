"""Generic metrics: hand-computed values, and the arithmetic example's answers checked by eval()."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest

from dgemma.data.chat import read_chat_jsonl
from dgemma.errors import DGemmaError
from dgemma.eval.generic import (
    bleu,
    chrf,
    compile_pattern,
    exact_match,
    generic_metrics,
    get_normalizer,
    normalize,
    regex_extract,
    rouge_l,
    score_example,
    sentence_bleu,
    sentence_chrf,
)

ANSWER = r"The answer is (?P<answer>-?\d+)"
REPO = Path(__file__).resolve().parents[2]
SENT = "the quick brown fox jumps over the lazy dog"


# -- normaliser and exact match -------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("  The Answer is:  -5. ", "the answer is -5"),
    ("Hello,   World!", "hello world"),
    ("3.5 and 1,000 and 1/2; then 3-5.", "3.5 and 1,000 and 1/2 then 3-5"),
    ("well-known e-mail", "wellknown email"),
    ("(−12)", "-12"),  # Unicode minus
    ("１２", "12"),  # full-width digits (NFKC)
    (None, ""),
])
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_normalize_flags():
    assert normalize(" A,  B ", lower=False) == "A B"
    assert normalize(" A,  B ", strip_punct=False) == "a, b"
    assert normalize(" A,  B ", collapse_ws=False) == " a  b "


def test_exact_match():
    preds = ["The answer is 4.", "the ANSWER is 4", "The answer is -4.", None]
    refs = ["the answer is 4"] * 4
    assert exact_match(preds, refs) == 0.5
    assert exact_match(preds, refs, "none") == 0.0
    assert exact_match(["a b"], ["a  b"], "strip") == 0.0
    assert exact_match(["A  b"], ["a b"], "lower") == 1.0
    assert exact_match(["x"], ["X"], str.lower) == 1.0
    assert exact_match([], []) == 0.0
    with pytest.raises(DGemmaError, match="same length"):
        exact_match(["a"], [])
    with pytest.raises(DGemmaError, match="unknown normalizer 'loose'"):
        get_normalizer("loose")


# -- regex ----------------------------------------------------------------------------------------
def test_regex_extract_first_match_named_groups():
    text = "First 3 + 4 = 7. The answer is 7. Or maybe The answer is 8."
    assert regex_extract(text, ANSWER) == {"answer": "7"}
    assert regex_extract("The answer is -12.", ANSWER) == {"answer": "-12"}
    assert regex_extract("I think it is 7.", ANSWER) is None  # no fallback to a bare number
    assert regex_extract(None, ANSWER) is None
    two = r"(?P<op>[+-]) (?P<n>\d+)(?P<unit> km)?"
    assert regex_extract("go + 12 then - 3 km", two) == {"op": "+", "n": "12", "unit": None}
    assert regex_extract("the answer is 7", "(?i)" + ANSWER) == {"answer": "7"}


def test_regex_must_have_named_groups():
    with pytest.raises(DGemmaError, match="no named group"):
        regex_extract("7", r"(\d+)")
    with pytest.raises(DGemmaError, match="invalid regex"):
        compile_pattern("(?P<answer>")
    with pytest.raises(DGemmaError, match="no group named 'answer'"):
        generic_metrics(["a"], ["a"], regex=r"(?P<x>\d)")


# -- ROUGE-L --------------------------------------------------------------------------------------
def test_rouge_l_hand_computed():
    # LCS of "the cat sat on the mat" / "the cat lay on a mat" = the cat on mat = 4; P = R = 4/6
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
    # LCS("a b c d", "a c") = 2: P = 2/4, R = 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    assert rouge_l("a b c d", "a c") == pytest.approx(2 / 3)
    # order matters: LCS("a b c", "c b a") = 1: P = R = 1/3
    assert rouge_l("a b c", "c b a") == pytest.approx(1 / 3)
    assert rouge_l("x y", "x y") == 1.0
    assert rouge_l("x y", "z") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "a") == 0.0 and rouge_l("a", "") == 0.0
    assert rouge_l("A b", "a b") == 0.5  # tokens compared exactly: case counts here


# -- BLEU and chrF --------------------------------------------------------------------------------
def test_bleu_and_chrf_extremes():
    assert bleu([SENT, SENT], [SENT, SENT]) == pytest.approx(100.0)
    assert chrf([SENT], [SENT]) == pytest.approx(100.0)
    assert sentence_bleu(SENT, SENT) == pytest.approx(100.0)
    assert sentence_chrf(SENT, SENT) == pytest.approx(100.0)
    other = "1234 5678 9090 0123 4567 8989"  # no character in common with SENT
    assert bleu([other], [SENT]) == pytest.approx(0.0, abs=1e-6)
    assert chrf([other], [SENT]) == pytest.approx(0.0, abs=1e-6)
    assert sentence_bleu(other, SENT) < 1.0
    assert bleu([], []) == 0.0 and chrf([], []) == 0.0
    assert 0.0 < bleu(["the quick brown fox jumps over a sleepy dog"], [SENT]) < 100.0


# -- batch and per-example ------------------------------------------------------------------------
def test_generic_metrics_with_answer_regex():
    refs = ["2 + 2 = 4. The answer is 4.", "5 - 8 = -3. The answer is -3.", "7", "The answer is 10."]
    texts = ["2 + 2 = 4. The answer is 4.",  # exact and right
             "5 - 8 = 3. The answer is 3.",  # wrong sign
             "Surely the answer is 7; The answer is 7.",  # bare reference "7": right
             "It is 10."]  # no match: wrong, not parsed
    m = generic_metrics(texts, refs, regex=ANSWER)
    assert set(m) == {"count", "exact_match", "rouge_l", "bleu", "chrf", "answer_accuracy", "answer_parsed"}
    assert m["count"] == 4
    assert m["exact_match"] == 0.25
    assert m["answer_accuracy"] == 0.5
    assert m["answer_parsed"] == 0.75
    # ROUGE-L on normalised texts: 1; "5 8 = 3 the answer is 3" vs "5 8 = -3 the answer is -3": 6/8;
    # "surely the answer is 7 the answer is 7" vs "7": P = 1/9, R = 1, F1 = 0.2; "it is 10" vs
    # "the answer is 10": LCS = is 10, P = 2/3, R = 2/4, F1 = 4/7
    assert m["rouge_l"] == pytest.approx((1 + 6 / 8 + 0.2 + 4 / 7) / 4)
    assert 0 < m["bleu"] < 100 and 0 < m["chrf"] < 100
    assert set(generic_metrics(texts, refs)) == {"count", "exact_match", "rouge_l", "bleu", "chrf"}


def test_generic_metrics_empty_batch():
    assert generic_metrics([], [], regex=ANSWER) == {"count": 0, "exact_match": 0.0, "rouge_l": 0.0, "bleu": 0.0,
                                                     "chrf": 0.0, "answer_accuracy": 0.0, "answer_parsed": 0.0}


def test_score_example():
    s = score_example("So -3. The answer is -3.", "5 - 8 = -3. The answer is -3.", regex=ANSWER)
    assert s["exact_match"] == 0.0 and s["answer_correct"] == 1.0
    assert (s["answer"], s["reference_answer"], s["extracted"]) == ("-3", "-3", {"answer": "-3"})
    assert 0 < s["bleu"] < 100 and 0 < s["chrf"] < 100 and 0 < s["rouge_l"] < 1
    s = score_example(None, "7", regex=ANSWER)
    assert (s["answer"], s["answer_correct"], s["extracted"], s["exact_match"]) == (None, 0.0, None, 0.0)
    s = score_example("Same.", "same")
    assert s["exact_match"] == 1.0 and s["rouge_l"] == 1.0 and "answer" not in s
    json.dumps(s)  # a JSONL row


# -- the arithmetic example -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def make_data():
    spec = importlib.util.spec_from_file_location("arith_make_data", REPO / "examples/arithmetic/make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_row(row: dict) -> None:
    turns = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    users = [m["content"] for m in row["messages"] if m["role"] == "user"]
    assert len(turns) == len(row["expressions"]) == len(row["answers"])
    for user, text, expr, answer in zip(users, turns, row["expressions"], row["answers"]):
        assert re.fullmatch(r"-?\d+ [-+*/%]{1,2} \d+( [-+*] \d+)?", expr), expr
        assert eval(expr, {"__builtins__": {}}) == answer
        if "//" in expr:
            a, b = map(int, expr.split(" // "))
            assert a % b == 0  # sharing equally divides exactly
        assert text.endswith(f"The answer is {answer}.")
        assert regex_extract(text, ANSWER) == {"answer": str(answer)}
        for number in re.findall(r"-?\d+", expr):
            assert re.search(rf"(?<![\d-]){re.escape(number)}(?!\d)", user), (number, user)


def test_generator_answers_verify_and_are_deterministic(make_data):
    train, evaluation = make_data.generate(300, 40, seed=3)
    assert (train, evaluation) == make_data.generate(300, 40, seed=3)
    assert train != make_data.generate(300, 40, seed=4)[0]
    for row in train + evaluation:
        check_row(row)

    def questions(rows):
        out = []
        for r in rows:
            for m in r["messages"]:
                if m["role"] == "user":
                    q = m["content"]
                    for prefix in make_data.FOLLOW_UPS:
                        q = q.removeprefix(prefix + " ")
                    out.append(q)
        return out

    all_questions = questions(train) + questions(evaluation)
    assert len(set(all_questions)) == len(all_questions)  # no question twice, so none shared by the splits
    rng = random.Random(0)
    for _ in range(200):
        q, a, expr, answer = make_data.make_problem(rng)
        assert eval(expr, {"__builtins__": {}}) == answer and a.endswith(f"The answer is {answer}.")


def test_generator_writes_valid_chat_jsonl(make_data, tmp_path):
    make_data.main(["--out", str(tmp_path), "--train", "50", "--eval", "10", "--seed", "1"])
    for name, n in (("train.jsonl", 50), ("eval.jsonl", 10)):
        records, problems = read_chat_jsonl(tmp_path / name)
        assert problems == [] and len(records) == n


@pytest.mark.parametrize("split, n", [("train", 2000), ("eval", 200)])
def test_committed_example_data(split, n):
    path = REPO / "examples/arithmetic/data" / f"{split}.jsonl"
    records, problems = read_chat_jsonl(path)
    assert problems == [] and len(records) == n
    for row in records:
        check_row(row)
