"""Import and export of Gemma 4 text models and Google's released DiffusionGemma.

Two transformers layouts map onto one :class:`~dgemma.models.transformer.DiffusionGemma`:

- ``gemma4_text`` (``Gemma4ForCausalLM``): the Gemma 4 text backbone, dense or mixture-of-experts,
  under the same ``model.layers.*`` names as Gemma 3;
- ``diffusion_gemma`` (``DiffusionGemmaForBlockDiffusion``): a causal encoder and a bidirectional
  decoder that share every weight, plus the decoder's self-conditioning block. Our single model
  *is* both (which tokens are noisy is data, see :mod:`dgemma.models.masks`), so the decoder's
  weights load once; the encoder's copies are checked to be the same tensors.

What transformers' DiffusionGemma computes and the config flags that reproduce it: Gemma 4
RMSNorm (``w``, not ``1 + w``), attention scale 1 (q/k norms carry it), keys reused as values
and a scale-free value norm, wider global heads with their own KV-head count, proportional
RoPE on global layers, experts beside the dense MLP in every layer, a per-layer scalar, final
logit soft-capping, the post-norm self-conditioning block fed ``softmax(logits) @ E * sqrt(d)``,
and a decoder whose sliding window ends at the canvas start (its sliding cache layers keep the
last ``window - 1`` context tokens, and canvas tokens see their whole canvas).

The vision tower is out of scope: its tensors are kept aside on load and written back on
export untouched, so a round trip loses nothing; image inputs are refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from dgemma.errors import DGemmaError
from dgemma.models.transformer import FULL, SLIDING, DiffusionGemma, ModelConfig

GEMMA4_TYPES = ("gemma4_text", "gemma4")
DIFFUSION_GEMMA_TYPE = "diffusion_gemma"
_DG_PREFIX = "model.decoder."
_ENC_PREFIX = "model.encoder.language_model."
_SELFCOND_RENAMES = {"gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}


GEMMA4_DESIGN = dict(norm_unit_offset=False, value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0)
"""The ModelConfig fields every Gemma 4 text model sets (RMSNorm ``w``, value norm, per-layer scalar,
attention scale 1)."""
DIFFUSIONGEMMA_DESIGN = dict(
    GEMMA4_DESIGN, attention_k_eq_v=True, final_logit_softcapping=30.0, decoder_window_anchor="canvas",
    self_conditioning=True, selfcond_variant="postnorm",
)
"""The ModelConfig fields that make a model the released DiffusionGemma's design, whatever its sizes:
``ModelConfig(**sizes, **DIFFUSIONGEMMA_DESIGN)`` (plus experts) exports to transformers."""


def is_diffusiongemma(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is the released DiffusionGemma's architecture (exported as such)."""
    return (not cfg.norm_unit_offset and cfg.self_conditioning and cfg.selfcond_variant == "postnorm"
            and cfg.decoder_window_anchor == "canvas")


# ------------------------------------------------------------------------------------ configs
def config_from_gemma4(text: dict, *, diffusion: bool) -> ModelConfig:
    """A transformers Gemma 4 / DiffusionGemma *text* config dict -> ModelConfig.

    Features our model does not implement (per-layer input embeddings, shared KV layers,
    bidirectional encoders, attention biases, per-layer overrides other than the global layers'
    head_dim / KV heads) are refused with the key to change.
    """
    get = text.get
    for key, ok in (("hidden_size_per_layer_input", lambda v: not v), ("num_kv_shared_layers", lambda v: not v),
                    ("attention_bias", lambda v: not v), ("use_bidirectional_attention", lambda v: v in (None, "vision")),
                    ("hidden_activation", lambda v: v in (None, "gelu_pytorch_tanh")),
                    ("tie_word_embeddings", lambda v: v in (None, True))):
        if not ok(get(key)):
            raise DGemmaError(f"Gemma 4 config: {key}={get(key)!r} is not supported by dgemma")
    n_layers = int(get("num_hidden_layers"))
    layer_types = list(get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)])
    head_dim, n_kv = int(get("head_dim")), int(get("num_key_value_heads"))
    global_dim, global_kv = _global_overrides(get("per_layer_config") or {}, layer_types, head_dim, n_kv, text)
    rope = get("rope_parameters") or {}
    local, full = rope.get(SLIDING) or {}, rope.get(FULL) or {}
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise DGemmaError(f"Gemma 4 config: unsupported sliding-layer rope {local}")
    partial = float(full.get("partial_rotary_factor", 1.0))
    if full.get("rope_type", "default") not in ("default", "proportional") or (
            full.get("rope_type", "default") == "default" and partial != 1.0):
        raise DGemmaError(f"Gemma 4 config: unsupported global-layer rope {full}")
    moe = bool(get("num_experts")) if diffusion else bool(get("enable_moe_block"))
    eos = get("eos_token_id")
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    try:
        fields = dict(
            vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")), num_hidden_layers=n_layers,
            num_attention_heads=int(get("num_attention_heads")), num_key_value_heads=n_kv, head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps") or 1e-6), sliding_window=int(get("sliding_window")),
            layer_types=layer_types, rope_local_theta=float(local.get("rope_theta", 10_000.0)),
            rope_global_theta=float(full.get("rope_theta", 1_000_000.0)),
            rope_global_scaling=float(full.get("factor", 1.0)), rope_global_partial_factor=partial,
            max_position_embeddings=int(get("max_position_embeddings")),
            pad_token_id=int(get("pad_token_id") or 0), eos_token_id=1 if eos is None else int(eos),
            bos_token_id=2 if get("bos_token_id") is None else int(get("bos_token_id")),
            global_head_dim=global_dim, num_global_key_value_heads=global_kv,
            num_experts=int(get("num_experts") or 0) if moe else 0,
            top_k_experts=int(get("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size") or 0) if moe else 0,
            **GEMMA4_DESIGN,
        )
        if diffusion:  # DiffusionGemmaTextConfig's soft-cap is a class default (30), absent from most files
            fields.update(DIFFUSIONGEMMA_DESIGN, selfcond_intermediate_size=int(get("intermediate_size")))
            fields["final_logit_softcapping"] = get("final_logit_softcapping", 30.0)
        else:
            fields.update(attention_k_eq_v=bool(get("attention_k_eq_v")),
                          final_logit_softcapping=get("final_logit_softcapping"))
        return ModelConfig(**fields)
    except (ValueError, TypeError) as e:
        raise DGemmaError(f"invalid Gemma 4 config: {e}") from None


def _global_overrides(per_layer: dict, layer_types, head_dim, n_kv, text) -> tuple[int | None, int | None]:
    """The full-attention layers' ``(head_dim, num_key_value_heads)`` from ``per_layer_config``."""
    if not per_layer:  # a freshly built config may still carry the constructor kwargs
        return text.get("global_head_dim"), text.get("num_global_key_value_heads")
    seen = set()
    for idx, over in per_layer.items():
        i = int(idx)
        if layer_types[i] != FULL or set(over) - {"head_dim", "num_key_value_heads"}:
            raise DGemmaError(f"Gemma 4 config: per_layer_config for layer {i} ({over}) is not supported")
        seen.add((over.get("head_dim", head_dim), over.get("num_key_value_heads", n_kv)))
    if len(seen) != 1 or sum(t == FULL for t in layer_types) != len(per_layer):
        raise DGemmaError("Gemma 4 config: global layers must share one head_dim / KV-head override")
    (gdim, gkv), = seen
    return int(gdim), int(gkv)


def diffusiongemma_text_config(cfg: ModelConfig) -> dict:
    """ModelConfig -> the ``text_config`` dict of a transformers DiffusionGemma ``config.json``."""
    if cfg.encoder_mode != "causal" or cfg.time_conditioning or cfg.canvas_position_groups is not None:
        raise DGemmaError("a DiffusionGemma export needs a causal encoder, no time conditioning, no canvas groups")
    if not cfg.num_experts:
        raise DGemmaError("transformers' DiffusionGemma always has experts: a dense model cannot be exported to it")
    # every design field transformers' config cannot express (the soft-cap is written out)
    off = {k: getattr(cfg, k) for k, v in DIFFUSIONGEMMA_DESIGN.items()
           if k != "final_logit_softcapping" and getattr(cfg, k) != v}
    if off or cfg.selfcond_intermediate_size not in (None, cfg.intermediate_size):
        raise DGemmaError(f"not a DiffusionGemma architecture: {off or 'self-conditioning width'} differs from "
                          "DIFFUSIONGEMMA_DESIGN / intermediate_size, which transformers would compute instead")
    gdim, gkv = cfg.global_head_dim or cfg.head_dim, cfg.num_global_key_value_heads or cfg.num_key_value_heads
    full = {"rope_type": "proportional", "partial_rotary_factor": cfg.rope_global_partial_factor,
            "rope_theta": cfg.rope_global_theta}
    if cfg.rope_global_scaling != 1.0:
        full["factor"] = cfg.rope_global_scaling
    return {
        "model_type": "diffusion_gemma_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id,
        "tie_word_embeddings": True, "attention_bias": False, "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types), "final_logit_softcapping": cfg.final_logit_softcapping,
        "use_bidirectional_attention": None, "num_experts": cfg.num_experts, "top_k_experts": cfg.top_k_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}, FULL: full},
        "per_layer_config": {str(i): {"head_dim": gdim, "num_key_value_heads": gkv}
                             for i, t in enumerate(cfg.layer_types) if t == FULL},
        # the same numbers in the older keys, which transformers drops when per_layer_config /
        # rope_parameters are there but mistral.rs 0.9.5 reads instead (its defaults, 512 and 1e6,
        # fit the released model only)
        "global_head_dim": gdim, "num_global_key_value_heads": gkv, "rope_theta": cfg.rope_global_theta,
    }


# ------------------------------------------------------------------------------------ weights
def diffusiongemma_to_dgemma(tensors: dict[str, Tensor], *, source: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """transformers DiffusionGemma tensors -> ``(ours, kept aside)``.

    The decoder's tensors become ours; each encoder tensor must equal its decoder twin (the
    weights are tied in transformers, but buffers such as ``layer_scalar`` are saved twice and
    could disagree: that model would be two networks, which ours cannot represent). Vision
    tensors are returned apart, untouched.
    """
    ours, aside = {}, {}
    for k, v in tensors.items():
        if k.startswith(_DG_PREFIX):
            rest = k[len(_DG_PREFIX):]
            if rest.startswith("self_conditioning."):
                head, _, tail = rest[len("self_conditioning."):].partition(".")
                ours["self_conditioning." + _SELFCOND_RENAMES.get(head, head) + "." + tail] = v
            else:
                ours["model." + rest] = v
        elif k.startswith(_ENC_PREFIX):
            twin = _DG_PREFIX + k[len(_ENC_PREFIX):]
            if twin in tensors and not torch.equal(tensors[twin], v):
                raise DGemmaError(f"{source}: encoder tensor {k!r} differs from its decoder twin; "
                                  "dgemma's encoder and decoder share weights")
            if twin not in tensors:
                ours.setdefault("model." + k[len(_ENC_PREFIX):], v)
        elif k == "lm_head.weight":
            ours[k] = v
        else:
            aside[k] = v
    return ours, aside


def dgemma_to_diffusiongemma(model: DiffusionGemma) -> dict[str, Tensor]:
    """Our state dict under transformers DiffusionGemma names (plus the encoder's untied buffers)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().contiguous()
        if k.startswith("model."):
            out[_DG_PREFIX + k[len("model."):]] = v
            if k.endswith("layer_scalar"):  # a buffer: transformers saves the encoder's copy too
                out[_ENC_PREFIX + k[len("model."):]] = v.clone()
        elif k.startswith("self_conditioning."):
            out[_DG_PREFIX + k.replace("self_conditioning.mlp.", "self_conditioning.")] = v
        elif k != "lm_head.weight":
            raise DGemmaError(f"cannot export {k!r} to DiffusionGemma: merge or drop adapters (e.g. LoRA) first")
    return out


def load_gemma4_folder(folder: Path, hf: dict, tensors: dict[str, Tensor]) -> tuple[ModelConfig, dict, dict]:
    """``(config, our tensors, tensors kept aside)`` for a ``gemma4_text`` or ``diffusion_gemma`` folder."""
    model_type = hf.get("model_type")
    if model_type == DIFFUSION_GEMMA_TYPE:
        cfg = config_from_gemma4(hf.get("text_config") or {}, diffusion=True)
        ours, aside = diffusiongemma_to_dgemma(tensors, source=str(folder))
        return cfg, ours, aside
    text = hf.get("text_config") if model_type == "gemma4" else hf
    cfg = config_from_gemma4(text or {}, diffusion=False)
    ours, aside = {}, {}
    for k, v in tensors.items():
        k = k.replace("model.language_model.", "model.", 1)
        text_weight = k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")) or k == "lm_head.weight"
        (ours if text_weight else aside)[k] = v
    return cfg, ours, aside


_DESIGN_FIELDS = ("self_conditioning", "selfcond_variant", "selfcond_intermediate_size", "decoder_window_anchor",
                  "norm_unit_offset", "encoder_mode")


def keep_checkpoint_design(cfg: ModelConfig, overrides: dict, *, source: str) -> dict:
    """Drop overrides that would rebuild a released DiffusionGemma as something else.

    The SFT recipes ask for zero-init self-conditioning, the right choice when adapting an AR
    Gemma; a DiffusionGemma base brings its own trained post-norm block, which wins. Each
    dropped setting is reported on stderr, never silently.
    """
    if not cfg.self_conditioning:  # a plain Gemma 4 backbone: everything may be chosen
        return dict(overrides)
    kept = {}
    for k, v in overrides.items():
        if k in _DESIGN_FIELDS and getattr(cfg, k) != v:
            print(f"[dgemma] {source} is a DiffusionGemma: keeping its {k}={getattr(cfg, k)!r} "
                  f"(the recipe's {v!r} applies to AR bases)", file=sys.stderr)
        else:
            kept[k] = v
    return kept


def image_token_ids(hf: dict) -> tuple[int, ...]:
    """Image placeholder / boundary ids of a multimodal config: text-only dgemma refuses them."""
    return tuple(int(hf[k]) for k in ("image_token_id", "boi_token_id", "eoi_token_id") if hf.get(k) is not None)


_PLACEHOLDER_VISION = {"model_type": "gemma4_vision", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                       "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8, "position_embedding_size": 8}


def placeholder_vision_tensors(text_hidden: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """All-zero tensors for the :data:`_PLACEHOLDER_VISION` tower (the names and shapes
    transformers builds for it): an inert stand-in, every image embeds to zero.

    Engines differ on a missing tower: transformers fills it at random and warns, mistral.rs
    refuses to load (``Missing required tensor(s) ... vision_tower.patch_embedder.input_proj``).
    With these 16 tensors (~7 K numbers) both load a model born in dgemma as it is.
    """
    v, tower = _PLACEHOLDER_VISION["hidden_size"], "model.encoder.vision_tower."
    layer = tower + "encoder.layers.0."
    shapes = {tower + "patch_embedder.position_embedding_table": (2, _PLACEHOLDER_VISION["position_embedding_size"], v),
              tower + "patch_embedder.input_proj.weight": (v, 3 * 16 * 16),  # RGB x 16 x 16 patches
              "model.encoder.embed_vision.embedding_projection.weight": (text_hidden, v)}
    shapes.update({f"{layer}self_attn.{p}_proj.linear.weight": (v, v) for p in "qkvo"})
    shapes.update({f"{layer}mlp.{p}_proj.linear.weight": (v, v) for p in ("gate", "up", "down")})
    shapes.update({f"{layer}self_attn.{n}_norm.weight": (v,) for n in "qk"})
    shapes.update({f"{layer}{n}_layernorm.weight": (v,) for n in ("input", "post_attention", "pre_feedforward",
                                                                  "post_feedforward")})
    return {k: torch.zeros(shape, dtype=dtype) for k, shape in shapes.items()}


def save_diffusiongemma(model: DiffusionGemma, tokenizer, out_dir: str | Path, *, canvas_length: int = 256,
                        generation: dict | None = None) -> Path:
    """Write a folder ``transformers.DiffusionGemmaForBlockDiffusion.from_pretrained`` loads (and we do too).

    Vision tensors kept aside at load time (``model.hf_passthrough``) are written back, so a
    released checkpoint round-trips whole; a model born in dgemma has none: it gets a minimal,
    all-zero placeholder tower (:func:`placeholder_vision_tensors`), which no text path runs.
    ``generation`` goes to ``generation_config.json`` (e.g. ``max_denoising_steps``).
    """
    from safetensors.torch import save_file

    cfg = model.config
    text = diffusiongemma_text_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dgemma_to_diffusiongemma(model)
    dtype = model.model.embed_tokens.weight.dtype
    passthrough = getattr(model, "hf_passthrough", {})
    vision = getattr(model, "hf_vision_config", None)
    tensors.update({k: v.contiguous() for k, v in passthrough.items()})
    if not vision:
        tensors.update(placeholder_vision_tensors(cfg.hidden_size, dtype))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": DIFFUSION_GEMMA_TYPE,
          "canvas_length": int(canvas_length), "tie_word_embeddings": True, "text_config": text,
          "dtype": str(dtype).removeprefix("torch.")}
    # a released checkpoint's vision tower goes back as it came; a model born in dgemma has none,
    # and a minimal placeholder keeps transformers from building (and randomly filling) a 167M one
    hf["vision_config"] = vision or dict(_PLACEHOLDER_VISION)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
    return out

