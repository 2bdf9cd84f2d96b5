"""Suite ``loss``: the chunked x0 cross-entropy against the full-logits one, vocabulary 262,144.

Both compute ``sum(-log softmax(h @ W.T)[target])`` over ``N`` tokens and its gradient, with
``W`` the tied ``[262,144, 640]`` embedding of the Gemma 3 270M: ``full_cross_entropy``
materialises the ``[N, V]`` fp32 logits (and autograd keeps them for backward), while
``chunked_cross_entropy`` keeps one log-sum-exp per token and recomputes each chunk's logits in
backward. Rows: forward + backward at growing ``N``, with the gradient w.r.t. the hidden states
only (LoRA: the embedding is frozen) and, at the smallest length, w.r.t. the embedding too (full
fine-tuning). Longer lengths, too slow to time on a CPU, get memory-only rows with a narrow hidden
state (the ``[N, V]`` tensors do not depend on its width). Memory is the peak of tensors created
by the call (``method.memory`` in the JSON) plus the largest single tensor, the proxy that shows ``[N, V]`` against ``[chunk, V]``.

The two are warmed up (with the memory counter) and then timed interleaved, full and chunked in
turn. Ratios per length: ``speed`` = full seconds / chunked seconds (>1: chunked faster) and
``memory_saving`` = full peak / chunked peak (>1: chunked smaller).
"""

from __future__ import annotations

import time

import torch

from dgemma.bench.common import (Budget, Context, add_ratio, finish, format_table, measure_interleaved, mib,
                                 new_result, peak_memory, profile_call, ratio, share_of)
from dgemma.diffusion.losses import chunked_cross_entropy, full_cross_entropy

SIZES = {
    "quick": dict(vocab=8192, dim=64, lengths=(64, 256), chunk=64, weight_grad_lengths=(64,), memory_lengths=(1024,),
                  memory_dim=8, repeats=2, row_cap_s=3.0, dtype="float32"),
    "cpu": dict(vocab=262_144, dim=640, lengths=(128, 256), chunk=128, weight_grad_lengths=(128,),
                memory_lengths=(512, 1024), memory_dim=16, repeats=3, row_cap_s=25.0, dtype="float32"),
    "gpu": dict(vocab=262_144, dim=640, lengths=(2048, 8192, 32768), chunk=1024, weight_grad_lengths=(2048, 8192),
                memory_lengths=(), memory_dim=16, repeats=5, row_cap_s=10.0, dtype="bfloat16"),
}
BUDGET_S = {"quick": None, "cpu": 150.0, "gpu": 60.0}
COLUMNS = [("name", "row"), ("tokens", "N"), ("dim", "d"), ("impl", "impl"), ("weight_grad", "dW"), ("repeats", "n"),
           ("median_s", "s"), ("peak_mib", "peak MiB"), ("largest_mib", "largest MiB"), ("speed", "x speed"),
           ("memory_saving", "x memory"), ("loss_rel_diff", "loss rel diff")]


def _inputs(n: int, vocab: int, dim: int, dtype, device, weight_grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=g) * 0.02).to(dtype).to(device).requires_grad_(weight_grad)
    hidden = torch.randn(n, dim, generator=g).to(dtype).to(device).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    return hidden, weight, targets, mask


def run(ctx: Context) -> dict:
    started = time.perf_counter()
    sz = SIZES[ctx.profile]
    budget = Budget(ctx.budget_s if ctx.budget_s is not None else BUDGET_S[ctx.profile])
    result = new_result("loss", ctx)
    dtype = getattr(torch, sz["dtype"])
    result["settings"] = {"vocab": sz["vocab"], "dim": sz["dim"], "chunk_tokens": sz["chunk"], "dtype": sz["dtype"],
                          "lengths": list(sz["lengths"]), "memory_lengths": list(sz["memory_lengths"]),
                          "memory_dim": sz["memory_dim"], "mask": "all tokens", "budget_s": budget.seconds,
                          "what": "forward (summed CE) + backward, grads w.r.t. hidden (and the embedding where dW)"}
    reps, cap, dev = ctx.reps(sz["repeats"]), sz["row_cap_s"], ctx.device
    rows: list[dict] = []

    def timed_case(n: int, wgrad: bool) -> None:
        tag = f"N={n}{' +dW' if wgrad else ''}"
        timed = [r for r in rows if "median_s" in r]
        est = 0.0
        if timed:
            est = sum(r["median_s"] for r in timed[-2:]) * n / timed[-1]["tokens"] * (1 + wgrad) * (reps + 1)
        if not budget.allows(est):
            result["skipped"].append(f"full and chunked {tag} (time budget: needs ~{est:.0f} s)")
            return
        h, w, tgt, mask = _inputs(n, sz["vocab"], sz["dim"], dtype, dev, wgrad)

        def make(fn_ce):
            def step():
                h.grad = None
                w.grad = None
                loss, _ = fn_ce(h, w, tgt, mask, chunk_tokens=sz["chunk"])
                loss.backward()
                return float(loss.detach())
            return step

        fns = {"full": make(full_cross_entropy), "chunked": make(chunked_cross_entropy)}
        pair, warm = {}, {}
        for impl, fn in fns.items():  # warm-up: one call each, with the memory counter
            ctx.say(f"loss: {impl} {tag} (warm-up, memory)")
            try:
                box = {}
                peak, largest = peak_memory(lambda: box.setdefault("loss", fn()), dev)
                warm[impl] = (peak, largest, box["loss"])
            except torch.OutOfMemoryError as e:  # the point of the chunked loss, on a GPU
                result["notes"].append(f"{impl} {tag}: out of memory ({str(e).splitlines()[0]})")
                rows.append({"name": f"{impl} {tag}", "impl": impl, "tokens": n, "weight_grad": wgrad, "oom": True})
                torch.cuda.empty_cache()
        ctx.say(f"loss: {tag} (timed, interleaved)")
        ms = measure_interleaved({k: fns[k] for k in warm}, repeats=reps, max_seconds=cap, device=dev)
        for impl, m in ms.items():
            peak, largest, loss0 = warm[impl]
            rec = m.record()
            rec["warmup"] = 1
            row = {"name": f"{impl} {tag}", "impl": impl, "tokens": n, "dim": sz["dim"], "weight_grad": wgrad, **rec,
                   "loss": loss0,
                   "peak_bytes": peak, "largest_tensor_bytes": largest, "peak_mib": mib(peak),
                   "largest_mib": mib(largest), "logits_bytes_full_fp32": n * sz["vocab"] * 4}
            rows.append(row)
            pair[impl] = row
        del h, w, tgt, mask, fns
        if len(pair) == 2:
            full, ch = pair["full"], pair["chunked"]
            ch["speed"] = ratio(full["median_s"], ch["median_s"])
            ch["memory_saving"] = ratio(full.get("peak_bytes"), ch.get("peak_bytes"))
            ch["loss_rel_diff"] = abs(full["loss"] - ch["loss"]) / max(abs(full["loss"]), 1e-12)
            add_ratio(result, f"chunked vs full loss time {tag}", ch["speed"], baseline="full_cross_entropy",
                      what="full seconds / chunked seconds")
            add_ratio(result, f"chunked vs full loss peak memory {tag}", ch["memory_saving"],
                      baseline="full_cross_entropy", what="full peak bytes / chunked peak bytes")
    # memory at lengths too long to time here: the [N, V] tensors do not depend on the width d, so a
    # narrow hidden state (memory_dim) shows the same growth for a fraction of the arithmetic
    def memory_case(n: int) -> None:
        est = 6 * n * sz["vocab"] * 4 / 2**30  # ~seconds of elementwise work per GiB-sized pass, generously
        if not budget.allows(est + 5):
            result["skipped"].append(f"memory N={n} (time budget)")
            return
        pair = {}
        for impl, fn_ce in (("full", full_cross_entropy), ("chunked", chunked_cross_entropy)):
            ctx.say(f"loss: memory {impl} N={n} (d={sz['memory_dim']})")
            h, w, tgt, mask = _inputs(n, sz["vocab"], sz["memory_dim"], dtype, dev, False)

            def call():
                loss, _ = fn_ce(h, w, tgt, mask, chunk_tokens=sz["chunk"])
                loss.backward()

            t0 = time.perf_counter()
            peak, largest = peak_memory(call, dev)
            row = {"name": f"{impl} N={n} (memory only)", "impl": impl, "tokens": n, "dim": sz["memory_dim"],
                   "weight_grad": False, "memory_only": True, "peak_bytes": peak, "largest_tensor_bytes": largest,
                   "peak_mib": mib(peak), "largest_mib": mib(largest), "seconds_once": time.perf_counter() - t0,
                   "logits_bytes_full_fp32": n * sz["vocab"] * 4}
            rows.append(row)
            pair[impl] = row
            del h, w, tgt, mask
        if len(pair) == 2:
            pair["chunked"]["memory_saving"] = ratio(pair["full"]["peak_bytes"], pair["chunked"]["peak_bytes"])
            add_ratio(result, f"chunked vs full loss peak memory N={n} (d={sz['memory_dim']}, memory only)",
                      pair["chunked"]["memory_saving"], baseline="full_cross_entropy",
                      what="full peak bytes / chunked peak bytes")
    timed_case(sz["lengths"][0], False)
    for n in sz["memory_lengths"]:
        memory_case(n)
    for n in sz["lengths"][1:]:
        timed_case(n, False)
    for n in sz["weight_grad_lengths"]:
        timed_case(n, True)
    # where the chunked loss is slower, say why with a profile (smallest length: same ops per chunk)
    slow = [r for r in rows if r.get("speed") is not None and r["speed"] < 1]
    if slow and ctx.do_profile and budget.allows(3 * slow[0]["median_s"]):
        r = slow[0]
        for impl, fn_ce in (("chunked", chunked_cross_entropy), ("full", full_cross_entropy)):
            h, w, tgt, mask = _inputs(r["tokens"], sz["vocab"], sz["dim"], dtype, dev, r["weight_grad"])

            def step():
                loss, _ = fn_ce(h, w, tgt, mask, chunk_tokens=sz["chunk"])
                loss.backward()

            prof = profile_call(step, device=dev)
            prof["vocab_ops_share"] = share_of(prof, lambda x: str(sz["vocab"]) in x["input_shapes"])
            prof["row"] = f"{impl} N={r['tokens']}"
            mm = sum(o["calls"] for o in prof["top_ops"] if o["name"] in ("aten::mm", "aten::addmm", "aten::matmul"))
            prof["matmul_calls"] = mm
            result["profiles"][f"{impl} N={r['tokens']}"] = prof
        result["notes"].append(
            "chunked is slower than full where x speed < 1: its backward recomputes each chunk's logits (one more "
            "[chunk, V] x [V, d] matmul per chunk: 3 vocabulary matmuls instead of 2 without dW, 4 instead of 3 "
            "with it), the price of never holding [N, V] logits; see profiles")
    result["rows"] = rows
    result["tables"].append(format_table(rows, COLUMNS, title=f"== loss: chunked vs full cross-entropy, V={sz['vocab']}, "
                                                              f"d={sz['dim']}, chunk {sz['chunk']}, {sz['dtype']}"))
    return finish(result, ctx, started)
