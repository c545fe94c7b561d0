"""Feed-forward blocks: SwiGLU (decoder dense FFN, shared experts) and a GELU MLP (vision).

Legend: D model dim, F hidden dim; `*` any leading shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(h_F2: torch.Tensor) -> torch.Tensor:
    """(*, 2F) fused gate|up projections, the halves -> (*, F) (the routed experts' layout)."""
    gate_F, up_F = h_F2.chunk(2, dim=-1)
    return F.silu(gate_F) * up_F


def swiglu_pairs(h_F2: torch.Tensor) -> torch.Tensor:
    """(*, 2F) fused projections interleaved per hidden unit (gate_0, up_0, gate_1, ...) -> (*, F)."""
    gate_up_F2 = h_F2.unflatten(-1, (-1, 2))
    return F.silu(gate_up_F2[..., 0]) * gate_up_F2[..., 1]


class SwiGLU(nn.Module):
    """w_in's rows interleave gate and up per hidden unit, so a contiguous block of rows is whole
    units: tensor parallelism's Shard(0) gives a rank its units' gate and up rows together
    (mmtrain/parallel/tensor_parallel.py). HF's gate_proj / up_proj are its even / odd rows."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, 2 * hidden, bias=False)  # gate, up per unit: one matmul
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.w_out(swiglu_pairs(self.w_in(x_D)))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, out_dim or dim, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x_D), approximate="tanh"))
