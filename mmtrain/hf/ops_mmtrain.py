"""Shared pieces of the mmtrain HF classes: RMSNorm, rotary embeddings, SwiGLU, the attention kernels.

Rotary: "rotate-half" pairs (feature i with i + F), computed in fp32. The decoder's M-RoPE is one
frequency ladder theta^(-i/F) over all F pairs cut into contiguous (t, h, w) sections; the vision
tower gives each axis its own full ladder over its section (a quarter of the pairs to t).

Legend: B rows, H heads, S queries, T keys, E head dim, F rotary pairs (E / 2), A position axes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class RMSNorm(nn.Module):
    """In fp32 (bf16 sums of squares lose small-norm tokens), cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def inv_freq(n_pairs: int, theta: float, device) -> Tensor:
    return theta ** (-torch.arange(n_pairs, dtype=torch.float32, device=device) / n_pairs)


def axial_angles(pos_A_: Tensor, freqs: list[Tensor]) -> Tensor:
    """Positions (A, *) and one frequency vector per axis -> angles (*, F)."""
    return torch.cat([pos_A_[a].float()[..., None] * f for a, f in enumerate(freqs) if f.numel()], dim=-1)


def mrope_freqs(head_dim: int, sections: list[int], theta: float, device) -> list[Tensor]:
    return list(torch.split(inv_freq(head_dim // 2, theta, device), list(sections)))


def vision_freqs(head_dim: int, theta: float, device) -> list[Tensor]:
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [inv_freq(n, theta, device) for n in (half - 2 * hw, hw, hw)]


def apply_rotary(x_E: Tensor, cos_F: Tensor, sin_F: Tensor) -> Tensor:
    half = x_E.shape[-1] // 2
    x1, x2 = x_E.float()[..., :half], x_E.float()[..., half:]
    return torch.cat([x1 * cos_F - x2 * sin_F, x2 * cos_F + x1 * sin_F], dim=-1).to(x_E.dtype)


def attention(q_BHSE: Tensor, k_BKTE: Tensor, v_BKTE: Tensor, mask_BhST: Tensor, impl: str) -> Tensor:
    """softmax(q k^T / sqrt(E) where mask) v, GQA; mask (B, 1 or H, S, T) bool; every row keeps a key.
    "eager": fp32 matmuls and softmax; "sdpa": PyTorch's fused kernel."""
    H, K = q_BHSE.shape[1], k_BKTE.shape[1]
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q_BHSE, k_BKTE, v_BKTE, attn_mask=mask_BhST, enable_gqa=H != K)
    if impl != "eager":
        raise ValueError(
            f"attn_implementation: mmtrain's attention runs {ATTN_IMPLEMENTATIONS} (got {impl!r}); "
            "other kernels would drop the sparse layers' block rule"
        )
    dt = torch.promote_types(q_BHSE.dtype, torch.float32)
    k_BHTE = k_BKTE.to(dt).repeat_interleave(H // K, 1)
    v_BHTE = v_BKTE.to(dt).repeat_interleave(H // K, 1)
    s_BHST = q_BHSE.to(dt) @ k_BHTE.transpose(-1, -2) / math.sqrt(q_BHSE.shape[-1])
    return (s_BHST.masked_fill(~mask_BhST, float("-inf")).softmax(-1) @ v_BHTE).to(q_BHSE.dtype)
