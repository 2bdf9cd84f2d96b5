"""Suite ``train``: one LoRA training step of the Gemma 3 270M in dgemma vs transformers + peft.

Same weights, same batch, same sequence, same precision, LoRA r=8 / alpha 16 on every decoder
projection (q, k, v, o, gate, up, down) on both sides, AdamW, gradient clipping at 1.0. Two steps:

- ``causal_lm``: next-token loss over ``[prompt | response]``. dgemma: ``model(ids,
  return_hidden=True)`` + the chunked ``ar_loss``; transformers: ``model(input_ids, labels=ids)``
  (full logits, its own loss).
- ``diffusion``: the adapter's training step. dgemma: ``dgemma.training.trainer.train_step``
  with ``DiffusionObjective`` (encoder over ``[prompt | canvas]`` writing the KV cache + AR loss,
  decoder over the corrupted canvas against it + x0 loss; self-conditioning off on both sides, as
  transformers has no such module). transformers + peft: the same computation as one forward over
  ``[prompt | canvas | corrupted canvas]`` with the block mask passed as a 4-D boolean mask per
  layer type and explicit positions, both losses from the full logits. The corruption is the
  objective's own ``plan`` for the same seed, so both sides see identical tokens.

The step-0 losses of the two sides must agree (LoRA B starts at zero, so step 0 is the base model):
``loss_rel_diff`` checks that the comparison is of the same computation. The timed calls are
interleaved (dgemma, transformers, dgemma, ...). Ratios: ``speed`` = transformers seconds /
dgemma seconds, ``memory_saving`` = transformers peak / dgemma peak (both >1: dgemma better). On
a GPU, ``mfu`` = counted FLOPs per step (``FlopCounterMode``: every executed matmul, so the
chunked loss's recomputation counts too) / seconds / the GPU's peak dense bf16 FLOP/s.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from dgemma.bench import fixtures
from dgemma.bench.common import (Budget, Context, add_ratio, finish, format_table, measure_interleaved, mib,
                                 new_result, peak_memory, peak_tflops, profile_call, ratio, share_of)
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.losses import ar_loss
from dgemma.diffusion.objective import DiffusionObjective, batch_info
from dgemma.diffusion.schedules import get_schedule
from dgemma.errors import DGemmaError
from dgemma.models.masks import dense_mask
from dgemma.models.pretrained import load_pretrained, prepare_gemma3_270m
from dgemma.models.weights import save_hf
from dgemma.training.lora import DECODER_LINEARS, apply_lora, merge_lora
from dgemma.training.trainer import TrainModule, step_generator, train_step

SIZES = {
    "quick": dict(batch=2, prompt=16, canvas=16, repeats=2, row_cap_s=4.0, bf16=False),
    "cpu": dict(batch=1, prompt=64, canvas=64, repeats=3, row_cap_s=30.0, bf16=False),
    "gpu": dict(batch=8, prompt=256, canvas=256, repeats=5, row_cap_s=20.0, bf16=True),
}
BUDGET_S = {"quick": None, "cpu": 240.0, "gpu": 150.0}
LORA = dict(r=8, alpha=16.0, dropout=0.0)
LR = 1e-4
COLUMNS = [("name", "row"), ("impl", "impl"), ("tokens", "tok/step"), ("repeats", "n"), ("median_s", "s/step"),
           ("peak_mib", "peak MiB"), ("loss_step0", "loss@0"), ("tflop_per_step", "TFLOP/step"), ("mfu", "MFU"),
           ("speed", "x speed"), ("memory_saving", "x memory"), ("loss_rel_diff", "loss rel diff")]

def peak_flops(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    tflops = peak_tflops(torch.cuda.get_device_name())
    return None if tflops is None else tflops * 1e12


# ------------------------------------------------------------------------------------ models
def _dgemma_model(ctx: Context, tiny_model=None):
    """A fresh dgemma 270M (LoRA is injected in place, so never the decode suite's shared copy)."""
    if tiny_model is not None:
        import copy

        model, tok, source = copy.deepcopy(tiny_model), None, "tiny-random"
    else:
        try:
            if (why := fixtures.weights_available(ctx)) is not None:
                raise DGemmaError(why)
            model, tok = load_pretrained("gemma3-270m", dtype=torch.float32)
            source = "gemma3-270m"
        except DGemmaError as e:
            ctx.say(f"270M weights unavailable ({e}); random init of the same architecture")
            model, tok, source = fixtures._seeded_model(fixtures.gemma_270m_config()), None, "random-init"
    torch.manual_seed(0)
    apply_lora(model, target_modules="all-linear", **LORA)
    return model.to(ctx.device).train(), tok, source


def _hf_model(ctx: Context, dgemma_model, source: str):
    """A fresh ``Gemma3ForCausalLM`` (sdpa) with the same base weights, wrapped by ``get_peft_model``."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM

    if source == "gemma3-270m":
        hf = Gemma3ForCausalLM.from_pretrained(prepare_gemma3_270m(), dtype=torch.float32, attn_implementation="sdpa")
    else:  # the same random base: export a LoRA-free copy of ours
        import copy

        base = merge_lora(copy.deepcopy(dgemma_model).cpu())  # B = 0: merging leaves the base weights
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(base, None, Path(tmp))
            hf = Gemma3ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
        del base
    torch.manual_seed(0)
    cfg = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                     target_modules=list(DECODER_LINEARS), bias="none")
    return get_peft_model(hf, cfg).to(ctx.device).train()


# ------------------------------------------------------------------------------------ data
def _batch(tok, vocab: int, sz: dict, device) -> dict:
    """``[prompt | one canvas]`` rows from the passage (no padding), in the trainer's batch layout."""
    b, p, c = sz["batch"], sz["prompt"], sz["canvas"]
    ids, _ = fixtures.passage_prompts(tok, b, p + c, vocab, seed=1)
    return {"prompt_ids": ids[:, :p].to(device), "prompt_valid": torch.ones(b, p, dtype=torch.bool, device=device),
            "canvas_ids": ids[:, p:].to(device), "canvas_valid": torch.ones(b, c, dtype=torch.bool, device=device),
            "canvas_mask": torch.ones(b, 1, dtype=torch.bool, device=device)}


def _hf_diffusion_inputs(objective, batch: dict, canvas: int, window: int | None):
    """The objective's own draws for seed 0, step 0 (as ``train_step`` makes them) laid out as one
    sequence ``[prompt | canvas | corrupted canvas]`` with per-layer-type 4-D boolean masks."""

    cpu = {k: v.cpu() for k, v in batch.items()}
    plan = objective.plan(cpu, step_generator(0, 0, 0, 0, 1, 1))
    clean = batch_info(cpu, canvas)
    info = clean.cat(plan.noisy)
    ids = torch.cat([cpu["prompt_ids"], cpu["canvas_ids"], plan.xt], 1)
    masks = {"full_attention": dense_mask(info, info, encoder="causal", window=None)[:, None],
             "sliding_attention": dense_mask(info, info, encoder="causal", window=window)[:, None]}
    return ids, info.positions, masks, plan


# ------------------------------------------------------------------------------------ steps
def _dgemma_causal(model, ids, valid, opt, autocast):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            h = model(ids, return_hidden=True)
            loss, _, _ = ar_loss(h, model.lm_head.weight, ids, valid)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())
    return step


def _hf_causal(hf, ids, valid, opt, autocast):
    params = [p for p in hf.parameters() if p.requires_grad]

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = hf(input_ids=ids, attention_mask=valid.long(), labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())
    return step


def _dgemma_diffusion(model, objective, batch, opt, autocast):
    module = TrainModule(model, objective)

    def step():
        out = train_step(module, [batch], opt, step=0, seed=0, rank=0, world=1, clip_norm=1.0,
                         ar_weight=objective.ar_loss_weight, objective=objective, autocast=autocast)
        return out["loss"]
    return step


def _hf_diffusion(hf, ids, pos, masks, plan, p: int, c: int, opt, autocast, device):
    ids, pos = ids.to(device), pos.to(device)
    masks = {k: v.to(device) for k, v in masks.items()}
    x0, target = plan.x0.to(device), plan.target.to(device)
    params = [p_ for p_ in hf.parameters() if p_.requires_grad]
    clean = ids[:, : p + c]

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            logits = hf(input_ids=ids, attention_mask=masks, position_ids=pos).logits.float()
            ar = F.cross_entropy(logits[:, : p + c - 1].flatten(0, 1), clean[:, 1:].flatten(), reduction="mean")
            dl = F.cross_entropy(logits[:, p + c:].flatten(0, 1), x0.flatten(), reduction="none")
            dl = (dl * target.flatten()).sum() / target.sum().clamp_min(1)
            loss = dl + ar
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())
    return step


def _warm(fn, device) -> dict:
    """The first (untimed) call: its loss, peak memory and counted FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    box = {}
    counter = FlopCounterMode(display=False)

    def call():
        with counter:
            box["loss"] = fn()

    box["peak_bytes"], box["largest_bytes"] = peak_memory(call, device)
    box["flops"] = counter.get_total_flops()
    return box


# ------------------------------------------------------------------------------------ suite
def run(ctx: Context) -> dict:
    started = time.perf_counter()
    sz = SIZES[ctx.profile]
    budget = Budget(ctx.budget_s if ctx.budget_s is not None else BUDGET_S[ctx.profile])
    result = new_result("train", ctx)
    dev = ctx.device
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        result["notes"].append(f"train suite skipped: {e}")
        return finish(result, ctx, started)
    tiny = fixtures._seeded_model(fixtures.tiny_config()) if ctx.quick else None
    ctx.say("train: building dgemma + LoRA and transformers + peft")
    model, tok, source = _dgemma_model(ctx, tiny)
    hf = _hf_model(ctx, model, source)
    autocast = (lambda: torch.autocast(torch.device(dev).type, dtype=torch.bfloat16)) if sz["bf16"] else nullcontext
    b, p, c = sz["batch"], sz["prompt"], sz["canvas"]
    cfg = model.config
    batch = _batch(tok, cfg.vocab_size, sz, dev)
    ids = torch.cat([batch["prompt_ids"], batch["canvas_ids"]], 1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    objective = DiffusionObjective(noise=UniformNoise(cfg.vocab_size, get_schedule("linear")), canvas_size=c,
                                   t_eps=1e-4, selfcond_prob=0.0, ar_loss_weight=1.0, decode="one", chunk_tokens=1024)
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    n_train_hf = sum(x.numel() for x in hf.parameters() if x.requires_grad)
    result["settings"] = {
        "model": "tiny" if ctx.quick else "gemma3-270m", "weights": source, "batch": b, "prompt": p, "canvas": c,
        "precision": "bf16 autocast, fp32 weights" if sz["bf16"] else "fp32",
        "lora": {**LORA, "targets": "q,k,v,o,gate,up,down"},
        "trainable_params": {"dgemma": n_train, "transformers+peft": n_train_hf},
        "optimizer": f"AdamW lr {LR}, clip 1.0",
        "attention": {"dgemma": cfg.attn_implementation, "transformers": "sdpa"},
        "diffusion": "uniform noise, linear schedule, one canvas, AR loss weight 1, self-conditioning off",
        "budget_s": budget.seconds,
    }
    if n_train != n_train_hf:
        result["notes"].append(f"trainable parameters differ: dgemma {n_train}, transformers+peft {n_train_hf}")
    opt_d = torch.optim.AdamW([x for x in model.parameters() if x.requires_grad], lr=LR)
    opt_h = torch.optim.AdamW([x for x in hf.parameters() if x.requires_grad], lr=LR)
    hf_ids, hf_pos, hf_masks, plan = _hf_diffusion_inputs(objective, batch, c, cfg.sliding_window)
    steps = {
        "causal_lm": (_dgemma_causal(model, ids, valid, opt_d, autocast), _hf_causal(hf, ids, valid, opt_h, autocast),
                      b * (p + c)),
        "diffusion": (_dgemma_diffusion(model, objective, batch, opt_d, autocast),
                      _hf_diffusion(hf, hf_ids, hf_pos, hf_masks, plan, p, c, opt_h, autocast, dev), b * (p + 2 * c)),
    }
    peak = peak_flops(dev)
    rows = []
    reps, cap = ctx.reps(sz["repeats"]), sz["row_cap_s"]
    for kind, (fd, fh, tokens) in steps.items():
        if rows and not budget.allows(sum(r["median_s"] for r in rows[-2:]) * (reps + 1)):
            result["skipped"].append(f"{kind} (time budget)")
            continue
        pair = {}
        ctx.say(f"train: {kind} (warm-up with memory and FLOP counting)")
        errors = {}
        warm = {}
        for impl, fn in (("dgemma", fd), ("transformers+peft", fh)):
            try:
                warm[impl] = _warm(fn, dev)
            except Exception as e:  # noqa: BLE001 - recorded as a finding; the other side still runs
                errors[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                result["notes"].append(f"train {kind} {impl} failed: {errors[impl]}")
        fns = {impl: fn for impl, fn in (("dgemma", fd), ("transformers+peft", fh)) if impl in warm}
        if not fns:
            continue
        ctx.say(f"train: {kind} (timed, interleaved)")
        ms = measure_interleaved(fns, repeats=reps, max_seconds=cap, device=dev)
        for impl, m in ms.items():
            w = warm[impl]
            rec = m.record()
            rec["warmup"] = 1
            row = {"name": f"{kind} {impl}", "kind": kind, "impl": impl, "tokens": tokens, **rec,
                   "peak_bytes": w["peak_bytes"], "peak_mib": mib(w["peak_bytes"]),
                   "largest_tensor_bytes": w["largest_bytes"], "loss_step0": w["loss"],
                   "flops_per_step": w["flops"], "tflop_per_step": w["flops"] / 1e12,
                   "achieved_tflops": w["flops"] / m.median_s / 1e12}
            if peak:
                row["mfu"] = w["flops"] / m.median_s / peak
            rows.append(row)
            pair[impl] = row
        if len(pair) == 2:
            d, h = pair["dgemma"], pair["transformers+peft"]
            d["speed"] = ratio(h["median_s"], d["median_s"])
            d["memory_saving"] = ratio(h["peak_bytes"], d["peak_bytes"])
            d["loss_rel_diff"] = abs(d["loss_step0"] - h["loss_step0"]) / max(abs(h["loss_step0"]), 1e-12)
            add_ratio(result, f"train {kind}: dgemma vs transformers+peft, seconds/step", d["speed"],
                      baseline="transformers+peft", what="transformers seconds / dgemma seconds")
            add_ratio(result, f"train {kind}: dgemma vs transformers+peft, peak memory", d["memory_saving"],
                      baseline="transformers+peft", what="transformers peak bytes / dgemma peak bytes")
            worse = d["speed"] is not None and d["speed"] < 1
            if worse and ctx.do_profile and budget.allows(3 * (d["median_s"] + h["median_s"])):
                vocab_op = lambda r: str(cfg.vocab_size) in r["input_shapes"]  # noqa: E731
                for impl, fn in (("dgemma", fd), ("transformers+peft", fh)):
                    prof = profile_call(fn, device=dev)
                    prof["vocab_ops_share"] = share_of(prof, vocab_op)
                    prof["row"] = f"{kind} {impl}"
                    result["profiles"][f"{kind} {impl}"] = prof
                    top = ", ".join(f"{o['name']} {o['share']:.0%}" for o in prof["top_ops"][:6])
                    result["notes"].append(f"profile train {kind} {impl}: top ops {top}; ops over the vocabulary "
                                           f"{prof['vocab_ops_share']:.0%}")
    if peak is None and torch.device(dev).type == "cuda":
        result["notes"].append(f"unknown peak FLOP/s for {torch.cuda.get_device_name()}: MFU not reported")
    result["rows"] = rows
    result["tables"].append(format_table(rows, COLUMNS, title=f"== train: one LoRA step, dgemma vs transformers + peft "
                                                              f"(batch {b}, prompt {p}, canvas {c}, "
                                                              f"{result['settings']['precision']})"))
    del model, hf, opt_d, opt_h
    return finish(result, ctx, started)
