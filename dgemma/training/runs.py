"""Open a training run's checkpoint for evaluation, export, solving or serving.

A run is its workdir: ``config.json`` (the resolved config) plus ``checkpoints/step_*/``. A
LoRA checkpoint holds only the adapter (and the new diffusion modules); the frozen base is
rebuilt from ``init.base``, exactly as the trainer does on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dgemma.device import resolve_dtype
from dgemma.errors import DGemmaError
from dgemma.training import checkpoint as ckpt
from dgemma.training import lora as lora_lib
from dgemma.training.config import Config, apply_overrides, load_config
from dgemma.training.ema import load_averaged
from dgemma.training.trainer import build_model, build_noise_for


@dataclass
class Run:
    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    step: int
    path: Path  # the checkpoint directory
    weights: str = "raw"  # "average" (train.ema's moving average) or "raw"
    lora: str = "none"  # "merged" (folded into the base weights), "adapter" (peft-wrapped) or "none"

    def noise(self):
        return build_noise_for(self.cfg, self.model, self.tokenizer)


def find_checkpoint(workdir: str | Path, step: int | None = None) -> Path:
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise DGemmaError(f"workdir not found: {workdir}")
    if step is None:
        latest = ckpt.latest_checkpoint(workdir)
        if latest is None:
            raise DGemmaError(f"no complete checkpoint in {workdir}/checkpoints")
        return latest
    steps = dict(ckpt.list_checkpoints(workdir))
    if step not in steps:
        raise DGemmaError(f"no complete checkpoint for step {step} in {workdir}; available: {sorted(steps)}")
    return steps[step]


def load_run(workdir: str | Path, *, step: int | None = None, overrides: list[str] | None = None,
             device: str | torch.device | None = None, dtype: str = "float32", weights: str = "average",
             merge_lora: bool = True) -> Run:
    """The run's model at ``step`` (latest complete if None), in eval mode.

    ``weights``: ``average`` (default) loads the moving average of a run trained with
    ``train.ema`` (``dgemma/training/ema.py``), the raw weights of any other; ``raw`` always the
    optimiser's own weights. ``Run.weights`` says which were loaded.

    ``overrides`` (``--cfg.a.b=v``) apply to the saved config, e.g. a different attention
    back-end or eval settings; architecture changes are refused by the checkpoint check.
    ``dtype`` (``auto | float32 | bfloat16``, see ``dgemma/device.py:resolve_dtype``) is the
    dtype of the weights for inference (norms and soft-capping stay fp32). ``auto`` is the run's
    own training precision: fp32 for a run trained with ``train.dtype="float32"``, else bf16 where
    the device has native bf16 units.

    ``merge_lora`` (default) folds a LoRA adapter into its base weights, in fp32 and before the
    cast to ``dtype``: a linear is then one matrix product instead of three (peft's wrapper adds
    ``B(A x)`` and a scale), which made a bf16 AR step of the PubMedQA adapter 1.2x faster on
    this project's CPU, and its bf16 weights are the rounding of the exact merged weight rather
    than the sum of three rounded products. ``merge_lora=False`` keeps peft's modules: for export
    (the adapter is saved as peft's) and for inspecting the adapter.
    """
    if weights not in ("average", "raw"):
        raise DGemmaError(f"weights must be 'average' or 'raw', got {weights!r}")
    workdir = Path(workdir)
    cfg_path = workdir / "config.json"
    if not cfg_path.is_file():
        raise DGemmaError(f"{workdir} has no config.json: is it a dgemma training workdir?")
    cfg = load_config(cfg_path)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    path = find_checkpoint(workdir, step)
    state = ckpt.load_checkpoint(path)
    model, tokenizer = build_model(cfg)
    ckpt.check_compatible(state["meta"], model.config, source=path)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if unexpected:
        raise DGemmaError(f"{path} holds weights this model does not have: {unexpected[:5]}")
    if not cfg.lora.enabled and missing:
        raise DGemmaError(f"{path} lacks weights for {missing[:5]}")
    loaded = "raw"
    if weights == "average" and "ema" in state["extra"]:
        load_averaged(model, state["extra"]["ema"])
        loaded = "average"
    lora = "none" if not cfg.lora.enabled else "merged" if merge_lora else "adapter"
    if lora == "merged":
        lora_lib.merge_lora(model)
    device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto" and cfg.train.dtype == "float32":
        dtype = "float32"
    model = model.to(device=device, dtype=resolve_dtype(dtype, device))
    return Run(cfg, model.eval(), tokenizer, state["step"], path, loaded, lora)
