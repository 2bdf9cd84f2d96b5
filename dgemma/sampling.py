"""Sample text from a model in three lines: the public Python API.

    import dgemma
    model = dgemma.load_model("checkpoints/pubmedqa_270m")        # a run, or pretrained=True
    out = model.generate(["Context: ...\\n\\nQuestion: ..."], dgemma.SamplerConfig(num_steps=16))
    print(out[0].text, out[0].tokens, out[0].seconds)

:class:`SamplerConfig` is every setting of the canvas sampler, typed; a field left ``None``
takes the model's default (a run's ``eval_ds``). :func:`build_sampler` is the one place a
:class:`~dgemma.diffusion.sampler.CanvasSampler` is assembled from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dgemma.data.sft import encode_prompts
from dgemma.device import default_device, resolve_dtype
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.sampler import CanvasSampler, check_logit_bias
from dgemma.diffusion.schedules import get_schedule
from dgemma.diffusion.steps import STEPS
from dgemma.diffusion.stopping import STOPPING
from dgemma.diffusion.wrappers import RowSeeded, TopPStep
from dgemma.errors import DGemmaError
from dgemma.models.pretrained import load_pretrained
from dgemma.tasks import response_stop_ids
from dgemma.training.runs import load_run


@dataclass(kw_only=True)
class SamplerConfig:
    num_steps: int | None = None  # denoising steps per canvas
    step_type: str | None = None  # ddim | commit | confidence | entropy_bound
    temperature: float | None = None  # the step's; 0 = greedy (commit / confidence)
    signal_temperature: float | None = None  # self-conditioning signal and stopping entropy (None: T, or 1 if greedy)
    early_stopping: str | None = None  # none | entropy | stable_confident
    entropy_threshold: float | None = None  # for early_stopping="entropy"
    max_canvases: int | None = None
    min_stop_prob: float | None = None  # a stop token only where its probability reaches this (0 = argmax)
    # each rule reads its own settings (dgemma/diffusion/steps.py:StepRule.from_settings)
    confidence_threshold: float | None = None  # confidence step: commit where p > this (default 0.9)
    commit_block: int | None = None  # commit step: semi-autoregressive sub-blocks of this many positions
    commit_order: str | None = None  # commit step: rank positions by confidence or margin (default confidence)
    commit_stable_first: bool | None = None  # commit step: positions whose confidence rose rank first (default True)
    commit_no_repeat: bool | None = None  # commit step: no token equal to a neighbour's (default False)
    entropy_bound: float | None = None  # entropy_bound step: the bound on the accepted entropies (default 0.1)
    entropy_t_max: float | None = None  # entropy_bound step: its temperature at t = 1 (default 0.8)
    entropy_t_min: float | None = None  # entropy_bound step: its temperature as t -> 0 (default 0.4)
    stability_threshold: int | None = None  # stable_confident stopping: unchanged steps (default 1)
    stop_confidence_threshold: float | None = None  # stable_confident stopping: entropy bound (default 0.005)
    top_p: float | None = None  # nucleus filtering of the step's distribution (1 = off)
    stop_alias_cos: float | None = None  # stop tokens absorb the tokens this close to their embedding
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit at every step ({} = none)
    self_condition: bool | None = None  # feed the last prediction back (default True; False: a zero signal)
    fuse_append: bool | None = None  # append a canvas in the next one's first pass (default True; same numbers)
    reuse_canvas_keys: bool | None = None  # approximate: partial passes over a canvas (default False)
    shortlist: int | None = None  # approximate: later passes score each position's top-K of the first (default 0: off)
    prefix: tuple[int, ...] | None = None  # response tokens pinned at the start of every answer (() = none)

    def merged(self, defaults: "SamplerConfig") -> "SamplerConfig":
        """This config with every ``None`` field taken from ``defaults``."""
        return replace(defaults, **{k: v for k, v in asdict(self).items() if v is not None})

    def resolved(self) -> "SamplerConfig":
        """Every rule setting still ``None`` at its rule's default (``commit_block`` stays None: no blocks)."""
        return self.merged(RULE_DEFAULTS)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.step_type} x {self.num_steps} steps, T={self.temperature}, "
                f"early stopping {self.early_stopping}, <= {self.max_canvases} canvases")


def max_canvases(cfg) -> int:
    """``aux.num_canvases`` if set, else ``eval_ds.max_canvases``, else the data's ``num_canvases``."""
    return cfg.aux.num_canvases or cfg.eval_ds.max_canvases or cfg.diffusion.num_canvases


def eval_settings(cfg, *, num_steps: int, step_type: str, temperature: float,
                  early_stopping: str | None, tokenizer=None) -> SamplerConfig:
    """A run's sampler settings: ``eval_ds`` and the canvas count of ``cfg``, with the step count,
    step rule, temperature and stopping rule of one evaluator. ``tokenizer`` resolves
    ``eval_ds.logit_bias`` (:func:`resolve_logit_bias`); a run that sets one needs it."""
    e = cfg.eval_ds
    return SamplerConfig(num_steps=num_steps, step_type=step_type, temperature=temperature,
                         early_stopping=early_stopping or "none", entropy_threshold=e.entropy_threshold,
                         max_canvases=max_canvases(cfg), min_stop_prob=e.min_stop_prob,
                         confidence_threshold=e.confidence_threshold, commit_block=e.commit_block,
                         commit_order=e.commit_order, commit_stable_first=e.commit_stable_first,
                         commit_no_repeat=e.commit_no_repeat,
                         entropy_bound=e.entropy_bound, stability_threshold=e.stability_threshold,
                         stop_confidence_threshold=e.stop_confidence_threshold, stop_alias_cos=e.stop_alias_cos,
                         logit_bias=resolve_logit_bias(e.logit_bias, tokenizer), self_condition=e.self_condition,
                         fuse_append=e.fuse_append, reuse_canvas_keys=e.reuse_canvas_keys, shortlist=e.shortlist,
                         prefix=resolve_prefix(e.response_prefix, tokenizer))


INTERACTIVE = {"interactive_self_condition": "self_condition", "interactive_reuse_canvas_keys": "reuse_canvas_keys",
               "interactive_no_repeat": "commit_no_repeat", "interactive_shortlist": "shortlist",
               "interactive_early_stopping": "early_stopping"}  # eval_ds.interactive_* -> the field it replaces


def interactive_cfg(cfg):
    """``cfg`` as the interactive front ends decode with it (``dgemma generate``, the playground and
    OpenAI API, :func:`load_model`, the lm-eval model): each ``eval_ds.interactive_*`` setting the
    run names (:data:`INTERACTIVE`) in place of the one ``dgemma eval`` measures, and
    ``interactive_steps`` as the only entry of ``steps``. The front ends then read ``steps[0]`` and
    ``early_stopping``. ``eval_ds.steps`` lists what ``dgemma eval`` measures (the PubMedQA recipe
    lists 8 steps first), which need not be the setting a run's quality is reported at: a shipped
    run can so default its users to a faster measured setting while its evaluation tables stay
    reproducible."""
    e = cfg.eval_ds
    over = {field: getattr(e, name) for name, field in INTERACTIVE.items() if getattr(e, name) is not None}
    if e.interactive_steps:
        over["steps"] = [e.interactive_steps]
    return replace(cfg, eval_ds=replace(e, **over)) if over else cfg


def resolve_logit_bias(bias: dict[str, float] | None, tokenizer) -> dict[int, float]:
    """``eval_ds.logit_bias`` (keyed by a token's text, e.g. ``{" no": 1.5}``) keyed by token id.
    Each key must be exactly one token of ``tokenizer``: a bias on a word that splits into
    several pieces would shift each piece everywhere it occurs, which is not what was fitted."""
    if not bias:
        return {}
    if tokenizer is None:
        raise DGemmaError("eval_ds.logit_bias names tokens by their text: resolving it needs the run's tokenizer")
    out = {}
    for text, v in bias.items():
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise DGemmaError(f"eval_ds.logit_bias: {text!r} is {len(ids)} tokens {ids}, not one; "
                              f"bias single tokens (mind the leading space, e.g. ' no')")
        out[ids[0]] = float(v)
    return out


def resolve_prefix(text: str | None, tokenizer) -> tuple[int, ...]:
    """``eval_ds.response_prefix`` (or ``dgemma generate --prefix``) as the token ids every answer
    starts with; ``()`` for None. The ids are the text's own tokenization, so a prefix must end
    where the answers' tokens do (PubMedQA's ``"The answer is:"``, not ``"The answer is: "``: its
    verdicts are the tokens `` yes`` / `` no``); :func:`check_prefix` tests it against references."""
    if text is None:
        return ()
    if not text:
        raise DGemmaError("the response prefix is empty: give the text every answer starts with, or leave it unset")
    if tokenizer is None:
        raise DGemmaError("a response prefix is text: resolving it needs the run's tokenizer")
    return tuple(tokenizer.encode(text))


def check_prefix(prefix: tuple[int, ...], references: list[list[int]], tokenizer) -> None:
    """Refuse a prefix that is not how the reference answers ``references`` (token ids) begin:
    pinned, it would force a tokenization the model never saw, and no answer could match."""
    for i, ref in enumerate(references):
        if tuple(ref[:len(prefix)]) != prefix:
            raise DGemmaError(f"the response prefix {tokenizer.decode(list(prefix))!r} {list(prefix)} is not how "
                              f"reference answer {i} begins: {tokenizer.decode(ref[:len(prefix) + 2])!r} "
                              f"{ref[:len(prefix) + 2]} (a prefix must end at a token boundary of the answers)")


RULE_DEFAULTS = SamplerConfig(entropy_threshold=0.05, min_stop_prob=0.0, confidence_threshold=0.9, entropy_bound=0.1,
                              commit_order="confidence", commit_stable_first=True, commit_no_repeat=False,
                              stability_threshold=1, stop_confidence_threshold=0.005, top_p=1.0,
                              entropy_t_max=0.8, entropy_t_min=0.4, self_condition=True, fuse_append=True,
                              reuse_canvas_keys=False, shortlist=0, prefix=())
"""The step and stopping rules' own defaults (those of their constructors)."""


def build_rules(cfg: SamplerConfig, noise):
    """``(step, stopping rule)`` of ``cfg``, each built from the settings it reads
    (``StepRule.from_settings``), rule settings left ``None`` at their defaults; ``top_p < 1``
    wraps the step in nucleus filtering. Bad settings raise DGemmaError."""

    missing = [k for k in ("num_steps", "step_type", "temperature", "early_stopping", "max_canvases")
               if getattr(cfg, k) is None]
    if missing:
        raise DGemmaError(f"sampler settings missing: {', '.join(missing)}")
    if cfg.step_type not in STEPS:
        raise DGemmaError(f"step_type {cfg.step_type!r} is unknown; choose one of {', '.join(STEPS)}")
    if cfg.early_stopping not in STOPPING:
        raise DGemmaError(f"early_stopping {cfg.early_stopping!r} is unknown; choose one of {', '.join(STOPPING)}")
    if cfg.num_steps < 1 or cfg.max_canvases < 1:
        raise DGemmaError(f"num_steps and max_canvases must be >= 1, got {cfg.num_steps} and {cfg.max_canvases}")
    if (cfg.shortlist or 0) < 0:
        raise DGemmaError(f"shortlist must be >= 0 (0: the whole vocabulary), got {cfg.shortlist}")
    cfg = cfg.resolved()
    step = STEPS[cfg.step_type].from_settings(cfg, noise)
    if cfg.top_p < 1:
        step = TopPStep(step, cfg.top_p)
    return step, STOPPING[cfg.early_stopping].from_settings(cfg)


def build_sampler(cfg: SamplerConfig, *, noise, canvas_size: int, stop_ids: tuple[int, ...], generators=None,
                  on_step=None, **engine):
    """The :class:`~dgemma.diffusion.sampler.CanvasSampler` that ``cfg`` describes: the one
    place a sampler is assembled. ``generators`` (one per batch row) gives every row its own
    random stream (:class:`~dgemma.diffusion.wrappers.RowSeeded`: outputs independent of the
    batch); ``on_step`` is the sampler's per-step hook; ``engine`` passes the sampler's own
    switches through (``use_cache``, ``record``, ``skip_committed``, ``hook_reads_guesses``),
    which change no output."""

    step, stop = build_rules(cfg, noise)
    cfg = cfg.resolved()
    check_logit_bias(cfg.logit_bias, getattr(noise, "vocab_size", None))
    parts = {"noise": noise, "step": step, "on_step": on_step}
    if generators is not None:
        parts = RowSeeded(noise, step, generators, num_steps=cfg.num_steps, stop_ids=stop_ids,
                          on_step=on_step).kwargs()
    return CanvasSampler(**parts, num_steps=cfg.num_steps, canvas_size=canvas_size,
                         max_canvases=cfg.max_canvases, stop=stop, stop_ids=stop_ids,
                         min_stop_prob=cfg.min_stop_prob, stop_alias_cos=cfg.stop_alias_cos,
                         logit_bias=dict(cfg.logit_bias or {}), temperature=signal_temperature(cfg),
                         self_condition=cfg.self_condition, fuse_append=cfg.fuse_append,
                         reuse_canvas_keys=cfg.reuse_canvas_keys, shortlist=cfg.shortlist, prefix=tuple(cfg.prefix),
                         **engine)


def signal_temperature(cfg: SamplerConfig) -> float:
    """The temperature of the self-conditioning signal and the stopping entropy: the step's,
    or 1 (the plain softmax) for a greedy step, unless ``cfg.signal_temperature`` names one."""
    if cfg.signal_temperature is not None:
        return cfg.signal_temperature
    return cfg.temperature if cfg.temperature > 0 else 1.0


def diffusiongemma_sampler(vocab_size: int, canvas_size: int = 256, *, max_new_tokens: int = 256,
                           max_denoising_steps: int = 48, entropy_bound: float = 0.1, t_min: float = 0.4,
                           t_max: float = 0.8, stability_threshold: int = 1, confidence_threshold: float = 0.005,
                           eos_token_id: int | tuple[int, ...] = 1) -> CanvasSampler:
    """The sampler of transformers' ``DiffusionGemmaForBlockDiffusion.generate``, argument for argument.

    Its defaults are ``generate``'s (``DiffusionGemmaGenerationConfig``): with the same model,
    prompt and seed (``torch.manual_seed(s)`` there, ``generator=torch.Generator().manual_seed(s)``
    here) it emits the same tokens; ``SampleResult.tokens_per_decoder_forward(pad_id)`` is its
    ``tokens_per_forward``.
    """
    noise = UniformNoise(vocab_size, get_schedule("linear"))
    stop_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    settings = SamplerConfig(num_steps=max_denoising_steps, step_type="entropy_bound", temperature=0.7,
                             entropy_bound=entropy_bound, entropy_t_max=t_max, entropy_t_min=t_min,
                             early_stopping="stable_confident", stability_threshold=stability_threshold,
                             stop_confidence_threshold=confidence_threshold,
                             max_canvases=-(-max_new_tokens // canvas_size))
    return build_sampler(settings, noise=noise, canvas_size=canvas_size, stop_ids=stop_ids)


@dataclass
class Output:
    text: str
    token_ids: list[int]
    forward_passes: int
    seconds: float  # this prompt's share of its batch's wall time

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Model:
    """A model ready to sample: weights, tokenizer, noise, canvas geometry and default settings."""

    model: torch.nn.Module
    tokenizer: object
    noise: object
    canvas_size: int
    prompt_len: int
    defaults: SamplerConfig
    trained: bool  # False: a base model whose diffusion modules were never trained
    source: str = ""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return response_stop_ids(self.tokenizer)

    def settings(self, overrides: SamplerConfig | None = None) -> SamplerConfig:
        return (overrides or SamplerConfig()).merged(self.defaults)

    @torch.no_grad()
    def generate(self, prompts, settings: SamplerConfig | None = None, *, batch_size: int = 1,
                 seed: int = 0) -> list[Output]:
        """Sample every prompt (strings, or records ``{"prompt", "system"?}`` rendered in the chat
        format); one generator seeded by ``seed`` draws for all of them, batch after batch."""
        records = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
        sampler = build_sampler(self.settings(settings), noise=self.noise, canvas_size=self.canvas_size,
                                stop_ids=self.stop_ids)
        dev = next(self.model.parameters()).device
        gen = torch.Generator(device=dev).manual_seed(seed)
        out: list[Output] = []
        for i in range(0, len(records), batch_size):
            batch = records[i:i + batch_size]
            ids, valid, _ = encode_prompts(self.tokenizer, batch, self.prompt_len, device=dev)
            res = sampler(self.model, ids, valid, generator=gen)
            for toks, fwd in zip(res.tokens, res.forward_passes):
                out.append(Output(self.tokenizer.decode(toks), toks, fwd, res.seconds / len(batch)))
        return out


def load_model(source: str | Path, *, pretrained: bool = False, dtype: str = "auto", device=None) -> Model:
    """A training workdir (its latest checkpoint, its ``eval_ds`` as defaults), or with
    ``pretrained=True`` a base model (``gemma3-270m``, a Gemma 3 folder or ``.gguf``) with
    uniform noise, 32-token canvases and the confidence step: untrained for diffusion."""
    device = torch.device(device) if device else default_device()
    if not pretrained:
        run = load_run(source, dtype=dtype, device=device)
        cfg = interactive_cfg(run.cfg)
        e = cfg.eval_ds
        defaults = eval_settings(cfg, num_steps=e.steps[0], step_type=e.step_type, temperature=e.temperature,
                                 early_stopping=e.early_stopping or "none", tokenizer=run.tokenizer)
        return Model(run.model, run.tokenizer, run.noise(), run.cfg.diffusion.canvas_size, run.cfg.data.prompt_len,
                     defaults, trained=True, source=str(source))
    model, tokenizer = load_pretrained(str(source))
    if tokenizer is None:
        raise DGemmaError(f"{source} has no tokenizer.json: sampling text needs one")
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    defaults = SamplerConfig(num_steps=32, step_type="confidence", temperature=0.0, early_stopping="none",
                             entropy_threshold=0.05, max_canvases=4)
    return Model(model, tokenizer, UniformNoise(model.config.vocab_size, get_schedule("linear")), 32, 1024, defaults,
                 trained=False, source=str(source))
