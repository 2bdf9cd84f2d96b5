"""The trainer: the CLI end to end, bitwise kill-and-resume with real SIGKILLs, NaN rollback,
token-normalised gradient accumulation, the memory pre-check, refusal of a foreign checkpoint,
and the reference recipes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dgemma.diffusion.objective import Plan
from dgemma.errors import DGemmaError
from dgemma.models.masks import TokenInfo
from dgemma.training import checkpoint as ckpt
from dgemma.training import trainer as trainer_mod
from dgemma.training.config import apply_overrides, load_config
from dgemma.training.trainer import (Trainer, TrainModule, build_model, build_objective, build_train_data,
                                     check_memory, train_step)

ROOT = Path(__file__).resolve().parents[2]
LORA_TINY, FULL_TINY = "configs/sft_sudoku_tiny.py", "configs/sft_sudoku_full_tiny.py"
# A short run with a checkpoint every 2 steps; the config pins train.threads=1 (the bits depend on it).
RUN = ["--cfg.train.steps=6", "--cfg.train.checkpoint_every=2", "--cfg.data.batch_size=2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and on a loaded 2-core machine two threads spin
    against each other (measured: 30x slower). The trainer also sets ``train.threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(path: str, workdir, *overrides: str):
    return apply_overrides(load_config(ROOT / path), [f"--cfg.workdir={workdir}", *overrides])


def records(workdir) -> list[dict]:
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(workdir) if r.get("split") == "train"}


def scalars(workdir, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(workdir) / "tb"))
    acc.Reload()
    return acc.Scalars(tag)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------ subprocesses
def start(workdir, *extra: str, slow_save: float | None = None) -> subprocess.Popen:
    """``python -m dgemma train`` in a real process. ``slow_save`` sleeps before every fsync of a
    checkpoint file (through a ``sitecustomize`` on PYTHONPATH), so a kill can land mid-write."""
    env = dict(os.environ)
    if slow_save:
        hook = Path(workdir).parent / f"{Path(workdir).name}_hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(textwrap.dedent("""
            import os, time
            import dgemma.training.checkpoint as c
            _fsync = c._fsync_file
            def _slow(path):
                time.sleep(float(os.environ["DGEMMA_TEST_SLOW_SAVE"]))
                _fsync(path)
            c._fsync_file = _slow
        """))
        env.update(DGEMMA_TEST_SLOW_SAVE=str(slow_save),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")])))
    Path(workdir).parent.mkdir(parents=True, exist_ok=True)
    log = open(f"{workdir}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "dgemma", "train", f"--cfg={LORA_TINY}", f"--cfg.workdir={workdir}",
                             *RUN, *extra], cwd=ROOT, env=env, stdout=log, stderr=log)


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 120.0) -> float:
    t0 = time.perf_counter()
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"training exited (rc {proc.returncode}) before {what}")
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)
    return time.perf_counter() - t0


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run, through the CLI as a user would start it."""
    workdir = tmp_path_factory.mktemp("ref") / "run"
    proc = subprocess.run([sys.executable, "-m", "dgemma", "train", f"--cfg={LORA_TINY}", f"--cfg.workdir={workdir}",
                           *RUN], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


def test_cli_run_writes_tensorboard_metrics_progress_and_checkpoints(reference):
    workdir, proc = reference
    assert "train: 100%" in proc.stderr and "6/6" in proc.stderr and "step/s" in proc.stderr
    assert "done: step 6" in proc.stdout
    assert sorted(losses(workdir)) == [1, 2, 3, 4, 5, 6]
    row = next(r for r in records(workdir) if r.get("step") == 6 and r.get("split") == "train")
    assert {"loss", "diffusion_loss", "ar_loss", "grad_norm", "lr", "tokens_per_s", "rss_gib"} <= row.keys()
    assert 0.05 < row["rss_gib"] < 64  # a CPU step logs the process's resident memory (dgemma/device.py)
    events = list((workdir / "tb").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in ckpt.list_checkpoints(workdir)] == [2, 4, 6]
    assert load_config(workdir / "config.json").train.steps == 6


def test_kill_and_resume_is_bitwise_identical(reference, tmp_path):
    ref_dir, _ = reference
    workdir = tmp_path / "run"
    root = workdir / "checkpoints"

    # 1. SIGKILL right after the first checkpoint is complete (renamed into place)
    proc = start(workdir)
    t_first = wait_for(proc, lambda: (root / "step_00000002").is_dir(), "checkpoint 2")
    kill(proc)
    assert not (root / "step_00000006").exists()

    # 2. SIGKILL in the middle of writing the next one
    proc = start(workdir, slow_save=0.3)
    t_tmp = wait_for(proc, lambda: any(root.glob(".tmp_step_*")), "a checkpoint being written")
    kill(proc)
    tmp = list(root.glob(".tmp_step_*"))
    assert tmp and not (tmp[0] / ckpt.META_FILE).exists()
    partial_step = int(tmp[0].name.split("_")[2])  # .tmp_step_00000004_<uuid>
    latest = ckpt.latest_checkpoint(workdir)
    assert latest is not None and int(latest.name[5:]) < partial_step

    # 3. resume to the end
    t0 = time.perf_counter()
    proc = start(workdir)
    assert proc.wait(300) == 0
    t_last = time.perf_counter() - t0
    log = Path(f"{workdir}.log").read_text()
    assert log.count("resumed from") == 2
    assert not list(root.glob(".tmp_step_*"))

    mine, ref = root / "step_00000006", ref_dir / "checkpoints" / "step_00000006"
    assert_same_tensors(load_file(mine / "model.safetensors"), load_file(ref / "model.safetensors"))
    optim_mine = torch.load(mine / "optim.pt", weights_only=True)
    optim_ref = torch.load(ref / "optim.pt", weights_only=True)
    assert optim_mine["param_groups"] == optim_ref["param_groups"]
    for k, state in optim_ref["state"].items():
        assert_same_tensors(optim_mine["state"][k], state)
    # the steps the killed runs logged after their checkpoint were redone: each is logged once, as uninterrupted
    train_steps = [r["step"] for r in records(workdir) if r.get("split") == "train"]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    assert losses(workdir) == losses(ref_dir)
    mine = scalars(workdir, "train/loss")  # every event file of the three processes, in order
    assert [e.step for e in mine] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in mine] == [e.value for e in scalars(ref_dir, "train/loss")]
    print(f"\nkill/resume: first checkpoint after {t_first:.1f}s, temp dir seen after {t_tmp:.1f}s, "
          f"final resume ran {t_last:.1f}s")


def test_rewind_metrics_keeps_what_was_logged_up_to_the_resumed_step(tmp_path):
    from dgemma.training.trainer import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "split": "train"}, {"step": 2, "event": "checkpoint step_00000002"},
            {"step": 3, "split": "train"}, {"step": 4, "split": "train"}, {"step": 3, "split": "train"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"st')  # the last line torn by a kill
    assert rewind_metrics(path, 2) == 4
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:2]
    assert rewind_metrics(path, 2) == 0 and not (tmp_path / "metrics.jsonl.tmp").exists()


def test_an_evaluation_cut_off_at_the_checkpoint_step_is_redone_on_resume(tmp_path):
    """A kill during the evaluation that follows checkpoint 2 leaves no eval row of step 2: the
    resumed run evaluates step 2 before step 3, and its log equals an uninterrupted run's."""
    from dgemma.training.trainer import Trainer

    def run(workdir, calls):
        def hook(trainer, step):
            calls.append(step)
            return {"probe": float(sum(p.detach().double().sum() for p in trainer.model.parameters()))}

        Trainer(config(LORA_TINY, workdir, "--cfg.train.steps=4", "--cfg.train.checkpoint_every=2",
                       "--cfg.train.eval_every=2", "--cfg.data.batch_size=2"), hooks=[hook]).run()

    ref_calls, calls = [], []
    run(tmp_path / "ref", ref_calls)
    run(tmp_path / "run", calls)
    assert ref_calls == calls == [2, 4]
    # what a kill in the middle of step 2's evaluation leaves: checkpoint 2, no eval row of step 2 yet
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")
    path = tmp_path / "run" / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines()
            if (row := json.loads(line))["step"] < 2 or (row["step"] == 2 and row.get("split") != "eval")]
    path.write_text("".join(line + "\n" for line in kept))
    assert not any(r.get("split") == "eval" for r in records(tmp_path / "run"))
    calls.clear()
    run(tmp_path / "run", calls)
    assert calls == [2, 4]
    rows = lambda w: [(r["step"], r.get("split"), r.get("loss", r.get("probe"))) for r in records(w) if "split" in r]
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")


# ------------------------------------------------------------------------------- rollback
class NaNOn:
    """The real objective, with non-finite losses while ``trainer.step`` is in ``bad``."""

    def __init__(self, inner, trainer, bad: range):
        self.inner, self.trainer, self.bad = inner, trainer, bad

    def run(self, model, batch, plan):
        terms = self.inner.run(model, batch, plan)
        if self.trainer.step in self.bad:
            terms.diffusion_sum = terms.diffusion_sum * float("nan")
        return terms

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_nan_steps_roll_back_to_the_last_checkpoint_and_training_continues(tmp_path):
    cfg = config(FULL_TINY, tmp_path, "--cfg.train.steps=18", "--cfg.train.checkpoint_every=8",
                 "--cfg.data.batch_size=2", "--cfg.optim.warmup_steps=1")
    trainer = Trainer(cfg)
    trainer.module.objective = NaNOn(trainer.objective, trainer, range(10, 15))  # steps 11-15 fail
    seen = []
    rollback = trainer.rollback

    def spy():
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        rollback()
        seen.append((trainer.step, before, {k: v.clone() for k, v in trainer.model.state_dict().items()},
                     [g["lr"] for g in trainer.optimizer.param_groups], trainer.scheduler.get_last_lr()))

    trainer.rollback = spy
    trainer.run()

    assert len(seen) == 1
    step, before, after, lrs, scheduled = seen[0]
    assert step == 15
    state = ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_00000008")
    saved = state["model"]
    assert_same_tensors({k: after[k] for k in saved}, saved)
    assert any(not torch.equal(before[k], saved[k]) for k in saved)  # steps 9-10 had moved them
    assert lrs == scheduled != [g["lr"] for g in state["optim"]["param_groups"]]  # this step's rate, not step 8's

    rows = records(tmp_path)
    events = [r for r in rows if "event" in r]
    assert [r["step"] for r in events if r["event"].startswith("non-finite")] == [11, 12, 13, 14, 15]
    assert [r["step"] for r in events if r["event"].startswith("rollback")] == [15]
    after_rollback = {s: l for s, l in losses(tmp_path).items() if s > 15}
    assert sorted(after_rollback) == [16, 17, 18] and all(map(torch.isfinite, torch.tensor([*after_rollback.values()])))
    final = ckpt.load_checkpoint(tmp_path / "checkpoints" / "step_00000018")["model"]
    assert any(not torch.equal(final[k], saved[k]) for k in saved)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no step ever succeeds
def test_rollback_without_a_checkpoint_is_a_clear_error(tmp_path):
    cfg = config(FULL_TINY, tmp_path, "--cfg.train.steps=8", "--cfg.train.checkpoint_every=8",
                 "--cfg.data.batch_size=1", "--cfg.train.nan_rollback_after=2")
    trainer = Trainer(cfg)
    trainer.module.objective = NaNOn(trainer.objective, trainer, range(0, 8))
    with pytest.raises(DGemmaError, match="2 consecutive non-finite steps at step 2 and no checkpoint"):
        trainer.run()


# ----------------------------------------------------------------------- gradient accumulation
class RowwisePlans:
    """The real objective planning each row with its own generator (seeded by ``batch["seed"]``),
    so a row draws the same noise in any micro-batch: what is left to compare is normalisation."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # every setting (certainty_weight, ...) is the real objective's
        return getattr(self.inner, name)

    def plan(self, batch, generator):
        rows = [self.inner.plan({k: v[i:i + 1] for k, v in batch.items() if k != "seed"},
                                torch.Generator().manual_seed(int(batch["seed"][i])))
                for i in range(len(batch["seed"]))]
        cat = lambda name: torch.cat([getattr(r, name) for r in rows])  # noqa: E731
        noisy = TokenInfo(*(torch.cat([getattr(r.noisy, f) for r in rows]) for f in ("positions", "blocks", "noisy",
                                                                                      "valid")))
        return Plan(chosen=cat("chosen"), t=cat("t"), x0=cat("x0"), weight=None, xt=cat("xt"), target=cat("target"),
                    noisy=noisy,
                    selfcond_rows=cat("selfcond_rows"), diffusion_count=sum(r.diffusion_count for r in rows),
                    ar_count=sum(r.ar_count for r in rows))


class Capture(torch.optim.SGD):
    """Records the gradients it is asked to apply, and applies nothing (lr 0)."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def test_grad_accum_equals_one_big_batch(tmp_path):
    cfg = config(FULL_TINY, tmp_path, "--cfg.diffusion.selfcond_prob=0.5")
    model, tok = build_model(cfg)
    model = model.double()
    objective = build_objective(cfg, model, tok)
    batch = build_train_data(cfg, tok).batch([0, 1, 2, 3])
    batch["seed"] = torch.tensor([11, 12, 13, 14])
    for i, n in enumerate([5, 23]):  # short prompts in the first half: the halves' token counts differ
        batch["prompt_valid"][i, n:] = False
        batch["prompt_ids"][i, n:] = tok.pad_id
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    rowwise = RowwisePlans(objective)
    counts = [rowwise.plan(h, None).ar_count for h in halves]
    assert counts[1] > 1.5 * counts[0]

    results = []
    for batches in ([batch], halves):
        opt = Capture(model.parameters(), lr=0.0)
        out = train_step(TrainModule(model, objective), batches, opt, step=0, seed=0, rank=0, world=1,
                         clip_norm=None, ar_weight=1.0, objective=rowwise)
        results.append((out, opt.grads))
    (one, g1), (two, g2) = results
    for key in ("loss", "diffusion_loss", "ar_loss", "grad_norm", "tokens"):
        assert one[key] == pytest.approx(two[key], rel=1e-6), key
    assert len(g1) == len(g2)
    for a, b in zip(g1, g2):  # fp32 steps (RMSNorm, the loss's log-sum-exp) see other batch shapes
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    assert one["grad_norm"] > 0


def test_certainty_weight_is_logged_and_added_to_the_loss(tmp_path):
    """``diffusion.certainty_weight``: the step logs the certainty term, adds it to ``loss`` with its
    weight, leaves the cross-entropy as it was and changes the gradient (same plan, fp64)."""
    outs = []
    for w in (0.0, 0.7):
        cfg = config(FULL_TINY, tmp_path, f"--cfg.diffusion.certainty_weight={w}", "--cfg.diffusion.loss_on=all")
        model, tok = build_model(cfg)
        model = model.double()
        objective = build_objective(cfg, model, tok)
        opt = Capture(model.parameters(), lr=0.0)
        out = train_step(TrainModule(model, objective), [build_train_data(cfg, tok).batch([0, 1])], opt, step=0,
                         seed=0, rank=0, world=1, clip_norm=None, ar_weight=1.0, objective=objective)
        outs.append((out, opt.grads))
    (plain, g0), (cert, g1) = outs
    assert "certainty" not in plain and cert["certainty"] > 0
    assert cert["diffusion_loss"] == plain["diffusion_loss"] and cert["ar_loss"] == plain["ar_loss"]
    assert cert["loss"] == pytest.approx(plain["loss"] + 0.7 * cert["certainty"], rel=1e-12)
    assert any(not torch.equal(a, b) for a, b in zip(g0, g1))


# --------------------------------------------------------------------------------- refusals
def test_memory_precheck_refuses_an_absurd_batch(tmp_path):
    cfg = config(FULL_TINY, tmp_path, "--cfg.data.batch_size=10000000")
    with pytest.raises(DGemmaError, match=r"needs about .* GiB but .* free .*largest terms: activations"):
        Trainer(cfg)


def test_a_failed_memory_estimate_is_logged_not_silent(tmp_path, monkeypatch):
    cfg = config(FULL_TINY, tmp_path)
    model, _ = build_model(cfg)

    def broken(device):
        raise OSError("no meminfo")

    monkeypatch.setattr(trainer_mod, "available_memory", broken)
    said = []
    assert check_memory(model, cfg, torch.device("cpu"), said.append) == {}
    assert said == ["memory estimate failed (OSError: no meminfo); continuing without a pre-check"]


def test_resume_refuses_a_checkpoint_of_another_architecture(tmp_path):
    Trainer(config(FULL_TINY, tmp_path, "--cfg.train.steps=1", "--cfg.data.batch_size=1")).run()
    saved_config = (tmp_path / "config.json").read_text()
    cfg = config(FULL_TINY, tmp_path, "--cfg.train.steps=2", "--cfg.data.batch_size=1", "--cfg.model.hidden_size=32")
    with pytest.raises(DGemmaError, match=r"step_00000001 was trained with hidden_size=64 .*; this config has "
                                          r"hidden_size=32"):
        Trainer(cfg)
    assert (tmp_path / "config.json").read_text() == saved_config


def test_an_inference_only_checkpoint_evaluates_but_refuses_to_resume(tmp_path):
    """``drop_optimizer_state`` (how the shipped AR baseline is stored): the weights load as the
    latest complete checkpoint, identical to before; a resume says why it cannot go on."""
    from dgemma.training.checkpoint import drop_optimizer_state, latest_checkpoint, load_checkpoint
    from dgemma.training.runs import load_run

    Trainer(config(FULL_TINY, tmp_path, "--cfg.train.steps=1", "--cfg.data.batch_size=1")).run()
    path = latest_checkpoint(tmp_path)
    before = load_checkpoint(path)["model"]
    assert drop_optimizer_state(path) > 0 and not (path / "optim.pt").exists()
    assert drop_optimizer_state(path) == 0  # already dropped
    assert latest_checkpoint(tmp_path) == path
    after = load_run(tmp_path).model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    cfg = config(FULL_TINY, tmp_path, "--cfg.train.steps=2", "--cfg.data.batch_size=1")
    with pytest.raises(DGemmaError, match="holds no optimizer state .*dropped.*not resumed"):
        Trainer(cfg).run()


def test_a_warm_start_takes_the_weights_and_nothing_else(tmp_path):
    """``init.weights``: step 0 holds the source's weights exactly (a step folder or a workdir),
    the optimiser starts empty, a run with checkpoints of its own resumes from them instead, and
    another architecture or an empty folder is refused by name."""
    src = tmp_path / "src"
    Trainer(config(FULL_TINY, src, "--cfg.train.steps=2", "--cfg.data.batch_size=1")).run()
    weights = ckpt.load_checkpoint(ckpt.latest_checkpoint(src))["model"]
    for source in (src, ckpt.latest_checkpoint(src)):
        t = Trainer(config(FULL_TINY, tmp_path / "warm", f"--cfg.init.weights={source}", "--cfg.init.seed=5",
                           "--cfg.train.steps=1", "--cfg.data.batch_size=1", "--cfg.train.resume=false"))
        assert t.step == 0 and not t.optimizer.state
        assert_same_tensors({k: v for k, v in t.model.state_dict().items() if k in weights}, weights)
    fresh = Trainer(config(FULL_TINY, tmp_path / "fresh", "--cfg.init.seed=5", "--cfg.train.steps=1",
                           "--cfg.data.batch_size=1"))
    assert not all(torch.equal(fresh.model.state_dict()[k], v) for k, v in weights.items())
    t.run()  # one step on top of the source's weights, then a resume wins over init.weights
    again = Trainer(config(FULL_TINY, tmp_path / "warm", f"--cfg.init.weights={src}", "--cfg.train.steps=2",
                           "--cfg.data.batch_size=1"))
    assert again.step == 1
    with pytest.raises(DGemmaError, match="trained with hidden_size=64 .*this config has hidden_size=32"):
        Trainer(config(FULL_TINY, tmp_path / "other", f"--cfg.init.weights={src}", "--cfg.model.hidden_size=32"))
    with pytest.raises(DGemmaError, match="neither a checkpoint folder nor a workdir"):
        Trainer(config(FULL_TINY, tmp_path / "none", f"--cfg.init.weights={tmp_path / 'empty'}"))


def test_a_deepened_warm_start_computes_its_source_exactly(tmp_path):
    """``init.layer_map=[0, 1, 0, 1]`` on a 2-layer source: 4 layers whose repeated two add
    exactly nothing at step 0 (same logits, bit for bit), whose weights are the source's, and
    which the first optimiser step then switches on."""
    src = tmp_path / "src"
    Trainer(config(FULL_TINY, src, "--cfg.train.steps=1", "--cfg.data.batch_size=1")).run()
    from dgemma.training.runs import load_run

    source = load_run(src).model
    deep_args = [f"--cfg.init.weights={src}", "--cfg.init.layer_map=0,1,0,1", "--cfg.model.num_hidden_layers=4",
                 "--cfg.model.layer_types=sliding_attention,full_attention,sliding_attention,full_attention",
                 "--cfg.train.steps=1", "--cfg.data.batch_size=1"]
    t = Trainer(config(FULL_TINY, tmp_path / "deep", *deep_args))
    deep = t.model.eval()
    ids = torch.randint(3, 16, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(deep(ids), source(ids))
    sd = deep.state_dict()
    assert torch.equal(sd["model.layers.2.self_attn.q_proj.weight"], source.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert (sd["model.layers.3.post_feedforward_layernorm.weight"] == -1).all()
    t.run()
    after = load_run(tmp_path / "deep").model.state_dict()
    assert not (after["model.layers.3.post_feedforward_layernorm.weight"] == -1).all()
    with pytest.raises(DGemmaError, match=r"must name one of the source's 2 layers for each of this model's 4"):
        Trainer(config(FULL_TINY, tmp_path / "bad", *deep_args[:1], "--cfg.init.layer_map=0,1,2,1", *deep_args[2:]))
    with pytest.raises(DGemmaError, match="gives layer types"):
        Trainer(config(FULL_TINY, tmp_path / "bad2", *deep_args[:1], "--cfg.init.layer_map=0,0,1,1", *deep_args[2:]))
    with pytest.raises(DGemmaError, match="set init.weights too"):
        config(FULL_TINY, tmp_path / "bad3", "--cfg.init.layer_map=0")


# -------------------------------------------------------------------------------- PubMedQA
def byte_tokenizer(folder: Path) -> Path:
    """Byte-level BPE without merges plus Gemma's special tokens: any English, 261 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dgemma.data.tokenizers import Tokenizer as Wrapper

    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    Wrapper(backend).save(folder)
    return folder / "tokenizer.json"


def test_pubmedqa_tiny_trains_on_two_canvases_of_english(tmp_path):
    from dgemma.tasks.pubmedqa import write_splits

    source = ROOT.parent / "shared" / "data" / "pubmedqa"
    if not (source / "ori_pqal.json").is_file():
        pytest.skip(f"PubMedQA source files not found in {source}")
    write_splits(source, tmp_path / "data")
    tokenizer = byte_tokenizer(tmp_path / "tok")
    cfg = config("configs/sft_pubmedqa_tiny.py", tmp_path / "run", f"--cfg.data.path={tmp_path / 'data'}",
                 f"--cfg.data.tokenizer={tokenizer}", "--cfg.model.vocab_size=264", "--cfg.train.steps=2")
    trainer = Trainer(cfg)
    assert trainer.tokenizer.decode(trainer.tokenizer.encode("Is it yes?")) == "Is it yes?"
    assert trainer.data.num_truncated == len(trainer.data)  # every context is longer than 128 bytes
    batch = trainer.data.batch([0, 1])
    assert batch["canvas_mask"].all()  # long answers fill both canvases
    out = trainer.run()
    assert out["finite"] and sorted(losses(tmp_path / "run")) == [1, 2]


# -------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("name,lora_r,batch,prompt,canvases,lr,warmup,optim,task", [
    ("sft_sudoku", 8, 8, 256, (1, 256), 1.5e-4, 100, "adamw", "sudoku"),
    ("sft_sudoku_full", None, 8, 256, (1, 256), 1.5e-4, 1000, "adafactor", "sudoku"),
    ("sft_pubmedqa", 4, 2, 1024, (2, 128), 1e-4, 100, "adamw", "pubmedqa"),
])
def test_reference_recipes(name, lora_r, batch, prompt, canvases, lr, warmup, optim, task):
    path = ROOT / "configs" / f"{name}.py"
    source = path.read_text()
    assert "configs" not in source.split('"""', 2)[2] and "load_config" not in source  # flat
    cfg = load_config(path)
    assert cfg.init.base == "gemma3-270m"
    assert cfg.lora.enabled == (lora_r is not None) and (lora_r is None or cfg.lora.r == lora_r)
    assert cfg.lora.target_modules == "all-linear"
    assert cfg.train.activation_checkpointing == (name == "sft_sudoku_full")
    assert (cfg.data.batch_size, cfg.data.prompt_len, cfg.data.task, cfg.data.path) == (batch, prompt, task,
                                                                                         f"data/{task}")
    d = cfg.diffusion
    assert (d.num_canvases, d.canvas_size) == canvases
    assert (d.process, d.schedule, d.t_eps, d.selfcond_prob, d.ar_loss_weight) == ("uniform", "linear", 1e-4, 0.5, 1.0)
    assert cfg.model.self_conditioning and cfg.model.selfcond_variant == "zero_init"
    o = cfg.optim
    assert (o.name, o.lr, o.warmup_steps, o.min_lr_ratio, o.clip_norm) == (optim, lr, warmup, 0.1, 1.0)
    if optim == "adamw":
        assert (o.betas, o.weight_decay) == ((0.95, 0.99), 1e-4)
    assert (cfg.train.steps, cfg.train.checkpoint_every) == (2000, 1000)
