"""Normalisation layers.

Legend: D feature dim (last axis of any input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (bf16 sums of squares lose the small-norm tokens), cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        y_D = F.rms_norm(x_D.float(), (x_D.shape[-1],), eps=self.eps)
        return (y_D * self.weight.float()).to(x_D.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
