"""Diagnostic: how much of PubMedQA's verdict can a Gemma 3 270M representation tell at all?

For every question of train (450), train_eval (50) and test (500) of a verdict-first data folder,
one causal forward of the chat prompt followed by "The answer is:" gives (a) the zero-shot
log-probabilities of " yes" / " no" / " maybe" there and (b) the final hidden state at that
position. A 3-class logistic regression on (b) (standardised, L2 strength picked by 5-fold
cross-validation on train + train_eval) is then scored on test. It bounds what a fine-tune that
keeps these features could read, and tells a verdict that learnt the prior from one that had
nothing to learn from.

    python scripts/pubmedqa_linear_probe.py [--run WORKDIR] [--data data/pubmedqa_first]

Without ``--run`` it probes the base model (``gemma3-270m``); with it, the run's model (an AR run's
LoRA merged in). bf16 autocast; ~10 minutes on two cores.
"""
import argparse
import json

import torch
import torch.nn.functional as F

from dgemma.data.sft import encode_prompts, read_jsonl
from dgemma.models.masks import TokenInfo

LABELS = ("yes", "no", "maybe")


def features(model, tok, records, prefix, cand, batch=8):
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt"]))  # little padding per batch
    last, zs = [None] * len(records), [None] * len(records)
    for lo in range(0, len(order), batch):
        idx = order[lo:lo + batch]
        ids, valid, _ = encode_prompts(tok, [records[k] for k in idx], 1024)
        n = valid.sum(-1)
        ids = torch.cat([ids, torch.full((len(idx), len(prefix)), tok.pad_id)], 1)
        valid = torch.cat([valid, torch.zeros(len(idx), len(prefix), dtype=torch.bool)], 1)
        for j in range(len(idx)):
            ids[j, n[j]:n[j] + len(prefix)] = torch.tensor(prefix)
            valid[j, n[j]:n[j] + len(prefix)] = True
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = model(ids, info=TokenInfo.clean(valid), return_hidden=True)
            h = h[torch.arange(len(idx)), valid.sum(-1) - 1]
            lp = model.logits(h).float().log_softmax(-1)[:, cand]
        for j, k in enumerate(idx):
            last[k], zs[k] = h[j].float(), lp[j]
    return torch.stack(last), torch.stack(zs)


def fit(x, y, lam):
    mu, sd = x.mean(0), x.std(0) + 1e-6
    w = torch.zeros(x.shape[1], 3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy((x - mu) / sd @ w + b, y) + lam * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lambda z: ((z - mu) / sd) @ w.detach() + b.detach()


def auc(score, pos):
    p, n = score[pos], score[~pos]
    return float((p[:, None] > n[None]).float().mean() + 0.5 * (p[:, None] == n[None]).float().mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="a training workdir (default: the base gemma3-270m)")
    ap.add_argument("--data", default="data/pubmedqa_first")
    args = ap.parse_args()
    if args.run:
        from dgemma.training.runs import load_run
        run = load_run(args.run, dtype="bfloat16")
        model, tok = run.model, run.tokenizer
    else:
        from dgemma.models.pretrained import load_pretrained
        model, tok = load_pretrained("gemma3-270m", dtype=torch.bfloat16)
    model.eval()
    prefix = tok.encode("The answer is:")
    cand = [tok.encode(" " + w)[0] for w in LABELS]
    split = {}
    for name in ("train", "train_eval", "test"):
        recs = read_jsonl(f"{args.data}/{name}.jsonl")
        split[name] = (*features(model, tok, recs, prefix, cand), torch.tensor([LABELS.index(r["label"]) for r in recs]))
    x_te, z_te, y_te = split["test"]
    out = {"model": args.run or "gemma3-270m", "n_test": len(y_te),
           "zero_shot": {"auc_yes_vs_rest": round(auc(z_te[:, 0] - z_te[:, 1], y_te == 0), 3),
                         "accuracy": round(float((z_te.argmax(-1) == y_te).float().mean()), 3),
                         "pred": [int((z_te.argmax(-1) == k).sum()) for k in range(3)]}}
    x = torch.cat([split["train"][0], split["train_eval"][0]])
    y = torch.cat([split["train"][2], split["train_eval"][2]])
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    best = None
    for lam in (1e-2, 1e-1, 1.0, 3.0, 10.0, 30.0, 100.0):
        accs = []
        for k in range(5):
            held = perm[k::5]
            keep = torch.ones(len(y), dtype=torch.bool)
            keep[held] = False
            f = fit(x[keep], y[keep], lam)
            accs.append(float((f(x[held]).argmax(-1) == y[held]).float().mean()))
        if best is None or sum(accs) / 5 > best[0]:
            best = (sum(accs) / 5, lam)
    z = fit(x, y, best[1])(x_te)
    out["linear_probe"] = {"lambda": best[1], "cv_accuracy": round(best[0], 3),
                           "accuracy": round(float((z.argmax(-1) == y_te).float().mean()), 3),
                           "auc_yes_vs_rest": round(auc(z[:, 0] - z[:, 1], y_te == 0), 3),
                           "pred": [int((z.argmax(-1) == k).sum()) for k in range(3)]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
