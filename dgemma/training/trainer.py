"""The training loop shared by the adapter recipes and Lite pretraining (docs/design.md §6-7).

The heart is :func:`train_step`: one optimiser step over ``grad_accum`` micro-batches whose
losses are normalised by the number of valid tokens in the *whole* step (all micro-batches, all
ranks), so accumulation and data parallelism change nothing but speed. Everything random in a
step draws from generators seeded by ``(seed, step, micro-step, rank)``; the data order is a
seeded permutation with a stored offset. Together with checkpoints that hold the optimiser,
scheduler and data-order state, a run resumed from any checkpoint ends bitwise identical to an
uninterrupted one (at a fixed thread count, which the checkpoint records).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dgemma.data.char_tokenizer import ALPHABETS, CharTokenizer
from dgemma.data.sft import DataOrder, trim_prompt_padding
from dgemma.data.tokenizers import load_tokenizer
from dgemma.device import default_device, describe, release_free_heap, resident_gib, resolve_dtype
from dgemma.diffusion.corruption import build_noise
from dgemma.diffusion.objective import DiffusionObjective, LossTerms
from dgemma.diffusion.schedules import get_schedule
from dgemma.errors import DGemmaError
from dgemma.models.pretrained import load_pretrained, resolve
from dgemma.models.transformer import DiffusionGemma
from dgemma.tasks import get_task
from dgemma.training import checkpoint as ckpt
from dgemma.training.config import Config, config_to_dict, model_overrides, save_config
from dgemma.training.ema import WeightEMA
from dgemma.training.lora import apply_lora, is_adapter_param


# ------------------------------------------------------------------------------- randomness
def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: int, micro: int, rank: int, world: int, grad_accum: int) -> torch.Generator:
    """The generator of one micro-batch. Its index counts micro-batches across ranks, so a
    2-rank run and a 1-rank run with twice the accumulation draw exactly the same numbers."""
    index = micro * world + rank
    return torch.Generator().manual_seed(derive_seed(seed, step, index, grad_accum * world))


# -------------------------------------------------------------------------------- schedule
def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0 to 1 over ``warmup`` steps, then cosine down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise DGemmaError(f"unknown optimiser {cfg.name!r}")


# ------------------------------------------------------------------------------ the module
class TrainModule(nn.Module):
    """The model and its objective as one module, so DDP / FSDP2 see every use of a parameter
    (the chunked loss reads the tied embedding outside the network's own forward)."""

    def __init__(self, model: nn.Module, objective: DiffusionObjective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict, plan) -> dict:
        return vars(self.objective.run(self.model, batch, plan))

    def runs_first_pass(self, plan) -> bool:
        """Whether the objective runs its detached self-conditioning pass on this micro-batch."""
        rows = plan.selfcond_rows
        return self.model.self_conditioning is not None and rows is not None and bool(rows.any())


def train_step(module: nn.Module, batches: list[dict], optimizer, *, step: int, seed: int, rank: int, world: int,
               clip_norm: float | None, ar_weight: float, objective: DiffusionObjective,
               autocast=nullcontext, diffusion_weight: float = 1.0) -> dict:
    """One optimiser step over micro-batches. Returns the step's (global) loss terms.

    Losses are sums divided by the step's global token counts, times ``world`` because DDP
    averages gradients over ranks: the gradient is exactly that of one big batch.
    """
    plans = [objective.plan(b, step_generator(seed, step, m, rank, world, len(batches))) for m, b in enumerate(batches)]
    inner = getattr(module, "module", module)  # DDP wraps; FSDP2 and plain modules do not
    stats = torch.tensor([[pl.diffusion_count, pl.ar_count, inner.runs_first_pass(pl)] for pl in plans],
                         dtype=torch.float64)  # [micro, (diffusion tokens, AR tokens, first pass)]
    if world > 1:
        dist.all_reduce(stats)
    d_norm, a_norm = stats[:, :2].sum(0).tolist()
    if world > 1 and _is_fsdp(module):
        # FSDP2 needs every rank to run the same passes over the same parameters: each layer
        # forward is an all-gather, and a parameter group reduce-scatters only the parameters
        # that got a gradient. So when any rank self-conditions, every rank runs the first pass
        # (rows that do not use it get the zero signal: same values, zero gradients).
        for pl, anywhere in zip(plans, stats[:, 2].tolist()):
            pl.first_pass = anywhere > 0
    logged = torch.zeros(3, dtype=torch.float64)  # diffusion, AR, certainty sums
    optimizer.zero_grad(set_to_none=True)
    for micro, batch in enumerate(batches):
        torch.manual_seed(derive_seed(seed, step, micro * world + rank, 7))  # dropout (LoRA): global RNG
        with _grad_sync(module, micro == len(batches) - 1), autocast():
            terms = LossTerms(**module(batch, plans[micro]))
            loss = terms.objective(d_norm, a_norm, ar_weight, diffusion_weight, objective.certainty_weight) * world
        loss.backward()
        cert = 0.0 if terms.certainty_sum is None else terms.certainty_sum.item()
        logged += torch.tensor([terms.diffusion_sum.item(), terms.ar_sum.item(), cert], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(logged)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:  # unused this step (no row self-conditioned): zero, so AdamW treats it alike on any world size
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if clip_norm:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    d_loss, a_loss = logged[0].item() / max(d_norm, 1), logged[1].item() / max(a_norm, 1)
    out = {"diffusion_loss": d_loss, "ar_loss": a_loss, "loss": diffusion_weight * d_loss + ar_weight * a_loss,
           "grad_norm": float(grad_norm), "tokens": d_norm + a_norm}
    if objective.certainty_weight:  # mean over the noised tokens (wrongly predicted ones count 0)
        out["certainty"] = logged[2].item() / max(d_norm, 1)
        out["loss"] += objective.certainty_weight * out["certainty"]
    out["finite"] = math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])
    if out["finite"]:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _grad_sync(module: nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-step (DDP ``no_sync``; FSDP2
    ``set_requires_gradient_sync``)."""
    if hasattr(module, "no_sync"):
        return nullcontext() if sync else module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)
    return nullcontext()


# ------------------------------------------------------------------------------- building
def build_tokenizer(cfg: Config):
    """The tokenizer of a from-scratch model: a character alphabet by name, or a tokenizer file."""
    spec = cfg.data.tokenizer
    if spec is None:
        raise DGemmaError("a model trained from scratch needs data.tokenizer (e.g. 'digits' or a tokenizer.json)")
    if spec in ALPHABETS:
        return CharTokenizer.named(spec)

    return load_tokenizer(resolve(spec))


def build_model(cfg: Config):
    """``(model, tokenizer)`` from ``cfg.init.base`` (pretrained) or ``cfg.model`` (random init)."""
    if cfg.init.base:
        model, tokenizer = load_pretrained(cfg.init.base, dtype=torch.float32, **model_overrides(cfg))
        if tokenizer is None or cfg.data.tokenizer is not None:  # a base without tokenizer.json, or a chosen one
            tokenizer = build_tokenizer(cfg)
    else:
        torch.manual_seed(cfg.init.seed)
        model, tokenizer = DiffusionGemma(cfg.model), build_tokenizer(cfg)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise DGemmaError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has "
                          f"{model.config.vocab_size}")
    model.set_activation_checkpointing(cfg.train.activation_checkpointing)
    if cfg.lora.enabled:
        apply_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                   target_modules=cfg.lora.target_modules, train_experts=cfg.lora.train_experts)
    return model, tokenizer


def build_noise_for(cfg: Config, model, tokenizer):
    d = cfg.diffusion
    mask = d.mask_token_id if d.mask_token_id is not None else getattr(tokenizer, "mask_id", None)
    if d.process == "absorbing" and mask is None:
        raise DGemmaError("absorbing noise needs diffusion.mask_token_id (this tokenizer has no mask token)")
    args = {"uniform": {"vocab_size": model.config.vocab_size}, "absorbing": {"mask_token_id": mask}}
    return build_noise(d.process, get_schedule(d.schedule), **args[d.process])


def build_objective(cfg: Config, model, tokenizer) -> DiffusionObjective:
    d = cfg.diffusion
    return DiffusionObjective(noise=build_noise_for(cfg, model, tokenizer), canvas_size=d.canvas_size, t_eps=d.t_eps, selfcond_prob=d.selfcond_prob,
                              ar_loss_weight=d.ar_loss_weight, ar_loss_on=d.ar_loss_on, decode=d.decode, chunk_tokens=d.loss_chunk_tokens,
                              loss_on=d.loss_on, diffusion_loss_weight=d.diffusion_loss_weight,
                              block_noise_prob=d.block_noise_prob, block_noise_size=d.block_noise_size,
                              certainty_weight=d.certainty_weight, certainty_temperature=d.certainty_temperature)


def build_train_data(cfg: Config, tokenizer):
    """The task's training set (``dgemma/tasks/base.py:Task.train_data``). ``Task.key_args`` runs
    here for every task, so that a key-token weight asked of a task without key tokens is refused
    even where the task builds its own data (a Sudoku stream, a corpus) and never reads it."""
    task = get_task(cfg.data.task)
    task.key_args(cfg, tokenizer)
    if cfg.data.sudoku_unique and (cfg.data.task != "sudoku" or cfg.data.path):
        raise DGemmaError(f"data.sudoku_unique={cfg.data.sudoku_unique} is for the sudoku task's generated stream "
                          f"(no data.path); this run has task {cfg.data.task!r}, data.path={cfg.data.path!r}")
    return task.train_data(cfg, tokenizer)


# ------------------------------------------------------------------------------- memory
def estimate_memory(model: nn.Module, cfg: Config) -> dict[str, int]:
    """Peak bytes by term, before the first step (coarse, deliberately on the high side)."""
    mc = model.config
    params = {id(p): p for p in model.parameters()}.values()
    n_all = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    act_bytes = 2 if _use_bf16(cfg) else 4
    b = cfg.data.batch_size
    seq = cfg.data.prompt_len + cfg.diffusion.num_canvases * cfg.diffusion.canvas_size
    dec = cfg.diffusion.canvas_size * (1 if cfg.diffusion.decode == "one" else cfg.diffusion.num_canvases)
    tokens = b * (seq + dec)
    per_token_layer = 10 * mc.hidden_size + 3 * mc.intermediate_size + 4 * mc.num_attention_heads * mc.head_dim
    layers_live = mc.num_hidden_layers
    if cfg.train.activation_checkpointing:  # layer inputs kept, one layer's internals live at a time
        per_token_layer, layers_live = mc.hidden_size, 1
    scores = 0
    if mc.attn_implementation == "eager":
        scores = b * mc.num_attention_heads * (seq + dec) * seq * 4 * layers_live
    opt = {"adamw": 2 * n_train * 4, "adafactor": n_train * 4 // 64}[cfg.optim.name]
    return {
        "weights": n_all * 4,
        "gradients": n_train * 4,
        "optimizer": opt,
        "activations": tokens * per_token_layer * mc.num_hidden_layers * act_bytes,
        "attention scores": scores,
        # fp32 [chunk, V] tensors live at once in the chunked loss's backward; the certainty term adds one
        "loss chunks": (4 if cfg.diffusion.certainty_weight else 3) * cfg.diffusion.loss_chunk_tokens
                       * mc.vocab_size * 4,
    }


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_memory(model, cfg: Config, device: torch.device, log) -> dict:
    try:
        terms = estimate_memory(model, cfg)
        avail = available_memory(device)
    except Exception as e:  # noqa: BLE001 - an estimate must never block a run silently
        log(f"memory estimate failed ({type(e).__name__}: {e}); continuing without a pre-check")
        return {}
    total = sum(terms.values())
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
    desc = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in top)
    if total > 0.95 * avail:
        raise DGemmaError(f"this run needs about {total / 2**30:.2f} GiB but {avail / 2**30:.2f} GiB is free on "
                          f"{device}; largest terms: {desc}. Lower data.batch_size, enable "
                          f"train.activation_checkpointing, or use LoRA")
    log(f"memory estimate {total / 2**30:.2f} GiB of {avail / 2**30:.2f} GiB free ({desc})")
    return {"estimate_bytes": total, "available_bytes": avail}


def _use_bf16(cfg: Config) -> bool:
    """bf16 autocast: asked for, or ``auto`` on a device with native bf16 matrix units
    (``dgemma/device.py:bf16_native``); fp32 everywhere else."""
    return resolve_dtype(cfg.train.dtype, default_device()) == torch.bfloat16


# ------------------------------------------------------------------------------- logging
class MetricsLog:
    """``metrics.jsonl`` plus TensorBoard event files in the workdir (rank 0 only)."""

    def __init__(self, workdir: Path, enabled: bool, *, resumed_at: int | None = None):
        """``resumed_at``: the step of the checkpoint a run resumed from. What a killed run logged
        after it is dropped (``metrics.jsonl`` rewritten; TensorBoard's ``purge_step`` hides the
        old events from step ``resumed_at + 1`` on), so the redone steps appear once, as in an
        uninterrupted run."""
        self.enabled = enabled
        self.tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            path = workdir / "metrics.jsonl"
            if resumed_at is not None and path.is_file():
                rewind_metrics(path, resumed_at)
            self.tb = SummaryWriter(str(workdir / "tb"), purge_step=None if resumed_at is None else resumed_at + 1)
            self.jsonl = path.open("a")

    def scalars(self, step: int, values: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **values}) + "\n")
        self.jsonl.flush()

    def logged(self, step: int, split: str) -> bool:
        """Whether ``metrics.jsonl`` holds a ``split`` row of ``step`` (False when disabled)."""
        if not self.enabled:
            return False
        self.jsonl.flush()
        rows = map(_metrics_row, Path(self.jsonl.name).read_text().splitlines())
        return any(row is not None and row["step"] == step and row.get("split") == split for row in rows)

    def event(self, step: int, text: str) -> None:
        if self.enabled:
            self.jsonl.write(json.dumps({"step": step, "event": text}) + "\n")
            self.jsonl.flush()
            self.tb.add_text("events", text, step)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


def _metrics_row(line: str) -> dict | None:
    """One ``metrics.jsonl`` line as a dict with an integer ``step``; None for a torn or foreign line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def rewind_metrics(path: Path, step: int) -> int:
    """Keep the lines of ``metrics.jsonl`` logged at or before ``step``; returns how many were dropped.

    A line that does not parse (a kill mid-write) goes too. Rewritten through a temporary file
    and a rename, so a kill here leaves the old file or the new one. Example, ``step=2``: lines
    of steps ``1 2 3 4 3`` and a torn ``{"st`` -> ``1 2``.
    """
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (row := _metrics_row(line)) is not None and row["step"] <= step]
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def map_layers(weights: dict, layer_map: list[int], *, unit_offset: bool = True) -> dict:
    """A state dict whose decoder layer ``i`` is ``weights``' layer ``layer_map[i]``; a source layer
    used a second time gets its two post-norm scales at zero (``-1`` stored for Gemma 3's ``1 + w``),
    so its residual branches add exactly nothing until training switches them on.

    Example: ``layer_map=[0, 1, 0]`` copies ``model.layers.0.*`` to layers 0 and 2 and
    ``model.layers.1.*`` to layer 1; layer 2's ``post_attention_layernorm.weight`` and
    ``post_feedforward_layernorm.weight`` become ``-1``. Every other tensor passes through.
    """
    prefix = "model.layers."
    out = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    seen = set()
    for i, j in enumerate(layer_map):
        src = f"{prefix}{j}."
        for k, v in weights.items():
            if k.startswith(src):
                rest = k[len(src):]
                if j in seen and rest in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"):
                    v = torch.full_like(v, -1.0 if unit_offset else 0.0)
                out[f"{prefix}{i}.{rest}"] = v.clone()
        seen.add(j)
    return out


# ------------------------------------------------------------------------------- the run
@dataclass
class Trainer:
    cfg: Config
    hooks: list = field(default_factory=list)  # callables (trainer, step) -> dict of eval metrics

    def __post_init__(self):
        cfg = self.cfg
        if not cfg.workdir:
            raise DGemmaError("no workdir: pass --cfg.workdir=DIR")
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
            else torch.device("cpu")
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.workdir = Path(cfg.workdir)
        if self.rank == 0:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer = build_model(cfg)
        self.model.to(self.device)
        self.objective = build_objective(cfg, self.model, self.tokenizer)
        self.data = build_train_data(cfg, self.tokenizer)
        self.order = DataOrder(len(self.data), seed=cfg.data.seed, rank=self.rank, world=self.world)
        self.memory = check_memory(self.model, cfg, self.device, self.say)
        self.say(f"compute dtype {'bfloat16 autocast' if _use_bf16(cfg) else 'float32'} on {describe(self.device)} "
                 f"(train.dtype={cfg.train.dtype})")
        self.module = self._wrap(TrainModule(self.model, self.objective))
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if not trainable:
            raise DGemmaError("nothing to train: every parameter is frozen")
        self.optimizer = build_optimizer(trainable, cfg.optim)
        self.ema = None
        if cfg.train.ema is not None:
            if self.world > 1 and cfg.train.distributed == "fsdp":
                raise DGemmaError("train.ema keeps a full copy of the trained weights on every rank: use it with "
                                  "DDP or one process, not FSDP")
            self.ema = WeightEMA(self.model, cfg.train.ema)
        o = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=o.warmup_steps, total=cfg.train.steps,
                                                min_ratio=o.min_lr_ratio))
        self.step = 0
        self.nan_streak = 0
        resumed_at = None
        if cfg.train.resume and (latest := ckpt.latest_checkpoint(self.workdir)) is not None:
            self.restore(latest)
            self.say(f"resumed from {latest}")
            resumed_at = self.step
        elif cfg.init.weights:
            self.warm_start(Path(cfg.init.weights))
        self.log = MetricsLog(self.workdir, self.rank == 0, resumed_at=resumed_at)
        if self.rank == 0:  # after the resume check: a refused resume leaves the run's config.json alone
            save_config(cfg, self.workdir)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[dgemma] {msg}", flush=True)

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.world == 1:
            return module
        if self.cfg.train.distributed == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer)
            return fully_shard(module)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # self-conditioning runs only when some row of the micro-batch draws it; an AR-only run
        # (diffusion_loss_weight=0) never runs the diffusion modules a config may still have
        unused = self.model.self_conditioning is not None or not self.cfg.diffusion.diffusion_loss_weight
        return DDP(module, device_ids=ids, find_unused_parameters=unused)

    def autocast(self):
        if _use_bf16(self.cfg):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    # -- state ----------------------------------------------------------------------------------
    def model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        if self.cfg.lora.enabled:  # the frozen base is reloaded from init.base on resume
            state = {k: v for k, v in state.items() if is_adapter_param(k, train_experts=self.cfg.lora.train_experts)}
        return state

    def save(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model_state = self.model_state()
        optim_state = get_optimizer_state_dict(self.module, self.optimizer,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return
        extra = {"scheduler": self.scheduler.state_dict(), "order": self.order.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                 "nan_streak": self.nan_streak}
        if self.ema is not None:
            extra["ema"] = self.ema.state_dict()
        meta = {"config": config_to_dict(self.cfg), "threads": torch.get_num_threads(), "world": self.world,
                "lora": self.cfg.lora.enabled}
        # the fingerprint is the model actually built: a pretrained base brings its own architecture
        path = ckpt.save_checkpoint(self.workdir, self.step, model_state=model_state, optim_state=optim_state,
                                    extra_state=extra, metadata=meta, keep_last=self.cfg.train.keep_last,
                                    model_config=self.model.config)
        self.log.event(self.step, f"checkpoint {path.name}")

    def restore(self, path: Path, *, weights_only: bool = False) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        state = ckpt.load_checkpoint(path)
        ckpt.check_compatible(state["meta"], self.model.config, source=path)
        if state["optim"] is None:
            raise DGemmaError(f"{path} holds no optimizer state ({state['meta'].get('optimizer_state', 'none saved')}): "
                              f"it can be evaluated and exported, not resumed or rolled back to")
        opts = StateDictOptions(full_state_dict=True, strict=not self.cfg.lora.enabled)
        set_model_state_dict(self.module, {f"model.{k}": v for k, v in state["model"].items()}, options=opts)
        set_optimizer_state_dict(self.module, self.optimizer, state["optim"],
                                 options=StateDictOptions(full_state_dict=True))
        for group in self.optimizer.param_groups:  # the round trip turns tuples (betas) into lists
            group.update({k: tuple(v) for k, v in group.items() if isinstance(v, list) and k != "params"})
        extra = state["extra"]
        if self.ema is not None:
            if "ema" in extra:
                self.ema.load_state_dict(extra["ema"])
            else:
                self.ema = WeightEMA(self.model, self.cfg.train.ema)
                self.say(f"{path.name} holds no weight average: the average (train.ema={self.cfg.train.ema}) "
                         f"starts from its weights")
        if weights_only:
            return
        self.scheduler.load_state_dict(extra["scheduler"])
        self.order.load_state_dict(extra["order"])
        torch.set_rng_state(extra["rng"]["torch"])
        random.setstate(extra["rng"]["python"])
        self.nan_streak = extra["nan_streak"]
        self.step = state["step"]
        if (saved := state["meta"].get("threads")) not in (None, torch.get_num_threads()):
            self.say(f"warning: checkpoint was written with {saved} threads, this run uses "
                     f"{torch.get_num_threads()}: results will not be bitwise identical")

    def warm_start(self, source: Path) -> None:
        """Load another run's weights into this fresh run (``init.weights``, ``init.layer_map``):
        step 0, new optimiser. A source with a weight average gives the average."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        path = source if (source / ckpt.META_FILE).is_file() else ckpt.latest_checkpoint(source)
        if path is None:
            raise DGemmaError(f"init.weights={source}: neither a checkpoint folder nor a workdir with a complete "
                              f"checkpoint")
        state = ckpt.load_checkpoint(path)
        weights = dict(state["model"])
        if "ema" in state["extra"]:
            weights.update(state["extra"]["ema"]["weights"])
        config, layer_map = self.model.config, self.cfg.init.layer_map
        if layer_map is not None:
            if self.cfg.lora.enabled or getattr(config, "layer_scalar", False):
                raise DGemmaError("init.layer_map deepens a fully trained model without layer scalars; it does "
                                  "not apply to a LoRA run or to a layer_scalar model")
            src_types = list(state["meta"].get("model_fingerprint", {}).get("layer_types", []))
            if len(layer_map) != config.num_hidden_layers or max(layer_map) >= len(src_types):
                raise DGemmaError(f"init.layer_map={layer_map} must name one of the source's {len(src_types)} layers "
                                  f"for each of this model's {config.num_hidden_layers}")
            if [src_types[j] for j in layer_map] != list(config.layer_types):
                raise DGemmaError(f"init.layer_map={layer_map} gives layer types {[src_types[j] for j in layer_map]}; "
                                  f"this model has {list(config.layer_types)}")
            weights = map_layers(weights, layer_map, unit_offset=config.norm_unit_offset)
            config = dataclasses.replace(config, num_hidden_layers=len(src_types), layer_types=src_types)
        ckpt.check_compatible(state["meta"], config, source=path)
        set_model_state_dict(self.module, {f"model.{k}": v for k, v in weights.items()},
                             options=StateDictOptions(full_state_dict=True, strict=not self.cfg.lora.enabled))
        if self.ema is not None:  # the average starts from the loaded weights, not the random ones
            self.ema = WeightEMA(self.model, self.cfg.train.ema)
        self.say(f"warm start from the {'averaged ' if 'ema' in state['extra'] else ''}weights of {path} "
                 f"(step {state['step']}{f', layers {layer_map}' if layer_map else ''}); optimiser and schedule "
                 f"start afresh")

    def rollback(self) -> None:
        latest = ckpt.latest_checkpoint(self.workdir)
        if latest is None:
            raise DGemmaError(f"{self.nan_streak} consecutive non-finite steps at step {self.step} and no "
                              f"checkpoint to roll back to")
        msg = (f"rollback: {self.nan_streak} consecutive non-finite steps at step {self.step}; restored weights "
               f"and optimiser from {latest.name}, continuing with the next batches")
        self.restore(latest, weights_only=True)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # the restored groups hold the checkpoint step's rate, not this step's
        self.nan_streak = 0
        self.say(msg)
        self.log.event(self.step, msg)

    # -- loop -----------------------------------------------------------------------------------
    def eval_due(self, step: int) -> bool:
        """Whether the hooks evaluate after ``step``: every ``train.eval_every`` steps and at the end."""
        every = self.cfg.train.eval_every
        return bool(every and step % every == 0) or step == self.cfg.train.steps

    def evaluate(self) -> None:
        """Run every hook on the current weights (the average, with ``train.ema``: what is saved
        for evaluation) and log what each returns under ``eval/``."""
        with self.ema.applied() if self.ema is not None else nullcontext():
            for hook in self.hooks:
                self.log.scalars(self.step, hook(self, self.step), prefix="eval")

    def run(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=self.rank != 0, unit="step",
                   dynamic_ncols=True, desc="train")
        last = {}
        # resumed (only a restore moves the step before the loop) from a kill during the evaluation
        # at the checkpoint's own step, which left no eval row: redo it first
        if (self.hooks and self.rank == 0 and self.step and self.eval_due(self.step)
                and not self.log.logged(self.step, "eval")):
            self.say(f"step {self.step}: its evaluation was not logged before the run stopped; running it now")
            self.evaluate()
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            batches = [{k: v.to(self.device) for k, v in self.data.batch(self.order.next_batch(cfg.data.batch_size)).items()}
                       for _ in range(cfg.train.grad_accum)]
            if cfg.data.trim_prompt_padding and "prompt_valid" in batches[0]:
                batches = trim_prompt_padding(batches)
            self.module.train()
            out = train_step(self.module, batches, self.optimizer, step=self.step, seed=cfg.train.seed,
                             rank=self.rank, world=self.world, clip_norm=cfg.optim.clip_norm,
                             ar_weight=cfg.diffusion.ar_loss_weight, objective=self.objective,
                             autocast=self.autocast, diffusion_weight=cfg.diffusion.diffusion_loss_weight)
            if self.ema is not None and out["finite"]:  # a skipped update leaves the average alone too
                self.ema.update()
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.step += 1
            dt = time.perf_counter() - t0
            out.update(lr=lr, tokens_per_s=out["tokens"] / dt, seconds=dt)
            if self.device.type == "cuda":
                out["memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            else:  # glibc keeps what a step freed; without this a LoRA run on the 270M grew to an OOM kill
                release_free_heap()
                rss = resident_gib()
                if rss is not None:
                    out["rss_gib"] = rss
            self.nan_streak = 0 if out["finite"] else self.nan_streak + 1
            if not out["finite"]:
                self.log.event(self.step, f"non-finite step (loss {out['loss']}, grad norm {out['grad_norm']}): "
                                          f"update skipped")
            if self.nan_streak >= cfg.train.nan_rollback_after:
                self.rollback()
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                self.log.scalars(self.step, {k: v for k, v in out.items() if k != "finite"})
            bar.set_postfix(loss=f"{out['loss']:.4f}", tok_s=f"{out['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
            if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
                self.save()
            if self.hooks and self.rank == 0 and self.eval_due(self.step):
                self.evaluate()
            last = out
        bar.close()
        self.log.close()
        return last


def train(cfg: Config, hooks: list | None = None) -> dict:
    trainer = Trainer(cfg, hooks=hooks or [])
    try:
        return trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
