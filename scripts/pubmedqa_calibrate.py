"""Fit a verdict prior correction: the logit bias on " no" / " maybe" (" yes" fixed at 0) that
maximises accuracy on one set of verdict probabilities, reported on others.

A verdict-first adapter that answers "yes" to every question can still rank the questions
(checkpoints/pubmedqa_270m/README.md: AUC 0.61); its argmax is stuck on the class prior. Adding
b_no, b_maybe to those two logits moves the decision threshold, nothing else; the pair is chosen
on data the test set never sees (the training questions), by grid search (steps of 0.05 in
[-8, 8]; ties: higher macro-F1, then the smaller shift).

    python scripts/pubmedqa_verdict_probe.py RUN STEP train runs/calib/train.jsonl   # P(verdict) per question
    python scripts/pubmedqa_verdict_probe.py RUN STEP test runs/calib/test.jsonl
    python scripts/pubmedqa_calibrate.py runs/calib/train.jsonl runs/calib/test.jsonl [--out BIAS.json]

Input lines: ``{"id", "label", "p": {"yes", "no", "maybe"}}``. Prints one JSON line per set
with the bias's accuracy, macro-F1 and predicted counts, beside the uncorrected argmax's; ``--out``
writes ``{"logit_bias": {" no": b_no, " maybe": b_maybe}, ...}`` for ``eval_ds.logit_bias``.
"""
import argparse
import json
import math

CLASSES = ("yes", "no", "maybe")


def read(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [([math.log(max(r["p"][c], 1e-12)) for c in CLASSES], r["label"]) for r in rows]


def predict(rows, bias):
    return [CLASSES[max(range(3), key=lambda k: lp[k] + bias[k])] for lp, _ in rows]


def scores(rows, bias):
    pred = predict(rows, bias)
    labels = [y for _, y in rows]
    f1 = []
    for c in CLASSES:
        tp = sum(p == c == y for p, y in zip(pred, labels))
        n_pred, n_true = pred.count(c), labels.count(c)
        f1.append(0.0 if tp == 0 else 2 * tp / (n_pred + n_true))
    return {"n": len(rows), "accuracy": sum(p == y for p, y in zip(pred, labels)) / len(rows),
            "macro_f1": sum(f1) / 3, "pred": {c: pred.count(c) for c in CLASSES}}


def fit(rows, lo=-8.0, hi=8.0, step=0.05):
    grid = [round(lo + i * step, 4) for i in range(int(round((hi - lo) / step)) + 1)]
    best = None
    for b_no in grid:
        for b_maybe in grid:
            s = scores(rows, (0.0, b_no, b_maybe))
            key = (s["accuracy"], s["macro_f1"], -(abs(b_no) + abs(b_maybe)))
            if best is None or key > best[0]:
                best = (key, (0.0, b_no, b_maybe))
    return best[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fit", help="verdict probabilities to fit the bias on (the training questions)")
    ap.add_argument("report", nargs="*", help="more sets to report it on (train_eval, test)")
    ap.add_argument("--out", help="write the fitted bias as JSON here")
    args = ap.parse_args()
    fit_rows = read(args.fit)
    bias = fit(fit_rows)
    for path in [args.fit, *args.report]:
        rows = read(path)
        print(json.dumps({"set": path, "bias": {" no": bias[1], " maybe": bias[2]}, **scores(rows, bias),
                          "argmax": scores(rows, (0.0, 0.0, 0.0))}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"logit_bias": {" no": bias[1], " maybe": bias[2]}, "fit_on": args.fit,
                       "fit": scores(fit_rows, bias)}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
