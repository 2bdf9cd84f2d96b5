import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dgemma.diffusion.losses import (
    ar_loss,
    chunked_certainty_cross_entropy,
    chunked_cross_entropy,
    diffusion_loss,
    full_certainty_cross_entropy,
    full_cross_entropy,
)
from dgemma.errors import DGemmaError


def make(n, v, d, dtype, p_mask=0.7, scale=1.0):
    hidden = (torch.randn(n, d, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = torch.randn(v, d, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,))
    mask = torch.rand(n) < p_mask
    targets[~mask] = v + 7  # out of range: unmasked targets must never be read
    return hidden, weight, targets, mask


def loss_and_grads(fn, hidden, weight, targets, mask, **kw):
    hidden.grad = weight.grad = None
    loss_sum, count = fn(hidden, weight, targets, mask, **kw)
    (loss_sum / count * 0.37).backward()
    return loss_sum.detach(), count, hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_chunked_matches_full(dtype, tol, softcap, chunk_tokens):
    hidden, weight, targets, mask = make(50, 97, 12, dtype, scale=2.0)
    kw = dict(chunk_tokens=chunk_tokens, softcap=softcap)
    ref = loss_and_grads(full_cross_entropy, hidden, weight, targets, mask, **kw)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, mask, **kw)
    assert got[1].item() == ref[1].item() == mask.sum().item()
    assert got[0].dtype == dtype
    for g, r in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)
    assert hidden.grad[~mask].abs().max() == 0


def test_softcap_changes_the_loss():
    hidden, weight, targets, mask = make(20, 31, 8, torch.float64, scale=3.0)
    plain = chunked_cross_entropy(hidden, weight, targets, mask)[0]
    capped = chunked_cross_entropy(hidden, weight, targets, mask, softcap=2.0)[0]
    assert (plain - capped).abs() > 1.0


def test_gradcheck_with_softcap():
    hidden, weight, targets, mask = make(9, 13, 5, torch.float64, scale=2.0)
    fn = lambda h, w: chunked_cross_entropy(h, w, targets, mask, chunk_tokens=4, softcap=1.5)[0]
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_bf16_inputs_close_to_fp32_and_grads_in_bf16():
    hidden, weight, targets, mask = make(64, 200, 32, torch.bfloat16)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, mask, chunk_tokens=10,
                         softcap=30.0)
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref = loss_and_grads(full_cross_entropy, h32, w32, targets, mask, softcap=30.0)
    assert got[0].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2].float(), ref[2], rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(got[3].float(), ref[3], rtol=1e-2, atol=1e-4)


def test_frozen_weight_gets_no_grad():
    hidden, weight, targets, mask = make(30, 40, 8, torch.float64)
    weight.requires_grad_(False)
    chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=8)[0].backward()
    h_grad = hidden.grad.clone()
    hidden.grad = None
    full_cross_entropy(hidden, weight, targets, mask)[0].backward()
    assert weight.grad is None
    torch.testing.assert_close(h_grad, hidden.grad, rtol=1e-12, atol=1e-12)


def test_empty_mask_is_zero_and_backpropagates():
    hidden, weight, targets, _ = make(10, 20, 4, torch.float32)
    mask = torch.zeros(10, dtype=torch.bool)
    loss_sum, count = chunked_cross_entropy(hidden, weight, targets, mask)
    loss_sum.backward()
    assert loss_sum.item() == 0 and count.item() == 0 and count.dtype == torch.long
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0
    mean, _, _ = diffusion_loss(hidden.detach()[None], weight.detach(), targets[None], mask[None])
    assert mean.item() == 0


def test_bad_input_raises():
    hidden, weight, targets, mask = make(10, 20, 4, torch.float32)
    with pytest.raises(DGemmaError):
        chunked_cross_entropy(hidden, weight[:, :3], targets, mask)
    with pytest.raises(DGemmaError):
        chunked_cross_entropy(hidden, weight, targets[:5], mask)
    with pytest.raises(DGemmaError):
        chunked_cross_entropy(hidden, weight, targets, mask.long())
    with pytest.raises(DGemmaError):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=0)
    with pytest.raises(DGemmaError):
        diffusion_loss(hidden[None], weight, targets[None], mask[None], impl="nope")


class LargestTensor(TorchDispatchMode):
    """Records the byte size of the largest tensor any aten op produces, forward or backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def largest_intermediate(fn, n, v, d, chunk_tokens):
    hidden, weight, targets, mask = make(n, v, d, torch.float32, p_mask=1.0)
    with LargestTensor() as rec:
        loss_sum, _ = fn(hidden, weight, targets, mask, chunk_tokens=chunk_tokens, softcap=30.0)
        loss_sum.backward()
    assert weight.grad is not None and hidden.grad is not None
    return rec


@pytest.mark.parametrize("n,v", [(256, 1024), (2048, 4096)])
def test_chunked_peak_tensor_is_chunk_by_vocab(n, v):
    d, chunk = 16, 64
    chunked = largest_intermediate(chunked_cross_entropy, n, v, d, chunk)
    full = largest_intermediate(full_cross_entropy, n, v, d, chunk)
    print(f"N={n} V={v}: largest tensor chunked {chunked.largest} B, full {full.largest} B")
    assert any("addmm_" in op for op in chunked.ops), "backward did not run under the recorder"
    assert chunked.largest == chunk * v * 4
    assert full.largest >= n * v * 4


def test_chunked_peak_tensor_independent_of_length():
    sizes = [largest_intermediate(chunked_cross_entropy, n, 512, 16, 32).largest
             for n in (64, 1024)]
    assert sizes[0] == sizes[1] == 32 * 512 * 4


def test_diffusion_loss_averages_over_mask():
    weight = torch.eye(3, dtype=torch.float64)
    hidden = torch.tensor([[[0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0], [50.0, 0.0, 0.0]]],
                          dtype=torch.float64)
    x0 = torch.tensor([[0, 0, 2]])
    mask = torch.tensor([[True, True, False]])
    for impl in ("chunked", "full"):
        mean, loss_sum, count = diffusion_loss(hidden, weight, x0, mask, impl=impl, chunk_tokens=1)
        assert count.item() == 2
        torch.testing.assert_close(loss_sum, torch.tensor(math.log(6), dtype=torch.float64))
        torch.testing.assert_close(mean, torch.tensor(math.log(6) / 2, dtype=torch.float64))


def test_ar_loss_counts_position_only_when_it_and_successor_are_valid():
    ids = torch.tensor([[10, 11, 12, 0, 0],
                        [13, 14, 15, 16, 17],
                        [0, 18, 19, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 0, 0],
                          [1, 1, 1, 1, 1],
                          [0, 1, 1, 0, 0]], dtype=torch.bool)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20, 8, dtype=torch.float64)
    counted = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3), (2, 1)]
    expected = sum(F.cross_entropy(hidden[b, i] @ weight.T, ids[b, i + 1]) for b, i in counted)
    for impl in ("chunked", "full"):
        mean, loss_sum, count = ar_loss(hidden, weight, ids, valid, impl=impl, chunk_tokens=3)
        assert count.item() == 7
        torch.testing.assert_close(loss_sum, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mean, expected / 7, rtol=1e-12, atol=1e-12)
        hidden.grad = None
        loss_sum.backward()
        touched = hidden.grad.abs().sum(-1) != 0
        assert sorted(map(tuple, touched.nonzero().tolist())) == counted


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_weighted_chunked_matches_full_and_a_per_token_reference(chunk_tokens):
    hidden, weight, targets, mask = make(50, 97, 12, torch.float64, scale=2.0)
    w = torch.rand(50, dtype=torch.float64) * 5
    kw = dict(chunk_tokens=chunk_tokens, softcap=3.0, weights=w)
    ref = loss_and_grads(full_cross_entropy, hidden, weight, targets, mask, **kw)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, mask, **kw)
    assert got[1].item() == ref[1].item() == mask.sum().item()  # the count is of tokens, not weights
    for g, r in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    logits = torch.tanh(hidden.detach() @ weight.detach().T / 3.0) * 3.0
    per_token = F.cross_entropy(logits[mask], targets[mask], reduction="none")
    torch.testing.assert_close(got[0], (per_token * w[mask]).sum(), rtol=1e-12, atol=1e-12)
    ones = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, mask, chunk_tokens=chunk_tokens,
                          weights=torch.ones(50, dtype=torch.float64))
    plain = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, mask, chunk_tokens=chunk_tokens)
    for a, b in zip(ones, plain):
        assert torch.equal(a, b)


def test_weighted_gradcheck_and_bad_weights():
    hidden, weight, targets, mask = make(9, 13, 5, torch.float64, scale=2.0)
    w = torch.rand(9, dtype=torch.float64) * 3
    fn = lambda h, W: chunked_cross_entropy(h, W, targets, mask, chunk_tokens=4, softcap=1.5, weights=w)[0]
    assert torch.autograd.gradcheck(fn, (hidden, weight))
    with pytest.raises(DGemmaError, match="weights must be a float tensor of shape"):
        chunked_cross_entropy(hidden, weight, targets, mask, weights=torch.ones(8))
    with pytest.raises(DGemmaError, match="weights must be a float tensor"):
        chunked_cross_entropy(hidden, weight, targets, mask, weights=torch.ones(9, dtype=torch.long))


def test_ar_loss_weights_the_target_token():
    ids = torch.tensor([[10, 11, 12, 13]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    hidden = torch.randn(1, 4, 8, dtype=torch.float64)
    weight = torch.randn(20, 8, dtype=torch.float64)
    w = torch.tensor([[1.0, 1.0, 4.0, 1.0]], dtype=torch.float64)  # token 12, predicted at position 1
    nll = [F.cross_entropy(hidden[0, i] @ weight.T, ids[0, i + 1]) for i in range(3)]
    for impl in ("chunked", "full"):
        _, loss_sum, count = ar_loss(hidden, weight, ids, valid, weights=w, impl=impl)
        assert count.item() == 3
        torch.testing.assert_close(loss_sum, nll[0] + 4 * nll[1] + nll[2], rtol=1e-12, atol=1e-12)
    with pytest.raises(DGemmaError, match="weights must have shape"):
        ar_loss(hidden, weight, ids, valid, weights=w[:, :3])


def half_right(hidden, weight, targets, mask, softcap=None):
    """Every other masked row's target becomes its argmax, so the certainty term has rows to see."""
    logits = hidden.detach() @ weight.detach().T
    rows = mask.nonzero().squeeze(1)[::2]
    targets[rows] = logits[rows].argmax(-1)
    return rows


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_certainty_chunked_matches_full_values_and_grads(softcap, chunk_tokens, temperature):
    hidden, weight, targets, mask = make(50, 97, 12, torch.float64, scale=2.0)
    rows = half_right(hidden, weight, targets, mask)
    w = torch.rand(50, dtype=torch.float64) * 3
    out = {}
    for name, fn in [("full", full_certainty_cross_entropy), ("chunked", chunked_certainty_cross_entropy)]:
        hidden.grad = weight.grad = None
        loss_sum, count, cert = fn(hidden, weight, targets, mask, chunk_tokens=chunk_tokens, softcap=softcap,
                                   weights=w, temperature=temperature)
        ((0.3 * loss_sum + 1.7 * cert) / count).backward()
        out[name] = (loss_sum.detach(), count, cert.detach(), hidden.grad.clone(), weight.grad.clone())
    for g, r in zip(out["chunked"], out["full"]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    # the cross-entropy part is chunked_cross_entropy's, and the certainty part sums only right rows
    plain = chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=chunk_tokens, softcap=softcap,
                                  weights=w)[0]
    torch.testing.assert_close(out["chunked"][0], plain, rtol=0, atol=0)
    logits = hidden.detach() @ weight.detach().T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    right = mask & (logits.argmax(-1) == targets)
    assert right.sum() >= len(rows) > 5  # capped logits keep the argmax
    ent = torch.distributions.Categorical(logits=logits / temperature).entropy()
    torch.testing.assert_close(out["chunked"][2], ent[right].sum(), rtol=1e-12, atol=1e-12)


def test_certainty_gradcheck_and_wrong_rows_only():
    hidden, weight, targets, mask = make(9, 13, 5, torch.float64, scale=2.0)
    half_right(hidden, weight, targets, mask)
    for temperature in (1.0, 0.4):
        fn = lambda h, W: chunked_certainty_cross_entropy(h, W, targets, mask, chunk_tokens=4, softcap=1.5,  # noqa
                                                          temperature=temperature)[2]
        assert torch.autograd.gradcheck(fn, (hidden, weight))  # the right rows stay right under gradcheck's nudges
    with pytest.raises(DGemmaError, match="temperature must be positive"):
        chunked_certainty_cross_entropy(hidden, weight, targets, mask, temperature=0.0)
    hidden, weight, targets, mask = make(20, 31, 8, torch.float64)
    logits = hidden.detach() @ weight.detach().T
    targets[mask] = (logits[mask].argmax(-1) + 1) % 31  # every row wrong: no certainty term, no gradient from it
    loss_sum, _, cert = chunked_certainty_cross_entropy(hidden, weight, targets, mask, chunk_tokens=3)
    assert cert.item() == 0.0
    cert.backward()
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0
