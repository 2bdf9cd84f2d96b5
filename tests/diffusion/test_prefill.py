"""The prefill a prompt at a time (``sampler.py:prefill_prompts``, ``KVCache.put_row``): the same cache,
states and decoded tokens as the batch's one forward over right-padded prompts (fp64)."""

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import CanvasSampler, ar_generate, prefill_prompts
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import CommitStep
from dgemma.models.kv_cache import KVCache
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V = 40
LENGTHS = [7, 3, 9, 1]


def tiny(attn: str, **kw) -> DiffusionGemma:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                      sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                      max_position_embeddings=64, attn_implementation=attn, **kw)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).double().eval()


def prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (len(LENGTHS), max(LENGTHS)), generator=g)
    valid = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    return torch.where(valid, ids, 0), valid


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_prompt_at_a_time_fills_the_cache_the_batch_forward_fills(attn):
    model, (ids, valid) = tiny(attn), prompts()
    caches, states = [], []
    with torch.no_grad():
        for by_row in (False, True):
            cache = KVCache(len(LENGTHS), ids.shape[1] + 4)
            states.append(prefill_prompts(model, ids, valid, cache, by_row=by_row))
            caches.append(cache)
    batch, rows = caches
    assert rows.cursor == batch.cursor == ids.shape[1]
    for a, b in zip((batch.info().positions, batch.info().valid), (rows.info().positions, rows.info().valid)):
        assert torch.equal(a, b)
    for i, n in enumerate(LENGTHS):  # the padding's keys and states are nobody's: only the prompts' compare
        torch.testing.assert_close(states[1][i, :n], states[0][i, :n], rtol=1e-12, atol=1e-12)
        assert not states[1][i, n:].any()
        for layer in batch.keys:
            for t in ("keys", "values"):
                torch.testing.assert_close(getattr(rows, t)[layer][i, :, :n], getattr(batch, t)[layer][i, :, :n],
                                           rtol=1e-12, atol=1e-12)


def test_by_row_is_the_default_for_unequal_prompts_on_a_cpu(monkeypatch):
    model, (ids, valid) = tiny("sdpa"), prompts()
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda x, **kw: calls.append(x.shape[1]) or forward(x, **kw))
    with torch.no_grad():
        prefill_prompts(model, ids, valid, KVCache(4, 12))
        assert calls == LENGTHS
        calls.clear()  # equal lengths, or left padding: the one forward
        prefill_prompts(model, ids, torch.ones_like(valid), KVCache(4, 12))
        prefill_prompts(model, ids, valid.flip(-1), KVCache(4, 12))
        assert calls == [9, 9]


def test_the_engines_decode_the_same_tokens_either_way(monkeypatch):
    import dgemma.diffusion.sampler as sampler_mod

    model, (ids, valid) = tiny("sdpa", shift_logits=True), prompts()  # (the canvas reads the prompt's last state)
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    sampler = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0, block=2), canvas_size=4,
                            num_steps=4, max_canvases=3, stop_ids=(5,))
    outs = []
    for by_row in (False, True):
        real = prefill_prompts
        monkeypatch.setattr(sampler_mod, "prefill_prompts",
                            lambda *a, **kw: real(*a, **{**kw, "by_row": by_row}))
        with torch.no_grad():
            res = sampler(model, ids, valid, generator=torch.Generator().manual_seed(0))
            ar = ar_generate(model, ids, valid, max_new_tokens=6, stop_ids=(5,))
        outs.append((res.tokens, res.forward_passes, ar.tokens))
    assert outs[0] == outs[1]


def test_put_row_refuses_what_does_not_fit():
    one = KVCache(1, 4)
    one.cursor = 4
    with pytest.raises(ValueError, match="put_row"):
        KVCache(2, 3).put_row(0, one)  # more slots than the batch cache has
    with pytest.raises(ValueError, match="put_row"):
        KVCache(2, 8).put_row(2, one)  # no such row


def test_the_engines_build_no_autograd_graph(monkeypatch):
    """Called with grad on and trainable weights, both engines still decode without autograd (and so
    prefill a prompt at a time)."""
    model, (ids, valid) = tiny("sdpa"), prompts()
    assert all(p.requires_grad for p in model.parameters())
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward",
                        lambda x, **kw: seen.append((x.shape[1], torch.is_grad_enabled())) or forward(x, **kw))
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0, block=2), canvas_size=4, num_steps=2,
                  max_canvases=1)(model, ids, valid, generator=torch.Generator().manual_seed(0))
    ar_generate(model, ids, valid, max_new_tokens=2)
    assert not any(grad for _, grad in seen)
    assert [n for n, _ in seen[:4]] == LENGTHS and [n for n, _ in seen[6:10]] == LENGTHS
