"""Products against the 262,144-word embedding (``primitives.py:fast_linear``) and the decoder's projections
(``primitives.py:Linear``): the small-row kernel or oneDNN for fp32 inference on a CPU, ``linear`` everywhere
else, and the same numbers either way up to fp32 rounding."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgemma.models import primitives, smallm
from dgemma.models.primitives import Linear, fast_linear, head_product, onednn_fits
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
@pytest.mark.parametrize("rows", [1, 2, 11, 24, 25])
def test_wide_weight_swapped_product_equals_linear(rows, monkeypatch):
    """2-24 rows against a vocabulary-wide weight take ``(weight @ x.T).T``; 1 and 25 the plain order
    (where the small-row kernel is not built: ``test_smallm.py``)."""
    monkeypatch.setattr(smallm, "kernel", lambda: None)
    monkeypatch.setattr(primitives, "_WIDE", 1000)  # the 1,000-row test head counts as a vocabulary
    lin = head()
    h = torch.randn(rows, 64)
    calls = []
    real = primitives._onednn
    monkeypatch.setattr(primitives, "_onednn", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    with torch.no_grad():
        got, want = fast_linear(h, lin.weight), F.linear(h, lin.weight)
    assert calls == [1000 if 2 <= rows <= 24 else rows]
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 2, 64), (2, 16, 64), (1, 33, 64), (3, 64)])
def test_decoder_linear_takes_onednn_for_2_to_32_rows(shape, monkeypatch):
    monkeypatch.setattr(smallm, "kernel", lambda: None)  # where the small-row kernel is not built
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=False)
    x = torch.randn(*shape)
    calls = []
    real = primitives._onednn
    monkeypatch.setattr(primitives, "_onednn", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    with torch.no_grad():
        got, want = lin(x), F.linear(x, lin.weight)
    rows = x.numel() // 64
    assert calls == ([rows] if 2 <= rows <= 32 else [])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    biased = Linear(64, 96)  # a bias keeps linear
    with torch.no_grad():
        assert torch.equal(biased(x), F.linear(x, biased.weight, biased.bias))


def test_decoder_linear_trains_and_takes_lora():
    """Gradients on the plain product, and peft wraps the subclass as it wraps ``nn.Linear``."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    lin = Linear(64, 96, bias=False)
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).square().sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(F.linear(x, lin.weight).square().sum(), x)[0])
    assert lin.weight.grad is not None
    net = nn.Sequential()
    net.add_module("proj", Linear(64, 96, bias=False))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False), net)
    assert type(net.proj).__module__.startswith("peft") and isinstance(net.proj.base_layer, Linear)
    with torch.no_grad():
        got = net.proj(x[:3])
    assert not torch.allclose(got, F.linear(x[:3], net.proj.base_layer.weight))  # the adapter's term is added


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
