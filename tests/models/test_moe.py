"""The expert dispatch (tokens sorted by expert, one matmul per expert) against the definition."""

import torch
import torch.nn.functional as F

from dgemma.models.moe import Experts, Router


def naive(experts: Experts, x, weights, idx):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):  # the definition: a loop over tokens and their chosen experts
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            gate, up = F.linear(x[n], experts.gate_up_proj[e]).chunk(2, -1)
            out[n] += weights[n, j] * F.linear(F.gelu(gate, approximate="tanh") * up, experts.down_proj[e])
    return out


def test_sorted_dispatch_equals_the_per_token_definition():
    torch.manual_seed(0)
    router, experts = Router(16, 5, 2, 1e-6).double(), Experts(16, 12, 5).double()
    with torch.no_grad():
        router.scale.normal_(1, 0.3)
        router.per_expert_scale.normal_(1, 0.3)
    x = torch.randn(23, 16, dtype=torch.float64)
    weights, idx = router(x)
    # top-k probabilities renormalised to one, then scaled per expert
    torch.testing.assert_close((weights / router.per_expert_scale[idx]).sum(-1), torch.ones(23, dtype=torch.float64))
    assert idx.shape == (23, 2) and (idx[:, 0] != idx[:, 1]).all()
    torch.testing.assert_close(experts(x, weights, idx), naive(experts, x, weights, idx), rtol=0, atol=1e-13)


def test_unused_experts_and_gradients():
    torch.manual_seed(1)
    experts = Experts(8, 6, 4)
    x = torch.randn(5, 8, requires_grad=True)
    idx = torch.tensor([[0, 2]] * 5)  # experts 1 and 3 get no tokens
    w = torch.full((5, 2), 0.5)
    out = experts(x, w, idx)
    torch.testing.assert_close(out, naive(experts, x, w, idx))
    out.sum().backward()
    assert x.grad is not None and experts.gate_up_proj.grad[1].abs().sum() == 0
    assert experts.gate_up_proj.grad[0].abs().sum() > 0


def test_grouped_gemm_path_equals_the_loop():
    """The path GPUs take (one ``grouped_mm`` per projection), checked on CPU where PyTorch has it."""
    import pytest

    if not hasattr(F, "grouped_mm"):
        pytest.skip("this PyTorch has no torch.nn.functional.grouped_mm")
    torch.manual_seed(2)
    experts = Experts(16, 8, 6)
    x, idx = torch.randn(31, 16), torch.randint(0, 6, (31, 2))
    w = torch.rand(31, 2)
    loop = experts(x, w, idx)
    experts.grouped = True
    torch.testing.assert_close(experts(x, w, idx), loop, rtol=1e-5, atol=1e-6)
