"""The DiffusionGemma network: a Gemma 3 decoder that is also a block-diffusion denoiser.

Reads top-down: config, attention, block, model. Parameter names mirror transformers'
``Gemma3ForCausalLM`` (``model.layers.{i}.self_attn.q_proj`` ...) so weights and PEFT adapters
move between the two without renaming; the diffusion extras live beside them
(``self_conditioning.*``, ``time_embedding.*``).

One ``forward`` serves every role. Which tokens are clean (encoder) or noisy (decoder) is data
(:class:`~dgemma.models.masks.TokenInfo`), not a mode switch: the mask rule and the conditioning
follow from it. ``model(input_ids)`` alone is a causal LM.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dgemma.errors import DGemmaError
from dgemma.models.attention import BACKENDS, MaskSpec, get_attention
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import ENCODER_MODES, WINDOW_ANCHORS, TokenInfo
from dgemma.models.moe import Experts, Router
from dgemma.models.primitives import GeGLU, Linear, RMSNorm, Rotary, apply_rotary, head_product
from dgemma.models.selfcond import SelfConditioning, TimeEmbedding
from dgemma.models.structure import CanvasPositionGroups, validate_groups

SLIDING, FULL = "sliding_attention", "full_attention"


# ------------------------------------------------------------------------------------- config
@dataclass(kw_only=True)
class ModelConfig:
    """Architecture. Defaults are the Gemma 3 270M.

    The Gemma 4 fields (all off by default) describe the released DiffusionGemma's backbone:
    ``norm_unit_offset=False`` (plain ``w`` RMSNorm scales), wider global heads with their own
    KV-head count, keys reused as values on global layers, a scale-free RMSNorm on values,
    proportional RoPE (``rope_global_partial_factor``), a per-layer output scalar, and experts
    beside the dense MLP (``num_experts > 0``). ``decoder_window_anchor="canvas"`` is
    DiffusionGemma's sliding window for noisy canvases: the window ends at the canvas start and
    every canvas token sees its whole canvas (what transformers' sliding KV cache yields).
    """

    vocab_size: int = 262_144
    hidden_size: int = 640
    intermediate_size: int = 2048
    num_hidden_layers: int = 18
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 512
    layer_types: list[str] | None = None  # default: every 6th layer full, the rest sliding
    rope_local_theta: float = 10_000.0
    rope_global_theta: float = 1_000_000.0
    rope_global_scaling: float = 1.0  # linear position interpolation on full-attention layers
    max_position_embeddings: int = 32_768
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2
    attn_implementation: str = "sdpa"  # eager | sdpa | flex
    encoder_mode: str = "causal"  # causal (adapter, = the AR model) | block (Lite)
    self_conditioning: bool = False
    selfcond_variant: str = "zero_init"  # zero_init | postnorm
    selfcond_intermediate_size: int | None = None  # default: hidden_size
    time_conditioning: bool = False
    time_freq_dim: int = 256
    gradient_checkpointing: bool = False
    # Gemma 4 / DiffusionGemma backbone
    norm_unit_offset: bool = True  # Gemma 3: (1 + w); Gemma 4: w
    global_head_dim: int | None = None  # head_dim of full-attention layers (default: head_dim)
    num_global_key_value_heads: int | None = None  # KV heads of full-attention layers (default: num_key_value_heads)
    attention_k_eq_v: bool = False  # full-attention layers have no v_proj: values = raw key projection
    value_norm: bool = False  # scale-free RMSNorm on values
    rope_global_partial_factor: float = 1.0  # proportional RoPE: share of frequency pairs that rotate
    layer_scalar: bool = False  # per-layer output scalar (a buffer, as in transformers)
    num_experts: int = 0  # > 0: a mixture of experts beside the dense MLP in every layer
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    decoder_window_anchor: str = "query"  # query | canvas (DiffusionGemma)
    canvas_position_groups: list[list[int]] | None = None  # learned canvas positions: group ids per offset
    shift_logits: bool = False  # canvas token j predicted from hidden j - 1 (j = 0: the token before): diffusion/shift.py

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if bad := sorted(set(self.layer_types) - {SLIDING, FULL}):
            raise ValueError(f"unknown layer types {bad}; use {SLIDING!r} or {FULL!r}")
        if self.attn_implementation not in BACKENDS:
            raise ValueError(f"attn_implementation must be one of {BACKENDS}, got {self.attn_implementation!r}")
        if self.encoder_mode not in ENCODER_MODES:
            raise ValueError(f"encoder_mode must be one of {ENCODER_MODES}, got {self.encoder_mode!r}")
        for kv in (self.num_key_value_heads, self.num_global_key_value_heads or self.num_key_value_heads):
            if self.num_attention_heads % kv:
                raise ValueError("num_attention_heads must be a multiple of the number of key/value heads")
        if self.decoder_window_anchor not in WINDOW_ANCHORS:
            raise ValueError(f"decoder_window_anchor must be one of {WINDOW_ANCHORS}, got {self.decoder_window_anchor!r}")
        if self.num_experts and not (0 < self.top_k_experts <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError("a mixture of experts needs 0 < top_k_experts <= num_experts and moe_intermediate_size > 0")
        if not 0.0 < self.rope_global_partial_factor <= 1.0:
            raise ValueError(f"rope_global_partial_factor must be in (0, 1], got {self.rope_global_partial_factor}")
        if self.canvas_position_groups is not None:
            self.canvas_position_groups = validate_groups(self.canvas_position_groups)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        is_global = cfg.layer_types[layer] == FULL
        self.n_heads, self.head_dim = cfg.num_attention_heads, head_dim_of(cfg, layer)
        self.n_kv = (cfg.num_global_key_value_heads or cfg.num_key_value_heads) if is_global else cfg.num_key_value_heads
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        norm = dict(eps=cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = (None if cfg.attention_k_eq_v and is_global
                       else Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False))
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, **norm)
        self.k_norm = RMSNorm(self.head_dim, **norm)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False) if cfg.value_norm else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: MaskSpec, attend,
                cache: KVCache | None, write: bool, at: int | Tensor | None = None, end: int | None = None) -> Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k_raw = self.k_proj(x).view(b, n, self.n_kv, self.head_dim)
        v = k_raw if self.v_proj is None else self.v_proj(x).view(b, n, self.n_kv, self.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        k, v = self.k_norm(k_raw).transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # [B, H, L, D]
        if cache is not None:
            k, v = cache.attend_keys(self.layer, k, v, write, at, end)  # [B, Hkv, S + L, D]
        out = attend(q, k, v, mask, scale=self.scale, softcap=self.softcap)  # [B, H, L, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


# -------------------------------------------------------------------------------------- block
class DecoderLayer(nn.Module):
    """Pre- and post-norm around both attention and MLP (Gemma 3's sandwich).

    With experts (Gemma 4 MoE), the router reads the residual stream and the experts' output,
    normed on its own, is added to the dense MLP's before the shared post-norm; an optional
    per-layer scalar multiplies the block's output.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, norm = cfg.hidden_size, dict(eps=cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.layer_type = cfg.layer_types[layer]
        self.self_attn = Attention(cfg, layer)
        self.mlp = GeGLU(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, **norm)
        self.post_attention_layernorm = RMSNorm(d, **norm)
        self.pre_feedforward_layernorm = RMSNorm(d, **norm)
        self.post_feedforward_layernorm = RMSNorm(d, **norm)
        self.router = self.experts = None
        if cfg.num_experts:
            self.router = Router(d, cfg.num_experts, cfg.top_k_experts, cfg.rms_norm_eps)
            self.experts = Experts(d, cfg.moe_intermediate_size, cfg.num_experts)
            self.post_feedforward_layernorm_1 = RMSNorm(d, **norm)
            self.post_feedforward_layernorm_2 = RMSNorm(d, **norm)
            self.pre_feedforward_layernorm_2 = RMSNorm(d, **norm)
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def forward(self, x, rope, mask, attend, cache, write, at=None, end=None):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, mask, attend, cache, write, at, end))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            flat = x.reshape(-1, x.shape[-1])  # [B*L, d]
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), *self.router(flat))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed.view_as(x))
        x = x + self.post_feedforward_layernorm(h)
        return x if self.layer_scalar is None else x * self.layer_scalar


# -------------------------------------------------------------------------------------- model
def head_dim_of(cfg: ModelConfig, layer: int) -> int:
    """Gemma 4's global layers may use wider heads than its sliding ones."""
    return (cfg.global_head_dim or cfg.head_dim) if cfg.layer_types[layer] == FULL else cfg.head_dim


class GemmaBackbone(nn.Module):
    """``Gemma3TextModel``'s parameters: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.forbidden_input_ids = torch.empty(0, dtype=torch.long)  # e.g. image tokens of a multimodal checkpoint
        self.model = GemmaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.self_conditioning = (
            SelfConditioning(cfg.hidden_size, cfg.selfcond_intermediate_size or cfg.hidden_size,
                             cfg.rms_norm_eps, cfg.selfcond_variant, unit_offset=cfg.norm_unit_offset)
            if cfg.self_conditioning else None
        )
        self.time_embedding = TimeEmbedding(cfg.hidden_size, cfg.time_freq_dim) if cfg.time_conditioning else None
        self.canvas_groups = (CanvasPositionGroups(cfg.canvas_position_groups, cfg.hidden_size)
                              if cfg.canvas_position_groups is not None else None)
        self.rotary = nn.ModuleDict({
            SLIDING: Rotary(cfg.head_dim, cfg.rope_local_theta, cfg.max_position_embeddings),
            FULL: Rotary(cfg.global_head_dim or cfg.head_dim, cfg.rope_global_theta, cfg.max_position_embeddings,
                         cfg.rope_global_scaling, cfg.rope_global_partial_factor),
        })
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (normal weights, RMSNorm and router scales at unit scale); zero-init parts kept."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if self.config.norm_unit_offset else 1.0)
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                p.fill_(1.0)
            elif "down_proj" in name and "self_conditioning" in name or name.startswith("time_embedding.fc2"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()

    # -- run-time switches: they change how the same math is computed, never the weights ----------
    def set_attention(self, name: str) -> "DiffusionGemma":
        """Compute attention with back-end ``name`` (eager | sdpa | flex) from the next forward on."""
        if name not in BACKENDS:
            raise DGemmaError(f"unknown attention back-end {name!r}; choose one of {', '.join(BACKENDS)}")
        self.config.attn_implementation = name
        return self

    def set_activation_checkpointing(self, enabled: bool) -> "DiffusionGemma":
        """Recompute each layer's internals in backward instead of keeping them (training only)."""
        self.config.gradient_checkpointing = bool(enabled)
        return self

    # -- pieces --------------------------------------------------------------------------------
    def embed(self, input_ids: Tensor, info: TokenInfo, selfcond: Tensor | None, t: Tensor | None) -> Tensor:
        """Scaled token embeddings; conditioning is added to noisy tokens only, exactly once."""
        w = self.model.embed_tokens.weight
        scale = torch.tensor(math.sqrt(self.config.hidden_size)).to(w.dtype)
        x = self.model.embed_tokens(input_ids) * scale
        if self.canvas_groups is not None:  # structure-aware canvas positions, clean and noisy canvases alike
            x = x + self.canvas_groups(info)
        if self.self_conditioning is None and self.time_embedding is None:
            return x
        noisy = info.noisy[..., None]
        cond = x
        if self.self_conditioning is not None:
            # the signal is an expected *input* embedding, so it carries the same sqrt(d) scale
            cond = self.self_conditioning(cond, None if selfcond is None else selfcond * scale)
        if self.time_embedding is not None and t is not None:
            cond = cond + self.time_embedding(t)[:, None, :]
        return torch.where(noisy, cond, x)

    def logits(self, hidden: Tensor, *, vocab: Tensor | None = None) -> Tensor:
        """Final-normed hidden states ``[.., d]`` -> logits ``[.., V]`` (with soft-capping);
        ``vocab [S]``: these tokens' logits only, ``[.., S]`` (``CanvasSampler.shortlist``).

        The head always sees a 2-D ``[N, d]`` matrix: given a 3-D view whose strides are not a
        packed tensor's (``h[:, C:]`` of a longer forward) and frozen bf16 weights (a loaded run),
        PyTorch 2.13's CPU ``linear`` takes a path that costs about 0.8 s a batch row for the 270M,
        against 25 ms for the same product on the flattened rows (``docs/benchmarks.md``). In fp32
        inference on a CPU the product goes through oneDNN (``primitives.py:head_product``)."""
        z = head_product(hidden.reshape(-1, hidden.shape[-1]), self.lm_head, vocab)
        z = z.view(*hidden.shape[:-1], z.shape[-1])
        if (cap := self.config.final_logit_softcapping) is not None:
            z = z.to(torch.promote_types(z.dtype, torch.float32))  # at least fp32, as transformers does
            z = torch.tanh(z / cap) * cap
        return z

    def rope(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        return {kind: self.rotary[kind](positions, dtype) for kind in set(self.config.layer_types)}

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        *,
        info: TokenInfo | None = None,
        cache: KVCache | None = None,
        write: bool | None = None,
        append: int = 0,
        selfcond: Tensor | None = None,
        t: Tensor | None = None,
        return_hidden: bool = False,
        partial: tuple[int | Tensor, TokenInfo] | None = None,
    ) -> Tensor:
        """``input_ids [B, L]`` -> logits ``[B, L, V]`` (or final hidden ``[B, L, d]``).

        ``info`` describes each token (default: clean, unpadded, positions ``0..L-1`` after the
        cache). With a ``cache`` the tokens attend to its filled slots too; ``write`` (default:
        True for clean inputs, False when any token is noisy) stores their keys and moves the
        cursor. ``append = n`` stores only the first ``n`` tokens (clean: a finished canvas) and
        moves the cursor past them; the rest (a noisy canvas) attend to them within the same
        forward and are not kept: an append and the next canvas's first denoising step in one
        pass, the same numbers as the two passes it replaces (the clean tokens never attend to
        noisy ones). ``selfcond [B, L, d]`` is the self-conditioning signal (expected embedding of
        the previous prediction), ``t [B]`` the diffusion time, both used on noisy tokens only.

        ``partial = (lo, canvas)``: the inputs are positions ``[lo, lo + L)`` of a noisy canvas
        described by ``canvas [B, C]`` (a cache and no write needed); ``lo`` is an int, or a ``[B]``
        tensor where each row has its own window (``info`` then describes each row's). They attend
        to the cache and to the whole canvas, whose other positions' keys are those an earlier pass
        of it left in the cache's scratch slots. Exact when those positions' tokens and every key
        they depend on are unchanged since; otherwise an approximation (``CanvasSampler.reuse_canvas_keys``).
        """
        cfg = self.config
        b, n = input_ids.shape
        forbidden = self.forbidden_input_ids
        if forbidden.numel() and bool(torch.isin(input_ids, forbidden.to(input_ids.device)).any()):
            raise DGemmaError("the input holds image tokens: dgemma runs DiffusionGemma on text only "
                              "(the vision tower is not supported)")
        if info is None:
            info = TokenInfo.plain(b, n, input_ids.device)
            if cache is not None and cache.cursor:
                last = cache.info().positions.max(-1).values  # continue each row's positions
                info.positions = info.positions + last[:, None] + 1
        if not torch.compiler.is_compiling():  # compiled.py resolves it eagerly, before the graph
            write = self.resolve_write(info, write, append)
        k_info = cache.key_info(info) if cache is not None else info
        end = None
        if partial is not None:
            lo, canvas = partial
            if cache is None or not cache.cursor or write:
                raise ValueError("a partial canvas pass reads a filled cache and writes nothing")
            if cfg.decoder_window_anchor == "canvas":  # its anchor is the canvas's first position, not the window's
                raise DGemmaError("a partial canvas pass needs decoder_window_anchor='query'")
            if isinstance(lo, Tensor) and (lo.shape != (b,) or bool(((lo < 0) | (lo + n > canvas.shape[1])).any())):
                raise ValueError(f"a partial pass's row windows [lo, lo + {n}) must lie in the canvas's "
                                 f"{canvas.shape[1]} positions, one start a row ({b}), got {lo.tolist()}")
            k_info, end = cache.key_info(canvas), cache.cursor + canvas.shape[1]
        attend = get_attention(cfg.attn_implementation)
        masks = {
            SLIDING: MaskSpec(info, k_info, cfg.encoder_mode, cfg.sliding_window, cfg.decoder_window_anchor),
            FULL: MaskSpec(info, k_info, cfg.encoder_mode, None),
        }
        x = self.embed(input_ids, info, selfcond, t)
        rope = self.rope(info.positions, x.dtype)
        at = cache.cursor + (partial[0] if partial is not None else 0) if cache is not None else None
        for layer in self.model.layers:
            kind = layer.layer_type
            if cfg.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # recomputation in backward re-writes the same keys into the same cache slots
                x = checkpoint(layer, x, rope[kind], masks[kind], attend, cache, write, at, end, use_reentrant=False)
            else:
                x = layer(x, rope[kind], masks[kind], attend, cache, write, at, end)
        if cache is not None and write:  # with append, the noisy keys stay in the scratch slots
            cache.advance(info[:, :append] if append else info)
        x = self.model.norm(x)
        return x if return_hidden else self.logits(x)

    @staticmethod
    def resolve_write(info: TokenInfo, write: bool | None, append: int = 0) -> bool:
        """``forward``'s ``write``: default True for clean inputs, False when any token is noisy;
        writing a noisy token is refused (one host sync). With ``append = n`` the first ``n``
        tokens must be clean and are written (True)."""
        if append:
            if not 0 < append < info.shape[1] or bool(info.noisy[:, :append].any()) or write is False:
                raise ValueError(f"append={append}: the first {append} of {info.shape[1]} tokens must be clean "
                                 "and written, and at least one token must follow them")
            return True
        noisy = bool(info.noisy.any())
        if write and noisy:
            raise ValueError("noisy (decoder) tokens are never written to the KV cache")
        return not noisy if write is None else write

    def num_parameters(self) -> int:
        """Unique parameters (the tied LM head counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
