"""Attention masks as small pure functions over per-token metadata.

Every token carries four facts (:class:`TokenInfo`): its rotary position, the block it belongs
to (block 0 is the prompt, canvas ``i`` is block ``i + 1``), whether it is a *noisy* decoder token
or a *clean* encoder token, and whether it is real or padding. Masks are functions of those facts
alone, never of tensor indices, so the same rule serves a single-shot forward over
``[clean | noisy]``, a prefill, and a decoder pass against the KV cache — which is what makes the
cached sampler provably equal to the single-shot forward (see ``tests/models/test_cache.py``).

All functions return boolean tensors where ``True`` means "query may attend to key".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ENCODER_MODES = ("causal", "block")
WINDOW_ANCHORS = ("query", "canvas")


@dataclass
class TokenInfo:
    """Per-token metadata, each field ``[batch, length]``."""

    positions: Tensor  # long: rotary position
    blocks: Tensor  # long: 0 = prompt, i + 1 = canvas i
    noisy: Tensor  # bool: decoder (noisy canvas) token
    valid: Tensor  # bool: real token, not padding

    @staticmethod
    def clean(valid: Tensor, *, start: Tensor | int = 0, blocks: Tensor | None = None) -> "TokenInfo":
        """Clean tokens whose positions count only the valid ones (right padding safe).

        ``start`` is a per-row ``[batch]`` offset (or an int). Padding takes the position of the
        last valid token before it; it is masked out as a key anyway.

        >>> TokenInfo.clean(torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()).positions
        tensor([[0, 1, 1],
                [0, 1, 2]])
        """
        valid = valid.bool()
        start_t = torch.as_tensor(start, device=valid.device).reshape(-1, 1)
        positions = (start_t + valid.long().cumsum(-1) - 1).clamp_min(start_t)
        if blocks is None:
            blocks = torch.zeros_like(positions)
        return TokenInfo(positions, blocks, torch.zeros_like(valid), valid)

    @staticmethod
    def plain(batch: int, length: int, device: torch.device | str = "cpu") -> "TokenInfo":
        """An unpadded clean sequence at positions ``0..length-1``."""
        return TokenInfo.clean(torch.ones(batch, length, dtype=torch.bool, device=device))

    def cat(self, other: "TokenInfo") -> "TokenInfo":
        return TokenInfo(
            torch.cat([self.positions, other.positions], 1),
            torch.cat([self.blocks, other.blocks], 1),
            torch.cat([self.noisy, other.noisy], 1),
            torch.cat([self.valid, other.valid], 1),
        )

    def __getitem__(self, idx) -> "TokenInfo":
        return TokenInfo(self.positions[idx], self.blocks[idx], self.noisy[idx], self.valid[idx])

    @property
    def shape(self) -> torch.Size:
        return self.positions.shape


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Key position not after query position.

    >>> causal_mask(torch.arange(3)[:, None], torch.arange(3)[None, :]).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    return k_pos <= q_pos


def sliding_window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Distance strictly below ``window`` (Gemma's exclusive bound), in both directions.

    >>> sliding_window_mask(torch.arange(4)[:, None], torch.arange(4)[None, :], 2).int()
    tensor([[1, 1, 0, 0],
            [1, 1, 1, 0],
            [0, 1, 1, 1],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    return (q_pos - k_pos).abs() < window


def block_causal_mask(q_block: Tensor, k_block: Tensor) -> Tensor:
    """Causal across blocks, bidirectional within one.

    >>> b = torch.tensor([0, 0, 1, 1])
    >>> block_causal_mask(b[:, None], b[None, :]).int()
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 1],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    return k_block <= q_block


def canvas_decode_mask(q_block: Tensor, k_block: Tensor, k_noisy: Tensor) -> Tensor:
    """A noisy canvas query sees clean keys of earlier blocks and noisy keys of its own block.

    Keys ``[p p c0 c0 | ~c0 ~c0]`` (prompt block 0, clean canvas block 1, then the noisy copy of
    canvas block 1), queries the noisy copy:

    >>> kb, kn = torch.tensor([0, 0, 1, 1, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1]).bool()
    >>> canvas_decode_mask(torch.tensor([1, 1])[:, None], kb[None, :], kn[None, :]).int()
    tensor([[1, 1, 0, 0, 1, 1],
            [1, 1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    return torch.where(k_noisy, k_block == q_block, k_block < q_block)


def block_starts(info: TokenInfo) -> Tensor:
    """``[B, L]``: the first position of each token's block in its row, within this call.

    A whole canvas always arrives in one call (prefill, append, decoder pass, or the single-shot
    forward, where a block's clean and noisy copies share positions), so this is the canvas's
    first position. Blocks are renumbered densely (``unique``) and the starts found with ``amin``,
    no loop over tokens:

    >>> info = TokenInfo(torch.tensor([[0, 1, 2, 3, 4, 5, 2, 3, 4]]), torch.tensor([[0, 0, 1, 1, 1, 2, 1, 1, 1]]),
    ...                  torch.zeros(1, 9, dtype=torch.bool), torch.ones(1, 9, dtype=torch.bool))
    >>> block_starts(info)
    tensor([[0, 0, 2, 2, 2, 5, 2, 2, 2]])
    """
    positions = info.positions
    _, dense = torch.unique(info.blocks, return_inverse=True)  # [B, L] in 0..U-1
    first = positions.new_full((positions.shape[0], int(dense.max()) + 1), torch.iinfo(positions.dtype).max)
    return first.scatter_reduce(1, dense, positions, reduce="amin").gather(1, dense)


def window_anchor(info: TokenInfo) -> Tensor:
    """Where each query's sliding window ends under the ``"canvas"`` anchor (DiffusionGemma's).

    A clean token keeps its own position; a noisy token takes the first position of its canvas,
    so every token of a noisy canvas sees the same ``window - 1`` context tokens before it (the
    ones transformers' sliding KV cache still holds) and, through the decoder rule, its whole
    canvas. Prompt ``p p p``, noisy canvas at positions 3-5:

    >>> info = TokenInfo(torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([[0, 0, 0, 1, 1, 1]]),
    ...                  torch.tensor([[0, 0, 0, 1, 1, 1]]).bool(), torch.ones(1, 6, dtype=torch.bool))
    >>> window_anchor(info)
    tensor([[0, 1, 2, 3, 3, 3]])
    """
    return torch.where(info.noisy, block_starts(info), info.positions)


def attention_rule(
    q_pos: Tensor,
    q_block: Tensor,
    q_noisy: Tensor,
    q_valid: Tensor,
    k_pos: Tensor,
    k_block: Tensor,
    k_noisy: Tensor,
    k_valid: Tensor,
    *,
    encoder: str,
    window: int | None,
    q_anchor: Tensor | None = None,
) -> Tensor:
    """The whole rule, elementwise and broadcastable (also used inside flex ``mask_mod``).

    Clean queries follow the encoder mode and never see noisy keys; noisy queries follow
    :func:`canvas_decode_mask`. Padding keys are hidden from real queries; padding queries may
    see anything allowed, so no row is ever empty. The sliding window is measured from each
    query's position, or from ``q_anchor`` (:func:`window_anchor`) when given, where noisy
    queries then see their whole canvas.
    """
    enc = causal_mask(q_pos, k_pos) if encoder == "causal" else block_causal_mask(q_block, k_block)
    clean_rule = enc & ~k_noisy
    allowed = torch.where(q_noisy, canvas_decode_mask(q_block, k_block, k_noisy), clean_rule)
    allowed = allowed & (k_valid | ~q_valid)
    if window is not None:
        if q_anchor is None:
            allowed = allowed & sliding_window_mask(q_pos, k_pos, window)
        else:
            allowed = allowed & ((q_noisy & k_noisy) | sliding_window_mask(q_anchor, k_pos, window))
    return allowed


def dense_mask(q: TokenInfo, k: TokenInfo, *, encoder: str, window: int | None, anchor: str = "query") -> Tensor:
    """Materialise :func:`attention_rule` as ``[batch, q_len, k_len]`` booleans."""
    if encoder not in ENCODER_MODES:
        raise ValueError(f"encoder mode must be one of {ENCODER_MODES}, got {encoder!r}")
    q_anchor = window_anchor(q)[:, :, None] if anchor == "canvas" and window is not None else None
    return attention_rule(
        q.positions[:, :, None], q.blocks[:, :, None], q.noisy[:, :, None], q.valid[:, :, None],
        k.positions[:, None, :], k.blocks[:, None, :], k.noisy[:, None, :], k.valid[:, None, :],
        encoder=encoder, window=window, q_anchor=q_anchor,
    )


def single_shot_info(prompt_valid: Tensor, canvas_valid: Tensor, canvas_size: int) -> TokenInfo:
    """Metadata for the single-shot training/reference layout ``[prompt | clean canvases | noisy canvases]``.

    ``prompt_valid`` is ``[B, P]`` (right padded); ``canvas_valid`` is ``[B, N * canvas_size]``.
    Canvas ``i`` starts right after each row's last valid prompt token.
    """
    b, n_tok = canvas_valid.shape
    prompt = TokenInfo.clean(prompt_valid)
    start = prompt_valid.long().sum(-1)
    offs = torch.arange(n_tok, device=canvas_valid.device)
    c_pos = start[:, None] + offs[None, :]
    c_block = (offs // canvas_size + 1)[None, :].expand(b, -1)
    clean = TokenInfo(c_pos, c_block, torch.zeros_like(canvas_valid), canvas_valid.bool())
    noisy = TokenInfo(c_pos, c_block, torch.ones_like(canvas_valid), canvas_valid.bool())
    return prompt.cat(clean).cat(noisy)
