"""Mixture of Experts: fine-grained routed SwiGLU experts + shared expert(s).

Routing (DeepSeek-V3): sigmoid or softmax scores; top-k chosen on score + bias, where the
per-expert bias is adjusted outside autograd (`update_bias`, auxiliary-loss-free balancing) and
never enters the combine weights. A small sequence-level balance loss and a router z-loss ride
along. Optional modality groups (MoMa): text tokens route among the text experts, image/video
tokens among the visual experts; shared experts serve everyone.

`forward` returns (y, aux) with aux a plain dict of tensors (a pytree, so FSDP2 sees every
tensor that needs a gradient): weighted losses plus detached per-modality load and router
entropy. Load is accumulated into a buffer by the caller (outside activation checkpointing,
which would replay forward and count twice).

Legend: B batch rows, S tokens per row, T = B*S tokens, D model dim, E routed experts,
F expert hidden dim, K top_k, G expert groups (1, or 2 with modality groups),
3 modalities (text, image, video).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.checks import check

from .chunked import over_tokens
from .ffn import SwiGLU
from .moe_dispatch import count, run_experts

Tensor = torch.Tensor
N_MODALITIES = 3  # text, image, video (data_pipelines.batch TEXT / IMAGE / VIDEO)


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
    dispatch: Literal["auto", "grouped_mm", "batched", "loop"] = "auto"

    def __post_init__(self) -> None:
        check(self, "n_routed", "top_k", "expert_dim", ge=1)
        check(self, "n_shared", "first_dense_layers", "n_text_experts", "n_visual_experts", ge=0)
        check(self, "bias_update_rate", "seq_aux_weight", "router_z_weight", "route_scale", ge=0)
        check(self, "score", choices=("sigmoid", "softmax"))
        check(self, "dispatch", choices=("auto", "grouped_mm", "batched", "loop"))
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


def route(logits_TE: Tensor, bias_E: Tensor, allowed_TE: Tensor | None, cfg: MoEConfig):
    """-> idx_TK (chosen experts), w_TK (combine weights), p_TE (scores normalised per token)."""
    if cfg.score == "softmax":
        masked_TE = logits_TE if allowed_TE is None else logits_TE.masked_fill(~allowed_TE, float("-inf"))
        s_TE = masked_TE.softmax(-1)
    else:
        s_TE = torch.sigmoid(logits_TE)
        s_TE = s_TE if allowed_TE is None else s_TE * allowed_TE
    sel_TE = s_TE.detach() + bias_E  # the bias steers selection only
    if allowed_TE is not None:
        sel_TE = sel_TE.masked_fill(~allowed_TE, float("-inf"))
    idx_TK = sel_TE.topk(cfg.top_k, dim=-1).indices
    w_TK = s_TE.gather(-1, idx_TK)
    if cfg.score == "sigmoid":
        w_TK = w_TK / w_TK.sum(-1, keepdim=True).clamp_min(1e-20)
    p_TE = s_TE / s_TE.sum(-1, keepdim=True).clamp_min(1e-20)
    return idx_TK, w_TK * cfg.route_scale, p_TE


def seq_balance_loss(p_BSE: Tensor, chosen_BSE: Tensor, group_BS: Tensor, group_sizes: list[int],
                     top_k: int) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss, per row and per expert group; 1.0 when balanced.

    Groups are contiguous expert ranges of the given sizes (MoEConfig.group_sizes).
    """
    total, start = p_BSE.new_zeros(()), 0
    for g, size in enumerate(group_sizes):
        tok_BS1 = (group_BS == g).unsqueeze(-1).to(p_BSE.dtype)
        n_B1 = tok_BS1.sum(1)
        f_BE = (chosen_BSE * tok_BS1).sum(1)[:, start:start + size] * size / (top_k * n_B1.clamp_min(1))
        P_BE = (p_BSE * tok_BS1).sum(1)[:, start:start + size] / n_B1.clamp_min(1)
        has_B = (n_B1[:, 0] > 0).to(p_BSE.dtype)
        total = total + ((f_BE * P_BE).sum(-1) * has_B).sum() / has_B.sum().clamp_min(1)
        start += size
    return total


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, token_chunk: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_chunk = token_chunk  # experts run on chunks of this many tokens (0: all at once)
        E, hidden = cfg.n_routed, cfg.expert_dim
        self.router = nn.Linear(dim, E, bias=False)
        self.w_in_EDF2 = nn.Parameter(torch.empty(E, dim, 2 * hidden))  # gate | up per expert
        self.w_out_EFD = nn.Parameter(torch.empty(E, hidden, dim))
        self.shared = SwiGLU(dim, cfg.n_shared * hidden) if cfg.n_shared else None
        self.register_buffer("group_E", torch.tensor(cfg.expert_group_E()), persistent=False)
        # fp32 on purpose: rate-sized steps vanish in bf16. Persistent: it is model state.
        self.register_buffer("expert_bias_E", torch.zeros(E, dtype=torch.float32))
        # Tokens routed to each expert since the last update_bias() (training forwards only).
        self.register_buffer("load_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.router.weight, std=std)
        nn.init.normal_(self.w_in_EDF2, std=std)
        nn.init.normal_(self.w_out_EFD, std=out_std or std)
        if self.shared is not None:
            nn.init.normal_(self.shared.w_in.weight, std=std)
            nn.init.normal_(self.shared.w_out.weight, std=out_std or std)
        self.group_E.copy_(torch.tensor(self.cfg.expert_group_E(), device=self.group_E.device))
        self.expert_bias_E.zero_()
        self.load_E.zero_()

    def forward(self, x_BSD: Tensor, modality_BS: Tensor | None = None,
                real_BS: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """real_BS (bool): tokens to route; the others (padding) get only the shared expert and
        stay out of the load, the balance, the z-loss and the entropy."""
        cfg = self.cfg
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        mod_T = (modality_BS.reshape(-1).long() if modality_BS is not None
                 else x_TD.new_zeros(B * S, dtype=torch.long))
        real_T = (real_BS.reshape(-1) if real_BS is not None
                  else torch.ones(B * S, dtype=torch.bool, device=x_TD.device))
        group_T = (mod_T != 0).long() if cfg.modality_groups else torch.zeros_like(mod_T)
        allowed_TE = (group_T[:, None] == self.group_E[None, :]) if cfg.modality_groups else None

        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 routing: selection and z-loss
            logits_TE = F.linear(x_TD.float(), self.router.weight.float())  # are precision-sensitive
        idx_TK, w_TK, p_TE = route(logits_TE, self.expert_bias_E, allowed_TE, cfg)
        y_TD = over_tokens(self.experts, self.token_chunk, x_TD, idx_TK, w_TK, real_T)
        aux = self._aux(logits_TE, allowed_TE, idx_TK, p_TE, group_T, mod_T, real_T, B, S)
        return y_TD.view(B, S, D).to(x_BSD.dtype), aux

    def experts(self, x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor, real_T: Tensor) -> Tensor:
        """The routed experts' weighted sum plus the shared expert, per token."""
        y_TD = run_experts(x_TD, idx_TK, w_TK, self.w_in_EDF2, self.w_out_EFD, self.cfg.dispatch, real_T)
        return y_TD if self.shared is None else y_TD + self.shared(x_TD)

    def _aux(self, logits_TE, allowed_TE, idx_TK, p_TE, group_T, mod_T, real_T, B, S) -> dict[str, Tensor]:
        cfg, E = self.cfg, self.cfg.n_routed
        chosen_TE = torch.zeros_like(p_TE).scatter_(-1, idx_TK, 1.0)
        seq = seq_balance_loss(p_TE.view(B, S, E), chosen_TE.view(B, S, E),
                               torch.where(real_T, group_T, -1).view(B, S), cfg.group_sizes(), cfg.top_k)
        masked_TE = logits_TE if allowed_TE is None else logits_TE.masked_fill(~allowed_TE, float("-inf"))
        # Mean over token slots, padding adding 0: every data-parallel rank divides by the same
        # B * S, so the ranks' mean is the global batch's (a mean over real tokens would not be).
        z = torch.where(real_T, masked_TE.logsumexp(-1).square(), 0).sum() / real_T.numel()
        with torch.no_grad():
            mod_T = torch.where(real_T, mod_T, N_MODALITIES)  # padding: an extra bin, dropped
            flat_R = (mod_T[:, None] * E + idx_TK).reshape(-1)
            load_3E = count(flat_R, (N_MODALITIES + 1) * E)[: N_MODALITIES * E].view(N_MODALITIES, E)
            ent_T = -(p_TE * p_TE.clamp_min(1e-20).log()).sum(-1)
            n_3 = count(mod_T, N_MODALITIES + 1)[:N_MODALITIES]
            ent_3 = torch.zeros(N_MODALITIES + 1, device=ent_T.device).index_add(0, mod_T, ent_T)
            ent_3 = ent_3[:N_MODALITIES] / n_3.clamp_min(1)
        return {"moe_seq_balance": cfg.seq_aux_weight * seq, "router_z": cfg.router_z_weight * z,
                "load_3E": load_3E, "router_entropy_3": ent_3}

    @torch.no_grad()
    def accumulate_load(self, load_3E: Tensor) -> None:
        self.load_E += load_3E.sum(0)

    @torch.no_grad()
    def update_bias(self, load_E: Tensor | None = None) -> None:
        """bias += rate * sign(mean_load - load), per expert group; then clear the load.

        `load_E` overrides the accumulated buffer (e.g. after an all-reduce across ranks, so
        every rank applies the same update and the replicated biases stay identical).
        """
        load_E, start = (self.load_E if load_E is None else load_E).float(), 0
        for size in self.cfg.group_sizes():
            load_G = load_E[start:start + size]
            step_G = self.cfg.bias_update_rate * (load_G.mean() - load_G).sign()
            self.expert_bias_E[start:start + size] += step_G
            start += size
        self.load_E.zero_()
