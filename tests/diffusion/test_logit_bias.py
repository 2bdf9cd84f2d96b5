"""``logit_bias``: a fixed shift of a few tokens' logits at every step, in both decoders.

It is how a decision fitted on held-out data (PubMedQA's verdict prior) reaches every front end
(``eval_ds.logit_bias``: eval, generate, serve, lm-eval) and what OpenAI's ``logit_bias`` means.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dgemma.diffusion.corruption import AbsorbingNoise
from dgemma.diffusion.sampler import add_logit_bias, ar_generate, check_logit_bias
from dgemma.diffusion.schedules import get_schedule
from dgemma.errors import DGemmaError
from dgemma.models.transformer import DiffusionGemma, ModelConfig
from dgemma.sampling import SamplerConfig, build_sampler, resolve_logit_bias

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 2,
            max_position_embeddings=128, attn_implementation="eager")


def test_the_bias_adds_to_the_named_columns_only():
    logits = torch.tensor([[[0.0, 2.0, 2.5], [1.0, 0.0, -1.0]]])
    out = add_logit_bias(logits, {1: 1.0})
    assert out.tolist() == [[[0.0, 3.0, 2.5], [1.0, 1.0, -1.0]]]
    assert logits[0, 0, 1] == 2.0  # the input is left alone
    assert add_logit_bias(logits, {}) is logits and add_logit_bias(logits, None) is logits
    check_logit_bias({0: -100, 63: 100.0}, 64)
    for bad, message in (({64: 1.0}, "not in the vocabulary"), ({-1: 1.0}, "not in the vocabulary"),
                         ({3: 100.5}, r"in \[-100, 100\]"), ({3: "1"}, r"in \[-100, 100\]")):
        with pytest.raises(DGemmaError, match=message):
            check_logit_bias(bad, 64)


def _decoders(model, ids, valid, bias):
    noise = AbsorbingNoise(4, get_schedule("linear"))
    sampler = build_sampler(SamplerConfig(num_steps=4, step_type="commit", temperature=0.0, early_stopping="none",
                                          max_canvases=2, logit_bias=bias), noise=noise, canvas_size=8, stop_ids=(1,))
    diff = sampler(model, ids, valid, generator=torch.Generator().manual_seed(0)).tokens
    ar = ar_generate(model, ids, valid, max_new_tokens=16, stop_ids=(1,), logit_bias=bias).tokens
    return diff, ar


def test_both_decoders_follow_the_bias():
    torch.manual_seed(0)
    model = DiffusionGemma(ModelConfig(**TINY)).eval()
    ids = torch.randint(5, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(ids, dtype=torch.bool)
    plain = _decoders(model, ids, valid, None)
    assert _decoders(model, ids, valid, {}) == plain
    diff, ar = _decoders(model, ids, valid, {7: 100.0})
    assert all(row == [7] * 16 for row in diff + ar)  # +100: the argmax everywhere
    banned = max(range(64), key=lambda t: sum(row.count(t) for row in plain[0] + plain[1]))
    diff, ar = _decoders(model, ids, valid, {banned: -100.0})
    assert not any(banned in row for row in diff + ar)
    # exact additive semantics: AR's first token flips to the runner-up at a bias just over the gap
    with torch.no_grad():
        from dgemma.models.masks import TokenInfo

        h = model(ids, info=TokenInfo.clean(valid), return_hidden=True)
        z = model.logits(h[:, -1]).float()
    top2 = z.topk(2, -1)
    gap = float(top2.values[0, 0] - top2.values[0, 1])
    second = int(top2.indices[0, 1])
    for extra, first in ((-1e-3, int(top2.indices[0, 0])), (1e-3, second)):
        out = ar_generate(model, ids[:1], valid[:1], max_new_tokens=1, logit_bias={second: gap + extra}).tokens
        assert out == [[first]]


def test_text_keys_resolve_to_single_tokens(tiny_text_model):
    from dgemma.data.tokenizers import load_tokenizer

    tok = load_tokenizer(tiny_text_model)
    word = next(w for w in (" the", " a", " of", "e") if len(tok.encode(w)) == 1)
    assert resolve_logit_bias({word: 1.5}, tok) == {tok.encode(word)[0]: 1.5}
    assert resolve_logit_bias(None, None) == {} == resolve_logit_bias({}, tok)
    long = next(w for w in (" antidisestablishment", " zyxwvut qq") if len(tok.encode(w)) > 1)
    with pytest.raises(DGemmaError, match="tokens .* not one"):
        resolve_logit_bias({long: 1.0}, tok)
    with pytest.raises(DGemmaError, match="needs the run's tokenizer"):
        resolve_logit_bias({word: 1.0}, None)


def test_a_runs_bias_is_its_default_everywhere(tiny_run, tmp_path):
    """``eval_ds.logit_bias`` in a run's config reaches ``dgemma.load_model`` (generate, serve),
    the lm-eval model and the evaluators, which record it; +100 on the digit 5 fills every blank with 5."""
    import dgemma
    from dgemma.eval.harness import evaluate
    from dgemma.training.runs import load_run

    run_dir = tmp_path / "biased"
    shutil.copytree(tiny_run, run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["eval_ds"]["logit_bias"] = {"5": 100.0}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    m = dgemma.load_model(run_dir, dtype="float32")
    assert m.defaults.logit_bias == {m.tokenizer.encode("5")[0]: 100.0}
    text = m.generate(["0" * 81], dgemma.SamplerConfig(num_steps=8, max_canvases=1))[0].text
    assert set(text[:81]) == {"5"}
    run = load_run(run_dir, dtype="float32")
    res = evaluate(run, "sudoku", eval_name="sample_ar_steps8", num_steps=8, step_type="commit", temperature=0.0,
                   early_stopping=None, records=run_records(run, 2), out_dir=tmp_path / "ev", ar_max_tokens=0)
    assert res["settings"]["logit_bias"] == {"5": 100.0}
    from dgemma.lm_eval_model import DGemmaLM  # the lm-eval model decodes with it too

    lm = DGemmaLM(run=str(run_dir), device="cpu")
    assert lm._settings_for(0.0, 1.0, 1).logit_bias == m.defaults.logit_bias


def run_records(run, n):
    from dgemma.tasks import get_task

    return get_task("sudoku").load(run.cfg, limit=n)
