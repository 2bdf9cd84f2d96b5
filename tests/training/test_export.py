"""``dgemma export``: a full and a LoRA run, each loaded back by transformers (merged), by peft
(the adapter, unmerged) and by dgemma (the self-conditioning side file).

Comparisons are fp32 with transformers' eager attention against our sdpa, so they are bounded
relative to the largest logit (1e-5, as in tests/models/test_hf_parity.py), and each test also
checks that what it compares is far apart from what a wrong export would give.
"""

import json

import pytest
import torch
from peft import PeftModel
from transformers import Gemma3ForCausalLM

import dgemma
from dgemma.cli.main import main
from dgemma.errors import DGemmaError
from dgemma.models.weights import save_hf
from dgemma.training.config import apply_overrides, load_config
from dgemma.training.runs import load_run
from dgemma.training.trainer import build_model, train

RUN = ["--cfg.train.steps=2", "--cfg.train.checkpoint_every=2", "--cfg.optim.lr=0.05",
       "--cfg.optim.warmup_steps=1", "--cfg.data.batch_size=2", "--cfg.diffusion.selfcond_prob=1.0"]
IDS = torch.randint(3, 16, (2, 24), generator=torch.Generator().manual_seed(0))


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def ar_logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out)


def trained(tmp_path_factory, config: str, name: str):
    workdir = tmp_path_factory.mktemp(name)
    train(apply_overrides(load_config(config), [f"--cfg.workdir={workdir}", *RUN]))
    out = workdir / "export"
    assert main(["export", f"--cfg.workdir={workdir}", "--step=2", f"--out={out}"]) == 0
    return workdir, out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return trained(tmp_path_factory, "configs/sft_sudoku_full_tiny.py", "full")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    return trained(tmp_path_factory, "configs/sft_sudoku_tiny.py", "lora")


def hf_model(folder) -> Gemma3ForCausalLM:
    return Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def test_full_run_round_trips_through_transformers(full_run):
    workdir, out = full_run
    ours = load_run(workdir, step=2, device="cpu").model
    hf = hf_model(out)
    hf_state = hf.state_dict()
    for k, v in ours.state_dict().items():  # every Gemma weight bit-exact, the extras in the side file
        if k.startswith("model."):
            assert torch.equal(hf_state[k], v), k
    assert rel_err(ar_logits(hf), ar_logits(ours)) < 1e-5
    info = json.loads((out / "dgemma_export.json").read_text())
    assert info["step"] == 2 and info["lora"] is False and not (out / "adapter").exists()


def test_full_run_selfcond_restored_by_dgemma(full_run):
    workdir, out = full_run
    ours = load_run(workdir, step=2, device="cpu").model
    back, tokenizer = dgemma.load_pretrained(out)
    assert back.self_conditioning is not None
    assert ours.self_conditioning.mlp.down_proj.weight.abs().sum() > 0  # trained, not the zero init
    mine, theirs = ours.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_lora_run_merged_equals_our_unmerged_model(lora_run):
    workdir, out = lora_run
    ours = load_run(workdir, step=2, device="cpu", merge_lora=False).model  # LoRA still wrapped
    base, _ = build_model(apply_overrides(load_config(workdir / "config.json"), ["--cfg.lora.enabled=false"]))
    mine = ar_logits(ours)
    assert rel_err(ar_logits(base.eval()), mine) > 1e-3  # the adapter matters ...
    assert rel_err(ar_logits(hf_model(out)), mine) < 1e-5  # ... and survives the merge


def test_load_run_merges_lora_by_default(lora_run):
    """Inference loads fold the adapter into the base weights (one product per linear); the
    logits are the wrapped model's up to fp32 rounding, far from the base's."""
    workdir, _ = lora_run
    merged, wrapped = load_run(workdir, step=2, device="cpu"), load_run(workdir, step=2, device="cpu", merge_lora=False)
    assert (merged.lora, wrapped.lora) == ("merged", "adapter")
    assert not any("lora_" in n for n, _ in merged.model.named_parameters())
    assert any("lora_" in n for n, _ in wrapped.model.named_parameters())
    base, _ = build_model(apply_overrides(load_config(workdir / "config.json"), ["--cfg.lora.enabled=false"]))
    mine = ar_logits(wrapped.model)
    assert rel_err(ar_logits(base.eval()), mine) > 1e-3
    assert rel_err(ar_logits(merged.model), mine) < 1e-5
    bf16 = load_run(workdir, step=2, device="cpu", dtype="bfloat16")  # merged in fp32, then rounded once
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(bf16.model.state_dict()[w], merged.model.state_dict()[w].to(torch.bfloat16))


def test_lora_adapter_loads_in_peft_on_the_base(lora_run, tmp_path):
    workdir, out = lora_run
    ours = load_run(workdir, step=2, device="cpu").model
    cfg = load_config(workdir / "config.json")
    base, _ = build_model(apply_overrides(cfg, ["--cfg.lora.enabled=false"]))
    save_hf(base, None, tmp_path / "base")  # a random base has no folder of its own
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == cfg.lora.r and adapter_cfg["base_model_name_or_path"] is None
    peft_model = PeftModel.from_pretrained(hf_model(tmp_path / "base"), out / "adapter").eval()
    theirs, mine = ar_logits(peft_model), ar_logits(ours)
    assert rel_err(ar_logits(base.eval()), mine) > 1e-3
    assert rel_err(theirs, mine) < 1e-5


def test_lora_selfcond_restored_by_dgemma(lora_run):
    workdir, out = lora_run
    ours = load_run(workdir, step=2, device="cpu").model
    back, _ = dgemma.load_pretrained(out)
    sc_ours, sc_back = ours.self_conditioning.state_dict(), back.self_conditioning.state_dict()
    assert sc_ours["mlp.down_proj.weight"].abs().sum() > 0
    assert all(torch.equal(sc_ours[k], sc_back[k]) for k in sc_ours)
    assert (out / "adapter" / "diffusion_extras.safetensors").is_file()


def test_export_names_the_available_steps(lora_run, capsys):
    workdir, out = lora_run
    assert main(["export", f"--cfg.workdir={workdir}", "--step=7", f"--out={out}"]) == 2
    assert "available: [2]" in capsys.readouterr().err
    with pytest.raises(DGemmaError, match="unexpected arguments"):
        from dgemma.cli.export import run

        run([f"--cfg.workdir={workdir}", f"--out={out}", "stray"])
