"""Forward corruption processes ``q(x_t | x0)`` (docs/design.md §2).

Both processes keep each token independently with probability ``alpha(t)`` and otherwise
replace it by a draw from their noise distribution:

- :class:`UniformNoise` (uniform-state, D3PM): a token drawn uniformly from the whole
  vocabulary, which may be the token itself, so ``P(x_t == x0) = alpha + (1 - alpha) / V``.
  There is no mask token. Default for adapting pretrained Gemma.
- :class:`AbsorbingNoise` (masked): the mask token.

Every draw comes from the caller's ``torch.Generator`` (never the global RNG), and a call
consumes the same random numbers whatever the inputs' values, so runs replay bit for bit.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from dgemma.diffusion.schedules import Schedule
from dgemma.errors import DGemmaError


@runtime_checkable
class NoiseProcess(Protocol):
    schedule: Schedule

    def q_sample(
        self, x0: Tensor, t: Tensor, *, generator: torch.Generator, where: Tensor | None = None
    ) -> Tensor: ...

    def noise_like(
        self, shape: tuple[int, ...], *, generator: torch.Generator, device: torch.device | str | None = None
    ) -> Tensor: ...


def _column(t: Tensor | float, batch: int, device: torch.device) -> Tensor:
    """``t`` (float, scalar or ``[B]``) as an fp64 ``[B or 1, 1]`` column on ``device``."""
    t = torch.as_tensor(t, dtype=torch.float64, device=device)
    if t.dim() == 0:
        return t.view(1, 1)
    if t.shape != (batch,):
        raise ValueError(f"expected one time per row, shape ({batch},), got {tuple(t.shape)}")
    return t.view(batch, 1)


class _KeepOrReplace:
    """Shared ``q_sample``: keep with probability ``alpha(t)``, else take ``noise_like``."""

    schedule: Schedule

    def noise_like(
        self, shape: tuple[int, ...], *, generator: torch.Generator, device: torch.device | str | None = None
    ) -> Tensor:
        raise NotImplementedError

    def q_sample(
        self, x0: Tensor, t: Tensor, *, generator: torch.Generator, where: Tensor | None = None
    ) -> Tensor:
        """Corrupt ``x0 [B, L]`` at times ``t [B]``; positions outside ``where [B, L]`` stay clean."""
        if x0.dim() != 2 or x0.dtype != torch.long:
            raise ValueError(f"x0 must be a [B, L] long tensor, got {tuple(x0.shape)} {x0.dtype}")
        if where is not None and where.shape != x0.shape:
            raise ValueError(f"where must match x0's shape {tuple(x0.shape)}, got {tuple(where.shape)}")
        alpha = self.schedule.alpha(_column(t, x0.shape[0], x0.device))
        keep = torch.rand(x0.shape, generator=generator, device=x0.device) < alpha
        noise = self.noise_like(tuple(x0.shape), generator=generator, device=x0.device)
        if where is not None:
            keep = keep | ~where
        return torch.where(keep, x0, noise)


class UniformNoise(_KeepOrReplace):
    """Uniform-state noise over a vocabulary of ``vocab_size`` tokens."""

    def __init__(self, vocab_size: int, schedule: Schedule):
        if vocab_size < 2:
            raise DGemmaError(f"uniform noise needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.schedule = schedule

    def noise_like(
        self, shape: tuple[int, ...], *, generator: torch.Generator, device: torch.device | str | None = None
    ) -> Tensor:
        device = generator.device if device is None else device
        return torch.randint(0, self.vocab_size, shape, generator=generator, device=device)

    def posterior(
        self, x_t: Tensor, x0: Tensor, t: Tensor | float, s: Tensor | float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Exact ``q(x_s | x_t, x0)`` for ``s <= t``, as fp64 ``(p_x0, p_xt, p_other)``, each ``[B, L]``.

        Bayes with ``q(x_t | x_s) = a_ts * delta + (1 - a_ts) / V`` (``a_ts = alpha(t) / alpha(s)``)
        and ``q(x_s | x0) = alpha(s) * delta + (1 - alpha(s)) / V``. ``p_other`` is the total mass
        of the tokens that are neither ``x0`` nor ``x_t`` (``V - 2`` of them, or ``V - 1`` where
        ``x0 == x_t``), spread evenly over them. Where ``x0 == x_t`` the shared token's mass is in
        ``p_x0`` and ``p_xt`` is 0. At ``s = 0`` the posterior is ``x0`` with probability 1.
        """
        if isinstance(t, (int, float)) and isinstance(s, (int, float)) and s > t:
            raise ValueError(f"posterior needs s <= t, got s={s}, t={t}")
        batch = x_t.shape[0]
        a_t = self.schedule.alpha(_column(t, batch, x_t.device))
        a_s = self.schedule.alpha(_column(s, batch, x_t.device))
        a_ts = torch.where(a_s > 0, a_t / a_s.clamp_min(1e-300), torch.zeros_like(a_t)).clamp(0.0, 1.0)
        inv_v = 1.0 / self.vocab_size
        t_off = (1.0 - a_ts) * inv_v  # q(x_t = k | x_s = j), j != k
        t_on = a_ts + t_off  # q(x_t = k | x_s = k)
        s_off = (1.0 - a_s) * inv_v  # q(x_s = j | x0 = i), j != i
        s_on = a_s + s_off  # q(x_s = i | x0 = i)
        same = x0 == x_t
        w_x0 = torch.where(same, t_on * s_on, t_off * s_on)
        w_xt = torch.where(same, torch.zeros_like(w_x0), t_on * s_off)
        n_other = torch.where(same, self.vocab_size - 1.0, self.vocab_size - 2.0)
        w_other = n_other * t_off * s_off
        z = w_x0 + w_xt + w_other
        return w_x0 / z, w_xt / z, w_other / z


class AbsorbingNoise(_KeepOrReplace):
    """Absorbing-state (masked) noise: a corrupted token becomes ``mask_token_id``."""

    def __init__(self, mask_token_id: int, schedule: Schedule):
        if mask_token_id < 0:
            raise DGemmaError(f"mask_token_id must be a token id >= 0, got {mask_token_id}")
        self.mask_token_id = int(mask_token_id)
        self.schedule = schedule

    def noise_like(
        self, shape: tuple[int, ...], *, generator: torch.Generator, device: torch.device | str | None = None
    ) -> Tensor:
        device = generator.device if device is None else device
        return torch.full(shape, self.mask_token_id, dtype=torch.long, device=device)


def block_states(free: Tensor, u: Tensor, canvas_size: int, block: int) -> tuple[Tensor, Tensor]:
    """Where a left-to-right block sampler stands in each canvas: ``(done, ahead)``, both ``[B, N*C]``.

    ``free [B, N*C]`` marks the positions that may be noised; ``u [B, N]`` in ``[0, 1)`` picks, per
    canvas, one of its blocks of ``block`` positions that hold a free position, uniformly: the
    block being decoded. ``done`` is every position before it (committed: kept clean), ``ahead``
    every position after it (not started: all noise); the block itself keeps the i.i.d. draw at
    the row's ``t``. These are the states ``eval_ds.commit_block`` visits, which i.i.d. masking
    almost never draws (a clean prefix with everything after a block masked). Example,
    ``C = 8, block = 2``, every position free, ``u = [[0.5]]`` (the third of four blocks)::

        done  = [1 1 1 1 0 0 0 0]
        ahead = [0 0 0 0 0 0 1 1]
    """
    b, length = free.shape
    n = length // canvas_size
    if length != n * canvas_size or canvas_size % block:
        raise ValueError(f"{length} positions are not canvases of {canvas_size} in blocks of {block}")
    per = canvas_size // block
    has = free.view(b, n, per, block).any(-1)  # [B, N, per] blocks holding a free position
    rank = (u * has.sum(-1)).floor().long()  # [B, N] which of them
    current = (has.cumsum(-1) <= rank.unsqueeze(-1)).sum(-1)  # [B, N] its index (per: no free block)
    blk = torch.arange(per, device=free.device).repeat_interleave(block)  # [C] block of each position
    done = blk.view(1, 1, -1) < current.unsqueeze(-1)
    ahead = blk.view(1, 1, -1) > current.unsqueeze(-1)
    return done.reshape(b, length), ahead.reshape(b, length)


NOISES: dict[str, type] = {"uniform": UniformNoise, "absorbing": AbsorbingNoise}


def build_noise(name: str, schedule: Schedule, **kw: Any) -> NoiseProcess:
    """``build_noise("uniform", s, vocab_size=V)`` or ``build_noise("absorbing", s, mask_token_id=m)``."""
    if name not in NOISES:
        raise DGemmaError(f"unknown noise process {name!r}; choose one of {sorted(NOISES)}")
    cls = NOISES[name]
    try:
        inspect.signature(cls).bind(schedule=schedule, **kw)
    except TypeError as e:
        raise DGemmaError(f"bad arguments for {name!r} noise: {e}") from None
    return cls(schedule=schedule, **kw)
