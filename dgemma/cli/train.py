"""``dgemma train --cfg=FILE [--cfg.a.b=value ...]`` (also under ``torchrun ... -m dgemma train``)."""

from __future__ import annotations

from dgemma.errors import DGemmaError


def run(argv: list[str]) -> int:
    from dgemma.training.config import parse_cli
    from dgemma.training.trainer import train

    cfg, rest = parse_cli(argv)
    if rest:
        raise DGemmaError(f"unexpected arguments {rest}; every setting is --cfg.KEY=VALUE")
    out = train(cfg)
    if out:
        print(f"[dgemma] done: step {cfg.train.steps}, loss {out['loss']:.4f}")
    return 0
