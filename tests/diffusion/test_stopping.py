import math

import pytest
import torch

from dgemma.diffusion.stopping import (
    STOPPING,
    EntropyStop,
    NoStop,
    StableAndConfident,
    build_stopping,
    mean_entropy,
)
from dgemma.errors import DGemmaError

V = 16


def sharp(targets, margin=30.0):
    """Near one-hot logits (entropy ~ 1e-11 nats) with argmax ``targets [B, C]``."""
    return torch.nn.functional.one_hot(targets, V).float() * margin


def flat(b, c):
    return torch.zeros(b, c, V)


def test_mean_entropy_values():
    assert mean_entropy(flat(2, 3), 1.0).tolist() == pytest.approx([math.log(V)] * 2)
    assert mean_entropy(sharp(torch.zeros(1, 4, dtype=torch.long)), 1.0).item() < 1e-9
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(0))
    p = (logits / 0.7).softmax(-1)
    manual = -(p * p.log()).sum(-1).mean(-1)
    torch.testing.assert_close(mean_entropy(logits, 0.7), manual)
    torch.testing.assert_close(mean_entropy(logits, 0.0), mean_entropy(logits, 1.0))
    assert (mean_entropy(logits, 0.3) < mean_entropy(logits, 1.0)).all()


def test_mean_entropy_averages_valid_positions_only():
    logits = torch.cat([sharp(torch.zeros(2, 3, dtype=torch.long)), flat(2, 2)], dim=1)
    valid = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    got = mean_entropy(logits, 1.0, valid)
    assert got[0].item() < 1e-9
    assert got[1].item() == pytest.approx(math.log(V) / 4)
    assert mean_entropy(logits, 1.0, torch.zeros_like(valid)).tolist() == [0.0, 0.0]
    masked_vocab = sharp(torch.zeros(1, 2, dtype=torch.long)).masked_fill(torch.arange(V) > 3, -math.inf)
    assert torch.isfinite(mean_entropy(masked_vocab, 1.0)).all()


def test_entropy_stop_fires_exactly_at_the_threshold():
    rule = EntropyStop()
    rule.reset(3)
    logits = torch.stack([sharp(torch.zeros(4, dtype=torch.long)), flat(1, 4)[0],
                          torch.randn(4, V) * 0.02])  # the last row: an untrained model, inert
    assert rule.update(logits, 1.0).tolist() == [True, False, False]
    two = torch.tensor([[[2.0, 0.0] + [-math.inf] * (V - 2)]])
    h = mean_entropy(two, 1.0).item()
    assert EntropyStop(h).update(two, 1.0).item()
    assert not EntropyStop(h * 0.999).update(two, 1.0).item()
    assert not EntropyStop(h).update(two, 2.0).item()  # a hotter distribution has more entropy


def test_stable_and_confident_sequence():
    rule = StableAndConfident()  # stability 1, entropy < 0.005
    rule.reset(1)
    a, b = torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)
    assert not rule.update(sharp(a), 1.0).item()  # no previous canvas yet
    assert rule.update(sharp(a), 1.0).item()  # unchanged and confident
    assert not rule.update(sharp(b), 1.0).item()  # changed
    assert rule.update(sharp(b), 1.0).item()
    low_margin = sharp(b, margin=4.0)  # same argmax, entropy ~ 1.1 nats
    assert not rule.update(low_margin, 1.0).item()  # stable but not confident
    rule.reset(1)
    assert not rule.update(sharp(b), 1.0).item()  # reset forgets the history


def test_stable_and_confident_thresholds():
    a = torch.zeros(1, 6, dtype=torch.long)
    rule = StableAndConfident(stability_threshold=2)
    rule.reset(1)
    assert [rule.update(sharp(a), 1.0).item() for _ in range(4)] == [False, False, True, True]
    rule = StableAndConfident(stability_threshold=0)
    rule.reset(1)
    assert rule.update(sharp(a), 1.0).item()
    ent = mean_entropy(sharp(a, margin=8.0), 1.0).item()
    rule = StableAndConfident(stability_threshold=0, confidence_threshold=ent)
    assert not rule.update(sharp(a, margin=8.0), 1.0).item()  # strictly below


def test_stable_and_confident_rows_valid_and_select():
    rule = StableAndConfident()
    rule.reset(3)
    t0 = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    t1 = torch.tensor([[1, 2, 3], [4, 5, 0], [7, 8, 0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])
    assert rule.update(sharp(t0), 1.0, valid).tolist() == [False, False, False]
    assert rule.update(sharp(t1), 1.0, valid).tolist() == [True, False, True]  # row 2 changed only off-canvas
    rule.select(torch.tensor([1, 2]))
    assert rule.update(sharp(t1[1:]), 1.0, valid[1:]).tolist() == [True, True]


def test_no_stop_and_registry():
    rule = NoStop()
    rule.reset(2)
    assert rule.update(sharp(torch.zeros(2, 3, dtype=torch.long)), 1.0).tolist() == [False, False]
    assert set(STOPPING) == {"none", "entropy", "stable_confident"}
    assert build_stopping("entropy", threshold=0.1).threshold == 0.1
    assert build_stopping("stable_confident").stability_threshold == 1
    with pytest.raises(DGemmaError, match="entropy"):
        build_stopping("patience")
    with pytest.raises(DGemmaError, match="bad arguments"):
        build_stopping("entropy", stability_threshold=1)
    with pytest.raises(DGemmaError):
        StableAndConfident(stability_threshold=-1)
