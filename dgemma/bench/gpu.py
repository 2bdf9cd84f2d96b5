"""Suite ``gpu``: the train, decode, loss and attention suites at GPU sizes, in under 8 minutes.

bf16 everywhere (autocast for training, bf16 weights for decoding), FlexAttention compiled (the
model's own path on CUDA), and ``torch.compile`` tried on the decoding model where
it can help (batch 1 is kernel-launch bound). Training reports MFU, decoding tokens/s against AR
decoding of the same weights. Each sub-suite gets a share of one overall budget; a sub-suite that
fails is recorded with its error and the others still run.

Without a CUDA device the suite writes a note and skips (``dgemma bench all`` on a CPU machine).
``scripts/gpu_bench.py`` runs this suite alone, as one prepared script for a GPU machine.
"""

from __future__ import annotations

import time
import traceback

import torch

from dgemma.bench import attention, decode, fixtures, loss, train
from dgemma.bench.common import Budget, Context, add_ratio, finish, format_table, measure, new_result, ratio
from dgemma.bench.decode import _diffusion_sampler
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.sampler import ar_generate
from dgemma.diffusion.schedules import get_schedule
from dgemma.models.compiled import CompiledModel

TOTAL_BUDGET_S = 420.0  # leaves ~1 minute of the 8 for start-up, model loading and writing
ORDER = (("train", 0.22), ("decode", 0.38), ("attention", 0.27), ("loss", 0.13))


def _compiled_decode(ctx: Context, result: dict, budget: Budget) -> None:
    """AR and diffusion decoding at batch 1 through ``torch.compile``d model calls, against the
    uncompiled ones measured in the same process (best effort: a failure is a note)."""

    if not budget.allows(90):
        result["skipped"].append("compiled decoding (time budget)")
        return
    model, tok, _ = fixtures.load_270m(ctx, dtype=torch.bfloat16)
    ids, valid = fixtures.passage_prompts(tok, 1, 128, model.config.vocab_size, device=ctx.device)
    sampler = _diffusion_sampler(UniformNoise(model.config.vocab_size, get_schedule("linear")), "ddim", 16, 64,
                                 early_stop=False)
    rows = []
    try:
        compiled = CompiledModel(model)  # a bare torch.compile(model) would not grow the rotary tables
        for name, m in (("eager", model), ("compiled", compiled)):
            gen = lambda: sampler(m, ids, valid, generator=torch.Generator(device=ctx.device).manual_seed(0))  # noqa: E731
            md = measure(gen, warmup=2, repeats=5, max_seconds=20, device=ctx.device)
            ma = measure(lambda: ar_generate(m, ids, valid, max_new_tokens=64), warmup=2, repeats=5, max_seconds=20,
                         device=ctx.device)
            rows.append({"name": f"ddim S=16 b1 {name}", "median_s": md.median_s,
                         "tokens_per_s": md.result.stats()["tokens"] / md.median_s})
            rows.append({"name": f"ar b1 {name}", "median_s": ma.median_s,
                         "tokens_per_s": ma.result.stats()["tokens"] / ma.median_s})
            if not budget.allows(30):
                break
    except Exception as e:  # noqa: BLE001
        result["notes"].append(f"torch.compile of the decoding model failed: {type(e).__name__}: {str(e)[:300]}")
    by = {r["name"]: r for r in rows}
    for kind in ("ddim S=16 b1", "ar b1"):
        a, b = by.get(f"{kind} eager"), by.get(f"{kind} compiled")
        if a and b:
            add_ratio(result, f"decode {kind}: torch.compile vs eager", ratio(b["tokens_per_s"], a["tokens_per_s"]),
                      baseline="eager", what="tokens/s")
    if rows:
        d, a = by.get("ddim S=16 b1 compiled"), by.get("ar b1 compiled")
        if d and a:
            add_ratio(result, "decode compiled ddim S=16 b1 vs compiled AR b1", ratio(d["tokens_per_s"], a["tokens_per_s"]),
                      baseline="ar_generate (compiled)", what="tokens/s")
        result["tables"].append(format_table(rows, [("name", "row"), ("median_s", "s"), ("tokens_per_s", "tok/s")],
                                             title="== gpu: torch.compile on decoding (batch 1, prompt 128, canvas 64)"))
        result["compiled_decode"] = rows


def run(ctx: Context) -> dict:
    started = time.perf_counter()
    result = new_result("gpu", ctx)
    device = ctx.device if torch.device(ctx.device).type == "cuda" else "cuda"
    if not torch.cuda.is_available():
        result["notes"].append("no CUDA device here: the gpu suite is skipped (run scripts/gpu_bench.py on a GPU machine)")
        result["skipped"].append("gpu (no CUDA device)")
        return finish(result, ctx, started)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    total = Budget(ctx.budget_s if ctx.budget_s is not None else TOTAL_BUDGET_S)
    sub_ctx = Context(out=ctx.out, quick=False, profile="gpu", device=device, repeats=ctx.repeats,
                      do_profile=ctx.do_profile, sudoku_workdir=ctx.sudoku_workdir, verbose=ctx.verbose, cache=ctx.cache,
                      allow_convert=ctx.allow_convert)
    result["settings"] = {"budget_s": total.seconds, "order": [n for n, _ in ORDER], "tf32": True,
                          "device_name": torch.cuda.get_device_name()}
    result["suites"] = {}
    modules = {"train": train, "decode": decode, "attention": attention, "loss": loss}
    for i, (name, share) in enumerate(ORDER):
        later = sum(s for _, s in ORDER[i + 1:])
        sub_ctx.budget_s = max(10.0, total.left() * share / (share + later))
        ctx.say(f"gpu: {name} (budget {sub_ctx.budget_s:.0f} s)")
        try:
            sub = modules[name].run(sub_ctx)
        except Exception as e:  # noqa: BLE001 - one failing suite must not cost the others
            result["notes"].append(f"{name} failed: {type(e).__name__}: {e}")
            result["errors"] = result.get("errors", {}) | {name: traceback.format_exc()[-3000:]}
            torch.cuda.empty_cache()
            continue
        result["suites"][name] = sub
        result["ratios"] += [{**r, "name": f"{name}: {r['name']}"} for r in sub["ratios"]]
        result["tables"] += sub["tables"]
        result["notes"] += [f"{name}: {n}" for n in sub["notes"]]
        result["skipped"] += [f"{name}: {s}" for s in sub["skipped"]]
        if name == "decode":
            sub_ctx.budget_s = total.left() * 0.05
            _compiled_decode(sub_ctx, result, Budget(min(total.left() - 60, 120)))
        for k in [k for k in ctx.cache if isinstance(k, tuple) and k[:1] == ("hf",)]:
            del ctx.cache[k]  # the transformers twins are not needed past decode
        torch.cuda.empty_cache()
    return finish(result, ctx, started)
