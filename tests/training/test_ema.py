"""``train.ema``: the moving average of the trained weights against its definition (recomputed from
every step's saved raw weights), bitwise across a resume, evaluated by ``load_run``, and refused
where it makes no sense."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dgemma.errors import DGemmaError
from dgemma.training import checkpoint as ckpt
from dgemma.training.config import apply_overrides, load_config
from dgemma.training.ema import WeightEMA, ema_rate
from dgemma.training.runs import load_run
from dgemma.training.trainer import Trainer, build_model

ROOT = Path(__file__).resolve().parents[2]
FULL_TINY = "configs/sft_sudoku_full_tiny.py"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(workdir, *overrides: str):
    return apply_overrides(load_config(ROOT / FULL_TINY),
                           [f"--cfg.workdir={workdir}", "--cfg.data.batch_size=2", "--cfg.train.ema=0.9",
                            "--cfg.train.keep_last=null", *overrides])


def test_the_rate_warms_up_to_the_decay():
    assert [round(ema_rate(0.998, t), 4) for t in (0, 1, 2)] == [0.1, 0.1818, 0.25]
    assert ema_rate(0.998, 890) == pytest.approx(0.99) and ema_rate(0.998, 10_000) == 0.998


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """Four steps, a checkpoint after each: every raw weight the average saw is on disk."""
    workdir = tmp_path_factory.mktemp("ema") / "run"
    Trainer(config(workdir, "--cfg.train.steps=4", "--cfg.train.checkpoint_every=1")).run()
    return workdir


def test_the_average_is_its_definition(run4):
    init, _ = build_model(config(run4))  # the trainer's step-0 weights: the same seeded build
    shadow = {n: p.detach().float().clone() for n, p in init.named_parameters() if p.requires_grad}
    for t in range(4):
        raw = load_file(run4 / "checkpoints" / f"step_{t + 1:08d}" / "model.safetensors")
        w = 1.0 - ema_rate(0.9, t)
        shadow = {n: torch.lerp(s, raw[n].float(), w) for n, s in shadow.items()}
    saved = ckpt.load_checkpoint(run4 / "checkpoints" / "step_00000004")["extra"]["ema"]
    assert saved["updates"] == 4 and saved["decay"] == 0.9 and saved["weights"].keys() == shadow.keys()
    for n, s in shadow.items():
        torch.testing.assert_close(saved["weights"][n], s, rtol=0, atol=1e-7)
    raw = load_file(run4 / "checkpoints" / "step_00000004" / "model.safetensors")
    assert any(not torch.equal(raw[n].float(), s) for n, s in shadow.items())  # an average, not the last weights


def test_a_resumed_average_is_bitwise_the_uninterrupted_one(run4, tmp_path):
    workdir = tmp_path / "resumed"
    Trainer(config(workdir, "--cfg.train.steps=2", "--cfg.train.checkpoint_every=1")).run()
    t = Trainer(config(workdir, "--cfg.train.steps=4", "--cfg.train.checkpoint_every=1"))
    assert t.step == 2 and t.ema.updates == 2
    t.run()
    mine = ckpt.load_checkpoint(workdir / "checkpoints" / "step_00000004")["extra"]["ema"]
    ref = ckpt.load_checkpoint(run4 / "checkpoints" / "step_00000004")["extra"]["ema"]
    assert mine["updates"] == ref["updates"]
    for n in ref["weights"]:
        assert torch.equal(mine["weights"][n], ref["weights"][n]), n


def test_load_run_evaluates_the_average_unless_asked_for_the_raw_weights(run4):
    avg, raw = load_run(run4), load_run(run4, weights="raw")
    assert (avg.weights, raw.weights) == ("average", "raw")
    saved = ckpt.load_checkpoint(run4 / "checkpoints" / "step_00000004")
    a, r = dict(avg.model.named_parameters()), dict(raw.model.named_parameters())
    for n, t in saved["extra"]["ema"]["weights"].items():
        assert torch.equal(a[n].float(), t), n
        assert torch.equal(r[n], saved["model"][n]), n
    with pytest.raises(DGemmaError, match="weights must be 'average' or 'raw'"):
        load_run(run4, weights="ema")
    plain = load_run(run4, step=1)  # every checkpoint of this run has an average
    assert plain.weights == "average"


def test_applied_swaps_the_weights_in_and_back():
    model = torch.nn.Linear(3, 2)
    ema = WeightEMA(model, 0.5)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()  # rate 0.1 at t = 0: shadow = before + 0.9
    with ema.applied():
        torch.testing.assert_close(model.weight, before + 0.9)
    assert torch.equal(model.weight, before + 1.0)


def test_refusals(tmp_path):
    with pytest.raises(DGemmaError, match="ema must be a decay in"):
        config(tmp_path, "--cfg.train.ema=1.0")
    with pytest.raises(DGemmaError, match="decay in"):
        WeightEMA(torch.nn.Linear(2, 2), 0.0)
    ema = WeightEMA(torch.nn.Linear(2, 2), 0.9)
    with pytest.raises(DGemmaError, match="does not match this model"):
        ema.load_state_dict({"updates": 1, "weights": {"nope": torch.zeros(1)}})
