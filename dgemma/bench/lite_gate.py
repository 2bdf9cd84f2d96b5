"""The Lite GPU gate (``scripts/gpu_lite_gate.py``): training MFU, peak memory and tokens/s of
``configs/lite_343m.py`` at its own shape (micro-batch 8, 16 canvases of 256 = 4,096 tokens), and
the sampler's speed against AR decoding of the same-size AR baseline (``configs/lite_343m_ar.py``),
all with random weights and random tokens: no corpus, no download, nothing installed.

**FLOPs** are counted analytically (:func:`lite_step_flops`), per training step of ``B`` windows
of ``S = N C`` tokens (no prompt, every canvas decoded), with ``d`` the width, ``L`` layers,
``H``/``H_kv`` query/KV heads of ``h``, GeGLU width ``F``, vocabulary ``V``:

- per token and layer, the projections and the MLP: ``f = 2 (d H h + 2 d H_kv h + H h d + 3 d F)``;
- per attended (query, key) pair and layer, ``Q K^T`` and ``P V``: ``a = 4 H h``;
- encoder, over the clean ``S_e = S - C`` tokens (the last canvas is nobody's context when the AR
  loss is off): ``L (S_e f + a C^2 (N - 1) N / 2)`` (block-causal: canvas ``k`` sees ``k + 1``
  canvases);
- decoder, over the ``S`` noisy tokens: ``L (S f + a C^2 N (N + 1) / 2)`` (canvas ``k`` sees its
  ``k`` clean predecessors and itself) plus the time MLP ``2 (t_f d + d^2)`` per window;
- LM head in the chunked loss: ``2 S d V``;
- training = forward + backward = 3 x the above (the backward of a matmul is two matmuls; the
  time MLP's first layer has no input gradient: ``2 x`` instead of ``3 x``; without the AR loss
  the last layer's encoder output feeds nothing, so only its k and v projections have a
  backward: ``2 (S_e 2 (2 d H h + 3 d F) + a C^2 (N - 1) N / 2)`` less);
- self-conditioning, when the micro-batch runs its detached first pass (any row draws it, so with
  probability ``1 - (1 - p)^B`` for ``p = selfcond_prob``): one more decoder forward, the expected
  embedding ``softmax(h W^T) W`` (``4 S d V``) and, in the trained pass, the self-conditioning
  GeGLU (``6 d F_sc`` per token forward, ``3 x`` in training: the signal is detached, but the
  RMSNorm before the GeGLU has a trained scale, so its input gets a gradient too).

These are *model* FLOPs (MFU). *Hardware* FLOPs add what the code recomputes: the chunked loss
recomputes the logits in backward (``2 S d V``) and the expected embedding computes them twice
(``2 S d V``). The attention counts are the pairs the masks allow (what FlexAttention's block
masks compute, up to tile edges); ``dense_attention=True`` counts every (query, key) pair the
eager and SDPA back-ends multiply, which is what a FLOP counter sees on them (the test checks
the formula against ``torch.utils.flop_counter`` that way, exactly).

MFU = model FLOPs per second / the device's dense BF16 peak (``dgemma/bench/common.py:PEAK_BF16_TFLOPS`` by device
name, or ``--peak-tflops``).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from dgemma.bench.common import peak_tflops
from dgemma.device import synchronize
from dgemma.diffusion.corruption import build_noise
from dgemma.diffusion.sampler import ar_generate
from dgemma.diffusion.schedules import get_schedule
from dgemma.eval.lite import analytic_tokens_per_forward
from dgemma.models.transformer import DiffusionGemma
from dgemma.sampling import SamplerConfig, build_sampler
from dgemma.training.config import load_config
from dgemma.training.trainer import TrainModule, build_objective, build_optimizer, step_generator, train_step

def lite_step_flops(cfg, batch: int | None = None, *, first_pass: bool | None = None,
                    dense_attention: bool = False) -> dict:
    """FLOPs of one training micro-step of a Lite config (module docstring): a dict of terms and
    ``model`` / ``hardware`` totals. ``first_pass`` says whether the self-conditioning pass runs
    (None: its probability). Needs ``data.prompt_len == 0`` and ``diffusion.decode == "all"``."""
    m, dc = cfg.model, cfg.diffusion
    if cfg.data.prompt_len or dc.decode != "all":
        raise ValueError("lite_step_flops counts Lite's shape: data.prompt_len=0 and diffusion.decode='all'")
    b = cfg.data.batch_size if batch is None else batch
    c, n = dc.canvas_size, dc.num_canvases
    s = n * c
    d, layers, heads, kv, hd, ffn, vocab = (m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
                                            m.num_key_value_heads, m.head_dim, m.intermediate_size, m.vocab_size)
    f = 2 * (d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * ffn)
    a = 4 * heads * hd
    diffusion, ar = bool(dc.diffusion_loss_weight), bool(dc.ar_loss_weight)
    enc_tokens = s if (ar or not diffusion) else s - c
    if dense_attention:
        enc_pairs, dec_pairs = enc_tokens ** 2, s * (enc_tokens + s)
    elif m.encoder_mode == "block":
        ne = enc_tokens // c
        enc_pairs, dec_pairs = c * c * ne * (ne + 1) // 2, c * c * n * (n + 1) // 2
    else:  # token-causal encoder; each noisy canvas sees the clean tokens before it and itself
        enc_pairs, dec_pairs = enc_tokens * (enc_tokens + 1) // 2, c * c * n * (n + 1) // 2
    time_fwd = 2 * (m.time_freq_dim * d + d * d) if m.time_conditioning else 0
    time_train = 2 * 2 * m.time_freq_dim * d + 3 * 2 * d * d if m.time_conditioning else 0  # fc1: no input grad
    enc = layers * (enc_tokens * f + a * enc_pairs)
    # without the AR loss the last layer's encoder output feeds nothing: only its k and v projections
    # (read by the decoder through the cache) are back-propagated
    unused = 0 if ar else enc_tokens * 2 * (2 * d * heads * hd + 3 * d * ffn) + a * enc_pairs
    dec = layers * (s * f + a * dec_pairs) if diffusion else 0
    head = 2 * vocab * d * ((s if diffusion else 0) + (s - 1 if ar else 0))
    terms = {"encoder": 3 * enc - 2 * unused, "decoder": 3 * dec + (time_train if diffusion else 0),
             "lm_head": 3 * head}
    sc = m.self_conditioning and diffusion and dc.selfcond_prob > 0
    p_any = (1.0 - (1.0 - dc.selfcond_prob) ** b) if sc else 0.0
    if first_pass is not None:
        p_any = float(bool(first_pass) and sc)
    f_sc = m.selfcond_intermediate_size or d
    first = dec + time_fwd + 4 * s * d * vocab + 3 * 6 * s * d * f_sc if sc else 0
    terms["selfcond"] = p_any * first
    per_window = sum(terms.values())
    recompute = head + p_any * 2 * s * d * vocab  # logits again: in the chunked loss's backward, the expected embedding
    return {"batch": b, "tokens": b * s, "terms": {k: b * v for k, v in terms.items()}, "selfcond_probability": p_any,
            "model": b * per_window, "hardware": b * (per_window + recompute), "dense_attention": dense_attention,
            "per_token_6n": 6 * _matmul_params(cfg) * b * s}


def _matmul_params(cfg) -> int:
    m = cfg.model
    per_layer = m.hidden_size * m.head_dim * (2 * m.num_attention_heads + 2 * m.num_key_value_heads) \
        + 3 * m.hidden_size * m.intermediate_size
    return m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size


# ------------------------------------------------------------------------------------- the run
def _random_batch(cfg, batch: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = cfg.diffusion.num_canvases * cfg.diffusion.canvas_size
    ids = torch.randint(4, cfg.model.vocab_size, (batch, s), generator=g)
    return {"prompt_ids": torch.zeros(batch, 0, dtype=torch.long, device=device),
            "prompt_valid": torch.zeros(batch, 0, dtype=torch.bool, device=device), "canvas_ids": ids.to(device),
            "canvas_valid": torch.ones(batch, s, dtype=torch.bool, device=device),
            "canvas_mask": torch.ones(batch, cfg.diffusion.num_canvases, dtype=torch.bool, device=device)}


def measure_training(cfg, device, *, batch: int, warmup: int, steps: int, peak: float | None, say=print) -> dict:
    """Warm-up then timed optimiser steps of Lite's real training step (``train_step`` over
    ``TrainModule``, AdamW, bf16 autocast on CUDA) on random tokens."""
    from contextlib import nullcontext


    torch.manual_seed(0)
    with torch.device(device):
        model = DiffusionGemma(cfg.model)
    objective = build_objective(cfg, model, None)
    module = TrainModule(model, objective).train()
    opt = build_optimizer([p for p in module.parameters() if p.requires_grad], cfg.optim)
    cuda = torch.device(device).type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    data = _random_batch(cfg, batch, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, flops, losses = [], [], []
    for step in range(warmup + steps):
        plan = objective.plan(data, step_generator(0, step, 0, 0, 1, 1))  # the draws train_step makes
        first = module.runs_first_pass(plan)
        synchronize(device)
        t0 = time.perf_counter()
        out = train_step(module, [data], opt, step=step, seed=0, rank=0, world=1, clip_norm=cfg.optim.clip_norm,
                         ar_weight=cfg.diffusion.ar_loss_weight, objective=objective, autocast=autocast,
                         diffusion_weight=cfg.diffusion.diffusion_loss_weight)
        synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(out["loss"])
        if step >= warmup:
            times.append(dt)
            flops.append(lite_step_flops(cfg, batch, first_pass=first)["model"])
        say(f"  train step {step}: {dt:.3f} s, loss {out['loss']:.4f}" + (" (warm-up)" if step < warmup else ""))
    sec = statistics.median(times)
    model_flops = statistics.mean(flops)
    res = {"batch": batch, "tokens_per_step": batch * cfg.diffusion.num_canvases * cfg.diffusion.canvas_size,
           "warmup_steps": warmup, "timed_steps": steps, "step_seconds": times, "median_step_s": sec,
           "tokens_per_s": batch * cfg.diffusion.num_canvases * cfg.diffusion.canvas_size / sec,
           "model_tflop_per_step": model_flops / 1e12, "achieved_tflops": model_flops / sec / 1e12,
           "mfu": model_flops / sec / (peak * 1e12) if peak else None, "losses": losses,
           "finite": all(math.isfinite(x) for x in losses),
           "flops_formula": lite_step_flops(cfg, batch)}
    if cuda:
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del module, opt, model
    if cuda:
        torch.cuda.empty_cache()
    return res


@torch.no_grad()
def measure_sampling(cfg, ar_cfg, device, *, steps: tuple[int, ...], canvases: int, batch: int, repeats: int,
                     say=print) -> dict:
    """The ``commit`` sampler (random Lite weights, SDPA, bf16 on CUDA) at each step count against
    greedy ``ar_generate`` with the KV cache of the random AR baseline, ``canvases x C`` new tokens
    per row from a one-token prompt, no stop tokens; the fastest of ``repeats`` after a warm-up."""

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    models = {}
    for name, c in (("diffusion", cfg), ("ar", ar_cfg)):
        torch.manual_seed(0)
        with torch.device(device):
            models[name] = DiffusionGemma(c.model).to(dtype).eval()
        models[name].set_attention("sdpa")  # decode shapes change every step: no flex recompiles
    ids = torch.full((batch, 1), cfg.model.eos_token_id, dtype=torch.long, device=device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    noise = build_noise(cfg.diffusion.process, get_schedule(cfg.diffusion.schedule), vocab_size=cfg.model.vocab_size)
    c = cfg.diffusion.canvas_size
    n_new = canvases * c

    def fastest(fn):
        fn()  # warm-up
        best = None
        for _ in range(max(repeats, 1)):
            synchronize(device)
            r = fn()
            synchronize(device)
            best = r if best is None or r.seconds < best.seconds else best
        return best

    ar = fastest(lambda: ar_generate(models["ar"], ids, valid, max_new_tokens=n_new)).stats()
    say(f"  AR: {ar['tokens_per_second']:.0f} tok/s")
    rows = []
    for t in steps:
        sampler = build_sampler(SamplerConfig(num_steps=t, step_type="commit", temperature=0.0, signal_temperature=0.7,
                                              early_stopping="none", max_canvases=canvases),
                                noise=noise, canvas_size=c, stop_ids=())
        res = fastest(lambda: sampler(models["diffusion"], ids, valid, generator=torch.Generator(device).manual_seed(0)))
        s = res.stats()
        rows.append({"name": f"commit T={t}", "num_steps": t, **s,
                     "analytic_tokens_per_forward": analytic_tokens_per_forward(c, t, canvases,
                                                                                schedule=noise.schedule),
                     "speedup_vs_ar": s["tokens_per_second"] / ar["tokens_per_second"]})
        say(f"  commit T={t}: {s['tokens_per_second']:.0f} tok/s, {s['tokens_per_forward']:.2f} tok/fwd")
    return {"batch": batch, "canvases": canvases, "new_tokens_per_row": n_new, "dtype": str(dtype),
            "attention": "sdpa", "ar": ar, "rows": rows}


def run_gate(*, smoke: bool, device: str, peak_override: float | None = None, out: str | Path | None = None,
             steps: int | None = None, attention: str = "recipe", say=print) -> dict:
    """Everything of the gate; ``smoke`` runs the same code on ``configs/lite_debug.py`` (and its AR
    twin) at a size that takes seconds on a CPU. ``attention``: ``recipe`` (the config's back-end:
    flex, as the trainer calls it: compiled once per process on CUDA) or ``sdpa``. Writes ``<out>/lite_gate.json``
    when ``out``."""
    started = time.perf_counter()
    name = "lite_debug" if smoke else "lite_343m"
    configs = Path(__file__).resolve().parents[2] / "configs"  # this checkout's, wherever the caller runs
    cfg, ar_cfg = load_config(configs / f"{name}.py"), load_config(configs / f"{name}_ar.py")
    cuda = torch.device(device).type == "cuda"
    device_name = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine() or "cpu")
    peak = peak_tflops(device_name, peak_override) if (cuda or peak_override) else None
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    result = {"gate": "lite", "config": f"configs/{name}.py", "ar_config": f"configs/{name}_ar.py", "smoke": smoke,
              "device": device, "device_name": device_name, "peak_bf16_tflops": peak,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "parameters": None, "notes": []}
    with torch.device("meta"):
        result["parameters"] = DiffusionGemma(cfg.model).num_parameters()
        result["ar_parameters"] = DiffusionGemma(ar_cfg.model).num_parameters()
    say(f"gate: {name} ({result['parameters']:,} parameters) on {device_name}")
    batch = cfg.data.batch_size
    n_steps = steps or (2 if smoke else 8)
    if attention == "sdpa":
        cfg.model.attn_implementation = "sdpa"
    elif attention != "recipe":
        raise ValueError(f"attention must be recipe or sdpa, got {attention!r}")
    result["attention_requested"] = attention
    if not cuda and cfg.model.attn_implementation == "flex":  # flex has no CPU backward
        cfg.model.attn_implementation = "sdpa"
        result["notes"].append("flex attention has no CPU backward: sdpa used")
    try:
        result["train"] = measure_training(cfg, device, batch=batch, warmup=1 if smoke else 3, steps=n_steps,
                                           peak=peak, say=say)
    except Exception as e:  # noqa: BLE001 - a failure is the gate's finding: record it, measure the rest
        if not cuda or cfg.model.attn_implementation != "flex":
            raise
        result["notes"].append(f"training with flex attention failed ({type(e).__name__}: {str(e)[:300]}); "
                               f"measured with sdpa instead")
        cfg.model.attn_implementation = "sdpa"
        torch.cuda.empty_cache()
        result["train"] = measure_training(cfg, device, batch=batch, warmup=2, steps=n_steps, peak=peak, say=say)
    result["train"]["attention"] = cfg.model.attn_implementation
    result["sampling"] = measure_sampling(cfg, ar_cfg, device, steps=(4, 8) if smoke else (16, 32, 64),
                                          canvases=2 if smoke else 4, batch=2 if smoke else 8,
                                          repeats=1 if smoke else 2, say=say)
    if peak is None:
        result["notes"].append(f"no BF16 peak known for {device_name!r}: MFU not reported (pass --peak-tflops)")
    result["seconds"] = time.perf_counter() - started
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "lite_gate.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def gate_table(result: dict) -> str:
    """The printed summary of :func:`run_gate`."""
    t, s = result["train"], result["sampling"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"Lite gate: {result['config']} ({result['parameters']:,} parameters) on {result['device_name']}"
             + (" [SMOKE: CPU-sized, numbers mean nothing]" if result["smoke"] else ""),
             f"  training  micro-batch {t['batch']} x {t['tokens_per_step'] // t['batch']} tokens, {t['attention']}: "
             f"{t['median_step_s']:.3f} s/step, {t['tokens_per_s']:,.0f} tokens/s, "
             f"{t['model_tflop_per_step']:.2f} TFLOP/step (model), {t['achieved_tflops']:.2f} TFLOP/s, "
             f"MFU {f(t['mfu'], '.1%')} of {f(result['peak_bf16_tflops'], '.0f')} TFLOP/s, "
             f"peak memory {f(t.get('peak_memory_gib'), '.1f')} GiB",
             f"  sampling  batch {s['batch']} x {s['new_tokens_per_row']} new tokens ({s['dtype']}, {s['attention']}); "
             f"AR baseline ({result['ar_parameters']:,} parameters): {s['ar']['tokens_per_second']:,.0f} tok/s, "
             f"{s['ar']['tokens_per_forward']:.2f} tok/fwd"]
    for r in s["rows"]:
        lines.append(f"    {r['name']:<12} {r['tokens_per_second']:>10,.0f} tok/s  {r['tokens_per_forward']:6.2f} tok/fwd "
                     f"(analytic {r['analytic_tokens_per_forward']:.2f})  x{r['speedup_vs_ar']:.2f} vs AR")
    lines += [f"  note: {n}" for n in result["notes"]]
    lines.append(f"  {result['seconds']:.0f} s in all")
    return "\n".join(lines)
