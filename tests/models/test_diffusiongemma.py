"""Google's DiffusionGemma and the Gemma 4 backbone against transformers, on tiny random configs.

Each reference is built with transformers' own config classes, saved with ``save_pretrained``,
and loaded with :func:`dgemma.load_pretrained`; its weights are perturbed away from the
initialisation (norm scales off one, router scales off one, per-layer scalars off one) so a
convention mix-up (``1 + w`` vs ``w``, a missing scalar) cannot hide. Every config has a
sequence longer than its sliding window. transformers' DiffusionGemma keeps RMSNorm, attention
softmax and the final soft-cap in fp32 even in an fp64 model, so fp64 agreement is bounded by
fp32 rounding too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache, Gemma4ForCausalLM,
                          Gemma4TextConfig)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (EntropyBoundSampler,
                                                                            EntropyBoundSamplerConfig,
                                                                            StableAndConfidentStoppingCriteria)

import dgemma
from dgemma.diffusion.corruption import UniformNoise
from dgemma.diffusion.sampler import CanvasSampler
from dgemma.sampling import diffusiongemma_sampler
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import EntropyBoundStep
from dgemma.diffusion.stopping import StableAndConfident, token_entropy
from dgemma.errors import DGemmaError
from dgemma.models.hf_gemma4 import save_diffusiongemma
from dgemma.models.kv_cache import KVCache
from dgemma.models.masks import TokenInfo
from dgemma.models.selfcond import probs_embedding

MOE_A = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=6,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=4, top_k_experts=2,
             moe_intermediate_size=24, max_position_embeddings=256)
MOE_B = dict(vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=3, head_dim=8, global_head_dim=24, num_global_key_value_heads=2, sliding_window=5,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
             num_experts=6, top_k_experts=3, moe_intermediate_size=16, max_position_embeddings=256,
             rms_norm_eps=1e-5, final_logit_softcapping=15.0,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                 "rope_theta": 20_000.0}})
CONFIGS = {"moe_a": (MOE_A, 8), "moe_b": (MOE_B, 6)}


def perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * scale)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # encoder and decoder copies stay equal
                b.fill_(0.8 + 0.1 * int(name.split("layers.")[1].split(".")[0]))


def build_dg(tmp_path_factory, name: str, scale: float):
    text, canvas = CONFIGS[name]
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=dict(text), canvas_length=canvas))
    perturb(model, scale, seed=1)
    folder = tmp_path_factory.mktemp(f"dg_{name}_{scale}")
    model.save_pretrained(folder)
    return folder, canvas


def hf_dg(folder, dtype=torch.float32) -> DiffusionGemmaForBlockDiffusion:
    return DiffusionGemmaForBlockDiffusion.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def dg_folder(request, tmp_path_factory):
    return build_dg(tmp_path_factory, request.param, scale=0.3)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def canvas_info(batch: int, start: int, length: int) -> TokenInfo:
    ones = torch.ones(batch, length, dtype=torch.bool)
    return TokenInfo(torch.arange(start, start + length).expand(batch, -1), torch.ones(batch, length, dtype=torch.long),
                     ones, ones)


# ------------------------------------------------------------------------------- forward passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_and_decoder_logits_match_transformers(dg_folder, dtype, backend):
    folder, canvas_len = dg_folder
    hf = hf_dg(folder, dtype)
    ours, _ = dgemma.load_pretrained(folder, dtype=dtype, attn_implementation=backend)
    vocab, prompt_len = ours.config.vocab_size, 2 * ours.config.sliding_window + 1  # longer than the window
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (2, prompt_len), generator=g)
    canvas = torch.randint(0, vocab, (2, canvas_len), generator=g)
    sc_logits = torch.randn(2, canvas_len, vocab, generator=g, dtype=dtype) * 3
    with torch.no_grad():
        for selfcond in (None, sc_logits):
            ref = hf(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=selfcond,
                     cache=DynamicCache(config=hf.config.get_text_config()))
            cap = hf.config.text_config.final_logit_softcapping
            enc_ref = torch.tanh(hf.lm_head(ref.encoder_last_hidden_state).float() / cap) * cap
            cache = KVCache(2, prompt_len + canvas_len)
            enc = ours(prompt, cache=cache)
            signal = None if selfcond is None else probs_embedding(selfcond, ours.model.embed_tokens.weight)
            dec = ours(canvas, info=canvas_info(2, prompt_len, canvas_len), cache=cache, write=False, selfcond=signal)
            assert rel(enc, enc_ref) < 1e-5
            assert rel(dec, ref.logits) < 1e-5


GEMMA4_CAUSAL = {
    "dense": dict(enable_moe_block=False, attention_k_eq_v=False),
    "dense_k_eq_v": dict(enable_moe_block=False, attention_k_eq_v=True),
    "moe": dict(enable_moe_block=True, attention_k_eq_v=True, num_experts=4, top_k_experts=2, moe_intermediate_size=20),
}


@pytest.mark.parametrize("variant", sorted(GEMMA4_CAUSAL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gemma4_backbone_matches_gemma4_for_causal_lm(tmp_path, variant, dtype):
    cfg = Gemma4TextConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                           num_global_key_value_heads=1, sliding_window=4, hidden_size_per_layer_input=0,
                           final_logit_softcapping=20.0, max_position_embeddings=128, **GEMMA4_CAUSAL[variant])
    torch.manual_seed(0)
    ref = Gemma4ForCausalLM(cfg)
    perturb(ref, 0.3, seed=2)
    ref.save_pretrained(tmp_path)
    ref = Gemma4ForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager",
                                            experts_implementation="eager").eval()
    ours, _ = dgemma.load_pretrained(tmp_path, dtype=dtype, attn_implementation="eager")
    assert ours.config.num_experts == (4 if variant == "moe" else 0)
    ids = torch.randint(0, 80, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel(ours(ids), ref(ids).logits) < 1e-5


# ------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_entropy_bound_sampler_gives_transformers_tokens(tmp_path_factory, name):
    """Same seed, same inputs: our entropy_bound + stable-and-confident sampler emits the tokens
    of transformers' ``generate``, canvas after canvas, and the same tokens-per-forward figure.

    Milder weights than the forward tests: with large random weights the self-conditioning loop
    is chaotic, and fp32 rounding differences of 1e-7 (our masked attention reduces over more
    keys than transformers' sliding cache holds) grow into different argmaxes after a few steps.
    """
    folder, canvas_len = build_dg(tmp_path_factory, name, scale=0.1)
    hf = hf_dg(folder)
    ours, _ = dgemma.load_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    vocab, eos = ours.config.vocab_size, ours.config.eos_token_id
    noise = UniformNoise(vocab, LinearSchedule())
    steps, canvases, seen = 6, 3, {"early_stop": 0, "eos": 0, "multi_accept": 0}
    for seed in range(6):
        for bound, stable, conf in ((0.1, 1, 0.005), (1.0, 1, 1.0), (3.0, 1, 2.5), (20.0, 0, 4.0), (0.5, 0, 5.0)):
            prompt = torch.randint(0, vocab, (1, 13), generator=torch.Generator().manual_seed(100 + seed))
            torch.manual_seed(seed)
            ref = hf.generate(prompt, max_new_tokens=canvases * canvas_len, max_denoising_steps=steps,
                              sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound), t_min=0.4, t_max=0.8,
                              stability_threshold=stable, confidence_threshold=conf, eos_token_id=eos, pad_token_id=0)
            if seed % 2:  # the preset with generate's argument names, and the same sampler spelled out
                sampler = diffusiongemma_sampler(vocab, canvas_len, max_new_tokens=canvases * canvas_len,
                                                 max_denoising_steps=steps, entropy_bound=bound,
                                                 stability_threshold=stable, confidence_threshold=conf,
                                                 eos_token_id=eos)
            else:
                sampler = CanvasSampler(noise=noise, step=EntropyBoundStep(noise, bound, t_max=0.8, t_min=0.4),
                                        num_steps=steps, canvas_size=canvas_len, max_canvases=canvases,
                                        stop=StableAndConfident(stable, conf), stop_ids=(eos,))
            got = sampler(ours, prompt, torch.ones_like(prompt, dtype=torch.bool),
                          generator=torch.Generator().manual_seed(seed))
            ref_tokens = ref.sequences[0, prompt.shape[1]:].tolist()
            mine = got.tokens[0]
            assert mine == ref_tokens[:len(mine)] and set(ref_tokens[len(mine):]) <= {0}, (seed, bound)
            assert got.tokens_per_decoder_forward(pad_id=0)[0] == pytest.approx(ref.tokens_per_forward.item(), rel=1e-6)
            seen["early_stop"] += any(s < steps for s in got.steps_used[0])
            seen["eos"] += eos in mine
            seen["multi_accept"] += bound >= 1.0
    assert seen["early_stop"] and seen["eos"], seen  # the test reaches every path it claims to check


def test_accept_sets_and_stopping_decisions_match_given_the_same_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, 50, generator=g) * torch.linspace(0.5, 12, 32)[None, :, None]
    for bound in (0.05, 0.1, 1.0, 5.0):
        ref = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), 32, 50, 10)
        ref.accept_canvas(torch.zeros(4, 32, dtype=torch.long), torch.ones(4, 32, dtype=torch.long), logits, 1)
        ours = EntropyBoundStep(UniformNoise(50, LinearSchedule()), bound).accept(token_entropy(logits))
        assert torch.equal(ours, ref.accepted_token_mask)
        assert 1 <= int(ours.sum(-1).min()) and (bound < 5.0 or int(ours.sum(-1).max()) > 1)
    ref_stop, our_stop = StableAndConfidentStoppingCriteria(1, 0.3), StableAndConfident(1, 0.3)
    our_stop.reset(4)
    sharp = logits * 4
    for step_logits in (sharp, sharp, sharp + 0.01, logits, logits):
        assert torch.equal(our_stop.update(step_logits, 1.0), ref_stop(step_logits.argmax(-1), step_logits))


# ------------------------------------------------------------------------------ load / export
def test_round_trip_dgemma_transformers_dgemma_is_unchanged(dg_folder, tmp_path):
    folder, canvas_len = dg_folder
    first, _ = dgemma.load_pretrained(folder, dtype=torch.float32)
    out = save_diffusiongemma(first, None, tmp_path / "export", canvas_length=canvas_len)
    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = DiffusionGemmaForBlockDiffusion.from_pretrained(folder).state_dict()
    assert original.keys() == hf.state_dict().keys()
    assert all(torch.equal(original[k], v) for k, v in hf.state_dict().items())  # vision tower kept too
    second, _ = dgemma.load_pretrained(out, dtype=torch.float32)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["canvas_length"] == canvas_len


def test_a_model_born_in_dgemma_exports_to_transformers_and_back(tmp_path):
    from dgemma.models.hf_gemma4 import DIFFUSIONGEMMA_DESIGN
    from dgemma.models.transformer import DiffusionGemma, ModelConfig
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=128,
                      layer_types=["sliding_attention", "full_attention"], selfcond_intermediate_size=48,
                      global_head_dim=16, num_global_key_value_heads=1, rope_global_partial_factor=0.25,
                      num_experts=4, top_k_experts=2, moe_intermediate_size=16, **DIFFUSIONGEMMA_DESIGN)
    torch.manual_seed(0)
    ours = DiffusionGemma(cfg).eval()
    perturb(ours, 0.3, seed=3)
    out = save_diffusiongemma(ours, None, tmp_path, canvas_length=6)
    text = json.loads((Path(out) / "config.json").read_text())["text_config"]
    assert text["per_layer_config"] == {"1": {"head_dim": 16, "num_key_value_heads": 1}}
    # mistral.rs reads these older keys, not per_layer_config / rope_parameters
    assert (text["global_head_dim"], text["num_global_key_value_heads"]) == (16, 1)
    assert text["rope_theta"] == text["rope_parameters"]["full_attention"]["rope_theta"] == cfg.rope_global_theta
    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True,
                                                               attn_implementation="eager",
                                                               experts_implementation="eager")
    assert not info["unexpected_keys"] and not info["missing_keys"], info  # the placeholder tower is written
    vision = {k: v for k, v in hf.state_dict().items() if ".vision_tower." in k or ".embed_vision." in k}
    assert len(vision) == 16 and all(not v.any() for v in vision.values())  # inert: all zeros
    prompt, canvas = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        ref = hf.eval()(input_ids=prompt, decoder_input_ids=canvas, cache=DynamicCache(config=hf.config.get_text_config()))
        cache = KVCache(1, 15)
        ours(prompt, cache=cache)
        assert rel(ours(canvas, info=canvas_info(1, 9, 6), cache=cache, write=False), ref.logits) < 1e-5
    back, _ = dgemma.load_pretrained(out, dtype=torch.float32)
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_refusals(dg_folder, tmp_path):
    folder, _ = dg_folder
    model, _ = dgemma.load_pretrained(folder, dtype=torch.float32)
    image_id = json.loads((folder / "config.json").read_text())["image_token_id"]
    ids = torch.tensor([[2, 5, image_id % 10**9]])
    with pytest.raises(DGemmaError, match="image tokens"):
        model(ids)
    # encoder and decoder copies that disagree are two networks, which ours cannot be
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    key = next(k for k in tensors if k.startswith("model.encoder.language_model.layers.") and "layer_scalar" in k)
    tensors[key] = tensors[key] * 2
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(DGemmaError, match="differs from its decoder twin"):
        dgemma.load_pretrained(bad)
    # a design transformers cannot express is refused by name, never exported as something else
    import dataclasses

    from dgemma.models.transformer import DiffusionGemma
    odd = DiffusionGemma(dataclasses.replace(model.config, value_norm=False))
    with pytest.raises(DGemmaError, match="value_norm"):
        save_diffusiongemma(odd, None, tmp_path / "odd")
    # a Gemma 3 export of a DiffusionGemma would silently drop its design
    with pytest.raises(DGemmaError, match="save_diffusiongemma"):
        dgemma.models.weights.save_hf(model, None, tmp_path / "g3")


# -------------------------------------------------------------------------------- fine-tuning
def test_sft_recipe_fine_tunes_a_diffusiongemma_and_exports_it_back(tmp_path_factory):
    """``configs/sft_sudoku.py`` with a DiffusionGemma base: LoRA on attention and dense MLP,
    router frozen, experts trained in full; the export loads into transformers with equal logits."""
    from dgemma.cli.main import main
    from dgemma.training.config import apply_overrides, load_config
    from dgemma.training.runs import load_run
    from dgemma.training.trainer import train

    folder, _ = build_dg(tmp_path_factory, "moe_a", scale=0.1)
    base, _ = dgemma.load_pretrained(folder, dtype=torch.float32)
    workdir = tmp_path_factory.mktemp("dg_sft")
    cfg = apply_overrides(load_config("configs/sft_sudoku.py"), [
        f"--cfg.workdir={workdir}", f"--cfg.init.base={folder}", "--cfg.data.path=none", "--cfg.data.tokenizer=digits",
        "--cfg.data.prompt_len=82", "--cfg.diffusion.canvas_size=88", "--cfg.data.batch_size=2",
        "--cfg.train.steps=3", "--cfg.train.checkpoint_every=3", "--cfg.train.dtype=float32", "--cfg.train.threads=1",
        "--cfg.optim.lr=0.01", "--cfg.optim.warmup_steps=1", "--cfg.lora.train_experts=true",
        "--cfg.train.log_every=1"])
    train(cfg)
    losses = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    run = load_run(workdir, device="cpu", merge_lora=False)
    assert run.model.config.selfcond_variant == "postnorm"  # the base's design, not the recipe's zero_init
    trained = dict(run.model.named_parameters())
    layer = "model.layers.0."
    assert torch.equal(trained[layer + "router.proj.weight"], base.state_dict()[layer + "router.proj.weight"])
    assert not torch.equal(trained[layer + "experts.gate_up_proj"], base.state_dict()[layer + "experts.gate_up_proj"])
    assert any("lora_" in n for n in trained)

    out = workdir / "export"
    assert main(["export", f"--cfg.workdir={workdir}", f"--out={out}"]) == 0
    merged = load_run(workdir, device="cpu").model  # LoRA folded in (load_run's default)
    hf = hf_dg(out)
    prompt = torch.randint(0, 16, (1, 20), generator=torch.Generator().manual_seed(5))
    canvas = torch.randint(0, 16, (1, 88), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(input_ids=prompt, decoder_input_ids=canvas, cache=DynamicCache(config=hf.config.get_text_config()))
        cache = KVCache(1, 20 + 88)
        merged(prompt, cache=cache)
        dec = merged(canvas, info=canvas_info(1, 20, 88), cache=cache, write=False)
    assert rel(dec, ref.logits) < 1e-5
    assert not torch.equal(hf.state_dict()["model.decoder.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])  # LoRA merged in


def test_gpu_script_smoke_mode_runs_the_same_code_on_cpu(tmp_path):
    """``scripts/gpu_diffusiongemma.py --smoke``: the GPU comparison's code path, on a tiny config."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_dg", "scripts/gpu_diffusiongemma.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--smoke", "--out", str(tmp_path), "--repeats", "1", "--batches", "1,3"]) == 0
    rows = json.loads((tmp_path / "diffusiongemma.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    # batch 1: same weights, seed and settings give the same tokens and tokens/forward. In a batch
    # the streams part once a row finishes: dgemma drops it (it stops costing compute) while
    # transformers keeps sampling it, so later draws have other shapes.
    assert rows[0]["token_agreement"] == 1.0
    assert rows[0]["tokens_per_forward_dgemma"] == pytest.approx(rows[0]["tokens_per_forward_transformers"], rel=1e-6)
    assert 0 < rows[1]["token_agreement"] <= 1.0
