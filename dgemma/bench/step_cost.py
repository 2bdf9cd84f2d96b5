"""``dgemma bench decode --only step_cost``: what one denoising forward costs, in AR steps.

One cached forward of ``C`` new tokens after a 64-token prompt, full LM head, batch 1, for
``C`` in 1, 16, 32, 64, 128, 256, for dgemma (a decoder pass of a noisy canvas against the KV
cache, written nowhere) and for transformers' ``Gemma3ForCausalLM`` (``C`` tokens appended to its
``DynamicCache``, a copy of the prefilled one at each call), both holding the Gemma 3 270M's weights in the
same dtype. ``vs_ar_step`` is the forward's median time over the median time of one AR step
(``C = 1``) of the same implementation and dtype: a sampler that commits more tokens per pass
than that ratio decodes faster than AR on this machine. Timings of the two implementations are
interleaved (a, b, a, b, ...), so load drift hits both alike.

For bf16 rows, ``argmax_agree_fp32`` is the fraction of the ``C`` positions whose greedy token
is the same as in fp32 (same weights, same inputs): what bf16 costs in decisions.

``kind="append_cost"`` rows time what appending a finished canvas costs: its own encoder
forward of ``C`` clean tokens followed by the next canvas's first decoder forward (``apart_s``),
against the one forward of ``2 C`` tokens that does both (``fused_s``,
``DiffusionGemma.forward``'s ``append``; the sampler's default, ``CanvasSampler.fuse_append``);
``fused_vs_apart`` is their ratio, ``max_abs_diff`` the largest gap between the two ways' logits
of the noisy canvas (rounding only: the same numbers in exact arithmetic).

``kind="head_cost"`` rows (fp32 only, the dtype whose path differs) time the LM head's product of
``rows`` hidden states: ``linear`` (PyTorch's; MKL on an x86 CPU) against
``dgemma/models/primitives.py:fast_linear`` (the small-row kernel or oneDNN for fp32 inference on a CPU), with
``fast_vs_linear`` their ratio and ``max_abs_diff`` the largest gap between their logits.

With ``--compile`` the same forwards also run through ``dgemma/models/compiled.py:CompiledModel``
(impl ``dgemma-compiled``; ``vs_ar_step`` over its own compiled AR step): ``compile_s`` on its
``C = 1`` and first ``C > 1`` rows is what compiling the AR step and the denoising step cost
(dynamic shapes: the other canvas sizes reuse the graph), ``argmax_agree_eager`` how often it picks
the eager forward's greedy token.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from dgemma.bench import fixtures
from dgemma.bench.common import Context, add_ratio, finish, format_table, measure_interleaved, new_result
from dgemma.models.compiled import CompiledModel
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.primitives import fast_linear

CANVASES = (1, 16, 32, 64, 128, 256)
PROMPT = 64
COLUMNS = [("impl", "impl"), ("dtype", "dtype"), ("canvas", "C"), ("repeats", "n"), ("median_s", "s"),
           ("vs_ar_step", "x AR step"), ("vs_transformers", "x transformers"), ("argmax_agree_fp32", "argmax = fp32"),
           ("compile_s", "compile s"), ("argmax_agree_eager", "argmax = eager")]

APPEND_COLUMNS = [("dtype", "dtype"), ("canvas", "C"), ("repeats", "n"), ("apart_s", "apart s"),
                  ("fused_s", "fused s"), ("fused_vs_apart", "fused / apart"), ("max_abs_diff", "max |diff|")]


HEAD_ROWS = (1, 4, 16, 64)
HEAD_COLUMNS = [("rows", "rows"), ("repeats", "n"), ("linear_s", "linear s"), ("fast_s", "fast_linear s"),
                ("fast_vs_linear", "fast / linear"), ("max_abs_diff", "max |diff|")]


def _head_rows(model, ctx: Context, reps: int, source: str) -> list[dict]:
    """The LM head's product of N rows: PyTorch's ``linear`` against ``fast_linear``, interleaved."""
    w = model.lm_head.weight
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in HEAD_ROWS[:2] if ctx.quick else HEAD_ROWS:
        h = torch.randn(n, w.shape[1], generator=gen).to(w)
        fns = {"linear": lambda: F.linear(h, w), "fast": lambda: fast_linear(h, w)}
        for fn in fns.values():
            fn()
        ms = measure_interleaved(fns, repeats=reps, max_seconds=None if ctx.quick else 10.0, device=ctx.device)
        out.append({"kind": "head_cost", "impl": "dgemma", "dtype": "float32", "rows": n, "repeats": ms["fast"].repeats,
                    "linear_s": ms["linear"].median_s, "fast_s": ms["fast"].median_s,
                    "fast_vs_linear": ms["fast"].median_s / ms["linear"].median_s, "source": source,
                    "max_abs_diff": float((ms["fast"].result - ms["linear"].result).abs().max())})
    return out


def _dgemma_forward(model, prompt_ids: torch.Tensor, c: int):
    """The timed call: one noisy canvas of ``c`` tokens against the prefilled cache (C = 1: the
    AR step, a clean token written at the cursor and rolled back)."""

    p = prompt_ids.shape[1]
    cache = KVCache(1, p + max(CANVASES))
    model(prompt_ids, cache=cache, return_hidden=True)
    gen = torch.Generator().manual_seed(c)  # the same canvas in every dtype
    tokens = torch.randint(3, model.config.vocab_size, (1, c), generator=gen).to(prompt_ids.device)
    pos = (p + torch.arange(c, device=prompt_ids.device))[None]
    ones = torch.ones(1, c, dtype=torch.bool, device=prompt_ids.device)
    if c == 1:
        info = TokenInfo(pos, torch.zeros_like(pos), ~ones, ones)

        def call():
            out = model(tokens, info=info, cache=cache)
            cache.truncate(p)
            return out
    else:
        info = TokenInfo(pos, torch.ones_like(pos), ones, ones)

        def call():
            return model(tokens, info=info, cache=cache, write=False)
    return call, tokens


def _append_calls(model, prompt_ids: torch.Tensor, c: int):
    """``(apart, fused)``: a clean canvas of ``c`` tokens appended by a forward of its own, then
    the next noisy canvas decoded; or both in one forward. Each rolls the cache back to the prompt."""
    p, dev = prompt_ids.shape[1], prompt_ids.device
    cache = KVCache(1, p + 2 * c)
    model(prompt_ids, cache=cache, return_hidden=True)
    gen = torch.Generator().manual_seed(c)
    clean_ids, noisy_ids = torch.randint(3, model.config.vocab_size, (2, 1, c), generator=gen).to(dev)
    pos = (p + torch.arange(2 * c, device=dev))[None]
    ones = torch.ones(1, c, dtype=torch.bool, device=dev)
    clean = TokenInfo(pos[:, :c], torch.ones_like(pos[:, :c]), ~ones, ones)
    noisy = TokenInfo(pos[:, c:], torch.full_like(pos[:, c:], 2), ones, ones)

    def apart():
        model(clean_ids, info=clean, cache=cache, return_hidden=True)
        out = model(noisy_ids, info=noisy, cache=cache, write=False)
        cache.truncate(p)
        return out

    def fused():
        out = model(torch.cat([clean_ids, noisy_ids], 1), info=clean.cat(noisy), cache=cache, append=c)[:, c:]
        cache.truncate(p)
        return out
    return apart, fused


def _hf_forward(hf, prompt_ids: torch.Tensor, tokens: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=prompt_ids, past_key_values=cache, use_cache=True)
    def call():  # a copy of the prefilled cache (64 tokens: ~2 MB for the 270M), since sliding layers cannot crop
        return hf(input_ids=tokens, past_key_values=copy.deepcopy(cache), use_cache=True).logits
    return call


def run(ctx: Context, dtypes: tuple[torch.dtype, ...]) -> dict:
    started = time.perf_counter()
    result = new_result("decode", ctx)
    result["settings"]["only"] = "step_cost"
    rows, appends, heads = [], [], []
    reps = ctx.reps(3 if ctx.quick else 7)
    reference: dict[int, torch.Tensor] = {}  # fp32 argmax per canvas size (dgemma), for the agreement column
    canvases = CANVASES[:3] if ctx.quick else CANVASES
    with torch.no_grad():
        for dtype in sorted(set(dtypes) | {torch.float32}, key=lambda d: d != torch.float32):
            if ctx.quick:
                model = fixtures._seeded_model(fixtures.tiny_config()).to(ctx.device, dtype).eval()
                source, hf = "tiny-random", fixtures.hf_twin(ctx, model, "tiny-random", dtype=dtype,
                                                              key=f"tiny-{dtype}")
            else:
                model, _, source = fixtures.load_270m(ctx, dtype=dtype)
                hf = fixtures.hf_twin(ctx, model, source, dtype=dtype)
            gen = torch.Generator().manual_seed(0)  # the same prompt in every dtype
            prompt = torch.randint(3, model.config.vocab_size, (1, PROMPT if not ctx.quick else 8), generator=gen)
            prompt = prompt.to(ctx.device)
            name = str(dtype).removeprefix("torch.")
            timed = {}
            compiled = CompiledModel(model) if ctx.compile and dtype in dtypes else None
            for c in canvases:
                ours, tokens = _dgemma_forward(model, prompt, c)
                fns = {"dgemma": ours}
                if compiled is not None:
                    fns["dgemma-compiled"] = _dgemma_forward(compiled, prompt, c)[0]
                if hf is not None:
                    fns["transformers"] = _hf_forward(hf, prompt, tokens)
                before = (compiled.compiles, compiled.compile_s) if compiled is not None else None
                for fn in fns.values():
                    fn()  # warm-up (compiles a new kind of call)
                compile_s = compiled.compile_s - before[1] if before and compiled.compiles > before[0] else None
                ms = measure_interleaved(fns, repeats=reps, max_seconds=None if ctx.quick else 20.0, device=ctx.device)
                argmax = ours().argmax(-1).cpu()
                if dtype == torch.float32:
                    reference[c] = argmax
                for impl, m in ms.items():
                    timed[(impl, c)] = m.median_s
                    row = {"kind": "step_cost", "impl": impl, "dtype": name, "canvas": c, "median_s": m.median_s,
                           "repeats": m.repeats, "source": source}
                    if impl == "dgemma" and dtype != torch.float32 and c in reference:
                        row["argmax_agree_fp32"] = float((argmax == reference[c]).float().mean())
                    if impl == "dgemma-compiled":
                        row["argmax_agree_eager"] = float((m.result.argmax(-1).cpu() == argmax).float().mean())
                        if compile_s is not None:  # this row's warm-up compiled a new kind of call
                            row["compile_s"] = compile_s
                    rows.append(row)
            if dtype == torch.float32 and dtype in dtypes:
                heads = _head_rows(model, ctx, reps, source)
            if dtype not in dtypes:  # fp32 was run only as the agreement reference
                rows = [r for r in rows if r["dtype"] != name]
                continue
            for r in rows:
                if r["dtype"] == name:
                    r["vs_ar_step"] = r["median_s"] / timed[(r["impl"], 1)]
                    if r["impl"].startswith("dgemma") and ("transformers", r["canvas"]) in timed:
                        r["vs_transformers"] = r["median_s"] / timed[("transformers", r["canvas"])]
            for c in canvases[1:4]:  # what an append costs, apart or in the next canvas's first forward
                apart, fused = _append_calls(model, prompt, c)
                apart(), fused()
                ms = measure_interleaved({"apart": apart, "fused": fused}, repeats=reps,
                                         max_seconds=None if ctx.quick else 20.0, device=ctx.device)
                if dtype in dtypes:
                    appends.append({"kind": "append_cost", "impl": "dgemma", "dtype": name, "canvas": c,
                                    "repeats": ms["fused"].repeats, "apart_s": ms["apart"].median_s,
                                    "fused_s": ms["fused"].median_s,
                                    "fused_vs_apart": ms["fused"].median_s / ms["apart"].median_s, "source": source,
                                    "max_abs_diff": float((ms["fused"].result.float() - ms["apart"].result.float())
                                                          .abs().max())})
    result["rows"] = rows + appends + heads
    if heads:
        result["tables"].append(format_table(heads, HEAD_COLUMNS, title="== decode --only step_cost: the LM head's "
                                             "product of N rows, PyTorch's linear against fast_linear (fp32)"))
    result["tables"].append(format_table(appends, APPEND_COLUMNS, title="== decode --only step_cost: appending a "
                                         "canvas of C tokens, by its own forward or in the next one's first"))
    result["tables"].append(format_table(rows, COLUMNS, title=f"== decode --only step_cost: one forward of C new "
                                                              f"tokens after a {PROMPT}-token prompt, batch 1"))
    for r in rows:
        if r["impl"].startswith("dgemma") and r.get("vs_transformers") is not None:
            add_ratio(result, f"step_cost {r['dtype']} C={r['canvas']}: {r['impl']} time / transformers time",
                      r["vs_transformers"], baseline="transformers' forward", higher_is_better=False)
    return finish(result, ctx, started)
