"""Suite ``decode``: block-diffusion sampling against AR decoding of the same weights.

Two models:

1. **Gemma 3 270M** (untrained as a diffusion model: speed only). Rows: AR decoding through our
   KV cache (``ar_generate``, greedy), transformers' ``generate`` with its cache (greedy, same
   prompt, same number of new tokens), and ``CanvasSampler`` for each step type x number of
   steps x early stopping, plus the sampler without the KV cache (``use_cache=False``: the
   prompt is recomputed at every step; compared with the cached sampler at a longer prompt,
   ``nocache_prompt_len``), at batch 1 and batch 16. Every prompt row has the same
   length and no stop token ends a row early, so every method emits the same number of tokens.
2. **The trained Sudoku model** (``--sudoku-workdir``, default ``checkpoints/sudoku_avg``):
   the same comparison with ``accuracy`` / ``cell_accuracy`` next to the speed, on generated
   unique puzzles, with the run's own sampler settings (``dgemma.eval.harness.build_sampler``).
   Skipped with a note when the run does not exist.
3. **The adapted PubMedQA pair** (``--pubmedqa-workdir``, default ``checkpoints/pubmedqa_270m``): the
   diffusion adapter with its own sampler settings (at its evaluated step counts) against the AR
   fine-tune of the same weights in its ``ar/`` (greedy, our cache), on the held-out test questions
   shipped beside it (``examples.jsonl``), at batch 1 and one batch of all of them; accuracy,
   macro-F1, BLEU and unparsed answers next to tokens/s. Each row is one pass over its questions
   after an untimed warm-up; ``vs_ar`` compares it with the AR row of the same batch.

The models run in ``ctx.dtype`` (``--dtype``, default ``auto``: bf16 where the CPU has native bf16
matrix units or on a GPU; a trained run's ``auto`` is its own training precision, see
``dgemma/training/runs.py:load_run``).

Ratios: ``vs_ar`` = tokens/s of the row / tokens/s of our AR decoding at the same batch size;
``vs_hf`` = the same against transformers' ``generate``; ``cache_speedup`` = tokens/s with the
KV cache / tokens/s without it (same sampler settings). The cheap baselines are timed again every
``refresh_s`` seconds between rows, and ``vs_ar`` / ``vs_hf`` use the baseline timings taken
within ``local_s`` seconds of the row (on a shared machine the load drifts over minutes);
``vs_ar_suite`` / ``vs_hf_suite`` use the baselines' medians over the whole suite.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from dgemma.bench import fixtures
from dgemma.bench.common import (Budget, Context, add_ratio, finish, format_table, measure, new_result,
                                 profile_call, ratio, share_of)
from dgemma.data.sft import encode_prompts
from dgemma.device import resolve_dtype, synchronize
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.sampler import CanvasSampler, ar_generate
from dgemma.diffusion.schedules import get_schedule
from dgemma.diffusion.steps import STEPS
from dgemma.errors import DGemmaError
from dgemma.eval import harness  # the run's own sampler, as dgemma eval builds it
from dgemma.sampling import SamplerConfig, build_sampler, interactive_cfg, max_canvases, resolve_prefix
from dgemma.tasks import get_task
from dgemma.tasks.sudoku import generate_eval_puzzles

STEP_TYPES = ("ddim", "commit", "confidence")
STEP_TEMPERATURE = {s: STEPS[s].default_temperature for s in STEP_TYPES}  # each rule's own default

# Sizes per profile. ``grid_steps`` x STEP_TYPES x {no stop, entropy stop} at ``batches[0]``; the
# big batch runs ``big_batch_steps`` only (batch 16 on a CPU is only affordable with short canvases).
SIZES = {
    "quick": dict(prompt_len=12, canvas=8, batches=(1, 4), grid_steps=(2, 4), big_batch_steps=(2,),
                  nocache_steps=(2,), nocache_prompt_len=24, repeats=2, row_cap_s=5.0, refresh_s=1e9, refresh_max_s=1.0, local_s=60.0,
                  sudoku_puzzles=4, sudoku_batch=2, sudoku_steps=(2, 4), sudoku_b1=2,
                  pubmedqa_questions=2, pubmedqa_b1=1, pubmedqa_steps=(2,), pubmedqa_canvases=1),
    "cpu": dict(prompt_len=32, canvas=16, batches=(1, 16), grid_steps=(8, 16, 32, 64), big_batch_steps=(8,),
                nocache_steps=(8,), nocache_prompt_len=128, repeats=3, row_cap_s=12.0, refresh_s=30.0, refresh_max_s=4.0, local_s=45.0,
                sudoku_puzzles=32, sudoku_batch=16, sudoku_steps=(8, 16, 32, 64), sudoku_b1=3,
                pubmedqa_questions=16, pubmedqa_b1=4, pubmedqa_steps=(32, 16, 8), pubmedqa_canvases=None),
    "gpu": dict(prompt_len=128, canvas=64, batches=(1, 16), grid_steps=(8, 16, 32, 64),
                big_batch_steps=(8, 16, 32, 64), nocache_steps=(8, 32), nocache_prompt_len=512, repeats=5, row_cap_s=10.0, refresh_s=20.0,
                refresh_max_s=4.0, local_s=30.0, sudoku_puzzles=256, sudoku_batch=16, sudoku_steps=(8, 16, 32, 64), sudoku_b1=16,
                pubmedqa_questions=16, pubmedqa_b1=16, pubmedqa_steps=(32, 16, 8),
                pubmedqa_canvases=None),
}
BUDGET_S = {"quick": None, "cpu": 700.0, "gpu": 200.0}

COLUMNS = [("name", "row"), ("batch", "B"), ("steps", "steps"), ("early_stop", "ES"), ("repeats", "n"),
           ("tokens", "tok"), ("forward_passes", "fwd"), ("tokens_per_forward", "tok/fwd"),
           ("mean_steps_per_canvas", "steps/cv"), ("median_s", "s"), ("tokens_per_s", "tok/s"),
           ("vs_ar", "x AR"), ("vs_hf", "x HF"), ("cache_speedup", "x no-cache")]
SUDOKU_COLUMNS = COLUMNS[:-1] + [("accuracy", "acc"), ("cell_accuracy", "cell acc"), ("n_puzzles", "puzzles")]


def _sync_time(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


def _diffusion_sampler(noise, step: str, steps: int, canvas: int, *, early_stop: bool, use_cache: bool = True,
                       stop_ids=()) -> CanvasSampler:
    """One canvas with ``step`` at its own default temperature (``StepRule.default_temperature``)."""
    settings = SamplerConfig(num_steps=steps, step_type=step, temperature=STEPS[step].default_temperature,
                             early_stopping="entropy" if early_stop else "none", max_canvases=1)
    return build_sampler(settings, noise=noise, canvas_size=canvas, stop_ids=tuple(stop_ids), use_cache=use_cache)


def _hf_generate(hf, ids, valid, new_tokens: int):
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                           eos_token_id=None)


def _left_pad(ids: torch.Tensor, valid: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows -> left-padded rows (what ``generate`` expects of a decoder-only model)."""
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # pads first, order kept
    return ids.gather(1, order).masked_fill(~valid.gather(1, order), pad_id), valid.gather(1, order)


# ------------------------------------------------------------------------------------ 270M
def _estimate(run_s: float, reps: int, cap: float, warm_s: float) -> float:
    """Seconds a row will take: its warm-up plus the timed repeats ``measure`` will run."""
    return warm_s + min(reps * run_s, max(run_s, cap + run_s))


class LMDecode:
    """The language-model half of the suite (the 270M, or the tiny model with ``--quick``)."""

    def __init__(self, ctx: Context, result: dict, budget: Budget, sz: dict):
        self.ctx, self.result, self.budget, self.sz = ctx, result, budget, sz
        dev = ctx.device
        if ctx.quick:
            key = ("tiny", dev)
            if key not in ctx.cache:
                ctx.cache[key] = (fixtures._seeded_model(fixtures.tiny_config()).to(dev).eval(), None, "tiny-random")
            self.model, self.tok, source = ctx.cache[key]
            self.hf = fixtures.hf_twin(ctx, self.model, source, key="tiny")
            self.label = "tiny"
        else:
            dtype = resolve_dtype(ctx.dtype, dev)
            self.model, self.tok, source = fixtures.load_270m(ctx, dtype=dtype)
            self.hf = fixtures.hf_twin(ctx, self.model, source, dtype=dtype)
            self.label = "gemma3-270m"
            if "270m_note" in ctx.cache:
                result["notes"].append(ctx.cache["270m_note"])
        if self.hf is None:
            result["notes"].append("transformers is not installed: the generate baseline is skipped")
        self.vocab = self.model.config.vocab_size
        self.noise = UniformNoise(self.vocab, get_schedule("linear"))
        self.c, self.p = sz["canvas"], sz["prompt_len"]
        self.reps, self.cap = ctx.reps(sz["repeats"]), sz["row_cap_s"]
        self.rows: list[dict] = []
        self.base: dict[tuple, dict] = {}  # ("ar" | "hf", batch) -> baseline row
        self.per_step_s: dict[int, float] = {}  # batch -> measured seconds per denoising step
        self.base_fns: dict[tuple, object] = {}  # the baselines' calls, re-timed between rows
        self.last_refresh = time.perf_counter()
        self.t_origin = budget.start
        self.last_result = None  # what the last timed call returned
        self.attempted: set[tuple] = set()  # (batch, step, steps, early, use_cache) of every diffusion row tried
        self.prompts = {b: fixtures.passage_prompts(self.tok, b, self.p, self.vocab, seed=b, device=dev)
                        for b in sz["batches"]}
        result["settings"]["lm"] = {
            "model": self.label, "weights": source, "dtype": str(next(self.model.parameters()).dtype),
            "prompt_len": self.p, "canvas_size": self.c, "new_tokens": self.c, "max_canvases": 1,
            "batches": list(sz["batches"]), "attn_implementation": self.model.config.attn_implementation,
            "self_conditioning": self.model.self_conditioning is not None, "step_temperatures": STEP_TEMPERATURE,
            "early_stopping": "entropy (threshold 0.05, the adapter's rule)",
            "stop_ids": "none (every row emits exactly canvas_size tokens)", "ar": "greedy, our KV cache",
            "hf": "transformers generate, greedy, its own cache, min_new_tokens = max_new_tokens", "seed": 0,
        }

    # -- one row ---------------------------------------------------------------------------------
    def _run(self, row: dict, fn, warm, est_s: float | None) -> dict | None:
        if est_s is not None and not self.budget.allows(est_s):
            self.result["skipped"].append(
                f"{row['name']} (time budget: needs ~{est_s:.0f} s, {max(self.budget.left(), 0):.0f} s left)")
            return None
        self.ctx.say(f"decode {self.label}: {row['name']}")
        warm()
        t0 = time.perf_counter()
        m = measure(fn, warmup=0, repeats=self.reps, max_seconds=self.cap, device=self.ctx.device)
        t1 = time.perf_counter()
        self.last_result = m.result
        row.update(m.record())
        row["window"] = (t0 - self.t_origin, t1 - self.t_origin)  # when it was timed, suite seconds
        if hasattr(m.result, "stats"):  # SampleResult / ARResult
            s = m.result.stats()
            row.update(tokens=s["tokens"], forward_passes=s["forward_passes"],
                       tokens_per_forward=s["tokens_per_forward"], mean_steps_per_canvas=s.get("mean_steps_per_canvas"))
        row["tokens_per_s"] = row["tokens"] / row["median_s"]
        self.rows.append(row)
        return row

    def baselines(self, b: int) -> None:
        model, c = self.model, self.c
        ids, valid = self.prompts[b]
        r = self._run({"name": f"ar b{b}", "model": self.label, "kind": "ar", "batch": b},
                      lambda: ar_generate(model, ids, valid, max_new_tokens=c),
                      lambda: ar_generate(model, ids, valid, max_new_tokens=2), None)
        if r:
            r["initial"] = r["repeats"]
            self.base[("ar", b)] = r
            self.base_fns[("ar", b)] = lambda: ar_generate(model, ids, valid, max_new_tokens=c)
            ours = self.last_result.tokens
        if self.hf is None:
            return
        hf = self.hf
        r = self._run({"name": f"hf generate b{b}", "model": self.label, "kind": "hf_generate", "batch": b,
                       "tokens": b * c, "forward_passes": b * c, "tokens_per_forward": 1.0},
                      lambda: _hf_generate(hf, ids, valid, c), lambda: _hf_generate(hf, ids, valid, 2), None)
        if r:
            r["initial"] = r["repeats"]
            self.base[("hf", b)] = r
            self.base_fns[("hf", b)] = lambda: _hf_generate(hf, ids, valid, c)
            if ("ar", b) in self.base:  # parity: our greedy tokens against transformers' on the same weights
                theirs = self.last_result[:, ids.shape[1]:].tolist()
                same = sum(x == y for a, b_ in zip(ours, theirs) for x, y in zip(a, b_))
                r["greedy_tokens_equal_to_ours"] = same / max(sum(len(a) for a in ours), 1)

    def refresh(self, force: bool = False) -> None:
        """Time each baseline once more if ``refresh_s`` have passed since the last time: its median
        then spans the whole suite, so a drift in the machine's load hits both sides of a ratio."""
        if not force and time.perf_counter() - self.last_refresh < self.sz["refresh_s"]:
            return
        for key, fn in self.base_fns.items():
            row = self.base[key]
            if row["median_s"] > self.sz["refresh_max_s"]:
                continue  # too dear to repeat (batch 16 on a CPU)
            t0 = time.perf_counter()
            _, dt = _sync_time(fn, self.ctx.device)
            row.setdefault("samples", []).append((t0 - self.t_origin + dt / 2, dt))
            row["times_s"].append(dt)
            row["median_s"] = statistics.median(row["times_s"])
            row["min_s"] = min(row["times_s"])
            row["repeats"] = len(row["times_s"])
            row["tokens_per_s"] = row["tokens"] / row["median_s"]
        self.last_refresh = time.perf_counter()

    def diffusion(self, b: int, step: str, steps: int, early: bool, use_cache: bool = True,
                  prompt_len: int | None = None) -> dict | None:
        """One sampler row; ``prompt_len`` (default: the suite's) only for the cache comparison, whose
        rows are then compared with each other, not with AR (a different prompt)."""
        model, c, dev = self.model, self.c, self.ctx.device
        p = prompt_len or self.p
        self.attempted.add((b, step, steps, early, use_cache, p))
        self.refresh()
        if p == self.p:
            ids, valid = self.prompts[b]
        else:
            ids, valid = fixtures.passage_prompts(self.tok, b, p, self.vocab, seed=b, device=dev)
        sampler = _diffusion_sampler(self.noise, step, steps, c, early_stop=early, use_cache=use_cache)
        warm_s = _diffusion_sampler(self.noise, step, min(steps, 2), c, early_stop=early, use_cache=use_cache)
        est = None
        if b in self.per_step_s:
            per = self.per_step_s[b] * (1.0 if use_cache else (p + c) / c)
            est = _estimate(per * (steps + 1), self.reps, self.cap, per * (min(steps, 2) + 1))
        name = (f"{step} S={steps}{' ES' if early else ''}{'' if p == self.p else f' P={p}'}"
                f"{'' if use_cache else ' no-cache'} b{b}")
        r = self._run({"name": name, "model": self.label, "kind": "diffusion" if use_cache else "diffusion_nocache",
                       "step": step, "batch": b, "steps": steps, "early_stop": early, "use_cache": use_cache,
                       "prompt_len": p},
                      lambda: sampler(model, ids, valid, generator=torch.Generator(device=dev).manual_seed(0)),
                      lambda: warm_s(model, ids, valid, generator=torch.Generator(device=dev).manual_seed(0)), est)
        if r is None:
            return None
        if use_cache and p == self.p:
            self.per_step_s.setdefault(b, r["median_s"] / (steps + 1))
        if p == self.p:
            r["vs_ar"] = ratio(r["tokens_per_s"], self.base.get(("ar", b), {}).get("tokens_per_s"))
            r["vs_hf"] = ratio(r["tokens_per_s"], self.base.get(("hf", b), {}).get("tokens_per_s"))
        return r

    # -- plan --------------------------------------------------------------------------------------
    # Rows run in order of value, so a time budget that runs out trims the least informative ones:
    # first_part -> profiles -> (the Sudoku model) -> big_batch -> step_sweep -> early_stop -> rest.
    def first_part(self) -> None:
        """Baselines at batch 1, each step type at the fewest steps, the sampler without the cache."""
        sz = self.sz
        b1, s0 = sz["batches"][0], sz["grid_steps"][0]
        self.baselines(b1)
        first = {st: self.diffusion(b1, st, s0, False) for st in STEP_TYPES}
        for steps in sz["nocache_steps"]:  # the cache comparison, at a longer prompt (what the cache saves grows with it)
            pl = sz["nocache_prompt_len"]
            cached = first["ddim"] if steps == s0 and pl == self.p else self.diffusion(b1, "ddim", steps, False,
                                                                                      prompt_len=pl)
            nc = self.diffusion(b1, "ddim", steps, False, use_cache=False, prompt_len=pl)
            if nc is not None and cached is not None:
                nc["cache_speedup"] = cached["cache_speedup"] = ratio(cached["tokens_per_s"], nc["tokens_per_s"])
                add_ratio(self.result, f"{self.label} kv-cache vs no cache (ddim S={steps}, prompt {pl}, b{b1})",
                          nc["cache_speedup"], baseline="CanvasSampler(use_cache=False)",
                          what="tokens/s with the cache / without")

    def step_sweep(self) -> None:
        """The adapter's step (ddim) at every number of steps."""
        for steps in self.sz["grid_steps"][1:]:
            self.diffusion(self.sz["batches"][0], "ddim", steps, False)

    def early_stop(self) -> None:
        """Each step type with the entropy stop, at the fewest steps."""
        for st in STEP_TYPES:
            self.diffusion(self.sz["batches"][0], st, self.sz["grid_steps"][0], True)

    def big_batch(self) -> None:
        """Baselines and the sampler at the big batch (every step type and count on a GPU)."""
        b1, bb = self.sz["batches"]
        ar1 = self.base.get(("ar", b1))
        if ar1 is not None:  # AR at batch bb costs about bb/4 of batch 1 per call on a CPU, x (warm-up + repeats)
            est = ar1["median_s"] * max(bb / 4, 1) * 2 * (1 + (self.hf is not None))
            if not self.budget.allows(est):
                self.result["skipped"].append(f"batch {bb} (time budget: needs ~{est:.0f} s for the baselines)")
                return
        self.baselines(bb)
        arb = self.base.get(("ar", bb))
        if b1 in self.per_step_s and arb is not None and ar1 is not None:
            self.per_step_s.setdefault(bb, self.per_step_s[b1] * arb["median_s"] / ar1["median_s"])
        types = STEP_TYPES if self.ctx.profile == "gpu" else ("ddim",)
        for steps in self.sz["big_batch_steps"]:
            for st in types:
                self.diffusion(bb, st, steps, False)

    def rest(self) -> None:
        """Whatever the grid still lacks: every step type x steps x early stopping at batch 1."""
        b1 = self.sz["batches"][0]
        for early in (False, True):
            for steps in self.sz["grid_steps"]:
                for st in STEP_TYPES:
                    if (b1, st, steps, early, True, self.p) not in self.attempted:
                        self.diffusion(b1, st, steps, early)

    def _local_tps(self, base: dict, window: tuple[float, float]) -> float:
        """The baseline's tokens/s from its timings within ``local_s`` of ``window`` (the time a row
        was measured), else over the whole suite: a row measured while the machine was busier is
        compared with a baseline measured while it was as busy."""
        a, b = base["window"]
        samples = [(a + (b - a) * (i + 0.5) / len(base["times_s"][:base["initial"]]), t)
                   for i, t in enumerate(base["times_s"][:base["initial"]])] + base.get("samples", [])
        lo, hi = window[0] - self.sz["local_s"], window[1] + self.sz["local_s"]
        near = [t for when, t in samples if lo <= when <= hi]
        return base["tokens"] / statistics.median(near) if near else base["tokens_per_s"]

    def ratios(self) -> None:
        """Final ratios: against the baselines timed nearest to each row (``vs_ar``, ``vs_hf``) and
        against their medians over the whole suite (``vs_ar_suite``, ``vs_hf_suite``)."""
        label, result = self.label, self.result
        for r in self.rows:
            if r["kind"].startswith("diffusion") and r.get("prompt_len", self.p) == self.p:
                for kind in ("ar", "hf"):
                    base = self.base.get((kind, r["batch"]))
                    r[f"vs_{kind}_suite"] = ratio(r["tokens_per_s"], base and base["tokens_per_s"])
                    r[f"vs_{kind}"] = ratio(r["tokens_per_s"], base and self._local_tps(base, r["window"]))
        for (kind, b), r in self.base.items():
            if kind == "ar" and ("hf", b) in self.base:
                r["vs_hf"] = ratio(r["tokens_per_s"], self.base[("hf", b)]["tokens_per_s"])
        for b in sorted({r["batch"] for r in self.rows}):
            ar, hf = self.base.get(("ar", b)), self.base.get(("hf", b))
            if ar and hf:
                add_ratio(result, f"{label} AR (ours) vs transformers generate b{b}",
                          ratio(ar["tokens_per_s"], hf["tokens_per_s"]), baseline="transformers generate",
                          what="tokens/s, greedy, same prompt and number of new tokens")
            diff = [r for r in self.rows if r["batch"] == b and r["kind"] == "diffusion" and r.get("vs_ar") is not None]
            if not diff:
                continue
            best = max(diff, key=lambda r: r["vs_ar"])
            add_ratio(result, f"{label} fastest diffusion vs AR b{b} ({best['name']})", best["vs_ar"],
                      baseline="ar_generate (ours)", what="tokens/s")
            if best.get("vs_hf") is not None:
                add_ratio(result, f"{label} fastest diffusion vs transformers generate b{b} ({best['name']})",
                          best["vs_hf"], baseline="transformers generate", what="tokens/s")
            for r in diff:
                if r["step"] == "ddim" and not r["early_stop"] and r is not best:
                    add_ratio(result, f"{label} {r['name']} vs AR", r["vs_ar"], baseline="ar_generate (ours)",
                              what="tokens/s")

    def profile_diffusion(self) -> None:
        """Profile the cheapest worse-than-AR diffusion row (at 2 steps: the same work per step) and,
        beside it, the AR baseline it loses to."""
        ctx, result = self.ctx, self.result
        worse = sorted((r for r in self.rows if r["kind"] == "diffusion" and (r.get("vs_ar") or 2) < 1),
                       key=lambda r: (r["batch"], r["steps"]))
        if not ctx.do_profile or not worse:
            return
        r = worse[0]
        ar = self.base.get(("ar", r["batch"]))
        est = 3 * r["median_s"] / (r["steps"] + 1) + (ar["median_s"] if ar else 0) + 5
        if not self.budget.allows(est):
            result["skipped"].append(f"profile of {r['name']} (time budget)")
            return
        model, c, dev = self.model, self.c, ctx.device
        ids, valid = self.prompts[r["batch"]]
        s = _diffusion_sampler(self.noise, r["step"], 2, c, early_stop=bool(r["early_stop"]))
        self._profile(f"{self.label} diffusion {r['step']} b{r['batch']}",
                      r["name"] + " (profiled at 2 steps: the same work per step)",
                      lambda: s(model, ids, valid, generator=torch.Generator(device=dev).manual_seed(0)))
        if ar is not None:
            self._profile(f"{self.label} ar b{r['batch']}", f"ar b{r['batch']} (the baseline it loses to)",
                          lambda: ar_generate(model, ids, valid, max_new_tokens=c))

    def profile_ar_vs_hf(self) -> None:
        """Profile our AR decoding wherever it is slower than transformers' generate."""
        if not self.ctx.do_profile:
            return
        for b in sorted({r["batch"] for r in self.rows}):
            ar, hf = self.base.get(("ar", b)), self.base.get(("hf", b))
            key = f"{self.label} ar b{b} (slower than generate)"
            if not (ar and hf and ar["tokens_per_s"] < hf["tokens_per_s"]) or key in self.result["profiles"]:
                continue
            if not self.budget.allows(2 * ar["median_s"] + 5):
                self.result["skipped"].append(f"profile of {ar['name']} (time budget)")
                continue
            ids, valid = self.prompts[b]
            model, c = self.model, self.c
            self._profile(key, ar["name"] + " (slower than transformers generate)",
                          lambda: ar_generate(model, ids, valid, max_new_tokens=c))

    def _profile(self, key: str, row: str, fn) -> None:
        vocab = str(self.vocab)
        prof = profile_call(fn, device=self.ctx.device)
        prof["vocab_ops_share"] = share_of(prof, lambda r: vocab in r["input_shapes"])
        prof["row"] = row
        self.result["profiles"][key] = prof


# ------------------------------------------------------------------------------------ Sudoku
def _hint_fn(run, width: int, device):
    """``records -> [B, width] pinned tokens or None``, as the eval harness makes them (Sudoku clues
    for a run trained with ``data.pin_clues``)."""
    def make(records):
        h = harness.clue_hints(run, records, width)
        return None if h is None else h.to(device)
    return make


def _hints_kw(pins) -> dict:
    return {} if pins is None else {"hints": pins}


def _skip_part(result: dict, key: str, label: str, why: str) -> list[dict]:
    """A trained-model part without its run: a note and ``settings[key]`` say why; no rows."""
    result["notes"].append(f"{label} part skipped: {why}")
    result["settings"][key] = {"skipped": why}
    return []


def _bench_sudoku(ctx: Context, result: dict, budget: Budget, sz: dict, run=None) -> list[dict]:
    """The trained Sudoku model: speed and accuracy per sampler setting, AR and generate baselines."""
    if run is None:
        run, why = fixtures.sudoku_run(ctx)
        if run is None:
            return _skip_part(result, "sudoku", "Sudoku", why)
    dev = ctx.device
    model, tok, cfg = run.model.eval(), run.tokenizer, run.cfg
    task = get_task("sudoku")
    records = generate_eval_puzzles(sz["sudoku_puzzles"], seed=20_250_101)
    noise = run.noise()
    bs = sz["sudoku_batch"]
    c = cfg.diffusion.canvas_size
    new_tokens = c * max(1, cfg.diffusion.num_canvases)
    types = [t for t in STEP_TYPES if t != "ddim" or isinstance(noise, UniformNoise)]
    result["settings"]["sudoku"] = {
        "workdir": str(getattr(run, "path", "")), "checkpoint_step": getattr(run, "step", None),
        "puzzles": len(records),
        "puzzle_source": "generate_eval_puzzles(seed=20250101): unique, easy/medium/hard in turn",
        "batch": bs, "batch1_puzzles": sz["sudoku_b1"], "canvas_size": c, "noise": cfg.diffusion.process,
        "step_types": types, "early_stopping": "entropy (threshold eval_ds.entropy_threshold)",
        "sampler": "dgemma.eval.harness.build_sampler (the run's own eval settings)",
        "prompt_len": cfg.data.prompt_len,
    }
    if "ddim" not in types:
        result["notes"].append("Sudoku: the ddim step needs uniform noise; this run uses "
                               f"{cfg.diffusion.process} noise, so only commit and confidence are timed")
    batches = [records[i:i + bs] for i in range(0, len(records), bs)]
    hint = _hint_fn(run, new_tokens, dev)  # pinned clues, when the run trained with them (data.pin_clues)
    enc = [(*encode_prompts(tok, bt, cfg.data.prompt_len, device=dev)[:2], hint(bt)) for bt in batches]
    singles = [(*encode_prompts(tok, [r], cfg.data.prompt_len, device=dev)[:2], hint([r]))
               for r in records[:sz["sudoku_b1"]]]
    result["settings"]["sudoku"]["clues_pinned"] = enc[0][2] is not None
    rows: list[dict] = []
    base: dict = {}
    reps, cap = ctx.reps(sz["repeats"]), sz["row_cap_s"]

    # baselines: AR through our cache, transformers generate (its cache), on the first batch / puzzle
    try:
        hf = fixtures.hf_twin(ctx, model, "sudoku", key="sudoku", dtype=next(model.parameters()).dtype)
    except Exception as e:  # noqa: BLE001 - e.g. a LoRA run that cannot be exported as plain Gemma 3
        hf = None
        result["notes"].append(f"Sudoku: no transformers twin ({type(e).__name__}: {e}); generate baseline skipped")
    for b, (ids, valid, _) in ((bs, enc[0]), (1, singles[0])):
        m = measure(lambda: ar_generate(model, ids, valid, max_new_tokens=new_tokens), warmup=1, repeats=reps,
                    max_seconds=cap, device=dev)
        st = m.result.stats()
        row = {"name": f"sudoku ar b{b}", "kind": "ar", "batch": ids.shape[0], **m.record(), "tokens": st["tokens"],
               "forward_passes": st["forward_passes"], "tokens_per_forward": st["tokens_per_forward"]}
        row["tokens_per_s"] = row["tokens"] / row["median_s"]
        rows.append(row)
        base[("ar", b)] = row
        if hf is not None:
            lids, lvalid = _left_pad(ids, valid, tok.pad_id)
            m = measure(lambda: _hf_generate(hf, lids, lvalid, new_tokens), warmup=1, repeats=reps, max_seconds=cap,
                        device=dev)
            row = {"name": f"sudoku hf generate b{b}", "kind": "hf_generate", "batch": ids.shape[0], **m.record(),
                   "tokens": ids.shape[0] * new_tokens, "forward_passes": ids.shape[0] * new_tokens,
                   "tokens_per_forward": 1.0}
            row["tokens_per_s"] = row["tokens"] / row["median_s"]
            rows.append(row)
            base[("hf", b)] = row

    steps_list = sorted(set(sz["sudoku_steps"]) | (set(cfg.eval_ds.steps or []) if not ctx.quick else set()))
    result["settings"]["sudoku"]["steps"] = steps_list
    for steps in steps_list:
        for st in types:
            for early in (False, True):
                if not budget.allows(5):
                    result["skipped"].append(f"sudoku {st} S={steps}{' ES' if early else ''} (time budget)")
                    continue
                temp = cfg.eval_ds.temperature if st == cfg.eval_ds.step_type else STEP_TEMPERATURE[st]
                sampler, settings = harness.build_sampler(run, task, num_steps=steps, step_type=st, temperature=temp,
                                                  early_stopping="entropy" if early else None)
                ctx.say(f"decode sudoku: {st} S={steps}{' ES' if early else ''}")
                gen = torch.Generator(device=dev).manual_seed(0)
                sampler(model, singles[0][0], singles[0][1], generator=gen, **_hints_kw(singles[0][2]))  # warm-up
                # batch rows: every batch is one timed repeat; accuracy over all puzzles
                times, tokens, fwd, outs, used = [], 0, 0, [], []
                gen = torch.Generator(device=dev).manual_seed(cfg.eval_ds.seed)
                for ids, valid, pins in enc:
                    res, dt = _sync_time(lambda: sampler(model, ids, valid, generator=gen, **_hints_kw(pins)), dev)
                    times.append(dt)
                    tokens += sum(map(len, res.tokens))
                    fwd += sum(res.forward_passes)
                    outs += res.tokens
                    used += [s for row_ in res.steps_used for s in row_]
                texts = [tok.decode(t) for t in outs]
                metrics = task.score(texts, records)
                row = {"name": f"sudoku {st} S={steps}{' ES' if early else ''} b{bs}", "kind": "diffusion", "step": st,
                       "batch": bs, "steps": steps, "early_stop": early, "temperature": temp,
                       "median_s": sorted(times)[len(times) // 2], "times_s": times, "repeats": len(times),
                       "warmup": 1, "tokens": tokens, "forward_passes": fwd, "tokens_per_forward": tokens / max(fwd, 1),
                       "mean_steps_per_canvas": sum(used) / max(len(used), 1),
                       "tokens_per_s": tokens / sum(times), "accuracy": metrics["accuracy"],
                       "cell_accuracy": metrics["cell_accuracy"], "valid_accuracy": metrics["valid_accuracy"],
                       "n_puzzles": len(records), "settings": settings}
                row["vs_ar"] = ratio(row["tokens_per_s"], base[("ar", bs)]["tokens_per_s"])
                row["vs_hf"] = ratio(row["tokens_per_s"], base.get(("hf", bs), {}).get("tokens_per_s"))
                rows.append(row)
                # batch 1: the first few puzzles one at a time (speed; accuracy over those few)
                times1, tok1, fwd1, outs1, used1 = [], 0, 0, [], []
                gen = torch.Generator(device=dev).manual_seed(cfg.eval_ds.seed)
                for ids, valid, pins in singles:
                    res, dt = _sync_time(lambda: sampler(model, ids, valid, generator=gen, **_hints_kw(pins)), dev)
                    times1.append(dt)
                    tok1 += sum(map(len, res.tokens))
                    fwd1 += sum(res.forward_passes)
                    outs1 += res.tokens
                    used1 += [s for row_ in res.steps_used for s in row_]
                m1 = task.score([tok.decode(t) for t in outs1], records[:len(singles)])
                row1 = {"name": f"sudoku {st} S={steps}{' ES' if early else ''} b1", "kind": "diffusion", "step": st,
                        "batch": 1, "steps": steps, "early_stop": early, "temperature": temp,
                        "median_s": sorted(times1)[len(times1) // 2], "times_s": times1, "repeats": len(times1),
                        "warmup": 1, "tokens": tok1, "forward_passes": fwd1,
                        "tokens_per_forward": tok1 / max(fwd1, 1), "tokens_per_s": tok1 / sum(times1),
                        "mean_steps_per_canvas": sum(used1) / max(len(used1), 1),
                        "accuracy": m1["accuracy"], "cell_accuracy": m1["cell_accuracy"], "n_puzzles": len(singles)}
                row1["vs_ar"] = ratio(row1["tokens_per_s"], base[("ar", 1)]["tokens_per_s"])
                row1["vs_hf"] = ratio(row1["tokens_per_s"], base.get(("hf", 1), {}).get("tokens_per_s"))
                rows.append(row1)
    for r in rows:
        r["model"] = "sudoku"
    diff = [r for r in rows if r["kind"] == "diffusion" and r["batch"] == bs]
    if diff:
        best = max(diff, key=lambda r: r["accuracy"])
        fastest = max(diff, key=lambda r: r["tokens_per_s"])
        for tag, r in (("most accurate", best), ("fastest", fastest)):
            add_ratio(result, f"sudoku {tag} setting vs AR b{bs} ({r['name']}, acc {r['accuracy']:.3f})", r["vs_ar"],
                      baseline="ar_generate (ours)", what="tokens/s; accuracy in the name")
    ar, hf_row = base.get(("ar", bs)), base.get(("hf", bs))
    if ar and hf_row:
        add_ratio(result, f"sudoku AR (ours) vs transformers generate b{bs}",
                  ratio(ar["tokens_per_s"], hf_row["tokens_per_s"]), baseline="transformers generate", what="tokens/s")
    return rows


# ------------------------------------------------------------------------------------ PubMedQA
PUBMEDQA_COLUMNS = [("name", "row"), ("batch", "B"), ("steps", "steps"), ("n_questions", "q"), ("tokens", "tok"),
                    ("forward_passes", "fwd"), ("tokens_per_forward", "tok/fwd"), ("seconds", "s"),
                    ("prefill_s", "prefill s"), ("tokens_per_s", "tok/s"), ("vs_ar", "x AR"),
                    ("decode_vs_ar", "x AR after prefill"), ("accuracy", "acc"), ("macro_f1", "macro-F1"),
                    ("bleu", "BLEU"), ("unparsed", "unparsed")]


def _bench_pubmedqa(ctx: Context, result: dict, budget: Budget, sz: dict, runs=None) -> list[dict]:
    """The shipped PubMedQA adapter against its AR fine-tune: tokens/s with the quality beside it.
    ``runs``: ``(diffusion_run, ar_run, questions)`` instead of ``fixtures.pubmedqa_runs``."""
    if runs is None:
        runs, why = fixtures.pubmedqa_runs(ctx)
        if runs is None:
            return _skip_part(result, "pubmedqa", "PubMedQA", why)
    diff, ar, questions = runs
    task = get_task("pubmedqa").configure(diff.cfg)
    prefix = diff.cfg.eval_ds.response_prefix if ctx.pubmedqa_prefix is None else ctx.pubmedqa_prefix
    for run in (diff, ar):  # both decoders get the prefix, or neither
        run.cfg.eval_ds = dataclasses.replace(run.cfg.eval_ds, response_prefix=prefix)
    if ctx.pubmedqa_no_repeat:
        diff.cfg.eval_ds = dataclasses.replace(diff.cfg.eval_ds, commit_no_repeat=True)
    e = diff.cfg.eval_ds
    step_counts = ctx.pubmedqa_steps or sz["pubmedqa_steps"]
    shortlist = ctx.pubmedqa_shortlist  # None: what the run's users decode with
    if shortlist is None:
        shortlist = interactive_cfg(diff.cfg).eval_ds.shortlist
    setting = ", template pinned" if prefix else ""
    setting += ", no repeats" if e.commit_no_repeat else ""
    questions = questions[:sz["pubmedqa_questions"]]
    b1 = ctx.pubmedqa_b1 or sz["pubmedqa_b1"]
    if b1 > len(questions):
        raise DGemmaError(f"--pubmedqa-b1 {b1}: this profile decodes {len(questions)} of the shipped test questions")
    batches = ((1, questions[:b1]), (len(questions), questions))
    canvases = sz["pubmedqa_canvases"]  # None: the runs' own (--quick: one canvas)
    ar_tokens = ar.cfg.diffusion.canvas_size * (canvases or max_canvases(ar.cfg))
    # what the run decodes with; a row that differs is named "no signal" (a model without the block has no signal)
    default_signal = bool(e.self_condition) and diff.model.self_conditioning is not None
    result["settings"]["pubmedqa"] = {
        "workdir": str(diff.path.parent.parent), "checkpoint_step": diff.step, "ar_checkpoint_step": ar.step,
        "questions": len(questions), "batch1_questions": len(batches[0][1]),
        "question_source": "examples.jsonl beside the adapter (the first test questions)",
        "dtype": str(next(diff.model.parameters()).dtype), "steps": list(step_counts),
        "lora": diff.lora, "ar_lora": ar.lora,  # merged into the weights (load_run's default) or peft-wrapped
        "sampler": f"the run's own ({e.step_type}, blocks of {e.commit_block}, temperature {e.temperature}, "
                   f"self-conditioning {'on' if default_signal else 'off'}, no early stop: the shipped "
                   f"evaluations' setting); a self-conditioned run's rows again without the signal ('no signal')",
        "ar": f"greedy, our cache, at most {ar_tokens} tokens, the task's stop tokens",
        "response_prefix": e.response_prefix,  # pinned / prefilled for both decoders (eval_ds.response_prefix)
        "commit_no_repeat": bool(e.commit_no_repeat),  # the diffusion rows' (eval_ds.commit_no_repeat)
        "shortlist": shortlist,  # the reused-keys rows again with it, when > 0
    }
    rows: list[dict] = []
    ar_rows: dict[int, dict] = {}

    def add(name: str, kind: str, run, gen, batch: int, steps: int | None, signal: bool | None = None,
            reuse: bool | None = None, shortlist: int = 0) -> None:
        st = gen.stats(steps or 0)
        _, metrics = gen.scored(task, run.tokenizer)
        row = {"name": name, "model": "pubmedqa", "kind": kind, "batch": batch, "steps": steps,
               "self_condition": signal, "reuse_canvas_keys": reuse, "shortlist": shortlist,
               "n_questions": len(gen.records),
               "tokens": st["tokens"],
               "forward_passes": st["forward_passes"],
               "tokens_per_forward": st["tokens_per_forward"], "seconds": st["seconds"],
               "prefill_s": st["prefill_seconds"], "tokens_per_s": st["tokens_per_second"],
               "decode_tokens_per_s": st["decode_tokens_per_second"],
               "mean_steps_per_canvas": st["mean_steps_per_canvas"],
               **{k: metrics[k] for k in ("accuracy", "macro_f1", "bleu", "unparsed")}}
        if kind == "ar":
            ar_rows[batch] = row
        else:
            base = ar_rows.get(batch, {})
            row["vs_ar"] = ratio(row["tokens_per_s"], base.get("tokens_per_s"))
            # the same without the prompts' encoding, which both decoders do alike: what the decoder itself adds
            row["decode_vs_ar"] = ratio(row["decode_tokens_per_s"], base.get("decode_tokens_per_s"))
        rows.append(row)

    def ar_row(b: int, recs: list[dict]) -> None:
        warm = 4 + len(resolve_prefix(ar.cfg.eval_ds.response_prefix, ar.tokenizer))  # 4 tokens after any prefix
        harness.generate_ar(ar, task, recs, batch_size=b, max_new_tokens=warm)  # warm-up
        ctx.say(f"decode pubmedqa: ar b{b}")
        add(f"pubmedqa ar b{b}", "ar", ar, harness.generate_ar(ar, task, recs, batch_size=b, max_new_tokens=ar_tokens),
            b, None)

    def diffusion_row(b: int, recs: list[dict], steps: int, signal: bool, reuse: bool = False,
                      shortlist: int = 0) -> None:
        name = (f"pubmedqa diffusion S={steps} b{b}" + ("" if signal == default_signal else " no signal")
                + (" reused keys" if reuse else "") + (f" shortlist {shortlist}" if shortlist else "")
                + (" no repeats" if e.commit_no_repeat else ""))
        base = ar_rows.get(b)  # a diffusion pass over the same questions costs about 4 AR passes at 32 steps
        est = 4.0 * base["seconds"] * steps / 32 if base else 0.0
        if not budget.allows(est):
            result["skipped"].append(f"{name} (time budget: needs ~{est:.0f} s, {max(budget.left(), 0):.0f} s left)")
            return
        sampler, _ = harness.build_sampler(diff, task, num_steps=steps, step_type=e.step_type,
                                           temperature=e.temperature, early_stopping=None)
        warm, _ = harness.build_sampler(diff, task, num_steps=2, step_type=e.step_type, temperature=e.temperature,
                                        early_stopping=None)
        sampler.self_condition = warm.self_condition = signal
        sampler.reuse_canvas_keys = warm.reuse_canvas_keys = reuse
        sampler.shortlist = warm.shortlist = shortlist
        if canvases:
            sampler.max_canvases = warm.max_canvases = canvases
        harness.generate(diff, warm, recs[:b], batch_size=b, seed=e.seed)
        ctx.say(f"decode {name}")
        add(name, "diffusion", diff, harness.generate(diff, sampler, recs, batch_size=b, seed=e.seed), b, steps,
            signal, reuse, shortlist)

    signals = (True, False) if default_signal else (False,)
    for i, steps in enumerate(step_counts):  # the headline first: batch 1 at the most steps
        for b, recs in batches:
            if i == 0:
                ar_row(b, recs)
            for signal in signals:
                diffusion_row(b, recs, steps, signal)
            diffusion_row(b, recs, steps, False, reuse=True)  # approximate: partial passes (no signal needed)
            if shortlist:  # approximate too: later passes score a shortlist
                diffusion_row(b, recs, steps, False, reuse=True, shortlist=shortlist)
    for b in sorted(ar_rows):
        for r in rows:
            if r["kind"] == "diffusion" and r["batch"] == b and r.get("vs_ar") is not None:
                signal = "" if r["self_condition"] == default_signal else " without the signal"
                signal += ", reused canvas keys" if r["reuse_canvas_keys"] else ""
                signal += f", shortlist {r['shortlist']}" if r["shortlist"] else ""
                add_ratio(result, f"pubmedqa diffusion S={r['steps']}{signal} vs AR fine-tune b{b}{setting} "
                                  f"(acc {r['accuracy']:.3f} vs {ar_rows[b]['accuracy']:.3f}, "
                                  f"BLEU {r['bleu']:.2f} vs {ar_rows[b]['bleu']:.2f})",
                          r["vs_ar"], baseline="the AR fine-tune, greedy (ours)", what="tokens/s; quality in the name")
    return rows


# ------------------------------------------------------------------------------------ suite
def _adapted_tables(result: dict, sudoku_rows: list[dict], pubmedqa_rows: list[dict]) -> None:
    if sudoku_rows:
        result["tables"].append(format_table(sudoku_rows, SUDOKU_COLUMNS,
                                             title="== decode: trained Sudoku model (accuracy next to speed)"))
    if pubmedqa_rows:
        result["tables"].append(format_table(pubmedqa_rows, PUBMEDQA_COLUMNS, title="== decode: adapted PubMedQA "
                                             "model vs its AR fine-tune (quality next to speed)"))


def run(ctx: Context, *, sudoku_run=None, pubmedqa_runs=None, adapted_only: bool = False) -> dict:
    """The decode suite; ``adapted_only`` runs the trained models' rows alone (``--only adapted``)."""
    started = time.perf_counter()
    sz = SIZES[ctx.profile]
    budget = Budget(ctx.budget_s if ctx.budget_s is not None else BUDGET_S[ctx.profile])
    result = new_result("decode", ctx)
    result["settings"]["sizes"] = dict(sz)
    result["settings"]["budget_s"] = budget.seconds
    with torch.no_grad():
        if adapted_only:  # the trained models' rows alone: quality next to speed
            result["settings"]["only"] = "adapted"
            sudoku_rows = _bench_sudoku(ctx, result, budget, sz, run=sudoku_run)
            pubmedqa_rows = _bench_pubmedqa(ctx, result, budget, sz, runs=pubmedqa_runs)
            result["rows"] = sudoku_rows + pubmedqa_rows
            _adapted_tables(result, sudoku_rows, pubmedqa_rows)
            return finish(result, ctx, started)
        lm = LMDecode(ctx, result, budget, sz)
        lm.first_part()
        lm.profile_diffusion()
        lm.profile_ar_vs_hf()
        sudoku_rows = _bench_sudoku(ctx, result, budget, sz, run=sudoku_run)  # cheap, and carries accuracy
        pubmedqa_rows = _bench_pubmedqa(ctx, result, budget, sz, runs=pubmedqa_runs)
        lm.big_batch()
        lm.profile_ar_vs_hf()
        lm.step_sweep()
        lm.early_stop()
        lm.refresh(force=True)  # one more baseline timing after the grid
        lm.rest()
        lm.ratios()
    result["rows"] = lm.rows + sudoku_rows + pubmedqa_rows
    kind_order = {"ar": 0, "hf_generate": 1, "diffusion": 2, "diffusion_nocache": 3}
    lm_sorted = sorted(lm.rows, key=lambda r: (r["batch"], kind_order[r["kind"]], STEP_TYPES.index(r["step"])
                                               if r.get("step") else -1, bool(r.get("early_stop")), r.get("steps") or 0))
    result["tables"].append(format_table(
        lm_sorted, COLUMNS, title=f"== decode: {lm.label} (prompt {sz['prompt_len']}, canvas {sz['canvas']}, "
                                  f"{result['settings']['lm']['dtype']})"))
    _adapted_tables(result, sudoku_rows, pubmedqa_rows)
    for name, prof in result["profiles"].items():
        top = ", ".join(f"{o['name']} {o['share']:.0%}" for o in prof["top_ops"][:6])
        result["notes"].append(f"profile {name}: {prof.get('row', '')}: top ops {top}; ops over the vocabulary "
                               f"dimension: {prof.get('vocab_ops_share', 0):.0%} of self time")
    return finish(result, ctx, started)
