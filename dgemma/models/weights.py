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
from dgemma.models.transformer import FULL, SLIDING, DiffusionGemma, ModelConfig


EXTRAS_PREFIXES = ("self_conditioning.", "time_embedding.", "canvas_groups.")
EXTRAS_FILE = "diffusion_extras.safetensors"
DGEMMA_CONFIG_FILE = "dgemma_config.json"

# Gemma3TextConfig's defaults (transformers 5): what a config.json that omits a key means.
_HF_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, max_position_embeddings=131_072,
    final_logit_softcapping=None, attn_logit_softcapping=None,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
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


# ------------------------------------------------------------------------------------ configs
def config_from_hf(d: dict) -> ModelConfig:
    """A transformers Gemma 3 config (``gemma3_text``, or ``gemma3`` with a ``text_config``) -> ModelConfig.

    Follows ``Gemma3TextConfig``'s reading of old and new files: keys left out take its defaults,
    ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` (older; the scaling applies to full-attention layers only), ``layer_types``
    or ``sliding_window_pattern``. Anything our model would compute differently is refused.
    """
    if not isinstance(d, dict):
        raise DGemmaError(f"expected a config dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type == "gemma3":
        text = d.get("text_config") or {}
        top = {k: d[k] for k in ("pad_token_id", "eos_token_id", "bos_token_id") if k in d}
        d = {**top, **text, "model_type": "gemma3_text"}
    elif model_type != "gemma3_text":
        raise DGemmaError(
            f"not a Gemma 3 text model: model_type is {model_type!r} "
            "(dgemma loads 'gemma3_text', or 'gemma3' with a text_config)"
        )
    get = lambda k: d.get(k, _HF_DEFAULTS.get(k))  # noqa: E731
    if d.get("use_bidirectional_attention"):
        raise DGemmaError(
            "use_bidirectional_attention=True (an embedding model) is not supported; dgemma needs a causal Gemma 3"
        )
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise DGemmaError(f"unsupported hidden_activation {act!r}; Gemma 3 uses 'gelu_pytorch_tanh'")
    if d.get("attention_bias"):
        raise DGemmaError("attention_bias=True is not supported (Gemma 3 has no attention biases)")
    if d.get("tie_word_embeddings", True) is False:
        raise DGemmaError("tie_word_embeddings=False is not supported: dgemma ties the LM head to the embedding")

    if d.get("attn_logit_softcapping") is not None:
        raise DGemmaError(
            f"attn_logit_softcapping={d['attn_logit_softcapping']} is not part of Gemma 3 "
            "(transformers' Gemma3 ignores it, dgemma would apply it); set it to null"
        )
    full_theta, local_theta, scaling = _rope_from_hf(d)
    n_layers = int(get("num_hidden_layers"))
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    eos = get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    try:
        return ModelConfig(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim")),
            rms_norm_eps=float(get("rms_norm_eps")),
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            sliding_window=None if get("sliding_window") is None else int(get("sliding_window")),
            layer_types=list(layer_types),
            rope_local_theta=local_theta,
            rope_global_theta=full_theta,
            rope_global_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings")),
            final_logit_softcapping=get("final_logit_softcapping"),
            pad_token_id=0 if get("pad_token_id") is None else int(get("pad_token_id")),
            eos_token_id=1 if eos is None else int(eos),
            bos_token_id=2 if get("bos_token_id") is None else int(get("bos_token_id")),
        )
    except (ValueError, TypeError) as e:
        raise DGemmaError(f"invalid Gemma 3 config: {e}") from None


def _rope_from_hf(d: dict) -> tuple[float, float, float]:
    """``(full theta, sliding theta, linear factor on full layers)`` from new or old rope keys."""
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {FULL, SLIDING}:
        raise DGemmaError(
            f"rope_parameters must map {FULL!r}/{SLIDING!r} to their settings, got {params!r}"
        )
    full = dict(params.get(FULL) or {})
    if d.get("rope_scaling"):  # older files: the scaling of the global rotary embedding
        full.update(d["rope_scaling"])
    local = dict(params.get(SLIDING) or {})
    full.setdefault("rope_theta", d.get("rope_theta", _DEFAULT_THETA[FULL]))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", _DEFAULT_THETA[SLIDING]))
    factors = {}
    for kind, p in ((FULL, full), (SLIDING, local)):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type == "default":
            factors[kind] = 1.0
        elif rope_type == "linear":
            factors[kind] = float(p.get("factor", 1.0))
        else:
            raise DGemmaError(
                f"unsupported rope type {rope_type!r} on {kind} layers; dgemma supports 'default' and 'linear'"
            )
    if factors[SLIDING] != 1.0:
        raise DGemmaError(f"linear rope scaling on sliding-attention layers (factor {factors[SLIDING]}) is not supported")
    return float(full["rope_theta"]), float(local["rope_theta"]), factors[FULL]


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict:
    """ModelConfig -> a ``config.json`` for ``Gemma3ForCausalLM``.

    Written in transformers 5's form (``rope_parameters``) plus the legacy rope keys older
    releases read; transformers 5 reads both to the same values.
    """
    full = {"rope_type": "default", "rope_theta": cfg.rope_global_theta}
    legacy_scaling = None
    if cfg.rope_global_scaling != 1.0:
        full = {"rope_type": "linear", "factor": cfg.rope_global_scaling, "rope_theta": cfg.rope_global_theta}
        legacy_scaling = {"rope_type": "linear", "factor": cfg.rope_global_scaling}
    out = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers 5 types it as int (strictly validated); every Gemma 3 uses an integer
        "query_pre_attn_scalar": int(q) if (q := cfg.query_pre_attn_scalar) == int(q) else q,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        "rope_theta": cfg.rope_global_theta,
        "rope_local_base_freq": cfg.rope_local_theta,
        "rope_scaling": legacy_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_id,
        "bos_token_id": cfg.bos_token_id,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "use_cache": True,
    }
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


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
    from dgemma.data.tokenizers import Tokenizer

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
    from dgemma.data.tokenizers import Tokenizer

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
