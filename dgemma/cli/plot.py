"""``dgemma plot --cfg.workdir=DIR [--out FILE]``: training curves as one PNG.

Panels: the loss terms, the learning rate and the gradient norm from ``DIR/metrics.jsonl``, and,
when there are any, eval accuracies: those logged during training (``split: eval`` rows) and
those of ``dgemma eval`` (``DIR/eval/<eval_name>/step_<S>.json``). A step logged twice (a resumed
or rolled-back run) keeps its last value. Default output: ``DIR/plots/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from dgemma.errors import DGemmaError

LOSS_KEYS = ("loss", "diffusion_loss", "ar_loss")
Series = dict[str, dict[int, float]]  # name -> step -> value


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(workdir: Path) -> tuple[Series, Series]:
    """``(train, eval)`` series from ``metrics.jsonl``; broken lines are skipped."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise DGemmaError(f"no metrics.jsonl in {workdir}: is it a dgemma training workdir?")
    train: Series = defaultdict(dict)
    evals: Series = defaultdict(dict)
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or "split" not in row or not _number(row.get("step")):
            continue
        target = train if row["split"] == "train" else evals
        for k, v in row.items():
            if k not in ("step", "split") and _number(v):
                target[k][int(row["step"])] = float(v)
    return train, evals


def read_eval_files(workdir: Path, metric: str = "accuracy") -> Series:
    """``metric`` of every ``DIR/eval/<eval_name>/step_<S>.json``, by eval name and step."""
    out: Series = defaultdict(dict)
    for p in sorted((workdir / "eval").glob("*/step_*.json")):
        m = re.fullmatch(r"step_(\d+)\.json", p.name)
        try:
            value = json.loads(p.read_text())["metrics"][metric]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if m and _number(value):
            out[p.parent.name][int(m[1])] = float(value)
    return out


def plot(workdir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = Path(workdir)
    train, evals = read_metrics(workdir)
    accuracy = {k: v for k, v in evals.items() if k == "accuracy" or k.endswith("/accuracy")}
    accuracy.update({f"{k} (dgemma eval)": v for k, v in read_eval_files(workdir).items()})
    panels = [("loss", [k for k in LOSS_KEYS if train.get(k) and any(train[k].values())] or ["loss"], train, "log"),
              ("learning rate", ["lr"], train, "linear"), ("gradient norm", ["grad_norm"], train, "log")]
    if accuracy:
        panels.append(("eval accuracy", sorted(accuracy), accuracy, "linear"))
    if not any(series.get(k) for _, keys, series, _ in panels for k in keys):
        raise DGemmaError(f"{workdir}/metrics.jsonl has no training metrics to plot yet")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys, series, scale) in zip(axes[:, 0], panels):
        for k in keys:
            points = sorted(series.get(k, {}).items())
            if points:
                ax.plot(*zip(*points), label=k, marker="." if len(points) < 30 else None)
        if scale == "log" and all(v > 0 for k in keys for v in series.get(k, {}).values()):
            ax.set_yscale("log")
        if title == "eval accuracy":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(str(workdir), fontsize=9)
    fig.tight_layout()
    out = Path(out) if out else workdir / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dgemma plot", description="plot a run's training curves to a PNG",
                                epilog="--cfg.workdir=DIR (a training workdir with metrics.jsonl) is required")
    p.add_argument("--out", help="output PNG (default DIR/plots/curves.png)")
    args, rest = p.parse_known_args(argv)
    workdir = [a.partition("=")[2] for a in rest if a.startswith("--cfg.workdir=")]
    other = [a for a in rest if not a.startswith("--cfg.workdir=")]
    if other:
        raise DGemmaError(f"unexpected arguments {other}; usage: dgemma plot --cfg.workdir=DIR [--out FILE]")
    if not workdir or not workdir[-1]:
        raise DGemmaError("missing --cfg.workdir=DIR")
    print(plot(workdir[-1], args.out))
    return 0
