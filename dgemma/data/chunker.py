"""The canvas chunker: cut a response into fixed-size canvases (docs/design.md §3).

The response is truncated to ``num_canvases * canvas_size`` tokens and laid out canvas by canvas;
the rest of the last non-empty canvas is filled with EOS and the canvases after it are PAD
(invalid). When the response is not truncated it is always followed by at least one EOS: a
response that ends exactly on a canvas boundary gets one more canvas of all EOS, and an empty
response is one canvas of all EOS. Otherwise no canvas would ever teach the model to stop at a
boundary (its successor would be PAD, which carries no loss), nor to answer with nothing. A
response of ``num_canvases * canvas_size`` tokens or more fills every canvas and has no EOS:
it was cut, so the model must not learn to stop there.

>>> c = chunk_response([5, 6, 7], num_canvases=3, canvas_size=2, eos_id=1, pad_id=0)
>>> c.tokens.tolist(), c.canvas_id.tolist()
([5, 6, 7, 1, 0, 0], [0, 0, 1, 1, 2, 2])
>>> c.canvas_mask.tolist(), c.valid.tolist()
([True, True, False], [True, True, True, True, False, False])
>>> chunk_response([5, 6], num_canvases=3, canvas_size=2, eos_id=1, pad_id=0).tokens.tolist()
[5, 6, 1, 1, 0, 0]
>>> chunk_response([5, 6, 7, 8, 9, 4, 3], num_canvases=3, canvas_size=2, eos_id=1, pad_id=0).tokens.tolist()
[5, 6, 7, 8, 9, 4]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dgemma.errors import DGemmaError


@dataclass
class Canvases:
    """One response laid out as ``num_canvases`` canvases of ``canvas_size`` tokens.

    ``tokens``, ``canvas_id`` (the canvas each position belongs to, PAD canvases included) and
    ``valid`` (response or EOS, not PAD) are ``[num_canvases * canvas_size]``; ``canvas_mask``
    ``[num_canvases]`` marks the non-empty canvases, the ones a trainer may pick to denoise.
    """

    tokens: Tensor
    canvas_id: Tensor
    canvas_mask: Tensor
    valid: Tensor


def chunk_response(tokens: Sequence[int], *, num_canvases: int, canvas_size: int, eos_id: int,
                   pad_id: int) -> Canvases:
    """Lay ``tokens`` out as canvases by the rule in the module docstring."""
    if num_canvases < 1 or canvas_size < 1:
        raise DGemmaError(
            f"num_canvases and canvas_size must be >= 1, got {num_canvases} and {canvas_size}"
        )
    capacity = num_canvases * canvas_size
    body = [int(t) for t in tokens[:capacity]]
    n = len(body)
    if n < capacity:
        used = n // canvas_size + 1
        filled = used * canvas_size
    else:
        used, filled = num_canvases, capacity
    ids = body + [eos_id] * (filled - n) + [pad_id] * (capacity - filled)
    valid = torch.zeros(capacity, dtype=torch.bool)
    valid[:filled] = True
    canvas_mask = torch.zeros(num_canvases, dtype=torch.bool)
    canvas_mask[:used] = True
    return Canvases(
        tokens=torch.tensor(ids, dtype=torch.long),
        canvas_id=torch.arange(num_canvases).repeat_interleave(canvas_size),
        canvas_mask=canvas_mask,
        valid=valid,
    )


def collate_canvases(items: Sequence[Canvases]) -> dict[str, Tensor]:
    """Stack equally shaped :class:`Canvases` into ``{field: [B, ...]}`` tensors."""
    if not items:
        raise DGemmaError("collate_canvases needs at least one example")
    shape = (items[0].tokens.shape, items[0].canvas_mask.shape)
    for i, c in enumerate(items):
        if (c.tokens.shape, c.canvas_mask.shape) != shape:
            raise DGemmaError(
                f"collate_canvases: example {i} has {c.canvas_mask.numel()} canvases over "
                f"{c.tokens.numel()} tokens, example 0 has {shape[1].numel()} over "
                f"{shape[0].numel()}; chunk every example with the same num_canvases and "
                f"canvas_size"
            )
    return {
        name: torch.stack([getattr(c, name) for c in items])
        for name in ("tokens", "canvas_id", "canvas_mask", "valid")
    }
