"""LoRA through ``peft`` on our own modules (never hand-rolled).

``peft.inject_adapter_in_model`` wraps the named ``nn.Linear`` layers of a
:class:`~dgemma.models.transformer.DiffusionGemma` in place. Because our parameter names mirror
``Gemma3ForCausalLM``, the adapter saved by :func:`save_peft_adapter` loads with
``PeftModel.from_pretrained(Gemma3ForCausalLM)``.

``"all-linear"`` is resolved to an explicit list of the decoder's projection names: peft's own
resolution also wraps ``lm_head`` on a custom module (docs/design.md §8), and the tied head must stay the
embedding.

The LoRA targets are the attention and dense-MLP projections of every layer; a mixture of
experts' router is never adapted, and its experts (3-D weights peft cannot wrap) train in full
only with ``train_experts=True``.

The trainable set is exactly the adapter: the LoRA matrices, plus the diffusion modules that the
base model does not have (``self_conditioning.*``, ``time_embedding.*``, ``canvas_groups.*``), which are new weights
and would otherwise stay at their zero init forever. Everything from the base is frozen.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dgemma.errors import DGemmaError

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_MODULES = ("self_conditioning.", "time_embedding.", "canvas_groups.")


def resolve_targets(target_modules: list[str] | str) -> list[str]:
    """``"all-linear"`` -> every decoder projection name; a list is checked against them."""
    if target_modules == "all-linear":
        return list(DECODER_LINEARS)
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if bad := [n for n in names if n not in DECODER_LINEARS]:
        raise DGemmaError(f"unknown LoRA target module(s) {bad}; choose from {list(DECODER_LINEARS)} or 'all-linear'")
    return names


def _peft_config(r: int, alpha: float, dropout: float, targets: list[str]):
    from peft import LoraConfig

    # a regex so only the decoder layers are wrapped (never lm_head or self_conditioning.mlp)
    pattern = r"model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(targets) + ")"
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=pattern, bias="none",
                      init_lora_weights=True)


def apply_lora(model: nn.Module, *, r: int, alpha: float, dropout: float, target_modules,
               train_experts: bool = False) -> nn.Module:
    """Inject LoRA adapters (A Kaiming-uniform, B zero: step 0 equals the base) and freeze the base."""
    from peft import inject_adapter_in_model

    targets = resolve_targets(target_modules)
    if train_experts and not getattr(model.config, "num_experts", 0):
        raise DGemmaError("lora.train_experts=True, but this model has no experts")
    inject_adapter_in_model(_peft_config(r, alpha, dropout, targets), model)
    model.lora_config = {"r": r, "alpha": alpha, "dropout": dropout, "target_modules": targets}
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name, train_experts=train_experts))
    return model


def is_adapter_param(name: str, *, train_experts: bool = False) -> bool:
    """LoRA matrices and new diffusion modules; the experts' weights too with ``train_experts``."""
    return "lora_" in name or name.startswith(NEW_MODULES) or train_experts and ".experts." in name


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the LoRA matrices, with peft's key names (adapter name stripped)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def save_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_name: str | None = None) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` in PEFT's layout."""
    from safetensors.torch import save_file

    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise DGemmaError("this model has no LoRA adapter to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in lora_state_dict(model).items()}
    save_file(state, str(out / "adapter_model.safetensors"))
    peft_cfg = _peft_config(cfg["r"], cfg["alpha"], cfg["dropout"], cfg["target_modules"])
    peft_cfg.base_model_name_or_path = base_name
    peft_cfg.task_type = "CAUSAL_LM"
    peft_cfg.save_pretrained(str(out))
    meta = json.loads((out / "adapter_config.json").read_text())
    if meta.get("target_modules") != peft_cfg.target_modules:
        raise DGemmaError("peft wrote an unexpected adapter_config.json")
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and unwrap it (in place)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model
