"""The Gemma 3 Hugging Face mapping: ``config.json`` <-> :class:`ModelConfig` (beside ``hf_gemma4.py``).

``Gemma3ForCausalLM``'s weights need no renaming (dgemma's parameter names are transformers');
what needs care is the config: keys a file leaves out mean ``Gemma3TextConfig``'s defaults, rope
settings come in two generations of keys, and anything dgemma would compute differently from
transformers is refused rather than approximated.
"""

from __future__ import annotations

import torch

from dgemma.errors import DGemmaError
from dgemma.models.transformer import FULL, SLIDING, ModelConfig

# Gemma3TextConfig's defaults (transformers 5): what a config.json that omits a key means.
_HF_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, max_position_embeddings=131_072,
    final_logit_softcapping=None, attn_logit_softcapping=None,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


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
