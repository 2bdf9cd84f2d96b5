"""Next-token alignment of canvas predictions (``ModelConfig.shift_logits``).

A pretrained AR model's hidden state at position ``i`` predicts the token at ``i + 1``. A
diffusion decoder without the shift asks the same head to predict the token *at* ``i``, a new
mapping that a small adapter learns slowly: Gemma 3 270M starts at ~9 nats per masked token
against ~2.7 for its next-token loss on the same PubMedQA answers. With the shift (as Dream and
DiffuLLaMA adapt AR models) canvas position ``j > 0`` is predicted from the decoder's hidden
state at ``j - 1``, and position 0 from the clean (encoder) hidden state of the token just before
the canvas: the last prompt token for the first canvas, the last token of the previous canvas
after that. The decoder's last position then predicts nothing inside its canvas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.errors import DGemmaError


def shift_to_canvas(hidden: Tensor, before: Tensor, canvas_size: int) -> Tensor:
    """``hidden [B, N*C, d]`` over N canvases and ``before [B, N, d]`` (the clean hidden state of
    the token before each canvas) -> ``[B, N*C, d]``, row ``j`` of canvas ``k`` holding the state
    that predicts its token: ``before[k]`` for ``j = 0``, else ``hidden[k*C + j - 1]``.

    >>> h = torch.arange(1., 5.).view(1, 4, 1)        # two canvases of 2: states 1 2 | 3 4
    >>> b = torch.tensor([[[10.], [20.]]])            # before canvas 0, before canvas 1
    >>> shift_to_canvas(h, b, 2).flatten().tolist()
    [10.0, 1.0, 20.0, 3.0]
    """
    bsz, length, d = hidden.shape
    if length % canvas_size or before.shape != (bsz, length // canvas_size, d):
        raise DGemmaError(f"shift_to_canvas: hidden {tuple(hidden.shape)} is not whole canvases of {canvas_size} "
                          f"with one state before each (got before {tuple(before.shape)})")
    h = hidden.view(bsz, length // canvas_size, canvas_size, d)
    return torch.cat([before[:, :, None].to(h.dtype), h[:, :, :-1]], 2).view(bsz, length, d)


def before_indices(prompt_valid: Tensor, canvases: Tensor, canvas_size: int) -> Tensor:
    """Index, in ``[prompt | canvases]`` (right-padded prompt of ``P`` slots), of the token before
    each canvas in ``canvases [B, K]`` (canvas numbers): the last valid prompt token for canvas 0,
    ``P + k*C - 1`` (the previous canvas's last token) for canvas ``k > 0``. A row without a prompt
    has no token before its first canvas: an error, since nothing could predict its first token.

    >>> valid = torch.tensor([[True, True, False], [True, False, False]])  # P = 3, C = 2
    >>> before_indices(valid, torch.tensor([[0, 1], [0, 2]]), 2).tolist()
    [[1, 4], [0, 6]]
    """
    n = prompt_valid.long().sum(-1)  # [B]
    if bool((n == 0).any()):
        raise DGemmaError("shift_logits needs a prompt (at least BOS) before the first canvas")
    p = prompt_valid.shape[1]
    return torch.where(canvases == 0, (n - 1)[:, None], p + canvases * canvas_size - 1)
