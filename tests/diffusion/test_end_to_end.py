"""A tiny model overfits one Sudoku-like example through the real train-and-sample path, then
reproduces it exactly with every step type (docs/design.md §2-4 end to end, seconds on a CPU)."""

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.objective import DiffusionObjective
from dgemma.diffusion.sampler import CanvasSampler, ar_generate
from dgemma.diffusion.schedules import LinearSchedule
from dgemma.diffusion.steps import build_step
from dgemma.diffusion.stopping import EntropyStop
from dgemma.models.transformer import DiffusionGemma, ModelConfig

V, C, EOS, PAD = 16, 8, 1, 0


def batch():
    prompt = torch.tensor([[2, 7, 3, 9, 4, 0, 0]])  # right padded prompt
    pvalid = torch.tensor([[1, 1, 1, 1, 1, 0, 0]]).bool()
    canvas = torch.tensor([[5, 3, 9, 7, 4, 8, 6, EOS]])  # the "solution", then EOS
    return {"prompt_ids": prompt, "prompt_valid": pvalid, "canvas_ids": canvas,
            "canvas_valid": torch.ones(1, C, dtype=torch.bool), "canvas_mask": torch.ones(1, 1, dtype=torch.bool)}


@pytest.fixture(scope="module", params=["uniform", "absorbing"])
def trained(request):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                      self_conditioning=True, eos_token_id=EOS, pad_token_id=PAD)
    model = DiffusionGemma(cfg)
    schedule = LinearSchedule()
    noise = UniformNoise(V, schedule) if request.param == "uniform" else AbsorbingNoise(V - 1, schedule)
    objective = DiffusionObjective(noise=noise, canvas_size=C, selfcond_prob=0.5, ar_loss_weight=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    b = batch()
    losses = []
    for step in range(300):
        terms = objective(model, b, torch.Generator().manual_seed(step))
        loss = terms.objective(terms.diffusion_count, terms.ar_count, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-50:]) / 50 < 0.25 < sum(losses[:50]) / 50
    return model.eval(), noise, schedule, b


@pytest.mark.parametrize("step", ["ddim", "commit", "confidence"])
def test_overfit_then_reproduce(trained, step):
    model, noise, schedule, b = trained
    if step == "ddim" and isinstance(noise, AbsorbingNoise):
        pytest.skip("ddim is the uniform process's posterior step")
    kw = {"ddim": {"noise": noise, "temperature": 0.7}, "commit": {"noise": noise, "schedule": schedule},
          "confidence": {"noise": noise, "threshold": 0.9}}[step]
    sampler = CanvasSampler(noise=noise, step=build_step(step, **kw), num_steps=8, canvas_size=C, max_canvases=2,
                            stop_ids=(EOS,), stop=EntropyStop(0.05))
    res = sampler(model, b["prompt_ids"], b["prompt_valid"], generator=torch.Generator().manual_seed(0))
    assert res.tokens[0] == b["canvas_ids"][0].tolist()  # cut after EOS: the second canvas never runs
    assert res.steps_used[0][0] <= 8 and len(res.steps_used[0]) == 1
    assert res.forward_passes[0] == 1 + res.steps_used[0][0]  # prefill + denoising steps, no re-encode


def test_ar_decoding_of_the_same_weights(trained):
    model, _, _, b = trained
    res = ar_generate(model, b["prompt_ids"], b["prompt_valid"], max_new_tokens=C, stop_ids=(EOS,))
    assert res.tokens[0] == b["canvas_ids"][0].tolist()  # the encoder AR loss taught the clean sequence too
    assert res.forward_passes[0] == C  # prefill + 7 single-token steps
