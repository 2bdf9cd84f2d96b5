"""dgemma: DiffusionGemma in PyTorch."""

from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.transformer import DiffusionGemma, ModelConfig

__version__ = "0.1.0"


def load_pretrained(source, *, dtype=None, **overrides):
    """Load ``(model, tokenizer)`` from a HF Gemma 3 folder, a ``.gguf`` file or ``"gemma3-270m"``.

    See :func:`dgemma.models.weights.load_pretrained`.
    """
    from dgemma.models.weights import load_pretrained as _load

    return _load(source, dtype=dtype, **overrides)


__all__ = ["DiffusionGemma", "KVCache", "ModelConfig", "TokenInfo", "load_pretrained", "__version__"]
