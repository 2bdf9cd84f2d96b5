"""The shipped PubMedQA adapter (``checkpoints/pubmedqa_270m``) leaves dgemma intact: ``dgemma
export`` of it loads in transformers (merged) and in peft (the adapter on the Gemma 3 270M
base) with our logits, and dgemma restores its diffusion side (shift, self-conditioning).

fp32, transformers' eager attention against our sdpa: bounded relative to the largest logit.
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import Gemma3ForCausalLM

import dgemma
from dgemma.cli.main import main
from dgemma.data.sft import encode_prompts
from dgemma.training.runs import load_run

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "pubmedqa_270m"
RECORD = {"system": "Answer the question from the context, then end with \"The answer is: \" and yes, no or maybe.",
          "prompt": "Context:\nIn a randomised trial of 120 adults, daily walking lowered systolic blood pressure "
                    "by 6 mmHg against usual care.\n\nQuestion: Does daily walking lower blood pressure?"}


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out).float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("pubmedqa_export") / "export"
    assert main(["export", f"--cfg.workdir={SHIPPED}", f"--out={out}"]) == 0
    run = load_run(SHIPPED, dtype="float32", device="cpu")
    ids, valid, _ = encode_prompts(run.tokenizer, [RECORD], run.cfg.data.prompt_len)
    return out, run, ids[:, : int(valid.sum())]


def test_adapter_in_peft_on_the_base_gives_our_logits(exported):
    out, run, ids = exported
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    base = Gemma3ForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32,
                                             attn_implementation="eager").eval()
    plain = logits(base, ids)
    theirs = logits(PeftModel.from_pretrained(base, out / "adapter").eval(), ids)
    mine = logits(run.model.eval(), ids)
    assert rel_err(plain, mine) > 1e-3  # the adapter changes the model ...
    assert rel_err(theirs, mine) < 1e-5  # ... and peft applies it as we do


def test_merged_export_gives_our_logits_and_keeps_the_diffusion_side(exported):
    out, run, ids = exported
    merged = Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert rel_err(logits(merged, ids), logits(run.model.eval(), ids)) < 1e-5
    back, _ = dgemma.load_pretrained(out)
    assert back.config.shift_logits == run.model.config.shift_logits
    sc = run.model.self_conditioning.state_dict()
    assert all(torch.equal(v, back.self_conditioning.state_dict()[k]) for k, v in sc.items())


def test_both_shipped_models_are_complete_checkpoints_at_their_last_step():
    """What ``dgemma eval --cfg.workdir=...`` opens: the adapter (with its optimizer state, for
    ``dgemma export``) and the AR baseline in ``ar/`` (weights only); neither may be skipped."""
    from dgemma.training.checkpoint import latest_checkpoint, load_checkpoint

    for workdir, optim in ((SHIPPED, True), (SHIPPED / "ar", False)):
        path = latest_checkpoint(workdir)
        assert path is not None and path.name == "step_00000120", workdir
        state = load_checkpoint(path)
        assert (state["optim"] is not None) == optim and state["step"] == 120
