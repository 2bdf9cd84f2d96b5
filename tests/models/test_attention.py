"""``sdpa_attention``'s own paths (folded query heads, ``is_causal`` for a prefill) against the eager reference."""

import pytest
import torch
import torch.nn.functional as F

from dgemma.models.attention import MaskSpec, eager_attention, fold_query_heads, sdpa_attention
from dgemma.models.masks import TokenInfo


def _case(dtype, batch, keys=50, heads=4, kv_heads=2, dim=32, seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, rows, keys, generator=g) > 0.3
    mask[..., 0] = True  # every row sees a key
    spec = MaskSpec(q=None, k=None, encoder="causal", window=None, _dense=mask)
    return q.to(dtype), k.to(dtype), v.to(dtype), spec


def _assert_matches_references(q, k, v, spec):
    """``sdpa_attention`` (whatever path it takes) against fp64 eager and against PyTorch's plain masked call."""
    got = sdpa_attention(q, k, v, spec, scale=0.2)
    want = eager_attention(q.double(), k.double(), v.double(), spec, scale=0.2)
    tol = 1e-6 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=spec.dense()[:, None], scale=0.2, enable_gqa=True)
    torch.testing.assert_close(got, masked, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,batch,rows", [(torch.float32, 2, 1), (torch.float32, 5, 1), (torch.bfloat16, 1, 1),
                                             (torch.bfloat16, 3, 1), (torch.bfloat16, 2, 5), (torch.bfloat16, 3, 16)])
def test_folded_heads_match_eager(dtype, batch, rows):
    q, k, v, spec = _case(dtype, batch, rows=rows)
    assert fold_query_heads(q, k.shape[1])
    _assert_matches_references(q, k, v, spec)


def test_fold_only_where_it_was_measured_to_win():
    q, k, _, _ = _case(torch.float32, 1)
    assert not fold_query_heads(q, k.shape[1])  # fp32, one row: PyTorch's GQA path is faster
    assert not fold_query_heads(q.expand(1, 4, 3, 32).bfloat16(), 2)  # one denoising pass (several rows)
    assert fold_query_heads(q.expand(2, 4, 3, 32).bfloat16(), 2)  # a bf16 batch of them folds
    assert not fold_query_heads(q.expand(2, 4, 3, 32), 2)  # an fp32 batch of them does not
    assert not fold_query_heads(q.expand(2, 4, 17, 32).bfloat16(), 2)  # nor more than 16 rows a head
    assert not fold_query_heads(q.bfloat16(), 4)  # one KV head a query head: nothing to fold
    assert not fold_query_heads(torch.empty(2, 4, 1, 32, device="meta", dtype=torch.bfloat16), 2)  # not a CPU
    assert fold_query_heads(q.double().expand(2, 4, 1, 32), 2)  # a batch of fp64 AR steps folds too


def _prefill(valid, window=None):
    info = TokenInfo.clean(valid)
    return MaskSpec(q=info, k=info, encoder="causal", window=window)


def test_causal_prefill_detected_only_where_the_mask_is_the_triangle():
    full = torch.ones(2, 6, dtype=torch.bool)
    assert _prefill(full).causal()
    assert _prefill(full, window=8).causal()  # a window wider than the prompt cuts nothing
    assert not _prefill(full, window=3).causal()  # a sliding window cuts the far keys
    padded = full.clone()
    padded[1, 0] = False  # a left-padded row
    assert not _prefill(padded).causal()
    q1 = TokenInfo.clean(torch.ones(1, 1, dtype=torch.bool))
    assert not MaskSpec(q=q1, k=q1, encoder="causal", window=None).causal()  # one token: nothing to skip
    canvas = TokenInfo.clean(torch.ones(1, 4, dtype=torch.bool))
    canvas.noisy[:] = True
    canvas.blocks[:] = 1
    assert not MaskSpec(q=canvas, k=canvas, encoder="causal", window=None).causal()  # bidirectional


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_prefill_matches_eager_and_the_masked_call(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 37, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 37, 32, generator=g).to(dtype) for _ in range(2))
    spec = _prefill(torch.ones(2, 37, dtype=torch.bool))
    assert spec.causal()
    _assert_matches_references(q, k, v, spec)
