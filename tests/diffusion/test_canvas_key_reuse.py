"""Partial canvas passes (``CanvasSampler.reuse_canvas_keys``, ``DiffusionGemma.forward``'s ``partial``).

A partial pass recomputes a window of the canvas and reads the other positions' keys from the
cache's scratch slots, where an earlier pass of the canvas left them. Two facts make it testable
exactly (fp64):

- with nothing changed since that pass, a partial pass gives the full pass's numbers;
- in a one-layer model a key depends on its own token only, so keys of unchanged tokens are never
  stale: a partial pass equals the full pass of the new canvas, and the sampler with reuse equals
  the sampler without it, token for token. With two layers the reused keys are stale (the
  approximation), which the last test shows.
"""

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import CanvasSampler, canvas_window
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import CommitStep
from dgemma.errors import DGemmaError
from dgemma.models.kv_cache import KVCache, put_rows
from dgemma.models.masks import TokenInfo
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V, P, C = 40, 6, 8


def tiny(layers: int, **kw) -> DiffusionGemma:
    types = ["sliding_attention", "full_attention"] * layers
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                      sliding_window=8, layer_types=types[:layers], max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).double().eval()


def canvas_info(b: int) -> TokenInfo:
    ones = torch.ones(b, C, dtype=torch.bool)
    return TokenInfo(P + torch.arange(C).expand(b, C), torch.ones(b, C, dtype=torch.long), ones, ones)


def passes(model, tokens: torch.Tensor, new: torch.Tensor, lo: int, hi: int):
    """Full pass of ``tokens``, then a partial pass of ``new[:, lo:hi]``; and the full pass of ``new``."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, V, (2, P), generator=g)
    info = canvas_info(2)
    with torch.no_grad():
        cache = KVCache(2, P + C)
        model(prompt, cache=cache)
        model(tokens, info=info, cache=cache, return_hidden=True)  # leaves the canvas's keys in the scratch
        part = model(new[:, lo:hi], info=info[:, lo:hi], cache=cache, partial=(lo, info), return_hidden=True)
        ref = KVCache(2, P + C)
        model(prompt, cache=ref)
        full = model(new, info=info, cache=ref, return_hidden=True)
    return part, full[:, lo:hi]


@pytest.mark.parametrize("lo,hi", [(0, 3), (2, 5), (5, 8)])
def test_a_partial_pass_over_an_unchanged_canvas_equals_the_full_pass(lo, hi):
    tokens = torch.randint(2, V, (2, C), generator=torch.Generator().manual_seed(2))
    part, full = passes(tiny(2), tokens, tokens, lo, hi)
    torch.testing.assert_close(part, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lo,hi", [(0, 3), (2, 5), (5, 8)])
def test_one_layer_partial_pass_after_a_change_in_the_window_equals_the_full_pass(lo, hi):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, V, (2, C), generator=g)
    new = tokens.clone()
    new[:, lo:hi] = torch.randint(2, V, (2, hi - lo), generator=g)
    part, full = passes(tiny(1), tokens, new, lo, hi)
    torch.testing.assert_close(part, full, rtol=1e-12, atol=1e-12)
    part2, full2 = passes(tiny(2), tokens, new, lo, hi)  # two layers: the reused keys are stale
    assert not torch.allclose(part2, full2, rtol=1e-6, atol=1e-6)


def test_a_partial_pass_is_refused_where_it_cannot_be_one():
    model = tiny(1)
    info = canvas_info(2)
    tokens = torch.randint(2, V, (2, C))
    with torch.no_grad(), pytest.raises(ValueError, match="filled cache"):
        model(tokens[:, :2], info=info[:, :2], cache=KVCache(2, P + C), partial=(0, info))
    canvas_anchor = tiny(1, decoder_window_anchor="canvas")
    cache = KVCache(2, P + C)
    with torch.no_grad():
        canvas_anchor(torch.randint(2, V, (2, P)), cache=cache)
        with pytest.raises(DGemmaError, match="decoder_window_anchor"):
            canvas_anchor(tokens[:, :2], info=info[:, :2], cache=cache, partial=(0, info))


def window(fresh, read, shift):
    span = canvas_window(fresh, read, shift=shift)
    return span if span is None else (span[0].tolist(), span[1])


def test_canvas_window_literal_examples():
    fresh = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    read = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 0]]).bool()
    assert window(fresh, read, True) == ([2, 3], 5)  # row 0 needs 2-6; row 1 4-5, moved left to fit
    assert window(fresh, read, False) == ([2, 2], 6)  # 2-7 and 5-6: row 1 from 5 would pass the end
    assert window(fresh[1:], read[1:], True) == ([4], 2)  # one row: its own span
    none = torch.zeros_like(read)
    assert window(fresh, torch.stack([read[0], none[0]]), True) == ([2, 3], 5)  # row 1 needs nothing: the end
    assert window(fresh, None, True) is None  # the step reads every open position
    assert window(~fresh, read, True) is None  # all stale: a full pass
    assert window(torch.ones_like(fresh), none, True) is None  # nothing needed: a full pass, as before


def test_rowwise_partial_pass_equals_each_rows_own():
    """Per-row windows (a ``[B]`` tensor of starts) give each row what its own partial pass over
    the same window gives, and, over an unchanged canvas, the full pass's numbers (fp64)."""
    model = tiny(2)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, V, (2, P), generator=g)
    tokens = torch.randint(2, V, (2, C), generator=g)
    info = canvas_info(2)
    starts, width = torch.tensor([1, 4]), 3
    at = (torch.arange(2)[:, None], starts[:, None] + torch.arange(width))
    with torch.no_grad():
        cache = KVCache(2, P + C)
        model(prompt, cache=cache)
        full = model(tokens, info=info, cache=cache, return_hidden=True)  # the canvas's keys in the scratch
        both = model(tokens[at], info=info[at], cache=cache, partial=(starts, info), return_hidden=True)
        torch.testing.assert_close(both, full[at], rtol=1e-12, atol=1e-12)
        new = tokens.clone()
        new[at] = torch.randint(2, V, (2, width), generator=g)  # changed inside each row's window
        both = model(new[at], info=info[at], cache=cache, partial=(starts, info), return_hidden=True)
        for r in range(2):
            one = KVCache(1, P + C)
            model(prompt[r:r + 1], cache=one)
            model(tokens[r:r + 1], info=info[r:r + 1], cache=one, return_hidden=True)
            lo = int(starts[r])
            alone = model(new[r:r + 1, lo:lo + width], info=info[r:r + 1, lo:lo + width], cache=one,
                          partial=(lo, info[r:r + 1]), return_hidden=True)
            torch.testing.assert_close(both[r:r + 1], alone, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="row windows"):  # a window past the canvas's end
            model(new[:, :width], info=info[:, :width], cache=cache, partial=(torch.tensor([0, 6]), info))


def test_put_rows_slices_and_indexed_write_agree():
    """The CPU's slice copy a row and the indexed write used elsewhere write the same slots."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 4, 5, generator=g)
    at = torch.tensor([0, 3, 6])
    a, b = torch.zeros(3, 2, 10, 5), torch.zeros(3, 2, 10, 5)
    put_rows(a, at, x, indexed=False)
    put_rows(b, at, x, indexed=True)
    assert torch.equal(a, b)
    assert torch.equal(a[1, :, 3:7], x[1]) and not a[1, :, :3].any() and not a[1, :, 7:].any()


def decode(model, reuse: bool, *, steps: int, prefix=(), hints=None):
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    prompt = torch.randint(2, V, (4, 5), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(4, 5, dtype=torch.bool)
    valid[1, 3:] = False
    s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0, block=4), num_steps=steps,
                      canvas_size=C, max_canvases=3, stop_ids=(7,), self_condition=False, reuse_canvas_keys=reuse,
                      prefix=prefix)
    computed = []
    real = model.forward

    def counting(ids, **kw):
        computed.append(ids.shape[1])
        return real(ids, **kw)

    model.forward = counting
    try:
        out = s(model, prompt, valid, generator=torch.Generator().manual_seed(0), hints=hints)
    finally:
        del model.forward
    return out, sum(computed)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("steps", [4, 8])  # 2 commits a step, 1 a step
def test_one_layer_sampler_with_reused_keys_equals_the_sampler_without(shift, steps):
    """Canvases appended in the next one's first pass, rows that stop leave the batch, a pinned
    stop token (EOS fill), the answer prefix: the same tokens and passes, fewer positions computed."""
    model = tiny(1, self_conditioning=True, shift_logits=shift)
    hints = torch.full((4, 3 * C), -1)
    hints[2, 10] = 7  # row 2 stops in its second canvas
    a, n_full = decode(model, False, steps=steps, prefix=(5, 6), hints=hints)
    b, n_part = decode(model, True, steps=steps, prefix=(5, 6), hints=hints)
    assert a.tokens == b.tokens and a.forward_passes == b.forward_passes and a.steps_used == b.steps_used
    assert n_part < n_full


def test_two_layer_sampler_with_reused_keys_computes_fewer_positions():
    """With two layers the reused keys are stale: the answers may differ (the approximation);
    each pass is counted, and the passes over the canvas are narrower."""
    model = tiny(2, shift_logits=True)
    a, n_full = decode(model, False, steps=8)
    b, n_part = decode(model, True, steps=8)
    assert a.forward_passes == b.forward_passes
    assert all(b.tokens) and n_part < 0.7 * n_full


def test_canvas_window_doctest():
    import doctest

    import dgemma.diffusion.sampler as sampler_mod

    tests = [t for t in doctest.DocTestFinder().find(sampler_mod) if t.name.endswith(".canvas_window")]
    assert len(tests) == 1 and tests[0].examples
    assert doctest.DocTestRunner().run(tests[0]).failed == 0
