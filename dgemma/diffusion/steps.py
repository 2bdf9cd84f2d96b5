"""Denoising steps of the canvas sampler (docs/design.md §4), one small class per rule.

A step maps the canvas at time ``t`` and the model's raw logits to the canvas at time ``s < t``:
``step(state, logits [B, C, V], t, s, *, generator, is_last) -> CanvasState``. Steps are pure:
they see only the state, the logits and the caller's generator, apply their own temperature,
and return a new state without touching the old one. Any step leaves positions that are
already ``committed`` untouched, so a caller may pin tokens by committing them up front.

Temperature 0 means greedy: the prediction is the argmax and its confidence is its probability
under the untempered softmax (a zero-temperature distribution would give every position
confidence 1 and nothing to rank by).
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.diffusion.corruption import NoiseProcess, UniformNoise
from dgemma.diffusion.schedules import Schedule, time_grid
from dgemma.diffusion.stopping import argmax_ids, token_entropy
from dgemma.errors import DGemmaError


@dataclass
class CanvasState:
    """One canvas per row: ``tokens [B, C]`` (the current ``x_t``), ``committed [B, C]`` (final
    for good), and the previous step's prediction and confidence (None before the first step).

    ``pinned [B, C]`` marks known tokens given before sampling (infilling, e.g. Sudoku clues):
    they start committed, and the commit schedule paces only the free positions.

    ``unread [B, C]`` marks open positions whose logits the sampler did not compute for this
    step (:meth:`StepRule.reads`): their rows hold their own token's one-hot, a greedy prediction
    takes them as closed, and no step commits them. A step's new state drops the mark.
    """

    tokens: Tensor
    committed: Tensor
    prev_pred: Tensor | None = None
    prev_conf: Tensor | None = None
    pinned: Tensor | None = None
    unread: Tensor | None = None

    @classmethod
    def from_noise(
        cls, noise: NoiseProcess, batch: int, canvas: int, *, generator: torch.Generator, device=None
    ) -> CanvasState:
        """A pure-noise canvas with nothing committed (the start of every canvas)."""
        tokens = noise.noise_like((batch, canvas), generator=generator, device=device)
        return cls(tokens=tokens, committed=torch.zeros_like(tokens, dtype=torch.bool))

    def select(self, rows: Tensor) -> CanvasState:
        """The state of the rows ``rows`` (indices or a bool mask), to follow a shrinking batch."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return CanvasState(pick(self.tokens), pick(self.committed), pick(self.prev_pred), pick(self.prev_conf),
                           pick(self.pinned), pick(self.unread))

    def pin(self, hint: Tensor) -> CanvasState:
        """Fix the tokens of ``hint [B, C]`` where it is ``>= 0`` (``-1`` = free)."""
        pinned = hint >= 0
        return CanvasState(torch.where(pinned, hint, self.tokens), self.committed | pinned, self.prev_pred,
                           self.prev_conf, pinned, self.unread)


class Step(Protocol):
    """What the sampler asks of a step: the call, and three facts about it. A step may also say
    which positions it reads (:meth:`StepRule.reads`); one that does not is read everywhere."""

    commits: bool  # committed positions are final: the sampler skips their vocabulary work
    needs_uniform: bool  # the rule reads the uniform-noise posterior (refused with absorbing noise)

    def sampling_temperature(self, t: float, default: float) -> float:
        """The temperature the self-conditioning signal and the stopping entropy read at ``t``."""

    def __call__(
        self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator: torch.Generator, is_last: bool
    ) -> CanvasState: ...


class StepRule:
    """Base of the built-in steps: the :class:`Step` facts' defaults and construction from a
    :class:`~dgemma.sampling.SamplerConfig` (:meth:`from_settings`, each rule reading the
    settings it has), so no caller needs to know which rule takes which argument."""

    commits = False
    needs_uniform = False
    default_temperature = 0.0  # the rule's temperature when a caller names none

    def sampling_temperature(self, t: float, default: float) -> float:
        return default

    def reads(self, state: CanvasState, s: float, s_next: float | None, *, is_last: bool) -> Tensor | None:
        """``[B, C]``: the positions whose logits this step (to time ``s``) and the next one (to
        ``s_next``; None when the next is the last or there is none) read, or None for every open
        position. A sampler that needs the logits for nothing else (no self-conditioning signal,
        stopping rule or trace) runs the LM head on these only. The default reads everything."""
        return None

    @classmethod
    def from_settings(cls, settings, noise) -> "StepRule":
        raise NotImplementedError


def predict(logits: Tensor, temperature: float, generator: torch.Generator,
            state: "CanvasState | None" = None) -> tuple[Tensor, Tensor]:
    """Sample ``x0 [B, C]`` from ``softmax(logits / T)`` and return it with its probability.

    ``T = 0`` is greedy (see the module docstring). Computed in fp32. Given the ``state``, a
    greedy prediction runs the vocabulary softmax on the open positions only: a committed
    position predicts its own token with probability 1, which is what the softmax of its row
    gives when the sampler wrote that row as a one-hot (``dgemma/diffusion/sampler.py:vocab_logits``),
    and what a commit rule never reads otherwise (committed positions are final). So does an
    ``unread`` one, which no rule commits at this step.
    """
    closed = None if state is None else state.committed if state.unread is None else state.committed | state.unread
    if temperature <= 0 and closed is not None and bool(closed.any()):
        open_ = ~closed
        pred = state.tokens.clone()
        conf = torch.ones(open_.shape, dtype=torch.float32, device=logits.device)
        if bool(open_.any()):
            conf[open_], pred[open_] = _greedy(logits, open_)
        return pred, conf
    if temperature <= 0:
        conf, pred = _greedy(logits, None)
        return pred.view(logits.shape[:-1]), conf.view(logits.shape[:-1])
    logits = logits.float()
    probs = F.softmax(logits / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    pred = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return pred, probs.gather(-1, pred.unsqueeze(-1)).squeeze(-1)


def _greedy(logits: Tensor, open_: Tensor | None) -> tuple[Tensor, Tensor]:
    """fp32 probability and index of each open row's argmax: from the shared :func:`open_softmax`,
    except for fp64 logits, whose self-conditioning signal stays fp64 while a prediction reads fp32."""
    if logits.dtype != torch.float64:
        out = open_softmax(logits, open_)
        return out.conf, out.pred
    return F.softmax(_open_rows(logits, open_).float(), dim=-1).max(dim=-1)


@dataclass(frozen=True)
class OpenSoftmax:
    """The plain softmax of a canvas's open rows (:func:`open_softmax`)."""

    conf: Tensor  # [N] fp32: the argmax's probability
    pred: Tensor  # [N] the argmax
    probs: Tensor | None  # [N, V]: in the logits' dtype where that is narrower than fp32 (the product reads it
    #                       so); None where the sampler said no signal reads them (remember_open_rows)


SOFTMAX_ROWS = 16  # rows an fp32 chunk: 16 MB at V = 262,144, below glibc's 32 MB mmap threshold


def open_softmax(logits: Tensor, open_: Tensor | None) -> OpenSoftmax:
    """``softmax(logits[open_])`` over ``N`` open positions (every position, ``N = B * C``, when
    ``open_`` is None or all True), computed once for the last ``logits [B, C, V]`` asked about.

    A greedy step's prediction (max and argmax) and the next step's self-conditioning signal
    (``probs @ E``) read the same softmax: at Gemma's 262,144 tokens a second one cost ~10 ms of a
    ~125 ms PubMedQA pass at batch 1 (``docs/benchmarks.md``). It is computed in fp32; for bf16
    logits 16 rows at a time, each chunk's max taken and its probabilities stored in bf16 (what the
    product reads), so no ``[N, V]`` fp32 tensor exists: at batch 16 that is ~280 MB, mapped fresh
    and faulted in at every pass. Each row's values are those of one fp32 softmax of all rows. The
    memo is keyed on the logits object (weakly: dropped with them), their in-place version and the
    mask's values; :func:`remember_open_rows` hands it the rows the LM head produced, so they are
    not gathered back out of ``logits``.
    """
    whole = open_ is None or bool(open_.all())
    key = (logits._version, None if whole else open_.clone())
    seen = tuple(_OPEN)  # one snapshot: another thread (the playground's) may replace the memo meanwhile
    slot = seen if seen and seen[0]() is logits and _same_key(seen[1], key) else None
    if slot is not None and slot[3] is not None:
        return slot[3]
    rows = slot[2] if slot is not None else _open_rows(logits, open_)
    keep = slot is None or slot[4]
    work = torch.promote_types(rows.dtype, torch.float32)
    if work == rows.dtype:  # fp32 or fp64 logits: one softmax, kept as it is
        probs = F.softmax(rows, dim=-1)
        conf, pred = probs.max(dim=-1)
    else:
        probs = torch.empty_like(rows) if keep else None
        conf = torch.empty(rows.shape[0], dtype=work, device=rows.device)
        pred = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
        for i in range(0, rows.shape[0], SOFTMAX_ROWS):
            chunk = F.softmax(rows[i:i + SOFTMAX_ROWS].to(work), dim=-1)
            torch.max(chunk, dim=-1, out=(conf[i:i + SOFTMAX_ROWS], pred[i:i + SOFTMAX_ROWS]))
            if keep:
                probs[i:i + SOFTMAX_ROWS] = chunk
    out = OpenSoftmax(conf=conf, pred=pred, probs=probs)
    _OPEN[:] = [weakref.ref(logits, _forget), key, None, out, keep]
    return out


def remember_open_rows(logits: Tensor, open_: Tensor, rows: Tensor, *, keep_probs: bool = True) -> None:
    """Tell :func:`open_softmax` that ``rows [N, V]`` are ``logits[open_]`` (the sampler's LM head
    output, before it wrote them into the canvas's ``logits``). ``keep_probs=False``: nothing
    will ask for the probabilities (no self-conditioning signal), so narrow ones are not kept."""
    _OPEN[:] = [weakref.ref(logits, _forget), (logits._version, open_.clone()), rows, None, keep_probs]


_OPEN: list = []  # [weakref to the logits, (version, open mask or None), open rows | None, OpenSoftmax | None,
#                   whether to keep the probabilities]


def _open_rows(logits: Tensor, open_: Tensor | None) -> Tensor:
    return logits.reshape(-1, logits.shape[-1]) if open_ is None or bool(open_.all()) else logits[open_]


def _forget(ref: weakref.ref) -> None:
    if _OPEN and _OPEN[0] is ref:  # the remembered logits died: free what was kept for them
        _OPEN.clear()


def _same_key(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    return a[1] is None or (a[1].shape == b[1].shape and torch.equal(a[1], b[1]))


def _check_temperature(temperature: float) -> float:
    if not temperature >= 0:
        raise DGemmaError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    return float(temperature)


def _top_k_per_row(score: Tensor, k: Tensor) -> Tensor:
    """Bool mask of the ``k[b]`` highest scores of each row; ties go to the lower position."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(score.shape[-1], device=score.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return rank < k.unsqueeze(-1)


def _renoise(
    state: CanvasState, noise: NoiseProcess, pred: Tensor, conf: Tensor, new: Tensor, generator: torch.Generator
) -> CanvasState:
    """Keep committed tokens, commit ``pred`` at ``new``, redraw every other position from noise."""
    fresh = noise.noise_like(tuple(state.tokens.shape), generator=generator, device=state.tokens.device)
    new = new & ~state.committed
    tokens = torch.where(state.committed, state.tokens, torch.where(new, pred, fresh))
    return CanvasState(tokens=tokens, committed=state.committed | new, prev_pred=pred, prev_conf=conf,
                       pinned=state.pinned)


class DDIMStep(StepRule):
    """The adapter's step: ancestral sampling with the exact uniform-noise posterior.

    Sample ``x0 ~ softmax(logits / T)``. Where ``x0 != x_t``, move to ``x0``, to a fresh noise
    token, or stay at ``x_t`` with the probabilities of ``q(x_s | x_t, x0)``; the noise token is
    drawn uniformly from the ``V - 2`` tokens that are neither, so the new token's marginal is
    exactly that posterior. Where ``x0 == x_t`` the token stays (the adapter's rule); with
    ``resample_agreeing=True`` those positions are drawn from the posterior too (full ancestral
    sampling: at high noise an agreeing token is usually sent back to noise). Nothing is
    committed; the last step targets ``s = 0``, where the posterior is ``x0`` itself.
    """

    needs_uniform = True
    default_temperature = 0.7

    @classmethod
    def from_settings(cls, settings, noise) -> "DDIMStep":
        return cls(noise, temperature=settings.temperature)

    def __init__(self, noise: UniformNoise, temperature: float = 0.7, resample_agreeing: bool = False):
        if not isinstance(noise, UniformNoise):
            raise DGemmaError(f"the ddim step needs uniform noise (its posterior), got {type(noise).__name__}")
        self.noise = noise
        self.temperature = _check_temperature(temperature)
        self.resample_agreeing = bool(resample_agreeing)

    def __call__(
        self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator: torch.Generator, is_last: bool
    ) -> CanvasState:
        x_t = state.tokens
        x0, conf = predict(logits, self.temperature, generator)
        p_x0, _, p_other = self.noise.posterior(x_t, x0, t, 0.0 if is_last else s)
        u = torch.rand(x_t.shape, generator=generator, device=x_t.device, dtype=torch.float64)
        other = self._other_token(x_t, x0, generator)
        new = torch.where(u < p_x0, x0, torch.where(u < p_x0 + p_other, other, x_t))
        frozen = state.committed if self.resample_agreeing else state.committed | (x0 == x_t)
        tokens = torch.where(frozen, x_t, new)
        return replace(state, tokens=tokens, prev_pred=x0, prev_conf=conf)

    def _other_token(self, x_t: Tensor, x0: Tensor, generator: torch.Generator) -> Tensor:
        """A token drawn uniformly from those that are neither ``x_t`` nor ``x0``.

        Draws ``r`` uniform on ``[0, n)`` and skips over the excluded ids in increasing order. fp64
        uniforms keep the bucket bias below 1e-10 even at V = 262,144.
        """
        vocab = self.noise.vocab_size
        same = x0 == x_t
        n = torch.where(same, vocab - 1, vocab - 2)
        u = torch.rand(x_t.shape, generator=generator, device=x_t.device, dtype=torch.float64)
        r = torch.minimum((u * n).long(), n - 1)
        lo = torch.minimum(x0, x_t)
        hi = torch.where(same, torch.full_like(x_t, vocab), torch.maximum(x0, x_t))
        r = r + (r >= lo).long()
        return r + (r >= hi).long()


class CommitStep(StepRule):
    """Lite's step: commit the most confident positions on the schedule's pace, re-noise the rest.

    Predict ``x0`` (greedy at ``T = 0``); among uncommitted positions, those whose prediction
    equals the previous step's with a confidence at least as high come first, then by
    confidence. Commit the top ones until ``ceil(alpha(s) * C)`` positions are committed (the
    clean fraction at the next time); a committed position keeps its prediction at commit time
    for good. Every other uncommitted position is redrawn from pure noise. The last step
    commits everything.

    ``block=B`` makes it semi-autoregressive inside the canvas (LLaDA's remedy for SFT models that
    commit EOS fill first, from the back, until it reaches the front): a step may commit only in
    the leftmost sub-blocks of ``B`` positions that hold enough open positions for its pace, so
    later positions wait for earlier ones. Example, ``C = 8, B = 4``, 3 commits due, positions
    0-1 committed: candidates are positions 2-7 (block 0 has 2 open, too few; blocks 0-1 have 6).

    ``order="margin"`` ranks by the margin between the predicted token's probability and the
    runner-up's instead of by the probability alone (Kim et al. 2025, "Train for the worst, plan
    for the best": on Sudoku a position torn between two digits is not yet decided even when one
    of them has 0.6). Example: probabilities (0.6, 0.4, ...) and (0.5, 0.1, 0.1, ...) rank first and
    second by confidence, second and first by margin (0.2 against 0.4).

    ``stable_first=False`` drops the first key: positions rank by the score alone. The key favours
    a position whose confidence rose at the last step over a more confident one whose confidence
    fell; on Sudoku at one commit a step, where a wrong board starts at one confident early choice,
    ranking by confidence alone solved more hard boards (checkpoints/sudoku_deep/README.md).
    Example: confidences (0.9, 0.8) after (0.95, 0.7) commit position 1 first with the key (its
    confidence rose), position 0 without it.

    ``no_repeat=True`` commits no token equal to a neighbour's: where it would, the position takes
    its runner-up (:func:`swap_repeats`). Positions committed in one pass are predicted
    apart, each from the same masked right-hand side, so a block of 4 often reads "the the"; the
    runner-up is the model's next guess for a position whose neighbour already says "the". It
    costs no pass (checkpoints/pubmedqa_270m/README.md, 2026-12-06). A repeat the text needs
    ("had had") is lost too; the tokens after a stop token, which may repeat it, are cut anyway.
    """

    commits = True  # committed positions are final: the sampler skips their vocabulary work
    ORDERS = ("confidence", "margin")

    @staticmethod
    def passes(schedule: Schedule, num_steps: int, width: int) -> int:
        """Denoising passes a canvas of ``width`` free positions takes on this pace without early
        stopping: the sampler ends a canvas once every position is committed, which on a
        front-loaded schedule (cosine) can come before step ``num_steps``."""
        grid = time_grid(num_steps)
        for i in range(num_steps - 1):
            if math.ceil(float(schedule.alpha(grid[i + 1])) * width - 1e-6) >= width:
                return i + 1
        return num_steps

    @classmethod
    def from_settings(cls, settings, noise) -> "CommitStep":
        return cls(noise, temperature=settings.temperature, block=settings.commit_block, order=settings.commit_order,
                   stable_first=settings.commit_stable_first, no_repeat=settings.commit_no_repeat)

    def __init__(self, noise: NoiseProcess, schedule: Schedule | None = None, temperature: float = 0.0,
                 block: int | None = None, order: str = "confidence", stable_first: bool = True,
                 no_repeat: bool = False):
        if block is not None and block < 1:
            raise DGemmaError(f"commit block must be >= 1 positions, got {block}")
        if order not in self.ORDERS:
            raise DGemmaError(f"commit order {order!r} is unknown; choose one of {', '.join(self.ORDERS)}")
        self.noise = noise
        self.schedule = noise.schedule if schedule is None else schedule
        self.temperature = _check_temperature(temperature)
        self.block = block
        self.order = order
        self.stable_first = stable_first
        self.no_repeat = no_repeat

    def __call__(
        self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator: torch.Generator, is_last: bool
    ) -> CanvasState:
        pred, conf = predict(logits, self.temperature, generator, state)
        open_ = ~state.committed
        if is_last:
            pred = self._swap(logits, pred, open_, state)
            return _renoise(state, self.noise, pred, conf, open_, generator)
        n_new = (self._target(state, s) - state.committed.sum(-1)).clamp_min(0)
        score = (conf if self.order == "confidence" else _margin(logits, pred)).double()
        if self.stable_first and state.prev_pred is not None and state.prev_conf is not None:
            stable = (pred == state.prev_pred) & (conf >= state.prev_conf)
            score = score + 2.0 * stable
        score = score.masked_fill(state.committed, -math.inf)
        if self.block:
            score = score.masked_fill(~_leftmost_blocks(open_, n_new, self.block), -math.inf)
        new = _top_k_per_row(score, n_new) & open_
        return _renoise(state, self.noise, self._swap(logits, pred, new, state), conf, new, generator)

    def _swap(self, logits: Tensor, pred: Tensor, new: Tensor, state: CanvasState) -> Tensor:
        """``pred`` under the no-repeat rule (committed positions read as their committed tokens)."""
        if not self.no_repeat:
            return pred
        return swap_repeats(logits, torch.where(state.committed, state.tokens, pred), new, state.committed)

    def _target(self, state: CanvasState, s: float) -> Tensor:
        """``[B]`` committed positions due at time ``s``: the pinned ones and ``ceil(alpha(s))`` of the free."""
        width = state.tokens.shape[-1]
        alpha_s = float(self.schedule.alpha(torch.tensor(float(s), dtype=torch.float64)))
        n_pin = torch.zeros_like(state.committed[:, 0], dtype=torch.long) if state.pinned is None \
            else state.pinned.sum(-1)
        return n_pin + torch.ceil(alpha_s * (width - n_pin) - 1e-6).long()  # pace the free positions only

    def reads(self, state: CanvasState, s: float, s_next: float | None, *, is_last: bool) -> Tensor | None:
        """With blocks, the leftmost blocks holding this step's commits and, when the next step
        ranks by "unchanged and not weaker", the next step's too (it compares with this step's
        prediction). This step commits its ``n`` in its blocks, so the next one's candidates lie in
        the leftmost blocks holding ``n + n_next`` open positions; an EOS fill after a stop token
        this step commits only closes positions after it. Example, ``C = 8, B = 4``, nothing
        committed, 2 due now and 2 next: positions 0-3."""
        if is_last or not self.block:
            return None
        committed = state.committed.sum(-1)
        n_now = (self._target(state, s) - committed).clamp_min(0)
        n_next = 0 if s_next is None or not self.stable_first else \
            (self._target(state, s_next) - committed - n_now).clamp_min(0)
        return _leftmost_blocks(~state.committed, n_now + n_next, self.block)


def swap_repeats(logits: Tensor, pred: Tensor, new: Tensor, committed: Tensor) -> Tensor:
    """``pred [B, C]`` with no ``new`` position holding a neighbour's token. Scanning left to right,
    a new position whose token equals its left neighbour's (committed, or new and already scanned)
    or its right neighbour's (committed at an earlier step) takes the likeliest token under
    ``logits [B, C, V]`` that equals neither. ``pred`` holds the committed tokens at committed positions.

    Example, position 0 committed, 1-3 new, ``pred = [7 7 7 2]``, each new position's two likeliest
    tokens ``(7, 4)``, ``(7, 5)``, ``(2, 6)`` -> ``[7 4 7 2]``: position 1 repeated the committed 7;
    position 2 no longer repeats the swapped-in 4. ``[7 2 2 2]`` with ``(2, 6)`` everywhere ->
    ``[7 2 6 2]``. Position 3 committed instead, ``[7 2 2 2]`` -> ``[7 2 6 2]`` as well: position 2
    then also avoids the 2 on its right.

    Scans the rows on the host; only a position that repeats reads its row of logits (one argmax
    with the banned tokens masked, about 0.3 ms for a 262,144-token bf16 row on this project's CPU;
    a top-k took 1.1 ms).
    """
    toks, free, done = pred.tolist(), new.tolist(), committed.tolist()
    swapped = False
    for b, row in enumerate(toks):
        for i in range(len(row)):
            if not free[b][i]:
                continue
            banned = {row[i - 1]} if i > 0 and (free[b][i - 1] or done[b][i - 1]) else set()
            if i + 1 < len(row) and done[b][i + 1]:
                banned.add(row[i + 1])
            if row[i] in banned and logits.shape[-1] > len(banned):
                ban = torch.tensor(sorted(banned), device=logits.device)
                row[i] = int(argmax_ids(logits[b, i].clone().index_fill_(0, ban, float("-inf"))))
                swapped = True
    return torch.tensor(toks, dtype=pred.dtype, device=pred.device) if swapped else pred


def _margin(logits: Tensor, pred: Tensor) -> Tensor:
    """``[B, C]``: the probability of ``pred`` minus the highest probability of any other token."""
    probs = F.softmax(logits.float(), dim=-1)
    chosen = probs.gather(-1, pred.unsqueeze(-1))
    return (chosen - probs.scatter(-1, pred.unsqueeze(-1), -1.0).amax(-1, keepdim=True)).squeeze(-1)


def _leftmost_blocks(open_: Tensor, n_new: Tensor, block: int) -> Tensor:
    """``[B, C]``: the positions of each row's leftmost sub-blocks of ``block`` positions that
    together hold at least ``n_new`` open positions (every block if none do)."""
    width = open_.shape[-1]
    blk = torch.arange(width, device=open_.device) // block  # [C]
    per_block = torch.zeros(open_.shape[0], int(blk[-1]) + 1, dtype=torch.long, device=open_.device)
    per_block.scatter_add_(1, blk.expand_as(open_), open_.long())
    last = (per_block.cumsum(-1) < n_new[:, None]).sum(-1)  # [B] index of the last block needed
    return blk[None, :] <= last[:, None]


class ConfidenceStep(StepRule):
    """Threshold step (Fast-dLLM, SDAR): commit every uncommitted position whose confidence
    exceeds ``threshold``; if none does, commit the single most confident one; the last step
    commits everything. Uncommitted positions are redrawn from pure noise, as in CommitStep.

    ``block=B`` (``eval_ds.commit_block``, as for :class:`CommitStep`) is Fast-dLLM's
    semi-autoregressive form: a step considers only the leftmost sub-block of ``B`` positions
    that still has an open one. Example, ``C = 8, B = 4``, positions 0-3 committed, confidences
    0.95 at positions 5 and 6: both commit, and nothing in positions 0-3 or 8-... is looked at.
    """

    commits = True  # committed positions are final: the sampler skips their vocabulary work

    @classmethod
    def from_settings(cls, settings, noise) -> "ConfidenceStep":
        return cls(noise, threshold=settings.confidence_threshold, temperature=settings.temperature,
                   block=settings.commit_block)

    def __init__(self, noise: NoiseProcess, threshold: float = 0.9, temperature: float = 0.0,
                 block: int | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise DGemmaError(f"confidence threshold must lie in [0, 1], got {threshold}")
        if block is not None and block < 1:
            raise DGemmaError(f"commit block must be >= 1 positions, got {block}")
        self.noise = noise
        self.threshold = float(threshold)
        self.temperature = _check_temperature(temperature)
        self.block = block

    def __call__(
        self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator: torch.Generator, is_last: bool
    ) -> CanvasState:
        pred, conf = predict(logits, self.temperature, generator, state)
        open_ = ~state.committed
        if is_last:
            return _renoise(state, self.noise, pred, conf, open_, generator)
        if self.block:  # the leftmost block holding an open position
            open_ = open_ & self._first_open_block(state)
        above = open_ & (conf > self.threshold)
        best = F.one_hot(conf.masked_fill(~open_, -math.inf).argmax(-1), conf.shape[-1]).bool()
        need = open_.any(-1) & ~above.any(-1)
        new = above | (best & need.unsqueeze(-1))
        return _renoise(state, self.noise, pred, conf, new, generator)

    def _first_open_block(self, state: CanvasState) -> Tensor:
        open_ = ~state.committed
        return _leftmost_blocks(open_, torch.ones_like(open_[:, 0], dtype=torch.long), self.block)

    def reads(self, state: CanvasState, s: float, s_next: float | None, *, is_last: bool) -> Tensor | None:
        """With blocks, the leftmost block holding an open position (what this step looks at; it
        keeps nothing for the next)."""
        return None if is_last or not self.block else self._first_open_block(state)


class EntropyBoundStep(StepRule):
    """The released DiffusionGemma's step (as in transformers' ``DiffusionGemmaForBlockDiffusion``).

    Sample a denoiser canvas from the logits at a temperature that falls linearly from ``t_max``
    (first step, ``t = 1``) to ``t_min`` (``t -> 0``); sort positions by the entropy of that
    distribution and accept the ``k`` lowest-entropy ones with ``sum(H) - max(H) <= bound`` (an
    upper bound on their joint mutual information, so they are nearly independent); every
    position not accepted is re-noised. Nothing is committed for good: the accepted set is
    chosen afresh each step. The last step emits the argmax canvas.
    """

    @classmethod
    def from_settings(cls, settings, noise) -> "EntropyBoundStep":
        return cls(noise, bound=settings.entropy_bound, t_max=settings.entropy_t_max,  # its own temperature
                   t_min=settings.entropy_t_min)                                    # schedule: no settings.temperature

    def __init__(self, noise: NoiseProcess, bound: float = 0.1, t_max: float = 0.8, t_min: float = 0.4):
        if bound <= 0 or not 0 < t_min <= t_max:
            raise DGemmaError(f"entropy_bound needs bound > 0 and 0 < t_min <= t_max, got {bound}, {t_min}, {t_max}")
        self.noise, self.bound, self.t_max, self.t_min = noise, float(bound), float(t_max), float(t_min)

    def temperature(self, t: float) -> float:
        return self.t_min + (self.t_max - self.t_min) * t

    def sampling_temperature(self, t: float, default: float) -> float:
        return self.temperature(t)  # the sampler conditions and stops on this schedule too, as transformers does

    def accept(self, entropy: Tensor) -> Tensor:
        """``[B, C]`` entropies -> the accepted positions (bool)."""
        sorted_h, order = torch.sort(entropy, dim=-1)
        keep = torch.cumsum(sorted_h, -1) - sorted_h <= self.bound
        return torch.zeros_like(keep).scatter(-1, order, keep)

    def __call__(
        self, state: CanvasState, logits: Tensor, t: float, s: float, *, generator: torch.Generator, is_last: bool
    ) -> CanvasState:
        scaled = logits.float() / self.temperature(t)
        probs = torch.softmax(scaled, -1)
        draw = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
        fresh = self.noise.noise_like(tuple(state.tokens.shape), generator=generator, device=state.tokens.device)
        if is_last:  # emit the argmax canvas; the draws above keep the random stream where transformers' is
            return replace(state, tokens=torch.where(state.committed, state.tokens, argmax_ids(scaled)), prev_pred=draw)
        accepted = self.accept(token_entropy(scaled)) & ~state.committed
        tokens = torch.where(state.committed, state.tokens, torch.where(accepted, draw, fresh))
        return replace(state, tokens=tokens, prev_pred=draw)


STEPS: dict[str, type[StepRule]] = {"ddim": DDIMStep, "commit": CommitStep, "confidence": ConfidenceStep,
                          "entropy_bound": EntropyBoundStep}


def build_step(name: str, **kw: Any) -> Step:
    """``build_step("ddim", noise=n, temperature=0.7)``; unknown names or arguments raise DGemmaError."""
    if name not in STEPS:
        raise DGemmaError(f"unknown denoising step {name!r}; choose one of {sorted(STEPS)}")
    cls = STEPS[name]
    try:
        inspect.signature(cls).bind(**kw)
    except TypeError as e:
        raise DGemmaError(f"bad arguments for the {name!r} step: {e}") from None
    return cls(**kw)
