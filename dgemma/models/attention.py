"""Three interchangeable attention back-ends that must agree.

- ``eager``: explicit scores, additive float mask, softmax in at least fp32. The ground-truth reference;
  kept on purpose (and the only one that supports attention-logit soft-capping besides flex).
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask.
- ``flex``: FlexAttention with a block mask whose ``mask_mod`` evaluates
  :func:`dgemma.models.masks.attention_rule` on the token metadata, so fully-masked tiles
  are skipped; compiled (fused) on GPUs, eager on CPUs. One fixed ``mask_mod`` code path per
  (encoder mode, window) keeps recompiles bounded. On CPU it runs forward only (PyTorch raises
  on backward there).

All take ``q [B, Hq, Lq, D]``, ``k, v [B, Hkv, Lk, D]`` and return ``[B, Hq, Lq, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.models.masks import TokenInfo, attention_rule, dense_mask, window_anchor

BACKENDS = ("eager", "sdpa", "flex")


@dataclass
class MaskSpec:
    """What a layer needs to build its mask; dense/block forms are built lazily and shared."""

    q: TokenInfo
    k: TokenInfo
    encoder: str
    window: int | None
    anchor: str = "query"  # where sliding windows end for noisy queries (masks.window_anchor)
    _dense: Tensor | None = field(default=None, repr=False)
    _block: object = field(default=None, repr=False)
    _causal: bool | None = field(default=None, repr=False)

    def dense(self) -> Tensor:
        if self._dense is None:
            self._dense = dense_mask(self.q, self.k, encoder=self.encoder, window=self.window, anchor=self.anchor)
        return self._dense

    def causal(self) -> bool:
        """Whether the dense mask is exactly the lower triangle of a square (every row: a prompt prefilled
        from an empty cache, no padding, no window cut). ``sdpa`` then passes ``is_causal`` instead of the
        mask, and PyTorch skips the blocks above the diagonal: the same scores, 1.8x faster for 1,000 tokens
        in bf16 on a CPU (6% at 400; ``docs/benchmarks.md``). One ``[B, L, L]`` comparison, once a pass."""
        if self._causal is None:
            m = self.dense()
            self._causal = (m.shape[-1] == m.shape[-2] > 1
                            and torch.equal(m, torch.ones(m.shape[-2:], dtype=torch.bool, device=m.device)
                                            .tril().expand_as(m)))
        return self._causal

    def block_mask(self):
        if self._block is None:
            from torch.nn.attention.flex_attention import create_block_mask

            q, k, encoder, window = self.q, self.k, self.encoder, self.window
            anchor = window_anchor(q) if self.anchor == "canvas" and window is not None else None

            def mask_mod(b, h, qi, ki):
                return attention_rule(
                    q.positions[b, qi], q.blocks[b, qi], q.noisy[b, qi], q.valid[b, qi],
                    k.positions[b, ki], k.blocks[b, ki], k.noisy[b, ki], k.valid[b, ki],
                    encoder=encoder, window=window, q_anchor=None if anchor is None else anchor[b, qi],
                )

            bsz, lq = q.shape
            self._block = create_block_mask(
                mask_mod, bsz, None, lq, k.shape[1], device=q.positions.device, _compile=False
            )
        return self._block


def _softcap(scores: Tensor, cap: float | None) -> Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def eager_attention(q, k, v, mask: MaskSpec, *, scale: float, softcap: float | None = None) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = _softcap(torch.matmul(q, k.transpose(2, 3)) * scale, softcap)
    additive = torch.zeros(mask.dense().shape, dtype=scores.dtype, device=scores.device)
    additive.masked_fill_(~mask.dense(), torch.finfo(scores.dtype).min)
    # fp32 softmax for half/single precision (as transformers does); fp64 stays fp64 so the
    # cache-vs-single-shot invariant can be checked to 1e-12
    probs = torch.softmax(scores + additive[:, None], dim=-1,
                          dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v)


def sdpa_attention(q, k, v, mask: MaskSpec, *, scale: float, softcap: float | None = None) -> Tensor:
    if softcap is not None:
        return eager_attention(q, k, v, mask, scale=scale, softcap=softcap)
    (b, hq, lq, d), hkv = q.shape, k.shape[1]
    if fold_query_heads(q, hkv):  # the G query heads of a KV head become G x Lq query rows of it
        groups, m = hq // hkv, mask.dense()  # [B, Lq, S], the same for every head
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, groups * lq, d), k, v, scale=scale,
                                             attn_mask=m[:, None, None].expand(b, 1, groups, lq, -1)
                                             .reshape(b, 1, groups * lq, -1))
        return out.view(b, hq, lq, d)
    if lq == k.shape[2] and mask.causal():  # a prefill: PyTorch skips the masked blocks itself
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense()[:, None], scale=scale, enable_gqa=hq != hkv)


def fold_query_heads(q: Tensor, kv_heads: int) -> bool:
    """Whether the ``G`` query heads of a KV head attend as ``G x Lq`` rows of it instead of through
    ``enable_gqa`` (the same dot products, the mask repeated): on a CPU, for one query row a head (an
    AR step) in bf16 / fp16 or for a batch, and for up to 16 rows a head (a denoising pass) in bf16 /
    fp16 for a batch. PyTorch's CPU flash kernel spends about a millisecond a call on one bf16 query
    row per head (a 1,100-key cache, 4 query heads on 1 KV head: 1.0 ms at batch 1, 15.7 at batch 16)
    where four rows of one head take 0.37 / 1.8 ms; in fp32 the fold wins for a batch (0.26 against
    0.38 ms at 2, 2.7 against 5.9 at 16) and loses for one row (0.68 against 0.20 ms). For 4-16 bf16
    rows a head at batch 4 or 16 it takes 0.50-0.89x the time at 450-1,100 keys; at batch 1, and in
    fp32, it is mixed (0.8-1.4x), so those keep ``enable_gqa``. An AMD EPYC, 2 threads, 2026-12-07
    (``docs/benchmarks.md``). The kernel's blocking may round the sums differently."""
    b, hq, lq, _ = q.shape
    if q.device.type != "cpu" or hq <= kv_heads:
        return False
    half = q.dtype in (torch.bfloat16, torch.float16)
    return (half or b > 1) if lq == 1 else (half and b > 1 and lq <= 16)


_COMPILED_FLEX: dict[str, object] = {}


def _flex_kernel(device: torch.device):
    """FlexAttention is fused only when compiled: on a GPU compile it once per process (shapes
    that change from call to call, such as a growing cache, make it dynamic after the first
    recompile); on a CPU keep the eager reference path, which also serves tests."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if device.type != "cuda":
        return flex
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex)
    return _COMPILED_FLEX["cuda"]


def flex_attention(q, k, v, mask: MaskSpec, *, scale: float, softcap: float | None = None) -> Tensor:
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, qi, ki):
            return torch.tanh(score / softcap) * softcap

    return _flex_kernel(q.device)(
        q, k, v, score_mod=score_mod, block_mask=mask.block_mask(), scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


ATTENTION = {"eager": eager_attention, "sdpa": sdpa_attention, "flex": flex_attention}


def get_attention(name: str):
    try:
        return ATTENTION[name]
    except KeyError:
        raise ValueError(f"unknown attention back-end {name!r}; choose one of {BACKENDS}") from None
