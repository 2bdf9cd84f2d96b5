"""Sampler wrappers (dgemma/diffusion/wrappers.py): per-row random streams make a row's sample
independent of its batch, rows leaving at stop tokens included; nucleus filtering."""

from __future__ import annotations

import pytest
import torch

from dgemma.diffusion.sampler import CanvasSampler
from dgemma.diffusion.steps import CanvasState, build_step
from dgemma.diffusion.wrappers import RowSeeded, TopPStep, top_p_filter
from dgemma.errors import DGemmaError


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None, None]
    kept = lambda p: torch.isfinite(top_p_filter(logits, p, 1.0))[0, 0].tolist()  # noqa: E731
    assert kept(0.7) == [True, True, False, False]
    assert kept(0.5) == [True, False, False, False]  # the first token alone reaches 0.5
    assert kept(0.1) == [True, False, False, False]  # the most probable token always stays
    assert kept(1.0) == [True, True, True, True]
    assert kept(0.9) == [True, True, True, False]


def test_top_p_step_draws_inside_the_nucleus_and_leaves_greedy_alone():
    from dgemma.diffusion.corruption import UniformNoise
    from dgemma.diffusion.schedules import LinearSchedule

    noise = UniformNoise(8, LinearSchedule())
    logits = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0)) * 2
    state = CanvasState(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.bool))
    step = TopPStep(build_step("confidence", noise=noise, temperature=1.0, threshold=0.0), 0.5)
    out = step(state, logits, 1.0, 0.5, generator=torch.Generator().manual_seed(1), is_last=True)
    allowed = torch.isfinite(top_p_filter(logits, 0.5, 1.0))
    assert bool(allowed.gather(-1, out.tokens[..., None]).all())  # every draw is inside its nucleus
    assert step.commits  # the wrapped step's attributes show through (the sampler reads `commits`)
    greedy = build_step("confidence", noise=noise, temperature=0.0)
    a = TopPStep(greedy, 0.3)(state, logits, 1.0, 0.5, generator=torch.Generator().manual_seed(1), is_last=False)
    b = greedy(state, logits, 1.0, 0.5, generator=torch.Generator().manual_seed(1), is_last=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.committed, b.committed)
    with pytest.raises(DGemmaError, match="entropy_bound"):
        TopPStep(build_step("entropy_bound", noise=noise), 0.9)


def test_row_streams_do_not_depend_on_the_batch(tiny_text_model):
    """A batch of 8 rows, several of which emit a stop token in an early canvas and leave the
    batch, gives each row exactly what it gives alone with its own generator."""
    import dgemma
    from dgemma.diffusion.corruption import UniformNoise
    from dgemma.diffusion.schedules import LinearSchedule

    model, tok = dgemma.load_pretrained(tiny_text_model)
    model.eval()
    noise = UniformNoise(model.config.vocab_size, LinearSchedule())
    stops = (tok.eos_id, tok.end_of_turn_id)
    prompts = [tok.encode(t, add_bos=True) for t in ["hello", "hello world", "The capital of France is", "1", "2",
                                                       "3.14", "Paris", "world"]]

    def sample(rows: list[int]) -> list[list[int]]:
        width = max(len(prompts[r]) for r in rows)
        ids = torch.tensor([prompts[r] + [0] * (width - len(prompts[r])) for r in rows])
        valid = torch.tensor([[1] * len(prompts[r]) + [0] * (width - len(prompts[r])) for r in rows]).bool()
        rs = RowSeeded(noise, build_step("commit", noise=noise, temperature=2.0),
                       [torch.Generator().manual_seed(100 + r) for r in rows], num_steps=6, stop_ids=stops)
        sampler = CanvasSampler(**rs.kwargs(), num_steps=6, canvas_size=32, max_canvases=3, stop_ids=stops,
                                temperature=2.0)
        return sampler(model, ids, valid, generator=torch.Generator().manual_seed(0)).tokens

    batch = sample(list(range(8)))
    assert any(len(t) < 64 for t in batch)  # some rows left the batch after their first canvas
    assert batch == [sample([r])[0] for r in range(8)]
    assert sample([5, 2]) == [batch[5], batch[2]]
