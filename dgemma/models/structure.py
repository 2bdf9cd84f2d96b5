"""Structure-aware canvas positions: learned embeddings of groups of canvas offsets.

Rotary positions are 1-D and relative, so a bidirectional canvas knows only how far apart two
of its tokens are, never *where* a token sits. Tasks with a 2-D layout need more: a Sudoku
solution canvas is 81 cells, and a cell's row, column and 3x3 box decide which others constrain
it (docs/design.md §11 found row/column/box embeddings the largest single gain from scratch).

``ModelConfig.canvas_position_groups`` is a list of *groupings*; each grouping gives one group id
per canvas offset. The model owns one ``nn.Embedding(num_groups, hidden)`` per grouping
(``canvas_groups.0``, ``canvas_groups.1``, ...) and adds, to every canvas token (block >= 1,
clean or noisy; never the prompt, block 0), the sum over groupings of the embedding of the group
at that token's canvas offset, times ``sqrt(hidden_size)`` like the token embeddings. A 2x2 grid
as a canvas of 4, grouped by rows and by columns::

    canvas_position_groups = [[0, 0, 1, 1],   # rows:    offsets 0, 1 in row 0; 2, 3 in row 1
                              [0, 1, 0, 1]]   # columns: offsets 0, 2 in column 0; 1, 3 in column 1
    offset 3 gets  (canvas_groups.0.weight[1] + canvas_groups.1.weight[1]) * sqrt(hidden_size)

The scale matters: both tables start at std 0.02, and without it the positions enter 8x weaker
than the tokens at width 64. On ``configs/sudoku_small.py`` the unscaled version solved 46% /
4% / 0% of easy / medium / hard boards after 800 steps, the scaled one 98% / 90% / 40% (150
puzzles, same seeds).

A token's canvas offset is its rotary position minus the first position of its block in its row
of the batch, within the same forward call (:func:`canvas_offsets`). A whole canvas always
arrives in one call (prefill, append-a-canvas, a decoder pass, or the single-shot training
forward, where the clean and noisy copies of a block share positions), so the offset is the
token's index in its canvas, and cached decoding equals the single-shot forward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dgemma.models.masks import TokenInfo, block_starts


def validate_groups(groups, canvas_size: int | None = None) -> list[list[int]]:
    """Check ``groups`` (a non-empty list of equally long lists of ids >= 0); return a plain copy."""
    out = [[int(g) for g in grouping] for grouping in groups]
    if not out or any(not grouping for grouping in out):
        raise ValueError("canvas_position_groups needs at least one non-empty grouping")
    if len({len(grouping) for grouping in out}) != 1:
        raise ValueError(f"canvas_position_groups: groupings differ in length {[len(g) for g in out]}")
    if canvas_size is not None and len(out[0]) != canvas_size:
        raise ValueError(f"canvas_position_groups covers {len(out[0])} offsets, the canvas has {canvas_size}")
    if any(g < 0 for grouping in out for g in grouping):
        raise ValueError("canvas_position_groups: group ids must be >= 0")
    return out


def canvas_offsets(info: TokenInfo) -> Tensor:
    """``[B, L]`` long: each token's position minus the first position of its block in its row.

    Prompt tokens (block 0) get offsets too; the caller ignores them. The starts are
    :func:`dgemma.models.masks.block_starts`, which the canvas-anchored sliding window uses too.

    >>> info = TokenInfo(positions=torch.tensor([[0, 1, 2, 3, 4, 5, 2, 3, 4]]),
    ...                  blocks=torch.tensor([[0, 0, 1, 1, 1, 2, 1, 1, 1]]),
    ...                  noisy=torch.zeros(1, 9, dtype=torch.bool), valid=torch.ones(1, 9, dtype=torch.bool))
    >>> canvas_offsets(info)
    tensor([[0, 1, 0, 1, 2, 0, 0, 1, 2]])
    """
    return info.positions - block_starts(info)


class CanvasPositionGroups(nn.ModuleList):
    """One embedding table per grouping; ``forward(info)`` -> ``[B, L, d]`` (zero on the prompt).

    Indexing ``canvas_groups[i]`` gives grouping ``i``'s ``nn.Embedding``. Offsets outside the
    canvas (padding of an empty canvas) are clamped into it: such tokens are masked as keys.
    """

    def __init__(self, groups: list[list[int]], hidden_size: int):
        groups = validate_groups(groups)
        super().__init__([nn.Embedding(max(g) + 1, hidden_size) for g in groups])
        self.register_buffer("group_ids", torch.tensor(groups, dtype=torch.long), persistent=False)  # [G, C]

    @property
    def canvas_size(self) -> int:
        return self.group_ids.shape[1]

    def reset_parameters(self, std: float = 0.02) -> None:
        for table in self:
            nn.init.normal_(table.weight, 0.0, std)

    def forward(self, info: TokenInfo) -> Tensor:
        offsets = canvas_offsets(info).clamp(0, self.canvas_size - 1)  # [B, L]
        ids = self.group_ids.to(offsets.device)[:, offsets]  # [G, B, L]
        scale = torch.tensor(math.sqrt(self[0].embedding_dim)).to(self[0].weight.dtype)  # as the token embeddings
        out = sum(table(ids[i]) for i, table in enumerate(self)) * scale
        return torch.where((info.blocks >= 1)[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
