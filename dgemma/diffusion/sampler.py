"""The canvas loop: prefill, denoise canvas by canvas through the KV cache, append, repeat.

For each batch of prompts (right padded, any lengths)::

    prefill the prompt                                   1 forward (on a CPU,    CanvasSampler.prefill
                                                         1 a prompt: prefill_prompts)
    for canvas k = 0, 1, ... < max_canvases:                                     CanvasSampler.denoise_canvas
        x = pure noise                                   [A, C]
        for each step on the time grid 1 -> 0:           1 forward each (decoder, no cache write)
            logits = model(x | cache); x = step(x, logits)
            rows whose stopping rule fires are frozen and leave the batch
        cut each row's canvas at EOS / end-of-turn -> that row is finished       CanvasSampler.append
        append the canvas of unfinished rows              in the next canvas's first forward

The three stages share one :class:`Decoding` (the call's cache, active rows and results).

Appending costs no forward of its own (``fuse_append``): the finished canvas, clean, goes in
front of the next canvas's first noisy input, ``[A, 2C]``, and that one forward writes its keys
(``DiffusionGemma.forward``'s ``append``) while the noisy half is denoised. The clean tokens are
token-causal and never see the noisy ones, so both halves get the numbers their own forwards
would. A canvas of S steps takes S forwards instead of S + 1; at C = 32 the one forward costs
about 0.77 of the two it replaces (bf16, batch 1, the AMX Xeon: ``docs/benchmarks.md``).

With ``shift_logits`` the first token of a canvas is predicted by the clean state of the token
before it, which the prefill or the append already computed (``dgemma/diffusion/shift.py``).

Finished rows leave the active batch (``KVCache.select``), so they stop costing compute.
``use_cache=False`` recomputes the whole prefix at every step instead: the same numbers (the
single-shot forward with the block mask), at the cost the cache exists to avoid.

Plain AR decoding of the same weights through the same cache (:func:`ar_generate`) is the
baseline every speed figure is compared with.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import Tensor

from dgemma.device import synchronize
from dgemma.diffusion.corruption import NoiseProcess
from dgemma.diffusion.schedules import time_grid
from dgemma.diffusion.shift import before_indices, shift_to_canvas
from dgemma.diffusion.steps import CanvasState, Step, open_softmax, remember_open_rows
from dgemma.diffusion.stopping import NoStop, StoppingRule, argmax_ids
from dgemma.errors import DGemmaError
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.selfcond import embed_probs, probs_embedding


@dataclass
class SampleResult:
    tokens: list[list[int]]  # generated tokens per row, cut after the first stop token (kept)
    forward_passes: list[int]  # per row: prefill + denoising steps (+ appends when not fused) it took part in
    steps_used: list[list[int]]  # per row, per canvas
    seconds: float
    trajectories: list[list[dict]] | None = None  # per row: one dict per step (see record)
    prefill_seconds: float = 0.0  # of ``seconds``: encoding the prompts, before the first canvas

    @property
    def tokens_per_forward(self) -> list[float]:
        return [len(t) / max(f, 1) for t, f in zip(self.tokens, self.forward_passes)]

    def tokens_per_decoder_forward(self, pad_id: int | None = None) -> list[float]:
        """Per row: generated tokens (``pad_id`` ones not counted) over denoising passes only.

        transformers' DiffusionGemma reports this figure (``tokens_per_forward`` of its
        ``generate``); ours above also counts the prefill pass (docs/design.md §4).
        """
        return [sum(tok != pad_id for tok in t) / max(sum(s), 1) for t, s in zip(self.tokens, self.steps_used)]

    def stats(self) -> dict:
        n_tok = sum(len(t) for t in self.tokens)
        n_fwd = sum(self.forward_passes)
        return {
            "tokens": n_tok,
            "forward_passes": n_fwd,
            "tokens_per_forward": n_tok / max(n_fwd, 1),
            **rates(n_tok, self.seconds, self.prefill_seconds),
            "mean_steps_per_canvas": (
                sum(sum(s) for s in self.steps_used) / max(sum(len(s) for s in self.steps_used), 1)),
        }


@dataclass(kw_only=True)
class CanvasSampler:
    """Block-diffusion sampling with a pluggable ``step`` and stopping rule."""

    noise: NoiseProcess  # UniformNoise | AbsorbingNoise: supplies pure-noise canvases
    step: Step  # a rule of dgemma/diffusion/steps.py
    num_steps: int
    canvas_size: int
    max_canvases: int = 1
    stop: StoppingRule = field(default_factory=NoStop)
    stop_ids: tuple[int, ...] = ()  # EOS, end-of-turn
    temperature: float = 0.7  # for the self-conditioning signal and the stopping entropy
    t_max: float = 1.0
    use_cache: bool = True
    skip_committed: bool = True  # LM head and self-conditioning on uncommitted positions only (commit steps)
    fill_after_stop: bool = True  # commit steps: EOS-fill the canvas after its first committed stop token
    min_stop_prob: float = 0.0  # a stop token is predicted only where its probability reaches this
    stop_alias_cos: float | None = None  # fold tokens this close to a stop token's embedding into it
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits at every step (add_logit_bias)
    reuse_logits: bool = True  # a step after one that changed no token reuses its logits (False: recompute)
    # append a finished canvas in the next canvas's first pass (one forward fewer a canvas, same
    # numbers; DiffusionGemma.forward's ``append``); False: a forward of its own, as the SPEC draws it
    fuse_append: bool = True
    self_condition: bool = True  # feed each step's prediction to the next (False: the zero signal of a first step)
    # approximate: a pass recomputes only the canvas positions a step reads and those whose token
    # changed; the others' keys are reused from an earlier pass of the canvas (canvas_window)
    reuse_canvas_keys: bool = False
    # approximate: a canvas's first pass runs the LM head on every position and keeps the ``shortlist``
    # likeliest tokens of each (with the context's tokens: canvas_shortlist); its later passes score
    # only those, the rest of the vocabulary at -inf. 0: the whole vocabulary at every pass. Ignored
    # with the self-conditioning signal or a stopping rule (both read the whole softmax)
    shortlist: int = 0
    # response tokens pinned at the start of every row's first canvas (a forced prefix: an answer
    # template's fixed words); :func:`ar_generate`'s ``prefix`` gives the AR baseline the same
    prefix: tuple[int, ...] = ()
    record: bool = False
    # Optional per-step callback, called after every denoising step with keyword arguments
    # canvas, step, t, rows (original row indices of the rows in this step), tokens, committed,
    # argmax ([len(rows), C] tensors: x_t after the step, the commit mask, the model's argmax),
    # done ([len(rows)] bool: rows whose canvas ends at this step; the emitted canvas is `tokens`
    # on the last step, `argmax` on an early stop) and reused (the step reused the last forward's
    # logits). Streaming front-ends read it; an exception raised in it aborts sampling and
    # propagates (how a server cancels a request). It draws nothing from the generator, so
    # outputs are the same with or without it.
    on_step: Callable[..., None] | None = None
    # the hook reads `argmax` at open positions (the playground's guesses). False: it reads only
    # what the sampler emits, so the LM head may still run where the step reads; the hook then gets
    # `argmax=None` (no stopping rule runs then, so a row ends only with every position committed
    # or after the last step, and emits `tokens`)
    hook_reads_guesses: bool = True

    @property
    def forbid(self) -> int | None:
        return getattr(self.noise, "mask_token_id", None)

    def adjust_logits(self, logits: Tensor, *, aliases: dict[int, Tensor]) -> Tensor:
        """The vocabulary rules applied to every prediction: stop aliases folded into their stop
        token (:func:`fold_aliases`), the logit bias, and the stop gate (:func:`gate_stop_tokens`)."""
        logits = add_logit_bias(fold_aliases(logits, aliases), self.logit_bias)
        if self.min_stop_prob > 0 and self.stop_ids:
            logits = gate_stop_tokens(logits, self.stop_ids, self.min_stop_prob)
        return logits

    @torch.no_grad()
    def __call__(self, model, prompt_ids: Tensor, prompt_valid: Tensor, *, generator: torch.Generator,
                 hints: Tensor | None = None) -> SampleResult:
        """``hints [B, max_canvases * C]`` pins known tokens (``-1`` = free), e.g. Sudoku clues; the
        sampler's ``prefix`` is pinned on top of them (:func:`pin_prefix`)."""
        t0 = time.perf_counter()
        hints = pin_prefix(hints, self.prefix, prompt_ids.shape[0], self.max_canvases * self.canvas_size,
                           device=prompt_ids.device)
        d = self.prefill(model, prompt_ids, prompt_valid)
        synchronize(prompt_ids.device)  # a GPU runs the prefill asynchronously
        prefilled = time.perf_counter() - t0
        for k in range(self.max_canvases):
            canvas = self.denoise_canvas(model, d, k, generator=generator, hints=hints)
            if not self.append(model, d, canvas, last=k == self.max_canvases - 1):
                break
        return SampleResult(d.out, d.fwd, d.steps_used, time.perf_counter() - t0, d.traj, prefill_seconds=prefilled)

    def prefill(self, model, prompt_ids: Tensor, prompt_valid: Tensor) -> "Decoding":
        """Encode the prompts into a cache sized for every canvas (one forward, keys only)."""
        b, p = prompt_ids.shape
        dev = prompt_ids.device
        prompt_valid = prompt_valid.bool()
        embed = model.model.embed_tokens.weight
        d = Decoding(
            start=prompt_valid.long().sum(-1), active=torch.arange(b, device=dev),
            prefix_ids=prompt_ids, prefix_info=TokenInfo.clean(prompt_valid),
            grid=time_grid(self.num_steps, t_max=self.t_max), embed=embed,
            aliases=stop_aliases(embed, self.stop_ids, self.stop_alias_cos) if self.stop_alias_cos else {},
            out=[[] for _ in range(b)], fwd=[1 if p else 0] * b,  # an empty prompt has no prefill
            steps_used=[[] for _ in range(b)], traj=[[] for _ in range(b)] if self.record else None)
        if model.config.shift_logits:  # the state of the token before the canvas predicts its first token
            if not p:
                raise DGemmaError("a shift_logits model predicts a canvas's first token from the token before it: "
                                  "it needs a prompt (at least BOS)")
            zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
            d.before_idx = before_indices(prompt_valid, zero, self.canvas_size)[:, 0]
        if self.use_cache:
            d.cache = KVCache(b, p + self.max_canvases * self.canvas_size)
            if p:
                h = prefill_prompts(model, prompt_ids, prompt_valid, d.cache)  # keys only: no LM head
                d.before = h[torch.arange(b, device=dev), d.before_idx] if d.before_idx is not None else None
        return d

    def denoise_canvas(self, model, d: "Decoding", k: int, *, generator: torch.Generator,
                       hints: Tensor | None = None) -> Tensor:
        """Canvas ``k`` of every active row, from pure noise to tokens: ``[A, C]``.

        One decoder forward per step against the cache (no write); a row whose stopping rule
        fires, or whose positions are all committed, leaves the step batch with its canvas.
        """
        a, c, dev = d.active.numel(), self.canvas_size, d.active.device
        d.pos = d.start[d.active][:, None] + k * c + torch.arange(c, device=dev)[None, :]
        d.blocks = torch.full((a, c), k + 1, dtype=torch.long, device=dev)
        ones = torch.ones(a, c, dtype=torch.bool, device=dev)
        noisy = TokenInfo(d.pos, d.blocks, ones, ones)
        state = CanvasState(tokens=self.noise.noise_like((a, c), generator=generator, device=dev),
                            committed=torch.zeros(a, c, dtype=torch.bool, device=dev),
                            prev_pred=None, prev_conf=None)
        if hints is not None and hints.shape[1] > k * c:
            state = state.pin(hints[d.active][:, k * c:(k + 1) * c])
        canvas = torch.empty(a, c, dtype=torch.long, device=dev)
        running = torch.arange(a, device=dev)  # rows of the canvas batch still denoising
        self.stop.reset(a)
        selfcond = None
        ctx_cache, ctx_ids, ctx_info = d.cache, d.prefix_ids, d.prefix_info
        grid = d.grid
        # without time or self-conditioning a forward depends on the canvas alone: a step that
        # changed no token (a commit pace with nothing due, absorbing noise) is followed by the
        # same forward, so its logits are reused instead of recomputed
        conditioned = self.self_condition and model.self_conditioning is not None
        reuse = self.reuse_logits and not conditioned and getattr(model, "time_embedding", False) is None
        # nothing but the step reads the logits: the LM head runs where the step looks (Step.reads)
        narrow = (not conditioned and not self.record and (self.on_step is None or not self.hook_reads_guesses)
                  and isinstance(self.stop, NoStop) and hasattr(self.step, "reads"))
        last = None  # (canvas, rows read, logits) of the last forward, while the running rows stay the same
        kept = CanvasLogits()  # the logits tensor, rewritten in place where a pass changes it
        # reuse_canvas_keys: the canvas's last hidden states [R, C, d] and which positions' keys in
        # the scratch slots were computed from their current token [R, C] (None: no pass yet)
        windowed = self.reuse_canvas_keys and self.use_cache and narrow
        hid = fresh = None
        # a shortlist where nothing reads a probability over the whole vocabulary (the signal, a
        # stopping rule's entropy); a hook's guesses are then the shortlist's argmax
        short = self.shortlist > 0 and not conditioned and isinstance(self.stop, NoStop)
        vocab = None  # the tokens this canvas's passes score after its first [S]
        for i in range(self.num_steps):
            t = grid[i].expand(running.numel()).to(dev)
            is_last = i == self.num_steps - 1
            # committed positions can no longer change: the LM head runs on the open ones only
            open_ = ~state.committed if self.skip_committed and self.step.commits else None
            if narrow and open_ is not None:
                reads = self.step.reads(state, float(grid[i + 1]), float(grid[i + 2]) if i + 2 < self.num_steps
                                        else None, is_last=is_last)
                if reads is not None:
                    state = replace(state, unread=open_ & ~reads)
                    open_ = open_ & reads
            rows = d.active[running].tolist()
            reused = last is not None and torch.equal(last[0], state.tokens) and _same_mask(last[1], open_)
            if reused:
                logits = last[2]
            else:
                if self.use_cache and d.pending is not None:  # the last canvas's append rides on this pass
                    done_ids, done_info = d.pending
                    n = done_ids.shape[1]
                    h = model(torch.cat([done_ids, state.tokens], 1), info=done_info.cat(noisy), cache=d.cache,
                              append=n, selfcond=selfcond, t=t, return_hidden=True)
                    d.pending = None
                    d.before = h[:, n - 1] if d.before_idx is not None else None
                    hidden, before = h[:, n:], d.before
                elif self.use_cache:  # nothing cached yet (empty prompt, first canvas): decode alone
                    span = (canvas_window(fresh, open_, shift=d.before_idx is not None)
                            if windowed and fresh is not None and ctx_cache.cursor else None)
                    if span is not None:  # only the positions that need it, against the canvas's scratch keys
                        starts, width = span
                        at = (torch.arange(running.numel(), device=dev)[:, None],
                              starts[:, None] + torch.arange(width, device=dev))  # each row's window [R, width]
                        rows_info = noisy[running]
                        hid[at] = model(state.tokens[at], info=rows_info[at], cache=ctx_cache,
                                        partial=(starts, rows_info), t=t, return_hidden=True)
                        fresh[at] = True
                        hidden = hid
                    else:
                        hidden = model(state.tokens, info=noisy[running],
                                       cache=ctx_cache if ctx_cache.cursor else None,
                                       write=False, selfcond=selfcond, t=t, return_hidden=True)
                    before = d.before[running] if d.before is not None else None
                else:
                    full = model(torch.cat([ctx_ids, state.tokens], 1), info=ctx_info.cat(noisy[running]),
                                 selfcond=_pad_left(selfcond, ctx_ids), t=t, return_hidden=True)
                    hidden = full[:, -c:]
                    before = None
                    if d.before_idx is not None:  # the clean context's states equal the encoder's
                        at = (d.before_idx[d.active][running] if k == 0
                              else torch.full_like(running, ctx_ids.shape[1] - 1))
                        before = full[torch.arange(running.numel(), device=dev), at]
                if windowed and hidden is not hid:  # a full pass: every position's keys are current
                    hid, fresh = hidden, torch.ones_like(state.committed)
                if before is not None:
                    hidden = shift_to_canvas(hidden, before[:, None], c)
                scores = None
                if short and vocab is None:  # the canvas's first pass: every position
                    scores = model.logits(hidden)  # [R, C, V]
                    context = [t for r in rows for t in d.out[r]] + list(self.stop_ids) + list(self.prefix)
                    vocab = canvas_shortlist(scores, self.shortlist, torch.cat(
                        [d.prefix_ids.flatten(), torch.tensor(context, dtype=torch.long, device=dev)]))
                logits = vocab_logits(model, hidden, state.tokens, open_, forbid=self.forbid,
                                      adjust=partial(self.adjust_logits, aliases=d.aliases), keep_probs=conditioned,
                                      into=kept, scores=scores, vocab=vocab)
                for r in rows:
                    d.fwd[r] += 1
            last = (state.tokens, open_, logits) if reuse else None
            before_step = state.tokens
            state = self.step(state, logits, float(grid[i]), float(grid[i + 1]), generator=generator,
                              is_last=is_last)
            if self.fill_after_stop and open_ is not None and self.stop_ids:
                state = fill_after_stop(state, self.stop_ids)
            if fresh is not None:  # a position whose token changed has stale keys in the scratch slots
                fresh &= state.tokens == before_step
            temp = self.step.sampling_temperature(float(grid[i]), self.temperature)
            done = torch.ones(running.numel(), dtype=torch.bool, device=dev) if is_last else \
                self.stop.update(logits, temp, open_=None if reused else open_)
            settled = state.committed.all(-1)  # every position committed: nothing left to denoise
            done = done | settled
            # the next step's input, so none after a canvas's last (T <= 0 conditions on the plain softmax)
            if conditioned and not bool(done.all()):
                selfcond = selfcond_signal(logits, temp if temp > 0 else 1.0, d.embed, state.tokens, open_)
            if self.on_step is not None:
                self.on_step(canvas=k, step=i, t=float(grid[i]), rows=rows, tokens=state.tokens,
                             committed=state.committed, argmax=None if narrow else argmax_ids(logits), done=done,
                             reused=reused)
            if d.traj is not None:
                argmax = argmax_ids(logits)
                for j, r in enumerate(rows):
                    d.traj[r].append({"canvas": k, "step": i, "t": float(grid[i]), "tokens": state.tokens[j].tolist(),
                                      "committed": state.committed[j].tolist(), "argmax": argmax[j].tolist()})
            if done.any():
                # rows that completed the schedule emit their final state; early-stopped rows
                # emit the argmax canvas of their last prediction
                final = state.tokens  # (an argmax over [A, C, V] only where a row did stop early)
                if not is_last and not bool(settled[done].all()):
                    final = torch.where(settled[:, None], state.tokens, argmax_ids(logits))
                canvas[running[done]] = final[done]
                for r in d.active[running[done]].tolist():
                    d.steps_used[r].append(i + 1)
                keep = ~done
                running, last = running[keep], None
                if running.numel() == 0:
                    break
                state = state.select(keep)
                kept.select(keep)
                self.stop.select(keep.nonzero().squeeze(1))
                selfcond = None if selfcond is None else selfcond[keep]
                if fresh is not None:
                    hid, fresh = hid[keep], fresh[keep]
                if self.use_cache:  # read-only from here: the prefix and one canvas of scratch
                    ctx_cache = d.cache.select(running, max_len=min(d.cache.cursor + c, d.cache.max_len))
                else:
                    ctx_ids, ctx_info = d.prefix_ids[running], d.prefix_info[running]
        return canvas

    def append(self, model, d: "Decoding", canvas: Tensor, *, last: bool) -> bool:
        """Cut each row's canvas at its first stop token (that row is finished) and append the
        canvases of the others to the context (one encoder forward, writes the cache). Returns
        whether any row goes on to another canvas."""
        a = d.active.numel()
        finished = torch.zeros(a, dtype=torch.bool, device=canvas.device)
        for j in range(a):
            row = canvas[j].tolist()
            cut = next((n + 1 for n, tok in enumerate(row) if tok in self.stop_ids), None)
            d.out[int(d.active[j])].extend(row if cut is None else row[:cut])
            finished[j] = cut is not None
        keep = ~finished
        if last or not keep.any():
            return False
        d.active, canvas, d.pos, d.blocks = d.active[keep], canvas[keep], d.pos[keep], d.blocks[keep]
        clean = TokenInfo(d.pos, d.blocks, torch.zeros_like(canvas, dtype=torch.bool),
                          torch.ones_like(canvas, dtype=torch.bool))
        if self.use_cache:
            if not keep.all():  # no copy when every row goes on
                d.cache = d.cache.select(keep.nonzero().squeeze(1))
            if self.fuse_append:  # written by the next canvas's first pass (denoise_canvas)
                d.pending = (canvas, clean)
                return True
            h = model(canvas, info=clean, cache=d.cache, return_hidden=True)  # append: encoder pass, keys only
            d.before = h[:, -1] if d.before_idx is not None else None
            for r in d.active.tolist():
                d.fwd[r] += 1
        else:
            d.prefix_ids = torch.cat([d.prefix_ids[keep], canvas], 1)
            d.prefix_info = d.prefix_info[keep].cat(clean)
        return True


@dataclass(kw_only=True, eq=False)
class Decoding:
    """One :class:`CanvasSampler` call's state between :meth:`~CanvasSampler.prefill`,
    :meth:`~CanvasSampler.denoise_canvas` and :meth:`~CanvasSampler.append`. Row tensors are
    indexed by the *active* rows (``active`` maps them to the caller's rows); the per-row
    results (``out``, ``fwd``, ``steps_used``, ``traj``) by the caller's rows."""

    start: Tensor  # [B] first canvas position of each row (its prompt length)
    active: Tensor  # [A] caller's row of each active row
    prefix_ids: Tensor  # [A, P'] prompt and appended canvases (read only without the cache)
    prefix_info: TokenInfo
    grid: Tensor  # the time grid, num_steps + 1 points from t_max to 0
    embed: Tensor  # [V, d] the input embedding (self-conditioning signal)
    aliases: dict  # stop token -> ids folded into it (stop_alias_cos)
    out: list  # per caller row: its generated tokens
    fwd: list  # per caller row: forward passes it took part in
    steps_used: list  # per caller row: steps per canvas
    traj: list | None = None
    cache: KVCache | None = None
    before_idx: Tensor | None = None  # shift_logits: [B] index of the prompt's last token
    before: Tensor | None = None  # shift_logits: [A, d] the clean state before the next canvas
    pending: tuple[Tensor, TokenInfo] | None = None  # a finished canvas [A, C] not yet in the cache (fuse_append)
    pos: Tensor | None = None  # [A, C] positions of the current canvas
    blocks: Tensor | None = None  # [A, C] its block id


def pin_prefix(hints: Tensor | None, prefix: tuple[int, ...], rows: int, width: int, device=None) -> Tensor | None:
    """``hints [rows, width]`` with ``prefix`` pinned at every row's first response positions, or
    ``hints`` as given when there is no prefix. ``hints=None``, ``prefix=(7, 8)``, 2 rows, width 3
    -> ``[[7, 8, -1], [7, 8, -1]]``. A hint that pins another token where the prefix goes is
    refused: ``[[-1, -1, 5], [-1, 9, -1]]`` with the same prefix (row 1 pins 9 where 8 goes)."""
    if not prefix:
        return hints
    k = len(prefix)
    if k >= width:
        raise DGemmaError(f"the response prefix is {k} tokens; the canvases hold {width}, so nothing would be left "
                          f"to generate")
    p = torch.tensor(prefix, dtype=torch.long, device=device)
    out = torch.full((rows, width), -1, dtype=torch.long, device=device) if hints is None else hints.clone()
    head = out[:, :k]
    clash = ((head >= 0) & (head != p)).nonzero()
    if clash.numel():
        r, i = clash[0].tolist()
        raise DGemmaError(f"the response prefix puts token {prefix[i]} at position {i}, where row {r}'s hints pin "
                          f"{int(head[r, i])}")
    out[:, :k] = p
    return out


def prefixed_prompts(prompt_ids: Tensor, prompt_valid: Tensor, prefix: tuple[int, ...],
                     pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Each right-padded prompt followed by ``prefix``, right-padded again: ``ids [[1, 2], [3, 0]]``,
    ``valid [[1, 1], [1, 0]]``, ``prefix (7,)`` -> ``ids [[1, 2, 7], [3, 7, 0]]``, ``valid [[1, 1, 1], [1, 1, 0]]``.
    How the AR decoder takes a forced response prefix: in its prefill, at no step's cost."""
    b, p = prompt_ids.shape
    k, dev = len(prefix), prompt_ids.device
    lens = prompt_valid.long().sum(-1)
    ids = torch.full((b, p + k), pad_id, dtype=prompt_ids.dtype, device=dev)
    valid = torch.zeros(b, p + k, dtype=torch.bool, device=dev)
    ids[:, :p] = torch.where(prompt_valid, prompt_ids, pad_id)
    valid[:, :p] = prompt_valid
    at = lens[:, None] + torch.arange(k, device=dev)[None, :]  # [B, k] where each row's prefix goes
    ids.scatter_(1, at, torch.tensor(prefix, dtype=prompt_ids.dtype, device=dev).expand(b, k))
    valid.scatter_(1, at, True)
    return ids, valid


def gate_stop_tokens(logits: Tensor, stop_ids: tuple[int, ...], min_prob: float) -> Tensor:
    """Forbid the stop tokens at positions where together they have less than ``min_prob``.

    A committed stop token ends the answer, so being the argmax is not enough: an unsure model
    spreads its mass over many words, and the one stop token then wins with a fraction of it
    (LLaDA's excess of EOS). Where the stop tokens hold less than ``min_prob`` of the mass the
    position predicts its best other token. Example, ``min_prob=0.5``: P = (stop 0.3, "the" 0.2,
    ...) predicts "the"; P = (stop 0.8, ...) predicts stop.
    """
    ids = torch.tensor(stop_ids, device=logits.device)
    z = logits.float()
    p_stop = (z[..., ids] - z.logsumexp(-1, keepdim=True)).exp().sum(-1)  # [B, C]
    low = p_stop < min_prob
    if bool(low.any()):
        logits = logits.clone()
        logits[..., ids] = logits[..., ids].masked_fill(low[..., None], float("-inf"))
    return logits


def add_logit_bias(logits: Tensor, bias: dict[int, float] | None) -> Tensor:
    """``logits`` with ``bias[token]`` added to each named token's logit at every position (the
    OpenAI ``logit_bias``): a prior shift on a few words, e.g. a decision calibrated on held-out
    data. Example, ``bias={7: 1.0}``: logits (token 7: 2.0, token 9: 2.5) -> (3.0, 2.5), so 7 wins.
    Only the named columns are touched; the input is not modified."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), device=logits.device)
    vals = torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
    logits = logits.clone()
    logits[..., ids] += vals
    return logits


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int | None = None) -> None:
    """Refuse token ids outside the vocabulary (``0..vocab_size - 1``; negative ones only, when
    it is not known) and biases that are not numbers in [-100, 100]."""
    for k, v in (bias or {}).items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (vocab_size is not None and k >= vocab_size):
            top = "" if vocab_size is None else f" (0..{vocab_size - 1})"
            raise DGemmaError(f"logit_bias: token id {k!r} is not in the vocabulary{top}")
        if not isinstance(v, (int, float)) or not -100.0 <= float(v) <= 100.0:
            raise DGemmaError(f"logit_bias: the bias of token {k} must be a number in [-100, 100], got {v!r}")


def stop_aliases(embed: Tensor, stop_ids: tuple[int, ...], min_cos: float) -> dict[int, Tensor]:
    """``{stop id: ids of the other tokens whose embedding row has cosine >= min_cos with its row}``.

    With a tied LM head, tokens with (nearly) the same embedding get (nearly) the same logit: the
    head cannot rank them, so a model that means "stop" spreads that probability over all of them
    and the argmax lands on whichever is marginally ahead. Gemma 3 270M's ``<end_of_turn>`` sits in
    such a cluster: ~6,200 untrained rows (unused and rare-script tokens, none of them in a
    PubMedQA answer) within cosine 0.95 of it. A token is the alias of one stop id at most (the
    closest). Example: rows ``e0 = (1, 0)``, ``e1 = (0.99, 0.1)``, ``e2 = (0, 1)``, stop id 0,
    ``min_cos=0.95``: ``{0: [1]}``.
    """
    if not stop_ids:
        return {}
    key = (embed._version, tuple(stop_ids), float(min_cos))
    for ref, k, out in _ALIASES:
        if ref() is embed and k == key:  # the same tensor, unchanged
            return out
    ids = torch.tensor(stop_ids, device=embed.device)
    ref = embed.detach()[ids].float()
    ref = ref / ref.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # [S, d]
    best, which = [], []
    for rows in embed.detach().split(32_768):  # fp32 in chunks: no full-vocabulary copy
        w = rows.float()
        b, k = ((w / w.norm(dim=-1, keepdim=True).clamp_min(1e-12)) @ ref.T).max(-1)
        best.append(b)
        which.append(k)
    best, which = torch.cat(best), torch.cat(which)
    alias = best >= min_cos
    alias[ids] = False
    out = {int(s): alias.logical_and(which == k).nonzero().flatten() for k, s in enumerate(stop_ids)}
    # the latest few models (an AR fine-tune beside its diffusion adapter in one process): 0.3 s each for
    # the Gemma 3 270M's 262,144 rows on a CPU, which would otherwise be paid again at every switch
    _ALIASES[:] = [(r, k, o) for r, k, o in _ALIASES if r() is not None and r() is not embed][-(ALIAS_MODELS - 1):]
    _ALIASES.append((weakref.ref(embed), key, out))
    return out


ALIAS_MODELS = 4
_ALIASES: list = []  # (weakref to the embedding, (version, stop ids, min_cos), aliases), the latest last


def fold_aliases(logits: Tensor, aliases: dict[int, Tensor]) -> Tensor:
    """In place: each stop token's logit becomes the log-sum-exp of its own and its aliases'
    logits (their probabilities summed), and the aliases are never predicted, so "stop" wins
    where the model puts its mass on the stop token's indistinguishable rows. Example, stop 1
    with aliases [3, 4]: probabilities (0.4, 0.1, 0.1, 0.2, 0.2) -> stop 0.5 is the argmax."""
    for stop, ids in aliases.items():
        if ids.numel():
            group = torch.cat([logits[..., stop:stop + 1], logits.index_select(-1, ids)], -1)
            logits[..., stop] = group.float().logsumexp(-1).to(logits.dtype)
            logits.index_fill_(-1, ids, float("-inf"))
    return logits


def fill_after_stop(state: CanvasState, stop_ids: tuple[int, ...]) -> CanvasState:
    """Commit every position after a row's first committed stop token as ``stop_ids[0]`` (EOS).

    The output is cut at the first stop token, so nothing after it can reach the answer; the
    model was trained to write EOS there (the chunker's fill), and as pinned positions they leave
    the commit pace to the positions before the stop. Saves their vocabulary work (the LM head
    and the self-conditioning signal run on open positions only). Example, stop id 1, fill 1:
    tokens ``[7 1 5 3]`` committed ``[1 1 0 0]`` -> tokens ``[7 1 1 1]`` committed ``[1 1 1 1]``.
    """
    stop = torch.isin(state.tokens, torch.tensor(stop_ids, device=state.tokens.device)) & state.committed
    after = (stop.long().cumsum(-1) - stop.long()) > 0  # strictly after the first committed stop
    new = after & ~state.committed
    if not bool(new.any()):
        return state
    pinned = new if state.pinned is None else state.pinned | new
    return replace(state, tokens=torch.where(new, torch.full_like(state.tokens, stop_ids[0]), state.tokens),
                   committed=state.committed | new, pinned=pinned)


@dataclass(eq=False)
class CanvasLogits:
    """A canvas batch's ``[A, C, V]`` logits kept from one denoising pass to the next
    (:func:`vocab_logits` ``into=``), so a pass rewrites only the rows that change.

    Built afresh, the tensor costs a fill of every row at every pass (270 MB at batch 16 with
    Gemma's 262,144 tokens) although a pass changes few: the rows the LM head ran on, and the
    closed rows whose one-hot changed (a position just committed, an unread one re-noised).
    ``head [A, C]`` marks rows holding LM-head output, ``onehot [A, C]`` the token each other row
    is the one-hot of (-1: none yet). Its rows follow the sampler's shrinking batch (:meth:`select`).
    """

    buf: Tensor | None = None
    head: Tensor | None = None
    onehot: Tensor | None = None

    def select(self, keep: Tensor) -> None:
        if self.buf is not None:
            self.buf, self.head, self.onehot = self.buf[keep], self.head[keep], self.onehot[keep]

    def write(self, z: Tensor, tokens: Tensor, open_: Tensor) -> Tensor:
        """The logits with ``z [N, V]`` on the ``open_`` rows and one-hots of ``tokens`` elsewhere."""
        if self.buf is None or self.buf.shape[:2] != open_.shape or self.buf.dtype != z.dtype:
            self.buf = z.new_full((*open_.shape, z.shape[-1]), torch.finfo(z.dtype).min)
            self.head = torch.zeros_like(open_)
            self.onehot = torch.full_like(tokens, -1)
        low = torch.finfo(z.dtype).min
        stale = ~open_ & (self.onehot != tokens)  # closed rows that are not yet their token's one-hot
        if bool(stale.any()):
            # LM-head rows: the whole row, indexed (a boolean [A, C] index becomes a masked_fill
            # that reads the whole [A, C, V] buffer: 4.6 ms a pass at batch 1 on the 270M)
            self.buf[(stale & self.head).nonzero(as_tuple=True)] = low
            old = stale & ~self.head & (self.onehot >= 0)  # another token's one-hot: its one entry
            self.buf[(*old.nonzero(as_tuple=True), self.onehot[old])] = low
            self.buf[(*stale.nonzero(as_tuple=True), tokens[stale])] = 0.0
        self.buf[open_] = z
        self.head, self.onehot = open_.clone(), torch.where(open_, -1, tokens)
        return self.buf

    def adopt(self, z: Tensor) -> Tensor:
        """A pass whose every row came from the LM head: ``z [A, C, V]`` becomes the buffer."""
        self.buf, self.head = z, torch.ones(z.shape[:2], dtype=torch.bool, device=z.device)
        self.onehot = torch.full(z.shape[:2], -1, dtype=torch.long, device=z.device)
        return z


def vocab_logits(model, hidden: Tensor, tokens: Tensor, open_: Tensor | None, *, forbid: int | None = None,
                 adjust: Callable[[Tensor], Tensor] | None = None, keep_probs: bool = True,
                 into: CanvasLogits | None = None, scores: Tensor | None = None,
                 vocab: Tensor | None = None) -> Tensor:
    """``[B, C, V]`` logits of the canvas, the LM head run only where ``open_`` (None: everywhere).

    A committed position is certain: its row is its token's one-hot in logit form (0 there,
    the dtype's lowest value elsewhere), so argmax, confidence (1) and entropy (0) read as they
    should, at no vocabulary cost. ``forbid`` (the absorbing mask token) is never predicted, and
    ``adjust`` (the sampler's stop aliases, logit bias and stop gate) runs on the rows the head
    ran on: none of them changes which token a one-hot row holds, nor its probability of 1.
    ``keep_probs=False`` tells the shared softmax that no self-conditioning signal will read it.
    ``into`` keeps the tensor between passes and rewrites only the rows that changed; the returned
    logits are then that buffer, valid until the next call. ``scores [B, C, V]``: the head's output
    at every position, computed already (``vocab`` is then not read). ``vocab [S]``: the head scores
    these tokens only, the others read -inf (a shortlist: :func:`canvas_shortlist`).
    """
    whole = open_ is None or bool(open_.all())
    if scores is not None:
        z = scores if whole else scores[open_]  # [B, C, V] or [N_open, V]
    else:
        rows = hidden if whole else hidden[open_]
        z = model.logits(rows, vocab=vocab)  # [.., V], or [.., S] on a shortlist
        if vocab is not None:
            z = z.new_full((*z.shape[:-1], model.config.vocab_size), float("-inf")).index_copy_(-1, vocab, z)
    if forbid is not None:
        z[..., forbid] = float("-inf")
    if adjust is not None:
        z = adjust(z)
    if whole:
        return z if into is None else into.adopt(z)
    logits = (into or CanvasLogits()).write(z, tokens, open_)  # a fresh one: every closed row written
    remember_open_rows(logits, open_, z, keep_probs=keep_probs)
    return logits


def canvas_shortlist(scores: Tensor, k: int, context: Tensor) -> Tensor:
    """The tokens a canvas's later passes score (``CanvasSampler.shortlist``): the ``k`` likeliest of
    every position at its first pass (``scores [R, C, V]``), and the ``context`` ids (prompts, earlier
    canvases, stop tokens, pinned prefix), which an answer copies. Sorted, so the argmax breaks
    ties toward the lower id, as over the whole vocabulary.

    Example, ``V = 6``, ``k = 2``, one position scoring ``[0 5 1 4 2 3]``, context ``[5 5]`` ->
    ``[1 3 5]``.

    On the PubMedQA adapter (bf16, 16 steps, reused keys; 4 test questions, 547 LM-head rows), each
    later argmax lay in the first pass's top 256 (~930 tokens a canvas) with the context: all 547;
    top 64: 545; top 16: 540 (2026-12-07)."""
    top = scores.topk(min(k, scores.shape[-1]), dim=-1).indices  # [R, C, k]
    return torch.unique(torch.cat([top.flatten(), context.flatten()]))  # sorted


def selfcond_signal(logits: Tensor, temperature: float, embed: Tensor, tokens: Tensor,
                    open_: Tensor | None) -> Tensor:
    """The next step's self-conditioning input, ``softmax(logits / T) @ E`` (``[B, C, d]``).

    Where ``open_`` is False the logits are a one-hot (:func:`vocab_logits`), whose softmax is
    exactly that token: the signal is its embedding row, looked up instead of multiplied out. At
    ``T = 1`` (what a greedy sampler conditions on) the softmax is the one the step's prediction
    computed (``dgemma/diffusion/steps.py:open_softmax``).
    """
    whole = open_ is None or bool(open_.all())
    shared = open_softmax(logits, open_).probs if temperature == 1.0 else None
    if shared is not None:  # the plain softmax, which a greedy step's prediction computed already
        signal = embed_probs(shared, embed)  # [N_open, d]
    else:
        signal = probs_embedding((logits if whole else logits[open_]) / temperature, embed)
    if whole:
        return signal.view(*logits.shape[:-1], -1)
    out = embed[tokens]  # [B, C, d]
    out[open_] = signal
    return out


def canvas_window(fresh: Tensor, read: Tensor | None, *, shift: bool) -> tuple[Tensor, int] | None:
    """The canvas positions a partial pass must recompute (``reuse_canvas_keys``), each row its own
    window: ``(starts [B], width)``, row ``b`` recomputing ``[starts[b], starts[b] + width)``; or None
    for a full pass. A row needs every position whose keys are stale (``~fresh [B, C]``: its token
    changed since its keys were computed) and every hidden state the step reads (``read [B, C]``:
    the positions the LM head runs on; with ``shift`` the state before each, position 0's being the
    cached clean state before the canvas).

    The rows share one forward, so all take the widest row's width; a narrower row's window starts
    at its first needed position, moved left where it would pass the canvas's end, and a row that
    needs nothing takes the canvas's last positions. Windows over the rows' union instead computed
    2.5 times the positions the rows need on the first 16 PubMedQA test questions at batch 16, these
    1.8 times (bf16, 12 steps; one row's window is the union at batch 1).

    A Fast-dLLM-style approximate cache within a canvas: the reused keys of the other positions
    were computed against tokens that have changed since. Example, ``C = 8``, row 0's positions
    2-3 just committed (stale) and the step reading its 4-7, shifted (it needs 2-6); row 1 reading
    its 5-6 (needs 4-5): width 5, row 1's window moved left to end at the canvas's end.

    >>> fresh = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    >>> read = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 0]]).bool()
    >>> canvas_window(fresh, read, shift=True)
    (tensor([2, 3]), 5)
    """
    if read is None:
        return None
    need = ~fresh
    if shift:
        need[:, :-1] |= read[:, 1:]
    else:
        need |= read
    c = need.shape[1]
    cols = torch.arange(c, device=need.device)
    first = torch.where(need, cols, c).amin(1)  # [B] (C: the row needs nothing)
    last = torch.where(need, cols, -1).amax(1)
    width = int((last - first + 1).amax())
    if width <= 0 or width == c:  # nothing needed, or a whole canvas: a full pass
        return None
    return first.clamp(max=c - width), width


def _same_mask(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _pad_left(selfcond: Tensor | None, ctx_ids: Tensor) -> Tensor | None:
    """Self-conditioning signal for ``[context | canvas]``: zeros on the (clean) context."""
    if selfcond is None:
        return None
    pad = selfcond.new_zeros(ctx_ids.shape[0], ctx_ids.shape[1], selfcond.shape[-1])
    return torch.cat([pad, selfcond], 1)


@dataclass
class ARResult:
    tokens: list[list[int]]
    forward_passes: list[int]
    seconds: float
    prefill_seconds: float = 0.0  # of ``seconds``: encoding the prompts (and the response prefix)

    def stats(self) -> dict:
        n_tok = sum(len(t) for t in self.tokens)
        n_fwd = sum(self.forward_passes)
        return {"tokens": n_tok, "forward_passes": n_fwd, "tokens_per_forward": n_tok / max(n_fwd, 1),
                **rates(n_tok, self.seconds, self.prefill_seconds)}


def rates(tokens: int, seconds: float, prefill_seconds: float) -> dict:
    """Tokens/s over the whole call and over what follows the prompts' encoding, which both engines
    do alike (:func:`prefill_prompts`): ``{"tokens_per_second", "decode_tokens_per_second",
    "seconds", "prefill_seconds"}``. Example: 40 tokens in 3 s, 1 s of it prefill -> 13.3 and 20.0."""
    return {"tokens_per_second": tokens / max(seconds, 1e-9),
            "decode_tokens_per_second": tokens / max(seconds - prefill_seconds, 1e-9),
            "seconds": seconds, "prefill_seconds": prefill_seconds}


def prefill_prompts(model, prompt_ids: Tensor, prompt_valid: Tensor, cache: KVCache, *,
                    by_row: bool | None = None) -> Tensor:
    """Encode prompts ``[B, P]`` into the empty ``cache`` (slots ``[0, P)``) and return the final
    hidden states ``[B, P, d]``: the prefill of both engines (:class:`CanvasSampler`, :func:`ar_generate`).

    ``by_row`` encodes each prompt alone, at its own length, and copies its keys into its row
    (:meth:`KVCache.put_row`); zero states stand at the padding, which no one reads. The default
    does so on a CPU, without autograd, for a right-padded batch whose prompts differ in length: there the batch's
    one forward computes the padding too and attends through a dense mask over the longest
    prompt, where a prompt alone is plainly causal and PyTorch skips the blocks above the
    diagonal. The first 16 PubMedQA test prompts (260-551 tokens, 6,108 of 8,816 padded slots;
    bf16, 2 threads, the AMD EPYC): 5.2 s a row at a time against 10.3 s (2026-12-07). On a GPU
    the one forward keeps the device busy. Either way each prompt's keys and states are the same
    numbers up to the kernels' rounding (exact in fp64: ``tests/diffusion/test_prefill.py``).

    Example: lengths 3 and 1, ``P = 3``: row 0 fills slots 0-2 from one forward of 3 tokens, row 1
    slot 0 from one of 1 token; the cache then moves to 3 with row 1's slots 1-2 marked invalid.
    """
    b, p = prompt_ids.shape
    info = TokenInfo.clean(prompt_valid)
    lengths = prompt_valid.long().sum(-1)
    if by_row is None:  # the cheap conditions first: a batch-1 or GPU prefill reads no lengths
        by_row = (prompt_ids.device.type == "cpu" and b > 1 and not torch.is_grad_enabled()
                  and bool((lengths != lengths[0]).any())
                  and bool((prompt_valid.bool() == (torch.arange(p, device=prompt_ids.device)
                                                    < lengths[:, None])).all()))  # right-padded
    if not by_row or not bool(lengths.any()):
        return model(prompt_ids, info=info, cache=cache, return_hidden=True)
    hidden = None
    for i, n in enumerate(lengths.tolist()):
        if not n:
            continue
        one = KVCache(1, n)
        h = model(prompt_ids[i:i + 1, :n], info=info[i:i + 1, :n], cache=one, return_hidden=True)  # [1, n, d]
        if hidden is None:
            hidden = h.new_zeros(b, p, h.shape[-1])
        hidden[i, :n] = h[0]
        cache.put_row(i, one)
    cache.advance(info)
    return hidden


@torch.no_grad()
def ar_generate(model, prompt_ids: Tensor, prompt_valid: Tensor, *, max_new_tokens: int,
                stop_ids: tuple[int, ...] = (), temperature: float = 0.0,
                generator: torch.Generator | None = None, stop_alias_cos: float | None = None,
                logit_bias: dict[int, float] | None = None, prefix: tuple[int, ...] = ()) -> ARResult:
    """Token-by-token decoding through the same KV cache (greedy at ``temperature=0``);
    ``stop_alias_cos`` folds the stop tokens' aliases into them and ``logit_bias`` shifts the
    named tokens' logits (:func:`add_logit_bias`), as the canvas sampler does.

    ``prefix``: response tokens every answer starts with, as the canvas sampler pins them
    (``CanvasSampler.prefix``). They join the prompt's prefill (:func:`prefixed_prompts`), begin
    every row's tokens and count towards ``max_new_tokens``, as pinned tokens fill a canvas."""
    t0 = time.perf_counter()
    prompt_valid = prompt_valid.bool()
    if prefix:
        if len(prefix) >= max_new_tokens:
            raise DGemmaError(f"the response prefix is {len(prefix)} tokens; max_new_tokens={max_new_tokens} leaves "
                              f"nothing to generate")
        prompt_ids, prompt_valid = prefixed_prompts(prompt_ids, prompt_valid, prefix, model.config.pad_token_id or 0)
        max_new_tokens -= len(prefix)
    b, p = prompt_ids.shape
    dev = prompt_ids.device
    cache = KVCache(b, p + max_new_tokens)
    hidden = prefill_prompts(model, prompt_ids, prompt_valid, cache)
    synchronize(dev)
    prefilled = time.perf_counter() - t0
    last = prompt_valid.long().sum(-1) - 1
    aliases = stop_aliases(model.model.embed_tokens.weight, stop_ids, stop_alias_cos) if stop_alias_cos else {}
    logits = fold_aliases(model.logits(hidden[torch.arange(b, device=dev), last]), aliases)  # [B, V]: one position a row
    logits = add_logit_bias(logits, logit_bias)
    pos = last + 1
    out: list[list[int]] = [list(prefix) for _ in range(b)]
    fwd = [1] * b
    rows = list(range(b))  # the batch rows still decoding: the per-token bookkeeping stays on the host
    stops = set(stop_ids)
    for i in range(max_new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]
        else:
            nxt = argmax_ids(logits)
        toks = nxt.tolist()  # the one host sync of a step
        for r, tok in zip(rows, toks):
            out[r].append(tok)
        keep = [tok not in stops for tok in toks]
        if i == max_new_tokens - 1 or not any(keep):
            break
        if not all(keep):
            kept = torch.tensor([j for j, k in enumerate(keep) if k], device=dev)
            nxt, pos = nxt[kept], pos[kept]
            rows = [r for r, k in zip(rows, keep) if k]
            cache = cache.select(kept)
        ones = torch.ones(len(rows), 1, dtype=torch.bool, device=dev)
        info = TokenInfo(pos[:, None], torch.zeros_like(pos[:, None]), ~ones, ones)
        logits = add_logit_bias(fold_aliases(model(nxt[:, None], info=info, cache=cache, write=True)[:, 0], aliases),
                                logit_bias)
        for r in rows:
            fwd[r] += 1
        pos = pos + 1
    return ARResult(out, fwd, time.perf_counter() - t0, prefilled)
