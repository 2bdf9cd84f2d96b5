"""The LM head on a shortlist (``CanvasSampler.shortlist``, ``sampler.py:canvas_shortlist``).

A canvas's first pass runs the head on every position and keeps each one's ``K`` likeliest
tokens with the context's; the canvas's later passes score only those. Exact checks (fp64):

- the head on a shortlist gives the full head's logits at those tokens;
- a shortlist that holds the whole vocabulary changes nothing, token for token;
- with a short one, every token a canvas ends with lies in that canvas's shortlist, and the
  later passes' head is as narrow as the shortlist;
- where something reads a probability over the whole vocabulary (the self-conditioning signal)
  the setting does nothing; a hook that reads every position's guess (the playground's) gets the
  shortlist's argmax.
"""

import pytest
import torch

import dgemma.diffusion.sampler as sampler_mod
from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import CanvasSampler, canvas_shortlist
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import CommitStep
from dgemma.errors import DGemmaError
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.sampling import SamplerConfig, build_rules
from dgemma.training.config import EvalConfig

V, C = 40, 8


def tiny(**kw) -> DiffusionGemma:
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return DiffusionGemma(cfg).double().eval()


def test_canvas_shortlist_literal_example():
    scores = torch.tensor([[[0.0, 5, 1, 4, 2, 3]]])  # [R=1, C=1, V=6]
    assert canvas_shortlist(scores, 2, torch.tensor([5, 5])).tolist() == [1, 3, 5]
    two = torch.tensor([[[0.0, 5, 1, 4, 2, 3], [9.0, 0, 0, 0, 0, 8]]])  # top 2 of each position, sorted
    assert canvas_shortlist(two, 2, torch.tensor([], dtype=torch.long)).tolist() == [0, 1, 3, 5]
    assert canvas_shortlist(scores, 99, torch.tensor([2])).tolist() == list(range(6))  # K > V: everything


@pytest.mark.parametrize("cap", [None, 3.0])
def test_the_head_on_a_shortlist_equals_the_full_head_there(cap):
    model = tiny(final_logit_softcapping=cap)
    hidden = torch.randn(2, 3, 32, dtype=torch.float64)
    vocab = torch.tensor([0, 4, 5, 17, 39])
    torch.testing.assert_close(model.logits(hidden, vocab=vocab), model.logits(hidden)[..., vocab],
                               rtol=1e-12, atol=1e-12)


def decode(model, shortlist: int, *, self_condition=False, hints=None, on_step=None):
    noise = AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule())
    prompt = torch.randint(2, V, (4, 5), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(4, 5, dtype=torch.bool)
    valid[1, 3:] = False
    s = CanvasSampler(noise=noise, step=CommitStep(noise, temperature=0.0, block=4), num_steps=4, canvas_size=C,
                      max_canvases=3, stop_ids=(7,), self_condition=self_condition, reuse_canvas_keys=True,
                      shortlist=shortlist, on_step=on_step)
    return s(model, prompt, valid, generator=torch.Generator().manual_seed(0), hints=hints)


def test_a_shortlist_of_the_whole_vocabulary_changes_nothing():
    model = tiny(shift_logits=True)
    hints = torch.full((4, 3 * C), -1)
    hints[2, 10] = 7  # row 2 stops in its second canvas
    a, b = decode(model, 0, hints=hints), decode(model, V, hints=hints)
    assert a.tokens == b.tokens and a.forward_passes == b.forward_passes and a.steps_used == b.steps_used


@pytest.fixture
def lists(monkeypatch) -> list:
    """Every shortlist the sampler builds, in order (one per canvas)."""
    made = []

    def recording(scores, k, context):
        made.append(canvas_shortlist(scores, k, context))
        return made[-1]

    monkeypatch.setattr(sampler_mod, "canvas_shortlist", recording)
    return made


def test_a_short_list_bounds_what_each_canvas_can_say(lists):
    model = tiny(shift_logits=True)
    widths = []
    real_logits = model.logits

    def recording_logits(hidden, *, vocab=None):
        z = real_logits(hidden, vocab=vocab)
        widths.append(z.shape[-1])
        return z

    model.logits = recording_logits
    out = decode(model, 2)
    assert len(lists) == 3  # one per canvas: each canvas's first pass
    assert len(widths) > len(lists) and all(w in (V, *(len(s) for s in lists)) for w in widths)
    assert sum(w < V for w in widths) == len(widths) - len(lists)  # every later pass: the shortlist alone
    for row in out.tokens:  # 4 rows x 3 canvases of C tokens (shorter where a row stopped)
        for k in range(0, len(row), C):
            assert set(row[k:k + C]) <= set(lists[k // C].tolist())


def test_the_signal_reads_every_probability_so_no_shortlist_then():
    model = tiny(self_conditioning=True)
    a, b = decode(model, 0, self_condition=True), decode(model, 2, self_condition=True)
    assert a.tokens == b.tokens


def test_a_negative_shortlist_is_refused():
    with pytest.raises(ValueError, match="shortlist must be >= 0"):
        EvalConfig(shortlist=-1)
    with pytest.raises(ValueError, match="interactive_shortlist must be >= 0"):
        EvalConfig(interactive_shortlist=-2)
    cfg = SamplerConfig(num_steps=2, step_type="commit", temperature=0.0, early_stopping="none", max_canvases=1,
                        shortlist=-1)
    with pytest.raises(DGemmaError, match="shortlist must be >= 0"):
        build_rules(cfg, AbsorbingNoise(mask_token_id=1, schedule=LinearSchedule()))


def test_a_hook_reading_every_guess_gets_the_shortlists_argmax(lists):
    """The playground's hook reads the argmax of every open position, so the head is not narrowed
    to the rows a step reads; it still scores the shortlist alone after a canvas's first pass."""
    guesses = []

    def hook(*, canvas, argmax, committed, **_):
        guesses.append((canvas, len(lists), argmax[~committed].tolist()))

    decode(tiny(shift_logits=True), 2, on_step=hook)
    assert len(lists) == 3 and sum(bool(g) for _, _, g in guesses) > 6  # open positions after most steps
    for canvas, made, guess in guesses:
        assert made == canvas + 1 and set(guess) <= set(lists[canvas].tolist())
