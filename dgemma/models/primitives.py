"""Primitives of the Gemma decoder: RMSNorm, the GeGLU MLP, rotary embeddings and the products of inference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.models import smallm


class RMSNorm(nn.Module):
    """Gemma RMSNorm: fp32 normalisation, then a learned scale; ``with_scale=False`` has no weight.

    ``unit_offset=True`` is Gemma 3's ``(1 + w)`` scale with ``w`` stored from zero;
    ``unit_offset=False`` is Gemma 4's plain ``w`` stored from one (and ``mean ** -0.5`` written as
    transformers writes it there, so fp32 results agree bit for bit).
    """

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True, unit_offset: bool = True):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        init = torch.zeros(dim) if unit_offset else torch.ones(dim)
        self.weight = nn.Parameter(init) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        if self.unit_offset:
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * ((1.0 + self.weight.float()) if self.unit_offset else self.weight.float())
        return out.type_as(x)


class GeGLU(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, the Gemma MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Rotary(nn.Module):
    """Rotate-half RoPE with a cached fp32 cos/sin table, indexed by position.

    ``scaling`` is the linear position-interpolation factor (Gemma 3 4B+ global layers).
    ``partial < 1`` is Gemma 4's *proportional* RoPE on global layers: only the first
    ``int(partial * head_dim // 2)`` frequency pairs rotate (with the full ``head_dim`` in the
    exponent), the rest get frequency 0 (cos 1, sin 0), so the table keeps ``head_dim`` columns.
    Tables are computed in fp32 exactly as ``transformers`` does (``pos * inv_freq``), then cast
    to the activation dtype at use, so fp64 models see the same rotary values as the reference.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: float = 1.0, partial: float = 1.0):
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.partial = head_dim, theta, scaling, partial
        self.max_positions = max_positions
        self._table: tuple[Tensor, Tensor] | None = None  # not a buffer: model.to(dtype) must not round it

    def table(self, device: torch.device, needed: int) -> tuple[Tensor, Tensor]:
        """fp32 ``cos, sin [n, head_dim]``, grown by doubling to cover ``needed`` positions."""
        if self._table is None or self._table[0].device != device or self._table[0].shape[0] < needed:
            n = min(self.max_positions, max(1024, 1 << (needed - 1).bit_length()))
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponent) / self.scaling
            if self.partial < 1.0:
                inv_freq[int(self.partial * self.head_dim // 2):] = 0.0
            freqs = torch.arange(n, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], -1)
            self._table = (emb.cos(), emb.sin())
        return self._table

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [B, L]`` -> ``cos, sin [B, 1, L, head_dim]`` in ``dtype``.

        Inside a compiled graph the table is the one already built (a host sync to size it would
        break the graph): ``dgemma/models/compiled.py:CompiledModel`` grows it before each call.
        """
        if not torch.compiler.is_compiling():
            self.cover(positions)
        elif self._table is None:
            raise RuntimeError("compile the model through dgemma.models.compiled.CompiledModel: it sizes the "
                               "rotary table outside the graph")
        cos, sin = self._table
        return cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)

    def cover(self, positions: Tensor) -> None:
        """Grow the table to every position in ``positions`` (one host sync), refusing any beyond
        ``max_position_embeddings``."""
        top = int(positions.max()) + 1
        if top > self.max_positions:
            raise ValueError(f"position {top - 1} exceeds max_position_embeddings {self.max_positions}")
        self.table(positions.device, top)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_WIDE = 1 << 16  # a weight with this many output rows or more is a vocabulary (the LM head)


def cpu_inference(x: Tensor, weight: Tensor) -> bool:
    """On a CPU, no gradient wanted, no graph being compiled: where a product may leave PyTorch's own."""
    return (weight.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())


def onednn_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether ``fast_linear`` may take oneDNN's matmul: fp32 CPU inference and a torch built with it."""
    return _ONEDNN_LINEAR and x.dtype == weight.dtype == torch.float32 and cpu_inference(x, weight)


def _onednn(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def fast_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [N, k] @ weight [n, k].T``; for inference on a CPU, not through MKL.

    1-64 fp32 rows (1-32 bf16 rows) against a packed weight go to the small-row kernel where this
    CPU builds it (``smallm.py``): the fastest here at every such shape. Otherwise, in fp32,
    oneDNN's matmul: PyTorch sends an fp32 product on a CPU to MKL, whose products with few rows
    against the 270M's 262,144 x 640 embedding (the one row of an AR step, the few a denoising
    step reads) used a fraction of the memory bandwidth on an AMD EPYC: 44 ms for one row of the
    LM head and 121 ms for four, against
    22 and 54 ms for oneDNN's ``_linear_pointwise`` on the same weight, uncopied
    (``docs/benchmarks.md``, 2026-12-06, late). For 2-24 rows against such a wide weight oneDNN is
    faster still with the operands swapped, ``(weight @ x.T).T``: 35 / 53 / 51 ms for 4 / 11 / 16
    rows against 44 / 64 / 71 (2026-12-07, later), with the same bits there (each output is the
    same dot product). The sums are ordered differently from ``linear``'s, so results differ from
    it in the last bits (about 1e-6 relative). Anything that needs gradients, another dtype or
    device, or a graph being compiled keeps ``linear``.
    """
    if not cpu_inference(x, weight):
        return F.linear(x, weight)
    x = x.contiguous()
    if smallm.fits(x, weight):
        return smallm.smallm_linear(x, weight)
    if not onednn_fits(x, weight):
        return F.linear(x, weight)
    if 2 <= x.shape[0] <= 24 and weight.shape[0] >= _WIDE and weight.is_contiguous():
        return _onednn(weight, x).t().contiguous()
    return _onednn(x, weight)


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` of the decoder (attention and MLP projections) whose CPU inference
    on few rows leaves MKL (``fast_linear``): 1-64 fp32 rows (1-32 bf16) where the small-row kernel
    builds, else 2-32 fp32 rows through oneDNN.

    MKL, which PyTorch calls for fp32 on a CPU, is the faster of it and oneDNN for one row (an AR
    step at batch 1: 71 against 205 us for 640 -> 1,024) and level from about 100 rows (a prefill),
    but 1.2-1.8x slower for the few rows of a partial denoising pass or a batched AR step (an AMD
    EPYC, 2026-12-07: 4 rows of 2,048 -> 640 took 761 us against 425). The small-row kernel beats
    both from one row to 64 (``smallm.py``). The sums are ordered differently from MKL's: the last
    bits differ. peft wraps it as it wraps ``nn.Linear``.
    """

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (self.bias is None and cpu_inference(x, self.weight)  # (a compiled graph never asks the kernel)
                and (smallm.takes(rows, self.weight) or 2 <= rows <= 32)):
            return fast_linear(x.reshape(rows, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


def head_product(h: Tensor, head: nn.Module, vocab: Tensor | None = None) -> Tensor:
    """``head(h)`` for rows ``h [N, d]``: ``fast_linear`` for a plain bias-free head; a wrapped
    head (LoRA) runs its own forward. ``vocab [S]``: only these outputs, ``[N, S]`` (a plain head
    multiplies their weight rows alone)."""
    if type(head) is nn.Linear and head.bias is None:
        return fast_linear(h, head.weight if vocab is None else head.weight[vocab])
    z = head(h)
    return z if vocab is None else z[:, vocab]
