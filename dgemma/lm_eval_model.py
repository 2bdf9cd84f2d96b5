"""The ``dgemma`` model of EleutherAI's lm-evaluation-harness (``pip install "dgemma[lm_eval]"``).

Importing this module registers the model with the harness's registry
(``lm_eval.api.registry.register_model``). lm-eval 0.4.13 resolves ``--model`` against the models
registered in its own process and discovers no third-party package (no entry point, no plugin
path), so dgemma's install adds ``dgemma-lm-eval.pth``, whose start-up hook
(``_dgemma_lm_eval_hook.py``) registers this class lazily once lm-eval loads its models; lm-eval's
own command line then finds it::

    lm_eval --model dgemma --model_args run=checkpoints/sudoku_wide,steps=81 \\
        --tasks my_task --include_path my_tasks/ --device cpu --batch_size 16

``dgemma lm-eval ARGS`` (``dgemma/cli/lm_eval.py``) is the same command line run after this
import, for installs without the hook. From Python: ``lm_eval.simple_evaluate(model="dgemma",
...)`` (the hook), or ``import dgemma.lm_eval_model`` first.

``--model_args`` (comma-separated ``key=value``):

- the model, one of ``run=DIR`` (a training workdir, :func:`dgemma.training.runs.load_run`;
  ``step=S`` picks a checkpoint) or ``pretrained=SRC`` (:func:`dgemma.load_pretrained`:
  ``gemma3-270m``, a Gemma 3 folder or ``.gguf``; uniform noise, ``canvas_size`` default 32);
- sampling: ``steps``, ``step_type``, ``temperature``, ``threshold`` (confidence step),
  ``early_stopping``, ``canvases`` (the most a request may use), ``seed`` (default 0); a run's
  ``eval_ds`` section supplies the defaults;
- ``batch_size`` (wins over ``--batch_size``), ``dtype`` (``float32 | bfloat16 | auto``),
  ``mc_samples`` (default 16), ``pin_clues`` (Sudoku runs trained with pinned clues: default
  on, when a prompt is a puzzle).

``generate_until`` runs :class:`~dgemma.diffusion.sampler.CanvasSampler` on batches of
requests. Request ``i`` draws from its own generator seeded by ``(seed, i)``
(:class:`~dgemma.diffusion.wrappers.RowSeeded`), so its output does not depend on the batch
size or on its batch-mates. Each request samples ``ceil(max_gen_toks / canvas_size)`` canvases
(at most ``canvases``, and what the positions leave), cut at ``max_gen_toks`` tokens, at a stop
token, and before the first ``until`` string. Its ``temperature`` (``do_sample: false`` means
0) and ``top_p`` override the model's; ``top_k`` is refused.

``loglikelihood`` and ``loglikelihood_rolling`` are **Monte-Carlo estimates of the diffusion
ELBO**, not exact log-likelihoods, as in LLaDA's and Dream's harness models: a diffusion model
has no left-to-right factorisation to sum. For each request, ``mc_samples`` times ``t`` is drawn
stratified over ``[t_eps, 1 - t_eps]`` (one draw per equal stratum), the continuation's canvases
are corrupted at ``t`` and decoded against the clean context and earlier canvases (block
diffusion), and the continuous-time integrand of :mod:`dgemma.eval.lite` is evaluated: absorbing
noise ``-alpha'(t) / (1 - alpha(t)) * sum_masked -log p(x0 | x_t)`` (MDLM), uniform noise
``beta(t) / V * sum_j f(r_j, rhat_j)`` (the ``mixture`` rate bound). Their mean times the interval
is the negative ELBO, so the reported log-likelihood is a noisy lower bound, seeded by ``(seed,
request index)``: repeatable, and independent of the batch. Choices of a multiple-choice
question are compared through it, noise included (raise ``mc_samples`` to shrink it). The
``is_greedy`` flag is a proxy: whether every continuation token is the argmax from a fully
noised canvas. A warning says all this when the model is built.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from dgemma.data.sft import pin_rows
from dgemma.data.sudoku import parse_puzzle
from dgemma.device import resolve_dtype
from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.objective import batch_info
from dgemma.diffusion.schedules import get_schedule
from dgemma.diffusion.shift import before_indices, shift_to_canvas
from dgemma.diffusion.stopping import argmax_ids
from dgemma.errors import DGemmaError
from dgemma.eval.lite import alpha_and_derivative, uniform_rate_terms
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.pretrained import load_pretrained
from dgemma.models.selfcond import expected_embedding
from dgemma.sampling import SamplerConfig, build_rules, build_sampler, eval_settings, interactive_cfg, max_canvases
from dgemma.tasks.sudoku import puzzle_hint
from dgemma.training.runs import load_run
from dgemma.training.trainer import derive_seed

log = logging.getLogger(__name__)

ELBO_NOTE = ("dgemma: loglikelihood and loglikelihood_rolling are Monte-Carlo estimates of the diffusion ELBO (a "
             "lower bound on log p, mc_samples={mc} draws of t per request, seeded by (seed, request index)), not "
             "exact log-likelihoods; multiple-choice scores carry that noise")
GEN_KEYS = {"until", "max_gen_toks", "temperature", "do_sample", "top_p", "top_k"}


def _seeded(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


@register_model("dgemma")
class DGemmaLM(TemplateLM):
    """A dgemma model (a training run or a pretrained source) as an lm-eval ``LM`` (module docstring)."""

    def __init__(self, run: str | None = None, pretrained: str | None = None, *, step: int | None = None,
                 steps: int | None = None, step_type: str | None = None, temperature: float | None = None,
                 threshold: float | None = None, early_stopping: str | None = None, canvases: int | None = None,
                 canvas_size: int = 32, seed: int = 0, mc_samples: int = 16, batch_size: int | str = 1,
                 max_batch_size: int | None = None, dtype: str = "float32", device: str | None = None,
                 pin_clues: bool | None = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise DGemmaError(f"unknown dgemma model_args {sorted(unknown)}; accepted: run, pretrained, step, steps, "
                              "step_type, temperature, threshold, early_stopping, canvases, canvas_size, seed, "
                              "mc_samples, batch_size, dtype, pin_clues")
        if (run is None) == (pretrained is None):
            raise DGemmaError("give the model as exactly one of run=DIR (a training workdir) or pretrained=SRC "
                              "(gemma3-270m, a Gemma 3 folder or a .gguf)")
        if isinstance(batch_size, str) and not batch_size.isdigit():
            raise DGemmaError(f"batch_size must be a whole number, got {batch_size!r} (auto is not supported)")
        self.batch = int(batch_size)
        if self.batch < 1 or int(mc_samples) < 1:
            raise DGemmaError(f"batch_size and mc_samples must be >= 1, got {batch_size} and {mc_samples}")
        self.device_ = self._pick_device(device)
        self.seed, self.mc_samples = int(seed), int(mc_samples)
        self.source = run or pretrained
        self.cfg = None
        if run is not None:
            r = load_run(run, step=step, device=self.device_, dtype=dtype)
            self.cfg, self.model, self.tok, self.noise = interactive_cfg(r.cfg), r.model, r.tokenizer, r.noise()
            e, d = self.cfg.eval_ds, r.cfg.diffusion
            self.canvas_size, default_canvases, self.t_eps = d.canvas_size, max_canvases(r.cfg), d.t_eps
            defaults = {"steps": e.steps[0], "step_type": e.step_type, "temperature": e.temperature,
                        "early_stopping": None if e.early_stopping in (None, "none") else e.early_stopping}
            self.entropy_threshold = e.entropy_threshold
            self.logit_bias = None  # the run's eval_ds.logit_bias, resolved once in run_settings (generation only)
            self.pin_clues = bool(r.cfg.data.pin_clues) if pin_clues is None else bool(pin_clues)
            if self.pin_clues and r.cfg.data.task != "sudoku":
                raise DGemmaError(f"pin_clues is for Sudoku runs; this run's task is {r.cfg.data.task!r}")
        else:
            model, self.tok = load_pretrained(pretrained)
            if self.tok is None:
                raise DGemmaError(f"{pretrained} has no tokenizer.json: the harness needs one")
            self.model = model.to(device=self.device_, dtype=resolve_dtype(dtype, self.device_)).eval()
            self.noise = UniformNoise(model.config.vocab_size, get_schedule("linear"))
            self.canvas_size, default_canvases, self.t_eps = int(canvas_size), 4, 1e-3
            defaults = {"steps": 32, "step_type": "confidence", "temperature": 0.0, "early_stopping": None}
            self.entropy_threshold = 0.05
            self.logit_bias = {}
            self.pin_clues = bool(pin_clues)
            if self.pin_clues:
                raise DGemmaError("pin_clues is for Sudoku runs (run=DIR), not a pretrained model")
        self.steps = int(steps or defaults["steps"])
        self.step_type = step_type or defaults["step_type"]
        self.temperature = float(defaults["temperature"] if temperature is None else temperature)
        self.threshold = threshold
        self.early_stopping = defaults["early_stopping"] if early_stopping is None else \
            (None if early_stopping == "none" else early_stopping)  # "none" overrides a run's rule
        self.canvases = int(canvases or default_canvases)
        self.positions = self.model.config.max_position_embeddings
        if self.canvases < 1 or self.steps < 1:
            raise DGemmaError(f"canvases and steps must be >= 1, got {self.canvases} and {self.steps}")
        # a run's own decoding settings (eval_ds), under the model args and each request's
        self.run_settings = None if self.cfg is None else eval_settings(
            self.cfg, num_steps=self.steps, step_type=self.step_type, temperature=self.temperature,
            early_stopping=self.early_stopping, tokenizer=self.tok)
        build_rules(self._settings_for(self.temperature, 1.0, 1), self.noise)  # bad settings fail here, not mid-run
        self._warned: set[str] = set()
        log.warning(ELBO_NOTE.format(mc=self.mc_samples))

    # lm-eval's model_args batch_size would clash with the harness's own --batch_size (always passed)
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @staticmethod
    def _pick_device(device: str | None) -> torch.device:
        if device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("dgemma: %s is not available here; running on the CPU (pass --device cpu to say so)", device)
            return torch.device("cpu")
        return torch.device(device)

    # ------------------------------------------------------------------ what lm-eval asks of an LM
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id

    @property
    def max_length(self) -> int:
        return self.positions

    @property
    def max_gen_toks(self) -> int:
        return self.canvases * self.canvas_size

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def device(self) -> torch.device:
        return self.device_

    @property
    def tokenizer_name(self) -> str:
        return f"dgemma-{self.source}"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = (self.tok.eos_id, getattr(self.tok, "end_of_turn_id", None))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_bos=add_special_tokens is not False)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if not hasattr(self.tok, "render_chat"):
            raise DGemmaError("this model's tokenizer has no chat template: drop --apply_chat_template")
        return self.tok.render_chat(chat_history, add_generation_prompt=add_generation_prompt)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # ------------------------------------------------------------------ generation
    def _settings_for(self, temperature: float, top_p: float, canvases: int):
        """The sampler settings of one request: a run's own (``eval_ds``: commit blocks and ranking,
        stop aliases and gate, the self-conditioning switch ...) under the model args and the request."""
        ask = SamplerConfig(num_steps=self.steps, step_type=self.step_type, temperature=temperature,
                            early_stopping=self.early_stopping or "none", entropy_threshold=self.entropy_threshold,
                            max_canvases=canvases, top_p=top_p, logit_bias=self.logit_bias,
                            confidence_threshold=None if self.threshold is None else float(self.threshold))
        return ask if self.run_settings is None else ask.merged(self.run_settings)

    def _settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int, float, float]:
        """``(until, max_gen_toks, temperature, top_p)`` of one request's generation kwargs."""
        gen_kwargs = dict(gen_kwargs or {})
        for key in sorted(set(gen_kwargs) - GEN_KEYS):
            self._warn_once(key, f"dgemma: generation kwarg {key!r} has no diffusion counterpart and is ignored")
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_toks = int(gen_kwargs.get("max_gen_toks") or self.max_gen_toks)
        temperature = float(gen_kwargs.get("temperature", self.temperature))
        if gen_kwargs.get("do_sample") is False:
            temperature = 0.0
        top_p = float(gen_kwargs.get("top_p") or 1.0)
        if gen_kwargs.get("top_k"):
            raise DGemmaError(f"top_k={gen_kwargs['top_k']} is not supported by the diffusion steps; drop it "
                              "(top_p is)")
        if max_toks < 1:
            raise DGemmaError(f"max_gen_toks must be >= 1, got {max_toks}")
        return until, max_toks, temperature, top_p

    def _hints(self, contexts: list[str], width: int) -> torch.Tensor | None:
        if not self.pin_clues:
            return None

        rows = []
        for text in contexts:
            try:
                pins = puzzle_hint(parse_puzzle(text), self.tok)
            except DGemmaError:
                pins = []  # not a puzzle: nothing pinned
            rows.append(pins)
        return pin_rows(rows, width, self.device_)

    def _pad(self, rows: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        width = width or max(map(len, rows))
        ids = torch.full((len(rows), width), self.tok.pad_id or 0, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            valid[i, :len(r)] = True
        return ids.to(self.device_), valid.to(self.device_)

    def _fit(self, ids: list[int], room: int) -> list[int]:
        """Left-truncate a prompt to ``room`` tokens, keeping its BOS first."""
        if len(ids) <= room:
            return ids
        bos = ids[:1] if ids and ids[0] == self.tok.bos_id else []
        return bos + ids[len(ids) - room + len(bos):]

    @torch.no_grad()
    def generate_batch(self, contexts: list[str], indices: list[int], *, max_toks: int, temperature: float,
                       top_p: float = 1.0) -> list[list[int]]:
        """Sampled tokens for each context, row ``j`` seeded by ``(seed, indices[j])``, cut at
        ``max_toks`` (and after a stop token). The batch is sampled in one sampler call."""
        c = self.canvas_size
        canvases = min(math.ceil(max_toks / c), self.canvases)
        canvases = min(canvases, (self.positions - 1) // c)
        if canvases < 1:
            raise DGemmaError(f"the model's {self.positions} positions leave no room for a canvas of {c}")
        if canvases * c < max_toks:
            self._warn_once("canvases", f"dgemma: max_gen_toks={max_toks} is more than {canvases} canvases of {c} "
                                        f"(canvases={self.canvases}, {self.positions} positions); generating "
                                        f"{canvases * c} tokens")
        room = self.positions - canvases * c
        prompts = [self._fit(self.tok_encode(text), room) for text in contexts]
        pad_to = None
        if self.model.config.attn_implementation == "flex" and self.cfg is not None:
            pad_to = max(self.cfg.data.prompt_len, max(map(len, prompts)))  # flex kernels compile for one shape
        ids, valid = self._pad(prompts, pad_to)
        sampler = build_sampler(self._settings_for(temperature, top_p, canvases), noise=self.noise, canvas_size=c,
                                stop_ids=self.stop_ids, generators=[_seeded(self.seed, i) for i in indices])
        hints = self._hints(contexts, canvases * c)
        extra = {} if hints is None else {"hints": hints}
        res = sampler(self.model, ids, valid, generator=torch.Generator(), **extra)  # RowSeeded: never drawn from
        return [t[:max_toks] for t in res.tokens]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            s = self._settings(gen_kwargs)
            settings.append(s)
            groups.setdefault(s[1:], []).append(i)
        out: list[str | None] = [None] * len(requests)
        for (max_toks, temperature, top_p), members in groups.items():
            members.sort(key=lambda i: -len(requests[i].args[0]))  # alike lengths share a batch (less padding)
            for b in range(0, len(members), self.batch):
                idx = members[b:b + self.batch]
                toks = self.generate_batch([requests[i].args[0] for i in idx], idx, max_toks=max_toks,
                                           temperature=temperature, top_p=top_p)
                for i, t in zip(idx, toks):
                    text = self.tok.decode(t)
                    cuts = [k for s in settings[i][0] if s and (k := text.find(s)) >= 0]
                    out[i] = text[:min(cuts)] if cuts else text
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    # ------------------------------------------------------------------ likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        items = [(ctx, cont, (self.seed, i)) for i, (_, ctx, cont) in enumerate(requests)]
        out = self.elbo(items)
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        span = (self.positions - 1) // self.canvas_size * self.canvas_size  # one context token + whole canvases
        items, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0], add_special_tokens=False)
            windows = get_rolling_token_windows(tokens, prefix_token=self.prefix_token_id, max_seq_len=span,
                                                context_len=1)
            for w, (ctx, cont) in enumerate(map(make_disjoint_window, windows)):
                items.append((ctx, cont, (self.seed, i, w)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self.elbo(items)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def elbo(self, items: list[tuple[list[int], list[int], tuple[int, ...]]]) -> list[tuple[float, bool]]:
        """``(ELBO estimate, is_greedy)`` of each ``(context ids, continuation ids, seed parts)``,
        in batches of ``batch_size`` (the module docstring says what is estimated)."""
        out: list[tuple[float, bool] | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: -(len(items[i][0]) + len(items[i][1])))
        for b in range(0, len(order), self.batch):
            idx = order[b:b + self.batch]
            for i, res in zip(idx, self._elbo_batch([items[i] for i in idx])):
                out[i] = res
        return out

    @torch.no_grad()
    def _elbo_batch(self, items) -> list[tuple[float, bool]]:
        c, dev, noise, model = self.canvas_size, self.device_, self.noise, self.model
        contexts, conts = [], []
        for ctx, cont, _ in items:
            if not cont:
                raise DGemmaError("an empty continuation has no likelihood to estimate")
            width = math.ceil(len(cont) / c) * c
            if width >= self.positions:
                raise DGemmaError(f"a continuation of {len(cont)} tokens does not fit the model's {self.positions} "
                                  f"positions in canvases of {c}")
            contexts.append(self._fit(ctx, self.positions - width))
            conts.append(cont)
        prompt_ids, prompt_valid = self._pad(contexts)
        n_canvas = max(math.ceil(len(x) / c) for x in conts)
        x0, valid = self._pad(conts, n_canvas * c)
        hints = self._hints([self.tok.decode(ctx) for ctx in contexts], n_canvas * c)
        free = valid if hints is None else valid & (hints < 0)  # pinned clues are given, as in training: not scored
        batch = {"prompt_ids": prompt_ids, "prompt_valid": prompt_valid, "canvas_ids": x0, "canvas_valid": valid}
        info = batch_info(batch, c)
        # a row with fewer canvases than its batch-mates pads the rest; padding is never attended
        # to, and position 0 keeps it inside the rotary table however long the others are
        info = TokenInfo(torch.where(info.valid, info.positions, 0), info.blocks, info.noisy, info.valid)
        p = prompt_ids.shape[1]
        keep = p + (n_canvas - 1) * c  # the clean context and every canvas but the last: one prefill for all draws
        ids = torch.cat([prompt_ids, x0], 1)
        cache = KVCache(len(items), ids.shape[1])
        enc = model(ids[:, :keep], info=info[:, :keep], cache=cache, return_hidden=True)
        align = None
        if model.config.shift_logits:  # each canvas's first token is predicted by the state before it
            at = before_indices(prompt_valid, torch.arange(n_canvas, device=dev).expand(len(items), -1), c)
            before = enc.gather(1, at[..., None].expand(-1, -1, enc.shape[-1]))

            def align(h):
                return shift_to_canvas(h, before, c)
        canvas = info[:, p:]
        noisy = TokenInfo(canvas.positions, canvas.blocks, torch.ones_like(canvas.valid), canvas.valid)
        gens = [_seeded(*parts) for _, _, parts in items]
        rows = free.nonzero()[:, 0].cpu()  # the row of each scored position
        chunk = max(1, (1 << 24) // model.config.vocab_size)
        lo, span = self.t_eps, 1.0 - 2 * self.t_eps
        nelbo = torch.zeros(len(items), dtype=torch.float64)
        for m in range(self.mc_samples):
            t = torch.stack([lo + span * (m + torch.rand((), generator=g, dtype=torch.float64)) / self.mc_samples
                             for g in gens])
            xt = torch.cat([noise.q_sample(x0[j:j + 1].cpu(), t[j:j + 1], generator=g, where=free[j:j + 1].cpu())
                            for j, g in enumerate(gens)]).to(dev)
            a, da = alpha_and_derivative(noise.schedule, t)
            if isinstance(noise, AbsorbingNoise):
                weight = -da / (1.0 - a)  # MDLM: -alpha' / (1 - alpha) on the masked positions
            elif isinstance(noise, UniformNoise):
                weight = -da / a / noise.vocab_size  # beta / V on the rate terms
            else:
                raise DGemmaError(f"no ELBO for noise process {type(noise).__name__}")
            h = self._hidden(xt, noisy, cache, t.to(dev, torch.float32), align)[free]
            x0v, xtv = x0[free], xt[free]
            for s in range(0, h.shape[0], chunk):
                sl = slice(s, s + chunk)
                logits = model.logits(h[sl]).to(torch.float64)
                r = rows[sl]
                if isinstance(noise, AbsorbingNoise):
                    logits[:, noise.mask_token_id] = float("-inf")
                    ce = -torch.log_softmax(logits, -1).gather(1, x0v[sl, None]).squeeze(1).cpu()
                    term = torch.where(xtv[sl].cpu() == noise.mask_token_id, ce, torch.zeros_like(ce))
                else:
                    term = uniform_rate_terms(logits, x0v[sl], xtv[sl], a[r].to(logits.device), noise.vocab_size,
                                              "mixture").cpu()
                nelbo.index_add_(0, r, term * weight[r])
        nelbo *= span / self.mc_samples
        # is_greedy (a proxy): the argmax from fully noised canvases is the continuation
        xt = torch.cat([torch.where(free[j:j + 1].cpu(), noise.noise_like((1, x0.shape[1]), generator=g, device="cpu"),
                                    x0[j:j + 1].cpu()) for j, g in enumerate(gens)]).to(dev)
        h = self._hidden(xt, noisy, cache, torch.ones(len(items), device=dev))
        logits = model.logits(h)
        if isinstance(noise, AbsorbingNoise):
            logits[..., noise.mask_token_id] = float("-inf")
        greedy = ((argmax_ids(logits) == x0) | ~free).all(-1).tolist()
        return [(-float(v), bool(g)) for v, g in zip(nelbo.tolist(), greedy)]

    def _hidden(self, xt, noisy, cache, t, align=None):
        """Final hidden states of the noisy canvases against the cached clean prefix, with the
        two-pass self-conditioning of sampling when the model has it (as ``dgemma/eval/lite.py``);
        ``align`` maps them to the states predicting each position (``shift_logits``)."""
        model = self.model
        align = align or (lambda h: h)
        h = align(model(xt, info=noisy, cache=cache, t=t, return_hidden=True))
        if model.self_conditioning is not None:
            signal = expected_embedding(h.reshape(-1, h.shape[-1]), model.lm_head.weight,
                                        softcap=model.config.final_logit_softcapping)
            h = align(model(xt, info=noisy, cache=cache, t=t, selfcond=signal.view_as(h), return_hidden=True))
        return h

