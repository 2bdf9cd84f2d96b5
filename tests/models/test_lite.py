"""The Lite recipe's architecture: its exact parameter count (docs/design.md §1: 343,516,160)."""

import torch

from dgemma.training.config import load_config
from dgemma.models.transformer import DiffusionGemma


def test_lite_343m_parameter_count():
    cfg = load_config("configs/lite_343m.py")
    with torch.device("meta"):
        model = DiffusionGemma(cfg.model)
    assert model.num_parameters() == 343_516_160
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert per_layer == 12_062_848
    assert sum(p.numel() for p in model.time_embedding.parameters()) == 1_312_768
    assert sum(p.numel() for p in model.self_conditioning.parameters()) == 1_230_848


def test_lite_debug_builds_and_runs_the_objective():
    from dgemma.diffusion.objective import DiffusionObjective
    from dgemma.training.trainer import build_noise_for

    cfg = load_config("configs/lite_debug.py")
    model = DiffusionGemma(cfg.model)
    n_tok = cfg.diffusion.num_canvases * cfg.diffusion.canvas_size
    batch = {"prompt_ids": torch.zeros(2, 0, dtype=torch.long), "prompt_valid": torch.zeros(2, 0, dtype=torch.bool),
             "canvas_ids": torch.randint(3, 2048, (2, n_tok)), "canvas_valid": torch.ones(2, n_tok, dtype=torch.bool),
             "canvas_mask": torch.ones(2, cfg.diffusion.num_canvases, dtype=torch.bool)}
    obj = DiffusionObjective(noise=build_noise_for(cfg, model, None), canvas_size=cfg.diffusion.canvas_size,
                             decode="all", ar_loss_weight=0.0, selfcond_prob=1.0)
    terms = obj(model, batch, torch.Generator().manual_seed(0))
    assert int(terms.diffusion_count) == 2 * n_tok
    (terms.diffusion_sum / terms.diffusion_count).backward()
    assert model.time_embedding.fc2.weight.grad.abs().sum() > 0


def test_ar_baselines_are_the_same_backbone():
    """configs/lite_*_ar.py: Lite's backbone (every shared field equal) with a causal encoder, no
    diffusion modules and only the next-token loss: 343,516,160 - 1,312,768 - 1,230,848 parameters."""
    for name, count in (("lite_343m", 340_972_544), ("lite_debug", None)):
        lite, ar = load_config(f"configs/{name}.py"), load_config(f"configs/{name}_ar.py")
        differ = {k for k, v in vars(lite.model).items() if getattr(ar.model, k) != v}
        assert differ <= {"encoder_mode", "self_conditioning", "time_conditioning", "selfcond_intermediate_size",
                          "time_freq_dim", "selfcond_variant"}
        assert ar.model.encoder_mode == "causal" and not ar.model.self_conditioning and not ar.model.time_conditioning
        assert ar.diffusion.diffusion_loss_weight == 0 and ar.diffusion.ar_loss_weight == 1
        assert (ar.data, ar.optim, ar.train) == (lite.data, lite.optim, lite.train)
        if count:
            with torch.device("meta"):
                assert DiffusionGemma(ar.model).num_parameters() == count
