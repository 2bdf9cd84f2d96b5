"""Import and export of Gemma 3 weights: Hugging Face folders and GGUF files.

Two formats load into a :class:`~dgemma.models.transformer.DiffusionGemma` plus its
:class:`~dgemma.data.tokenizers.Tokenizer`:

- a Hugging Face Gemma 3 folder (``config.json``, ``model.safetensors`` or shards with
  ``model.safetensors.index.json``, ``tokenizer.json``), including folders written by
  :func:`save_hf`, whose diffusion extras sit in side files;
- a ``.gguf`` file, dequantised through ``transformers`` (slow: about a minute for 270M).

Models by name (``"gemma3-270m"``, its package cache) and the public entry ``load_pretrained``
are :mod:`dgemma.models.pretrained`, one layer up: this module never imports it.

Loading builds the model without initialising it and *assigns* the checkpoint tensors, so a
270M model appears in about two seconds instead of spending seconds on a random init it would
throw away; ``transformers`` is imported only on the GGUF path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import Tensor

from dgemma.errors import DGemmaError
from dgemma.models.hf_gemma4 import (DIFFUSION_GEMMA_TYPE, GEMMA4_TYPES, image_token_ids, keep_checkpoint_design,
                                     load_gemma4_folder)
from dgemma.data.tokenizers import Tokenizer
from dgemma.models.hf_gemma3 import config_from_hf, config_to_hf
from dgemma.models.transformer import DiffusionGemma, ModelConfig


EXTRAS_PREFIXES = ("self_conditioning.", "time_embedding.", "canvas_groups.")
EXTRAS_FILE = "diffusion_extras.safetensors"
DGEMMA_CONFIG_FILE = "dgemma_config.json"

_ARCH_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "sliding_window", "layer_types",
)
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


# ---------------------------------------------------------------------------- building models
def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise DGemmaError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")


def _apply_overrides(cfg: ModelConfig, attn_implementation: str | None, overrides: dict) -> ModelConfig:
    if attn_implementation is not None:
        overrides = {**overrides, "attn_implementation": attn_implementation}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown := sorted(set(overrides) - names):
        raise DGemmaError(f"unknown model setting(s) {unknown}; ModelConfig fields are {sorted(names)}")
    try:
        return dataclasses.replace(cfg, **overrides)
    except ValueError as e:
        raise DGemmaError(f"invalid model setting: {e}") from None


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Make in-place random/constant initialisation a no-op.

    A model built under it holds allocated but never-written storage (for large tensors the
    pages are not even committed) until the checkpoint's tensors are assigned over it. Building
    on the meta device instead would route ``normal_`` and ``arange`` through Python
    decompositions that import ``torch._dynamo`` (~2 s, most of a cache load).
    """

    NAMES = frozenset({"normal_", "uniform_", "zero_", "fill_", "trunc_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.NAMES:
            return args[0] if args else kwargs["tensor"]  # Tensor.normal_(...) / nn.init.normal_(tensor=...)
        return func(*args, **kwargs)


def model_from_state_dict(cfg: ModelConfig, tensors: dict[str, Tensor], *, dtype=None,
                          source: str = "checkpoint") -> DiffusionGemma:
    """Build a model from ``tensors`` (transformers names) without a throw-away random init.

    The model is built without initialisation and the tensors are assigned (not copied). Diffusion
    extras the checkpoint lacks come from a freshly initialised model without vocabulary or
    layers, which is cheap (a plain Gemma adapted with ``self_conditioning=True`` starts from
    their zero init). Rotary tables stay fp32 whatever ``dtype`` is.
    ``dtype=None`` keeps the checkpoint's floating dtype.
    """
    dtype = _resolve_dtype(dtype)
    tensors = dict(tensors)
    embed = tensors.get("model.embed_tokens.weight")
    head = tensors.pop("lm_head.weight", None)
    if head is not None and embed is not None and head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed):
        raise DGemmaError(f"{source}: lm_head.weight differs from the embedding; dgemma needs tied embeddings")
    for k in [k for k in tensors if k.endswith("rotary_emb.inv_freq")]:  # recomputed, never loaded
        del tensors[k]
    if dtype is None:
        dtype = embed.dtype if embed is not None and embed.is_floating_point() else torch.get_default_dtype()
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}

    with _SkipInit():
        model = DiffusionGemma(cfg)
    wanted = set(model.state_dict()) - {"lm_head.weight"}
    missing, unexpected = sorted(wanted - tensors.keys()), sorted(tensors.keys() - wanted)
    if core := [k for k in missing if not k.startswith(EXTRAS_PREFIXES)]:
        raise DGemmaError(f"{source} lacks {len(core)} weight(s) this config needs, e.g. {core[0]!r}")
    if unexpected:
        raise DGemmaError(f"{source} has {len(unexpected)} weight(s) this config does not use, e.g. {unexpected[0]!r}")
    try:
        model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise DGemmaError(f"{source} does not fit the config: {first}") from None
    model.lm_head.weight = model.model.embed_tokens.weight  # assign replaced the shared Parameter

    if missing:  # only diffusion extras can be missing here: take them freshly initialised
        donor = DiffusionGemma(dataclasses.replace(cfg, vocab_size=1, num_hidden_layers=0, layer_types=None))
        for prefix in EXTRAS_PREFIXES:
            name = prefix[:-1]
            absent = [k for k in missing if k.startswith(prefix)]
            if absent and len(absent) != sum(k.startswith(prefix) for k in wanted):
                raise DGemmaError(f"{source} holds only part of {name} (missing {absent[0]!r})")
            if absent:
                setattr(model, name, getattr(donor, name).to(dtype))
    return model


# ----------------------------------------------------------------------------- reading folders
def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise DGemmaError(f"cannot read {path}: {e} (corrupt or truncated? re-download or re-convert it)") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DGemmaError(f"cannot read {path}: {e}") from None


def _folder_weights(folder: Path) -> dict[str, Tensor]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single)
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise DGemmaError(f"{index} has an empty weight_map")
        tensors = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise DGemmaError(f"{index} names {shard}, which is not in {folder}")
            tensors.update(_read_safetensors(folder / shard))
        return tensors
    if any(folder.glob("*.bin")):
        raise DGemmaError(
            f"{folder} holds PyTorch .bin weights; dgemma reads safetensors (re-save with safe_serialization=True)"
        )
    raise DGemmaError(f"no model.safetensors or model.safetensors.index.json in {folder}")


_MULTIMODAL_RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
_MULTIMODAL_DROP = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_weights(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The language model of a multimodal ``gemma3`` checkpoint under ``Gemma3ForCausalLM`` names."""
    out = {}
    for k, v in tensors.items():
        if k.startswith(_MULTIMODAL_DROP):
            continue
        for old, new in _MULTIMODAL_RENAMES:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


def _load_folder(folder: Path, dtype, attn_implementation, overrides):
    if not (folder / "config.json").is_file():
        raise DGemmaError(f"no config.json in {folder}: not a Hugging Face checkpoint folder")
    hf = _read_json(folder / "config.json")
    if hf.get("model_type") in (*GEMMA4_TYPES, DIFFUSION_GEMMA_TYPE):
        cfg, tensors, aside = load_gemma4_folder(folder, hf, _folder_weights(folder))
        overrides = keep_checkpoint_design(cfg, overrides, source=str(folder))
        model = model_from_state_dict(_apply_overrides(cfg, attn_implementation, overrides), tensors,
                                      dtype=dtype, source=str(folder))
        model.hf_passthrough = aside  # vision tower etc.: written back by save_diffusiongemma
        model.hf_vision_config = hf.get("vision_config")
        model.forbidden_input_ids = torch.tensor(image_token_ids(hf), dtype=torch.long)
        return model, _folder_tokenizer(folder)
    cfg = config_from_hf(hf)
    if (folder / DGEMMA_CONFIG_FILE).is_file():
        cfg = _dgemma_config(folder / DGEMMA_CONFIG_FILE, cfg)
    cfg = _apply_overrides(cfg, attn_implementation, overrides)
    tensors = _folder_weights(folder)
    if hf.get("model_type") == "gemma3":
        tensors = _text_weights(tensors)
    if (folder / EXTRAS_FILE).is_file():
        flags = (cfg.self_conditioning, cfg.time_conditioning, cfg.canvas_position_groups is not None)
        enabled = tuple(p for p, on in zip(EXTRAS_PREFIXES, flags) if on)
        extras = _read_safetensors(folder / EXTRAS_FILE)
        tensors.update({k: v for k, v in extras.items() if enabled and k.startswith(enabled)})
    return model_from_state_dict(cfg, tensors, dtype=dtype, source=str(folder)), _folder_tokenizer(folder)


def _folder_tokenizer(folder: Path):
    """The folder's ``tokenizer.json`` as a Tokenizer, or None."""
    return Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None


def _dgemma_config(path: Path, hf_cfg: ModelConfig) -> ModelConfig:
    """Our exact config, checked against ``config.json`` so a stray side file cannot slip in."""
    d = _read_json(path)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown := sorted(set(d) - names):
        raise DGemmaError(f"{path} has unknown settings {unknown} (written by a newer dgemma?)")
    try:
        cfg = ModelConfig(**d)
    except (ValueError, TypeError) as e:
        raise DGemmaError(f"invalid {path}: {e}") from None
    for f in _ARCH_FIELDS:
        if getattr(cfg, f) != getattr(hf_cfg, f):
            raise DGemmaError(f"{path} disagrees with config.json on {f}: {getattr(cfg, f)!r} vs {getattr(hf_cfg, f)!r}")
    return cfg


# ------------------------------------------------------------------------------------- GGUF
def _read_gguf(path: Path):
    """Dequantise a Gemma 3 GGUF through transformers: ``(config, fp32 tensors, tokenizer)``."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DGemmaError(f"{path} is not a GGUF file (bad magic bytes)")
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForCausalLM, GgufConfig

    folder, name = str(path.parent), path.name
    try:
        hf_cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as e:
        raise DGemmaError(f"cannot read the GGUF metadata of {path}: {e}") from None
    cfg = config_from_hf(hf_cfg.to_dict())
    hf_model = Gemma3ForCausalLM.from_pretrained(
        folder, gguf_file=name, config=hf_cfg, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = Tokenizer.from_hf(AutoTokenizer.from_pretrained(folder, gguf_file=name))
    return cfg, hf_model.state_dict(), tokenizer


def save_hf(model: DiffusionGemma, tokenizer, out_dir: str | Path) -> Path:
    """Write a folder ``transformers.Gemma3ForCausalLM.from_pretrained`` loads (and we do too).

    ``tokenizer`` may be None. ``model.safetensors`` + ``config.json`` hold the Gemma 3 model; the diffusion extras go to
    ``diffusion_extras.safetensors`` and our exact config to ``dgemma_config.json``, which
    transformers ignores and :func:`load_pretrained` restores. Transformers computes the plain
    causal LM: for an adapter (causal encoder) that is our ``model(input_ids)``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    main = {k: v.detach().contiguous() for k, v in state.items() if k.startswith("model.")}
    extras = {k: v.detach().contiguous() for k, v in state.items() if k.startswith(EXTRAS_PREFIXES)}
    if model.config.attn_logit_softcapping is not None:
        raise DGemmaError("cannot export attn_logit_softcapping to Gemma 3: transformers' Gemma3 ignores it")
    if not model.config.norm_unit_offset:
        raise DGemmaError("a Gemma 4 / DiffusionGemma model is exported with "
                          "dgemma.models.hf_gemma4.save_diffusiongemma, not as Gemma 3")
    if stray := sorted(set(state) - main.keys() - extras.keys() - {"lm_head.weight"}):
        raise DGemmaError(f"cannot export weights {stray[:3]}...: merge or drop adapters (e.g. LoRA) before save_hf")
    dtype = model.model.embed_tokens.weight.dtype
    save_file(main, str(out / "model.safetensors"), metadata={"format": "pt"})
    if extras:
        save_file(extras, str(out / EXTRAS_FILE), metadata={"format": "pt"})
    elif (out / EXTRAS_FILE).exists():
        (out / EXTRAS_FILE).unlink()
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype), indent=2) + "\n")
    (out / DGEMMA_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    return out
