"""Noise schedules and time grids (docs/design.md §2).

Time runs from ``t = 0`` (clean) to ``t = 1`` (pure noise). A schedule gives ``alpha(t)``, the
probability that a token is still clean at time ``t``: ``alpha(0) = 1``, ``alpha(1) = 0``,
non-increasing in between.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dgemma.errors import DGemmaError


@runtime_checkable
class Schedule(Protocol):
    name: str

    def alpha(self, t: Tensor) -> Tensor: ...


class LinearSchedule:
    """``alpha(t) = 1 - t`` (the adapter's)."""

    name = "linear"

    def alpha(self, t: Tensor) -> Tensor:
        return (1.0 - t).clamp(0.0, 1.0)


class CosineSchedule:
    """``alpha(t) = cos(pi/2 * t)`` (Lite's; the form MDLM/BD3-LM call "cosine").

    Computed as ``sin(pi/2 * (1 - t))``, the same function, because in fp32 ``cos(pi/2)`` is
    ``-4.4e-8`` while ``sin(0)`` is exactly 0: both endpoints come out exact.
    """

    name = "cosine"

    def alpha(self, t: Tensor) -> Tensor:
        return torch.sin((math.pi / 2) * (1.0 - t)).clamp(0.0, 1.0)


SCHEDULES: dict[str, type] = {"linear": LinearSchedule, "cosine": CosineSchedule}


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]()
    except KeyError:
        raise DGemmaError(f"unknown noise schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None


def sample_t(
    batch: int, *, generator: torch.Generator, eps: float = 1e-4, device: torch.device | str | None = None
) -> Tensor:
    """One training time per example, uniform on ``[eps, 1 - eps]``, as fp32 ``[batch]``.

    Drawn on the generator's device unless ``device`` says otherwise (they must agree).
    """
    if not 0.0 <= eps < 0.5:
        raise DGemmaError(f"time eps must lie in [0, 0.5), got {eps}")
    device = generator.device if device is None else device
    u = torch.rand(batch, generator=generator, device=device)
    return eps + (1.0 - 2.0 * eps) * u


def time_grid(num_steps: int, *, t_max: float = 1.0, t_min: float = 0.0) -> Tensor:
    """``num_steps + 1`` decreasing times (fp64, CPU); step ``i`` goes ``grid[i] -> grid[i+1]``.

    ``grid[:num_steps]`` is the evenly spaced ramp from ``t_max`` towards ``t_min``
    (``linspace(t_max, t_min, num_steps + 1)`` without its last point) and ``grid[-1]`` is
    always 0, so the last step fully denoises. With the default ``t_min = 0`` the grid is
    exactly ``linspace(t_max, 0, num_steps + 1)``; with ``t_min > 0`` the last step jumps from
    ``grid[-2]`` to 0.
    """
    if num_steps < 1:
        raise DGemmaError(f"num_steps must be >= 1, got {num_steps}")
    if not 0.0 <= t_min < t_max <= 1.0:
        raise DGemmaError(f"need 0 <= t_min < t_max <= 1, got t_min={t_min}, t_max={t_max}")
    # (k / N) exactly, as transformers' DiffusionGemma computes its step fraction
    grid = t_min + (t_max - t_min) * (torch.arange(num_steps, -1, -1, dtype=torch.float64) / num_steps)
    grid[-1] = 0.0
    return grid
