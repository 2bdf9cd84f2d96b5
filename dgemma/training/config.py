"""Run configuration: one keyword-only dataclass per concern, composed into :class:`Config`.

A run config is a flat Python file defining ``get_config() -> Config`` (no config imports
another, docs/design.md §6). Any leaf is overridden on the command line as ``--cfg.optim.lr=3e-4``; values
are parsed and checked against the dataclass annotations, so a typo or a bad value fails before
any work starts, with the full dotted path and a suggestion. The resolved config is saved as
``config.json`` in the workdir and loads back to an equal object.

Choices are ``Literal`` annotations: the type checker, the parser and the error message all read
the same declaration.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from dgemma.errors import DGemmaError
from dgemma.models.transformer import ModelConfig


# ------------------------------------------------------------------------------------ sections
def _positive(obj, *names: str) -> None:
    for n in names:
        if getattr(obj, n) is not None and getattr(obj, n) < 1:
            raise ValueError(f"{n} must be >= 1, got {getattr(obj, n)}")


def _fraction(obj, *names: str) -> None:
    for n in names:
        if getattr(obj, n) is not None and not 0.0 <= getattr(obj, n) <= 1.0:
            raise ValueError(f"{n} must be in [0, 1], got {getattr(obj, n)}")


@dataclass(kw_only=True)
class InitConfig:
    """Where the weights come from before step 0.

    ``base`` is a source for :func:`dgemma.load_pretrained` (``"gemma3-270m"``, a HF folder, a
    ``.gguf``); its architecture wins and the ``model`` fields that differ from
    :class:`ModelConfig`'s defaults are applied on top (see :func:`model_overrides`). ``None``
    builds a random model from ``model`` with ``seed``.

    ``weights`` warm-starts a new run from another run's weights: a checkpoint folder
    (``RUN/checkpoints/step_*``) or a run workdir (its latest complete checkpoint), of the same
    architecture. Only the weights come over (and, for a LoRA run, only what the checkpoint holds);
    the optimiser, schedule and data order start afresh, which is what tells a warm start from a
    resume. A run that already has checkpoints of its own resumes from them and ignores this.
    A source trained with ``train.ema`` gives its weight average, the weights its evaluation uses.

    ``layer_map`` makes the warm-started model deeper than its source: layer ``i`` starts from
    the source's layer ``layer_map[i]``, and a source layer used a second time starts with its
    residual outputs switched off (both post-norm scales at zero), so at step 0 the deeper model
    computes exactly its source's function. Example, a 4-layer source: ``[0, 1, 2, 3, 0, 1, 2, 3]``
    runs the source's stack, then a second copy of it that training switches on.
    """

    base: str | None = None
    seed: int = 0
    weights: str | None = None
    layer_map: list[int] | None = None

    def __post_init__(self):
        if self.layer_map is not None:
            if self.weights is None:
                raise ValueError("layer_map maps the layers of init.weights: set init.weights too")
            if not self.layer_map or min(self.layer_map) < 0:
                raise ValueError(f"layer_map must list source layer indices >= 0, got {self.layer_map}")


@dataclass(kw_only=True)
class DiffusionConfig:
    process: Literal["uniform", "absorbing"] = "uniform"
    schedule: Literal["linear", "cosine"] = "linear"
    t_eps: float = 1e-4  # t ~ U[t_eps, 1 - t_eps]
    canvas_size: int = 256
    num_canvases: int = 1
    selfcond_prob: float = 0.5  # chance per example of the no-grad first pass
    ar_loss_weight: float = 1.0  # encoder next-token loss beside the diffusion loss; 0 = off
    ar_loss_on: Literal["all", "response"] = "all"  # AR targets: prompt and response, or the response only
    diffusion_loss_weight: float = 1.0  # 0 = an AR-only model (no corruption, no decoder pass): a baseline
    loss_chunk_tokens: int = 1024  # tokens per chunked-CE slice: peak fp32 logits = this x vocab x 4 B
    decode: Literal["one", "all"] = "one"  # canvases decoded per example: one (adapter) or all (Lite)
    loss_on: Literal["all", "noised"] = "all"  # diffusion loss on every canvas position, or corrupted ones
    mask_token_id: int | None = None  # absorbing process only: the mask token (None: the tokenizer's)
    key_token_weight: float = 1.0  # loss weight of the tokens the task's metric reads (Task.key_tokens); 1 = off
    block_noise_prob: float = 0.0  # share of rows noised as a left-to-right block sampler leaves a canvas
    block_noise_size: int = 4  # ... in blocks of this many positions (eval_ds.commit_block; corruption.py:block_states)
    certainty_weight: float = 0.0  # + entropy of right predictions (losses.py:chunked_certainty_cross_entropy); 0 = off
    certainty_temperature: float = 1.0  # ... of softmax(logits / this) (dParallel: 0.5)

    def __post_init__(self):
        _positive(self, "canvas_size", "num_canvases", "loss_chunk_tokens")
        _fraction(self, "selfcond_prob", "block_noise_prob")
        _positive(self, "block_noise_size")
        if self.block_noise_prob and self.canvas_size % self.block_noise_size:
            raise ValueError(f"block_noise_size ({self.block_noise_size}) must divide canvas_size ({self.canvas_size})")
        if not 0.0 <= self.t_eps < 0.5:
            raise ValueError(f"t_eps must be in [0, 0.5), got {self.t_eps}")
        if not self.key_token_weight > 0:
            raise ValueError(f"key_token_weight must be positive, got {self.key_token_weight}")
        if self.certainty_weight < 0 or not self.certainty_temperature > 0:
            raise ValueError(f"certainty_weight must be >= 0 and certainty_temperature > 0, got "
                             f"{self.certainty_weight}, {self.certainty_temperature}")
        if self.ar_loss_weight < 0 or self.diffusion_loss_weight < 0:
            raise ValueError("ar_loss_weight and diffusion_loss_weight must be >= 0")
        if not self.ar_loss_weight and not self.diffusion_loss_weight:
            raise ValueError("ar_loss_weight and diffusion_loss_weight are both 0: nothing to train")


@dataclass(kw_only=True)
class DataConfig:
    task: str = "sudoku"
    tokenizer: str | None = None  # for models trained from scratch: "digits" or a tokenizer.json path
    split: str = "train"  # chat task from a Hugging Face dataset: the split to train on
    supervise: Literal["last", "all"] = "last"  # chat task: the final assistant turn, or every one
    pin_clues: bool = False  # sudoku: clues pinned in the canvas (infilling), never noised nor scored
    sudoku_unique: float = 0.0  # sudoku stream: share of puzzles with exactly one solution (tasks/sudoku.py:SudokuStream)
    sudoku_unique_pool: int = 2000  # sudoku stream: how many unique puzzles to generate (each seen transformed)
    sudoku_unique_clues: tuple[int, int] = (22, 35)  # sudoku stream: clue range of the unique puzzles (inclusive)
    path: str | None = None  # None: the task's default source (generator, shared data set)
    prompt_len: int = 256  # 0 for pretraining (no prompt: the whole window is canvases)
    response_end: Literal["end_of_turn", "eos"] = "end_of_turn"  # the token appended to every response
    trim_prompt_padding: bool = False  # cut each step's prompts to its longest one (same math, fewer FLOPs)
    batch_size: int = 8  # per optimiser micro-step and rank
    num_workers: int = 0
    on_error: Literal["skip", "fail"] = "fail"  # a malformed record: count and skip, or stop
    seed: int = 0

    def __post_init__(self):
        _positive(self, "batch_size", "sudoku_unique_pool")
        _fraction(self, "sudoku_unique")
        lo, hi = self.sudoku_unique_clues
        if not 17 <= lo <= hi <= 81:
            raise ValueError(f"sudoku_unique_clues must be (lo, hi) with 17 <= lo <= hi <= 81, got {self.sudoku_unique_clues}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")


@dataclass(kw_only=True)
class OptimConfig:
    """Linear warmup to ``lr``, then cosine to ``lr * min_lr_ratio`` at the last step."""

    name: Literal["adamw", "adafactor"] = "adamw"
    lr: float = 1.5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.95, 0.99)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    clip_norm: float | None = 1.0

    def __post_init__(self):
        _fraction(self, "min_lr_ratio")


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 2000
    grad_accum: int = 1
    seed: int = 0
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 where the device supports it
    activation_checkpointing: bool = False
    checkpoint_every: int = 1000
    keep_last: int | None = 3  # None keeps every checkpoint
    resume: bool = True  # continue from the workdir's latest complete checkpoint
    log_every: int = 10
    eval_every: int | None = None  # None: evaluate only at the end
    eval_name: str | None = None  # the evaluator eval_every runs, e.g. train_eval_sample_ar_steps16 (None: the first default)
    distributed: Literal["ddp", "fsdp"] = "ddp"
    nan_rollback_after: int = 5  # consecutive non-finite steps before rolling back
    threads: int | None = None  # torch CPU threads; None = torch's default. Bits depend on it.
    ema: float | None = None  # decay of a moving average of the trained weights, evaluated instead of them (training/ema.py)

    def __post_init__(self):
        _positive(self, "steps", "grad_accum", "checkpoint_every", "keep_last", "log_every", "eval_every",
                  "nan_rollback_after", "threads")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise ValueError(f"ema must be a decay in (0, 1), e.g. 0.998, or None; got {self.ema}")


@dataclass(kw_only=True)
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | Literal["all-linear"] = "all-linear"  # resolved to names, never lm_head
    train_experts: bool = False  # MoE bases: train the experts in full too (the router stays frozen)


@dataclass(kw_only=True)
class EvalConfig:
    batch_size: int = 8
    steps: list[int] = field(default_factory=lambda: [32, 64, 96])  # one eval per denoising step count
    step_type: Literal["ddim", "commit", "confidence", "entropy_bound"] = "ddim"
    temperature: float = 0.7
    early_stopping: Literal["entropy", "stable_confident"] | None = "entropy"  # None: run every step
    entropy_threshold: float = 0.05
    max_canvases: int | None = None  # None: the data's num_canvases
    min_stop_prob: float = 0.0  # sampler: a stop token only where its probability reaches this (0 = argmax)
    confidence_threshold: float = 0.9  # confidence step: commit every position with p above this
    commit_block: int | None = None  # commit step: semi-autoregressive sub-blocks of this many positions
    commit_order: Literal["confidence", "margin"] = "confidence"  # commit step: rank by p, or by p - runner-up's p
    commit_stable_first: bool = True  # commit step: a position whose p rose at the last step ranks first
    commit_no_repeat: bool = False  # commit step: a token equal to a neighbour's gives way to the runner-up
    entropy_bound: float = 0.1  # entropy_bound step: bound on the accepted positions' entropies (nats)
    stability_threshold: int = 1  # stable_confident stopping: steps the argmax canvas must stay unchanged
    stop_confidence_threshold: float = 0.005  # stable_confident stopping: mean entropy below this (nats)
    stop_alias_cos: float | None = None  # fold tokens whose embedding has this cosine with a stop token's into it
    logit_bias: dict[str, float] | None = None  # {token text: bias} added to those logits at every step (both decoders)
    self_condition: bool = True  # diffusion decoder: feed each step's prediction to the next (False: a zero signal)
    fuse_append: bool = True  # append a finished canvas in the next canvas's first pass (False: a forward of its own)
    # approximate, greedy narrow decoding only: a pass recomputes the canvas positions a step reads
    # and those whose token changed, reusing the others' keys (CanvasSampler.reuse_canvas_keys)
    reuse_canvas_keys: bool = False
    # approximate, greedy narrow decoding only: a canvas's first pass keeps each position's top-K tokens
    # (and the context's); its later passes score only those (CanvasSampler.shortlist). 0: off
    shortlist: int = 0
    response_prefix: str | None = None  # text every answer starts with, given to both decoders (pinned / prefilled)
    # what generate, serve, load_model and the lm-eval model decode with unless asked otherwise
    interactive_steps: int | None = None  # steps of generate / serve / load_model / lm-eval (None: steps[0])
    interactive_early_stopping: Literal["none", "entropy", "stable_confident"] | None = None  # None: early_stopping
    interactive_self_condition: bool | None = None  # None: self_condition
    interactive_reuse_canvas_keys: bool | None = None  # None: reuse_canvas_keys
    interactive_no_repeat: bool | None = None  # None: commit_no_repeat
    interactive_shortlist: int | None = None  # None: shortlist
    num_examples: int = 256
    split: str | None = None  # the evaluators' split (None: the task's default, e.g. test)
    seed: int = 0
    path: str | None = None  # chat/completion tasks: the eval JSONL (None: data.path's eval.jsonl sibling)
    regex: str | None = None  # generic tasks: answer extractor with a named group 'answer'
    normalizer: str = "default"  # generic tasks: exact-match normaliser (default | none | strip | lower)
    puzzle_seed: int = 7_919  # sudoku without data.path: seed of the generated held-out puzzles

    def __post_init__(self):
        _positive(self, "batch_size", "max_canvases", "num_examples", "commit_block", "interactive_steps")
        _fraction(self, "min_stop_prob", "confidence_threshold", "stop_alias_cos")
        for name in ("entropy_bound", "stop_confidence_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("stability_threshold", "shortlist", "interactive_shortlist"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(n < 1 for n in self.steps):
            raise ValueError(f"steps must all be >= 1, got {self.steps}")


@dataclass(kw_only=True)
class AuxConfig:
    """Evaluation-time overrides that are not sampler settings."""

    eval_num_batches: int | None = None  # cap on eval batches during training; None = all
    num_canvases: int | None = None  # eval-time canvas count override


LEGACY_KNOBS = {"step.threshold": "confidence_threshold", "step.block": "commit_block", "step.bound": "entropy_bound",
                "stop.threshold": "entropy_threshold", "stop.stability_threshold": "stability_threshold",
                "stop.confidence_threshold": "stop_confidence_threshold", "eval_puzzle_seed": "puzzle_seed"}
"""The free-form ``aux.knobs`` of older configs, and the typed ``eval_ds`` field each became."""


def _upgrade_knobs(d: dict) -> dict:
    """A saved config with ``aux.knobs`` (before typed sampler settings): each known knob moved
    to its ``eval_ds`` field; an unknown one is refused rather than silently dropped."""
    aux = d.get("aux")
    if not isinstance(aux, dict) or "knobs" not in aux:
        return d
    knobs = aux["knobs"] or {}
    if not isinstance(knobs, dict):
        raise DGemmaError(f"config aux.knobs must be an object, got {knobs!r}")
    unknown = sorted(set(knobs) - set(LEGACY_KNOBS))
    if unknown:
        raise DGemmaError(f"config aux.knobs.{unknown[0]} is not read any more (aux.knobs became typed eval_ds "
                          f"fields: {', '.join(f'{k} -> eval_ds.{v}' for k, v in LEGACY_KNOBS.items())})")
    eval_ds = {**d.get("eval_ds", {}), **{LEGACY_KNOBS[k]: v for k, v in knobs.items()}}
    return {**d, "aux": {k: v for k, v in aux.items() if k != "knobs"}, "eval_ds": eval_ds}


@dataclass(kw_only=True)
class Config:
    """A run. ``eval_ds`` is the evaluation section, named as in the reference configs
    (``--cfg.eval_ds.batch_size=16``)."""

    workdir: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval_ds: EvalConfig = field(default_factory=EvalConfig)
    aux: AuxConfig = field(default_factory=AuxConfig)

    def __post_init__(self):
        groups = getattr(self.model, "canvas_position_groups", None)
        if groups is not None and len(groups[0]) != self.diffusion.canvas_size:
            raise ValueError(f"model.canvas_position_groups covers {len(groups[0])} canvas offsets but "
                             f"diffusion.canvas_size is {self.diffusion.canvas_size}")


# ------------------------------------------------------------------------------------- typing
_NONE_WORDS = ("none", "null")
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
               "on": True, "off": False}


class _BadValue(Exception):
    """Internal: a value does not fit a type; carries nothing, the caller words the error."""


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _describe(tp) -> str:
    """How a type reads in an error message."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "none"
    if _is_union(tp):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if tp is bool:
        return "bool (true/false)"
    if origin is list:
        return f"list of {_describe(args[0])} (comma-separated or JSON)"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_describe(args[0])} (comma-separated or JSON)"
        return f"{len(args)} comma-separated values ({', '.join(_describe(a) for a in args)})"
    if origin is dict:
        return "JSON object"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _union_order(arg) -> int:
    """Try the narrowest readings first: a Literal before a list, str last."""
    if typing.get_origin(arg) is Literal:
        return 0
    return {bool: 1, int: 2, float: 3, str: 9}.get(arg, 5)


def _split(s: str) -> list:
    s = s.strip()
    if s.startswith(("[", "(")):
        try:
            v = json.loads("[" + s[1:-1] + "]" if s.startswith("(") else s)
        except json.JSONDecodeError:
            raise _BadValue from None
        if not isinstance(v, list):
            raise _BadValue
        return v
    return [] if not s else [x.strip() for x in s.split(",")]


def _coerce(v: Any, tp: Any, cli: bool) -> Any:
    """``v`` as a value of ``tp``. ``cli``: ``v`` may be the command line's text for it.

    Values from Python files and JSON are checked, not parsed: ``lr="1e-4"`` in a config file is
    a mistake to report, not a string to guess at.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    text = cli and isinstance(v, str)
    if tp is Any:
        return v
    if tp is type(None):
        if v is None or (text and v.strip().lower() in _NONE_WORDS):
            return None
        raise _BadValue
    if _is_union(tp):
        if type(None) in args and (v is None or text and v.strip().lower() in _NONE_WORDS):
            return None
        for arg in sorted((a for a in args if a is not type(None)), key=_union_order):
            try:
                return _coerce(v, arg, cli)
            except _BadValue:
                continue
        raise _BadValue
    if origin is Literal:
        for choice in args:
            if v == choice and type(v) is type(choice) or text and str(choice) == v.strip():
                return choice
        raise _BadValue
    if tp is bool:
        if isinstance(v, bool):
            return v
        if text and v.strip().lower() in _BOOL_WORDS:
            return _BOOL_WORDS[v.strip().lower()]
        raise _BadValue
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if text:
            try:
                return int(v.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(v)
                except ValueError:
                    raise _BadValue from None
                if f.is_integer():  # 1e3 steps
                    return int(f)
        raise _BadValue
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if text:
            try:
                return float(v.strip())
            except ValueError:
                raise _BadValue from None
        raise _BadValue
    if tp is str:
        if isinstance(v, str):
            return v
        raise _BadValue
    if origin in (list, tuple):
        if text:
            v = _split(v)
        if not isinstance(v, (list, tuple)):
            raise _BadValue
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(v) != len(args):
                raise _BadValue
            return tuple(_coerce(x, a, cli) for x, a in zip(v, args))
        items = [_coerce(x, args[0] if args else Any, cli) for x in v]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if text:
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                raise _BadValue from None
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise _BadValue
        return {k: _coerce(x, args[1] if args else Any, cli) for k, x in v.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(v, tp):
            return v
        raise _BadValue
    raise TypeError(f"config field type {tp!r} is not supported")


def _check_value(v: Any, tp: Any, key: str, cli: bool) -> Any:
    try:
        return _coerce(v, tp, cli)
    except _BadValue:
        raise DGemmaError(f"invalid value {v!r} for {key}: expected {_describe(tp)}") from None


# ---------------------------------------------------------------------------------- key paths
def _leaf_paths(cls, prefix: str = "") -> list[str]:
    out = []
    for name, tp in _hints(cls).items():
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _leaf_paths(tp, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def _quote_list(items: list[str]) -> str:
    q = [f"'{x}'" for x in items]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def _unknown_key(key: str, root=None) -> DGemmaError:
    """``unknown config key 'optim.lrr'; did you mean 'optim.lr'?``

    Suggestions come from the same section first (difflib on the field name, so ``optim.lrr``
    is not matched to ``optim.eps`` through the shared prefix), then the same name in another
    section (``train.lr`` -> ``optim.lr``), then the whole dotted path (``optm.lr``).
    """
    valid = _leaf_paths(root or Config)
    section, _, leaf = key.rpartition(".")
    in_section = [p for p in valid if p.rpartition(".")[0] == section]
    names = difflib.get_close_matches(leaf, [p.rpartition(".")[2] for p in in_section], n=3, cutoff=0.6)
    out = [f"{section}.{n}" if section else n for n in names]
    out += [p for p in valid if p.rpartition(".")[2] == leaf and p not in out]
    if not out:
        out = difflib.get_close_matches(key, valid, n=3, cutoff=0.7)
    if out:
        return DGemmaError(f"unknown config key '{key}'; did you mean {_quote_list(out[:3])}?")
    if in_section and section:
        return DGemmaError(f"unknown config key '{key}'; valid keys under '{section}': "
                           + ", ".join(p.rpartition(".")[2] for p in in_section))
    return DGemmaError(f"unknown config key '{key}'; top-level keys: " + ", ".join(_hints(root or Config)))


# -------------------------------------------------------------------------------- rebuilding
def _derived_defaults(obj, changes: dict[str, Any]) -> dict[str, Any]:
    """Fields that ``__post_init__`` filled from others and that should follow them.

    ``ModelConfig.layer_types`` defaults to a pattern over ``num_hidden_layers``; overriding the
    layer count alone must re-derive it rather than fail on a stale 18-entry list. A field counts
    as derived when it has a ``None`` default and rebuilding with ``None`` reproduces its value.
    """
    out = {}
    current = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    for f in dataclasses.fields(obj):
        if f.name in changes or not f.init or f.default is not None or current[f.name] is None:
            continue
        try:
            if getattr(type(obj)(**{**current, f.name: None}), f.name) == current[f.name]:
                out[f.name] = None
        except Exception:
            continue
    return out


def _rebuild(obj, changes: dict[str, Any], section: str):
    """A new ``type(obj)`` with ``changes``, so ``__post_init__`` validation runs again."""
    kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    kwargs.update(_derived_defaults(obj, changes))
    kwargs.update(changes)
    try:
        return type(obj)(**kwargs)
    except (ValueError, TypeError) as e:
        raise DGemmaError(f"invalid {section or 'config'} config: {e}") from None


def apply_overrides(cfg: Config, args: list[str]) -> Config:
    """Return a copy of ``cfg`` with ``--cfg.a.b=value`` items applied in order (later wins)."""
    nested: dict = {}
    for arg in args:
        if not arg.startswith("--cfg."):
            raise DGemmaError(f"not a config override: {arg!r}; write --cfg.SECTION.KEY=VALUE")
        key, eq, value = arg[len("--cfg."):].partition("=")
        if not eq:
            raise DGemmaError(f"{arg} needs a value: write {arg}=VALUE")
        parts = key.split(".")
        cls, node = type(cfg), nested
        for i, part in enumerate(parts):
            hints = _hints(cls)
            dotted = ".".join(parts[: i + 1])
            if dotted == "aux.knobs":
                name = ".".join(parts[i + 1:])
                new = f"--cfg.eval_ds.{LEGACY_KNOBS[name]}=..." if name in LEGACY_KNOBS else "a typed eval_ds field"
                raise DGemmaError(f"aux.knobs is gone: write {new} instead of {arg.partition('=')[0]}")
            if part not in hints:
                raise _unknown_key(key, type(cfg))
            tp = hints[part]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                if i == len(parts) - 1:
                    raise DGemmaError(f"'{dotted}' is a config section, not a value; set one of its "
                                      f"fields, e.g. --cfg.{dotted}.{next(iter(_hints(tp)))}=...")
                cls, node = tp, node.setdefault(part, {})
                continue
            if i != len(parts) - 1:
                raise DGemmaError(f"'{dotted}' is a value, not a section: no '{key}'")
            node[part] = _check_value(value, tp, key, cli=True)
            break
    return _apply_nested(cfg, nested, "")


def _apply_nested(obj, nested: dict, section: str):
    if not nested:
        return obj
    changes = {}
    for k, v in nested.items():
        if isinstance(v, dict) and dataclasses.is_dataclass(getattr(obj, k)):
            changes[k] = _apply_nested(getattr(obj, k), v, f"{section}.{k}" if section else k)
        else:
            changes[k] = v
    return _rebuild(obj, changes, section)


# ------------------------------------------------------------------------------ dict / json
def config_to_dict(cfg) -> dict:
    """JSON-ready nested dict (tuples become lists)."""

    def conv(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def config_from_dict(d: dict, cls: type = Config, *, _prefix: str = "", _root: type | None = None):
    """Inverse of :func:`config_to_dict`. Missing keys take defaults (configs saved before a
    field existed still load); unknown keys are an error with a suggestion."""
    root = _root or cls
    if not isinstance(d, dict):
        raise DGemmaError(f"config section '{_prefix.rstrip('.') or 'config'}' must be an object, got {d!r}")
    if cls is Config and not _prefix:
        d = _upgrade_knobs(d)
    hints = _hints(cls)
    kwargs = {}
    for k, v in d.items():
        key = _prefix + k
        if k not in hints:
            raise _unknown_key(key, root)
        tp = hints[k]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[k] = config_from_dict(v, tp, _prefix=key + ".", _root=root)
        else:
            kwargs[k] = _check_value(v, tp, key, cli=False)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise DGemmaError(f"invalid {_prefix.rstrip('.') or 'config'} config: {e}") from None


def validate_config(cfg: Config) -> Config:
    """Type-check every field of a config built in Python (a file's ``get_config()``)."""
    if not isinstance(cfg, Config):
        raise DGemmaError(f"expected a Config, got {type(cfg).__name__}")
    for name, tp in _hints(Config).items():
        v = getattr(cfg, name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and not isinstance(v, tp):
            raise DGemmaError(f"config field '{name}' must be a {tp.__name__}, got {type(v).__name__}")
    return config_from_dict(config_to_dict(cfg))


def save_config(cfg: Config, workdir: str | os.PathLike) -> Path:
    """Write the resolved config to ``workdir/config.json`` (atomically) and return its path."""
    path = Path(workdir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp_config_{os.getpid()}.json")
    tmp.write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def model_overrides(cfg: Config) -> dict[str, Any]:
    """``model`` fields that differ from :class:`ModelConfig`'s defaults: what to apply on top of
    a pretrained ``init.base`` (e.g. ``{"self_conditioning": True}``)."""
    default, mine = config_to_dict(ModelConfig()), config_to_dict(cfg.model)
    derived = _derived_defaults(cfg.model, {})
    return {k: getattr(cfg.model, k) for k, v in mine.items() if default.get(k) != v and k not in derived}


# ------------------------------------------------------------------------------ files and CLI
_KWARG_RE = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")
_SECTIONS = {c.__name__: c for c in (Config, ModelConfig, InitConfig, DiffusionConfig, DataConfig,
                                     OptimConfig, TrainConfig, LoraConfig, EvalConfig, AuxConfig)}


def load_config(path: str | os.PathLike) -> Config:
    """Run a config file and return its validated ``get_config()``.

    A ``.json`` path is read as a saved ``config.json`` instead, so a finished run's resolved
    config can seed the next one.
    """
    path = Path(path)
    if not path.is_file():
        raise DGemmaError(f"config file not found: {path}")
    if path.suffix == ".json":
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DGemmaError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        return config_from_dict(d)
    source = path.read_text()
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as e:
        raise DGemmaError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    module = types.ModuleType(f"dgemma_config_{path.stem}")
    module.__file__ = str(path)
    try:
        exec(code, module.__dict__)
        get_config = module.__dict__.get("get_config")
        if not callable(get_config):
            raise DGemmaError(f"{path} defines no get_config() function returning a Config")
        cfg = get_config()
    except DGemmaError:
        raise
    except Exception as e:
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                     if f.filename == str(path)), None)
        where = f"{path}:{line}" if line else str(path)
        msg = f"{type(e).__name__}: {e}"
        if isinstance(e, TypeError) and (m := _KWARG_RE.search(str(e))) and m[1] in _SECTIONS:
            fields = list(_hints(_SECTIONS[m[1]]))
            close = difflib.get_close_matches(m[2], fields, n=3, cutoff=0.6)
            msg = f"{m[1]} has no field '{m[2]}'" + (f"; did you mean {_quote_list(close)}?" if close else "")
        raise DGemmaError(f"{where}: {msg}") from None
    if not isinstance(cfg, Config):
        raise DGemmaError(f"{path}: get_config() returned {type(cfg).__name__}, not a Config")
    return validate_config(cfg)


def parse_cli(argv: list[str], *, require_file: bool = True) -> tuple[Config, list[str]]:
    """``--cfg=FILE`` (or ``--cfg FILE``) plus ``--cfg.a.b=v`` overrides -> ``(Config, rest)``.

    Everything else (``--step=3``, positionals) is returned untouched, in order, for the caller's
    own parser. Without ``--cfg`` the defaults are the base, unless ``require_file``.
    """
    file, overrides, rest = None, [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--cfg" or a.startswith("--cfg="):
            if file is not None:
                raise DGemmaError(f"--cfg given twice ({file} and {a}); one config file per run")
            if a == "--cfg":
                if i + 1 >= len(argv):
                    raise DGemmaError("--cfg needs a file: --cfg=configs/NAME.py")
                i += 1
                file = argv[i]
            else:
                file = a[len("--cfg="):]
        elif a.startswith("--cfg."):
            overrides.append(a)
        else:
            rest.append(a)
        i += 1
    if file is None and require_file:
        raise DGemmaError("missing --cfg=FILE (a config file such as configs/sft_sudoku.py)")
    cfg = load_config(file) if file is not None else Config()
    return apply_overrides(cfg, overrides), rest
