"""``dgemma export --cfg.workdir=DIR [--step=N] --out=OUT [--cfg.a.b=value ...]``.

Writes a training run's weights as a Hugging Face Gemma 3 folder that
``transformers.Gemma3ForCausalLM.from_pretrained(OUT)`` loads (the plain causal LM: our
``model(input_ids)``), with the diffusion extras (self-conditioning) and our exact model config
in side files that :func:`dgemma.load_pretrained` restores (see :func:`dgemma.models.weights.save_hf`).

A LoRA run is merged into its base first, and its adapter is also written unmerged to
``OUT/adapter`` in PEFT's layout, for ``PeftModel.from_pretrained(Gemma3ForCausalLM, OUT/adapter)``.
The adapter folder gets the diffusion extras too, so base + adapter is a complete dgemma model.
A DiffusionGemma run (a released checkpoint as base) goes back to transformers'
``DiffusionGemmaForBlockDiffusion`` layout instead, LoRA merged.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dgemma.errors import DGemmaError


def adapter_base_path(base: str | None) -> str | None:
    """Where the adapter's base lives, for ``adapter_config.json``'s ``base_model_name_or_path``.

    ``None`` for a random base (a from-scratch LoRA run): there is no folder to point at.
    """
    if base is None:
        return None
    from dgemma.models.pretrained import GEMMA3_270M, prepare_gemma3_270m

    if base == GEMMA3_270M:
        return str(prepare_gemma3_270m())
    return str(Path(base).expanduser().resolve())


def export_run(workdir: str | Path, out: str | Path, *, step: int | None = None,
               overrides: list[str] | None = None) -> dict:
    """Export one checkpoint of a run; returns what was written (also saved as ``OUT/dgemma_export.json``)."""
    from dgemma.models.weights import EXTRAS_FILE, save_hf
    from dgemma.training.lora import merge_lora, save_peft_adapter
    from dgemma.training.runs import load_run

    run = load_run(workdir, step=step, overrides=overrides, device="cpu", merge_lora=False)  # peft's adapter
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DGemmaError(f"--out {out} exists and is not a folder")
    tokenizer = run.tokenizer if hasattr(run.tokenizer, "save") else None  # a char alphabet has no tokenizer.json
    info = {"workdir": str(Path(workdir).resolve()), "step": run.step, "checkpoint": str(run.path),
            "lora": run.cfg.lora.enabled, "tokenizer": tokenizer is not None}
    from dgemma.models.hf_gemma4 import is_diffusiongemma, save_diffusiongemma

    if is_diffusiongemma(run.model.config):  # back to transformers' DiffusionGemma layout, LoRA merged
        if run.model.config.shift_logits:
            raise DGemmaError("a shift_logits model has no DiffusionGemma layout (that format predicts each "
                              "canvas token at its own position); export it from a Gemma 3 base instead")
        if run.cfg.lora.enabled:
            merge_lora(run.model)
        save_diffusiongemma(run.model, tokenizer, out, canvas_length=run.cfg.diffusion.canvas_size)
        info["format"] = "diffusion_gemma"
        (out / "dgemma_export.json").write_text(json.dumps(info, indent=2) + "\n")
        return info
    if run.cfg.lora.enabled:
        adapter = out / "adapter"
        if adapter.exists():
            shutil.rmtree(adapter)
        save_peft_adapter(run.model, adapter, base_name=adapter_base_path(run.cfg.init.base))
        merge_lora(run.model)
        info["adapter"] = str(adapter)
    save_hf(run.model, tokenizer, out)
    if run.cfg.lora.enabled and (out / EXTRAS_FILE).is_file():
        shutil.copy2(out / EXTRAS_FILE, out / "adapter" / EXTRAS_FILE)
    (out / "dgemma_export.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgemma export", description=__doc__.split("\n\n")[1])
    parser.add_argument("--cfg.workdir", dest="workdir", required=True, help="the training run's workdir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    parser.add_argument("--out", required=True, help="output folder (Hugging Face layout)")
    args, rest = parser.parse_known_args(argv)
    if bad := [a for a in rest if not a.startswith("--cfg.")]:
        raise DGemmaError(f"unexpected arguments {bad}; export takes --cfg.workdir, --step, --out and --cfg.KEY=VALUE")
    info = export_run(args.workdir, args.out, step=args.step, overrides=rest)
    extra = f" and the PEFT adapter in {info['adapter']}" if info.get("adapter") else ""
    print(f"[dgemma] exported step {info['step']} of {args.workdir} to {args.out}{extra}")
    return 0
