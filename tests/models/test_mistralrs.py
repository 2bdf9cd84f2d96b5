"""A DiffusionGemma written by ``dgemma export`` in a second engine: mistral.rs (Rust, CPU build).

mistral.rs has no greedy mode for block diffusion: every pass starts from, and re-noises to,
uniformly random tokens and samples with Gumbel noise at temperature 0.4-0.8 (``t_min`` /
``t_max``), whatever the request says. So its generated text cannot be compared with ours token
for token. What it offers for validation is a hook (``MISTRALRS_DIFFUSION_DEBUG_DUMP``): on its
first real prompt it runs one denoising pass over the fixed canvas ``ids[i] = 977 i mod V``,
without self-conditioning, writes the logits and the prompt ids, and exits. We run that pass
ourselves on the same ids: in fp32 (``MISTRALRS_CPU_KV_F32=1``; its default f16 KV cache on a CPU
is not fp32) the logits must agree to fp32 rounding and the greedy tokens exactly.

The hook fires on mistral.rs's own warm-up prompt (``<bos>hello``, 2 tokens), so the sliding
window (6) is not cut here. Found while writing this test: at a window of 2 over that prompt,
mistral.rs 0.9.5 disagrees with transformers (which we match: tests/models/test_diffusiongemma.py)
by 0.96 of the logits' scale, while windows 3, 4 and 6 agree to 1e-6 (docs/guides/serving.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dgemma
from dgemma.models.hf_gemma4 import DIFFUSIONGEMMA_DESIGN, save_diffusiongemma
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.transformer import DiffusionGemma, ModelConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mistralrs") is None,
                                reason="mistralrs not installed (pip install -e '.[mistralrs]')")

CANVAS = 8
RUN = """
import sys, mistralrs as m
folder, dtype, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
runner = m.Runner(which=m.Which.MultimodalPlain(model_id=folder, arch=m.MultimodalArchitecture.DiffusionGemma,
                                                dtype=getattr(m.ModelDType, dtype)))
r = runner.send_completion_request(m.CompletionRequest(model="default", prompt=prompt, max_tokens=12))
print("USAGE", r.usage.completion_tokens)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A model born in dgemma (experts, k = v, partial RoPE with non-default thetas, soft-cap),
    weights moved off their initialisation, exported as ``dgemma export`` writes it."""
    from tests.conftest import tiny_bpe
    from tests.models.test_diffusiongemma import perturb

    from tokenizers.processors import TemplateProcessing
    tok = tiny_bpe(["hello world", "The capital of France is Paris."])
    # Gemma's tokenizer.json adds <bos> itself; mistral.rs encodes prompts with it as written
    tok.backend.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_id)])
    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=6, max_position_embeddings=256,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      selfcond_intermediate_size=48, global_head_dim=16, num_global_key_value_heads=1,
                      rope_global_partial_factor=0.25, rope_global_theta=20_000.0, rope_local_theta=500.0,
                      num_experts=4, top_k_experts=2, moe_intermediate_size=16, pad_token_id=tok.pad_id,
                      eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, **DIFFUSIONGEMMA_DESIGN)
    torch.manual_seed(0)
    model = DiffusionGemma(cfg).eval()
    perturb(model, 0.3, seed=5)
    return save_diffusiongemma(model, tok, tmp_path_factory.mktemp("mistralrs") / "export", canvas_length=CANVAS,
                               generation={"max_denoising_steps": 4})


def mistralrs(folder, dtype: str, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", RUN, str(folder), dtype, "hello world"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_one_denoising_pass_matches_ours_in_fp32(exported, tmp_path):
    dump = tmp_path / "logits.npy"
    mistralrs(exported, "F32", MISTRALRS_CPU_KV_F32="1", MISTRALRS_DIFFUSION_DEBUG_DUMP=str(dump))
    theirs = torch.from_numpy(np.load(dump)).double()
    prompt = torch.from_numpy(np.load(f"{dump}.prompt_ids.npy")).long()
    assert theirs.shape == (1, CANVAS, 320) and prompt.shape[1] > 1

    ours, _ = dgemma.load_pretrained(exported, dtype=torch.float32)
    P = prompt.shape[1]
    canvas = (torch.arange(CANVAS) * 977 % 320).unsqueeze(0)
    ones = torch.ones(1, CANVAS, dtype=torch.bool)
    info = TokenInfo(torch.arange(P, P + CANVAS).unsqueeze(0), torch.ones(1, CANVAS, dtype=torch.long), ones, ones)
    with torch.no_grad():
        cache = KVCache(1, P + CANVAS)
        ours(prompt, cache=cache)  # the causal encoder fills the cache
        logits = ours(canvas, info=info, cache=cache, write=False).double()  # one bidirectional pass
    assert float((logits - theirs).abs().max() / theirs.abs().max()) < 1e-5
    assert torch.equal(logits.argmax(-1), theirs.argmax(-1))
    # a wrong RoPE theta (mistral.rs reads text_config.rope_theta) is caught: the check can fail
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["text_config"]["rope_theta"] == 20_000.0


def test_it_loads_and_generates_in_bf16(exported):
    out = mistralrs(exported, "BF16").stdout
    tokens = int(out.split("USAGE")[-1])
    assert 1 <= tokens <= 12
