"""``dgemma average``: the new run holds exactly the weighted mean of its sources' evaluated
weights, opens like any run, refuses to be resumed, and bad input leaves nothing behind."""

import json

import pytest
import torch

from dgemma.cli.main import main
from dgemma.errors import DGemmaError
from dgemma.training import checkpoint as ckpt
from dgemma.training.average import average_runs
from dgemma.training.config import load_config
from dgemma.training.runs import find_checkpoint, load_run
from dgemma.training.trainer import train
from tests.conftest import train_tiny_sudoku


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """A second tiny run of the same architecture from another initial seed."""
    return train_tiny_sudoku(tmp_path_factory.mktemp("avg") / "other", "--cfg.init.seed=1")


def weights_of(workdir):
    return {k: v.double() for k, v in load_run(workdir, device="cpu").model.state_dict().items()}


def test_average_is_the_weighted_mean_of_the_evaluated_weights(tiny_run, other_run, tmp_path):
    out = tmp_path / "avg"
    path = average_runs([tiny_run, other_run], out, weights=[0.25, 0.75])
    a, b, m = weights_of(tiny_run), weights_of(other_run), weights_of(out)
    assert m.keys() == a.keys()
    for k in a:
        want = (0.25 * a[k] + 0.75 * b[k]).float().double() if a[k].is_floating_point() else a[k]
        assert torch.equal(m[k], want), k
    emb = "model.embed_tokens.weight"
    assert (m[emb] - a[emb]).abs().max() > 1e-3 and (m[emb] - b[emb]).abs().max() > 1e-3  # a real mix
    meta = json.loads((path / ckpt.META_FILE).read_text())
    assert [s["weight"] for s in meta["averaged_from"]] == [0.25, 0.75]
    assert [s["step"] for s in meta["averaged_from"]] == [10, 10] and meta["step"] == 10
    assert meta["averaged_from"][0]["model_sha256"] == json.loads(
        (ckpt.latest_checkpoint(tiny_run) / ckpt.META_FILE).read_text())["files"][ckpt.MODEL_FILE]["sha256"]
    assert ckpt.OPTIM_FILE not in meta["files"]
    assert load_config(out / "config.json").workdir == str(out)


def test_an_average_opens_for_evaluation_but_refuses_a_resume(tiny_run, other_run, tmp_path):
    out = tmp_path / "avg"
    assert main(["average", str(tiny_run), str(other_run), "--out", str(out), "--step", "7"]) == 0
    assert load_run(out, device="cpu").step == 7
    cfg = load_config(out / "config.json")
    with pytest.raises(DGemmaError, match="holds no optimizer state"):
        train(cfg)


@pytest.mark.parametrize("kwargs, match", [
    ({"weights": [0.5, 0.6]}, "sum to 1"),
    ({"weights": [1.5, -0.5]}, "positive"),
    ({"weights": [1.0]}, "one per run"),
    ({"steps": [10, 99]}, "no complete checkpoint for step 99"),
])
def test_bad_arguments_are_refused_and_write_nothing(tiny_run, other_run, tmp_path, kwargs, match):
    out = tmp_path / "avg"
    with pytest.raises(DGemmaError, match=match):
        average_runs([tiny_run, other_run], out, **kwargs)
    assert not out.exists()


def test_one_run_another_architecture_or_a_used_out_are_refused(tiny_run, tmp_path_factory, tmp_path):
    with pytest.raises(DGemmaError, match="at least two"):
        average_runs([tiny_run], tmp_path / "one")
    wide = train_tiny_sudoku(tmp_path_factory.mktemp("avg") / "wide", "--cfg.model.intermediate_size=64")
    with pytest.raises(DGemmaError, match=r"another architecture .*intermediate_size"):
        average_runs([tiny_run, wide], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    out = tmp_path / "avg"
    average_runs([tiny_run, tiny_run], out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(DGemmaError, match="already holds checkpoints"):
        average_runs([tiny_run, tiny_run], out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_the_shipped_solver_is_the_average_of_its_sources(tmp_path):
    """``checkpoints/sudoku_avg`` (``dgemma/shipped.py:SUDOKU``) is exactly what ``dgemma average``
    makes of the two runs its meta.json names, today: same sources, same bits."""
    from dgemma import shipped

    meta = json.loads((ckpt.latest_checkpoint(shipped.SUDOKU) / ckpt.META_FILE).read_text())
    sources = meta["averaged_from"]
    for s in sources:
        path = find_checkpoint(shipped.REPO / s["workdir"], s["step"])
        files = json.loads((path / ckpt.META_FILE).read_text())["files"]
        assert files[ckpt.MODEL_FILE]["sha256"] == s["model_sha256"], s["workdir"]
    average_runs([shipped.REPO / s["workdir"] for s in sources], tmp_path / "again",
                 weights=[s["weight"] for s in sources], steps=[s["step"] for s in sources], step=meta["step"])
    again, shipped_weights = weights_of(tmp_path / "again"), weights_of(shipped.SUDOKU)
    assert again.keys() == shipped_weights.keys()
    assert all(torch.equal(again[k], shipped_weights[k]) for k in again)
