"""mmtrain's MoE feed-forward for the HF classes: routed SwiGLU experts + shared experts.

Routing (DeepSeek-V3 style, in fp32): logits = x W_gate^T; scores s = sigmoid(logits) or
softmax(logits); the top-k experts are chosen on s + e_score_correction_bias (the bias steers
selection only); weights w = s of the chosen, divided by their sum for sigmoid, times
routed_scaling_factor. y = sum_k w_k expert_k(x) + shared(x). With modality groups, text tokens
choose among experts [0, n_text_experts) and visual tokens among the rest. Padding tokens are
not routed (shared experts only), as in mmtrain.

Legend: T tokens, D model dim, E routed experts, K top-k, R routed (token, slot) pairs of one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops_mmtrain import SwiGLU

Tensor = torch.Tensor


class MoEGate(nn.Module):
    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))


class MmtrainMoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        D, F_ = config.hidden_size, config.moe_intermediate_size
        self.config = config
        self.gate = MoEGate(D, config.n_routed_experts)
        self.experts = nn.ModuleList(SwiGLU(D, F_) for _ in range(config.n_routed_experts))
        self.shared_experts = SwiGLU(D, config.n_shared_experts * F_) if config.n_shared_experts else None

    def route(self, x_TD: Tensor, visual_T: Tensor) -> tuple[Tensor, Tensor]:
        """-> idx_TK (chosen experts), w_TK (combine weights)."""
        cfg = self.config
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        allowed_TE = None
        if cfg.modality_groups:
            text_E = torch.arange(cfg.n_routed_experts, device=x_TD.device) < cfg.n_text_experts
            allowed_TE = text_E[None, :] != visual_T[:, None]
        if cfg.scoring_func == "softmax":
            s_TE = (
                logits_TE if allowed_TE is None else logits_TE.masked_fill(~allowed_TE, float("-inf"))
            ).softmax(-1)
        else:
            s_TE = torch.sigmoid(logits_TE) if allowed_TE is None else torch.sigmoid(logits_TE) * allowed_TE
        sel_TE = s_TE + self.gate.e_score_correction_bias.float()
        if allowed_TE is not None:
            sel_TE = sel_TE.masked_fill(~allowed_TE, float("-inf"))
        idx_TK = sel_TE.topk(cfg.num_experts_per_tok, dim=-1).indices
        w_TK = s_TE.gather(-1, idx_TK)
        if cfg.scoring_func == "sigmoid":
            w_TK = w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return idx_TK, w_TK * cfg.routed_scaling_factor

    def forward(self, x_BSD: Tensor, visual_BS: Tensor, real_BS: Tensor) -> Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        idx_TK, w_TK = self.route(x_TD, visual_BS.reshape(-1))
        idx_TK = torch.where(real_BS.reshape(-1, 1), idx_TK, -1)  # padding: no expert
        y_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            tok_R, slot_R = torch.nonzero(idx_TK == e, as_tuple=True)
            if tok_R.numel():
                y_TD.index_add_(0, tok_R, expert(x_TD[tok_R]) * w_TK[tok_R, slot_R, None].to(x_TD.dtype))
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(B, S, D)
