"""Evaluation of a pretrained Lite model (``dgemma eval --task=lm``): held-out loss, a likelihood
bound, and generation speed against an AR baseline of the same size.

Three measurements, all on the ``val`` split of the run's prepared corpus (``dgemma prepare
corpus``), each window cut into canvases exactly as in training:

1. **Validation loss** (:func:`validation_loss`): the training objective itself (unweighted
   x0 cross-entropy over every canvas position, docs/design.md §2, self-conditioning drawn as in training)
   on a fixed, seeded set of windows and ``t`` draws, so two checkpoints compare on the same
   numbers. For an AR model (``diffusion.diffusion_loss_weight=0``) it is the exact next-token
   NLL, and ``exp`` of it the exact perplexity.

2. **A bound on the perplexity** (:func:`nelbo_bound`). The unweighted loss is not a likelihood.
   The continuous-time negative ELBO is: with ``alpha(t)`` the schedule (``alpha(0) = 1``,
   ``alpha(1) = 0``), per sequence, in nats,

   - absorbing (masked) noise, MDLM (Sahoo et al. 2024, "Simple and Effective Masked Diffusion
     Language Models", eq. 10)::

         NELBO = int_0^1  -alpha'(t) / (1 - alpha(t)) * E_{x_t}[ sum_{l masked} -log p(x0_l | x_t) ] dt

     which, in the masked share ``u = 1 - alpha``, is ``int_0^1 E[CE on masked | u] / u du``:
     it does not depend on the schedule. A model that predicts uniformly over the ``K`` real
     tokens scores exactly ``log K`` per token, for any schedule (a test pins it).

   - uniform-state noise (``N`` = vocabulary size). The forward process is the CTMC with rates
     ``beta(t) / N`` between any two tokens, ``beta = -alpha' / alpha``; the reverse process has
     rates ``R(i -> j) = beta / N * r_j`` and the NELBO is the path KL (Campbell et al. 2022,
     "A Continuous Time Framework for Discrete Denoising Models", Prop. 3)::

         NELBO = int_0^1 beta(t) / N * E_{x_t}[ sum_l sum_{j != x_t,l} f(r_j, rhat_j) ] dt,
         f(r, rhat) = rhat - r + r log(r / rhat)   (>= 0, = 0 iff rhat = r)

     with the true ratio ``r_j = xbar_j / xbar_i`` (``xbar = N alpha onehot(x0) + (1 - alpha)``,
     ``i = x_t``) and the model's ``rhat_j`` from ``p = p_theta(x0 | x_t)`` in one of two
     parameterisations:

     * ``mixture`` (the primary figure): ``rhat_j = sum_k p_k xbar_j(k) / xbar_i(k)``, i.e. the
       reverse kernel ``sum_k p_k q(x_s | x_t, x0 = k)`` our ``ddim`` step samples at temperature
       1 (D3PM's x0-parameterisation, Austin et al. 2021). A model trained on x0 cross-entropy
       estimates the posterior ``p(x0 | x_t)``, and with the exact posterior this reverse process
       *is* the true one: the bound is tight (a test checks it converges to the entropy of a known
       distribution).
     * ``udlm``: ``rhat_j = xbar_theta_j / xbar_theta_i`` with ``xbar_theta = N alpha p + (1 - alpha)``,
       the reverse kernel ``q(x_s | x_t, x0 = p)`` of UDLM (Schiff et al. 2024, "Simple Guidance
       Mechanisms for Discrete Diffusion", the continuous-time ELBO of §3), which trains on this
       bound directly. Reported for comparison with published uniform-noise numbers; for a model
       trained on cross-entropy it is looser.

   The integral runs over a quadrature grid of ``points`` cells of ``[0, 1]``, one ``x_t`` draw
   per window and cell at the cell's midpoint ``t_m`` (seeded): the absorbing integrand is
   weighted by the cell's exact mass ``alpha(t_lo) - alpha(t_hi)`` (so the ``log K`` case is
   exact on any grid); the uniform one by ``dt * beta(t_m)`` (``alpha'`` by autograd, any
   schedule). Every canvas is scored against its clean prefix, as in block diffusion (BD3-LM,
   Arriola et al. 2025): the sequence bound is the sum of the canvases' bounds. The result, per
   token, is reported in nats and bits, with ``exp(NELBO / token)`` an upper bound on the
   perplexity of the continuous-time reverse process up to Monte Carlo and quadrature error (it
   is not the perplexity of the ``commit`` sampler, which has none).

3. **Generation** (:func:`generation_speed`): unconditional samples (a one-token EOS prompt:
   the corpus separates documents with EOS) of ``canvases`` canvases, no stop tokens, so every
   setting emits the same number of tokens. Fixed step counts with Lite's ``commit`` step, whose
   tokens per forward (the prefill counted; each append rides on the next canvas's first pass,
   docs/design.md §4) is exactly ``M C / (1 + M T)``, just under ``C / T``; and adaptive
   stopping (``entropy``, ``stable_confident``) up to ``adaptive_steps``. Wall-clock tokens/s against ``ar_generate``
   (KV cache, greedy) of the AR baseline run given as ``ar_run`` (same backbone, trained the same
   way: configs/lite_debug_ar.py, configs/lite_343m_ar.py), or of the same weights when none is
   given (speed only). Tokens per forward is a property of the step schedule, not of the model:
   on a tiny model it says nothing about quality, and wall-clock speed-ups on a CPU are not those
   of a GPU.

Files: ``<workdir>/eval/lm/step_<S>.json`` holding every number and setting.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dgemma.data.windows import CorpusData
from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.objective import batch_info
from dgemma.diffusion.sampler import ar_generate
from dgemma.diffusion.steps import CommitStep
from dgemma.errors import DGemmaError
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.selfcond import expected_embedding
from dgemma.sampling import SamplerConfig, build_sampler
from dgemma.training.trainer import build_objective, derive_seed

EVAL_NAME = "lm"
GEN_STEPS = (8, 16, 32, 64)
ADAPTIVE = ("entropy", "stable_confident")
TINY_MODEL_NOTE = ("tokens/forward is set by the step schedule, not the model: with T fixed steps it is "
                   "about canvas/T (C tokens per T denoising passes, plus one prefill), so on a tiny or "
                   "untrained model it says nothing about quality, and CPU wall-clock ratios are not GPU ones")


# ------------------------------------------------------------------------------------- the bound
def alpha_and_derivative(schedule, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(alpha(t), alpha'(t))`` in fp64 for any schedule (the derivative by autograd)."""
    t = t.detach().to(torch.float64).clone().requires_grad_(True)
    with torch.enable_grad():
        a = schedule.alpha(t)
        (da,) = torch.autograd.grad(a.sum(), t)
    return a.detach(), da.detach()


def elbo_grid(points: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(t_lo, t_mid, t_hi)``, fp64 ``[points]``: ``points`` equal cells of ``[0, 1]``."""
    if points < 1:
        raise DGemmaError(f"the ELBO grid needs at least 1 point, got {points}")
    edges = torch.linspace(0.0, 1.0, points + 1, dtype=torch.float64)
    return edges[:-1], (edges[:-1] + edges[1:]) / 2, edges[1:]


def uniform_rate_terms(logits: Tensor, x0: Tensor, xt: Tensor, alpha: float | Tensor, vocab_size: int,
                       param: str = "mixture") -> Tensor:
    """Per position ``sum_{j != x_t} f(r_j, rhat_j)`` (fp64 ``[n]``), the uniform-noise NELBO
    integrand without its ``beta / N`` factor (see the module docstring for ``f``, ``r`` and the
    two parameterisations of ``rhat``). ``logits [n, V]`` give ``p_theta(x0 | x_t)``; ``alpha`` is
    a float or ``[n]``."""
    if param not in ("mixture", "udlm"):
        raise DGemmaError(f"unknown parameterisation {param!r}; choose 'mixture' or 'udlm'")
    n_tok = vocab_size
    p = torch.softmax(logits.to(torch.float64), -1)
    a = torch.as_tensor(alpha, dtype=torch.float64, device=p.device).reshape(-1, 1).expand(p.shape[0], 1)
    i = xt[:, None]
    # true ratios: xbar_j / xbar_i with xbar = N a onehot(x0) + (1 - a)
    xbar = (1.0 - a).expand_as(p).clone()
    xbar.scatter_add_(1, x0[:, None], n_tok * a)
    r = xbar / xbar.gather(1, i)
    if param == "udlm":
        xb = n_tok * a * p + (1.0 - a)
        rhat = xb / xb.gather(1, i)
    else:  # sum_k p_k xbar_j(k) / xbar_i(k): k = i gives c, k = j gives 1 / c, any other k gives 1
        c = (1.0 - a) / (n_tok * a + 1.0 - a)
        p_i = p.gather(1, i)
        rhat = p_i * c + p / c + (1.0 - p_i - p)
    f = rhat - r + r * (torch.log(r) - torch.log(rhat))
    return f.scatter(1, i, torch.zeros_like(f[:, :1])).sum(-1)  # the sum runs over j != x_t


def nelbo_cell(logits: Tensor, x0: Tensor, xt: Tensor, noise, t_lo: float, t_hi: float,
               param: str = "mixture") -> Tensor:
    """The NELBO contribution (nats, fp64 ``[n]``) of the time cell ``[t_lo, t_hi]`` for positions
    whose corruption ``xt`` was drawn at the cell's midpoint; summed over cells it estimates the
    integral of the module docstring. ``logits [n, V]`` are the model's at that midpoint."""
    sched = noise.schedule
    t = torch.tensor([t_lo, (t_lo + t_hi) / 2, t_hi], dtype=torch.float64)
    a, da = alpha_and_derivative(sched, t)
    if isinstance(noise, AbsorbingNoise):
        mask = noise.mask_token_id
        logits = logits.to(torch.float64).clone()
        if mask < logits.shape[-1]:
            logits[:, mask] = float("-inf")  # the clean token is never the mask (as in the sampler)
        ce = -torch.log_softmax(logits, -1).gather(1, x0[:, None]).squeeze(1)
        masked = xt == mask
        weight = (a[0] - a[2]) / (1.0 - a[1])  # exact cell mass of -alpha', over the masked share
        return torch.where(masked, weight * ce, torch.zeros_like(ce))
    if isinstance(noise, UniformNoise):
        beta = -da[1] / a[1]
        terms = uniform_rate_terms(logits, x0, xt, a[1], noise.vocab_size, param)
        return (t_hi - t_lo) * beta / noise.vocab_size * terms
    raise DGemmaError(f"no ELBO for noise process {type(noise).__name__}")


# ------------------------------------------------------------------------------------- data
def val_batches(run, *, windows: int, batch_size: int) -> list[dict]:
    """Up to ``windows`` windows of the corpus ``val`` split, evenly spaced over it, batched."""
    cfg = run.cfg
    if cfg.data.task != "corpus" or not cfg.data.path:
        raise DGemmaError(f"the lm evaluation reads a prepared corpus (data.task='corpus' and data.path), this run "
                          f"has data.task={cfg.data.task!r}, data.path={cfg.data.path!r}")
    d = cfg.diffusion
    data = CorpusData(cfg.data.path, cfg.data.prompt_len + d.num_canvases * d.canvas_size, d.canvas_size, split="val")
    n = min(windows, len(data))
    idx = sorted(set(np.linspace(0, len(data) - 1, n).round().astype(int).tolist())) if n else []
    dev = next(run.model.parameters()).device
    return [{k: v.to(dev) for k, v in data.batch(idx[i:i + batch_size]).items()}
            for i in range(0, len(idx), batch_size)]


def _batch_seed(seed: int, *parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *parts))


# ------------------------------------------------------------------------------------- losses
@torch.no_grad()
def validation_loss(run, batches: list[dict], *, seed: int = 0) -> dict:
    """The training objective on ``batches`` with plans seeded by ``(seed, batch)``: mean
    diffusion cross-entropy (nats/token) and, where the run trains it, the AR next-token NLL."""
    obj = build_objective(run.cfg, run.model, run.tokenizer)
    sums = torch.zeros(4, dtype=torch.float64)
    for k, batch in enumerate(batches):
        terms = obj.run(run.model, batch, obj.plan(batch, _batch_seed(seed, k, 0)))
        sums += torch.tensor([float(terms.diffusion_sum), float(terms.diffusion_count), float(terms.ar_sum),
                              float(terms.ar_count)], dtype=torch.float64)
    d_sum, d_n, a_sum, a_n = sums.tolist()
    out = {"windows": sum(b["canvas_ids"].shape[0] for b in batches),
           "diffusion_ce": d_sum / d_n if d_n else None, "diffusion_tokens": int(d_n),
           "ar_nll": a_sum / a_n if a_n else None, "ar_tokens": int(a_n)}
    out["ar_ppl"] = math.exp(out["ar_nll"]) if out["ar_nll"] is not None else None
    out["ar_bits_per_token"] = out["ar_nll"] / math.log(2) if out["ar_nll"] is not None else None
    return out


def _decode_all(model, batch: dict, xt: Tensor, t: Tensor, canvas_size: int, selfcond: bool) -> Tensor:
    """Final hidden states ``[B, N*C, d]`` of every canvas decoded from ``xt`` at time ``t``
    against its clean prefix (the training forward of ``decode="all"``)."""
    if model.config.shift_logits:  # Lite is trained from scratch and never shifted
        raise DGemmaError("the NELBO of dgemma/eval/lite.py does not support shift_logits models")

    p = batch["prompt_ids"].shape[1]
    clean = batch_info(batch, canvas_size)
    ids = torch.cat([batch["prompt_ids"], batch["canvas_ids"]], 1)
    keep = ids.shape[1] - canvas_size  # the last canvas's clean tokens are nobody's context
    cache = None
    if keep > 0:
        cache = KVCache(ids.shape[0], keep)
        model(ids[:, :keep], info=clean[:, :keep], cache=cache, return_hidden=True)
    info = clean[:, p:]
    noisy = TokenInfo(info.positions, info.blocks, torch.ones_like(info.valid), info.valid)
    h = model(xt, info=noisy, cache=cache, t=t, return_hidden=True)
    if selfcond and model.self_conditioning is not None:
        w = model.lm_head.weight
        signal = expected_embedding(h.reshape(-1, h.shape[-1]), w, softcap=model.config.final_logit_softcapping)
        h = model(xt, info=noisy, cache=cache, t=t, selfcond=signal.view_as(h), return_hidden=True)
    return h


@torch.no_grad()
def nelbo_bound(run, batches: list[dict], *, points: int = 16, seed: int = 0, selfcond: bool = True,
                chunk: int = 512) -> dict:
    """The continuous-time NELBO per token (module docstring) over ``batches``, on a grid of
    ``points`` cells, one seeded corruption per window and cell. Self-conditioned on a first pass
    (as at sampling) when ``selfcond`` and the model has it. Returns nats, bits and the perplexity
    bound for each parameterisation (``mixture``, ``udlm``; absorbing noise has one, ``mdlm``),
    and the mean cross-entropy at each grid time."""
    noise, model, c = run.noise(), run.model, run.cfg.diffusion.canvas_size
    params = ("mixture", "udlm") if isinstance(noise, UniformNoise) else ("mdlm",)
    t_lo, t_mid, t_hi = elbo_grid(points)
    totals = {k: 0.0 for k in params}
    ce_at = torch.zeros(points, dtype=torch.float64)
    tokens = 0
    for k, batch in enumerate(batches):
        x0, valid = batch["canvas_ids"], batch["canvas_valid"].bool()
        tokens += int(valid.sum())
        for m in range(points):
            gen = _batch_seed(seed, k, m + 1)
            t = torch.full((x0.shape[0],), float(t_mid[m]), device=x0.device)
            xt = noise.q_sample(x0.cpu(), t.cpu(), generator=gen, where=valid.cpu()).to(x0.device)
            h = _decode_all(model, batch, xt, t, c, selfcond)
            hv, x0v, xtv = h[valid], x0[valid], xt[valid]
            for s in range(0, hv.shape[0], chunk):
                logits = model.logits(hv[s:s + chunk]).to(torch.float64)
                ce_at[m] += F.cross_entropy(logits, x0v[s:s + chunk], reduction="sum").item()
                for name in params:
                    totals[name] += nelbo_cell(logits, x0v[s:s + chunk], xtv[s:s + chunk], noise, float(t_lo[m]),
                                               float(t_hi[m]), "mixture" if name == "mdlm" else name).sum().item()
    out = {"process": run.cfg.diffusion.process, "schedule": run.cfg.diffusion.schedule, "points": points,
           "tokens": tokens, "selfcond": bool(selfcond and model.self_conditioning is not None),
           "ce_at_t": {f"{float(t):.4f}": v / max(tokens, 1) for t, v in zip(t_mid, ce_at.tolist())}}
    for name in params:
        nats = totals[name] / max(tokens, 1)
        out[name] = {"nats_per_token": nats, "bits_per_token": nats / math.log(2),
                     "ppl_bound": math.exp(nats) if nats < 700 else float("inf")}
    out["primary"] = params[0]
    return out


# ------------------------------------------------------------------------------------- generation
def analytic_tokens_per_forward(canvas_size: int, num_steps: int, canvases: int, prompt_len: int = 1,
                                schedule=None, fuse_append: bool = True) -> float:
    """Tokens per forward of a run with no early stop: ``M C`` tokens over one prefill (if there
    is a prompt) and ``M T'`` denoising passes, where ``T'`` is ``T`` or, given the commit step's
    ``schedule``, the pass after which it has committed every position
    (``dgemma/diffusion/steps.py:CommitStep.passes``). The ``M - 1`` appends ride on the next
    canvas's first pass, unless ``fuse_append`` is False (``CanvasSampler.fuse_append``)."""
    passes = num_steps if schedule is None else CommitStep.passes(schedule, num_steps, canvas_size)
    appends = 0 if fuse_append else canvases - 1
    return canvases * canvas_size / ((1 if prompt_len else 0) + canvases * passes + appends)


def _sampler(run, num_steps: int, rule: str | None, canvases: int):
    """Greedy ``commit`` steps, the self-conditioning signal and the stopping entropy at
    ``eval_ds.temperature`` (1 if that is 0), no stop tokens: every row fills all its canvases."""
    cfg = run.cfg
    t = cfg.eval_ds.temperature
    return build_sampler(SamplerConfig(num_steps=num_steps, step_type="commit", temperature=0.0,
                                       signal_temperature=t if t > 0 else 1.0, early_stopping=rule or "none",
                                       entropy_threshold=cfg.eval_ds.entropy_threshold, max_canvases=canvases),
                         noise=run.noise(), canvas_size=cfg.diffusion.canvas_size, stop_ids=())


def _prompt(run, batch: int) -> tuple[Tensor, Tensor]:
    dev = next(run.model.parameters()).device
    eos = getattr(run.tokenizer, "eos_id", run.model.config.eos_token_id)
    return torch.full((batch, 1), eos, dtype=torch.long, device=dev), torch.ones(batch, 1, dtype=torch.bool, device=dev)


@torch.no_grad()
def generation_speed(run, *, steps=GEN_STEPS, adaptive=ADAPTIVE, adaptive_steps: int = 64, canvases: int = 4,
                     batch: int = 4, seed: int = 0, ar_run=None, repeats: int = 1) -> dict:
    """Unconditional generation of ``batch`` rows x ``canvases`` canvases: the ``commit`` sampler at
    each fixed step count and with each adaptive stopping rule (at most ``adaptive_steps``), and
    greedy AR decoding with the KV cache of ``ar_run``'s model (default: the same weights).
    Timings are the fastest of ``repeats`` runs after an untimed warm-up."""
    ids, valid = _prompt(run, batch)
    n_new = canvases * run.cfg.diffusion.canvas_size
    ar_model = (ar_run or run).model
    ar_ids, ar_valid = _prompt(ar_run or run, batch)
    _sampler(run, 2, None, 1)(run.model, ids, valid, generator=torch.Generator().manual_seed(seed))  # warm-up
    ar_generate(ar_model, ar_ids, ar_valid, max_new_tokens=4)

    def fastest(fn):
        runs = [fn() for _ in range(max(repeats, 1))]
        return min(runs, key=lambda r: r.seconds)

    ar = fastest(lambda: ar_generate(ar_model, ar_ids, ar_valid, max_new_tokens=n_new)).stats()
    rows = []
    settings = [(t, None) for t in steps] + [(adaptive_steps, rule) for rule in adaptive]
    for num_steps, rule in settings:
        sampler = _sampler(run, num_steps, rule, canvases)
        res = fastest(lambda: sampler(run.model, ids, valid, generator=torch.Generator().manual_seed(seed)))
        s = res.stats()
        rows.append({"name": f"commit_steps{num_steps}" + (f"_{rule}" if rule else ""), "num_steps": num_steps,
                     "stopping": rule or "none", **s,
                     "analytic_tokens_per_forward": None if rule else analytic_tokens_per_forward(
                         sampler.canvas_size, num_steps, canvases, schedule=sampler.step.schedule),
                     "speedup_vs_ar": s["tokens_per_second"] / ar["tokens_per_second"]})
    return {"prompt": "EOS (unconditional)", "batch": batch, "canvases": canvases, "new_tokens_per_row": n_new,
            "step": "commit", "temperature": run.cfg.eval_ds.temperature, "seed": seed, "repeats": repeats,
            "ar": {"source": str(ar_run.path) if ar_run is not None else "same weights (no AR run given)", **ar},
            "rows": rows, "note": TINY_MODEL_NOTE}


# ------------------------------------------------------------------------------------- all of it
def evaluate_lm(run, *, ar_run=None, windows: int = 64, batch_size: int = 8, points: int = 16, seed: int = 0,
                gen_steps=GEN_STEPS, adaptive=ADAPTIVE, adaptive_steps: int = 64, gen_canvases: int = 4,
                gen_batch: int = 4, repeats: int = 1, out_dir: str | Path | None = None) -> dict:
    """Every measurement of the module on ``run`` (and ``ar_run``), written to
    ``<out_dir or workdir>/eval/lm/step_<S>.json``; returns what the file holds."""
    started = time.perf_counter()
    is_diffusion = bool(run.cfg.diffusion.diffusion_loss_weight)
    batches = val_batches(run, windows=windows, batch_size=batch_size)
    result = {"eval_name": EVAL_NAME, "workdir": str(run.path.parent.parent), "checkpoint_step": run.step,
              "settings": {"windows": windows, "batch_size": batch_size, "points": points, "seed": seed,
                           "data": run.cfg.data.path, "split": "val",
                           "device": str(next(run.model.parameters()).device), "threads": torch.get_num_threads(),
                           "parameters": run.model.num_parameters(), "date": time.strftime("%Y-%m-%d")},
              "validation": validation_loss(run, batches, seed=seed)}
    result["bound"] = nelbo_bound(run, batches, points=points, seed=seed) if is_diffusion else None
    if ar_run is not None:
        ar_batches = val_batches(ar_run, windows=windows, batch_size=batch_size)
        result["ar_baseline"] = {"workdir": str(ar_run.path.parent.parent), "checkpoint_step": ar_run.step,
                                 "parameters": ar_run.model.num_parameters(),
                                 **validation_loss(ar_run, ar_batches, seed=seed)}
    if is_diffusion:
        result["generation"] = generation_speed(run, steps=gen_steps, adaptive=adaptive, adaptive_steps=adaptive_steps,
                                                canvases=gen_canvases, batch=gen_batch, seed=seed, ar_run=ar_run,
                                                repeats=repeats)
    result["seconds"] = time.perf_counter() - started
    out = Path(out_dir if out_dir is not None else run.path.parent.parent) / "eval" / EVAL_NAME
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".step_{run.step}.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / f"step_{run.step}.json")
    return result


def _f(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def lm_table(result: dict) -> str:
    """The printed summary of :func:`evaluate_lm`'s result."""
    v, b = result["validation"], result.get("bound")
    lines = [f"lm eval of {result['workdir']} at step {result['checkpoint_step']} "
             f"({result['settings']['parameters']:,} parameters, {v['windows']} val windows, "
             f"{result['settings']['threads']} threads on {result['settings']['device']})"]
    if v["diffusion_ce"] is not None:
        lines.append(f"  validation diffusion CE (training objective)   {v['diffusion_ce']:.4f} nats/token")
    if v["ar_nll"] is not None:
        lines.append(f"  validation AR NLL                              {v['ar_nll']:.4f} nats/token, ppl {v['ar_ppl']:.2f}")
    if b:
        for name in ("mixture", "udlm", "mdlm"):
            if name in b:
                x = b[name]
                lines.append(f"  NELBO bound ({name:7s}, {b['points']}-cell grid)      {x['nats_per_token']:.4f} nats = "
                             f"{x['bits_per_token']:.4f} bits/token, ppl <= {x['ppl_bound']:.2f}")
    if a := result.get("ar_baseline"):
        lines.append(f"  AR baseline ({a['parameters']:,} parameters, step {a['checkpoint_step']}): NLL "
                     f"{a['ar_nll']:.4f} nats/token, ppl {a['ar_ppl']:.2f}")
    if g := result.get("generation"):
        ar = g["ar"]
        lines += ["", f"generation: {g['batch']} rows x {g['canvases']} canvases ({g['new_tokens_per_row']} tokens/row), "
                      f"{g['step']} step, AR = {ar['source']}: {ar['tokens_per_second']:.1f} tok/s, "
                      f"{ar['tokens_per_forward']:.3f} tok/fwd"]
        cols = ["sampler", "steps/canvas", "tok/fwd", "analytic", "tok/s", "x AR"]
        rows = [[r["name"], _f(r["mean_steps_per_canvas"]), _f(r["tokens_per_forward"]),
                 _f(r["analytic_tokens_per_forward"]), _f(r["tokens_per_second"]), _f(r["speedup_vs_ar"])]
                for r in g["rows"]]
        cells = [cols] + rows
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        fmt = [("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
               for row in cells]
        lines += [fmt[0], "-" * len(fmt[0]), *fmt[1:], f"note: {g['note']}"]
    return "\n".join(lines)
