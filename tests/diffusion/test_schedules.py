import math

import pytest
import torch

from dgemma.diffusion.schedules import CosineSchedule, LinearSchedule, get_schedule, sample_t, time_grid
from dgemma.errors import DGemmaError

SCHEDULES = ["linear", "cosine"]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_endpoints_are_exact(name, dtype):
    a = get_schedule(name).alpha(torch.tensor([0.0, 1.0], dtype=dtype))
    assert a.tolist() == [1.0, 0.0]
    assert a.dtype == dtype


@pytest.mark.parametrize("name", SCHEDULES)
def test_strictly_decreasing_inside(name):
    t = torch.linspace(0, 1, 1001, dtype=torch.float64)
    a = get_schedule(name).alpha(t)
    assert (a[1:] < a[:-1]).all()
    assert ((a >= 0) & (a <= 1)).all()


def test_values():
    t = torch.tensor([0.25, 0.5, 0.9], dtype=torch.float64)
    torch.testing.assert_close(LinearSchedule().alpha(t), 1 - t)
    torch.testing.assert_close(CosineSchedule().alpha(t), torch.cos(math.pi / 2 * t))


def test_unknown_schedule():
    with pytest.raises(DGemmaError, match="cosine"):
        get_schedule("sqrt")


def test_sample_t_range_mean_and_seed():
    g = torch.Generator().manual_seed(3)
    rng = torch.get_rng_state()
    t = sample_t(200_000, generator=g, eps=0.1)
    assert torch.equal(torch.get_rng_state(), rng)  # global RNG untouched
    assert t.shape == (200_000,) and t.dtype == torch.float32
    assert t.min() >= 0.1 and t.max() <= 0.9
    assert abs(t.mean().item() - 0.5) < 0.003
    assert abs(((t < 0.3).float().mean() - 0.25).item()) < 0.005  # uniform: P(t < 0.3) = 0.2 / 0.8
    t1 = sample_t(64, generator=torch.Generator().manual_seed(7))
    t2 = sample_t(64, generator=torch.Generator().manual_seed(7))
    t3 = sample_t(64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(t1, t2) and not torch.equal(t1, t3)
    assert t1.min() >= 1e-4 and t1.max() <= 1 - 1e-4
    with pytest.raises(DGemmaError):
        sample_t(4, generator=g, eps=0.5)


def test_time_grid_default():
    g = time_grid(4)
    assert g.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    torch.testing.assert_close(time_grid(7, t_max=0.9), torch.linspace(0.9, 0.0, 8, dtype=torch.float64))
    # exactly k / N, the step fraction transformers' DiffusionGemma schedules its temperature with
    assert time_grid(48).tolist() == [k / 48 for k in range(48, -1, -1)]


def test_time_grid_last_target_is_zero():
    g = time_grid(3, t_max=0.8, t_min=0.2)
    torch.testing.assert_close(g, torch.tensor([0.8, 0.6, 0.4, 0.0], dtype=torch.float64))
    assert (g[1:] < g[:-1]).all()
    assert time_grid(1).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("kw", [dict(num_steps=0), dict(num_steps=4, t_max=1.5), dict(num_steps=4, t_min=-0.1),
                                dict(num_steps=4, t_max=0.3, t_min=0.3)])
def test_time_grid_rejects(kw):
    with pytest.raises(DGemmaError):
        time_grid(**kw)
