"""Stop-token aliases: tokens whose embedding a tied head cannot tell from a stop token's.

Gemma 3 270M's ``<end_of_turn>`` shares its direction with ~6,200 untrained rows (cosine >= 0.95),
so a fine-tune that means "end of turn" emits one of them instead. ``stop_alias_cos`` folds
their probability into the stop token in both decoders (the canvas sampler and ``ar_generate``).
"""

from __future__ import annotations

import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import ar_generate, fold_aliases, stop_aliases
from dgemma.diffusion.schedules import get_schedule
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.sampling import SamplerConfig, build_sampler

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 2,
            max_position_embeddings=128, attn_implementation="eager")
ALIASES = [40, 41, 42]


def test_aliases_are_the_near_duplicate_rows_of_each_stop_token():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(10, 16, generator=g)
    e[7] = 2.0 * e[1] + 0.01 * torch.randn(16, generator=g)  # same direction, other norm: an alias of 1
    e[8] = e[3] + 0.02 * torch.randn(16, generator=g)  # an alias of 3
    got = stop_aliases(e, (1, 3), 0.99)
    assert {k: v.tolist() for k, v in got.items()} == {1: [7], 3: [8]}
    assert stop_aliases(e, (), 0.99) == {}


def test_aliases_are_kept_per_embedding_until_it_changes():
    """Two models in one process (an AR fine-tune beside its adapter) each keep their aliases; an
    embedding edited in place is read again."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    a[7], b[8] = 2.0 * a[1], 3.0 * b[1]
    first_a, first_b = stop_aliases(a, (1,), 0.99), stop_aliases(b, (1,), 0.99)
    assert first_a[1].tolist() == [7] and first_b[1].tolist() == [8]
    assert stop_aliases(a, (1,), 0.99) is first_a and stop_aliases(b, (1,), 0.99) is first_b  # neither recomputed
    assert stop_aliases(a, (1,), 0.5) is not first_a  # other settings: computed for them
    a[9] = a[1]  # in place: the version moves
    assert stop_aliases(a, (1,), 0.99)[1].tolist() == [7, 9]


def test_folding_sums_the_probabilities_and_never_predicts_an_alias():
    p = torch.tensor([[0.40, 0.10, 0.10, 0.20, 0.20], [0.90, 0.02, 0.04, 0.02, 0.02]])
    out = fold_aliases(p.log(), {1: torch.tensor([3, 4])})
    assert torch.allclose(out.exp(), torch.tensor([[0.40, 0.50, 0.10, 0, 0], [0.90, 0.06, 0.04, 0, 0]]))
    assert out.argmax(-1).tolist() == [1, 0]  # stop wins only where the folded mass leads


def _model_with_aliases(ids):
    """EOS (id 1) and ALIASES share one row direction (a hair apart), one the final states point
    to: the tied head ranks them first, in an order set by the hair."""
    torch.manual_seed(0)
    model = DiffusionGemma(ModelConfig(**TINY)).eval()
    with torch.no_grad():
        from dgemma.models.masks import TokenInfo

        h = model(ids, info=TokenInfo.clean(torch.ones_like(ids, dtype=torch.bool)), return_hidden=True)
        d = h.mean((0, 1))
        d = 4 * d / d.norm() * model.model.embed_tokens.weight.norm(dim=-1).mean()
        w = model.model.embed_tokens.weight
        g = torch.Generator().manual_seed(2)
        for i in [1, *ALIASES]:
            w[i] = d + 1e-3 * d.norm() * torch.randn(d.shape, generator=g)
    return model


def test_both_decoders_emit_the_stop_token_instead_of_its_aliases():
    ids = torch.randint(5, 40, (4, 6), generator=torch.Generator().manual_seed(1))
    model = _model_with_aliases(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    noise = AbsorbingNoise(4, get_schedule("linear"))
    for cos in (None, 0.999):
        sampler = build_sampler(SamplerConfig(num_steps=4, step_type="commit", temperature=0.0, early_stopping="none",
                                              max_canvases=3, stop_alias_cos=cos), noise=noise, canvas_size=8,
                                stop_ids=(1,))
        diff = sampler(model, ids, valid, generator=torch.Generator().manual_seed(0)).tokens
        ar = ar_generate(model, ids, valid, max_new_tokens=24, stop_ids=(1,), stop_alias_cos=cos).tokens
        emitted = {t for row in diff + ar for t in row}
        if cos is None:
            assert emitted & set(ALIASES)  # the case the folding exists for
        else:
            assert not emitted & set(ALIASES) and 1 in emitted
    # without aliases in the vocabulary, folding changes nothing
    plain = DiffusionGemma(ModelConfig(**TINY)).eval()
    a = ar_generate(plain, ids, valid, max_new_tokens=12, stop_ids=(1,)).tokens
    b = ar_generate(plain, ids, valid, max_new_tokens=12, stop_ids=(1,), stop_alias_cos=0.999).tokens
    assert a == b
