"""Checkpoints: round trip with tied weights, pruning, refusal of anything incomplete, and a
real SIGKILL in the middle of a save."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dgemma.errors import DGemmaError
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.training.checkpoint import (
    check_compatible,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_fingerprint,
    save_checkpoint,
)
from dgemma.training.config import Config, config_to_dict

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8.0)


def tiny_model(**kw):
    return DiffusionGemma(ModelConfig(**{**TINY, **kw}))


def save(wd, step, keep_last=None, model=None, **kw):
    model = model or tiny_model()
    cfg = Config(model=model.config)
    return save_checkpoint(wd, step, model_state=model.state_dict(), optim_state={"step": step},
                           extra_state={"step": step}, metadata={"config": config_to_dict(cfg), **kw},
                           keep_last=keep_last)


def steps(wd):
    return [s for s, _ in list_checkpoints(wd)]


def err(fn, *a, **k) -> str:
    with pytest.raises(DGemmaError) as e:
        fn(*a, **k)
    return str(e.value)


# -------------------------------------------------------------------------------- round trip
def test_round_trip_with_tied_weights_optimizer_and_rng(tmp_path):
    model = tiny_model(self_conditioning=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 5))
    model(ids).square().mean().backward()
    opt.step()
    rng = torch.get_rng_state()
    extra = {"rng": rng, "sampler": {"offset": 17, "order": [3, 1, 2]}, "py": (1, "a")}
    cfg = Config(model=model.config)
    path = save_checkpoint(tmp_path, 7, model_state=model.state_dict(), optim_state=opt.state_dict(),
                           extra_state=extra, metadata={"config": config_to_dict(cfg), "note": "x"},
                           keep_last=3)
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "optim.pt", "state.pt"]

    ck = load_checkpoint(path)
    assert ck["step"] == 7 and ck["extra"]["sampler"] == extra["sampler"] and ck["extra"]["py"] == (1, "a")
    assert torch.equal(ck["extra"]["rng"], rng)
    assert ck["model"]["lm_head.weight"] is ck["model"]["model.embed_tokens.weight"]
    meta = ck["meta"]
    assert meta["tensor_aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert meta["note"] == "x" and meta["config"] == json.loads(json.dumps(config_to_dict(cfg)))
    assert meta["model_fingerprint"] == model_fingerprint(model.config)
    assert meta["num_threads"] == torch.get_num_threads() and meta["torch_version"] == torch.__version__
    assert set(meta["files"]) == {"model.safetensors", "optim.pt", "state.pt"}
    assert all(len(f["sha256"]) == 64 for f in meta["files"].values())

    fresh = tiny_model(self_conditioning=True)
    fresh.load_state_dict(ck["model"])
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    opt2.load_state_dict(ck["optim"])
    for s1, s2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(model(ids), fresh(ids))


def test_shared_and_strided_tensors(tmp_path):
    buf = torch.arange(12.0)
    state = {"w": buf, "same": buf, "view_a": buf[:6], "view_b": buf[6:], "t": torch.arange(6.0).view(2, 3).t(),
             "empty": torch.zeros(0)}
    path = save_checkpoint(tmp_path, 1, model_state=state, optim_state=None, extra_state={}, metadata={},
                           keep_last=None)
    ck = load_checkpoint(path)
    assert ck["optim"] is None and ck["model"]["same"] is ck["model"]["w"]
    for k, v in state.items():
        assert torch.equal(ck["model"][k], v), k


def test_resaving_a_step_replaces_it(tmp_path):
    save(tmp_path, 3, note="first")
    save(tmp_path, 3, note="second")
    assert steps(tmp_path) == [3] and load_checkpoint(latest_checkpoint(tmp_path))["meta"]["note"] == "second"


def test_metadata_must_be_json_and_not_reserved(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        save(tmp_path, 1, bad=object())
    with pytest.raises(ValueError, match="reserved"):
        save(tmp_path, 1, files=1)
    assert not (tmp_path / "checkpoints").exists() or steps(tmp_path) == []


# ------------------------------------------------------------------------------------ pruning
def test_keep_last_prunes_oldest(tmp_path):
    for s in (10, 20, 30, 40, 50):
        save(tmp_path, s, keep_last=2)
    assert steps(tmp_path) == [40, 50]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000040", "step_00000050"]
    for s in (60, 70):
        save(tmp_path, s, keep_last=None)
    assert steps(tmp_path) == [40, 50, 60, 70]
    assert latest_checkpoint(tmp_path).name == "step_00000070"


def test_pruning_counts_complete_checkpoints_only(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_00000002" / "meta.json").unlink()
    save(tmp_path, 3, keep_last=2)
    assert steps(tmp_path) == [1, 3]


# ----------------------------------------------------------------------- incomplete / corrupt
def test_stale_temp_dir_is_ignored_then_removed(tmp_path):
    save(tmp_path, 1)
    stale = tmp_path / "checkpoints" / ".tmp_step_00000002_deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    assert latest_checkpoint(tmp_path).name == "step_00000001" and steps(tmp_path) == [1]
    assert "temporary directory of an unfinished save" in err(load_checkpoint, stale)
    save(tmp_path, 2)
    assert not stale.exists() and steps(tmp_path) == [1, 2]


def test_step_dir_without_meta_is_skipped_and_refused(tmp_path):
    save(tmp_path, 1)
    p2 = save(tmp_path, 2)
    (p2 / "meta.json").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000001" and steps(tmp_path) == [1]
    assert err(load_checkpoint, p2) == (
        f"checkpoint {p2} is incomplete or corrupt: meta.json is missing "
        "(the save was interrupted or the directory was copied partially)")


@pytest.mark.parametrize("name", ["model.safetensors", "optim.pt", "state.pt"])
def test_tampered_file_same_size_is_skipped_and_refused(tmp_path, name):
    save(tmp_path, 1)
    p2 = save(tmp_path, 2)
    f = p2 / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert steps(tmp_path) == [1, 2]  # the cheap listing checks sizes only
    msg = err(load_checkpoint, p2)
    assert msg.startswith(f"checkpoint {p2} is incomplete or corrupt: {name} has sha256 ")
    assert msg.endswith("(corrupt or modified)")


def test_truncated_safetensors_is_refused(tmp_path):
    p = save(tmp_path, 1)
    f = p / "model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    assert latest_checkpoint(tmp_path) is None and steps(tmp_path) == []
    assert err(load_checkpoint, p, verify=False) == (
        f"checkpoint {p} is incomplete or corrupt: model.safetensors is {size // 2} bytes, "
        f"meta.json records {size} (truncated or replaced)")


def test_missing_file_and_bad_meta_are_refused(tmp_path):
    p = save(tmp_path, 1)
    (p / "state.pt").unlink()
    assert err(load_checkpoint, p).endswith("state.pt is missing")
    p = save(tmp_path, 2)
    (p / "meta.json").write_text("{ not json")
    assert "meta.json is unreadable" in err(load_checkpoint, p)
    assert latest_checkpoint(tmp_path) is None
    assert err(load_checkpoint, tmp_path / "nowhere") == f"checkpoint {tmp_path / 'nowhere'} does not exist"


def test_unreadable_safetensors_with_matching_meta_names_the_file(tmp_path):
    p = save(tmp_path, 1)
    f = p / "model.safetensors"
    f.write_bytes(b"\xff" * f.stat().st_size)
    msg = err(load_checkpoint, p, verify=False)
    assert msg.startswith(f"checkpoint {p}: cannot read model.safetensors:")


# ------------------------------------------------------------------------------ architecture
def test_architecture_mismatch_lists_every_field(tmp_path):
    ck = load_checkpoint(save(tmp_path, 5))
    check_compatible(ck["meta"], ModelConfig(**TINY))
    check_compatible(ck["meta"], ModelConfig(**TINY, attn_implementation="eager", sliding_window=4))
    other = ModelConfig(**{**TINY, "vocab_size": 80, "hidden_size": 24}, self_conditioning=True)
    assert err(check_compatible, ck["meta"], other) == (
        "checkpoint step 5 was trained with vocab_size=64 hidden_size=16 self_conditioning=False; "
        "this config has vocab_size=80 hidden_size=24 self_conditioning=True")
    assert err(check_compatible, ck["meta"], other.to_dict(), source="runs/a").startswith(
        "checkpoint runs/a was trained with vocab_size=64")


def test_fingerprint_from_config_when_meta_lacks_it():
    meta = {"step": 1, "config": {"model": {**TINY, "layer_types": ["full_attention"] * 2}}}
    assert err(check_compatible, meta, ModelConfig(**TINY)) == (
        "checkpoint step 1 was trained with layer_types=[2x'full_attention']; "
        "this config has layer_types=[2x'sliding_attention']")
    assert "records no model architecture" in err(check_compatible, {"step": 1}, ModelConfig(**TINY))


def test_fingerprint_ignores_inactive_blocks():
    a = model_fingerprint(ModelConfig(**TINY, selfcond_variant="postnorm"))
    assert a == model_fingerprint(ModelConfig(**TINY)) and "selfcond_variant" not in a
    b = model_fingerprint(ModelConfig(**TINY, self_conditioning=True))
    assert b["selfcond_intermediate_size"] == TINY["hidden_size"]
    assert b == model_fingerprint(ModelConfig(**TINY, self_conditioning=True, selfcond_intermediate_size=16))


# -------------------------------------------------------------------------------- real crash
CHILD = textwrap.dedent("""
    import os, sys, time, torch
    import dgemma.training.checkpoint as ck
    wd, stage, ready, mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def park():
        open(ready, "w").close()
        time.sleep(600)

    if stage in ("model.safetensors", "optim.pt", "state.pt"):
        real = ck._fsync_file
        def hooked(path):
            real(path)
            if os.path.basename(path) == stage:
                park()
        ck._fsync_file = hooked
    elif stage == "before_rename":
        real_dir = ck._fsync_dir
        def hooked_dir(path):
            real_dir(path)
            if os.path.basename(path).startswith(".tmp_step"):
                park()
        ck._fsync_dir = hooked_dir
    n = mb * 2**20 // 4  # float32 elements in `mb` MiB; the optimiser state is a quarter of it
    state = {f"w{i}": torch.full((n // 4,), float(i)) for i in range(4)}
    if stage == "natural":
        open(ready, "w").close()
    ck.save_checkpoint(wd, 2, model_state=state, optim_state={"m": state["w0"].clone(), "v": state["w1"].clone()},
                       extra_state={"s": 2}, metadata={}, keep_last=1)
""")


def run_and_kill(tmp_path, stage, mb):
    ready = tmp_path / f"ready_{stage}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), stage, str(ready), str(mb)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"child exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "child never reached the kill point"
            time.sleep(0.001)
        if stage == "natural":  # no hook: kill once torch.save has begun streaming optim.pt
            while not any(f.stat().st_size > 0 for f in (tmp_path / "checkpoints").glob(".tmp_step*/optim.pt")):
                assert proc.poll() is None, "the save finished before it could be killed"
                time.sleep(0.0002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("stage", ["model.safetensors", "optim.pt", "state.pt", "before_rename"])
def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path, stage):
    first = save(tmp_path, 1)
    run_and_kill(tmp_path, stage, mb=8)
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step_00000002" not in leftovers and any(n.startswith(".tmp_step_00000002") for n in leftovers)
    assert latest_checkpoint(tmp_path) == first and steps(tmp_path) == [1]
    assert load_checkpoint(first)["step"] == 1
    save(tmp_path, 3, keep_last=1)  # the next save cleans up and prunes as usual
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]


def test_sigkill_during_a_large_write(tmp_path):
    first = save(tmp_path, 1)
    run_and_kill(tmp_path, "natural", mb=128)
    assert latest_checkpoint(tmp_path) == first and steps(tmp_path) == [1]
    assert load_checkpoint(first)["step"] == 1
    save(tmp_path, 3, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000003"]
