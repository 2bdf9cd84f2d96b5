"""Diagnostic: P(yes/no/maybe) at the verdict position of a verdict-first PubMedQA diffusion adapter,
with "The answer is:" pinned and the rest of canvas 1 masked (the decoder's first step), and the AUC
of P(yes) - P(no) for yes-labelled questions against the rest: does the verdict read the question?
For an AR fine-tune (no diffusion loss), the next-token probabilities after the prompt and
"The answer is:", the position its greedy decoder writes the verdict at.

    python scripts/pubmedqa_verdict_probe.py WORKDIR STEP [SPLIT] [OUT.jsonl]   # SPLIT: train_eval (default), test or train

``train`` reads the run's training file (``<data.path>/train.jsonl``), e.g. to fit a decision rule.

``OUT.jsonl`` (optional) receives one line per question: its id, label and the three probabilities.
"""
import json, sys, torch
from dgemma.training.runs import load_run
from dgemma.tasks import get_task
from dgemma.eval import harness
from dgemma.data.sft import encode_prompts

wd, step, split = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "train_eval"
out = sys.argv[4] if len(sys.argv) > 4 else None
run = load_run(wd, step=step, dtype="bfloat16")
task = get_task("pubmedqa")
if split == "train":
    from pathlib import Path
    from dgemma.data.sft import read_jsonl
    recs = read_jsonl(Path(run.cfg.data.path) / "train.jsonl")
else:
    recs = task.load(run.cfg, split)
tok = run.tokenizer
prefix = tok.encode("The answer is:")
cand = {w: tok.encode(" " + w)[0] for w in ("yes", "no", "maybe")}
sampler, _ = harness.build_sampler(run, task, num_steps=2, step_type="commit", temperature=0.0, early_stopping=None)
sampler.max_canvases = 1
probs = []
class Tap:
    def __init__(s, inner): s.inner = inner
    def __getattr__(s, n): return getattr(s.inner, n)
    def __call__(s, state, logits, t, u, **kw):
        if t == 1.0:
            p = torch.softmax(logits[:, len(prefix)].float(), -1)
            probs.append(torch.stack([p[:, cand[w]] for w in ("yes", "no", "maybe")], -1))
        return s.inner(state, logits, t, u, **kw)
sampler.step = Tap(sampler.step)
C = sampler.canvas_size
ar = not run.cfg.diffusion.diffusion_loss_weight  # an AR fine-tune: the next-token head after the prefix
from dgemma.models.masks import TokenInfo
for i in range(0, len(recs), 16):
    b = recs[i:i+16]
    ids, valid, _ = encode_prompts(tok, b, run.cfg.data.prompt_len)
    if ar:  # the prompt, then "The answer is:" where the answer starts; read the next token
        n = valid.long().sum(-1)
        ids = torch.cat([ids, torch.zeros(len(b), len(prefix), dtype=ids.dtype)], 1)
        valid = torch.cat([valid.bool(), torch.zeros(len(b), len(prefix), dtype=torch.bool)], 1)
        for r in range(len(b)):
            ids[r, n[r]:n[r] + len(prefix)] = torch.tensor(prefix)
            valid[r, n[r]:n[r] + len(prefix)] = True
        with torch.no_grad():
            h = run.model(ids, info=TokenInfo.clean(valid), return_hidden=True)
            p = torch.softmax(run.model.logits(h[torch.arange(len(b)), n + len(prefix) - 1]).float(), -1)
        probs.append(torch.stack([p[:, cand[w]] for w in ("yes", "no", "maybe")], -1))
        continue
    hints = torch.full((len(b), C), -1, dtype=torch.long); hints[:, :len(prefix)] = torch.tensor(prefix)
    sampler(run.model, ids, valid, generator=torch.Generator().manual_seed(0), hints=hints)
P = torch.cat(probs)
labels = [r["label"] for r in recs]
if out:
    with open(out, "w") as f:
        for r, p in zip(recs, P.tolist()):
            f.write(json.dumps({"id": r.get("id"), "label": r["label"], "p": dict(zip(("yes", "no", "maybe"), p))}) + "\n")
y = torch.tensor([l == "yes" for l in labels])
s = P[:, 0] - P[:, 1]
pos, neg = s[y], s[~y]
auc = ((pos[:, None] > neg[None, :]).float().mean() + 0.5 * (pos[:, None] == neg[None, :]).float().mean()).item()
print(json.dumps({"step": step, "split": split, "n": len(recs), "mean_p": {w: round(float(P[:, k].mean()), 3) for k, w in enumerate(("yes", "no", "maybe"))},
                  "mean_p_yes_given": {l: round(float(P[[x == l for x in labels], 0].mean()), 3) for l in ("yes", "no", "maybe") if l in labels},
                  "auc_yes_vs_rest": round(auc, 3), "argmax": {w: int((P.argmax(-1) == k).sum()) for k, w in enumerate(("yes", "no", "maybe"))}}))
