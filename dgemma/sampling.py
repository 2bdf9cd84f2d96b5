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

import inspect
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dgemma.errors import DGemmaError


@dataclass(kw_only=True)
class SamplerConfig:
    num_steps: int | None = None  # denoising steps per canvas
    step_type: str | None = None  # ddim | commit | confidence | entropy_bound
    temperature: float | None = None  # 0 = greedy (commit / confidence)
    early_stopping: str | None = None  # none | entropy | stable_confident
    entropy_threshold: float | None = None  # for early_stopping="entropy"
    max_canvases: int | None = None
    min_stop_prob: float | None = None  # a stop token only where its probability reaches this (0 = argmax)
    step_args: dict = field(default_factory=dict)  # extra step arguments, e.g. {"threshold": 0.9}
    stop_args: dict = field(default_factory=dict)  # extra stopping arguments

    def merged(self, defaults: "SamplerConfig") -> "SamplerConfig":
        """This config with every ``None`` field taken from ``defaults``."""
        return replace(defaults, **{k: v for k, v in asdict(self).items() if v is not None and v != {}})

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.step_type} x {self.num_steps} steps, T={self.temperature}, "
                f"early stopping {self.early_stopping}, <= {self.max_canvases} canvases")


def max_canvases(cfg) -> int:
    """``aux.num_canvases`` if set, else ``eval_ds.max_canvases``, else the data's ``num_canvases``."""
    return cfg.aux.num_canvases or cfg.eval_ds.max_canvases or cfg.diffusion.num_canvases


def build_sampler(cfg: SamplerConfig, *, noise, canvas_size: int, stop_ids: tuple[int, ...]):
    """The :class:`~dgemma.diffusion.sampler.CanvasSampler` that ``cfg`` describes (all fields set)."""
    from dgemma.diffusion.sampler import CanvasSampler
    from dgemma.diffusion.steps import STEPS, build_step
    from dgemma.diffusion.stopping import build_stopping

    missing = [k for k in ("num_steps", "step_type", "temperature", "early_stopping", "max_canvases")
               if getattr(cfg, k) is None]
    if missing:
        raise DGemmaError(f"sampler settings missing: {', '.join(missing)}")
    if cfg.step_type not in STEPS:
        raise DGemmaError(f"denoising step {cfg.step_type!r} is not available; choose one of {sorted(STEPS)}")
    if cfg.num_steps < 1 or cfg.max_canvases < 1:
        raise DGemmaError(f"num_steps and max_canvases must be >= 1, got {cfg.num_steps} and {cfg.max_canvases}")
    accepted = inspect.signature(STEPS[cfg.step_type]).parameters
    step_kw = {k: v for k, v in {"noise": noise, "temperature": cfg.temperature}.items() if k in accepted}
    step = build_step(cfg.step_type, **{**step_kw, **cfg.step_args})
    rule = cfg.early_stopping or "none"
    stop_kw = {"threshold": cfg.entropy_threshold} if rule == "entropy" and cfg.entropy_threshold is not None else {}
    stop = build_stopping(rule, **{**stop_kw, **cfg.stop_args})
    return CanvasSampler(noise=noise, step=step, num_steps=cfg.num_steps, canvas_size=canvas_size,
                         max_canvases=cfg.max_canvases, stop=stop, stop_ids=stop_ids,
                         min_stop_prob=cfg.min_stop_prob or 0.0,
                         temperature=cfg.temperature if cfg.temperature > 0 else 1.0)  # greedy: selfcond reads T=1


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
        from dgemma.tasks import response_stop_ids

        return response_stop_ids(self.tokenizer)

    def settings(self, overrides: SamplerConfig | None = None) -> SamplerConfig:
        return (overrides or SamplerConfig()).merged(self.defaults)

    @torch.no_grad()
    def generate(self, prompts, settings: SamplerConfig | None = None, *, batch_size: int = 1,
                 seed: int = 0) -> list[Output]:
        """Sample every prompt (strings, or records ``{"prompt", "system"?}`` rendered in the chat
        format); one generator seeded by ``seed`` draws for all of them, batch after batch."""
        from dgemma.data.sft import encode_prompts

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
    from dgemma.device import default_device, resolve_dtype

    device = torch.device(device) if device else default_device()
    if not pretrained:
        from dgemma.training.runs import load_run

        run = load_run(source, dtype=dtype, device=device)
        e = run.cfg.eval_ds
        defaults = SamplerConfig(num_steps=e.steps[0], step_type=e.step_type, temperature=e.temperature,
                                 early_stopping=e.early_stopping or "none", entropy_threshold=e.entropy_threshold,
                                 max_canvases=max_canvases(run.cfg), min_stop_prob=e.min_stop_prob)
        return Model(run.model, run.tokenizer, run.noise(), run.cfg.diffusion.canvas_size, run.cfg.data.prompt_len,
                     defaults, trained=True, source=str(source))
    from dgemma.diffusion.corruption import UniformNoise
    from dgemma.diffusion.schedules import get_schedule
    from dgemma.models.pretrained import load_pretrained

    model, tokenizer = load_pretrained(str(source))
    if tokenizer is None:
        raise DGemmaError(f"{source} has no tokenizer.json: sampling text needs one")
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    defaults = SamplerConfig(num_steps=32, step_type="confidence", temperature=0.0, early_stopping="none",
                             entropy_threshold=0.05, max_canvases=4)
    return Model(model, tokenizer, UniformNoise(model.config.vocab_size, get_schedule("linear")), 32, 1024, defaults,
                 trained=False, source=str(source))
