"""A forced response prefix: text every answer starts with, given to both decoders.

The canvas sampler pins it at the start of the first canvas (``CanvasSampler.prefix``); the AR
decoder prefills it after the prompt (``ar_generate``'s ``prefix``). Both must equal what their
explicit forms give: the sampler with those tokens as hints, AR greedy decoding of prompts that
end with them, checked against an uncached fp64 forward at every token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import ar_generate, pin_prefix, prefixed_prompts
from dgemma.diffusion.schedules import get_schedule
from dgemma.errors import DGemmaError
from dgemma.models.masks import TokenInfo
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.sampling import SamplerConfig, build_sampler, check_prefix, resolve_prefix

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 2,
            max_position_embeddings=128, attn_implementation="eager", shift_logits=True)
PREFIX = (11, 12, 13)


def test_pin_prefix_literal_example():
    assert pin_prefix(None, (7, 8), 2, 3).tolist() == [[7, 8, -1], [7, 8, -1]]
    hints = torch.tensor([[-1, -1, 5], [-1, 8, -1]])
    assert pin_prefix(hints, (7, 8), 2, 3).tolist() == [[7, 8, 5], [7, 8, -1]]  # other pins kept, agreeing ones too
    assert hints.tolist() == [[-1, -1, 5], [-1, 8, -1]]  # the caller's hints are left alone
    assert pin_prefix(hints, (), 2, 3) is hints and pin_prefix(None, (), 2, 3) is None
    with pytest.raises(DGemmaError, match="puts token 8 at position 1, where row 1's hints pin 9"):
        pin_prefix(torch.tensor([[-1, -1, 5], [-1, 9, -1]]), (7, 8), 2, 3)
    with pytest.raises(DGemmaError, match="the response prefix is 3 tokens; the canvases hold 3"):
        pin_prefix(None, (7, 8, 9), 1, 3)


def test_prefixed_prompts_literal_example():
    ids, valid = prefixed_prompts(torch.tensor([[1, 2], [3, 0]]), torch.tensor([[1, 1], [1, 0]]).bool(), (7,))
    assert ids.tolist() == [[1, 2, 7], [3, 7, 0]]
    assert valid.int().tolist() == [[1, 1, 1], [1, 1, 0]]


def _model_and_prompts(dtype=torch.float32):
    torch.manual_seed(0)
    model = DiffusionGemma(ModelConfig(**TINY)).eval().to(dtype)
    ids = torch.randint(5, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 4:] = False  # rows of different lengths, right padded
    valid[2, 2:] = False
    return model, ids, valid


def _sampler(prefix=None):
    noise = AbsorbingNoise(4, get_schedule("linear"))
    return build_sampler(SamplerConfig(num_steps=4, step_type="commit", temperature=0.0, early_stopping="none",
                                       max_canvases=2, prefix=prefix), noise=noise, canvas_size=8, stop_ids=(1,))


def test_the_sampler_pins_its_prefix_as_hints_would():
    model, ids, valid = _model_and_prompts()
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    pinned = _sampler(PREFIX)(model, ids, valid, generator=gen())
    assert _sampler(PREFIX).prefix == PREFIX and _sampler().prefix == ()
    hints = torch.full((3, 16), -1)
    hints[:, :3] = torch.tensor(PREFIX)
    explicit = _sampler()(model, ids, valid, generator=gen(), hints=hints)
    assert pinned.tokens == explicit.tokens and pinned.forward_passes == explicit.forward_passes
    assert all(row[:3] == list(PREFIX) for row in pinned.tokens)
    free = _sampler()(model, ids, valid, generator=gen())
    assert free.tokens != pinned.tokens  # the pins change what follows
    # a clue elsewhere stays pinned beside the prefix
    clue = torch.full((3, 16), -1)
    clue[0, 5] = 9
    both = _sampler(PREFIX)(model, ids, valid, generator=gen(), hints=clue)
    assert both.tokens[0][:3] == list(PREFIX) and both.tokens[0][5] == 9


def _uncached_greedy(model, prompt: list[int], prefix: tuple[int, ...], n: int) -> list[int]:
    """The prefix, then ``n`` argmax tokens, each from a fresh causal forward of everything so far."""
    seq = list(prompt) + list(prefix)
    for _ in range(n):
        x = torch.tensor([seq])
        h = model(x, info=TokenInfo.clean(torch.ones_like(x, dtype=torch.bool)), return_hidden=True)
        seq.append(int(model.logits(h[:, -1]).argmax(-1)))
    return seq[len(prompt):]


def test_ar_prefix_is_prefilled_and_equals_uncached_greedy_decoding():
    model, ids, valid = _model_and_prompts(torch.float64)
    out = ar_generate(model, ids, valid, max_new_tokens=10, prefix=PREFIX)
    assert out.forward_passes == [7] * 3  # the prefix costs no step: 7 tokens after it, 1 prefill + 6 steps
    for r in range(3):
        prompt = ids[r, valid[r]].tolist()
        assert out.tokens[r] == _uncached_greedy(model, prompt, PREFIX, 7)
    ext_ids, ext_valid = prefixed_prompts(ids, valid, PREFIX)
    plain = ar_generate(model, ext_ids, ext_valid, max_new_tokens=7)
    assert [list(PREFIX) + row for row in plain.tokens] == out.tokens
    with pytest.raises(DGemmaError, match="max_new_tokens=3 leaves nothing to generate"):
        ar_generate(model, ids, valid, max_new_tokens=3, prefix=PREFIX)


def test_resolve_and_check_prefix(tiny_text_model):
    from dgemma.data.tokenizers import load_tokenizer

    tok = load_tokenizer(tiny_text_model)
    ids = resolve_prefix("The capital", tok)
    assert ids == tuple(tok.encode("The capital")) and resolve_prefix(None, tok) == ()
    check_prefix(ids, [tok.encode("The capital of France is Paris.")], tok)
    with pytest.raises(DGemmaError, match="is not how reference answer 1 begins"):
        check_prefix(ids, [tok.encode("The capital of France"), tok.encode("hello world")], tok)
    with pytest.raises(DGemmaError, match="the response prefix is empty"):
        resolve_prefix("", tok)
    with pytest.raises(DGemmaError, match="needs the run's tokenizer"):
        resolve_prefix("The", None)


def test_eval_harness_gives_both_decoders_the_prefix(tiny_run):
    from dgemma.eval import harness
    from dgemma.tasks import get_task
    from dgemma.training.runs import load_run

    run = load_run(tiny_run, dtype="float32")
    task = get_task(run.cfg.data.task).configure(run.cfg)
    records = task.load(run.cfg, limit=8)
    first = records[0]["response"][:2]
    same = [r for r in records if r["response"].startswith(first)]
    other = next(r for r in records if not r["response"].startswith(first))
    run.cfg.eval_ds = dataclasses.replace(run.cfg.eval_ds, response_prefix=first)
    prefix = tuple(run.tokenizer.encode(first))
    sampler, settings = harness.build_sampler(run, task, num_steps=4, step_type="commit", temperature=0.0,
                                              early_stopping=None)
    assert sampler.prefix == prefix and settings["response_prefix"] == first
    diff = harness.generate(run, sampler, same, batch_size=4)
    ar = harness.generate_ar(run, task, same, batch_size=4, max_new_tokens=16)
    assert all(t[:len(prefix)] == list(prefix) for t in diff.tokens + ar.tokens)
    for fn in (lambda recs: harness.generate(run, sampler, recs, batch_size=4),
               lambda recs: harness.generate_ar(run, task, recs, batch_size=4, max_new_tokens=16)):
        with pytest.raises(DGemmaError, match=f"is not how reference answer {len(same)} begins"):
            fn(same + [other])
