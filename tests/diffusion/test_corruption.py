import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise, block_states, build_noise
from dgemma.diffusion.schedules import CosineSchedule, LinearSchedule, get_schedule
from dgemma.errors import DGemmaError

V = 50
MASK = 7


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def clean(b=400, l=500, vocab=V):
    return torch.randint(0, vocab, (b, l), generator=gen(123))


@pytest.mark.parametrize("schedule", [LinearSchedule(), CosineSchedule()])
def test_uniform_keeps_the_right_fraction(schedule):
    x0 = clean()
    t = torch.tensor([0.1, 0.5, 0.9, 0.3]).repeat_interleave(100)
    xt = UniformNoise(V, schedule).q_sample(x0, t, generator=gen())
    same = (xt == x0).float().view(4, 100 * 500).mean(-1)
    alpha = schedule.alpha(torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64))
    expected = alpha + (1 - alpha) / V  # a redrawn token may be itself
    torch.testing.assert_close(same.double(), expected, atol=0.005, rtol=0)  # ~5 sigma at n = 50k


def test_uniform_replacements_are_uniform_over_the_vocabulary():
    x0 = torch.zeros(400, 500, dtype=torch.long)
    xt = UniformNoise(V, LinearSchedule()).q_sample(x0, torch.ones(400), generator=gen())
    freq = torch.bincount(xt.flatten(), minlength=V).double() / xt.numel()
    torch.testing.assert_close(freq, torch.full((V,), 1 / V, dtype=torch.float64), atol=0.0015, rtol=0)


def test_absorbing_masks_the_right_fraction():
    x0 = clean(vocab=MASK)  # ids below the mask id, so "== mask" means corrupted
    t = torch.tensor([0.2, 0.7]).repeat_interleave(200)
    xt = AbsorbingNoise(MASK, LinearSchedule()).q_sample(x0, t, generator=gen())
    masked = (xt == MASK).float().view(2, -1).mean(-1)
    torch.testing.assert_close(masked, torch.tensor([0.2, 0.7]), atol=0.005, rtol=0)
    assert torch.equal(xt[xt != MASK], x0[xt != MASK])


@pytest.mark.parametrize("noise", [UniformNoise(V, LinearSchedule()), AbsorbingNoise(MASK, LinearSchedule())])
def test_endpoints_seed_and_global_rng(noise):
    x0 = clean(8, 64)
    rng = torch.get_rng_state()
    assert torch.equal(noise.q_sample(x0, torch.zeros(8), generator=gen()), x0)
    full = noise.q_sample(x0, torch.ones(8), generator=gen())
    assert torch.equal(torch.get_rng_state(), rng)
    if isinstance(noise, AbsorbingNoise):
        assert (full == MASK).all()
    else:
        assert (full == x0).float().mean() < 0.1
    t = torch.full((8,), 0.5)
    a = noise.q_sample(x0, t, generator=gen(5))
    assert torch.equal(a, noise.q_sample(x0, t, generator=gen(5)))
    assert not torch.equal(a, noise.q_sample(x0, t, generator=gen(6)))


@pytest.mark.parametrize("noise", [UniformNoise(V, LinearSchedule()), AbsorbingNoise(MASK, LinearSchedule())])
def test_where_is_respected(noise):
    x0 = clean(16, 64, vocab=MASK)
    where = torch.rand(16, 64, generator=gen(9)) < 0.5
    xt = noise.q_sample(x0, torch.ones(16), generator=gen(), where=where)
    assert torch.equal(xt[~where], x0[~where])
    assert (xt[where] != x0[where]).float().mean() > 0.8


def test_noise_like():
    u = UniformNoise(V, LinearSchedule()).noise_like((4, 1000), generator=gen(), device="cpu")
    assert u.dtype == torch.long and u.min() >= 0 and u.max() == V - 1
    a = AbsorbingNoise(MASK, LinearSchedule()).noise_like((4, 10), generator=gen())
    assert (a == MASK).all() and a.dtype == torch.long


def brute_posterior(vocab, x_t, x0, a_t, a_s):
    """q(x_s | x_t, x0) for every x_s by Bayes over explicit transition matrices."""
    eye, ones = torch.eye(vocab, dtype=torch.float64), torch.ones(vocab, vocab, dtype=torch.float64)
    q_s = a_s * eye + (1 - a_s) / vocab * ones  # q_s[i, j] = q(x_s = j | x0 = i)
    a_ts = a_t / a_s if a_s > 0 else 0.0
    q_ts = a_ts * eye + (1 - a_ts) / vocab * ones  # q_ts[j, k] = q(x_t = k | x_s = j)
    torch.testing.assert_close(q_s @ q_ts, a_t * eye + (1 - a_t) / vocab * ones)  # the process is Markov
    joint = q_s[x0] * q_ts[:, x_t]
    return joint / joint.sum()


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_uniform_posterior_matches_bayes(name):
    vocab, b, l = 5, 64, 8
    schedule = get_schedule(name)
    g = gen(11)
    t = torch.rand(b, generator=g, dtype=torch.float64) * 0.98 + 0.02
    s = t * torch.rand(b, generator=g, dtype=torch.float64)
    s[:8] = 0.0
    t[8:12] = 1.0
    x_t = torch.randint(0, vocab, (b, l), generator=g)
    x0 = torch.randint(0, vocab, (b, l), generator=g)
    x0[:, :2] = x_t[:, :2]
    p_x0, p_xt, p_other = UniformNoise(vocab, schedule).posterior(x_t, x0, t, s)
    torch.testing.assert_close(p_x0 + p_xt + p_other, torch.ones(b, l, dtype=torch.float64))
    a_t, a_s = schedule.alpha(t), schedule.alpha(s)
    for i in range(b):
        for j in range(l):
            post = brute_posterior(vocab, x_t[i, j].item(), x0[i, j].item(), a_t[i].item(), a_s[i].item())
            k, o = x_t[i, j].item(), x0[i, j].item()
            others = [v for v in range(vocab) if v not in (k, o)]
            assert p_x0[i, j].item() == pytest.approx(post[o].item(), abs=1e-12)
            assert p_xt[i, j].item() == pytest.approx(0.0 if k == o else post[k].item(), abs=1e-12)
            assert p_other[i, j].item() == pytest.approx(post[others].sum().item(), abs=1e-12)
            assert torch.allclose(post[others], post[others][0])  # spread evenly
    assert (p_x0[:8] == 1).all() and (p_other[:8] == 0).all()  # s = 0 collapses to x0


def test_posterior_with_float_times_and_a_large_vocabulary():
    vocab = 262_144
    x_t = torch.randint(0, vocab, (2, 16), generator=gen())
    x0 = x_t.clone()
    x0[:, ::2] = (x0[:, ::2] + 1) % vocab
    parts = UniformNoise(vocab, LinearSchedule()).posterior(x_t, x0, 0.5, 0.25)
    total = sum(parts)
    assert torch.isfinite(total).all()
    torch.testing.assert_close(total, torch.ones_like(total))
    with pytest.raises(ValueError):
        UniformNoise(vocab, LinearSchedule()).posterior(x_t, x0, 0.25, 0.5)


def test_constructors_and_registry():
    with pytest.raises(DGemmaError):
        UniformNoise(1, LinearSchedule())
    with pytest.raises(DGemmaError):
        AbsorbingNoise(-1, LinearSchedule())
    assert isinstance(build_noise("uniform", LinearSchedule(), vocab_size=V), UniformNoise)
    assert build_noise("absorbing", LinearSchedule(), mask_token_id=3).mask_token_id == 3
    with pytest.raises(DGemmaError, match="absorbing"):
        build_noise("gaussian", LinearSchedule())
    with pytest.raises(DGemmaError, match="bad arguments"):
        build_noise("uniform", LinearSchedule(), mask_token_id=3)


def test_block_states_docstring_example_and_edges():
    done, ahead = block_states(torch.ones(1, 8, dtype=torch.bool), torch.tensor([[0.5]]), 8, 2)
    assert done.int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]]
    assert ahead.int().tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]
    # two canvases: the first holds free positions in its first two blocks only, so u -> 1 picks block 1
    free = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0] + [1] * 8]).bool()
    done, ahead = block_states(free, torch.tensor([[0.99, 0.0]]), 8, 2)
    assert done.int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0] + [0] * 8]
    assert ahead.int().tolist() == [[0, 0, 0, 0, 1, 1, 1, 1] + [0, 0] + [1] * 6]
    # a canvas with nothing free: all "done", which keeps it clean
    done, ahead = block_states(torch.zeros(1, 8, dtype=torch.bool), torch.tensor([[0.3]]), 8, 2)
    assert done.all() and not ahead.any()
    with pytest.raises(ValueError, match="blocks of 3"):
        block_states(torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, 1), 8, 3)
