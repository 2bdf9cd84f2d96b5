"""The PubMedQA table and curves of a diffusion run beside its AR baseline, from their eval files.

    python scripts/pubmedqa_report.py --diffusion checkpoints/pubmedqa_270m --ar checkpoints/pubmedqa_270m/ar \\
        [--batch1 DIR ...] [--out checkpoints/pubmedqa_270m]

Reads what ``dgemma eval`` wrote (``DIR/eval/<eval_name>/step_<S>.json``: the latest step of each
evaluator on the test split) and prints one markdown table: accuracy, macro-F1, per-class
predictions, BLEU, tokens per forward, tokens/s at the evaluation's batch size and, where a
``--batch1`` directory holds the same evaluator run at batch 1, at batch 1; the majority-class
baseline (55.2%: 276 of 500 test questions are "yes") is the first row. ``--verdict`` folders hold
first-canvas evaluations (``--cfg.eval_ds.max_canvases=1``: a verdict-first model's verdict), whose
rows give accuracy, macro-F1 and predictions only. ``--out`` also writes
``results.md``, ``results.json`` and ``curves.png`` (held-out accuracy on the 50 train-eval
questions against training step, from ``train_eval_*`` evaluations, and the training loss).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAJORITY = {"name": "majority class (yes)", "accuracy": 276 / 500, "macro_f1": (2 * 276 / (500 + 276)) / 3}


def latest(folder: Path, split: str = "test") -> dict | None:
    files = sorted(folder.glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    results = [json.loads(p.read_text()) for p in files]
    results = [r for r in results if r.get("split") == split]
    return results[-1] if results else None


def collect(workdir: Path, label: str) -> list[dict]:
    rows = []
    for folder in sorted((workdir / "eval").glob("*")):
        if folder.name == "tb" or not folder.is_dir():
            continue
        r = latest(folder)
        if r is not None:
            rows.append({"model": label, **r})
    return rows


def kind(result: dict) -> str:
    """"AR" for the greedy AR decoder's evaluations, else "diffusion"."""
    return "AR" if result["eval_name"].endswith("ar_greedy") else "diffusion"


def curve(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for folder in sorted((workdir / "eval").glob("train_eval_*")):
        pts = []
        for p in folder.glob("step_*.json"):
            r = json.loads(p.read_text())
            pts.append((r["checkpoint_step"], r["metrics"]["accuracy"]))
        out[folder.name] = sorted(pts)
    return out


def losses(workdir: Path) -> list[tuple[int, float]]:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if r.get("split") == "train" and "loss" in r]


def fmt(v, pct=False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else (f"{v:.3g}" if isinstance(v, float) else str(v))


def table(rows: list[dict], batch1: dict[tuple[str, str], float], batch16: dict | None = None) -> str:
    """``batch16`` (optional) replaces a row's batch-B tokens/s with one measured apart (on an idle
    machine, when the accuracy run shared it)."""
    batch16 = batch16 or {}
    head = ("| model | decoder | questions | accuracy % | macro-F1 | pred yes/no/maybe | unparsed | BLEU | tok/fwd | "
            "steps/canvas | tok/s (batch B) | tok/s batch 1 |")
    lines = [head, "|" + "---|" * 12]
    lines.append(f"| {MAJORITY['name']} | - | 500 | {fmt(MAJORITY['accuracy'], True)} | {fmt(MAJORITY['macro_f1'])} | "
                 "500/0/0 | 0 | - | - | - | - | - |")
    for r in rows:
        m, s = r["metrics"], r["stats"]
        b = r["settings"].get("batch_size")
        key = (r["model"].split(" ")[0], r["eval_name"])
        tps = batch16.get(key, s["tokens_per_second"])
        # a first-canvas row holds the verdict only: no explanation to score, no answer to time
        only = r.get("verdict_only")
        bleu, tpf = ("-", "-") if only else (fmt(m["bleu"]), fmt(s["tokens_per_forward"]))
        speed, speed1 = ("-", "-") if only else (f"{fmt(tps)} (B={b})", fmt(batch1.get(key)))
        lines.append(
            f"| {r['model']} | {r['eval_name']} | {r['num_examples']} | {fmt(m['accuracy'], True)} | "
            f"{fmt(m['macro_f1'])} | {m['pred_yes']}/{m['pred_no']}/{m['pred_maybe']} | {m['unparsed']} | "
            f"{bleu} | {tpf} | {fmt(s.get('mean_steps_per_canvas'))} | {speed} | {speed1} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diffusion", type=Path, required=True)
    p.add_argument("--ar", type=Path, required=True)
    p.add_argument("--batch1", type=Path, nargs="*", default=[],
                   help="folders with batch-1 evaluations (dgemma eval --out DIR --cfg.eval_ds.batch_size=1)")
    p.add_argument("--subset", type=Path, nargs="*", default=[],
                   help="folders with evaluations on the first questions only (dgemma eval --out DIR "
                        "--cfg.aux.eval_num_batches=N); their rows say how many")
    p.add_argument("--verdict", type=Path, nargs="*", default=[],
                   help="folders with first-canvas evaluations (--cfg.eval_ds.max_canvases=1): accuracy only")
    p.add_argument("--batch16", type=Path, nargs="*", default=[],
                   help="folders whose batch-16 tokens/s replace the accuracy runs' (measured on an idle machine)")
    p.add_argument("--curves", type=Path, nargs="*", default=[],
                   help="more folders whose train_eval_* evaluations are plotted (e.g. DIR/curve16)")
    p.add_argument("--losses", type=Path, nargs="*", default=[],
                   help="training workdirs whose metrics.jsonl loss is plotted (default: --diffusion, --ar)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = collect(args.diffusion, "diffusion") + collect(args.ar, "AR")
    for folder in args.verdict:
        rows += [{**r, "model": f"{kind(r)} (first canvas)", "verdict_only": True} for r in collect(folder, "")]
    for folder in args.subset:
        rows += [{**r, "model": f"{kind(r)} (subset)"} for r in collect(folder, "")]
    speeds = {}
    for name, folders in (("batch1", args.batch1), ("batch16", args.batch16)):
        speeds[name] = {}
        for folder in folders:
            for r in collect(folder, ""):
                speeds[name][(kind(r), r["eval_name"])] = r["stats"]["tokens_per_second"]
    batch1 = speeds["batch1"]
    text = table(rows, batch1, speeds["batch16"])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps({"rows": rows, **{
            f"{name}_tokens_per_second": {f"{k[0]}/{k[1]}": v for k, v in sp.items()} for name, sp in speeds.items()}},
            indent=1) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for wd in (args.diffusion, args.ar, *args.curves):
            for name, pts in curve(wd).items():
                if pts:
                    a.plot(*zip(*pts), marker="o", label=f"{wd.name}: {name}")
        for wd in args.losses or (args.diffusion, args.ar):
            if (ls := losses(wd)):
                b.plot(*zip(*ls), label=wd.name, alpha=0.7)
        a.axhline(MAJORITY["accuracy"], color="grey", ls="--", label="majority class (test)")
        a.set(xlabel="training step", ylabel="accuracy (train-eval questions)", ylim=(0, 1))
        b.set(xlabel="training step", ylabel="training loss (nats/token)")
        a.legend(fontsize=7)
        b.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / "curves.png", dpi=110)


if __name__ == "__main__":
    main()
