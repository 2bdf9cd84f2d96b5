"""An exponential moving average of the trained weights (Polyak averaging), for evaluation.

``train.ema = d`` keeps, after every optimiser step that was taken, ``shadow += (1 - d_t) *
(weight - shadow)`` in fp32 for every trained parameter, with the warm-up ``d_t = min(d, (1 +
t) / (10 + t))`` (``t`` = updates so far) so that the first averages are not dominated by the
initial weights. A small model trained at a high learning rate ends its run oscillating around a
minimum; the average sits nearer its centre (docs/design.md §11 evaluated the Sudoku sweep with
``d = 0.998``). The shadow lives in the checkpoint's ``state.pt`` (``extra["ema"]``), so a resumed
run continues the same average bit for bit; ``dgemma/training/runs.py:load_run`` evaluates with
it unless asked for the raw weights.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dgemma.errors import DGemmaError


def ema_rate(decay: float, updates: int) -> float:
    """The decay of update ``updates + 1``: ``min(decay, (1 + t) / (10 + t))``.
    Example, ``decay=0.998``: 0.1, 0.18, 0.25, ... 0.99 at t = 890, then 0.998 from t = 4,490."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightEMA:
    """The average of ``model``'s trainable parameters, by their ``named_parameters`` names."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise DGemmaError(f"train.ema must be a decay in (0, 1), e.g. 0.998; got {decay}")
        self.decay, self.updates = float(decay), 0
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - ema_rate(self.decay, self.updates)
        names = list(self.params)
        torch._foreach_lerp_([self.shadow[n] for n in names], [self.params[n].detach().float() for n in names],
                             weight)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "weights": {n: t.clone() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        weights = state["weights"]
        if set(weights) != set(self.shadow):
            missing, extra = sorted(set(self.shadow) - set(weights)), sorted(set(weights) - set(self.shadow))
            raise DGemmaError(f"the checkpoint's weight average does not match this model's trained parameters "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for n, t in weights.items():
            self.shadow[n].copy_(t)
        self.updates = int(state["updates"])

    @contextmanager
    def applied(self):
        """The model holds the averaged weights inside the block, its own ones again after it."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])


def load_averaged(model: nn.Module, state: dict) -> None:
    """Copy a checkpoint's averaged weights (``extra["ema"]``) into ``model``, each cast to its
    parameter's dtype; names the model lacks are an error."""
    params = dict(model.named_parameters())
    unknown = sorted(set(state["weights"]) - set(params))
    if unknown:
        raise DGemmaError(f"the checkpoint's weight average names parameters this model lacks: {unknown[:3]}")
    with torch.no_grad():
        for n, t in state["weights"].items():
            params[n].copy_(t.to(params[n].dtype))
