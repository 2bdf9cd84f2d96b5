"""Cross-entropy losses against a tied LM head, without full-vocabulary logits.

At batch 8 x 4096 x 50,257 the fp32 logits alone are ~6.6 GB, and autograd would keep them (plus
the softmax) alive until backward. :func:`chunked_cross_entropy` instead walks the masked tokens
in chunks of ``chunk_tokens`` rows: forward keeps only one fp32 log-sum-exp per row, and backward
recomputes each chunk's logits to form ``softmax - onehot`` on the spot. The largest tensor it
ever creates is ``[chunk_tokens, V]``, whatever the number of tokens.

Every loss here returns ``(loss_sum, count)`` (and the mean, for the two task losses) so that a
trainer can normalise by the number of valid tokens across a whole gradient-accumulation window:
backpropagate ``loss_sum / total_count`` on each micro-step, where ``total_count`` is the sum of
the micro-steps' counts (known from the masks before any forward). Averaging per-micro-step means
instead would weight tokens of short micro-batches more than those of long ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from dgemma.errors import DGemmaError

DEFAULT_CHUNK_TOKENS = 1024


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32 for half-precision inputs, fp64 when any input is fp64 (for exact reference tests)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor, chunk_tokens: int,
           softcap: float | None, weights: Tensor | None = None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise DGemmaError(
            f"cross-entropy expects hidden [N, d] and weight [V, d]; got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    n = hidden.shape[0]
    if targets.shape != (n,) or mask.shape != (n,):
        raise DGemmaError(
            f"cross-entropy expects targets and mask of shape [{n}]; got {tuple(targets.shape)} "
            f"and {tuple(mask.shape)}"
        )
    if targets.dtype != torch.long:
        raise DGemmaError(f"targets must be int64 token ids, got {targets.dtype}")
    if mask.dtype != torch.bool:
        raise DGemmaError(f"mask must be bool, got {mask.dtype}")
    if chunk_tokens < 1:
        raise DGemmaError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if softcap is not None and not softcap > 0:
        raise DGemmaError(f"softcap must be positive or None, got {softcap}")
    if weights is not None and (weights.shape != (n,) or not weights.is_floating_point()):
        raise DGemmaError(f"weights must be a float tensor of shape [{n}], got {weights.dtype} {tuple(weights.shape)}")


class _ChunkedCE(torch.autograd.Function):
    """Summed cross-entropy of ``softcap(h @ W.T)`` over rows of ``h``, chunk by chunk, and
    (``certainty=T``) the summed entropy ``H`` of ``q = softmax(z / T)`` over the rows whose argmax
    is already the target.

    Saves only the inputs and per-row statistics; backward recomputes each chunk's logits.
    With ``z = c * tanh(y / c)`` the gradient w.r.t. the raw logit ``y`` is
    ``(softmax(z) - onehot) * (1 - tanh(y / c) ** 2)`` for the cross-entropy, and
    ``-q * (log q + H) / T`` (times the same factor) for the entropy (the right rows are chosen
    in forward and held fixed, as a stop-gradient).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                softcap: float | None, row_weights: Tensor | None = None, certainty: float | None = None):
        cd = _compute_dtype(hidden, weight)
        rw = None if row_weights is None else row_weights.to(cd)
        w = weight.to(cd)
        total = torch.zeros((), dtype=cd, device=hidden.device)
        ent_total = torch.zeros((), dtype=cd, device=hidden.device)
        lse_parts, ent_parts, right_parts, lse_t_parts = [], [], [], []
        for s in range(0, hidden.shape[0], chunk):
            z = hidden[s:s + chunk].to(cd) @ w.T
            if softcap is not None:
                z.div_(softcap).tanh_().mul_(softcap)
            lse = torch.logsumexp(z, dim=-1)
            tgt = targets[s:s + chunk, None]
            nll = lse - z.gather(1, tgt).squeeze(1)
            total += (nll if rw is None else nll * rw[s:s + chunk]).sum()
            lse_parts.append(lse)
            if certainty is not None:  # H = lse_T - sum q z / T, kept where argmax == target (0 elsewhere)
                right = z.argmax(-1) == tgt.squeeze(1)
                zt = z if certainty == 1.0 else z / certainty
                lse_t = torch.logsumexp(zt, dim=-1)
                ent = lse_t - torch.softmax(zt, -1).mul_(zt).sum(-1)  # one more [chunk, V] (two at T != 1)
                ent = ent.where(right, torch.zeros_like(ent))
                lse_t_parts.append(lse_t)
                del zt
                ent_total += ent.sum()
                ent_parts.append(ent)
                right_parts.append(right)
            del z
        lse_all = torch.cat(lse_parts) if lse_parts else hidden.new_zeros(0, dtype=cd)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk, ctx.softcap, ctx.row_weights = chunk, softcap, rw
        ctx.ent = torch.cat(ent_parts) if ent_parts else None  # [N] H on the right rows, else 0
        ctx.right = torch.cat(right_parts) if right_parts else None  # [N] argmax == target
        ctx.lse_t = torch.cat(lse_t_parts) if lse_t_parts else None  # [N] log-sum-exp of z / T
        ctx.temperature = certainty
        return total, ent_total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, grad_ent: Tensor):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        chunk, softcap = ctx.chunk, ctx.softcap
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cd = lse_all.dtype
        w = weight.to(cd)
        g = grad_out.to(cd)
        ge = grad_ent.to(cd)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].to(cd)
            y = h @ w.T
            lse = lse_all[s:s + chunk, None]
            if softcap is not None:
                t = y.div_(softcap).tanh_()
                logp = t.mul(softcap).sub_(lse)
            else:
                logp = y.sub_(lse)
            if ctx.ent is not None:  # d(gH)/dz = -g q (log q + H) / T on the right rows
                ent, right = ctx.ent[s:s + chunk, None], ctx.right[s:s + chunk, None]
                temp = ctx.temperature
                p = logp.exp()
                logq = logp.add_(lse).div_(temp).sub_(ctx.lse_t[s:s + chunk, None])  # z / T - lse_T
                cert = logq.exp().mul_(logq.add_(ent)).mul_(-ge * right / temp)
            else:
                p, cert = logp.exp_(), None
            idx = targets[s:s + chunk, None]
            p.scatter_(1, idx, p.gather(1, idx) - 1)
            p.mul_(g if ctx.row_weights is None else g * ctx.row_weights[s:s + chunk, None])
            if cert is not None:
                p.add_(cert)
                del cert
            if softcap is not None:
                p.mul_(t.square_().neg_().add_(1))
                del t
            del y, logp
            if need_h:
                grad_h[s:s + chunk] = (p @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(p.T, h)
            del p
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor, *,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None,
                          weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Summed ``-log softmax(softcap(hidden @ weight.T))[target]`` over rows where ``mask``.

    ``hidden [N, d]``, ``weight [V, d]`` (the tied embedding; it receives a gradient unless it
    does not require one, as with LoRA), ``targets [N]`` int64 (only masked entries are read and
    must lie in ``[0, V)``), ``mask [N]`` bool. Logits are formed in fp32 (fp64 for fp64 inputs)
    ``chunk_tokens`` masked rows at a time and never for the whole batch, in forward or backward;
    gradients come back in the inputs' dtypes. ``softcap`` is Gemma's final-logit soft-capping
    ``tanh(z / c) * c``. Returns ``(loss_sum, count)``: a scalar in the compute dtype and the
    int64 number of masked rows.

    ``weights [N]`` (optional, float) multiplies each row's loss in the sum (and its gradient);
    the count stays the number of masked rows, so a weight above 1 adds to a token's share of the
    loss without taking any from the others (``DiffusionConfig.key_token_weight``).
    """
    _check(hidden, weight, targets, mask, chunk_tokens, softcap, weights)
    count = mask.sum()
    loss_sum, _ = _ChunkedCE.apply(hidden[mask], weight, targets[mask], chunk_tokens, softcap,
                                   None if weights is None else weights[mask])
    return loss_sum, count


def chunked_certainty_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor, *,
                                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None,
                                    weights: Tensor | None = None,
                                    temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunked_cross_entropy` and, in the same pass over the logits, the *certainty* term
    of certainty-forcing distillation (dParallel, Chen et al. 2025): the summed entropy of the
    predicted distribution at ``temperature`` (dParallel: 0.5) over the masked rows whose argmax
    is already the target.

    Returns ``(loss_sum, count, certainty_sum)``. Minimising ``certainty_sum`` sharpens the
    predictions the model already gets right, so that a confidence-thresholded sampler can
    commit more of them in one pass; the rows it gets wrong are left to the cross-entropy. Which
    rows are right is decided in forward and held fixed in backward (a stop-gradient). The
    entropy is unweighted by ``weights`` (those weigh the cross-entropy only).
    """
    _check(hidden, weight, targets, mask, chunk_tokens, softcap, weights)
    if not temperature > 0:
        raise DGemmaError(f"certainty temperature must be positive, got {temperature}")
    loss_sum, certainty_sum = _ChunkedCE.apply(hidden[mask], weight, targets[mask], chunk_tokens, softcap,
                                               None if weights is None else weights[mask], float(temperature))
    return loss_sum, mask.sum(), certainty_sum


def _full_logits(hidden: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    """All ``[N, V]`` logits in the compute dtype, soft-capped (the eager references only)."""
    cd = _compute_dtype(hidden, weight)
    logits = hidden.to(cd) @ weight.to(cd).T
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _full_nll(logits: Tensor, targets: Tensor, mask: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    nll = F.cross_entropy(logits, targets.masked_fill(~mask, 0), reduction="none")
    if weights is not None:
        nll = nll * weights.to(logits.dtype)
    return (nll * mask).sum(), mask.sum()


def full_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor, *,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None,
                       weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eager reference for :func:`chunked_cross_entropy`: materialises all ``[N, V]`` logits.

    Same signature and results (``chunk_tokens`` is accepted and ignored); kept for tests.
    """
    _check(hidden, weight, targets, mask, chunk_tokens, softcap, weights)
    return _full_nll(_full_logits(hidden, weight, softcap), targets, mask, weights)


def full_certainty_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor, *,
                                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None,
                                 weights: Tensor | None = None,
                                 temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Eager reference for :func:`chunked_certainty_cross_entropy` (all ``[N, V]`` logits, autograd)."""
    _check(hidden, weight, targets, mask, chunk_tokens, softcap, weights)
    logits = _full_logits(hidden, weight, softcap)
    loss_sum, count = _full_nll(logits, targets, mask, weights)
    logq = torch.log_softmax(logits / temperature, -1)
    ent = -(logq.exp() * logq).sum(-1)
    right = mask & (logits.argmax(-1) == targets)
    return loss_sum, count, (ent * right).sum()


_IMPLS = {"chunked": chunked_cross_entropy, "full": full_cross_entropy}


def _cross_entropy(impl: str):
    if impl not in _IMPLS:
        raise DGemmaError(f"unknown cross-entropy impl {impl!r}; choose one of {sorted(_IMPLS)}")
    return _IMPLS[impl]


def diffusion_loss(hidden: Tensor, weight: Tensor, x0: Tensor, mask: Tensor, *,
                   impl: str = "chunked", **kw) -> tuple[Tensor, Tensor, Tensor]:
    """x0-prediction loss: cross-entropy against the clean tokens ``x0`` wherever ``mask``.

    ``hidden [..., d]`` are the decoder's final hidden states over the canvas; ``x0`` and
    ``mask`` share its leading shape. ``mask`` is every valid (non-pad) canvas position,
    corrupted or not, and there is no time weighting (docs/design.md §2). Returns
    ``(mean, loss_sum, count)`` with ``mean = loss_sum / max(count, 1)``; an all-false mask gives
    a zero loss that still backpropagates. ``kw`` goes to the cross-entropy (``chunk_tokens``,
    ``softcap``); ``impl="full"`` selects the eager reference.
    """
    if x0.shape != hidden.shape[:-1] or mask.shape != x0.shape:
        raise DGemmaError(
            f"diffusion_loss expects hidden [..., d] with x0 and mask [...]; got "
            f"{tuple(hidden.shape)}, {tuple(x0.shape)} and {tuple(mask.shape)}"
        )
    ce = _cross_entropy(impl)
    loss_sum, count = ce(hidden.reshape(-1, hidden.shape[-1]), weight, x0.reshape(-1),
                         mask.reshape(-1), **kw)
    return loss_sum / count.clamp_min(1), loss_sum, count


def ar_loss(hidden: Tensor, weight: Tensor, ids: Tensor, valid: Tensor, *, scored: Tensor | None = None,
            weights: Tensor | None = None, impl: str = "chunked", **kw) -> tuple[Tensor, Tensor, Tensor]:
    """Next-token cross-entropy of the encoder over ``[prompt | response]``.

    ``hidden [B, L, d]`` at position ``i`` predicts ``ids[:, i + 1]``; position ``i`` counts when
    ``valid[:, i]`` and ``valid[:, i + 1]`` both hold, so nothing is predicted from or into
    padding, wherever the padding sits. ``scored [B, L]`` (optional) further limits the *targets*:
    ``ids[:, i + 1]`` counts only where ``scored[:, i + 1]`` (the response tokens of an SFT
    example, say). ``weights [B, L]`` (optional) weighs each *target* token ``ids[:, i + 1]`` by
    ``weights[:, i + 1]`` (see :func:`chunked_cross_entropy`). Returns ``(mean, loss_sum,
    count)`` as :func:`diffusion_loss` does.
    """
    if hidden.dim() != 3 or ids.shape != hidden.shape[:2] or valid.shape != ids.shape:
        raise DGemmaError(
            f"ar_loss expects hidden [B, L, d] with ids and valid [B, L]; got "
            f"{tuple(hidden.shape)}, {tuple(ids.shape)} and {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise DGemmaError(f"valid must be bool, got {valid.dtype}")
    targets = ids.roll(-1, dims=1)
    mask = valid & valid.roll(-1, dims=1)
    if scored is not None:
        if scored.shape != ids.shape or scored.dtype != torch.bool:
            raise DGemmaError(f"scored must be bool of shape {tuple(ids.shape)}, got {scored.dtype} "
                              f"{tuple(scored.shape)}")
        mask &= scored.roll(-1, dims=1)
    mask[:, -1] = False
    if weights is not None:
        if weights.shape != ids.shape:
            raise DGemmaError(f"weights must have shape {tuple(ids.shape)}, got {tuple(weights.shape)}")
        kw["weights"] = weights.roll(-1, dims=1).reshape(-1)
    ce = _cross_entropy(impl)
    loss_sum, count = ce(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                         mask.reshape(-1), **kw)
    return loss_sum / count.clamp_min(1), loss_sum, count
