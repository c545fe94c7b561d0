"""The router: scores, top-k choice steered by a balancing bias, and the routing statistics.

DeepSeek-V3 routing: sigmoid or softmax scores; top-k chosen on score + bias, where the per-expert
bias is adjusted outside autograd (`update_bias`, auxiliary-loss-free balancing) and never enters
the combine weights. With modality groups (MoMa) text tokens choose among the text experts and
image/video tokens among the visual ones. Replicated on every rank: under expert parallelism
every rank routes its own tokens over all E experts.

Legend: T tokens, D model dim, E routed experts, K top_k, B rows, S tokens per row,
3 modalities (text, image, video).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .dispatch import count

Tensor = torch.Tensor
N_MODALITIES = 3  # text, image, video (data_pipelines.batch TEXT / IMAGE / VIDEO)


@dataclass
class Routing:
    idx_TK: Tensor  # chosen experts
    w_TK: Tensor  # combine weights (route_scale included)
    p_TE: Tensor  # scores normalised per token (balance loss, entropy)
    logits_TE: Tensor  # fp32 router logits (z-loss)
    allowed_TE: Tensor | None  # experts of each token's group; None without modality groups


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
                     top_k: int, row_sum=None) -> Tensor:
    """DeepSeek-V3 sequence-wise balance loss, per row and per expert group; 1.0 when balanced.

    Groups are contiguous expert ranges of the given sizes (MoEConfig.group_sizes). `row_sum`
    sums the per-row statistics over the ranks that each hold a chunk of every row.
    """
    total, start = p_BSE.new_zeros(()), 0
    for g, size in enumerate(group_sizes):
        tok_BS1 = (group_BS == g).unsqueeze(-1).to(p_BSE.dtype)
        sums_B1X = torch.cat([tok_BS1.sum(1), (chosen_BSE * tok_BS1).sum(1), (p_BSE * tok_BS1).sum(1)], -1)
        sums_B1X = sums_B1X if row_sum is None else row_sum(sums_B1X)
        n_B1, chosen_BE, p_BE = sums_B1X.split([1, p_BSE.shape[-1], p_BSE.shape[-1]], -1)
        f_BE = chosen_BE[:, start:start + size] * size / (top_k * n_B1.clamp_min(1))
        P_BE = p_BE[:, start:start + size] / n_B1.clamp_min(1)
        has_B = (n_B1[:, 0] > 0).to(p_BSE.dtype)
        total = total + ((f_BE * P_BE).sum(-1) * has_B).sum() / has_B.sum().clamp_min(1)
        start += size
    return total


class Router(nn.Linear):
    """A bias-free (E, D) projection (an nn.Linear, so a seed gives the same initial weights as the
    layer before the split) plus the choice, the balancing bias and the load counters."""

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__(dim, cfg.n_routed, bias=False)
        self.cfg = cfg
        E = cfg.n_routed
        self.register_buffer("group_E", torch.tensor(cfg.expert_group_E()), persistent=False)
        # fp32 on purpose: rate-sized steps vanish in bf16. Persistent: it is model state.
        self.register_buffer("expert_bias_E", torch.zeros(E, dtype=torch.float32))
        # Tokens routed to each expert since the last update_bias() (training forwards only).
        self.register_buffer("load_E", torch.zeros(E, dtype=torch.int64), persistent=False)

    def reset_parameters(self, std: float | None = None) -> None:
        if std is None:  # nn.Linear's constructor: before the buffers exist
            return super().reset_parameters()
        nn.init.normal_(self.weight, std=std)
        self.group_E.copy_(torch.tensor(self.cfg.expert_group_E(), device=self.group_E.device))
        self.expert_bias_E.zero_()
        self.load_E.zero_()

    def forward(self, x_TD: Tensor, group_T: Tensor) -> Routing:
        allowed_TE = (group_T[:, None] == self.group_E[None, :]) if self.cfg.modality_groups else None
        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 routing: selection and z-loss
            logits_TE = F.linear(x_TD.float(), self.weight.float())  # are precision-sensitive
        idx_TK, w_TK, p_TE = route(logits_TE, self.expert_bias_E, allowed_TE, self.cfg)
        return Routing(idx_TK, w_TK, p_TE, logits_TE, allowed_TE)

    def aux(self, r: Routing, group_T: Tensor, mod_T: Tensor, real_T: Tensor, B: int, S: int,
            row_sum=None) -> dict[str, Tensor]:
        """Weighted balance and z-losses, and detached per-modality load and routing entropy."""
        cfg, E = self.cfg, self.cfg.n_routed
        chosen_TE = torch.zeros_like(r.p_TE).scatter_(-1, r.idx_TK, 1.0)
        seq = seq_balance_loss(r.p_TE.view(B, S, E), chosen_TE.view(B, S, E),
                               torch.where(real_T, group_T, -1).view(B, S), cfg.group_sizes(), cfg.top_k,
                               row_sum)
        masked_TE = (r.logits_TE if r.allowed_TE is None
                     else r.logits_TE.masked_fill(~r.allowed_TE, float("-inf")))
        # Mean over token slots, padding adding 0: every data-parallel rank divides by the same
        # B * S, so the ranks' mean is the global batch's (a mean over real tokens would not be).
        z = torch.where(real_T, masked_TE.logsumexp(-1).square(), 0).sum() / real_T.numel()
        with torch.no_grad():
            mod_T = torch.where(real_T, mod_T, N_MODALITIES)  # padding: an extra bin, dropped
            flat_R = (mod_T[:, None] * E + r.idx_TK).reshape(-1)
            load_3E = count(flat_R, (N_MODALITIES + 1) * E)[: N_MODALITIES * E].view(N_MODALITIES, E)
            ent_T = -(r.p_TE * r.p_TE.clamp_min(1e-20).log()).sum(-1)
            n_3 = count(mod_T, N_MODALITIES + 1)[:N_MODALITIES]
            ent_3 = torch.zeros(N_MODALITIES + 1, device=ent_T.device).index_add(0, mod_T, ent_T)
            ent_3 = ent_3[:N_MODALITIES] / n_3.clamp_min(1)
        return {"moe_seq_balance": cfg.seq_aux_weight * seq, "router_z": cfg.router_z_weight * z,
                "load_3E": load_3E, "router_entropy_3": ent_3}

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
