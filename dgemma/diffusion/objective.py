"""The training forward of a block-diffusion model (docs/design.md §2-3).

Encode the clean ``[prompt | canvases]`` once (this fills a KV cache and gives the encoder AR
loss), corrupt the selected canvas(es), and decode them against that cache. The decoder never
writes the cache: a noisy canvas reads the clean keys of the prompt and of earlier canvases
through the mask (``block < own block``), so no slot of the prompt or of later canvases is ever
touched — unlike the reference JAX adapter, which decodes every canvas into the cache and
overwrites prompt slots.

Which canvases are decoded is the only difference between the adapter and Lite:

- ``one``: one valid canvas per example, uniformly (the adapter);
- ``all``: every valid canvas at once, each against its own prefix (Lite / BD3-LM style).

``loss_on="all"`` scores every valid position of a decoded canvas, corrupted or not (docs/design.md §2);
``"noised"`` only the corrupted ones (MDLM's masked loss, for absorbing noise). Pinned tokens
(``canvas_hint >= 0``, infilling) are never corrupted nor scored. ``canvas_weight`` (the task's
key tokens, ``diffusion.key_token_weight``) multiplies a scored token's loss in both losses; the
normalising counts stay token counts. ``certainty_weight`` (``diffusion.certainty_weight``) adds
the entropy of the scored tokens the decoder already predicts right
(:func:`dgemma.diffusion.losses.chunked_certainty_cross_entropy`), normalised as the diffusion loss.

Losses come back as sums and counts so the trainer normalises by valid tokens across
gradient-accumulation micro-steps and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.diffusion.corruption import block_states
from dgemma.diffusion.losses import ar_loss, chunked_certainty_cross_entropy, chunked_cross_entropy
from dgemma.diffusion.schedules import sample_t
from dgemma.diffusion.shift import before_indices, shift_to_canvas
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.selfcond import expected_embedding


@dataclass
class Plan:
    """The random draws of one micro-batch (see :meth:`DiffusionObjective.plan`)."""

    chosen: Tensor  # [B, N] canvases decoded
    t: Tensor  # [B]
    x0: Tensor  # [B, L] clean tokens of the decoded canvas(es)
    weight: Tensor | None  # [B, L] their loss weights (key tokens), or None: all 1
    xt: Tensor  # [B, L] their corruption
    target: Tensor  # [B, L] positions scored by the diffusion loss
    noisy: TokenInfo  # metadata of the decoder tokens
    selfcond_rows: Tensor | None  # [B] rows self-conditioned on a first pass
    diffusion_count: int
    ar_count: int
    first_pass: bool = False  # run the detached pass even if no row uses it (FSDP: all ranks alike)


@dataclass
class LossTerms:
    """Summed losses and the number of tokens they sum over (this micro-batch)."""

    diffusion_sum: Tensor
    diffusion_count: Tensor
    ar_sum: Tensor
    ar_count: Tensor
    certainty_sum: Tensor | None = None  # summed entropy of the rightly predicted noised tokens (if asked)

    def objective(self, diffusion_norm: Tensor | float, ar_norm: Tensor | float, ar_weight: float,
                  diffusion_weight: float = 1.0, certainty_weight: float = 0.0) -> Tensor:
        """The scalar to back-propagate, normalised by *global* token counts (clamped to >= 1)."""
        loss = diffusion_weight * self.diffusion_sum / max(float(diffusion_norm), 1.0)
        if certainty_weight and self.certainty_sum is not None:
            loss = loss + certainty_weight * self.certainty_sum / max(float(diffusion_norm), 1.0)
        if ar_weight:
            loss = loss + ar_weight * self.ar_sum / max(float(ar_norm), 1.0)
        return loss


def batch_info(batch: dict[str, Tensor], canvas_size: int) -> TokenInfo:
    """Clean metadata of ``[prompt | canvases]``: prompt block 0, canvas ``i`` block ``i + 1``."""
    prompt_valid, canvas_valid = batch["prompt_valid"].bool(), batch["canvas_valid"].bool()
    prompt = TokenInfo.clean(prompt_valid)
    start = prompt_valid.long().sum(-1)
    offs = torch.arange(canvas_valid.shape[1], device=canvas_valid.device)
    canvas = TokenInfo(
        start[:, None] + offs[None, :],
        (offs // canvas_size + 1)[None, :].expand_as(canvas_valid),
        torch.zeros_like(canvas_valid),
        canvas_valid,
    )
    return prompt.cat(canvas)


def pick_canvases(canvas_mask: Tensor, mode: str, generator: torch.Generator) -> Tensor:
    """``[B, N]`` bool: which canvases to decode. ``one`` draws one valid canvas per row uniformly."""
    if mode == "all":
        return canvas_mask.clone()
    if mode != "one":
        raise ValueError(f"decode mode must be 'one' or 'all', got {mode!r}")
    weights = canvas_mask.float().cpu()
    weights[weights.sum(-1) == 0, 0] = 1.0  # rows without a valid canvas: pick 0, masked out later
    choice = torch.multinomial(weights, 1, generator=generator).to(canvas_mask.device)
    return torch.zeros_like(canvas_mask).scatter_(1, choice, True) & canvas_mask


def compact_valid(valid: Tensor) -> Tensor:
    """Gather order that moves each row's valid tokens to the front, keeping their order.

    With right-padded prompts the response starts after a pad gap; the AR loss must pair the
    last prompt token with the first response token, so it runs on the compacted sequence.
    """
    return torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices


class DiffusionObjective:
    def __init__(self, *, noise, canvas_size: int, t_eps: float = 1e-4, selfcond_prob: float = 0.5,
                 ar_loss_weight: float = 1.0, decode: str = "one", chunk_tokens: int = 1024, loss_on: str = "all",
                 diffusion_loss_weight: float = 1.0, ar_loss_on: str = "all", block_noise_prob: float = 0.0,
                 block_noise_size: int = 4, certainty_weight: float = 0.0, certainty_temperature: float = 1.0):
        if certainty_weight < 0 or not certainty_temperature > 0:
            raise ValueError(f"certainty_weight must be >= 0 and certainty_temperature > 0, got {certainty_weight}, "
                             f"{certainty_temperature}")
        self.certainty_weight, self.certainty_temperature = certainty_weight, certainty_temperature
        if not 0.0 <= block_noise_prob <= 1.0:
            raise ValueError(f"block_noise_prob must be in [0, 1], got {block_noise_prob}")
        if block_noise_prob and (block_noise_size < 1 or canvas_size % block_noise_size):
            raise ValueError(f"block_noise_size must divide the canvas ({canvas_size}), got {block_noise_size}")
        self.block_noise_prob, self.block_noise_size = block_noise_prob, block_noise_size
        if loss_on not in ("all", "noised"):
            raise ValueError(f"loss_on must be 'all' or 'noised', got {loss_on!r}")
        if ar_loss_on not in ("all", "response"):
            raise ValueError(f"ar_loss_on must be 'all' or 'response', got {ar_loss_on!r}")
        self.ar_loss_on = ar_loss_on
        if not diffusion_loss_weight and not ar_loss_weight:
            raise ValueError("diffusion_loss_weight and ar_loss_weight are both 0: no loss")
        self.diffusion_loss_weight = diffusion_loss_weight  # 0: AR only (no corruption, no decoder pass)
        self.loss_on = loss_on
        self.noise = noise
        self.canvas_size = canvas_size
        self.t_eps = t_eps
        self.selfcond_prob = selfcond_prob
        self.ar_loss_weight = ar_loss_weight
        self.decode = decode
        self.chunk_tokens = chunk_tokens

    def plan(self, batch: dict[str, Tensor], generator: torch.Generator) -> Plan:
        """Every random draw of a micro-batch, before the network runs: which canvases, ``t``, the
        corruption, and who gets self-conditioning. The trainer plans all micro-batches first to
        count their loss tokens exactly (they depend on the draws under ``loss_on="noised"``)."""
        prompt_ids, canvas_ids = batch["prompt_ids"], batch["canvas_ids"]
        b, p = prompt_ids.shape
        c = self.canvas_size
        dev = prompt_ids.device
        chosen = pick_canvases(batch["canvas_mask"].bool(), self.decode, generator)  # [B, N]
        t = sample_t(b, generator=generator, eps=self.t_eps).to(dev)  # [B]
        canvas_info = batch_info(batch, c)[:, p:]
        chosen_tok = chosen.repeat_interleave(c, dim=1) & canvas_info.valid  # [B, N*C]
        hint = batch.get("canvas_hint")  # [B, N*C], -1 = free: pinned tokens are never corrupted
        weight = batch.get("canvas_weight")  # [B, N*C] loss weights (diffusion.key_token_weight)
        if self.decode == "one":  # decode only the chosen canvas: gather its C tokens per row
            k = chosen.float().argmax(-1)  # [B]
            idx = k[:, None] * c + torch.arange(c, device=dev)[None, :]  # [B, C]
            x0 = canvas_ids.gather(1, idx)
            sel = chosen_tok.gather(1, idx)
            info = canvas_info[torch.arange(b, device=dev)[:, None], idx]
            hint = None if hint is None else hint.gather(1, idx)
            weight = None if weight is None else weight.gather(1, idx)
        else:
            x0, sel, info = canvas_ids, chosen_tok, canvas_info
        free = sel if hint is None else sel & (hint < 0)
        # draws use the (CPU) step generator, so a plan is the same on any device
        xt = self.noise.q_sample(x0.cpu(), t.cpu(), generator=generator, where=free.cpu()).to(dev)
        if self.block_noise_prob:  # some rows as the block sampler leaves them (corruption.py:block_states)
            xt = self._block_layout(x0, xt, free, generator)
        target = free & (xt != x0) if self.loss_on == "noised" else free
        use = torch.rand(b, generator=generator).to(dev) < self.selfcond_prob if self.selfcond_prob > 0 else None
        if not self.diffusion_loss_weight:  # AR only: nothing is decoded or scored by the diffusion loss
            target, use = torch.zeros_like(target), None
        ar_count = self._ar_count(batch) if self.ar_loss_weight else 0
        return Plan(chosen=chosen, t=t, x0=x0, weight=weight, xt=xt, target=target,
                    noisy=TokenInfo(info.positions, info.blocks, torch.ones_like(sel), info.valid),
                    selfcond_rows=use, diffusion_count=int(target.sum()), ar_count=ar_count)

    def _block_layout(self, x0: Tensor, xt: Tensor, free: Tensor, generator: torch.Generator) -> Tensor:
        """In a share ``block_noise_prob`` of the rows, each decoded canvas keeps its i.i.d. draw only
        in one block of ``block_noise_size``: the blocks before it are clean, the ones after it noise."""
        b, n = x0.shape[0], x0.shape[1] // self.canvas_size
        rows = torch.rand(b, generator=generator) < self.block_noise_prob  # [B]
        done, ahead = block_states(free.cpu(), torch.rand(b, n, generator=generator), self.canvas_size,
                                   self.block_noise_size)
        fresh = self.noise.noise_like(tuple(x0.shape), generator=generator, device="cpu")
        rows = rows.unsqueeze(-1)
        out = torch.where(rows & done, x0.cpu(), torch.where(rows & ahead, fresh, xt.cpu()))
        return torch.where(free.cpu(), out, x0.cpu()).to(xt.device)  # pinned and invalid positions stay clean

    def _ar_count(self, batch: dict[str, Tensor]) -> int:
        """Targets of the AR loss: every valid token but each row's first; or, for
        ``ar_loss_on="response"``, every valid canvas token that has a token before it."""
        prompt_valid, canvas_valid = batch["prompt_valid"].bool(), batch["canvas_valid"].bool()
        valid = torch.cat([prompt_valid, canvas_valid], 1)
        if self.ar_loss_on == "all":
            return int(valid.sum()) - int(valid.any(-1).sum())
        no_prompt = ~prompt_valid.any(-1) & canvas_valid.any(-1)  # the first response token starts the row
        return int(canvas_valid.sum()) - int(no_prompt.sum())

    def __call__(self, model, batch: dict[str, Tensor], generator: torch.Generator) -> LossTerms:
        return self.run(model, batch, self.plan(batch, generator))

    def run(self, model, batch: dict[str, Tensor], plan: Plan) -> LossTerms:
        prompt_ids, canvas_ids = batch["prompt_ids"], batch["canvas_ids"]
        b, p = prompt_ids.shape
        c = self.canvas_size
        dev = prompt_ids.device
        weight = model.lm_head.weight
        softcap = model.config.final_logit_softcapping

        # encode the clean context -> cache (+ AR loss)
        clean = batch_info(batch, c)
        ids = torch.cat([prompt_ids, canvas_ids], 1)  # [B, P + N*C]
        if not self.ar_loss_weight:  # no canvas attends to its own or later clean tokens: skip them
            last = int(plan.chosen.any(0).nonzero().max()) if plan.chosen.any() else 0
            ids, clean = ids[:, : p + last * c], clean[:, : p + last * c]
        cache = KVCache(b, ids.shape[1]) if ids.shape[1] else None  # no context: decode alone
        hidden = model(ids, info=clean, cache=cache, return_hidden=True) if cache is not None else None
        if self.ar_loss_weight:
            order = compact_valid(clean.valid)
            h = hidden.gather(1, order[..., None].expand_as(hidden))
            scored = None
            if self.ar_loss_on == "response":  # targets: the canvas tokens only
                scored = torch.cat([torch.zeros_like(batch["prompt_valid"], dtype=torch.bool),
                                    batch["canvas_valid"].bool()], 1).gather(1, order)
            w = batch.get("canvas_weight")  # key tokens weigh as much as a target as in the diffusion loss
            if w is not None:
                w = torch.cat([torch.ones_like(prompt_ids, dtype=w.dtype), w], 1).gather(1, order)
            _, ar_sum, ar_count = ar_loss(h, weight, ids.gather(1, order), clean.valid.gather(1, order),
                                          scored=scored, weights=w, softcap=softcap, chunk_tokens=self.chunk_tokens)
        else:
            ar_sum, ar_count = weight.new_zeros(()), torch.zeros((), dtype=torch.long, device=dev)

        if not self.diffusion_loss_weight:  # an AR-only model: no decoder pass
            zero = weight.new_zeros(())
            return LossTerms(zero, torch.zeros((), dtype=torch.long, device=dev), ar_sum, ar_count)

        # decode the corrupted canvases, optionally self-conditioned on a detached first pass
        xt, noisy, t = plan.xt, plan.noisy, plan.t
        align = self._aligner(model, batch, plan, hidden)  # shift_logits: position j predicted from j - 1
        selfcond = None
        use = plan.selfcond_rows
        if model.self_conditioning is not None and use is not None and (use.any() or plan.first_pass):
            with torch.no_grad():
                h0 = align(model(xt, info=noisy, cache=cache, t=t, return_hidden=True))
                signal = expected_embedding(h0.reshape(-1, h0.shape[-1]), weight, softcap=softcap)
            selfcond = signal.view_as(h0) * use[:, None, None].to(h0.dtype)  # zero signal = off
        hd = align(model(xt, info=noisy, cache=cache, t=t, selfcond=selfcond, return_hidden=True))
        ce, kw = chunked_cross_entropy, {}
        if self.certainty_weight:
            ce, kw = chunked_certainty_cross_entropy, {"temperature": self.certainty_temperature}
        d_sum, d_count, *cert = ce(hd.reshape(-1, hd.shape[-1]), weight, plan.x0.reshape(-1), plan.target.reshape(-1),
                                   softcap=softcap, chunk_tokens=self.chunk_tokens,
                                   weights=None if plan.weight is None else plan.weight.reshape(-1), **kw)
        if not self.ar_loss_weight and hidden is not None and hidden.requires_grad and _fsdp_layers(model):
            # Without the AR loss the encoder's output feeds no loss: its gradient arrives only
            # through the keys and values it wrote into the cache, and the last layer's output
            # reaches neither. FSDP2 unshards a layer for backward from a hook on that layer's
            # *outputs*, so the last layer's encoder pass would back-propagate into resharded
            # (freed) weights ("setStorage ... storage of size 0"). This exact-zero term puts the
            # output in the graph: the loss gains 0.0 and the gradients zeros (only the sign of a
            # zero can change). Not needed, and skipped (its backward costs ~1/L of the
            # encoder's), without FSDP.
            d_sum = d_sum + hidden.sum() * 0.0
        return LossTerms(d_sum, d_count, ar_sum, ar_count, *cert)


    def _aligner(self, model, batch: dict[str, Tensor], plan: Plan, hidden: Tensor | None):
        """Identity, or for ``shift_logits`` the map from decoder states to the states that
        predict each canvas token (:func:`dgemma.diffusion.shift.shift_to_canvas`), the first
        position of a canvas taking the encoder's state of the token before it."""
        if not model.config.shift_logits:
            return lambda h: h
        b, n = plan.chosen.shape
        dev = plan.chosen.device
        canvases = (plan.chosen.float().argmax(-1, keepdim=True) if self.decode == "one"
                    else torch.arange(n, device=dev).expand(b, n))  # [B, K] the canvases decoded
        idx = before_indices(batch["prompt_valid"].bool(), canvases, self.canvas_size)
        # a canvas past the encoded context is padding (never scored): any state will do
        idx = idx.clamp_max(hidden.shape[1] - 1)
        before = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, K, d]
        return lambda h: shift_to_canvas(h, before, self.canvas_size)


def _fsdp_layers(model) -> bool:
    """Whether the model's layers are FSDP2-sharded (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and isinstance(layers[-1], FSDPModule)
