"""Products against the 262,144-word embedding (``primitives.py:fast_linear``): oneDNN for fp32 inference on
a CPU, ``linear`` everywhere else, and the same numbers either way up to fp32 rounding."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgemma.models import primitives
from dgemma.models.primitives import fast_linear, head_product, onednn_fits
from dgemma.models.selfcond import embed_probs
from dgemma.models.transformer import DiffusionGemma, ModelConfig

needs_onednn = pytest.mark.skipif(not primitives._ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")


def head(vocab=1000, d=64, dtype=torch.float32, bias=False):
    torch.manual_seed(0)
    return nn.Linear(d, vocab, bias=bias).to(dtype)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_onednn_product_equals_linear(rows):
    lin = head()
    h = torch.randn(rows, 64)
    with torch.no_grad():
        assert onednn_fits(h, lin.weight)
        got, want = head_product(h, lin), F.linear(h, lin.weight)
    assert got.shape == want.shape == (rows, 1000)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_onednn
def test_onednn_product_of_strided_operands():
    """A column slice of a wider input (rows not packed) and a transposed weight (the signal's ``E.T``)."""
    lin = head()
    wide = torch.randn(5, 128)
    with torch.no_grad():
        torch.testing.assert_close(head_product(wide[:, ::2], lin), F.linear(wide[:, ::2].contiguous(), lin.weight),
                                   rtol=1e-5, atol=1e-5)
        p = torch.softmax(torch.randn(3, 1000), -1)
        torch.testing.assert_close(fast_linear(p, lin.weight.t()), p @ lin.weight, rtol=1e-5, atol=1e-6)


def test_everything_else_keeps_linear():
    h = torch.randn(3, 64)
    lin = head()
    assert not onednn_fits(h, lin.weight)  # gradients enabled and the weight takes them: training
    frozen = head().weight.requires_grad_(False)
    assert onednn_fits(h, frozen) == primitives._ONEDNN_LINEAR  # nothing wants a gradient
    assert not onednn_fits(h.clone().requires_grad_(), frozen)  # LoRA training: a frozen head, a live input
    with torch.no_grad():
        assert not onednn_fits(h.double(), head(dtype=torch.float64).weight)  # the exactness tests' fp64
        assert not onednn_fits(h.bfloat16(), head(dtype=torch.bfloat16).weight)  # bf16 already goes to oneDNN
        assert not onednn_fits(h.double(), lin.weight)  # dtypes that differ
        w64 = head(dtype=torch.float64).weight
        assert torch.equal(fast_linear(h.double(), w64), F.linear(h.double(), w64))

        class Wrapped(nn.Linear):  # a LoRA-style wrapper: its own forward must run
            def forward(self, x):
                return super().forward(x) + 1.0
        wrapped = Wrapped(64, 1000, bias=False)
        assert torch.equal(head_product(h, wrapped), wrapped(h))
        biased = head(bias=True)
        assert torch.equal(head_product(h, biased), biased(h))


def test_gradients_flow_in_training():
    """oneDNN's op has no autograd kernel (backward through it silently gives no gradient), so training
    must never reach it: gradients equal the plain products'."""
    lin = head()
    h = torch.randn(2, 64, requires_grad=True)
    head_product(h, lin).square().sum().backward()
    want = torch.autograd.grad(F.linear(h, lin.weight).square().sum(), h)[0]
    torch.testing.assert_close(h.grad, want)
    assert lin.weight.grad is not None
    frozen = head().weight.requires_grad_(False)  # LoRA: the tied embedding frozen, the signal's input live
    z = torch.randn(2, 1000, requires_grad=True)
    embed_probs(torch.softmax(z, -1), frozen).square().sum().backward()
    want = torch.autograd.grad((torch.softmax(z, -1) @ frozen).square().sum(), z)[0]
    torch.testing.assert_close(z.grad, want)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 31, 40])
def test_signal_product_equals_the_plain_product(rows):
    """``embed_probs`` in fp32: oneDNN below 32 rows, the plain product above, the same numbers."""
    w = head().weight.detach()
    probs = torch.softmax(torch.randn(rows, 1000), -1)
    with torch.no_grad():
        torch.testing.assert_close(embed_probs(probs, w), probs @ w, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_model_logits_match_the_linear_head():
    """``DiffusionGemma.logits`` on a 3-D slice (with soft-capping) against the plain product."""
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, layer_types=["full_attention"], max_position_embeddings=64,
                      final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = DiffusionGemma(cfg).eval()
    hidden = torch.randn(2, 7, 32)[:, 3:]
    with torch.no_grad():
        got = model.logits(hidden)
        z = F.linear(hidden, model.lm_head.weight)
    torch.testing.assert_close(got, torch.tanh(z / 30.0) * 30.0, rtol=1e-5, atol=1e-5)
