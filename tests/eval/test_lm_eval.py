"""The Lite evaluation (dgemma/eval/lite.py): the NELBO formulas against closed forms and an
oracle, then the whole harness and its CLI on a tiny corpus and tiny diffusion + AR runs."""

import json
import math
import random

import pytest
import torch

from dgemma.cli.main import main
from dgemma.diffusion.corruption import AbsorbingNoise, UniformNoise
from dgemma.diffusion.schedules import CosineSchedule, LinearSchedule
from dgemma.eval import lite

# -- the bound, as formulas -------------------------------------------------------------------
V = 4
PI = torch.tensor([0.5, 0.25, 0.15, 0.10], dtype=torch.float64)
ENTROPY = float(-(PI * PI.log()).sum())


@pytest.mark.parametrize("schedule", [CosineSchedule(), LinearSchedule()])
@pytest.mark.parametrize("points", [1, 3, 16])
def test_absorbing_uniform_predictor_scores_log_k_on_any_grid(schedule, points):
    """MDLM's NELBO of a model uniform over the K = V - 1 real tokens is log K per token for any
    schedule; the cell weights make it exact on any grid (a Riemann sum of -alpha' would not be)."""
    vocab, mask = 11, 10
    noise = AbsorbingNoise(mask, schedule)
    lo, mid, hi = lite.elbo_grid(points)
    x0 = torch.arange(10)
    xt = torch.full_like(x0, mask)  # every position masked; weight by P(masked) = 1 - alpha(t_mid)
    total = torch.zeros((), dtype=torch.float64)
    for m in range(points):
        p_masked = 1.0 - float(schedule.alpha(mid[m].clone()))
        total += p_masked * lite.nelbo_cell(torch.zeros(10, vocab), x0, xt, noise, float(lo[m]), float(hi[m])).mean()
    assert float(total) == pytest.approx(math.log(vocab - 1), rel=1e-12)
    unmasked = lite.nelbo_cell(torch.zeros(10, vocab), x0, x0, noise, float(lo[0]), float(hi[0]))
    assert unmasked.abs().sum() == 0  # clean positions are not scored


def _oracle_bound(noise, points, param):
    """Exact expectation over (x0 ~ PI, x_t ~ q_t(. | x0)) of the grid NELBO of the Bayes-optimal
    denoiser p(x0 | x_t) for one token."""
    lo, mid, hi = lite.elbo_grid(points)
    k, i = torch.arange(V).repeat_interleave(V), torch.arange(V).repeat(V)
    total = 0.0
    for m in range(points):
        a = float(noise.schedule.alpha(mid[m].clone()))
        q = torch.where(i == k, a + (1 - a) / V, (1 - a) / V).double()
        like = torch.where(i[:, None] == torch.arange(V)[None], a + (1 - a) / V, (1 - a) / V).double()
        post = PI[None] * like
        post = post / post.sum(-1, keepdim=True)
        cell = lite.nelbo_cell(post.log(), k, i, noise, float(lo[m]), float(hi[m]), param)
        total += float((PI[k] * q * cell).sum())
    return total


def test_uniform_mixture_bound_of_the_oracle_converges_to_the_entropy():
    """With the exact posterior, the mixture reverse process is the true one: the continuous-time
    NELBO equals the data entropy, and the grid estimate converges to it from above (cosine)."""
    noise = UniformNoise(V, CosineSchedule())
    b8, b32, b128 = (_oracle_bound(noise, n, "mixture") for n in (8, 32, 128))
    assert b8 > b32 > b128 > ENTROPY
    assert b128 - ENTROPY < 2e-4 and b8 - ENTROPY > 1e-2


def test_uniform_udlm_bound_is_a_looser_bound():
    noise = UniformNoise(V, CosineSchedule())
    udlm = _oracle_bound(noise, 64, "udlm")
    assert udlm > _oracle_bound(noise, 64, "mixture") + 0.3 > ENTROPY + 0.3
    # its discrete-time T-step ELBO (plugging p into the posterior) approaches the continuous one
    assert udlm == pytest.approx(_discrete_udlm(noise, 512), abs=5e-3)


def _discrete_udlm(noise, steps):
    """sum_t E KL(q(x_s | x_t, x0) || q(x_s | x_t, p)) of the oracle on a T-step grid (exact)."""
    grid = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    total = 0.0
    for n in range(steps):
        at, as_ = float(noise.schedule.alpha(grid[n].clone())), float(noise.schedule.alpha(grid[n + 1].clone()))
        ats = at / as_
        for k in range(V):
            for i in range(V):
                qi = at * (i == k) + (1 - at) / V
                onehot = torch.nn.functional.one_hot(torch.tensor(k), V).double()
                trans = torch.where(torch.arange(V) == i, ats + (1 - ats) / V, torch.tensor((1 - ats) / V)).double()

                def post(x):
                    w = (as_ * x + (1 - as_) / V) * trans
                    return w / w.sum()

                like = torch.where(torch.arange(V) == i, at + (1 - at) / V, torch.tensor((1 - at) / V)).double()
                p = PI * like / (PI * like).sum()
                q, pm = post(onehot), post(p)
                m = q > 0
                total += float(PI[k]) * qi * float((q[m] * (q[m].log() - pm[m].log())).sum())
    return total


@pytest.mark.parametrize("param", ["mixture", "udlm"])
def test_uniform_terms_vanish_for_a_perfect_model_and_are_positive_otherwise(param):
    g = torch.Generator().manual_seed(0)
    x0, xt = torch.randint(0, 7, (20,), generator=g), torch.randint(0, 7, (20,), generator=g)
    perfect = torch.full((20, 7), -1e4).scatter(1, x0[:, None], 0.0)
    assert lite.uniform_rate_terms(perfect, x0, xt, 0.6, 7, param).abs().max() < 1e-9
    noisy = torch.randn(20, 7, generator=g)
    assert (lite.uniform_rate_terms(noisy, x0, xt, 0.6, 7, param) > 0).all()


def test_analytic_tokens_per_forward():
    assert lite.analytic_tokens_per_forward(32, 8, 4) == 128 / 33  # one prefill, 4 x 8 steps
    assert lite.analytic_tokens_per_forward(32, 8, 4, fuse_append=False) == 32 / 9  # and 3 appends of their own
    assert lite.analytic_tokens_per_forward(32, 8, 4, prompt_len=0) == 128 / 32


# -- the harness on tiny runs ------------------------------------------------------------------
WORDS = "the cat sat on a mat while dogs ran over green hills and birds sang under blue skies".split()
TINY = ["--cfg.model.vocab_size=300", "--cfg.model.hidden_size=32", "--cfg.model.intermediate_size=64",
        "--cfg.model.num_hidden_layers=2", "--cfg.model.num_attention_heads=2", "--cfg.model.num_key_value_heads=1",
        "--cfg.model.head_dim=16", "--cfg.model.query_pre_attn_scalar=16",
        "--cfg.model.layer_types=full_attention,full_attention", "--cfg.diffusion.canvas_size=8",
        "--cfg.diffusion.num_canvases=4", "--cfg.data.batch_size=4", "--cfg.train.steps=3",
        "--cfg.train.checkpoint_every=3", "--cfg.train.log_every=1", "--cfg.train.threads=1",
        "--cfg.eval_ds.batch_size=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lite")
    rng = random.Random(0)
    (root / "in.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))})
                                           + "\n" for _ in range(400)))
    corpus = root / "corpus"
    assert main(["prepare", "corpus", "--input", str(root / "in.jsonl"), "--out", str(corpus), "--vocab-size", "300",
                 "--workers", "0", "--val-fraction", "0.1"]) == 0
    data = [f"--cfg.data.path={corpus}", f"--cfg.data.tokenizer={corpus / 'tokenizer'}"]
    for name, cfg in (("diff", "configs/lite_debug.py"), ("ar", "configs/lite_debug_ar.py")):
        assert main(["train", f"--cfg={cfg}", f"--cfg.workdir={root / name}", *TINY, *data]) == 0
    return root


def test_harness_end_to_end(runs):
    from dgemma.training.runs import load_run

    run, ar = load_run(runs / "diff"), load_run(runs / "ar")
    res = lite.evaluate_lm(run, ar_run=ar, windows=8, batch_size=4, points=4, gen_steps=(2, 4), adaptive_steps=4,
                           gen_canvases=3, gen_batch=2)
    v, b = res["validation"], res["bound"]
    assert v["windows"] == 8 and v["diffusion_tokens"] == 8 * 32 and v["ar_nll"] is None
    assert math.isfinite(v["diffusion_ce"]) and 0 < v["diffusion_ce"] < 2 * math.log(300)
    # an untrained model predicts near uniformly: its uniform-noise bound is at least log V, above the CE
    for name in ("mixture", "udlm"):
        assert math.isfinite(b[name]["nats_per_token"]) and b[name]["nats_per_token"] >= v["diffusion_ce"]
        assert b[name]["nats_per_token"] > math.log(300) - 0.05
        assert b[name]["bits_per_token"] == pytest.approx(b[name]["nats_per_token"] / math.log(2))
    assert b["tokens"] == 8 * 32 and len(b["ce_at_t"]) == 4
    a = res["ar_baseline"]
    assert a["ar_tokens"] == 8 * 31 and math.isfinite(a["ar_nll"]) and a["diffusion_tokens"] == 0
    g = res["generation"]
    assert g["ar"]["tokens_per_forward"] == 1.0 and g["ar"]["tokens"] == 2 * 3 * 8
    for r in g["rows"]:
        assert r["tokens"] == 2 * 3 * 8 and r["tokens_per_second"] > 0
        if r["stopping"] == "none":  # exactly M C / (1 + M T'): one prefill, M T' steps (the appends ride on them)
            assert r["tokens_per_forward"] == r["analytic_tokens_per_forward"]
            # T' = T, except that the cosine pace has committed all 8 positions after 3 of 4 steps
            assert r["tokens_per_forward"] == 3 * 8 / (1 + 3 * {2: 2, 4: 3}[r["num_steps"]])
    assert {r["name"] for r in g["rows"]} == {"commit_steps2", "commit_steps4", "commit_steps4_entropy",
                                              "commit_steps4_stable_confident"}
    saved = json.loads((runs / "diff" / "eval" / "lm" / "step_3.json").read_text())
    assert saved["bound"]["mixture"] == b["mixture"]
    # the same seed gives the same numbers
    again = lite.validation_loss(run, lite.val_batches(run, windows=8, batch_size=4))
    assert again["diffusion_ce"] == v["diffusion_ce"]


def test_cli_lm_task(runs, capsys):
    assert main(["eval", f"--cfg.workdir={runs / 'diff'}", f"--ar_workdir={runs / 'ar'}", "--windows=4",
                 "--elbo_points=2", "--gen_steps=2", "--gen_canvases=2", "--gen_batch=1", "--repeats=1"]) == 0
    out = capsys.readouterr().out
    assert "NELBO bound (mixture" in out and "commit_steps2 " in out and "AR baseline" in out
    assert "tokens/forward is set by the step schedule" in out
    assert main(["eval", "--task=lm", f"--cfg.workdir={runs / 'ar'}", "--windows=4"]) == 0  # an AR run: NLL only
    assert "validation AR NLL" in capsys.readouterr().out
    assert main(["eval", "--task=lm", f"--cfg.workdir={runs / 'diff'}", "--gen_steps=0"]) == 2


def test_unconditional_sampling_from_an_empty_prompt(runs):
    """An empty prompt works (no prefill): the cached and the prefix-recomputing samplers agree."""
    from dgemma.training.runs import load_run

    run = load_run(runs / "diff")
    outs = []
    for use_cache in (True, False):
        s = lite._sampler(run, 3, None, 2)
        s.use_cache = use_cache
        res = s(run.model, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool),
                generator=torch.Generator().manual_seed(0))
        outs.append(res)
    assert outs[0].tokens == outs[1].tokens and all(len(t) == 16 for t in outs[0].tokens)
    assert outs[0].forward_passes == [2 * 3] * 2  # no prefill: 2 x 3 steps (the append rides on the 4th)
