"""``torch.compile`` of the model's forward for decoding: opt-in, measured, never silent.

:class:`CompiledModel` stands in for a :class:`~dgemma.models.transformer.DiffusionGemma`
wherever a sampler takes one (``CanvasSampler``, ``ar_generate``): calling it runs the compiled
forward, every other attribute (``config``, ``logits``, ``parameters``...) is the model's own.
It compiles with dynamic shapes, so the growing KV cache does not recompile: one graph per kind
of call (prefill/append, denoising step, AR step), each compiled at its first call, which
:attr:`CompiledModel.compile_s` counts.

What the graph cannot do is done eagerly before each call, by the same code the eager forward
runs: the rotary tables are grown to the largest position
(``dgemma/models/primitives.py:Rotary.cover``; inside a graph ``Rotary.forward`` reads them as
they are) and ``write`` is resolved and checked
(``dgemma/models/transformer.py:DiffusionGemma.resolve_write``). Both are host syncs eager
decoding pays anyway.

Measured on this project's 2-core AMD EPYC (AVX512-BF16), Gemma 3 270M in bf16, 64-token prompt,
idle (``dgemma bench decode --only step_cost --compile``; ``docs/benchmarks.md``): the AR step and
16-32-token denoising steps cost the same as eager, 64-256-token forwards 20-30 % less, and each
graph took 50-59 s to compile, so it is off by default on a CPU (``--compile``).
"""

from __future__ import annotations

import time

import torch

from dgemma.models.masks import TokenInfo


class CompiledModel:
    """``model`` with its forward compiled by inductor (``dynamic=True``); see the module doc."""

    def __init__(self, model, *, mode: str | None = None):
        self.module = model
        self._forward = torch.compile(model.forward, dynamic=True, mode=mode)
        self._seen: set[tuple] = set()  # kinds of call already compiled
        self.compile_s = 0.0  # seconds spent in the first call of each kind (tracing + compiling + running once)
        self.compiles = 0

    def __getattr__(self, name):  # only reached for names this wrapper lacks
        return getattr(self.__dict__["module"], name)

    def __call__(self, input_ids: torch.Tensor, *, info: TokenInfo | None = None, cache=None,
                 write: bool | None = None, append: int = 0, selfcond: torch.Tensor | None = None,
                 t: torch.Tensor | None = None, return_hidden: bool = False,
                 partial: tuple[int | torch.Tensor, TokenInfo] | None = None) -> torch.Tensor:
        model = self.module
        if info is None:  # the model's defaults read the cache on the host: run them eagerly
            return model(input_ids, info=info, cache=cache, write=write, append=append, selfcond=selfcond,
                         t=t, return_hidden=return_hidden, partial=partial)
        write = model.resolve_write(info, write, append)
        for rotary in model.rotary.values():
            rotary.cover(info.positions)
        kind = (cache is not None, write, append, selfcond is not None, t is not None, return_hidden,
                torch.is_grad_enabled(), partial is not None)
        first = kind not in self._seen
        t0 = time.perf_counter()
        out = self._forward(input_ids, info=info, cache=cache, write=write, append=append, selfcond=selfcond,
                            t=t, return_hidden=return_hidden, partial=partial)
        if first:
            self._seen.add(kind)
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
        return out
