"""The training forward: canvas selection, cache hygiene, self-conditioning, AR pairing."""

import pytest
import torch

import dgemma.diffusion.objective as objective_mod
from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.objective import DiffusionObjective, compact_valid, pick_canvases
from dgemma.diffusion.sampler import CanvasSampler
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import build_step
from dgemma.diffusion.stopping import EntropyStop
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V, C, N = 40, 4, 3


def tiny(**kw):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).double()


def make_batch(b=2):
    g = torch.Generator().manual_seed(3)
    pvalid = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]).bool()[:b]
    return {"prompt_ids": torch.randint(2, V, (b, 6), generator=g), "prompt_valid": pvalid,
            "canvas_ids": torch.randint(2, V, (b, N * C), generator=g),
            "canvas_valid": torch.ones(b, N * C, dtype=torch.bool), "canvas_mask": torch.ones(b, N, dtype=torch.bool)}


def objective(**kw):
    args = dict(noise=UniformNoise(V, LinearSchedule()), canvas_size=C, selfcond_prob=0.0)
    args.update(kw)
    return DiffusionObjective(**args)


def test_selfcond_and_time_conditioning_are_exact_no_ops_at_init():
    plain, cond = tiny(), tiny(self_conditioning=True, time_conditioning=True)
    cond.load_state_dict(plain.state_dict(), strict=False)
    ids = torch.randint(0, V, (2, 10))
    ones = torch.ones(2, 10, dtype=torch.bool)
    info = TokenInfo(torch.arange(10).expand(2, 10), torch.zeros(2, 10, dtype=torch.long), ones, ones)
    signal = torch.randn(2, 10, 32, dtype=torch.float64)
    t = torch.tensor([0.2, 0.9], dtype=torch.float64)
    with torch.no_grad():
        want = plain(ids, info=info)
        torch.testing.assert_close(cond(ids, info=info, selfcond=signal, t=t), want, rtol=0, atol=0)
        torch.testing.assert_close(cond(ids, info=info), want, rtol=0, atol=0)


def test_selected_canvas_sees_only_its_prefix():
    """Later canvases (and the chosen canvas's own clean tokens) cannot change its loss."""
    model, obj, b = tiny(), objective(ar_loss_weight=0.0), make_batch()
    base = obj(model, b, torch.Generator().manual_seed(5))
    k = pick_canvases(b["canvas_mask"], "one", torch.Generator().manual_seed(5)).float().argmax(-1)
    assert k.tolist() == [1, 1]  # the seed picks the middle canvas for both rows, so this test is meaningful
    later = dict(b, canvas_ids=b["canvas_ids"].clone())
    later["canvas_ids"][:, 2 * C:] = (later["canvas_ids"][:, 2 * C:] + 1) % V
    earlier = dict(b, canvas_ids=b["canvas_ids"].clone())
    earlier["canvas_ids"][:, :C] = (earlier["canvas_ids"][:, :C] + 1) % V
    same = obj(model, later, torch.Generator().manual_seed(5))
    diff = obj(model, earlier, torch.Generator().manual_seed(5))
    assert torch.equal(same.diffusion_sum, base.diffusion_sum)
    assert not torch.equal(diff.diffusion_sum, base.diffusion_sum)
    assert int(base.diffusion_count) == 2 * C


def test_decoder_never_writes_the_training_cache(monkeypatch):
    writes = []

    class Spy(KVCache):
        def attend_keys(self, layer, k, v, write, at=None, end=None):
            writes.append((self.cursor, write, k.shape[2]))
            return super().attend_keys(layer, k, v, write, at, end)

    monkeypatch.setattr(objective_mod, "KVCache", Spy)
    model = tiny(self_conditioning=True)
    objective(selfcond_prob=1.0)(model, make_batch(), torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    assert [w[1] for w in writes] == [True] * layers + [False] * (2 * layers)  # encode; 2 decoder passes
    assert all(w[0] == 6 + N * C for w in writes[layers:])  # the decoder reads the full cache, masked
    assert all(w[2] == C for w in writes[layers:])  # and feeds only the chosen canvas


def test_selfcond_first_pass_is_detached_and_per_example(monkeypatch):
    seen = []
    model = tiny(self_conditioning=True)
    real = model.forward

    def spy(*args, **kw):
        if kw.get("selfcond") is not None:
            seen.append(kw["selfcond"])
        return real(*args, **kw)

    monkeypatch.setattr(model, "forward", spy)
    b = make_batch()
    b = {k: v.repeat(8, 1) for k, v in b.items()}
    objective(selfcond_prob=0.5)(model, b, torch.Generator().manual_seed(1))
    (signal,) = seen
    assert not signal.requires_grad
    used = signal.abs().sum((1, 2)) > 0
    assert 0 < int(used.sum()) < 16  # some rows conditioned, the rest get the exact zero signal


def test_ar_loss_pairs_across_the_prompt_padding_gap():
    valid = torch.tensor([[1, 1, 0, 0, 1, 1]]).bool()
    order = compact_valid(valid)
    assert order.tolist() == [[0, 1, 4, 5, 2, 3]]


def test_all_mode_decodes_every_valid_canvas():
    b = make_batch()
    b["canvas_mask"][1, 2] = False
    b["canvas_valid"][1, 2 * C:] = False
    terms = objective(decode="all", ar_loss_weight=0.0)(tiny(), b, torch.Generator().manual_seed(0))
    assert int(terms.diffusion_count) == 2 * N * C - C


@pytest.mark.parametrize("threshold, steps", [(float("inf"), 1), (0.0, 6)])
def test_entropy_stopping_freezes_rows(threshold, steps):
    model = tiny().eval()
    noise = UniformNoise(V, LinearSchedule())
    b = make_batch()
    sampler = CanvasSampler(noise=noise, step=build_step("ddim", noise=noise), num_steps=6, canvas_size=C,
                            max_canvases=1, stop=EntropyStop(threshold), record=True)
    res = sampler(model, b["prompt_ids"], b["prompt_valid"], generator=torch.Generator().manual_seed(0))
    assert [s[0] for s in res.steps_used] == [steps, steps]
    assert res.forward_passes == [1 + steps, 1 + steps]
    assert [len(tr) for tr in res.trajectories] == [steps, steps]
    if steps == 1:  # an early-stopped row emits the argmax canvas of its last prediction
        assert res.tokens[0] == res.trajectories[0][-1]["argmax"]


def test_pinned_hints_are_never_noised_scored_or_resampled():
    b = make_batch()
    hint = torch.full_like(b["canvas_ids"], -1)
    hint[:, ::2] = b["canvas_ids"][:, ::2]  # pin every other token
    b["canvas_hint"] = hint
    obj = objective(decode="all", ar_loss_weight=0.0, loss_on="noised")
    plan = obj.plan(b, torch.Generator().manual_seed(0))
    pinned = hint >= 0
    assert torch.equal(plan.xt[pinned], b["canvas_ids"][pinned])
    assert not plan.target[pinned].any() and plan.target[~pinned].any()
    assert torch.equal(plan.target, (plan.xt != plan.x0) & ~pinned)
    assert plan.diffusion_count == int(plan.target.sum())

    model = tiny().eval()
    noise = UniformNoise(V, LinearSchedule())
    for step in ("ddim", "commit", "confidence"):
        kw = {"schedule": LinearSchedule()} if step == "commit" else {}
        sampler = CanvasSampler(noise=noise, step=build_step(step, noise=noise, **kw), num_steps=4, canvas_size=C,
                                max_canvases=1)
        res = sampler(model, b["prompt_ids"], b["prompt_valid"], generator=torch.Generator().manual_seed(0),
                      hints=hint[:, :C])
        for row in range(2):
            got = torch.tensor(res.tokens[row])
            assert torch.equal(got[::2], hint[row, :C:2]), step


def test_activation_checkpointing_gives_the_same_gradients():
    b = make_batch()
    grads = []
    for ckpt in (False, True):
        model = tiny(self_conditioning=True).train()
        model.set_activation_checkpointing(ckpt)
        terms = objective(selfcond_prob=1.0)(model, b, torch.Generator().manual_seed(0))
        (terms.diffusion_sum / terms.diffusion_count + terms.ar_sum / terms.ar_count).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-12)


def wake_conditioning(model):
    """Random weights on the zero-initialised outputs of self- and time-conditioning, so that
    both change the numbers (at init they are exact no-ops). Returns the model in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_conditioning.mlp.down_proj" in name or "time_embedding.fc2" in name:
                p.normal_(0, 0.3)
    return model.eval()


def cached_and_uncached(model, step: str, **sampler_args) -> dict:
    """``{use_cache: SampleResult}`` of the same seeded 4-step, 3-canvas sampling of make_batch();
    ``"own"``: through the cache, each canvas appended by a forward of its own (``fuse_append=False``)."""
    noise = UniformNoise(V, LinearSchedule())
    b = make_batch()
    out = {}
    for key, use_cache in ((True, True), (False, False), ("own", True)):
        kw = {"schedule": LinearSchedule()} if step == "commit" else {}
        sampler = CanvasSampler(noise=noise, step=build_step(step, noise=noise, **kw), num_steps=4, canvas_size=C,
                                max_canvases=3, use_cache=use_cache, fuse_append=key != "own", **sampler_args)
        out[key] = sampler(model, b["prompt_ids"], b["prompt_valid"], generator=torch.Generator().manual_seed(0))
    return out


@pytest.mark.parametrize("step", ["ddim", "commit"])
def test_cached_sampler_equals_recomputing_the_prefix(step):
    """The same seed through the KV cache (each finished canvas appended within the next canvas's
    first forward, or by a forward of its own) and through single-shot forwards of [prefix |
    canvas] gives the same tokens, canvas after canvas (fp64)."""
    out = cached_and_uncached(wake_conditioning(tiny(self_conditioning=True, time_conditioning=True)), step)
    assert out[True].tokens == out[False].tokens == out["own"].tokens
    assert all(len(t) == 3 * C for t in out[True].tokens)  # no stop ids: three full canvases
    assert out[True].forward_passes == [1 + 3 * 4] * 2  # prefill, 3 x 4 steps (the appends ride on them)
    assert out["own"].forward_passes == [1 + 3 * 4 + 2] * 2  # and 2 re-encodes


def test_ar_only_objective_is_the_plain_next_token_loss():
    """``diffusion_loss_weight=0`` (the AR baselines): no corruption, no decoder pass, no diffusion
    tokens; the loss is the encoder's next-token loss of a causal model."""
    from dgemma.diffusion.losses import ar_loss

    model, b = tiny(), make_batch()
    obj = objective(ar_loss_weight=1.0, diffusion_loss_weight=0.0, selfcond_prob=0.5)
    calls = []
    model.register_forward_hook(lambda m, args, kw, out: calls.append(kw.get("info")), with_kwargs=True)
    plan = obj.plan(b, torch.Generator().manual_seed(0))
    assert plan.diffusion_count == 0 and plan.selfcond_rows is None
    terms = obj.run(model, b, plan)
    assert len(calls) == 1 and not calls[0].noisy.any()  # the encoder only
    assert int(terms.diffusion_count) == 0 and float(terms.diffusion_sum) == 0
    order = compact_valid(torch.cat([b["prompt_valid"], b["canvas_valid"]], 1))
    ids = torch.cat([b["prompt_ids"], b["canvas_ids"]], 1).gather(1, order)
    valid = torch.cat([b["prompt_valid"], b["canvas_valid"]], 1).gather(1, order)
    with torch.no_grad():
        h = model(ids, info=TokenInfo.clean(valid), return_hidden=True)
    _, want, count = ar_loss(h, model.lm_head.weight, ids, valid)
    assert int(terms.ar_count) == int(count)
    torch.testing.assert_close(terms.ar_sum.detach(), want, rtol=1e-12, atol=0)
    loss = terms.objective(0, terms.ar_count, 1.0, 0.0)
    loss.backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="both 0"):
        objective(ar_loss_weight=0.0, diffusion_loss_weight=0.0)



@pytest.mark.parametrize("decode", ["one", "all"])
def test_key_token_weights_scale_their_tokens_in_both_losses(decode):
    """``canvas_weight`` multiplies each scored token's loss, diffusion and AR alike, and the
    counts stay token counts. One-hot weights take the sums apart into per-token losses (fp64):
    they add up to the unweighted sums, and the weighted sums are their weighted totals."""
    model, b = tiny(), make_batch()
    obj = objective(decode=decode, ar_loss_weight=1.0, ar_loss_on="response")
    run = lambda w: obj(model, b if w is None else {**b, "canvas_weight": w},  # noqa: E731
                        torch.Generator().manual_seed(2))
    plain = run(None)
    w = torch.ones(2, N * C, dtype=torch.float64)
    w[:, 1], w[1, 6] = 7.0, 3.0  # key tokens, as PubMedQA's verdict
    weighted = run(w)
    assert weighted.diffusion_count == plain.diffusion_count and weighted.ar_count == plain.ar_count
    d_parts, a_parts = torch.zeros(2, N * C, dtype=torch.float64), torch.zeros(2, N * C, dtype=torch.float64)
    for row in range(2):
        for k in range(N * C):
            one = torch.zeros_like(w)
            one[row, k] = 1.0
            t = run(one)
            d_parts[row, k], a_parts[row, k] = t.diffusion_sum, t.ar_sum
    assert (d_parts > 0).any() and (a_parts > 0).all()
    for parts, total, got in ((d_parts, plain.diffusion_sum, weighted.diffusion_sum),
                              (a_parts, plain.ar_sum, weighted.ar_sum)):
        torch.testing.assert_close(parts.sum(), total, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close((parts * w).sum(), got, rtol=1e-10, atol=1e-10)


def test_block_noise_draws_the_states_a_block_sampler_visits():
    """``block_noise_prob=1``: in every decoded canvas the blocks before one are clean, the blocks
    after it fully masked, and every block holding an answer token is drawn; off, the draws are
    exactly the i.i.d. ones."""
    c, blk, n, b, mask = 8, 2, 2, 4, 1
    g = torch.Generator().manual_seed(5)
    batch = {"prompt_ids": torch.randint(2, V, (b, 3), generator=g), "prompt_valid": torch.ones(b, 3, dtype=torch.bool),
             "canvas_ids": torch.randint(2, V, (b, n * c), generator=g),
             "canvas_valid": torch.ones(b, n * c, dtype=torch.bool), "canvas_mask": torch.ones(b, n, dtype=torch.bool)}
    batch["canvas_valid"][0, c + 3:] = False  # row 0's answer ends inside its second canvas's second block
    hint = torch.full_like(batch["canvas_ids"], -1)
    hint[1, 6] = batch["canvas_ids"][1, 6]  # one pinned token, in the last block of row 1's first canvas
    batch["canvas_hint"] = hint
    noise = AbsorbingNoise(mask, LinearSchedule())

    def obj(p):
        return DiffusionObjective(noise=noise, canvas_size=c, selfcond_prob=0.0, ar_loss_weight=0.0, decode="all",
                                  loss_on="noised", block_noise_prob=p, block_noise_size=blk)

    seen = set()
    for seed in range(60):
        plan = obj(1.0).plan(batch, torch.Generator().manual_seed(seed))
        free = batch["canvas_valid"] & (hint < 0)
        assert torch.equal(plan.xt[~free], plan.x0[~free])  # pinned and invalid positions stay clean
        assert torch.equal(plan.target, (plan.xt != plan.x0))
        masked = (plan.xt == mask).view(b, n, c // blk, blk)
        for row in range(b):
            for k in range(n):
                blocks = masked[row, k]
                fb = free.view(b, n, c // blk, blk)[row, k].any(-1)
                touched = [j for j in range(c // blk) if blocks[j].any()]
                cur = touched[0] if touched else None
                if cur is None:
                    continue  # the current block drew no mask at this t and nothing comes after it
                assert not blocks[:cur].any()  # done: clean
                later = free.view(b, n, c // blk, blk)[row, k, cur + 1:]
                assert torch.equal(blocks[cur + 1:], later)  # ahead: every free position masked
                assert fb[cur]
                seen.add((row, k, cur))
    assert {(0, 1, j) for j in range(c // blk)} & seen == {(0, 1, 0), (0, 1, 1)}  # never an empty block
    assert {(2, 0, j) for j in range(c // blk)} <= seen  # each block of a full canvas is drawn

    g0, g1 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    off, base = obj(0.0).plan(batch, g0), DiffusionObjective(
        noise=noise, canvas_size=c, selfcond_prob=0.0, ar_loss_weight=0.0, decode="all", loss_on="noised").plan(batch, g1)
    assert torch.equal(off.xt, base.xt) and torch.equal(g0.get_state(), g1.get_state())


def test_block_noise_settings_are_checked():
    from dgemma.training.config import DiffusionConfig
    with pytest.raises(ValueError, match="block_noise_size"):
        DiffusionConfig(canvas_size=32, block_noise_prob=0.5, block_noise_size=5)
    with pytest.raises(ValueError, match="block_noise_prob"):
        DiffusionConfig(block_noise_prob=1.5)
    with pytest.raises(ValueError, match="block_noise_size"):
        objective(block_noise_prob=0.5, block_noise_size=3)


def test_certainty_weight_adds_the_entropy_of_right_predictions(monkeypatch):
    """``certainty_weight`` leaves the diffusion sum as it was and adds the full-logits reference's
    certainty sum (the entropy of the scored tokens whose argmax is the target), weighted in the
    objective; off, no certainty term is computed."""
    from dgemma.diffusion import losses
    from dgemma.diffusion.objective import LossTerms

    model, b = tiny(), make_batch()
    with torch.no_grad():  # layers add nothing: the tied head reads each visible (scored) token back
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    seen = {}

    def spy(h, w, x, m, **kw):
        seen["ref"] = losses.full_certainty_cross_entropy(h.detach(), w.detach(), x, m, **kw)
        return losses.chunked_certainty_cross_entropy(h, w, x, m, **kw)

    monkeypatch.setattr(objective_mod, "chunked_certainty_cross_entropy", spy)
    run = lambda **kw: objective(noise=AbsorbingNoise(0, LinearSchedule()), **kw)(  # noqa: E731
        model, b, torch.Generator().manual_seed(2))
    plain, cert = run(), run(certainty_weight=0.5)
    assert plain.certainty_sum is None
    assert cert.certainty_sum > 0
    torch.testing.assert_close(cert.diffusion_sum, plain.diffusion_sum, rtol=0, atol=0)
    torch.testing.assert_close(cert.certainty_sum, seen["ref"][2], rtol=1e-12, atol=1e-12)
    terms = LossTerms(cert.diffusion_sum, cert.diffusion_count, cert.ar_sum, cert.ar_count, cert.certainty_sum)
    norm = float(cert.diffusion_count)
    want = cert.diffusion_sum / norm + cert.ar_sum / 3.0 + 0.5 * cert.certainty_sum / norm
    torch.testing.assert_close(terms.objective(norm, 3.0, 1.0, 1.0, 0.5), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="certainty_weight"):
        objective(certainty_weight=-1.0)
