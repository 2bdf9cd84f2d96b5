"""Wrappers around a :class:`~dgemma.diffusion.sampler.CanvasSampler`'s noise process and step
that serving and the lm-evaluation-harness model need, without changing the sampler.

:class:`RowSeeded` gives every batch row its own random stream. The sampler draws from one
generator for the whole batch, so a row's sample depends on which rows share its batch and in
what order; with ``RowSeeded`` row ``r`` draws only from ``generators[r]``, exactly what a
batch of one seeded with that generator draws. A request's output is then the same whatever
batch it runs in (up to floating-point differences of the batched forward, which do not
change a sample in practice).

:class:`TopPStep` is nucleus (top-p) filtering in front of any step that samples through
``softmax(logits / T)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dgemma.diffusion.steps import CanvasState, EntropyBoundStep
from dgemma.errors import DGemmaError


def emitted_canvases(tokens: Tensor, committed: Tensor, argmax: Tensor | None, *, last: bool) -> Tensor:
    """The canvases the sampler emits for rows that end at a step (its ``on_step`` arguments):
    the tokens after the schedule's last step or once every position is committed, the argmax
    canvas on an early stop. ``argmax`` is None when the LM head ran only where the step reads
    (``CanvasSampler.hook_reads_guesses=False``): no row stops early then."""
    if last or argmax is None:
        return tokens
    return torch.where(committed.all(-1, keepdim=True), tokens, argmax)


def _cat_states(states: Sequence[CanvasState]) -> CanvasState:
    fields = {}
    for f in dataclasses.fields(CanvasState):
        parts = [getattr(s, f.name) for s in states]
        fields[f.name] = None if any(p is None for p in parts) else torch.cat(parts, 0)
    return CanvasState(**fields)


class _Noise:
    """The sampler's noise process: a canvas's initial noise is drawn row by row."""

    def __init__(self, owner: RowSeeded):
        self._owner = owner

    def noise_like(self, shape, *, generator=None, device=None) -> Tensor:
        return self._owner._start_canvas(tuple(shape), device)

    def __getattr__(self, name):  # mask_token_id, schedule, vocab_size ...
        if name == "_owner":
            raise AttributeError(name)
        return getattr(self._owner.noise, name)


class _Step:
    """The sampler's step: run row by row, each row with its own generator."""

    def __init__(self, owner: RowSeeded):
        self._owner = owner

    def __call__(self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator=None,
                 is_last: bool) -> CanvasState:
        return self._owner._step(state, logits, t, s, is_last)

    def __getattr__(self, name):  # commits, sampling_temperature, the step's settings
        if name == "_owner":
            raise AttributeError(name)
        return getattr(self._owner.step, name)


class RowSeeded:
    """Per-row random streams for a batched sampler (see the module docstring).

    ``CanvasSampler(**rs.kwargs(), num_steps=..., stop_ids=..., ...)`` with ``rs =
    RowSeeded(noise, step, generators, num_steps=..., stop_ids=...)``; the sampler's own
    ``generator`` argument is then never drawn from. One instance serves one sampler call.

    Which original rows a call covers follows from the sampler's documented ``on_step`` hook:
    after each step it names the rows and which of them ended their canvas
    (:func:`emitted_canvases` says what each emitted); a canvas holding a stop token ends its row.
    ``num_steps`` and ``stop_ids`` must be the sampler's. ``on_step`` is
    the caller's own hook, called after the bookkeeping.
    """

    def __init__(self, noise, step, generators: Sequence[torch.Generator], *, num_steps: int,
                 stop_ids: Sequence[int], on_step: Callable | None = None):
        if not generators:
            raise DGemmaError("RowSeeded needs one generator per batch row")
        self.noise, self.step, self.generators = noise, step, list(generators)
        self.num_steps, self.stop_ids, self.user_hook = num_steps, set(int(i) for i in stop_ids), on_step
        self.active = list(range(len(self.generators)))  # rows of the current canvas batch
        self.running: list[int] = []  # rows of the current canvas still denoising
        self.ended: set[int] = set()  # rows of the current canvas whose emitted canvas holds a stop token

    def _start_canvas(self, shape: tuple[int, ...], device) -> Tensor:
        if shape[0] != len(self.active):
            raise RuntimeError(f"RowSeeded lost track of the batch: {shape[0]} rows, expected {len(self.active)}")
        self.running, self.ended = list(self.active), set()
        return torch.cat([self.noise.noise_like((1, *shape[1:]), generator=self.generators[r], device=device)
                          for r in self.active], 0)

    def _step(self, state: CanvasState, logits: Tensor, t: float, s: float, is_last: bool) -> CanvasState:
        if state.tokens.shape[0] != len(self.running):
            raise RuntimeError(f"RowSeeded lost track of the batch: {state.tokens.shape[0]} rows, "
                               f"expected {len(self.running)}")
        return _cat_states([self.step(state.select(torch.tensor([j], device=logits.device)), logits[j:j + 1], t, s,
                                      generator=self.generators[r], is_last=is_last)
                            for j, r in enumerate(self.running)])

    def on_step(self, *, canvas, step, t, rows, tokens, committed, argmax, done, reused=False) -> None:
        """The hook to hand the sampler: keeps track of the rows, then calls the caller's hook."""
        flags = done.tolist()
        emitted = emitted_canvases(tokens, committed, argmax, last=step == self.num_steps - 1)
        for j, (r, d) in enumerate(zip(rows, flags)):
            if d and self.stop_ids.intersection(emitted[j].tolist()):
                self.ended.add(r)
        self.running = [r for r, d in zip(rows, flags) if not d]
        if not self.running:  # the canvas is over: rows that emitted a stop token leave the batch
            self.active = [r for r in self.active if r not in self.ended]
        if self.user_hook is not None:
            self.user_hook(canvas=canvas, step=step, t=t, rows=rows, tokens=tokens, committed=committed,
                           argmax=argmax, done=done)

    def kwargs(self) -> dict:
        """``noise``, ``step`` and ``on_step`` for the CanvasSampler."""
        return {"noise": _Noise(self), "step": _Step(self), "on_step": self.on_step}


def top_p_filter(logits: Tensor, top_p: float, temperature: float) -> Tensor:
    """``logits`` with every token outside the nucleus of ``softmax(logits / T)`` set to ``-inf``:
    the smallest set of most probable tokens whose mass reaches ``top_p`` (the most probable
    token always stays)."""
    probs = torch.softmax(logits.float() / temperature, -1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    outside = torch.cumsum(sorted_p, -1) - sorted_p >= top_p  # the mass before a token already reaches top_p
    drop = torch.zeros_like(outside).scatter(-1, order, outside)
    return logits.masked_fill(drop, float("-inf"))


class TopPStep:
    """Nucleus sampling for a step that samples ``x0 ~ softmax(logits / T)`` (``commit``,
    ``confidence``, ``ddim``): the step sees logits outside the top-p nucleus at ``-inf``, so it
    draws from the renormalised nucleus and ranks confidences under it.

    At ``T = 0`` (greedy) the step is left alone: the argmax is always in the nucleus, and
    renormalising would only change the confidences that order the commits. ``entropy_bound``
    draws at its own temperature schedule and measures entropies of the full distribution,
    which a truncated one would make meaningless: it is refused.
    """

    def __init__(self, step, top_p: float):
        if isinstance(step, EntropyBoundStep):
            raise DGemmaError("top_p is not available with the entropy_bound step (it measures the entropy of "
                              "the full distribution); use step_type commit, confidence or ddim, or top_p=1")
        if not 0.0 < top_p <= 1.0:
            raise DGemmaError(f"top_p must lie in (0, 1], got {top_p}")
        self.step, self.top_p = step, float(top_p)
        self.temperature = float(getattr(step, "temperature", 0.0))

    def __getattr__(self, name):  # commits, noise, schedule ...: the wrapped step's
        if name == "step":
            raise AttributeError(name)
        return getattr(self.step, name)

    def __call__(self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator, is_last: bool):
        if self.top_p < 1.0 and self.temperature > 0:
            logits = top_p_filter(logits, self.top_p, self.temperature)
        return self.step(state, logits, t, s, generator=generator, is_last=is_last)
