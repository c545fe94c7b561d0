"""The MoE layer's config (see models/moe/__init__.py for the layer's contract)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmtrain.checks import check

from .experts import EXPERT_PATHS


@dataclass
class MoEConfig:
    n_routed: int = 8
    top_k: int = 2
    n_shared: int = 1  # shared experts, fused into one SwiGLU of n_shared * expert_dim
    expert_dim: int = 256  # hidden width of one expert
    score: Literal["sigmoid", "softmax"] = "sigmoid"
    route_scale: float = 1.0  # multiplies the combine weights (DeepSeek-V3 routed_scaling_factor)
    bias_update_rate: float = 1e-3  # aux-loss-free balancing step (0 disables)
    seq_aux_weight: float = 1e-4
    router_z_weight: float = 1e-3
    modality_groups: bool = False
    n_text_experts: int = 0  # with modality_groups: experts [0, n_text) serve text
    n_visual_experts: int = 0  # ... and [n_text, n_routed) serve image and video
    first_dense_layers: int = 1  # the first layers use a dense SwiGLU FFN
    dispatch: str = "auto"  # how the experts run: auto, or an entry of models/moe/experts.EXPERT_PATHS

    def __post_init__(self) -> None:
        check(self, "n_routed", "top_k", "expert_dim", ge=1)
        check(self, "n_shared", "first_dense_layers", "n_text_experts", "n_visual_experts", ge=0)
        check(self, "bias_update_rate", "seq_aux_weight", "router_z_weight", "route_scale", ge=0)
        check(self, "score", choices=("sigmoid", "softmax"))
        check(self, "dispatch", choices=("auto", *EXPERT_PATHS))
        if self.modality_groups:
            if self.n_text_experts + self.n_visual_experts != self.n_routed:
                raise ValueError(f"n_text_experts: n_text_experts + n_visual_experts must equal n_routed "
                                 f"{self.n_routed} (got {self.n_text_experts} + {self.n_visual_experts})")
            if min(self.n_text_experts, self.n_visual_experts) < self.top_k:
                raise ValueError(f"top_k: must be <= each group's experts (got {self.top_k}, groups "
                                 f"{self.n_text_experts}/{self.n_visual_experts})")
        elif self.top_k > self.n_routed:
            raise ValueError(f"top_k: must be <= n_routed {self.n_routed} (got {self.top_k})")

    def group_sizes(self) -> list[int]:
        """Experts per group, in expert order: [all], or [text, visual] with modality groups."""
        return [self.n_text_experts, self.n_visual_experts] if self.modality_groups else [self.n_routed]

    def expert_group_E(self) -> list[int]:
        """Group of each routed expert: 0 text (or everyone), 1 visual."""
        return [g for g, size in enumerate(self.group_sizes()) for _ in range(size)]
