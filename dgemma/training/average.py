"""Weight averaging of finished runs (a "model soup", Wortsman et al. 2022): one new run whose
weights are a weighted mean of several runs of the same architecture.

Two runs that share a start (here: a run and its continuation on harder data) often lie in one
basin, and the mean of their weights can beat both: ``checkpoints/sudoku_avg`` is the mean of
``sudoku_deep`` and ``sudoku_deep_hard`` (its README has the figures). Each source contributes the
weights :func:`dgemma.training.runs.load_run` evaluates by default (the moving average of a run
trained with ``train.ema``, else its raw weights), so an average of averages.

The result is a workdir like any other (``config.json`` + ``checkpoints/step_N``) that ``dgemma
eval``, ``solve``, ``serve`` and ``export`` open, with no optimiser state: it was never trained
as such, so resuming from it fails with a clear error (``trainer.py:Trainer.restore``). Its
``meta.json`` names every source (workdir, step, weight, which weights, the sha256 of the file).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from dgemma.errors import DGemmaError
from dgemma.training import checkpoint as ckpt
from dgemma.training.config import config_to_dict, save_config


def average_runs(workdirs: list[str | Path], out: str | Path, *, weights: list[float] | None = None,
                 steps: list[int | None] | None = None, step: int | None = None) -> Path:
    """Write ``out`` as a run holding ``sum_i weights[i] * run_i``; returns its checkpoint folder.

    ``weights`` default to equal ones and must be positive and sum to 1; ``steps[i]`` picks a
    source's checkpoint (latest complete when None). The new checkpoint's ``step`` is the largest
    source step unless given. The config is the first source's (``workdir`` set to ``out``). The
    mean is taken in float64 and cast back; integer tensors must agree across sources. LoRA runs
    are refused (merge them with ``dgemma export`` first: a mean of adapters is not a mean of
    merged weights). ``out`` must hold no checkpoint yet, so nothing is overwritten.
    """
    from dgemma.training.runs import load_run

    n = len(workdirs)
    if n < 2:
        raise DGemmaError(f"averaging needs at least two runs, got {n}")
    weights = [1.0 / n] * n if weights is None else [float(w) for w in weights]
    steps = [None] * n if steps is None else list(steps)
    if len(weights) != n or len(steps) != n:
        raise DGemmaError(f"{n} runs but {len(weights)} weights and {len(steps)} steps: give one per run")
    if any(not math.isfinite(w) or w <= 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise DGemmaError(f"weights must be positive and sum to 1, got {weights} (sum {sum(weights):g})")
    out = Path(out)
    if ckpt.list_checkpoints(out) if out.is_dir() else False:
        raise DGemmaError(f"{out} already holds checkpoints; choose an empty --out")

    runs, sources = [], []
    for workdir, s in zip(workdirs, steps):
        run = load_run(workdir, step=s, device="cpu", dtype="float32")
        if run.cfg.lora.enabled:
            raise DGemmaError(f"{workdir} is a LoRA run: export it merged (dgemma export) and average full weights")
        runs.append(run)
    first = ckpt.model_fingerprint(runs[0].model.config)
    for workdir, run in zip(workdirs[1:], runs[1:]):
        other = ckpt.model_fingerprint(run.model.config)
        if other != first:
            diff = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            raise DGemmaError(f"{workdir} has another architecture than {workdirs[0]} (differs in {diff})")

    states = [r.model.state_dict() for r in runs]
    mean = {}
    for name, ref in states[0].items():
        if any(name not in st for st in states[1:]):
            raise DGemmaError(f"tensor {name} is missing from some of the runs")
        if ref.is_floating_point():
            acc = sum(w * st[name].double() for w, st in zip(weights, states))
            mean[name] = acc.to(ref.dtype)
        elif all(torch.equal(ref, st[name]) for st in states[1:]):
            mean[name] = ref.clone()
        else:
            raise DGemmaError(f"integer tensor {name} differs between runs; it cannot be averaged")
    for run, w, workdir in zip(runs, weights, workdirs):
        files = json.loads((run.path / ckpt.META_FILE).read_text())["files"]  # load_run verified it
        sources.append({"workdir": str(workdir), "step": run.step, "weight": w,
                        "weights": run.weights, "model_sha256": files[ckpt.MODEL_FILE]["sha256"]})

    cfg = dataclasses.replace(runs[0].cfg, workdir=str(out))
    step = max(r.step for r in runs) if step is None else int(step)
    save_config(cfg, out)
    meta = {"config": config_to_dict(cfg), "lora": False, "averaged_from": sources,
            "optimizer_state": "none: a weight average of other runs (evaluation and export, not resume)"}
    return ckpt.save_checkpoint(out, step, model_state=mean, optim_state=None, extra_state={"averaged_from": sources},
                                metadata=meta, keep_last=None, model_config=runs[0].model.config)
