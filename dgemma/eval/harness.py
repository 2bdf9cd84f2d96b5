"""Offline evaluation of a run's checkpoint: sample the eval prompts, score, record, compare with AR.

Evaluators are named as in the reference: ``sample_ar_steps{N}`` (every canvas runs all ``N``
denoising steps) and ``sample_ar_steps{N}_early_stopping`` (a canvas stops when
``eval_ds.early_stopping`` fires; ``entropy`` when the config says none), for ``N`` in
``eval_ds.steps``. They run on the task's default split; ``{split}_sample_ar_steps{N}...``
runs on another split (``train_eval_sample_ar_steps32`` for PubMedQA's train-eval items).

Each evaluator writes, under ``DIR/eval/<eval_name>/``:

- ``step_<S>.json`` (``S`` = the checkpoint step): metrics, sampling statistics and every
  setting that decides the numbers (seed, steps, temperature, step rule, stopping rule and
  thresholds, canvases, batch size, device and thread count: docs/design.md §8);
- ``step_<S>.jsonl``: one line per example with its prompt, output, reference and score;
- ``viz/step_<S>_ex<k>.{gif,png}`` for the first ``visualize`` examples;

and TensorBoard scalars ``eval/<eval_name>/<key>`` at step ``S`` under ``DIR/eval/tb``.

Sampling is seeded by ``eval_ds.seed`` through one generator for the whole evaluator, so the
same checkpoint, settings and seed give the same outputs. Every sampler setting is a typed
``eval_ds`` field (``--cfg.eval_ds.confidence_threshold=0.95`` for the confidence step,
``--cfg.eval_ds.commit_block=8``, ``--cfg.eval_ds.stop_confidence_threshold=0.01``), turned into a
sampler by ``dgemma/sampling.py:eval_settings`` and ``dgemma/sampling.py:build_sampler``.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dgemma.data.sft import encode_prompts, pin_rows, response_end_id
from dgemma.diffusion.sampler import CanvasSampler, ar_generate, rates
from dgemma.errors import DGemmaError
from dgemma.eval.sudoku_verify import evaluate_verified
from dgemma.eval.visualize import visualize_example
from dgemma.sampling import (build_sampler as build, check_prefix, eval_settings, max_canvases, resolve_logit_bias,
                             resolve_prefix)
from dgemma.tasks import get_task

EVAL_NAME = re.compile(r"^(?:(?P<split>\w+?)_)?sample_ar_steps(?P<steps>\d+)(?P<es>_early_stopping)?$")
AR_EVAL_NAME = re.compile(r"^(?:(?P<split>\w+?)_)?ar_greedy$")
VERIFIED_EVAL_NAME = re.compile(
    r"^(?:(?P<split>\w+?)_)?verified_steps(?P<steps>\d+)_rounds(?P<rounds>\d+)(?:_variants(?P<variants>\d+))?$")
AR_MAX_TOKENS = 64
AR_KEYS = ("ar_examples", "ar_max_new_tokens", "ar_tokens", "ar_forward_passes", "ar_tokens_per_forward",
           "ar_tokens_per_second", "ar_seconds", "ar_prefill_seconds",
           "ar_decode_tokens_per_second")  # None when the AR baseline is skipped


@dataclass(frozen=True)
class Evaluator:
    name: str
    split: str
    num_steps: int  # 0 for ``ar_greedy``
    early_stopping: bool
    ar: bool = False  # greedy token-by-token decoding instead of the diffusion sampler
    rounds: int | None = None  # verified solving (Sudoku) with up to this many repair rounds
    variants: int = 1  # and this many re-runs per round


def evaluator_name(num_steps: int, early_stopping: bool, split: str | None = None) -> str:
    name = f"sample_ar_steps{num_steps}" + ("_early_stopping" if early_stopping else "")
    return f"{split}_{name}" if split else name


def parse_evaluator(name: str, task) -> Evaluator:
    """``[split_]sample_ar_steps{N}[_early_stopping]`` or ``[split_]ar_greedy`` -> :class:`Evaluator`
    (split checked)."""
    if m := AR_EVAL_NAME.match(name):
        return Evaluator(name, task.check_split(m["split"] or task.default_split), 0, False, ar=True)
    if m := VERIFIED_EVAL_NAME.match(name):
        if task.name != "sudoku":
            raise DGemmaError(f"{name}: verified solving is for the sudoku task, not {task.name!r}")
        if int(m["steps"]) < 1 or (m["variants"] is not None and int(m["variants"]) < 1):
            raise DGemmaError(f"bad evaluator name {name!r}: verified_steps<N>_rounds<K>[_variants<W>] needs "
                              f"N >= 1 and W >= 1")
        return Evaluator(name, task.check_split(m["split"] or task.default_split), int(m["steps"]), False,
                         rounds=int(m["rounds"]), variants=int(m["variants"] or 1))
    m = EVAL_NAME.match(name)
    if not m or int(m["steps"]) < 1:
        raise DGemmaError(f"bad evaluator name {name!r}: expected [SPLIT_]sample_ar_steps<N>[_early_stopping], "
                          f"[SPLIT_]ar_greedy or (sudoku) [SPLIT_]verified_steps<N>_rounds<K>[_variants<W>], "
                          f"e.g. sample_ar_steps32_early_stopping")
    split = task.check_split(m["split"] or task.default_split)
    return Evaluator(name, split, int(m["steps"]), bool(m["es"]))


def default_evaluators(cfg, task) -> list[Evaluator]:
    """``sample_ar_steps{N}`` for N in ``eval_ds.steps``, plus ``_early_stopping`` variants when
    ``eval_ds.early_stopping`` is set, on ``eval_ds.split`` (None: the task's default split)."""
    split = task.check_split(cfg.eval_ds.split or task.default_split)
    prefix = None if split == task.default_split else split
    if not cfg.diffusion.diffusion_loss_weight:  # an AR-only run: its only decoder is the AR one
        return [Evaluator(f"{prefix}_ar_greedy" if prefix else "ar_greedy", split, 0, False, ar=True)]
    out = []
    for n in cfg.eval_ds.steps:
        for es in (False, True) if cfg.eval_ds.early_stopping else (False,):
            out.append(Evaluator(evaluator_name(n, es, prefix), split, n, es))
    return out


# ------------------------------------------------------------------------------------ building
def _params(obj) -> dict:
    """The constructor arguments an object kept, for the record (noise and schedules by name)."""
    out = {}
    for name in inspect.signature(type(obj)).parameters:
        if hasattr(obj, name):
            v = getattr(obj, name)
            out[name] = v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__
    return out


def build_sampler(run, task, *, num_steps: int, step_type: str, temperature: float,
                  early_stopping: str | None) -> tuple[CanvasSampler, dict]:
    """The run's sampler (``dgemma/sampling.py:build_sampler``) and the settings that describe it."""
    cfg = run.cfg
    noise = run.noise()
    sampler = build(eval_settings(cfg, num_steps=num_steps, step_type=step_type, temperature=temperature,
                                  early_stopping=early_stopping, tokenizer=run.tokenizer),
                    noise=noise, canvas_size=cfg.diffusion.canvas_size, stop_ids=task.stop_ids(run.tokenizer))
    step, stop, rule = sampler.step, sampler.stop, early_stopping or "none"
    settings = {
        "seed": cfg.eval_ds.seed, "num_steps": num_steps, "step_type": step_type, "step_args": _params(step),
        "temperature": temperature, "early_stopping": early_stopping, "stopping": {"rule": rule, **_params(stop)},
        "canvas_size": sampler.canvas_size, "max_canvases": sampler.max_canvases, "stop_ids": list(sampler.stop_ids),
        "noise": cfg.diffusion.process, "schedule": cfg.diffusion.schedule, "pin_clues": cfg.data.pin_clues,
        "min_stop_prob": sampler.min_stop_prob, "stop_alias_cos": sampler.stop_alias_cos,
        "logit_bias": cfg.eval_ds.logit_bias, "self_condition": sampler.self_condition, "weights": run.weights,
        "lora": run.lora, "fuse_append": sampler.fuse_append, "reuse_canvas_keys": sampler.reuse_canvas_keys,
        "shortlist": sampler.shortlist, "response_prefix": cfg.eval_ds.response_prefix,
    }
    return sampler, settings


def clue_hints(run, records: list[dict], width: int) -> torch.Tensor | None:
    """``[B, width]`` pinned response tokens (``-1`` = free) when the run trained with them
    (``data.pin_clues``: Sudoku clues), else None."""
    fn = get_task(run.cfg.data.task).hints(run.cfg, run.tokenizer)
    if fn is None:
        return None
    tok = run.tokenizer
    return pin_rows([fn(r, tok.encode(r["response"]) + [response_end_id(tok, run.cfg.data.response_end)]) or []
                     for r in records], width)


def checked_prefix(run, prefix: tuple[int, ...], records: list[dict]) -> tuple[int, ...]:
    """``prefix`` once it is known to begin every record's reference response
    (:func:`~dgemma.sampling.check_prefix`; records without a reference are not checked)."""
    if prefix:
        tok = run.tokenizer
        check_prefix(prefix, [tok.encode(r["response"]) for r in records if r.get("response")], tok)
    return prefix


def eval_limit(cfg) -> int | None:
    """Examples the ``aux.eval_num_batches`` cap leaves (None: no cap)."""
    n = cfg.aux.eval_num_batches
    return None if n is None else n * cfg.eval_ds.batch_size


def batches(records: list[dict], batch_size: int, max_batches: int | None) -> list[list[dict]]:
    out = [records[i: i + batch_size] for i in range(0, len(records), batch_size)]
    return out[:max_batches] if max_batches else out


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _compiled(model) -> dict | None:
    """How a ``CompiledModel`` (``--compile``) compiled so far; None for an eager model."""
    n = getattr(model, "compiles", None)
    return None if n is None else {"graphs": n, "compile_s": round(model.compile_s, 1)}


def _dtype(model) -> str:
    """The weights' dtype, or ``bfloat16 autocast`` inside an autocast region (training's eval hook)."""
    if torch.is_autocast_enabled(_device(model).type):
        return f"{str(torch.get_autocast_dtype(_device(model).type)).removeprefix('torch.')} autocast"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------ sampling
@dataclass
class Generation:
    records: list[dict]
    tokens: list[list[int]]
    forward_passes: list[int]
    steps_used: list[list[int]]
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # of ``seconds``: the prompts' encoding
    truncated: int = 0
    trajectories: dict[int, list[dict]] = field(default_factory=dict)  # example index -> steps

    def stats(self, num_steps: int) -> dict:
        n_tok, n_fwd = sum(map(len, self.tokens)), sum(self.forward_passes)
        canvases = [s for row in self.steps_used for s in row]
        return {"examples": len(self.tokens), "tokens": n_tok, "forward_passes": n_fwd,
                "tokens_per_forward": n_tok / max(n_fwd, 1), **rates(n_tok, self.seconds, self.prefill_seconds),
                "canvases": len(canvases),
                "mean_steps_per_canvas": sum(canvases) / max(len(canvases), 1),
                "early_stopped_canvases": sum(s < num_steps for s in canvases), "truncated_prompts": self.truncated}

    def scored(self, task, tokenizer) -> tuple[list[str], dict]:
        """The decoded texts and the task's metrics of them."""
        texts = [tokenizer.decode(t) for t in self.tokens]
        return texts, task.score(texts, self.records)


def generate(run, sampler: CanvasSampler, records: list[dict], *, batch_size: int, max_batches: int | None = None,
             seed: int = 0, record_first: int = 0, pins: list[list[int]] | None = None) -> Generation:
    """Sample every batch with one generator seeded by ``seed``; keep trajectories of the first
    ``record_first`` examples (recording draws nothing, so outputs are the same either way).
    ``pins``: per record, response tokens to pin from the first canvas position on (a forced
    prefix), instead of the task's own hints (:func:`clue_hints`)."""
    dev = _device(run.model)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pad_to = run.cfg.data.prompt_len if run.model.config.attn_implementation == "flex" else None
    out = Generation([], [], [], [])
    checked_prefix(run, sampler.prefix, records)
    for batch in batches(records, batch_size, max_batches):
        first = len(out.records)
        ids, valid, truncated = encode_prompts(run.tokenizer, batch, run.cfg.data.prompt_len, pad_to=pad_to,
                                               device=dev)
        sampler.record = first < record_first
        width = sampler.max_canvases * sampler.canvas_size
        hints = clue_hints(run, batch, width) if pins is None else pin_rows(pins[first:first + len(batch)], width)
        res = sampler(run.model, ids, valid, generator=gen, hints=None if hints is None else hints.to(dev))
        out.records += batch
        out.tokens += res.tokens
        out.forward_passes += res.forward_passes
        out.steps_used += res.steps_used
        out.seconds += res.seconds
        out.prefill_seconds += res.prefill_seconds
        out.truncated += truncated
        for j, traj in enumerate(res.trajectories or []):
            if first + j < record_first:
                out.trajectories[first + j] = traj
    sampler.record = False
    return out


def generate_ar(run, task, records: list[dict], *, batch_size: int, max_new_tokens: int,
                max_batches: int | None = None) -> Generation:
    """Greedy AR decoding of every batch through the KV cache, stopping at the task's stop tokens
    (and their aliases, ``eval_ds.stop_alias_cos``), each answer starting with ``eval_ds.response_prefix``
    where the run sets one: :func:`generate`'s counterpart for an AR model."""
    dev = _device(run.model)
    bias = resolve_logit_bias(run.cfg.eval_ds.logit_bias, run.tokenizer)
    prefix = checked_prefix(run, resolve_prefix(run.cfg.eval_ds.response_prefix, run.tokenizer), records)
    out = Generation([], [], [], [])
    for batch in batches(records, batch_size, max_batches):
        ids, valid, truncated = encode_prompts(run.tokenizer, batch, run.cfg.data.prompt_len, device=dev)
        res = ar_generate(run.model, ids, valid, max_new_tokens=max_new_tokens, stop_ids=task.stop_ids(run.tokenizer),
                          stop_alias_cos=run.cfg.eval_ds.stop_alias_cos, logit_bias=bias, prefix=prefix)
        out.records += batch
        out.tokens += res.tokens
        out.forward_passes += res.forward_passes
        out.steps_used += [[] for _ in batch]
        out.seconds += res.seconds
        out.prefill_seconds += res.prefill_seconds
        out.truncated += truncated
    return out


def ar_baseline(run, task, records: list[dict], *, batch_size: int, max_new_tokens: int, repeats: int = 2) -> dict:
    """Greedy AR decoding of the same weights on the first batch of prompts (capped length);
    the fastest of ``repeats`` runs, as first calls on a CPU pay one-off costs."""
    batch = records[:batch_size]
    ids, valid, _ = encode_prompts(run.tokenizer, batch, run.cfg.data.prompt_len, device=_device(run.model))
    runs = [ar_generate(run.model, ids, valid, max_new_tokens=max_new_tokens, stop_ids=task.stop_ids(run.tokenizer),
                        stop_alias_cos=run.cfg.eval_ds.stop_alias_cos)
            for _ in range(max(repeats, 1))]
    s = min(runs, key=lambda r: r.seconds).stats()
    return {"ar_examples": len(batch), "ar_max_new_tokens": max_new_tokens, **{f"ar_{k}": v for k, v in s.items()}}


def ar_cap(cfg, ar_max_tokens: int) -> int:
    """AR tokens per prompt: ``ar_max_tokens``, at most what the diffusion sampler can emit."""
    return min(ar_max_tokens, cfg.diffusion.canvas_size * max_canvases(cfg))


def warmup(run, task, records: list[dict]) -> None:
    """Untimed short AR and diffusion runs, so one-off first-call costs (kernel selection,
    allocation) stay out of the measured tokens/s."""
    if not records:
        return
    e = run.cfg.eval_ds
    ids, valid, _ = encode_prompts(run.tokenizer, records, run.cfg.data.prompt_len, device=_device(run.model))
    ar_generate(run.model, ids, valid, max_new_tokens=4)
    sampler, _ = build_sampler(run, task, num_steps=2, step_type=e.step_type, temperature=e.temperature,
                               early_stopping=None)
    generate(run, sampler, records, batch_size=len(records), seed=e.seed)


# ------------------------------------------------------------------------------------ evaluate
def eval_dir(run, out_dir: str | Path | None = None) -> Path:
    """``<workdir>/eval``; the workdir is ``out_dir`` or the one holding the run's checkpoint."""
    return Path(out_dir if out_dir is not None else run.path.parent.parent) / "eval"


def evaluate(run, task, *, eval_name: str, num_steps: int, step_type: str, temperature: float,
             early_stopping: str | None, split: str | None = None, records: list[dict] | None = None,
             out_dir: str | Path | None = None, visualize: int = 0, ar_stats: dict | None = None,
             ar_max_tokens: int = AR_MAX_TOKENS, tb=None) -> dict:
    """Run one evaluator on ``run`` and write its files; returns what ``step_<S>.json`` holds.

    ``records`` default to ``task.load(cfg, split)``; ``ar_stats`` (from :func:`ar_baseline`)
    is computed here when not given, unless ``ar_max_tokens`` is 0. ``tb`` is a SummaryWriter
    to reuse (one is opened and closed here otherwise).
    """
    cfg, e = run.cfg, run.cfg.eval_ds
    task = (get_task(task) if isinstance(task, str) else task).configure(cfg)
    split = task.check_split(split or task.default_split)
    records = task.load(cfg, split, limit=eval_limit(cfg)) if records is None else records
    sampler, settings = build_sampler(run, task, num_steps=num_steps, step_type=step_type, temperature=temperature,
                                      early_stopping=early_stopping)
    gen = generate(run, sampler, records, batch_size=e.batch_size, max_batches=cfg.aux.eval_num_batches,
                   seed=e.seed, record_first=visualize)
    texts, metrics = gen.scored(task, run.tokenizer)
    stats = gen.stats(num_steps)
    if ar_stats is None and ar_max_tokens > 0:
        ar_stats = ar_baseline(run, task, records, batch_size=e.batch_size,
                               max_new_tokens=ar_cap(cfg, ar_max_tokens))
    stats.update({k: None for k in AR_KEYS}, **(ar_stats or {}))
    ar_tps = stats.get("ar_tokens_per_second")
    stats["speedup_vs_ar"] = stats["tokens_per_second"] / ar_tps if ar_tps else None
    settings.update(batch_size=e.batch_size, num_batches=cfg.aux.eval_num_batches, prompt_len=cfg.data.prompt_len,
                    device=str(_device(run.model)), dtype=_dtype(run.model), threads=torch.get_num_threads(),
                    compiled=_compiled(run.model))
    result = {"eval_name": eval_name, "task": task.name, "split": split, "source": task.source(cfg, split),
              "checkpoint_step": run.step, "num_examples": len(gen.records), "metrics": metrics, "stats": stats,
              "settings": settings}
    out = eval_dir(run, out_dir) / eval_name
    _write(out, run.step, result, _examples(task, gen, texts))
    _scalars(tb, eval_dir(run, out_dir) / "tb", eval_name, run.step, {**metrics, **stats})
    if visualize:
        _visualize(run, task, gen, sampler, out / "viz", run.step)
    return result


def evaluate_ar(run, task, *, eval_name: str, split: str | None = None, records: list[dict] | None = None,
                out_dir: str | Path | None = None, max_new_tokens: int | None = None, tb=None) -> dict:
    """Greedy AR decoding of every record through the KV cache, scored like the diffusion
    evaluators (the baseline an AR fine-tune is judged by). ``max_new_tokens`` defaults to the
    diffusion sampler's budget, ``canvas_size * max_canvases``; files as :func:`evaluate`."""
    cfg, e = run.cfg, run.cfg.eval_ds
    task = (get_task(task) if isinstance(task, str) else task).configure(cfg)
    split = task.check_split(split or task.default_split)
    records = task.load(cfg, split, limit=eval_limit(cfg)) if records is None else records
    max_new = max_new_tokens or cfg.diffusion.canvas_size * max_canvases(cfg)
    dev = _device(run.model)
    gen = generate_ar(run, task, records, batch_size=e.batch_size, max_batches=cfg.aux.eval_num_batches,
                      max_new_tokens=max_new)
    texts, metrics = gen.scored(task, run.tokenizer)
    stats = gen.stats(0)
    settings = {"decoder": "ar_greedy", "max_new_tokens": max_new, "stop_ids": list(task.stop_ids(run.tokenizer)),
                "batch_size": e.batch_size, "num_batches": cfg.aux.eval_num_batches, "prompt_len": cfg.data.prompt_len,
                "device": str(dev), "dtype": _dtype(run.model), "threads": torch.get_num_threads(),
                "stop_alias_cos": cfg.eval_ds.stop_alias_cos, "logit_bias": cfg.eval_ds.logit_bias,
                "response_prefix": cfg.eval_ds.response_prefix, "weights": run.weights, "lora": run.lora,
                "compiled": _compiled(run.model)}
    result = {"eval_name": eval_name, "task": task.name, "split": split, "source": task.source(cfg, split),
              "checkpoint_step": run.step, "num_examples": len(gen.records), "metrics": metrics, "stats": stats,
              "settings": settings}
    _write(eval_dir(run, out_dir) / eval_name, run.step, result, _examples(task, gen, texts))
    _scalars(tb, eval_dir(run, out_dir) / "tb", eval_name, run.step, {**metrics, **stats})
    return result


def _examples(task, gen: Generation, texts: list[str]) -> list[dict]:
    return [{"index": i, "id": r.get("id"), "system": r.get("system"), "prompt": r["prompt"], "output": text,
             "reference": task.reference(r), "score": task.score_one(text, r), "tokens": len(toks),
             "forward_passes": fwd, "steps_used": steps}
            for i, (r, text, toks, fwd, steps) in enumerate(zip(gen.records, texts, gen.tokens, gen.forward_passes,
                                                                gen.steps_used))]


def _write(out: Path, step: int, result: dict, examples: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"step_{step}.json", json.dumps(result, indent=2) + "\n"),
                       (f"step_{step}.jsonl", "".join(json.dumps(x) + "\n" for x in examples))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def _scalars(tb, tb_dir: Path, eval_name: str, step: int, values: dict) -> None:
    own = tb is None
    if own:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(tb_dir))
    for k, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            tb.add_scalar(f"eval/{eval_name}/{k}", v, step)
    tb.flush()
    if own:
        tb.close()


def _visualize(run, task, gen: Generation, sampler: CanvasSampler, out: Path, step: int) -> None:
    for i, traj in sorted(gen.trajectories.items()):
        visualize_example(task.viz, traj, gen.tokens[i], run.tokenizer, out / f"step_{step}_ex{i}",
                          canvas_size=sampler.canvas_size, stop_ids=sampler.stop_ids,
                          puzzle=gen.records[i].get("puzzle"))


def evaluate_verified_run(run, task, ev: Evaluator, *, records: list[dict], out_dir=None, tb=None) -> dict:
    """The verified-solving evaluator (``dgemma/eval/sudoku_verify.py:evaluate_verified``): files
    as :func:`evaluate` (``step_<S>.json`` with ``model_only`` and ``verified`` kept apart, one
    ``step_<S>.jsonl`` line per puzzle), TensorBoard ``eval/<name>/model_only/<k>`` and
    ``eval/<name>/verified/<k>``."""
    out = evaluate_verified(run, task, rounds=ev.rounds, records=records, num_steps=ev.num_steps, split=ev.split,
                            variants=ev.variants)
    out["eval_name"] = ev.name
    examples = out.pop("examples")
    _write(eval_dir(run, out_dir) / ev.name, run.step, out, examples)
    for part in ("model_only", "verified"):
        _scalars(tb, eval_dir(run, out_dir) / "tb", f"{ev.name}/{part}", run.step, out[part])
    return out


def run_evaluators(run, task, evaluators: list[Evaluator], *, out_dir: str | Path | None = None,
                   visualize: int = 0, ar_max_tokens: int = AR_MAX_TOKENS) -> list[dict]:
    """Every evaluator with the config's step type and temperature; records and the AR baseline
    are computed once per split and shared."""
    from torch.utils.tensorboard import SummaryWriter

    cfg, e = run.cfg, run.cfg.eval_ds
    task = (get_task(task) if isinstance(task, str) else task).configure(cfg)
    splits = dict.fromkeys(ev.split for ev in evaluators)
    records = {split: task.load(cfg, split, limit=eval_limit(cfg)) for split in splits}
    ar = {}
    if records:
        warmup(run, task, next(iter(records.values()))[: e.batch_size])
    if ar_max_tokens > 0:
        ar = {split: ar_baseline(run, task, recs, batch_size=e.batch_size, max_new_tokens=ar_cap(cfg, ar_max_tokens))
              for split, recs in records.items()}
    tb = SummaryWriter(str(eval_dir(run, out_dir) / "tb"))
    results = []
    try:
        for ev in evaluators:
            if ev.rounds is not None:
                results.append(evaluate_verified_run(run, task, ev, records=records[ev.split], out_dir=out_dir, tb=tb))
                continue
            if ev.ar:
                results.append(evaluate_ar(run, task, eval_name=ev.name, split=ev.split, records=records[ev.split],
                                           out_dir=out_dir, tb=tb))
                continue
            rule = (e.early_stopping or "entropy") if ev.early_stopping else None
            results.append(evaluate(run, task, eval_name=ev.name, num_steps=ev.num_steps, step_type=e.step_type,
                                    temperature=e.temperature, early_stopping=rule, split=ev.split,
                                    records=records[ev.split], out_dir=out_dir, visualize=visualize,
                                    ar_stats=ar.get(ev.split), ar_max_tokens=ar_max_tokens, tb=tb))
    finally:
        tb.close()
    return results
