"""docs/design.md §3's invariant: canvas-by-canvas decoding through the KV cache equals one single-shot
forward over ``[prompt | clean canvases | noisy canvases]`` with the block mask (fp64)."""

import pytest
import torch

from dgemma.models.hf_gemma4 import DIFFUSIONGEMMA_DESIGN
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo, single_shot_info
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V, C, N = 50, 4, 3


def tiny(encoder="causal", attn="eager", **kw):
    kw = {"query_pre_attn_scalar": 8, **kw}
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      max_position_embeddings=128, encoder_mode=encoder, attn_implementation=attn, **kw)
    torch.manual_seed(0)
    m = DiffusionGemma(cfg).double().eval()
    with torch.no_grad():  # make every norm and zero-init part matter
        for name, p in m.named_parameters():
            if p.dim() == 1 or "self_conditioning.mlp.down_proj" in name or "time_embedding.fc2" in name:
                p.normal_(0, 0.3)
    return m


def cached_decode(model, prompt, pvalid, clean, noisy, selfcond=None, t=None, fused=False):
    """Decode every noisy canvas k against a cache holding prompt + clean canvases < k. ``fused``:
    clean canvas k - 1 is appended in the forward that decodes noisy canvas k (``append=C``)."""
    b, p = prompt.shape
    cache = KVCache(b, p + N * C)
    model(prompt, info=TokenInfo.clean(pvalid), cache=cache)
    start = pvalid.sum(-1)
    ones = torch.ones(b, C, dtype=torch.bool)
    info = [TokenInfo(start[:, None] + k * C + torch.arange(C)[None], torch.full((b, C), k + 1), ones, ones)
            for k in range(N)]
    outs = []
    for k in range(N):
        sc = None if selfcond is None else selfcond[:, k * C:(k + 1) * C]
        before = cache.cursor
        if fused and k:
            done = TokenInfo(info[k - 1].positions, info[k - 1].blocks, ~ones, ones)
            sc = None if sc is None else torch.cat([torch.zeros_like(sc), sc], 1)
            out = model(torch.cat([clean[:, (k - 1) * C:k * C], noisy[:, k * C:(k + 1) * C]], 1),
                        info=done.cat(info[k]), cache=cache, append=C, selfcond=sc, t=t)
            outs.append(out[:, C:])
            assert cache.cursor == before + C
        else:
            outs.append(model(noisy[:, k * C:(k + 1) * C], info=info[k], cache=cache, write=False, selfcond=sc, t=t))
            assert cache.cursor == before
        if not fused or k == N - 1:
            before = cache.cursor
            model(clean[:, k * C:(k + 1) * C], info=TokenInfo(info[k].positions, info[k].blocks, ~ones, ones),
                  cache=cache)
            assert cache.cursor == before + C
    assert cache.cursor == p + N * C
    return torch.cat(outs, 1)


@pytest.mark.parametrize("encoder", ["causal", "block"])
@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("conditioning", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cached_equals_single_shot(encoder, attn, conditioning, fused):
    model = tiny(encoder, attn, self_conditioning=conditioning, time_conditioning=conditioning)
    g = torch.Generator().manual_seed(1)
    pvalid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()  # right padded, different lengths
    prompt = torch.randint(0, V, (2, 5), generator=g)
    clean = torch.randint(0, V, (2, N * C), generator=g)
    noisy = torch.randint(0, V, (2, N * C), generator=g)
    selfcond = torch.randn(2, N * C, 32, generator=g, dtype=torch.float64) if conditioning else None
    t = torch.tensor([0.3, 0.8], dtype=torch.float64) if conditioning else None
    with torch.no_grad():
        got = cached_decode(model, prompt, pvalid, clean, noisy, selfcond, t, fused=fused)
        info = single_shot_info(pvalid, torch.ones(2, N * C, dtype=torch.bool), C)
        ids = torch.cat([prompt, clean, noisy], 1)
        sc = None if selfcond is None else torch.cat([torch.zeros(2, 5 + N * C, 32, dtype=torch.float64), selfcond], 1)
        want = model(ids, info=info, selfcond=sc, t=t)[:, -N * C:]
    # Bit-equality is out of reach only because the two paths reduce over key sets of different
    # lengths (masked keys contribute exact zeros, but change the summation blocking): the
    # measured gap is 1 ulp (8e-17 on logits of order 1), so hold it to 1e-14.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


GEMMA4 = dict(global_head_dim=16, num_global_key_value_heads=1, rope_global_partial_factor=0.25, num_experts=4,
              top_k_experts=2, moe_intermediate_size=16, **DIFFUSIONGEMMA_DESIGN)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("fused", [False, True])
def test_cached_equals_single_shot_diffusiongemma_architecture(attn, fused):
    """The same invariant for the released DiffusionGemma's design: Gemma 4 layers, experts, and
    a sliding window anchored at the canvas start (prompt longer than the window)."""
    model = tiny("causal", attn, **GEMMA4)
    g = torch.Generator().manual_seed(2)
    pvalid = torch.tensor([[1] * 9, [1] * 7 + [0, 0]]).bool()
    prompt = torch.randint(0, V, (2, 9), generator=g)
    clean = torch.randint(0, V, (2, N * C), generator=g)
    noisy = torch.randint(0, V, (2, N * C), generator=g)
    selfcond = torch.randn(2, N * C, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = cached_decode(model, prompt, pvalid, clean, noisy, selfcond, fused=fused)
        info = single_shot_info(pvalid, torch.ones(2, N * C, dtype=torch.bool), C)
        sc = torch.cat([torch.zeros(2, 9 + N * C, 32, dtype=torch.float64), selfcond], 1)
        want = model(torch.cat([prompt, clean, noisy], 1), info=info, selfcond=sc)[:, -N * C:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_prefill_then_tokens_equals_full_forward():
    model = tiny()
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(2, 12)
        parts = [model(ids[:, :5], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)


def test_decoder_pass_never_writes_the_cache():
    model = tiny()
    prompt = torch.randint(0, V, (1, 6))
    cache = KVCache(1, 6 + C)
    with torch.no_grad():
        model(prompt, cache=cache)
        snapshot = {k: v.clone() for k, v in cache.keys.items()}, cache.cursor
        ones = torch.ones(1, C, dtype=torch.bool)
        model(torch.randint(0, V, (1, C)), info=TokenInfo(6 + torch.arange(C)[None], torch.ones(1, C).long(), ones, ones),
              cache=cache)  # write defaults to False for noisy tokens
    assert cache.cursor == snapshot[1]
    # the filled slots are untouched; the free ones after the cursor served as scratch
    assert all(torch.equal(cache.keys[k][:, :, :6], v[:, :, :6]) for k, v in snapshot[0].items())
    assert not all(torch.equal(cache.keys[k], v) for k, v in snapshot[0].items())
    with pytest.raises(ValueError, match="never written"):
        model(torch.randint(0, V, (1, C)), info=TokenInfo(6 + torch.arange(C)[None], torch.ones(1, C).long(), ones, ones),
              cache=cache, write=True)
    for append in (1, C):  # append stores clean tokens only, and leaves a noisy canvas to decode
        with pytest.raises(ValueError, match="must be clean"):
            model(torch.randint(0, V, (1, C)), info=TokenInfo(6 + torch.arange(C)[None], torch.ones(1, C).long(),
                                                              ones, ones), cache=cache, append=append)
    assert cache.cursor == snapshot[1]


def test_truncate_and_select():
    model = tiny()
    ids = torch.randint(0, V, (3, 8))
    with torch.no_grad():
        cache = KVCache(3, 8)
        model(ids[:, :6], cache=cache)
        cache.truncate(4)
        a = model(ids[:, 4:8], cache=cache)
        sub = KVCache(3, 8)
        model(ids[:, :4], cache=sub)
        sub = sub.select(torch.tensor([2, 0]))
        b = model(ids[[2, 0], 4:8], cache=sub)
    torch.testing.assert_close(a[[2, 0]], b, rtol=0, atol=0)
    with pytest.raises(ValueError):
        cache.truncate(99)


def test_select_with_a_shorter_capacity_reads_the_same():
    """A selected cache trimmed to ``cursor + C`` slots (the sampler's in-canvas copy) decodes a
    noisy canvas exactly as the full-capacity copy does, and refuses a capacity below the cursor."""
    model = tiny()
    ids = torch.randint(0, V, (3, 10))
    noisy = TokenInfo(torch.arange(6, 10).expand(2, 4), torch.ones(2, 4, dtype=torch.long),
                      torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool))
    with torch.no_grad():
        cache = KVCache(3, 6 + 3 * 4)
        model(ids[:, :6], cache=cache)
        rows = torch.tensor([2, 0])
        full, short = cache.select(rows), cache.select(rows, max_len=6 + 4)
        assert short.max_len == 10 and short.cursor == full.cursor == 6
        a = model(ids[[2, 0], 6:10], info=noisy, cache=full, write=False)
        b = model(ids[[2, 0], 6:10], info=noisy, cache=short, write=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert short.keys[0].shape[2] == 10 and full.keys[0].shape[2] == 18
    with pytest.raises(ValueError, match="max_len must lie in"):
        cache.select(rows, max_len=5)


@pytest.mark.parametrize("encoder", ["causal", "block"])
def test_backends_agree_on_diffusion_masks(encoder):
    """eager (the reference), sdpa and flex on the single-shot [prompt | clean | noisy] layout."""
    g = torch.Generator().manual_seed(2)
    pvalid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    ids = torch.randint(0, V, (2, 5 + 2 * N * C), generator=g)
    info = single_shot_info(pvalid, torch.ones(2, N * C, dtype=torch.bool), C)
    outs = {}
    for attn in ("eager", "sdpa", "flex"):
        with torch.no_grad():
            outs[attn] = tiny(encoder, attn)(ids, info=info)
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=0, atol=1e-12)
    torch.testing.assert_close(outs["flex"], outs["eager"], rtol=0, atol=1e-12)


def test_logits_of_a_strided_view_are_the_packed_ones():
    """``DiffusionGemma.logits`` flattens its input before the head (with frozen bf16 weights a 3-D
    view such as the noisy half of a fused append, ``h[:, C:]``, sends PyTorch's CPU ``linear`` down
    a path 30x slower): the same numbers for the view, its packed copy and one vector, and no rows
    for none (fp64)."""
    model = tiny(final_logit_softcapping=30.0)
    h = torch.randn(3, 2 * C, 32, dtype=torch.float64)
    view = h[:, C:]
    assert view.stride() != view.contiguous().stride()
    with torch.no_grad():
        got = model.logits(view)
        want = torch.tanh(model.lm_head(view.contiguous()) / 30.0) * 30.0
        one = model.logits(view[1, 2])
        none = model.logits(view[view[..., 0] > 99])  # no row selected (a pass with no open position)
    assert got.shape == (3, C, V) and torch.equal(got, want)
    assert one.shape == (V,) and none.shape == (0, V)
    torch.testing.assert_close(one, got[1, 2], rtol=0, atol=1e-15)  # a one-row product rounds on its own
