"""The shortcuts that make training and sampling cheaper change no result they claim to keep.

- AR loss on the response only == the full-logits next-token loss over response targets (fp64);
- trimmed prompt padding == the padded batch (fp64 losses, every term);
- the KV cache's scratch decoder pass == a cache that concatenates (fp64);
- committed positions skip the LM head: the sampler's logits and self-conditioning signal equal
  those computed from full logits with committed rows replaced by their one-hot, and a greedy
  step and that signal share one softmax;
- bf16 is chosen from the CPU's flags, never assumed.
"""

import pytest
import torch
import torch.nn.functional as F

from dgemma.data.sft import trim_prompt_padding
from dgemma.device import bf16_native, cpu_bf16_features, resolve_dtype
from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.objective import DiffusionObjective
from dgemma.diffusion.sampler import CanvasSampler, selfcond_signal, vocab_logits
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import CommitStep, open_softmax, remember_open_rows
from dgemma.diffusion.wrappers import emitted_canvases
from dgemma.errors import DGemmaError
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.selfcond import probs_embedding
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V, C, N = 40, 4, 2


def tiny(**kw):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).double()


def batch(width=8):
    g = torch.Generator().manual_seed(3)
    lens = [5, 3]
    pvalid = torch.tensor([[i < n for i in range(width)] for n in lens])
    cvalid = torch.ones(2, N * C, dtype=torch.bool)
    cvalid[1, C + 2:] = False
    return {"prompt_ids": torch.randint(2, V, (2, width), generator=g) * pvalid, "prompt_valid": pvalid,
            "canvas_ids": torch.randint(2, V, (2, N * C), generator=g), "canvas_valid": cvalid,
            "canvas_mask": torch.tensor([[True, True], [True, True]])}


def test_ar_loss_on_response_is_the_next_token_loss_of_the_response():
    model, b = tiny(), batch()
    obj = DiffusionObjective(noise=UniformNoise(V, LinearSchedule()), canvas_size=C, selfcond_prob=0.0,
                             ar_loss_on="response")
    terms = obj(model, b, torch.Generator().manual_seed(1))
    # reference: each row's valid tokens in order, the full logits, CE of every response token
    want_sum, want_n = torch.zeros((), dtype=torch.float64), 0
    for r in range(2):
        p = b["prompt_ids"][r][b["prompt_valid"][r]]
        resp = b["canvas_ids"][r][b["canvas_valid"][r]]
        ids = torch.cat([p, resp])[None]
        with torch.no_grad():
            logits = model(ids)[0]
        pred = logits[len(p) - 1: len(p) - 1 + len(resp)]
        want_sum += F.cross_entropy(pred, resp, reduction="sum")
        want_n += len(resp)
    assert int(terms.ar_count) == want_n == obj._ar_count(b)
    torch.testing.assert_close(terms.ar_sum.detach(), want_sum, rtol=1e-12, atol=0)
    full = DiffusionObjective(noise=UniformNoise(V, LinearSchedule()), canvas_size=C, selfcond_prob=0.0)
    assert int(full(model, b, torch.Generator().manual_seed(1)).ar_count) > want_n  # the prompt counts there


def test_trimmed_prompt_padding_changes_no_loss():
    model = tiny(self_conditioning=True)
    obj = DiffusionObjective(noise=UniformNoise(V, LinearSchedule()), canvas_size=C, selfcond_prob=0.5)
    padded = batch(width=12)
    (trimmed,) = trim_prompt_padding([padded])
    assert trimmed["prompt_ids"].shape[1] == 5
    a = obj(model, padded, torch.Generator().manual_seed(2))
    b = obj(model, trimmed, torch.Generator().manual_seed(2))
    for x, y in ((a.diffusion_sum, b.diffusion_sum), (a.ar_sum, b.ar_sum)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert (a.diffusion_count, a.ar_count) == (b.diffusion_count, b.ar_count)


def test_trim_uses_one_width_for_every_micro_batch():
    b1, b2 = batch(width=12), batch(width=12)
    b2["prompt_valid"][0, :9] = True
    out = trim_prompt_padding([b1, b2])
    assert [o["prompt_ids"].shape[1] for o in out] == [9, 9]


def test_scratch_decoder_pass_equals_concatenation(monkeypatch):
    model = tiny()
    prompt = torch.randint(2, V, (2, 6))
    noisy = torch.randint(2, V, (2, C))
    ones = torch.ones(2, C, dtype=torch.bool)
    info = TokenInfo(6 + torch.arange(C).expand(2, C), torch.ones(2, C, dtype=torch.long), ones, ones)
    with torch.no_grad():
        cache = KVCache(2, 6 + C)
        model(prompt, cache=cache)
        scratch = model(noisy, info=info, cache=cache)
        tight = KVCache(2, 6)  # no free slot: the concatenating path
        model(prompt, cache=tight)
        concat = model(noisy, info=info, cache=tight)
    torch.testing.assert_close(scratch, concat, rtol=0, atol=0)


def test_committed_positions_skip_the_lm_head_exactly():
    model = tiny(self_conditioning=True)
    hidden = torch.randn(2, C, 32, dtype=torch.float64)
    tokens = torch.randint(2, V, (2, C))
    open_ = torch.tensor([[True, False, True, False], [False, False, True, True]])
    with torch.no_grad():
        got = vocab_logits(model, hidden, tokens, open_, forbid=3, adjust=lambda z: z * 2.0)
        full = model.logits(hidden)
    full[..., 3] = float("-inf")  # forbid, then adjust, on the open rows; committed rows stay one-hots
    ref = torch.full_like(full, torch.finfo(full.dtype).min)
    ref[open_] = full[open_] * 2.0
    closed = ~open_
    ref[closed] = ref[closed].scatter(-1, tokens[closed][:, None], 0.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    embed = model.model.embed_tokens.weight
    for temp in (0.7, 1.0):  # 1.0 (greedy conditioning) reuses the prediction's softmax
        torch.testing.assert_close(selfcond_signal(got, temp, embed, tokens, open_), probs_embedding(ref / temp, embed),
                                   rtol=1e-12, atol=1e-12)


def test_the_open_softmax_is_computed_once_per_logits_and_recomputed_when_they_change():
    """A greedy step and the self-conditioning signal share one softmax of the open rows; a
    changed tensor (in place), another mask or another tensor gets its own."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, C, V, generator=g, dtype=torch.float64)
    open_ = torch.tensor([[True, False, True, True], [False, True, True, False]])
    first = open_softmax(logits, open_)
    assert open_softmax(logits, open_.clone()) is first  # equal mask values: the same result
    want = F.softmax(logits[open_], -1)
    torch.testing.assert_close(first.probs, want, rtol=0, atol=0)
    assert torch.equal(first.conf, want.max(-1).values) and torch.equal(first.pred, want.argmax(-1))
    whole = open_softmax(logits, None)
    assert whole.probs.shape == (2 * C, V) and open_softmax(logits, torch.ones_like(open_)) is whole
    torch.testing.assert_close(open_softmax(logits, open_).probs, want, rtol=0, atol=0)  # recomputed
    logits[0, 0] += 1.0  # in place: the version moves on
    torch.testing.assert_close(open_softmax(logits, open_).probs, F.softmax(logits[open_], -1), rtol=0, atol=0)
    other = logits.clone()
    assert open_softmax(other, open_) is not open_softmax(logits, open_)


@pytest.mark.parametrize("n", [3, 16, 37])
def test_the_bf16_open_softmax_in_chunks_equals_one_fp32_softmax(n):
    """bf16 logits: fp32 a chunk of rows at a time, stored in bf16; the same bits as one fp32
    softmax of every row cast to bf16, and the same fp32 max and argmax; rows handed over by
    ``remember_open_rows`` are used as ``logits[open_]``."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(n, 2, 500, generator=g) * 4).to(torch.bfloat16)
    open_ = torch.rand(n, 2, generator=g) < 0.7
    open_[0, 0] = True
    ref = F.softmax(logits[open_].float(), -1)
    got = open_softmax(logits, open_)
    assert got.probs.dtype == torch.bfloat16 and torch.equal(got.probs, ref.to(torch.bfloat16))
    assert torch.equal(got.conf, ref.max(-1).values) and torch.equal(got.pred, ref.max(-1).indices)
    fresh = logits.clone()
    remember_open_rows(fresh, open_, logits[open_])
    assert torch.equal(open_softmax(fresh, open_).probs, got.probs)
    remember_open_rows(fresh, open_, torch.zeros_like(logits[open_]))  # taken as given, not gathered again
    assert bool((open_softmax(fresh, open_).probs == torch.tensor(1 / 500).to(torch.bfloat16)).all())


def test_small_self_conditioning_products_are_padded_on_amx_only(monkeypatch):
    """``embed_probs`` pads fewer than 16 rows with zeros where that was measured to pay (bf16 on an
    AMX CPU); a padded row is the same sum, so it matches the fp64 product to bf16 rounding, and
    every row count below 16 gives each row the same bits."""
    import dgemma.models.selfcond as sc

    g = torch.Generator().manual_seed(4)
    embed = torch.randn(300, 24, generator=g).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(5, 300, generator=g) * 3, -1)
    for amx in (False, True):
        monkeypatch.setattr(sc, "cpu_bf16_features", lambda: ("amx_bf16",) if amx else ())
        got = sc.embed_probs(probs, embed)
        assert got.dtype == torch.bfloat16 and got.shape == (5, 24)
        torch.testing.assert_close(got.double(), probs.to(torch.bfloat16).double() @ embed.double(),
                                   rtol=2e-2, atol=2e-3)
        if amx:
            assert torch.equal(sc.embed_probs(probs[:2], embed), got[:2])
        else:
            assert torch.equal(got, probs.to(torch.bfloat16) @ embed)
    wide = torch.randn(3, C, 300, generator=g, dtype=torch.float64)
    assert torch.equal(sc.embed_probs(wide, embed.double()), wide @ embed.double())  # fp64: never padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_prediction_on_open_positions_equals_the_full_softmax(dtype):
    """A greedy step runs its softmax on the open positions only; with committed rows written as
    one-hots (as the sampler writes them) it returns the full softmax's argmax and probability, bit for bit."""
    from dgemma.diffusion.steps import CanvasState, predict

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, V, (2, C), generator=g)
    committed = torch.tensor([[True, False, True, False], [False, False, False, True]])
    logits = (torch.randn(2, C, V, generator=g) * 3).to(dtype)
    logits[committed] = torch.full_like(logits[committed], torch.finfo(dtype).min).scatter(
        -1, tokens[committed][:, None], 0.0)
    state = CanvasState(tokens=tokens, committed=committed)
    pred, conf = predict(logits, 0.0, g, state)
    want_pred, want_conf = predict(logits, 0.0, g)
    assert torch.equal(pred, want_pred) and torch.equal(conf, want_conf) and conf.dtype == torch.float32
    assert torch.equal(pred[committed], tokens[committed]) and bool((conf[committed] == 1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_on_open_positions_equals_the_full_entropy(dtype):
    """The stopping entropy skips one-hot rows, whose entropy is exactly 0: same means, bit for bit."""
    from dgemma.diffusion.stopping import mean_entropy

    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(2, V, (3, C), generator=g)
    committed = torch.tensor([[True, False, True, False], [False] * C, [True] * C])
    logits = (torch.randn(3, C, V, generator=g) * 2).to(dtype)
    logits[committed] = torch.full_like(logits[committed], torch.finfo(dtype).min).scatter(
        -1, tokens[committed][:, None], 0.0)
    valid = torch.tensor([[True, True, True, False], [True] * C, [True] * C])
    for T in (0.0, 0.7):
        for v in (None, valid):
            assert torch.equal(mean_entropy(logits, T, v, ~committed), mean_entropy(logits, T, v))


def test_commit_sampler_with_vocabulary_skipping_equals_its_definition(monkeypatch):
    """The fast sampler emits the tokens of one that runs the LM head on every position and then
    overwrites the committed rows with their one-hot (the definition), self-conditioned, fp64."""
    import dgemma.diffusion.sampler as sampler_mod

    model = tiny(self_conditioning=True)
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    prompt = torch.randint(2, V, (2, 5))
    valid = torch.ones(2, 5, dtype=torch.bool)

    def sample():
        # a logit bias and a stop gate, so the vocabulary rules have work to do on every row
        s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0), num_steps=3, canvas_size=C,
                          max_canvases=2, record=True, stop_ids=(7,), min_stop_prob=0.3, logit_bias={9: 2.0})
        return s(model, prompt, valid, generator=torch.Generator().manual_seed(0))

    calls = []
    real = sampler_mod.vocab_logits

    def counting(model_, hidden, tokens, open_, *, forbid=None, adjust=None, **kw):
        calls.append(None if open_ is None else int(open_.sum()))
        return real(model_, hidden, tokens, open_, forbid=forbid, adjust=adjust, **kw)

    monkeypatch.setattr(sampler_mod, "vocab_logits", counting)
    fast = sample()
    assert any(n is not None and n < 2 * C for n in calls)  # some step really skipped rows

    def definition(model_, hidden, tokens, open_, *, forbid=None, adjust=None, **kw):
        full = model_.logits(hidden)
        if open_ is not None:
            closed = ~open_
            rows = torch.full_like(full[closed], torch.finfo(full.dtype).min)
            full[closed] = rows.scatter(-1, tokens[closed][:, None], 0.0)
        if forbid is not None:
            full[..., forbid] = float("-inf")
        return full if adjust is None else adjust(full)  # the rules on every row, one-hots included

    monkeypatch.setattr(sampler_mod, "vocab_logits", definition)
    slow = sample()
    assert fast.tokens == slow.tokens and fast.steps_used == slow.steps_used
    assert [[s["argmax"] for s in t] for t in fast.trajectories] == [[s["argmax"] for s in t] for t in slow.trajectories]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_equal_fresh_ones_at_every_pass(dtype):
    """CanvasLogits rewrites only the rows that change; at every pass of a random sequence (rows
    opening, closing, re-noised, the batch shrinking, a whole pass) it equals the tensor built
    afresh: LM-head rows where open, the token's one-hot elsewhere."""
    from dgemma.diffusion.sampler import CanvasLogits

    g = torch.Generator().manual_seed(0)
    kept, b = CanvasLogits(), 3
    tokens = torch.randint(0, V, (b, C), generator=g)
    for i in range(12):
        if i == 6:  # a row finishes: the batch shrinks
            keep = torch.tensor([True, False, True])
            kept.select(keep)
            tokens, b = tokens[keep], 2
        open_ = torch.ones(b, C, dtype=torch.bool) if i == 3 else torch.rand(b, C, generator=g) < 0.5
        redraw = torch.rand(b, C, generator=g) < 0.3
        tokens = torch.where(redraw, torch.randint(0, V, (b, C), generator=g), tokens)
        z = torch.randn(int(open_.sum()), V, generator=g).to(dtype)
        got = kept.adopt(z.view(b, C, V)) if bool(open_.all()) else kept.write(z, tokens, open_)
        fresh = torch.full((b, C, V), torch.finfo(dtype).min, dtype=dtype)
        fresh[open_] = z
        closed = (~open_).nonzero(as_tuple=True)
        fresh[(*closed, tokens[closed])] = 0.0
        assert torch.equal(got, fresh), i


def test_without_self_conditioning_the_signal_is_zero():
    """``self_condition=False`` decodes as if the model had no self-conditioning block (its zero
    signal is an exact no-op for the zero-init variant); with it on, the signal changes tokens."""
    import copy

    from tests.diffusion.test_objective import wake_conditioning

    model = wake_conditioning(tiny(self_conditioning=True))
    bare = copy.deepcopy(model)
    bare.self_conditioning = None
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    prompt = torch.randint(2, V, (4, 5), generator=torch.Generator().manual_seed(2))
    valid = torch.ones(4, 5, dtype=torch.bool)

    def run(m, on):
        s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0, block=4), num_steps=4,
                          canvas_size=12, max_canvases=2, self_condition=on)
        return s(m, prompt, valid, generator=torch.Generator().manual_seed(0)).tokens

    off = run(model, False)
    assert off == run(bare, True)
    assert off != run(model, True)


class _ReadsAll(CommitStep):
    def reads(self, state, s, s_next, *, is_last):
        return None


def absorbing_rows(width: int, seed: int):
    """``(model, noise, prompt, valid, hints)``: the self-conditioned tiny model, absorbing noise,
    8 random prompts of 5 tokens and free hints (``-1``) for two canvases of ``width``."""
    model = tiny(self_conditioning=True)
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    prompt = torch.randint(2, V, (8, 5), generator=torch.Generator().manual_seed(seed))
    return model, noise, prompt, torch.ones(8, 5, dtype=torch.bool), torch.full((8, 2 * width), -1)


@pytest.mark.parametrize("steps", [4, 6])  # 3 or 2 commits a step in blocks of 4
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("rule", ["commit", "commit_no_stable", "commit_margin", "commit_no_repeat", "confidence"])
def test_lm_head_where_the_step_reads_equals_everywhere(monkeypatch, rule, temperature, steps):
    """Without self-conditioning, the LM head runs on the positions the step reads (Step.reads)
    only; the tokens and passes equal those of a sampler that runs it on every open position (fp64;
    commits in blocks, the stable-first key reading the last step's prediction, EOS fill, pins)."""
    import dgemma.diffusion.sampler as sampler_mod
    from dgemma.diffusion.steps import ConfidenceStep

    width = 12
    model, noise, prompt, valid, hints = absorbing_rows(width, seed=1)
    hints[1, 5] = 9  # a pinned token in the middle of row 1's first canvas
    hints[2, 8] = 7  # a pinned stop token: EOS fill after it

    def step(narrow: bool):
        if rule == "confidence":
            s = ConfidenceStep(noise, threshold=0.2, temperature=temperature, block=4)
            if not narrow:
                s.reads = lambda *a, **k: None
            return s
        kw = {"stable_first": rule != "commit_no_stable",
              "order": "margin" if rule == "commit_margin" else "confidence", "no_repeat": rule == "commit_no_repeat"}
        return (CommitStep if narrow else _ReadsAll)(noise, temperature=temperature, block=4, **kw)

    calls = []
    real = sampler_mod.vocab_logits

    def counting(model_, hidden, tokens, open_, **kw):
        calls.append((hidden.shape[0] * hidden.shape[1], None if open_ is None else int(open_.sum())))
        return real(model_, hidden, tokens, open_, **kw)

    monkeypatch.setattr(sampler_mod, "vocab_logits", counting)
    out, seen = {}, {True: [], False: []}

    def hook(narrow):  # what a streaming front-end reads: the canvases each step emits
        def on_step(*, canvas, step, rows, tokens, committed, argmax, done, **_):
            assert (argmax is None) == narrow  # no argmax over stale logits when the hook reads no guesses
            emitted = emitted_canvases(tokens, committed, argmax, last=step == steps - 1)
            seen[narrow].append((canvas, step, rows, done.tolist(), emitted[done].tolist()))
        return on_step

    for narrow in (True, False):
        calls.clear()
        # the narrow run has a hook that reads no guesses: the LM head still runs where the step reads
        s = CanvasSampler(noise=noise, step=step(narrow), num_steps=steps, canvas_size=width, max_canvases=2,
                          stop_ids=(7,), self_condition=False, on_step=hook(narrow), hook_reads_guesses=not narrow)
        out[narrow] = (s(model, prompt, valid, generator=torch.Generator().manual_seed(0), hints=hints), list(calls))
    fast, slow = out[True][0], out[False][0]
    assert fast.tokens == slow.tokens and fast.forward_passes == slow.forward_passes
    assert fast.steps_used == slow.steps_used
    assert seen[True] == seen[False]  # the hook saw the same rows end with the same canvases
    assert sum(n for _, n in out[True][1]) < sum(n for _, n in out[False][1])  # fewer rows through the head
    assert 7 in fast.tokens[2] and len(fast.tokens[2]) <= 9  # cut at the pinned stop token


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_no_repeat_leaves_no_free_position_equal_to_a_neighbour(temperature):
    """The sampler with ``CommitStep(no_repeat=True)``: inside each canvas, up to the first stop
    token, no two neighbours hold the same token unless both were pinned (commits in blocks at two
    steps a canvas, so a position can commit after its right neighbour); without the rule the same
    model and seed write such repeats."""
    width = 8
    model, noise, prompt, valid, hints = absorbing_rows(width, seed=2)
    hints[0, 3] = 9

    def repeats(no_repeat: bool) -> int:
        s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=temperature, block=4, no_repeat=no_repeat),
                          num_steps=2, canvas_size=width, max_canvases=2, stop_ids=(7,))
        out = s(model, prompt, valid, generator=torch.Generator().manual_seed(0), hints=hints)
        n = 0
        for r, toks in enumerate(out.tokens):
            for i in range(1, len(toks)):
                if i % width and toks[i] == toks[i - 1] and min(int(hints[r, i]), int(hints[r, i - 1])) < 0:
                    n += 1
        return n

    assert repeats(True) == 0
    assert repeats(False) > 0


def test_commit_reads_literal_example():
    """The docstring's example: ``C = 8, B = 4``, nothing committed, 2 due now and 2 next -> 0-3;
    without the stable-first key only this step's blocks; the last step reads everything."""
    from dgemma.diffusion.steps import CanvasState

    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    state = CanvasState(tokens=torch.ones(1, 8, dtype=torch.long), committed=torch.zeros(1, 8, dtype=torch.bool))
    step = CommitStep(noise, block=4)
    assert step.reads(state, 0.75, 0.5, is_last=False).tolist() == [[True] * 4 + [False] * 4]
    assert step.reads(state, 0.75, 0.25, is_last=False).tolist() == [[True] * 8]  # 2 + 4 due: both blocks
    assert step.reads(state, 0.75, 0.5, is_last=True) is None
    assert CommitStep(noise).reads(state, 0.75, 0.5, is_last=False) is None  # no blocks: everything
    assert CommitStep(noise, block=2, stable_first=False).reads(state, 0.75, 0.5, is_last=False).tolist() == \
        [[True] * 2 + [False] * 6]


def test_commit_sampler_stops_once_every_position_is_committed():
    from dgemma.diffusion.steps import ConfidenceStep

    model = tiny()
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    s = CanvasSampler(noise=noise, step=ConfidenceStep(noise, threshold=0.0), num_steps=16, canvas_size=C,
                      max_canvases=1)
    res = s(model, torch.randint(2, V, (1, 5)), torch.ones(1, 5, dtype=torch.bool),
            generator=torch.Generator().manual_seed(0))
    assert res.steps_used == [[1]]  # threshold 0: every position commits at the first step


def test_bf16_is_read_from_the_cpu_flags(monkeypatch):
    import dgemma.device as device

    device.cpu_bf16_features.cache_clear()
    monkeypatch.setattr(device.platform, "system", lambda: "Linux")
    monkeypatch.setattr(device, "linux_cpu_flags", lambda: {"avx512f", "avx2"})
    assert cpu_bf16_features() == () and not bf16_native("cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    device.cpu_bf16_features.cache_clear()
    monkeypatch.setattr(device, "linux_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert cpu_bf16_features() == ("avx512_bf16",) and resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32 and resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(DGemmaError, match="dtype must be one of"):
        resolve_dtype("fp16", "cpu")
    device.cpu_bf16_features.cache_clear()


def test_fill_after_stop_literal_example():
    from dgemma.diffusion.sampler import fill_after_stop
    from dgemma.diffusion.steps import CanvasState

    state = CanvasState(tokens=torch.tensor([[7, 1, 5, 3], [7, 5, 1, 3]]),
                        committed=torch.tensor([[True, True, False, False], [True, False, False, True]]))
    out = fill_after_stop(state, (1, 6))
    assert out.tokens.tolist() == [[7, 1, 1, 1], [7, 5, 1, 3]]  # row 2's stop token is not committed yet
    assert out.committed.tolist() == [[True, True, True, True], [True, False, False, True]]
    assert out.pinned.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert fill_after_stop(out, (1, 6)) is out  # nothing new: the same state


def test_sampler_fills_after_a_committed_stop_and_paces_the_rest():
    """A model biased towards EOS commits one at the first step: every position after it is
    filled with EOS and committed in that same step, and the answer ends at it."""
    model = tiny()
    with torch.no_grad():  # bias the tied LM head towards token 1 (EOS)
        model.model.embed_tokens.weight[1] += 50 * model.model.norm.weight.new_ones(32) / 32 ** 0.5
    noise = AbsorbingNoise(mask_token_id=3, schedule=LinearSchedule())
    s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0), num_steps=4, canvas_size=C,
                      max_canvases=1, stop_ids=(1,), record=True)
    res = s(model, torch.randint(4, V, (1, 5)), torch.ones(1, 5, dtype=torch.bool),
            generator=torch.Generator().manual_seed(0))
    first = res.trajectories[0][0]
    k = first["tokens"].index(1) if 1 in first["tokens"] else None
    assert k is not None and first["committed"][k]
    assert all(t == 1 and c for t, c in zip(first["tokens"][k + 1:], first["committed"][k + 1:]))
    assert res.tokens[0][-1] == 1 and len(res.tokens[0]) <= C


def test_commit_blocks_literal_example_and_left_to_right_order():
    from dgemma.diffusion.steps import CanvasState, _leftmost_blocks

    open_ = torch.tensor([[False, False, True, True, True, True, True, True]])
    assert _leftmost_blocks(open_, torch.tensor([3]), 4).tolist() == [[True] * 8]
    assert _leftmost_blocks(open_, torch.tensor([2]), 4).tolist() == [[True] * 4 + [False] * 4]
    # confidences rise to the right: without blocks the right end commits first, with blocks the left
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    logits = torch.zeros(1, 8, V, dtype=torch.float64)
    logits[0, torch.arange(8), 5] = torch.arange(8, dtype=torch.float64)
    state = CanvasState(tokens=torch.ones(1, 8, dtype=torch.long), committed=torch.zeros(1, 8, dtype=torch.bool))
    g = torch.Generator().manual_seed(0)
    plain = CommitStep(noise)(state, logits, 1.0, 0.75, generator=g, is_last=False)
    blocked = CommitStep(noise, block=4)(state, logits, 1.0, 0.75, generator=g, is_last=False)
    assert plain.committed.tolist() == [[False] * 6 + [True] * 2]
    assert blocked.committed.tolist() == [[False, False, True, True] + [False] * 4]
    with pytest.raises(DGemmaError, match="commit block must be >= 1"):
        CommitStep(noise, block=0)


def test_gate_stop_tokens_literal_example():
    from dgemma.diffusion.sampler import gate_stop_tokens

    probs = torch.tensor([[[0.30, 0.28, 0.22, 0.20], [0.80, 0.10, 0.05, 0.05]]])  # token 0 is the stop token
    assert probs.log().argmax(-1).tolist() == [[0, 0]]
    out = gate_stop_tokens(probs.log(), (0,), 0.5)
    assert out.argmax(-1).tolist() == [[1, 0]]  # 0.3 < 0.5: the best other token; 0.8: the stop stays
    assert torch.isinf(out[0, 0, 0]) and torch.equal(out[0, 1], probs.log()[0, 1])
    assert torch.equal(gate_stop_tokens(probs.log(), (0,), 0.2), probs.log())  # every stop above the bar


def test_ar_rows_that_stop_leave_the_batch_without_changing_the_others():
    """``ar_generate`` drops finished rows from the batch and the cache (``KVCache.select``): each
    row's tokens and forward count equal decoding it alone (fp64, greedy, a stop token that some
    rows emit early)."""
    from dgemma.diffusion.sampler import ar_generate

    model = tiny()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, V, (4, 6), generator=g)
    valid = torch.ones_like(ids, dtype=torch.bool)
    free = ar_generate(model, ids, valid, max_new_tokens=10).tokens
    r0, k = next((r, k) for r in range(4) for k in range(1, 10) if free[r][k] not in free[r][:k])
    stop = free[r0][k]  # row r0 stops at token k + 1; the others when (if) they emit it
    both = ar_generate(model, ids, valid, max_new_tokens=10, stop_ids=(stop,))
    assert both.tokens[r0] == free[r0][:k + 1]
    assert len({len(t) for t in both.tokens}) > 1  # rows did leave at different steps
    for r in range(4):
        alone = ar_generate(model, ids[r:r + 1], valid[r:r + 1], max_new_tokens=10, stop_ids=(stop,))
        assert both.tokens[r] == alone.tokens[0] and both.forward_passes[r] == alone.forward_passes[0]



@pytest.mark.parametrize("use_cache", [True, False])
def test_a_step_that_changed_no_token_reuses_the_last_forward(use_cache):
    """With absorbing noise and more steps than positions, the commit pace has steps with nothing
    due: the canvas stays as it was, so the next forward would repeat the last one. The sampler
    reuses its logits (``reuse_logits``): the same tokens, bit for bit, as recomputing every step
    (fp64, greedy, two rows that settle at different steps); alone, a row takes one forward per
    distinct canvas its steps start from, plus its prefill."""
    model = tiny()
    noise = AbsorbingNoise(V - 1, LinearSchedule())
    b = batch()
    hints = torch.full((2, N * C), -1)
    hints[0, 1] = 7  # row 0 has one position pinned: it settles before row 1

    def run(rows, reuse):
        sampler = CanvasSampler(noise=noise, step=CommitStep(noise), num_steps=3 * C, canvas_size=C, max_canvases=N,
                                use_cache=use_cache, reuse_logits=reuse, temperature=0.0, record=True)
        return sampler(model, b["prompt_ids"][rows], b["prompt_valid"][rows], hints=hints[rows],
                       generator=torch.Generator().manual_seed(0))

    both, ref = run(slice(0, 2), True), run(slice(0, 2), False)
    assert both.tokens == ref.tokens
    assert sum(both.forward_passes) < sum(ref.forward_passes)
    for r in range(2):
        # no encoder pass of its own: each append rides on the next canvas's first forward
        assert ref.forward_passes[r] == 1 + sum(ref.steps_used[r])
        alone = run(slice(r, r + 1), True)
        assert alone.tokens[0] == both.tokens[r]
        steps = alone.trajectories[0]
        inputs = 0
        for j, st in enumerate(steps):  # step j's input is step j - 1's output within a canvas
            inputs += st["step"] == 0 or (st["step"] >= 2 and steps[j - 1]["tokens"] != steps[j - 2]["tokens"]) or \
                (st["step"] == 1 and steps[j - 1]["committed"] != [bool(h >= 0) for h in
                                                                     hints[r, st["canvas"] * C:(st["canvas"] + 1) * C]])
        assert alone.forward_passes[0] == 1 + inputs < ref.forward_passes[r]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_argmax_ids_equals_argmax(dtype):
    """``argmax_ids`` (``max(-1).indices``, the faster kernel) gives ``argmax(-1)``'s indices:
    vocabulary-wide rows, a batch of canvases, tied maxima (the first wins), -inf, a row of NaN."""
    from dgemma.diffusion.stopping import argmax_ids

    g = torch.Generator().manual_seed(0)
    for shape in [(1, 262_144), (3, 5, 70_001)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        assert torch.equal(argmax_ids(x), x.argmax(-1))
    x = torch.randn(6, 70_001, generator=g).to(dtype).clamp(max=3.0)
    x[0, [5, 9, 70_000]] = 4.0  # ties: the first index, as argmax
    x[1] = 0.5  # every entry tied
    x[2, :100] = float("-inf")
    x[3] = float("-inf")
    x[4, 17] = float("nan")  # NaN is the max, as in argmax
    assert argmax_ids(x)[:2].tolist() == [5, 0] and argmax_ids(x)[4] == 17
    assert torch.equal(argmax_ids(x), x.argmax(-1))
