import math
from dataclasses import replace

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.schedules import CosineSchedule, LinearSchedule, time_grid
from dgemma.diffusion.steps import (
    STEPS,
    CanvasState,
    CommitStep,
    ConfidenceStep,
    DDIMStep,
    build_step,
    predict,
    swap_repeats,
)
from dgemma.errors import DGemmaError

MASK = 3


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def state_of(tokens, committed=None):
    return CanvasState(tokens=tokens, committed=torch.zeros_like(tokens, dtype=torch.bool) if committed is None
                       else committed)


def conf_logits(conf, vocab=8, targets=None):
    """Logits whose argmax is ``targets`` (default 0) with probability ``conf`` per position."""
    targets = torch.zeros_like(conf, dtype=torch.long) if targets is None else targets
    hot = torch.nn.functional.one_hot(targets, vocab).bool()
    p = torch.where(hot, conf.unsqueeze(-1), ((1 - conf) / (vocab - 1)).unsqueeze(-1))
    return p.log()


def peaked(targets, vocab, margin=50.0):
    """Logits whose argmax is ``targets`` with probability ~1."""
    return torch.nn.functional.one_hot(targets, vocab).float() * margin


def test_predict_greedy_and_sampled():
    logits = torch.randn(2, 4, 6, generator=gen(1))
    pred, conf = predict(logits, 0.0, gen())
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(conf, logits.softmax(-1).amax(-1))
    row = torch.tensor([0.0, 1.0, 2.0, -1.0])
    pred, conf = predict(row.expand(1, 100_000, 4), 0.7, gen())
    freq = torch.bincount(pred.flatten(), minlength=4).double() / pred.numel()
    torch.testing.assert_close(freq, (row / 0.7).softmax(-1).double(), atol=0.006, rtol=0)
    torch.testing.assert_close(conf, (row / 0.7).softmax(-1)[pred])


# ---- DDIM -------------------------------------------------------------------------------------


def ddim_freq(step, x_t, logits, t, s, n=200_000, vocab=5):
    state = state_of(torch.full((1, n), x_t))
    out = step(state, logits.expand(1, n, vocab), t, s, generator=gen(2), is_last=False)
    return torch.bincount(out.tokens.flatten(), minlength=vocab).double() / n


@pytest.mark.parametrize("schedule", [LinearSchedule(), CosineSchedule()])
def test_ddim_transition_frequencies_match_the_posterior(schedule):
    vocab, x_t, x0, t, s = 5, 2, 4, 0.6, 0.3
    noise = UniformNoise(vocab, schedule)
    p_x0, p_xt, p_other = noise.posterior(torch.tensor([[x_t]]), torch.tensor([[x0]]), t, s)
    expected = torch.full((vocab,), p_other.item() / 3, dtype=torch.float64)
    expected[x0], expected[x_t] = p_x0.item(), p_xt.item()
    freq = ddim_freq(DDIMStep(noise, temperature=1.0), x_t, peaked(torch.tensor(x0), vocab), t, s)
    torch.testing.assert_close(freq, expected, atol=0.005, rtol=0)  # >= 4 sigma at n = 200k


def test_ddim_marginal_over_sampled_x0_matches_enumeration():
    vocab, x_t, t, s, temp = 5, 1, 0.8, 0.5, 0.7
    noise = UniformNoise(vocab, LinearSchedule())
    logits = torch.tensor([0.5, 0.0, 2.0, -1.0, 1.0])
    p0 = (logits / temp).softmax(-1).double()
    expected = torch.zeros(vocab, dtype=torch.float64)
    for x0 in range(vocab):
        if x0 == x_t:
            expected[x_t] += p0[x0]
            continue
        a, b, o = (p.item() for p in noise.posterior(torch.tensor([[x_t]]), torch.tensor([[x0]]), t, s))
        expected[x0] += p0[x0] * a
        expected[x_t] += p0[x0] * b
        expected += p0[x0] * o / 3 * torch.tensor([v not in (x0, x_t) for v in range(vocab)])
    freq = ddim_freq(DDIMStep(noise, temperature=temp), x_t, logits, t, s)
    torch.testing.assert_close(freq, expected, atol=0.005, rtol=0)


def test_ddim_agreeing_positions():
    vocab, x, t, s = 5, 2, 0.9, 0.6
    noise = UniformNoise(vocab, LinearSchedule())
    logits = peaked(torch.tensor(x), vocab)
    assert (ddim_freq(DDIMStep(noise), x, logits, t, s)[x] == 1.0)  # the adapter's rule: stay
    p_x0, _, p_other = noise.posterior(torch.tensor([[x]]), torch.tensor([[x]]), t, s)
    expected = torch.full((vocab,), p_other.item() / 4, dtype=torch.float64)
    expected[x] = p_x0.item()
    freq = ddim_freq(DDIMStep(noise, resample_agreeing=True), x, logits, t, s)
    torch.testing.assert_close(freq, expected, atol=0.005, rtol=0)


def test_ddim_last_step_lands_on_x0_and_keeps_committed():
    vocab = 11
    noise = UniformNoise(vocab, LinearSchedule())
    target = torch.randint(0, vocab, (3, 20), generator=gen(4))
    tokens = torch.randint(0, vocab, (3, 20), generator=gen(5))
    committed = torch.zeros(3, 20, dtype=torch.bool)
    committed[:, :4] = True
    out = DDIMStep(noise)(state_of(tokens, committed), peaked(target, vocab), 0.05, 0.02, generator=gen(),
                          is_last=True)
    assert torch.equal(out.tokens[:, 4:], target[:, 4:])
    assert torch.equal(out.tokens[:, :4], tokens[:, :4])
    assert torch.equal(out.committed, committed)
    assert torch.equal(out.prev_pred, target)


def test_ddim_is_seeded_and_pure():
    noise = UniformNoise(7, LinearSchedule())
    logits = torch.randn(2, 30, 7, generator=gen(6))
    state = state_of(torch.randint(0, 7, (2, 30), generator=gen(7)))
    before = state.tokens.clone()
    a = DDIMStep(noise)(state, logits, 0.7, 0.4, generator=gen(1), is_last=False)
    b = DDIMStep(noise)(state, logits, 0.7, 0.4, generator=gen(1), is_last=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(state.tokens, before)


def test_ddim_needs_uniform_noise():
    with pytest.raises(DGemmaError, match="uniform"):
        DDIMStep(AbsorbingNoise(MASK, LinearSchedule()))


# ---- commit -----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", [LinearSchedule(), CosineSchedule()])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_commit_follows_the_schedule_and_never_overwrites(schedule, temperature):
    vocab, b, c, steps = 40, 3, 64, 8
    noise = UniformNoise(vocab, schedule)
    step = CommitStep(noise, schedule, temperature=temperature)
    g = gen(8)
    state = CanvasState.from_noise(noise, b, c, generator=g)
    grid = time_grid(steps)
    for i in range(steps):
        t, s = grid[i].item(), grid[i + 1].item()
        logits = torch.randn(b, c, vocab, generator=gen(100 + i)) * 3
        new = step(state, logits, t, s, generator=g, is_last=i == steps - 1)
        assert torch.equal(new.tokens[state.committed], state.tokens[state.committed])
        assert (new.committed | ~state.committed).all()  # nothing is ever uncommitted
        fresh = new.committed & ~state.committed
        assert torch.equal(new.tokens[fresh], new.prev_pred[fresh])
        if temperature == 0:  # greedy: the argmax where open; a committed position predicts its own token
            was_open = ~state.committed
            assert torch.equal(new.prev_pred[was_open], logits.argmax(-1)[was_open])
            assert torch.equal(new.prev_pred[state.committed], state.tokens[state.committed])
        alpha_s = schedule.alpha(torch.tensor(s, dtype=torch.float64)).item()
        want = c if i == steps - 1 else math.ceil(alpha_s * c - 1e-6)
        assert new.committed.sum(-1).tolist() == [want] * b
        state = new
    assert state.committed.all()


def test_commit_redraws_uncommitted_positions_uniformly():
    vocab, c = 10, 4000
    noise = UniformNoise(vocab, LinearSchedule())
    state = CanvasState.from_noise(noise, 2, c, generator=gen(1))
    logits = torch.randn(2, c, vocab, generator=gen(2))
    out = CommitStep(noise)(state, logits, 1.0, 0.9, generator=gen(3), is_last=False)
    open_ = ~out.committed
    assert out.committed.sum().item() == 2 * 400
    assert (out.tokens[open_] == state.tokens[open_]).float().mean() < 0.13  # chance: 1/10
    freq = torch.bincount(out.tokens[open_], minlength=vocab).double() / open_.sum()
    torch.testing.assert_close(freq, torch.full((vocab,), 0.1, dtype=torch.float64), atol=0.015, rtol=0)


def test_commit_with_absorbing_noise_masks_the_rest():
    noise = AbsorbingNoise(MASK, LinearSchedule())
    state = CanvasState.from_noise(noise, 2, 10, generator=gen())
    assert (state.tokens == MASK).all()
    logits = torch.randn(2, 10, 8, generator=gen(1))
    out = CommitStep(noise)(state, logits, 1.0, 0.7, generator=gen(), is_last=False)
    assert out.committed.sum(-1).tolist() == [3, 3]
    assert (out.tokens[~out.committed] == MASK).all()
    conf = logits.softmax(-1).amax(-1)
    top3 = conf.topk(3, dim=-1).indices
    assert torch.equal(out.committed, torch.zeros_like(out.committed).scatter(-1, top3, True))


def test_commit_prefers_stable_and_not_weaker_predictions():
    vocab = 6
    noise = UniformNoise(vocab, LinearSchedule())
    pred = torch.tensor([[0, 1, 2, 3]])
    probs = torch.tensor([[0.9, 0.5, 0.4, 0.7]])  # confidences of the argmax tokens
    logits = conf_logits(probs, vocab, pred)
    state = state_of(torch.zeros(1, 4, dtype=torch.long))
    state.prev_pred = torch.tensor([[5, 1, 2, 3]])  # position 0 changed its mind
    state.prev_conf = torch.tensor([[0.1, 0.6, 0.3, 0.3]])  # position 1 got weaker
    out = CommitStep(noise)(state, logits, 1.0, 0.5, generator=gen(), is_last=False)  # commit 2 of 4
    assert out.committed.tolist() == [[False, False, True, True]]  # stable+stronger first, by confidence
    out = CommitStep(noise)(state, logits, 1.0, 0.25, generator=gen(), is_last=False)  # commit 3 of 4
    assert out.committed.tolist() == [[True, False, True, True]]  # then the most confident of the rest
    assert out.tokens[0, [0, 2, 3]].tolist() == [0, 2, 3]


def test_commit_by_margin_prefers_the_decided_position():
    """The docstring's example: (0.6, 0.4, 0, 0) and (0.5, 0.1 x 5) swap ranks under margin;
    the margin is the predicted token's probability minus the best other token's, computed here
    by hand."""
    noise = AbsorbingNoise(MASK, LinearSchedule())
    probs = torch.tensor([[[0.6, 0.4, 0.0, 0.0, 0.0, 0.0], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
                           [0.3, 0.25, 0.25, 0.1, 0.05, 0.05]]])
    logits = probs.clamp_min(1e-9).log()
    state = CanvasState.from_noise(noise, 1, 3, generator=gen())
    by_conf = CommitStep(noise)(state, logits, 1.0, 2 / 3, generator=gen(), is_last=False)  # commit 1 of 3
    by_margin = CommitStep(noise, order="margin")(state, logits, 1.0, 2 / 3, generator=gen(), is_last=False)
    assert by_conf.committed.tolist() == [[True, False, False]]
    assert by_margin.committed.tolist() == [[False, True, False]]
    top2 = probs.topk(2, -1).values
    from dgemma.diffusion.steps import _margin

    torch.testing.assert_close(_margin(logits, probs.argmax(-1)), top2[..., 0] - top2[..., 1])
    with pytest.raises(DGemmaError, match="commit order 'entropy' is unknown"):
        CommitStep(noise, order="entropy")


def test_commit_without_stable_first_ranks_by_confidence_alone():
    """The docstring's example: confidences (0.9, 0.8) after (0.95, 0.7), the same predictions.
    With the key position 1 commits first (its confidence rose), without it position 0."""
    noise = AbsorbingNoise(MASK, LinearSchedule())
    pred = torch.tensor([[0, 1]])
    logits = conf_logits(torch.tensor([[0.9, 0.8]]), 8, pred)
    state = state_of(torch.full((1, 2), MASK))
    state.prev_pred, state.prev_conf = pred.clone(), torch.tensor([[0.95, 0.7]])
    kw = dict(generator=gen(), is_last=False)
    assert CommitStep(noise)(state, logits, 1.0, 0.5, **kw).committed.tolist() == [[False, True]]
    alone = CommitStep(noise, stable_first=False)(state, logits, 1.0, 0.5, **kw)
    assert alone.committed.tolist() == [[True, False]]
    assert alone.tokens[0, 0].item() == 0


def _two_choices(first, second, vocab=10):
    """``[1, C, V]`` logits whose likeliest token is ``first[i]`` and second likeliest ``second[i]``."""
    logits = torch.zeros(1, len(first), vocab)
    for i, (a, b) in enumerate(zip(first, second)):
        logits[0, i, a], logits[0, i, b] = 5.0, 3.0
    return logits


def test_swap_repeats_docstring_examples():
    committed = torch.tensor([[True, False, False, False]])
    new = ~committed
    logits = _two_choices([7, 7, 7, 2], [0, 4, 5, 6])
    assert swap_repeats(logits, torch.tensor([[7, 7, 7, 2]]), new, committed).tolist() == [[7, 4, 7, 2]]
    same = _two_choices([2, 2, 2, 2], [6, 6, 6, 6])
    assert swap_repeats(same, torch.tensor([[7, 2, 2, 2]]), new, committed).tolist() == [[7, 2, 6, 2]]
    # a position not committed at this step is left alone, and so is one whose left neighbour is still open
    new2 = torch.tensor([[False, True, False, True]])
    assert swap_repeats(logits, torch.tensor([[7, 7, 7, 7]]), new2, committed).tolist() == [[7, 4, 7, 7]]
    pred = torch.tensor([[7, 3, 5, 8]])
    assert swap_repeats(logits, pred, new, committed) is pred  # nothing repeats: the same tensor back
    # position 3 committed earlier: position 2 also avoids the 2 on its right
    right = torch.tensor([[True, False, False, True]])
    assert swap_repeats(same, torch.tensor([[7, 2, 2, 2]]), ~right, right).tolist() == [[7, 2, 6, 2]]
    both = _two_choices([2, 2, 2, 2], [5, 5, 5, 5]).index_fill_(-1, torch.tensor([6]), 2.0)  # third choice 6
    assert swap_repeats(both, torch.tensor([[5, 2, 5, 5]]), ~right, right).tolist() == [[5, 2, 6, 5]]


def test_commit_no_repeat_swaps_in_the_runner_up_and_nothing_else():
    """A block of 4 committed in one pass, predicted (7, 7, 7, 2): without the rule the canvas
    reads 7 7 7 2; with it each repeat takes its runner-up, and which positions commit does not change."""
    noise = AbsorbingNoise(MASK, LinearSchedule())
    logits = _two_choices([7, 7, 7, 2, 2, 2, 2, 2], [1, 4, 5, 6, 6, 6, 6, 6])
    state = CanvasState.from_noise(noise, 1, 8, generator=gen())
    kw = dict(generator=gen(), is_last=False)
    plain = CommitStep(noise, block=4)(state, logits, 1.0, 0.5, **kw)  # 4 of 8: the first block
    swapped = CommitStep(noise, block=4, no_repeat=True)(state, logits, 1.0, 0.5, **kw)
    assert plain.tokens[0, :4].tolist() == [7, 7, 7, 2]
    assert swapped.tokens[0, :4].tolist() == [7, 4, 7, 2]  # 1 -> 4; then 2 no longer repeats its neighbour
    assert torch.equal(plain.committed, swapped.committed)
    assert (swapped.tokens[0, 4:] == MASK).all()
    last = CommitStep(noise, block=4, no_repeat=True)(swapped, logits, 0.5, 0.0, generator=gen(), is_last=True)
    assert last.tokens[0].tolist() == [7, 4, 7, 2, 6, 2, 6, 2]  # the last step's commits follow the rule too
    assert CommitStep(noise, block=4)(plain, logits, 0.5, 0.0, generator=gen(), is_last=True).tokens[0].tolist() \
        == [7, 7, 7, 2, 2, 2, 2, 2]


# ---- confidence -------------------------------------------------------------------------------




def test_confidence_commits_exactly_the_positions_above_threshold():
    noise = UniformNoise(8, LinearSchedule())
    conf = torch.tensor([[0.95, 0.5, 0.91, 0.99, 0.2], [0.3, 0.6, 0.5, 0.4, 0.89]])
    committed = torch.tensor([[False, False, False, True, False], [False] * 5])
    state = state_of(torch.full((2, 5), 5), committed)
    out = ConfidenceStep(noise, threshold=0.9)(state, conf_logits(conf), 0.8, 0.6, generator=gen(), is_last=False)
    assert out.committed.tolist() == [[True, False, True, True, False], [False, False, False, False, True]]
    assert out.tokens[0, 3].item() == 5  # already committed: untouched
    assert (out.tokens[out.committed & ~committed] == 0).all()
    last = ConfidenceStep(noise)(out, conf_logits(conf), 0.1, 0.0, generator=gen(), is_last=True)
    assert last.committed.all()


def test_confidence_blocks_look_only_at_the_leftmost_open_block():
    noise = UniformNoise(8, LinearSchedule())
    conf = torch.tensor([[0.99, 0.2, 0.3, 0.2, 0.3, 0.95, 0.95, 0.99]])
    state = state_of(torch.full((1, 8), 5))
    blocked = ConfidenceStep(noise, threshold=0.9, block=4)
    out = blocked(state, conf_logits(conf), 0.8, 0.6, generator=gen(), is_last=False)
    assert out.committed.tolist() == [[True] + [False] * 7]  # block 0 only: 7 waits
    done0 = state_of(torch.full((1, 8), 5), torch.tensor([[True] * 4 + [False] * 4]))
    out = blocked(done0, conf_logits(conf), 0.8, 0.6, generator=gen(), is_last=False)
    assert out.committed.tolist() == [[True] * 4 + [False, True, True, True]]  # the module docstring's example
    weak = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.3, 0.95, 0.95, 0.99]])
    out = blocked(state, conf_logits(weak), 0.8, 0.6, generator=gen(), is_last=False)
    assert out.committed.tolist() == [[False, False, True] + [False] * 5]  # none above: block 0's best
    plain = ConfidenceStep(noise, threshold=0.9)(state, conf_logits(weak), 0.8, 0.6, generator=gen(), is_last=False)
    assert plain.committed.tolist() == [[False] * 5 + [True] * 3]
    with pytest.raises(DGemmaError, match="commit block must be >= 1"):
        ConfidenceStep(noise, block=0)


def test_confidence_commits_at_least_one_per_step_until_done():
    vocab, c = 8, 12
    noise = UniformNoise(vocab, LinearSchedule())
    step = ConfidenceStep(noise, threshold=0.999, temperature=0.0)
    g = gen(9)
    state = CanvasState.from_noise(noise, 2, c, generator=g)
    for i in range(c):
        logits = torch.randn(2, c, vocab, generator=gen(i))
        new = step(state, logits, 1.0, 0.5, generator=g, is_last=False)
        assert (new.committed.sum(-1) - state.committed.sum(-1)).tolist() == [1, 1]
        assert torch.equal(new.tokens[state.committed], state.tokens[state.committed])
        state = new
    assert state.committed.all()
    again = step(state, torch.randn(2, c, vocab), 0.5, 0.2, generator=g, is_last=False)
    assert torch.equal(again.tokens, state.tokens)


# ---- state and registry -----------------------------------------------------------------------


def test_state_select():
    noise = UniformNoise(9, LinearSchedule())
    state = CanvasState.from_noise(noise, 4, 6, generator=gen())
    state = CommitStep(noise)(state, torch.randn(4, 6, 9), 1.0, 0.5, generator=gen(), is_last=False)
    sub = state.select(torch.tensor([True, False, False, True]))
    assert torch.equal(sub.tokens, state.tokens[[0, 3]]) and torch.equal(sub.prev_conf, state.prev_conf[[0, 3]])
    assert state_of(torch.zeros(3, 2, dtype=torch.long)).select(torch.tensor([2])).prev_pred is None


def test_registry():
    noise = UniformNoise(9, LinearSchedule())
    assert set(STEPS) == {"ddim", "commit", "confidence", "entropy_bound"}
    assert isinstance(build_step("ddim", noise=noise, temperature=0.5), DDIMStep)
    assert build_step("confidence", noise=noise, threshold=0.8).threshold == 0.8
    assert isinstance(build_step("commit", noise=noise), CommitStep)
    with pytest.raises(DGemmaError, match="ddim"):
        build_step("entropy_bonud", noise=noise)
    with pytest.raises(DGemmaError, match="bad arguments"):
        build_step("commit", noise=noise, threshold=0.9)
    with pytest.raises(DGemmaError):
        build_step("confidence", noise=noise, threshold=1.5)
    with pytest.raises(DGemmaError):
        build_step("ddim", noise=noise, temperature=-1.0)


def test_entropy_bound_accepts_the_lowest_entropy_prefix_within_the_bound():
    from dgemma.diffusion.steps import EntropyBoundStep

    step = EntropyBoundStep(UniformNoise(5, LinearSchedule()), bound=0.1)
    h = torch.tensor([[0.30, 0.01, 0.05, 0.02, 0.9]])
    # sorted: .01 .02 .05 .30 .90; cumsum - self: 0, .01, .03, .08, .38 -> first four accepted
    assert step.accept(h).tolist() == [[True, True, True, True, False]]
    assert step.temperature(1.0) == pytest.approx(0.8) and step.temperature(0.0) == pytest.approx(0.4)


def test_entropy_bound_step_keeps_pins_renoises_rejects_and_ends_on_argmax():
    from dgemma.diffusion.steps import CanvasState, EntropyBoundStep

    noise = UniformNoise(6, LinearSchedule())
    step = EntropyBoundStep(noise, bound=0.1)
    logits = torch.full((1, 4, 6), -20.0)
    logits[0, 0, 2] = logits[0, 1, 3] = 20.0  # positions 0 and 1 certain, 2 and 3 flat
    logits[0, 2:, :] = 0.0
    state = CanvasState(tokens=torch.tensor([[0, 0, 0, 5]]), committed=torch.tensor([[False, False, False, True]]))
    state = replace(state, pinned=state.committed.clone())
    g = torch.Generator().manual_seed(0)
    out = step(state, logits, 0.5, 0.4, generator=g, is_last=False)
    assert out.tokens[0, :2].tolist() == [2, 3] and out.tokens[0, 3] == 5
    last = step(state, logits, 0.1, 0.0, generator=g, is_last=True)
    assert last.tokens[0].tolist() == [2, 3, 0, 5]
