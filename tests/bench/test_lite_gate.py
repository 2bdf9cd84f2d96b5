"""The Lite GPU gate (scripts/gpu_lite_gate.py, dgemma/bench/lite_gate.py): the analytic FLOP formula
against PyTorch's FLOP counter on the real training step, the peak table, and the whole script in
``--smoke`` mode on the CPU. Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dgemma.bench import lite_gate as G
from dgemma.training.config import apply_overrides, load_config

REPO = Path(__file__).resolve().parents[2]


def _addmm_(self_shape, a, b, out_shape=None, **kw):  # the chunked loss's weight gradient; the counter skips in-place
    return 2 * a[0] * a[1] * b[1]


@pytest.mark.parametrize("config,extra", [
    ("lite_debug", []),  # self-conditioned step (the first pass runs)
    ("lite_debug", ["--cfg.diffusion.selfcond_prob=0"]),
    ("lite_debug", ["--cfg.diffusion.ar_loss_weight=1"]),  # the encoder's last layer is back-propagated too
    ("lite_debug_ar", []),  # the AR baseline: encoder and AR head only
])
def test_flop_formula_equals_the_flop_counter(config, extra):
    """With eager attention (every (query, key) pair multiplied) the formula's dense count equals the
    FLOPs ``torch.utils.flop_counter`` counts in one real training step, exactly."""
    from dgemma.models.transformer import DiffusionGemma
    from dgemma.training.trainer import TrainModule, build_objective, step_generator, train_step

    cfg = apply_overrides(load_config(REPO / "configs" / f"{config}.py"),
                          ["--cfg.model.attn_implementation=eager", "--cfg.diffusion.num_canvases=4",
                           "--cfg.data.batch_size=2", *extra])
    model = DiffusionGemma(cfg.model)
    objective = build_objective(cfg, model, None)
    module = TrainModule(model, objective)
    batch = G._random_batch(cfg, 2, "cpu")
    first = module.runs_first_pass(objective.plan(batch, step_generator(0, 0, 0, 0, 1, 1)))
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_}) as counter:
        train_step(module, [batch], torch.optim.SGD(model.parameters(), lr=0.0), step=0, seed=0, rank=0, world=1,
                   clip_norm=None, ar_weight=cfg.diffusion.ar_loss_weight, objective=objective,
                   diffusion_weight=cfg.diffusion.diffusion_loss_weight)
    want = G.lite_step_flops(cfg, 2, first_pass=first, dense_attention=True)
    assert counter.get_total_flops() == want["hardware"]
    assert first == (config == "lite_debug" and "--cfg.diffusion.selfcond_prob=0" not in extra)


def test_lite_343m_flops():
    """The recipe's step: 8 windows of 4,096 tokens; the block masks halve the attention; the
    self-conditioning pass runs with probability 1 - 0.5^8."""
    cfg = load_config(REPO / "configs" / "lite_343m.py")
    f = G.lite_step_flops(cfg)
    assert f["tokens"] == 8 * 4096 and f["selfcond_probability"] == 1 - 0.5 ** 8
    assert f["model"] < f["hardware"] < G.lite_step_flops(cfg, dense_attention=True)["hardware"]
    assert 2.5 * f["per_token_6n"] < f["model"] < 3.2 * f["per_token_6n"]
    ar = G.lite_step_flops(load_config(REPO / "configs" / "lite_343m_ar.py"))
    assert ar["terms"]["decoder"] == ar["terms"]["selfcond"] == 0 and ar["model"] < f["model"] / 2


def test_peak_table():
    assert G.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert G.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert G.peak_tflops("NVIDIA H200") == 989.0
    assert G.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert G.peak_tflops("Some New GPU") is None and G.peak_tflops("Some New GPU", 500) == 500.0


def test_smoke_runs_the_whole_script(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_lite_gate.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Lite gate: configs/lite_debug.py" in r.stdout and "[SMOKE" in r.stdout
    res = json.loads((tmp_path / "lite_gate.json").read_text())
    t, s = res["train"], res["sampling"]
    assert res["smoke"] and t["finite"] and t["tokens_per_s"] > 0 and t["timed_steps"] == 2
    assert t["model_tflop_per_step"] > 0 and t["mfu"] is None  # no peak known for a CPU
    for row in s["rows"]:
        assert row["tokens_per_forward"] == pytest.approx(row["analytic_tokens_per_forward"], rel=1e-12)
    assert s["ar"]["tokens_per_forward"] == 1.0 and res["ar_parameters"] < res["parameters"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_a_gpu():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_lite_gate.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "no CUDA device" in r.stderr
