"""Gemma 4's mixture-of-experts block: a router and a bank of GeGLU experts.

In a Gemma 4 MoE layer (and in every layer of the released DiffusionGemma) the experts run *beside*
the dense MLP, not instead of it: the router reads the residual stream, picks ``top_k`` of
``num_experts`` experts per token, renormalises their probabilities to sum to one and multiplies
each by a learned per-expert scale. Parameter names and layouts follow transformers
(``router.proj``, ``router.scale``, ``router.per_expert_scale``, ``experts.gate_up_proj [E, 2I, d]``,
``experts.down_proj [E, d, I]``) so checkpoints load without renaming.

Dispatch sorts the ``tokens x top_k`` assignments by expert and runs one matmul per expert over
its contiguous slice (or one grouped matmul where PyTorch offers it on the device), so the cost
is a handful of large matmuls whatever the token count, never a Python loop over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.models.primitives import RMSNorm


class Router(nn.Module):
    """Scale-free RMSNorm, a learned per-channel scale times ``d ** -0.5``, a linear map to expert scores.

    The softmax runs in fp32 whatever the model dtype (as transformers does), so expert choices
    agree with the reference in fp64 and bf16 runs alike.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.root = dim**-0.5
        self.norm = RMSNorm(dim, eps, with_scale=False)
        self.proj = nn.Linear(dim, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, d]`` -> ``weights [N, k]`` (renormalised, per-expert scaled) and ``experts [N, k]``."""
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """``num_experts`` GeGLU MLPs stored as 3-D tensors, applied to routed tokens."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    grouped: bool | None = None  # one grouped GEMM per projection; None = where PyTorch has a fast kernel

    def use_grouped(self, x: Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        return (hasattr(F, "grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x.device) >= (8, 0))

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``x [N, d]``, ``weights/experts [N, k]`` -> ``sum_k weight_k * expert_k(x) [N, d]``."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order kept
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        xs = x[token]  # [N*k, d], rows of expert 0 first, then expert 1, ...
        if self.use_grouped(x):  # no host sync: offsets stay on the device
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            out = F.grouped_mm(F.gelu(gate, approximate="tanh") * up, self.down_proj.transpose(1, 2), offs=offs)
        else:
            out = torch.empty_like(xs)
            lo = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    gate, up = F.linear(xs[lo:lo + c], self.gate_up_proj[e]).chunk(2, dim=-1)
                    out[lo:lo + c] = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
                lo += c
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        # expert-ascending accumulation, the order transformers adds contributions in
        return torch.zeros_like(x).index_add_(0, token, out)
