"""Checkpoints that survive a crash at any instant.

Layout: ``WORKDIR/checkpoints/step_00001000/`` holding ``model.safetensors`` (weights),
``optim.pt`` (optimiser state; absent when saved without one), ``state.pt`` (scheduler, RNG
states, data sampler offsets: anything picklable) and ``meta.json``. Everything is written into
a ``.tmp_step_*`` directory, fsynced, and renamed into place, and ``meta.json`` is written last
with the size and sha256 of every other file: a step directory whose ``meta.json`` is present
and whose files match it is complete (docs/design.md §7); anything else is ignored by
:func:`latest_checkpoint` and refused by :func:`load_checkpoint`.

One writer per workdir (rank 0): the next save deletes leftover ``.tmp_*`` directories.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dgemma.errors import DGemmaError
from dgemma.models.transformer import ModelConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE, OPTIM_FILE, STATE_FILE, META_FILE = "model.safetensors", "optim.pt", "state.pt", "meta.json"
_TMP_PREFIX = ".tmp_"
_RESERVED = {"format_version", "step", "time", "unix_time", "torch_version", "num_threads", "files",
             "tensor_aliases", "model_fingerprint"}

FINGERPRINT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "layer_types", "encoder_mode",
    "self_conditioning", "selfcond_variant", "selfcond_intermediate_size",
    "time_conditioning", "time_freq_dim", "canvas_position_groups",
    "norm_unit_offset", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "num_experts",
    "top_k_experts", "moe_intermediate_size", "layer_scalar", "shift_logits",
)
"""The architecture a set of weights belongs to: shapes, which trained blocks exist, and the
encoder's attention rule. Back-end, checkpointing and context-length fields may change freely."""


# ----------------------------------------------------------------------------- fingerprints
def model_fingerprint(model_config: dict | Any) -> dict:
    """The fields of a model config (``ModelConfig`` or its ``to_dict()``) that must match
    between a checkpoint and the model it is loaded into. Conditioning details are dropped when
    the block is off, and defaults are resolved, so equal architectures give equal prints."""
    if dataclasses.is_dataclass(model_config):
        model_config = dataclasses.asdict(model_config)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model_config.items() if k in known})
    fp = {k: getattr(cfg, k) for k in FINGERPRINT_FIELDS}
    fp["layer_types"] = list(fp["layer_types"])
    if fp["self_conditioning"]:
        fp["selfcond_intermediate_size"] = fp["selfcond_intermediate_size"] or fp["hidden_size"]
    else:
        del fp["selfcond_variant"], fp["selfcond_intermediate_size"]
    if not fp["time_conditioning"]:
        del fp["time_freq_dim"]
    if fp["canvas_position_groups"] is None:  # unset: the print of a checkpoint saved before the field
        del fp["canvas_position_groups"]
    if not fp["shift_logits"]:  # likewise
        del fp["shift_logits"]
    return fp


def _fmt(v: Any) -> str:
    """Compact value for messages: lists run-length encoded (``[5x'sliding_attention', ...]``)."""
    if not isinstance(v, list):
        return str(v)
    if v and all(isinstance(x, list) for x in v):  # canvas_position_groups: its shape, not 81 x 3 ids
        return f"<{len(v)} groupings of {len(v[0])} offsets, {[max(x, default=-1) + 1 for x in v]} groups>"
    runs: list[list] = []
    for x in v:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "[" + ", ".join(f"{n}x{x!r}" if n > 1 else repr(x) for x, n in runs) + "]"


def check_compatible(saved_meta: dict, model_config: dict | Any, *, source: str | os.PathLike | None = None) -> None:
    """Raise :class:`DGemmaError` listing every architecture field that differs.

    ``saved_meta`` is a checkpoint's ``meta.json`` (from :func:`load_checkpoint`); a field the
    checkpoint does not record (saved by an older version) is not compared.
    """
    saved = saved_meta.get("model_fingerprint")
    if saved is None and isinstance(saved_meta.get("config"), dict) and "model" in saved_meta["config"]:
        saved = model_fingerprint(saved_meta["config"]["model"])
    name = str(source) if source is not None else f"step {saved_meta.get('step', '?')}"
    if saved is None:
        raise DGemmaError(f"checkpoint {name} records no model architecture; cannot check it")
    unset = {"canvas_position_groups": None, "shift_logits": False}  # absent from a print (older prints too)
    saved = {**unset, **saved}
    mine = {**unset, **model_fingerprint(model_config)}
    keys = [k for k in dict.fromkeys([*saved, *mine]) if k in saved]
    diff = [k for k in keys if saved.get(k) != mine.get(k)]
    if diff:
        was = " ".join(f"{k}={_fmt(saved.get(k))}" for k in diff)
        now = " ".join(f"{k}={_fmt(mine.get(k))}" for k in diff)
        raise DGemmaError(f"checkpoint {name} was trained with {was}; this config has {now}")


# -------------------------------------------------------------------------------- file utils
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Rename out of the way, then delete: a crash mid-delete leaves only a ``.tmp_`` dir."""
    doomed = path.with_name(f"{_TMP_PREFIX}del_{path.name}_{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


# ------------------------------------------------------------------------------ tied tensors
def _split_aliases(state: dict) -> tuple[dict, dict]:
    """``(unique tensors, {alias: canonical})``.

    safetensors refuses tensors that share storage (the tied LM head). Exact views of the same
    memory are stored once and recorded as aliases; other overlapping views are copied, so
    values survive even where the sharing cannot.
    """
    unique, aliases, exact, used = {}, {}, {}, set()
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if t.numel() == 0:
            unique[name] = t.contiguous().cpu()
            continue
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in exact:
            aliases[name] = exact[key]
            continue
        exact[key] = name
        if (ptr, t.device) in used or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        used.add((ptr, t.device))
        unique[name] = t.cpu()
    return unique, aliases


# ------------------------------------------------------------------------------------- save
def save_checkpoint(
    workdir: str | os.PathLike,
    step: int,
    *,
    model_state: dict,
    optim_state: dict | None,
    extra_state: dict,
    metadata: dict,
    keep_last: int | None,
    model_config: Any = None,
) -> Path:
    """Write step ``step`` atomically and prune to the newest ``keep_last`` complete ones.

    ``metadata`` is JSON-serialisable and goes into ``meta.json`` beside the bookkeeping; when it
    holds ``config`` (a :func:`~dgemma.training.config.config_to_dict`) with a ``model`` section,
    the model fingerprint is derived from it, unless ``model_config`` (the model actually built,
    e.g. from a pretrained base with its own architecture) is given. Saving an existing step replaces it. Returns the
    step directory.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be >= 1 (or None to keep every checkpoint)")
    if clash := _RESERVED & set(metadata):
        raise ValueError(f"metadata keys {sorted(clash)} are reserved")
    try:
        user_meta = json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable: {e}") from None

    root = Path(workdir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        log.info("removing stale checkpoint temp dir %s", stale)
        shutil.rmtree(stale, ignore_errors=True)

    final = _step_dir(root, step)
    tmp = root / f"{_TMP_PREFIX}{final.name}_{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tensors, aliases = _split_aliases(model_state)
    save_file(tensors, tmp / MODEL_FILE, metadata={"format": "pt", "dgemma_aliases": json.dumps(aliases)})
    del tensors
    _fsync_file(tmp / MODEL_FILE)
    names = [MODEL_FILE]
    if optim_state is not None:
        torch.save(optim_state, tmp / OPTIM_FILE)
        _fsync_file(tmp / OPTIM_FILE)
        names.append(OPTIM_FILE)
    torch.save(extra_state, tmp / STATE_FILE)
    _fsync_file(tmp / STATE_FILE)
    names.append(STATE_FILE)

    now = time.time()
    meta = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "unix_time": now,
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "files": {n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in names},
        "tensor_aliases": aliases,
    }
    config = user_meta.get("config")
    if model_config is not None:
        meta["model_fingerprint"] = model_fingerprint(model_config)
    elif isinstance(config, dict) and isinstance(config.get("model"), dict):
        meta["model_fingerprint"] = model_fingerprint(config["model"])
    meta.update(user_meta)
    with open(tmp / META_FILE, "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)

    if final.exists():
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(root)

    if keep_last is not None:
        for _, old in list_checkpoints(workdir)[:-keep_last]:
            if old != final:
                log.info("pruning checkpoint %s (keep_last=%d)", old, keep_last)
                _remove(old)
    return final


# ------------------------------------------------------------------------------------- find
def _problem(path: Path, *, verify: bool) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` when it is."""
    if path.name.startswith(_TMP_PREFIX):
        return "it is the temporary directory of an unfinished save"
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return f"{META_FILE} is missing (the save was interrupted or the directory was copied partially)"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        step = int(meta["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        return f"{META_FILE} is unreadable ({type(e).__name__}: {e})"
    if path.name.startswith("step_") and path.name != f"step_{step:08d}":
        return f"{META_FILE} records step {step}, not the directory's"
    for name in (MODEL_FILE, STATE_FILE):
        if name not in files:
            return f"{META_FILE} lists no {name}"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != info["bytes"]:
            return f"{name} is {size} bytes, {META_FILE} records {info['bytes']} (truncated or replaced)"
        if verify and (digest := _sha256(f)) != info["sha256"]:
            return f"{name} has sha256 {digest[:12]}..., {META_FILE} records {info['sha256'][:12]}... (corrupt or modified)"
    return None


def list_checkpoints(workdir: str | os.PathLike, *, verify: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. ``verify`` also checks every sha256 (reads them all);
    without it, completeness is ``meta.json`` plus the recorded file sizes."""
    root = Path(workdir) / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for p in root.glob("step_*"):
        try:
            step = int(p.name[len("step_"):])
        except ValueError:
            continue
        if p.is_dir() and _problem(p, verify=verify) is None:
            out.append((step, p))
    return sorted(out)


def latest_checkpoint(workdir: str | os.PathLike, *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint whose checksums match, or ``None``.

    Candidates are checked newest first and the first good one wins, so a resume reads the
    files of one checkpoint, not all of them. Skipped ones are logged.
    """
    root = Path(workdir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = []
    for p in root.glob("step_*"):
        try:
            steps.append((int(p.name[len("step_"):]), p))
        except ValueError:
            continue
    for _, p in sorted(steps, reverse=True):
        if not p.is_dir():
            continue
        if (why := _problem(p, verify=verify)) is None:
            return p
        log.warning("skipping incomplete checkpoint %s: %s", p, why)
    return None


def drop_optimizer_state(path: str | os.PathLike) -> int:
    """Make the step directory ``path`` an inference-only checkpoint: delete ``optim.pt`` and its
    entry in ``meta.json`` (rewritten atomically), so it loads for evaluation and export as a
    complete checkpoint of the weights, while a resume from it fails with a clear error instead
    of continuing with a fresh optimizer. Returns the bytes freed (0 when there was none)."""
    path = Path(path)
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text())
    info = meta["files"].pop(OPTIM_FILE, None)
    if info is None:
        return 0
    meta["optimizer_state"] = "dropped (an inference-only copy: evaluation and export, not resume)"
    tmp = path / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(meta_path)
    (path / OPTIM_FILE).unlink(missing_ok=True)
    return int(info["bytes"])


# ------------------------------------------------------------------------------------- load
def load_checkpoint(path: str | os.PathLike, *, verify: bool = True, map_location: Any = "cpu") -> dict:
    """``{"step", "model", "optim", "extra", "meta"}`` from a step directory.

    Tied tensors come back as one tensor under every name. ``state.pt`` is unpickled in full
    (it holds RNG and sampler state), so load only checkpoints you trust; ``optim.pt`` is read
    with ``weights_only``.
    """
    path = Path(path)
    if not path.is_dir():
        raise DGemmaError(f"checkpoint {path} does not exist")
    if (why := _problem(path, verify=verify)) is not None:
        raise DGemmaError(f"checkpoint {path} is incomplete or corrupt: {why}")
    meta = json.loads((path / META_FILE).read_text())
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    try:
        model = load_file(path / MODEL_FILE, device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise DGemmaError(f"checkpoint {path}: cannot read {MODEL_FILE}: {e}") from None
    for alias, canonical in meta.get("tensor_aliases", {}).items():
        model[alias] = model[canonical]
    optim = None
    if OPTIM_FILE in meta["files"]:
        optim = _torch_load(path / OPTIM_FILE, map_location, weights_only=True)
    extra = _torch_load(path / STATE_FILE, map_location, weights_only=False)
    return {"step": meta["step"], "model": model, "optim": optim, "extra": extra, "meta": meta}


def _torch_load(f: Path, map_location: Any, *, weights_only: bool) -> Any:
    try:
        return torch.load(f, map_location=map_location, weights_only=weights_only)
    except Exception as e:
        raise DGemmaError(f"checkpoint {f.parent}: cannot read {f.name}: {type(e).__name__}: {e}") from None
