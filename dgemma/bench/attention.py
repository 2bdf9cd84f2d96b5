"""Suite ``attention``: the eager, sdpa and flex back-ends on the same model and inputs.

The model has the Gemma 3 270M's layer shapes (width 640, 4 query heads, 1 KV head of 256,
sliding window 512, every 6th layer global) with fewer layers and a small vocabulary: only the
transformer trunk is timed (``return_hidden=True``), and the LM head does not depend on the
attention back-end. Weights are random: speed does not depend on their values.

- ``train``: the adapter's training forward, the encoder over ``[prompt | canvas]`` of length
  ``L`` (writing the KV cache), then the decoder over the noisy canvas against it. On CPU the
  forward only, without autograd for every back-end (FlexAttention refuses inputs that require
  grad on CPU); on a GPU forward + backward.
- ``decode``: one denoising step, a noisy canvas against a KV cache of ``L`` prompt tokens.

``flex`` is the library's back-end as shipped (``dgemma/models/attention.py:flex_attention``): the
block mask built every forward, ``flex_attention`` compiled once per process on CUDA (the fused
kernel) and eager on CPU. The suite times the model as it runs; it patches nothing.

Each back-end is warmed up once, then the back-ends are timed interleaved at each length. Ratios:
``vs_eager`` = eager seconds / back-end seconds at the same length (>1: faster than the
reference); ``max_abs_diff`` is the largest difference of the final hidden states from eager.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from dgemma.bench.common import (Budget, Context, add_ratio, finish, format_table, measure_interleaved,
                                 new_result, profile_call, ratio)
from dgemma.bench.fixtures import _seeded_model, gemma_270m_config, tiny_config
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo

SIZES = {
    "quick": dict(layers=2, train_lengths=(32, 64), decode_lengths=(32, 64), canvas=8, batch=1, repeats=2,
                  row_cap_s=3.0, dtype="float32", backward=False),
    "cpu": dict(layers=6, train_lengths=(128, 512, 1024), decode_lengths=(128, 512, 2048), canvas=32, batch=1,
                repeats=3, row_cap_s=6.0, dtype="float32", backward=False),
    "gpu": dict(layers=18, train_lengths=(512, 2048, 8192), decode_lengths=(512, 2048, 8192), canvas=64, batch=1,
                repeats=5, row_cap_s=6.0, dtype="bfloat16", backward=True),
}
BUDGET_S = {"quick": None, "cpu": 120.0, "gpu": 150.0}
COLUMNS = [("name", "row"), ("mode", "mode"), ("length", "L"), ("backend", "backend"), ("repeats", "n"),
           ("median_s", "s"), ("vs_eager", "x eager"), ("vs_sdpa", "x sdpa"), ("max_abs_diff", "max |diff| vs eager")]


@contextmanager
def backend(model, name: str):
    """Run ``model`` with back-end ``name`` for the block (``DiffusionGemma.set_attention``)."""
    old = model.config.attn_implementation
    model.set_attention(name)
    try:
        yield
    finally:
        model.set_attention(old)


def _model(ctx: Context, sz: dict):
    dtype = getattr(torch, sz["dtype"])
    if ctx.quick:
        cfg = tiny_config()
    else:
        n = sz["layers"]
        cfg = gemma_270m_config(num_hidden_layers=n, layer_types=None, vocab_size=4096)
    return _seeded_model(cfg).to(dtype).to(ctx.device), cfg


def run(ctx: Context) -> dict:
    started = time.perf_counter()
    sz = SIZES[ctx.profile]
    budget = Budget(ctx.budget_s if ctx.budget_s is not None else BUDGET_S[ctx.profile])
    result = new_result("attention", ctx)
    model, cfg = _model(ctx, sz)
    dev, b, c = ctx.device, sz["batch"], sz["canvas"]
    backends = ["eager", "sdpa", "flex"]
    result["settings"] = {
        "layers": cfg.num_hidden_layers, "layer_types": cfg.layer_types, "hidden_size": cfg.hidden_size,
        "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim], "window": cfg.sliding_window,
        "batch": b, "canvas": c, "dtype": sz["dtype"], "backward": sz["backward"], "backends": backends,
        "weights": "random (speed does not depend on the values)", "budget_s": budget.seconds,
    }
    if torch.device(dev).type != "cuda":
        result["notes"].append("flex on CPU: PyTorch's eager flex_attention materialises the full score matrix and "
                               "has no backward; it is the GPU fast path, measured here for completeness")
    reps, cap = ctx.reps(sz["repeats"]), sz["row_cap_s"]
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size

    def train_fn(ids, clean, xt, noisy):
        def fn():
            cache = KVCache(b, ids.shape[1])
            with torch.set_grad_enabled(sz["backward"]):
                h_enc = model(ids, info=clean, cache=cache, return_hidden=True)
                h_dec = model(xt, info=noisy, cache=cache, return_hidden=True)
                if sz["backward"]:
                    (h_enc.float().square().mean() + h_dec.float().square().mean()).backward()
                    model.zero_grad(set_to_none=True)
            return h_dec.detach()
        return fn

    def decode_fn(xt, noisy, cache):
        def fn():
            with torch.no_grad():
                return model(xt, info=noisy, cache=cache, write=False, return_hidden=True)
        return fn

    cases = [("train", L) for L in sz["train_lengths"]] + [("decode", L) for L in sz["decode_lengths"]]
    for mode, L in cases:
        if mode == "train":
            p = L - c
            ids = torch.randint(5, vocab, (b, L), generator=g).to(dev)
            clean = TokenInfo.clean(torch.ones(b, p, dtype=torch.bool, device=dev)).cat(
                TokenInfo(p + torch.arange(c, device=dev).expand(b, c), torch.ones(b, c, dtype=torch.long, device=dev),
                          torch.zeros(b, c, dtype=torch.bool, device=dev), torch.ones(b, c, dtype=torch.bool, device=dev)))
            xt = torch.randint(5, vocab, (b, c), generator=g).to(dev)
            noisy = TokenInfo(clean.positions[:, p:], clean.blocks[:, p:], torch.ones(b, c, dtype=torch.bool, device=dev),
                              torch.ones(b, c, dtype=torch.bool, device=dev))
            make = lambda: train_fn(ids, clean, xt, noisy)  # noqa: E731
        else:
            ids = torch.randint(5, vocab, (b, L), generator=g).to(dev)
            cache = KVCache(b, L)
            with torch.no_grad(), backend(model, "sdpa"):
                model(ids, info=TokenInfo.clean(torch.ones(b, L, dtype=torch.bool, device=dev)), cache=cache,
                      return_hidden=True)
            xt = torch.randint(5, vocab, (b, c), generator=g).to(dev)
            pos = L + torch.arange(c, device=dev).expand(b, c)
            ones = torch.ones(b, c, dtype=torch.bool, device=dev)
            noisy = TokenInfo(pos, torch.ones_like(pos), ones, ones)
            make = lambda: decode_fn(xt, noisy, cache)  # noqa: E731
        group: dict[str, dict] = {}
        prev = [r for r in rows if r["mode"] == mode]
        est = sum(r["median_s"] for r in prev[-len(backends):]) * L / prev[-1]["length"] * (reps + 1) if prev else 0.0
        if not budget.allows(est):
            result["skipped"].append(f"{mode} L={L} (time budget: needs ~{est:.0f} s)")
            continue
        fns, outs = {}, {}
        for name in backends:  # warm-up, one call each (this is also the output compared with eager)
            ctx.say(f"attention: {mode} L={L} {name}")
            fn = make()

            def call(fn=fn, name=name):
                with backend(model, name):
                    return fn()

            try:
                outs[name] = call().float()
                fns[name] = call
            except Exception as e:  # noqa: BLE001 - a back-end that cannot run here is a finding, not a crash
                result["notes"].append(f"{mode} L={L} {name}: failed ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:200]})")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # e.g. eager attention's L x L scores out of memory
        ms = measure_interleaved(fns, repeats=reps, max_seconds=cap, device=dev)
        for name, m in ms.items():
            rec = m.record()
            rec["warmup"] = 1
            row = {"name": f"{mode} L={L} {name}", "mode": mode, "length": L, "backend": name, **rec}
            if name != "eager" and "eager" in outs:
                row["max_abs_diff"] = float((outs[name] - outs["eager"]).abs().max())
            rows.append(row)
            group[name] = row
        del outs
        eager, sdpa = group.get("eager"), group.get("sdpa")
        for name, row in group.items():
            if eager and name != "eager":
                row["vs_eager"] = ratio(eager["median_s"], row["median_s"])
                add_ratio(result, f"{name} vs eager, {mode} L={L}", row["vs_eager"], baseline="eager",
                          what="eager seconds / back-end seconds")
            if sdpa and name.startswith("flex"):
                row["vs_sdpa"] = ratio(sdpa["median_s"], row["median_s"])
        del group
    # profile the flex back-end where it is slower than sdpa (the smallest such length)
    slow = [r for r in rows if r["backend"].startswith("flex") and (r.get("vs_sdpa") or 2) < 1]
    if slow and ctx.do_profile and budget.allows(3 * slow[0]["median_s"]):
        r = slow[0]
        L = r["length"]
        ids = torch.randint(5, vocab, (b, L), generator=g).to(dev)
        cache = KVCache(b, L)
        with torch.no_grad(), backend(model, "sdpa"):
            model(ids, info=TokenInfo.clean(torch.ones(b, L, dtype=torch.bool, device=dev)), cache=cache,
                  return_hidden=True)
        xt = torch.randint(5, vocab, (b, c), generator=g).to(dev)
        pos = L + torch.arange(c, device=dev).expand(b, c)
        ones = torch.ones(b, c, dtype=torch.bool, device=dev)
        noisy = TokenInfo(pos, torch.ones_like(pos), ones, ones)
        with backend(model, r["backend"]):
            prof = profile_call(decode_fn(xt, noisy, cache), device=dev)
        prof["row"] = f"decode L={L} {r['backend']} (profiled in decode mode)"
        result["profiles"][f"{r['backend']} L={L}"] = prof
        top = ", ".join(f"{o['name']} {o['share']:.0%}" for o in prof["top_ops"][:6])
        result["notes"].append(f"profile {r['backend']} (slower than sdpa): top ops {top}")
    result["rows"] = rows
    result["tables"].append(format_table(rows, COLUMNS, title=f"== attention: eager vs sdpa vs flex "
                                                              f"({cfg.num_hidden_layers} layers of the 270M shape, "
                                                              f"batch {b}, canvas {c}, {sz['dtype']})"))
    return finish(result, ctx, started)
