#!/usr/bin/env python3
"""Make the arithmetic word-problem data set: chat JSONL with verifiable integer answers.

Written for this project (templates and wording are ours). Deterministic: the same ``--seed``
and sizes give byte-identical files. Each line is a conversation::

    {"messages": [{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...],
     "expressions": ["20 - 4 * 3", ...], "answers": [8, ...], "id": "train-00000"}

Every assistant turn is a short worked solution ending with ``The answer is N.``; ``expressions``
and ``answers`` list, per assistant turn, a Python expression over the numbers in the question
and its integer value (``eval(expression) == answer``), so the data can be checked mechanically.
About a fifth of the conversations have two problems (two user/assistant rounds), which
exercises history rendering and ``supervise="all"``. The eval split shares no question with the
training split.

Usage: ``python examples/arithmetic/make_data.py [--out DIR] [--train 2000] [--eval 200] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "Solve the word problem step by step. End with \"The answer is N.\""
NAMES = ("Ada", "Bilal", "Chen", "Dara", "Elif", "Femi", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Mateo", "Noor", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tove")
ITEMS = (("notebook", "notebooks"), ("pencil", "pencils"), ("apple", "apples"), ("ticket", "tickets"),
         ("mug", "mugs"), ("stamp", "stamps"), ("candle", "candles"), ("sticker", "stickers"))
FOLLOW_UPS = ("Thanks! Here is another one.", "Great. One more, please:", "Now try this one.")


def shopping(rng: random.Random):
    name, (item, items) = rng.choice(NAMES), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(2, 15)
    cost = n * price
    bill = rng.choice([b for b in (20, 50, 100, 200) if b >= cost])
    q = (f"{name} buys {n} {items} that cost {price} dollars each and pays with a {bill}-dollar bill. "
         f"How many dollars of change does {name} get?")
    a = (f"Each {item} costs {price} dollars, so {n} {items} cost {n} × {price} = {cost} dollars. "
         f"The change is {bill} - {cost} = {bill - cost} dollars.")
    return q, a, f"{bill} - {n} * {price}"


def sharing(rng: random.Random):
    name, (_, items) = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 12), rng.randint(2, 25)
    total = friends * each
    q = f"{name} shares {total} {items} equally among {friends} friends. How many {items} does each friend get?"
    a = f"Sharing {total} {items} among {friends} friends gives {total} ÷ {friends} = {each} {items} each."
    return q, a, f"{total} // {friends}"


def distance(rng: random.Random):
    speed, hours, extra = rng.randint(20, 90), rng.randint(2, 6), rng.randint(5, 60)
    vehicle = rng.choice(("A train", "A bus", "A cyclist", "A ferry"))
    q = (f"{vehicle} travels at {speed} km per hour for {hours} hours, then covers another {extra} km. "
         "How many km does it travel in total?")
    a = (f"In {hours} hours at {speed} km per hour it covers {speed} × {hours} = {speed * hours} km. "
         f"Adding {extra} km gives {speed * hours} + {extra} = {speed * hours + extra} km.")
    return q, a, f"{speed} * {hours} + {extra}"


def temperature(rng: random.Random):
    start, drop = rng.randint(-10, 15), rng.randint(3, 25)
    city = rng.choice(("Oslo", "Calgary", "Harbin", "Tallinn", "Denver"))
    q = (f"In {city} the temperature was {start} degrees at noon and fell by {drop} degrees by midnight. "
         "What was the temperature at midnight, in degrees?")
    a = f"Falling by {drop} degrees from {start} gives {start} - {drop} = {start - drop} degrees."
    return q, a, f"{start} - {drop}"


def savings(rng: random.Random):
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(3, 30), rng.randint(2, 10)
    saved = weekly * weeks
    spent = rng.randint(1, saved - 1)
    q = (f"{name} saves {weekly} dollars every week for {weeks} weeks, then spends {spent} dollars on a gift. "
         "How many dollars are left?")
    a = (f"{name} saves {weekly} × {weeks} = {saved} dollars. After spending {spent} dollars, "
         f"{saved} - {spent} = {saved - spent} dollars are left.")
    return q, a, f"{weekly} * {weeks} - {spent}"


def leftovers(rng: random.Random):
    size = rng.randint(3, 12)
    eggs = rng.randint(size + 1, size * 15)
    q = f"A farm packs {eggs} eggs into boxes of {size}, filling as many boxes as it can. How many eggs are left over?"
    full = eggs // size
    a = (f"{eggs} ÷ {size} is {full} full boxes holding {full} × {size} = {full * size} eggs, "
         f"so {eggs} - {full * size} = {eggs % size} eggs are left over.")
    return q, a, f"{eggs} % {size}"


def ages(rng: random.Random):
    name, other = rng.sample(NAMES, 2)
    age, gap, years = rng.randint(8, 40), rng.randint(2, 7), rng.randint(2, 15)
    q = (f"{name} is {age} years old and {other} is {gap} years younger. "
         f"How old will {other} be in {years} years?")
    a = (f"{other} is {age} - {gap} = {age - gap} years old now, so in {years} years "
         f"{other} will be {age - gap} + {years} = {age - gap + years}.")
    return q, a, f"{age} - {gap} + {years}"


TEMPLATES = (shopping, sharing, distance, temperature, savings, leftovers, ages)


def make_problem(rng: random.Random) -> tuple[str, str, str, int]:
    """One problem: ``(question, assistant answer, expression, answer)``; the assistant answer
    ends with ``The answer is N.``."""
    question, work, expression = rng.choice(TEMPLATES)(rng)
    answer = eval(expression, {"__builtins__": {}})  # our own arithmetic strings, no names
    assert isinstance(answer, int)
    return question, f"{work} The answer is {answer}.", expression, answer


def make_conversation(rng: random.Random, seen: set[str]) -> dict | None:
    """A one- or two-problem conversation whose questions are all unseen (None on a collision)."""
    rounds = 2 if rng.random() < 0.2 else 1
    problems = [make_problem(rng) for _ in range(rounds)]
    questions = [p[0] for p in problems]
    if any(q in seen for q in questions) or len(set(questions)) != rounds:
        return None
    seen.update(questions)
    messages = [{"role": "system", "content": SYSTEM}]
    for k, (question, answer_text, _, _) in enumerate(problems):
        user = question if k == 0 else f"{rng.choice(FOLLOW_UPS)} {question}"
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer_text}]
    return {"messages": messages, "expressions": [p[2] for p in problems], "answers": [p[3] for p in problems]}


def generate(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` conversations; no question appears twice anywhere."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n_train + n_eval:
        attempts += 1
        if attempts > 50 * (n_train + n_eval) + 1000:
            raise RuntimeError("too many duplicate problems; ask for fewer rows")
        if (row := make_conversation(rng, seen)) is not None:
            rows.append(row)
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    for split, part in (("eval", eval_rows), ("train", train_rows)):
        for i, row in enumerate(part):
            row["id"] = f"{split}-{i:05d}"
    return train_rows, eval_rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, evaluation = generate(args.train, args.eval, args.seed)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", evaluation)
    print(f"wrote {len(train)} train and {len(evaluation)} eval conversations to {args.out}")


if __name__ == "__main__":
    main()
