"""``sdpa_attention``'s folded query heads (one query row a head: an AR step) against the eager reference."""

import pytest
import torch
import torch.nn.functional as F

from dgemma.models.attention import MaskSpec, eager_attention, fold_query_heads, sdpa_attention


def _case(dtype, batch, keys=50, heads=4, kv_heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = torch.rand(batch, 1, keys, generator=g) > 0.3
    mask[..., 0] = True  # every row sees a key
    spec = MaskSpec(q=None, k=None, encoder="causal", window=None, _dense=mask)
    return q.to(dtype), k.to(dtype), v.to(dtype), spec


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 2), (torch.float32, 5), (torch.bfloat16, 1), (torch.bfloat16, 3)])
def test_folded_heads_match_eager(dtype, batch):
    q, k, v, spec = _case(dtype, batch)
    assert fold_query_heads(q, k.shape[1])
    got = sdpa_attention(q, k, v, spec, scale=0.2)
    want = eager_attention(q.double(), k.double(), v.double(), spec, scale=0.2)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    unfolded = F.scaled_dot_product_attention(q, k, v, attn_mask=spec.dense()[:, None], scale=0.2, enable_gqa=True)
    torch.testing.assert_close(got, unfolded, rtol=tol, atol=tol)


def test_fold_only_where_it_was_measured_to_win():
    q, k, _, _ = _case(torch.float32, 1)
    assert not fold_query_heads(q, k.shape[1])  # fp32, one row: PyTorch's GQA path is faster
    assert not fold_query_heads(q.expand(2, 4, 3, 32).bfloat16(), 2)  # a denoising pass (several rows)
    assert not fold_query_heads(q.bfloat16(), 4)  # one KV head a query head: nothing to fold
    assert not fold_query_heads(torch.empty(2, 4, 1, 32, device="meta", dtype=torch.bfloat16), 2)  # not a CPU
    assert fold_query_heads(q.double().expand(2, 4, 1, 32), 2)  # a batch of fp64 AR steps folds too
