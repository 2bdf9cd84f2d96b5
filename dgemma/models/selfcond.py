"""Conditioning signals added to the embeddings of noisy (decoder) tokens.

Self-conditioning: the previous denoising step's prediction, as a probability-weighted mix of
token embeddings, passes through RMSNorm -> GeGLU FFN -> RMSNorm and is added to the input
embeddings. The FFN's output projection starts at zero, and "no previous step" is the zero
signal, so at initialisation the model is bit-for-bit the plain model (RMSNorm(0) = 0 and the
FFN has no biases).

Two variants:

- ``zero_init`` (for adapting an AR model): ``emb + post_norm(FFN(pre_norm(signal)))``; exactly
  the pretrained model at step 0.
- ``postnorm`` (the released DiffusionGemma's): ``post_norm(emb + FFN(pre_norm(signal)))``
  with a scale-free post-norm, applied even when the signal is zero.

Time conditioning (Lite): a sinusoidal embedding of ``t`` through a small MLP whose last layer
starts at zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dgemma.device import cpu_bf16_features
from dgemma.models import smallm
from dgemma.models.primitives import GeGLU, RMSNorm, cpu_inference, fast_linear, onednn_fits


class SelfConditioning(nn.Module):
    def __init__(self, dim: int, hidden: int, eps: float, variant: str = "zero_init", unit_offset: bool = True):
        super().__init__()
        if variant not in ("zero_init", "postnorm"):
            raise ValueError(f"self-conditioning variant must be 'zero_init' or 'postnorm', got {variant!r}")
        self.variant = variant
        self.pre_norm = RMSNorm(dim, eps, unit_offset=unit_offset)
        self.mlp = GeGLU(dim, hidden)
        self.post_norm = RMSNorm(dim, eps, with_scale=variant == "zero_init", unit_offset=unit_offset)
        nn.init.zeros_(self.mlp.down_proj.weight)

    def forward(self, emb: Tensor, signal: Tensor | None) -> Tensor:
        """``emb [.., d]`` plus the conditioned ``signal [.., d]`` (None = zero signal)."""
        if self.variant == "zero_init":
            if signal is None:  # FFN(RMSNorm(0)) == 0 exactly: skip the work
                return emb
            return emb + self.post_norm(self.mlp(self.pre_norm(signal.to(emb.dtype))))
        delta = 0.0 if signal is None else self.mlp(self.pre_norm(signal.to(emb.dtype)))
        return self.post_norm(emb + delta)


@torch.no_grad()
def expected_embedding(
    hidden: Tensor, weight: Tensor, *, temperature: float = 1.0, chunk: int = 32_768, softcap: float | None = None
) -> Tensor:
    """``softmax(hidden @ weight.T / T) @ weight`` without materialising full-vocabulary logits.

    Two passes over vocabulary chunks: a log-sum-exp, then the weighted sum. Used for the
    detached first pass of self-conditioned training (docs/design.md §2), where ``[tokens, vocab]`` logits
    would dominate memory. ``hidden [N, d]``, ``weight [V, d]`` -> ``[N, d]``.
    """
    h = hidden.float()

    def logits(lo: int) -> Tensor:
        z = h @ weight[lo : lo + chunk].float().T
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        return z / temperature

    vocab = weight.shape[0]
    lse = torch.full(h.shape[:-1], -math.inf, device=h.device)
    for lo in range(0, vocab, chunk):
        lse = torch.logaddexp(lse, torch.logsumexp(logits(lo), -1))
    out = torch.zeros_like(h)
    for lo in range(0, vocab, chunk):
        out += torch.exp(logits(lo) - lse[..., None]) @ weight[lo : lo + chunk].float()
    return out.to(hidden.dtype)


def probs_embedding(logits: Tensor, weight: Tensor) -> Tensor:
    """``softmax(logits) @ weight`` for logits the sampler already holds (``[.., V]`` -> ``[.., d]``).

    The softmax runs in fp32 (at least); the product in the embedding's own dtype, so a bf16
    model never casts its ``[V, d]`` embedding (670 MB in fp32 for Gemma 3) at every step.
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return embed_probs(probs, weight)


def embed_probs(probs: Tensor, weight: Tensor) -> Tensor:
    """``probs [.., V] @ weight [V, d]`` in the embedding's dtype (the product of :func:`probs_embedding`).

    On a CPU with AMX, bf16, oneDNN's product of fewer than 16 rows against Gemma's 262,144 x 640
    embedding took 28-39 ms where 16 rows took 21 (the memory-bound time to read it once); the
    rows are padded with zeros to 16 there (measured 2026-12-05, ``docs/benchmarks.md``). A zero
    row changes no other row's sum, so the result is the unpadded product's up to its rounding.
    In fp32 on a CPU, 2-64 rows go to the small-row kernel where it builds (``smallm.py:probs_embed``:
    55 / 94 ms for 16 / 32 rows against 78 / 127), else fewer than 32 rows through oneDNN instead
    of MKL (an AMD EPYC: 26 / 41 / 82 ms for 1 / 4 / 16 rows against 47 / 81 / 97; level at 32-64
    rows, slower at 128). In bf16 on a CPU with AVX512-BF16 and no AMX, 1-24 rows go to the bf16
    kernel (18 / 32 ms for 1 / 16 rows against oneDNN's 30 / 42, an AMD EPYC, 2026-12-07).
    """
    rows = probs.reshape(-1, probs.shape[-1]).to(weight.dtype)
    n = rows.shape[0]
    if cpu_inference(rows, weight) and smallm.probs_fit(rows, weight) and not _pad_small_products(weight):
        return smallm.probs_embed(rows, weight).view(*probs.shape[:-1], weight.shape[1])
    if n < _PAD_ROWS * 2 and onednn_fits(rows, weight):  # fp32, CPU: primitives.py:fast_linear
        return fast_linear(rows, weight.t()).view(*probs.shape[:-1], weight.shape[1])
    if n < _PAD_ROWS and _pad_small_products(weight):
        rows = torch.cat([rows, rows.new_zeros(_PAD_ROWS - n, rows.shape[1])])
    return (rows @ weight)[:n].view(*probs.shape[:-1], weight.shape[1])


_PAD_ROWS = 16


def _pad_small_products(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and "amx_bf16" in cpu_bf16_features()


def sinusoidal(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
    """Standard sinusoidal features of ``t [B]`` in ``[0, 1]`` (scaled by 1000) -> ``[B, dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class TimeEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, t: Tensor) -> Tensor:
        """``t [B]`` -> ``[B, dim]``."""
        feats = sinusoidal(t, self.freq_dim).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(feats)))
