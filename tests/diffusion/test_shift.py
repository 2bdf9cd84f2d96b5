"""``shift_logits``: every canvas token is scored and sampled from the state before it (fp64)."""

import doctest

import pytest
import torch

import dgemma.diffusion.shift as shift_mod
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.objective import DiffusionObjective
from dgemma.diffusion.sampler import CanvasSampler
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import build_step
from dgemma.diffusion.stopping import EntropyStop
from dgemma.errors import DGemmaError
from dgemma.models.masks import TokenInfo
from dgemma.training.checkpoint import check_compatible, model_fingerprint

from tests.diffusion.test_objective import C, N, V, cached_and_uncached, make_batch, tiny, wake_conditioning


def test_doctests():
    assert doctest.testmod(shift_mod, extraglobs={"torch": torch}).failed == 0


def _reference_sum(model, batch, plan, canvases_per_row):
    """Summed CE of the decoded canvases by one uncached forward of [prompt | clean canvases < k |
    noisy canvas k] per row and canvas; the state predicting position j is that of j - 1, and of
    the last context token (the last *valid* prompt token for k = 0) for j = 0."""
    total = torch.zeros((), dtype=torch.float64)
    p = batch["prompt_ids"].shape[1]
    for r, ks in enumerate(canvases_per_row):
        for slot, k in enumerate(ks):
            ctx = torch.cat([batch["prompt_ids"][r], batch["canvas_ids"][r, :k * C]])[None]
            pv = batch["prompt_valid"][r]
            n = int(pv.sum())
            ctx_info = TokenInfo(torch.cat([torch.arange(p).masked_fill(~pv, 0), n + torch.arange(k * C)])[None],
                                 torch.cat([torch.zeros(p, dtype=torch.long),
                                            1 + torch.arange(k * C) // C])[None],
                                 torch.zeros(1, p + k * C, dtype=torch.bool),
                                 torch.cat([pv, torch.ones(k * C, dtype=torch.bool)])[None])
            sl = slice(slot * C, (slot + 1) * C)
            xt, target = plan.xt[r:r + 1, sl], plan.target[r, sl]
            noisy = TokenInfo(n + k * C + torch.arange(C)[None], torch.full((1, C), k + 1),
                              torch.ones(1, C, dtype=torch.bool), torch.ones(1, C, dtype=torch.bool))
            with torch.no_grad():
                h = model(torch.cat([ctx, xt], 1), info=ctx_info.cat(noisy), return_hidden=True)[0]
            before = n - 1 if k == 0 else p + k * C - 1
            states = torch.cat([h[before:before + 1], h[p + k * C: p + k * C + C - 1]])
            logp = model.logits(states).log_softmax(-1)
            x0 = plan.x0[r, sl]
            total += -(logp.gather(1, x0[:, None])[:, 0] * target).sum()
    return total


@pytest.mark.parametrize("decode", ["one", "all"])
@pytest.mark.parametrize("ar_weight", [0.0, 1.0])
def test_shifted_objective_scores_each_token_from_the_state_before_it(decode, ar_weight):
    model, batch = tiny(shift_logits=True), make_batch()
    obj = DiffusionObjective(noise=UniformNoise(V, LinearSchedule()), canvas_size=C, selfcond_prob=0.0,
                             decode=decode, ar_loss_weight=ar_weight)
    plan = obj.plan(batch, torch.Generator().manual_seed(1))
    terms = obj.run(model, batch, plan)
    ks = [[int(plan.chosen[r].float().argmax())] if decode == "one" else list(range(N)) for r in range(2)]
    want = _reference_sum(model, batch, plan, ks)
    torch.testing.assert_close(terms.diffusion_sum.detach(), want, rtol=1e-10, atol=0)
    # and the unshifted model scores something else: the shift is not a no-op
    plain = tiny()
    plain.load_state_dict(model.state_dict())
    assert not torch.isclose(obj.run(plain, batch, plan).diffusion_sum.detach(), want, rtol=1e-6)


@pytest.mark.parametrize("step", ["ddim", "commit"])
def test_shifted_sampler_cached_equals_recomputing_the_prefix(step):
    """Through the KV cache (the state before a canvas from the prefill or the append) and through
    single-shot forwards: the same tokens, with rows stopping early and finishing at different
    canvases (fp64)."""
    out = cached_and_uncached(wake_conditioning(tiny(shift_logits=True, self_conditioning=True)), step,
                              stop_ids=(5, 6, 7), stop=EntropyStop(3.6))
    assert out[True].tokens == out[False].tokens == out["own"].tokens
    assert out[True].steps_used == out[False].steps_used == out["own"].steps_used
    assert len(out[True].tokens[0]) != len(out[True].tokens[1])  # the rows finish at different canvases


def test_shift_needs_a_prompt_and_is_part_of_the_architecture():
    model, batch = tiny(shift_logits=True), make_batch()
    empty = torch.zeros_like(batch["prompt_valid"])
    sampler = CanvasSampler(noise=UniformNoise(V, LinearSchedule()), step=build_step("ddim", noise=UniformNoise(
        V, LinearSchedule())), num_steps=2, canvas_size=C)
    with pytest.raises(DGemmaError, match="needs a prompt"):
        sampler(model, batch["prompt_ids"], empty, generator=torch.Generator().manual_seed(0))
    meta = {"model_fingerprint": model_fingerprint(tiny().config)}  # a checkpoint of an unshifted model
    with pytest.raises(DGemmaError, match="shift_logits"):
        check_compatible(meta, model.config)
    check_compatible(meta, tiny().config)
    check_compatible({"model_fingerprint": model_fingerprint(model.config)}, model.config)
