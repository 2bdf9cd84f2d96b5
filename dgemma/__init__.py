"""dgemma: DiffusionGemma in PyTorch.

Imports are lazy so that ``import dgemma`` (and the CLI, and worker processes) start without
loading torch until a model is actually needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "DiffusionGemma": "dgemma.models.transformer",
    "ModelConfig": "dgemma.models.transformer",
    "KVCache": "dgemma.models.kv_cache",
    "TokenInfo": "dgemma.models.masks",
    "load_model": "dgemma.sampling",
    "SamplerConfig": "dgemma.sampling",
    "build_sampler": "dgemma.sampling",
    "keep_freed_heap": "dgemma.device",
}


def load_pretrained(source, *, dtype=None, **overrides):
    """Load ``(model, tokenizer)`` from a HF Gemma 3 folder, a ``.gguf`` file or ``"gemma3-270m"``.

    See :func:`dgemma.models.pretrained.load_pretrained`.
    """
    from dgemma.models.pretrained import load_pretrained as _load

    return _load(source, dtype=dtype, **overrides)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dgemma' has no attribute {name!r}")


__all__ = ["DiffusionGemma", "KVCache", "ModelConfig", "SamplerConfig", "TokenInfo", "build_sampler",
           "keep_freed_heap", "load_model", "load_pretrained", "__version__"]
