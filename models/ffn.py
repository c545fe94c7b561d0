"""Feed-forward blocks: SwiGLU (decoder dense FFN, shared experts) and a GELU MLP (vision).

Legend: D model dim, F hidden dim; `*` any leading shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(h_F2: torch.Tensor) -> torch.Tensor:
    """(*, 2F) fused gate|up projections -> (*, F)."""
    gate_F, up_F = h_F2.chunk(2, dim=-1)
    return F.silu(gate_F) * up_F


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, 2 * hidden, bias=False)  # gate | up, one matmul
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.w_out(swiglu(self.w_in(x_D)))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, out_dim or dim, bias=False)

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x_D), approximate="tanh"))
