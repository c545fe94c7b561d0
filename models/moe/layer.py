"""The MoE layer: router -> dispatcher -> experts, plus the shared expert(s) every token uses.

`forward` returns (y, aux) with aux a plain dict of tensors (a pytree, so FSDP2 sees every tensor
that needs a gradient): weighted losses plus detached per-modality load and router entropy. Load
is accumulated into the router's buffer by the caller (outside activation checkpointing, which
would replay forward and count twice).

State-dict names: `router.weight`, `router.expert_bias_E`, `experts.w_in_EDF2`,
`experts.w_out_EFD`, `shared.*`; checkpoints of the single-module layout (`expert_bias_E`,
`w_in_EDF2`, `w_out_EFD` on the layer) load through `LEGACY_NAMES`.

Legend: B batch rows, S tokens per row, T = B*S tokens, D model dim, E routed experts, K top_k.
"""

from __future__ import annotations

import torch
from torch import nn

from ..chunked import over_tokens
from ..ffn import SwiGLU
from .config import MoEConfig
from .dispatch import LocalDispatcher
from .experts import Experts
from .router import Router

Tensor = torch.Tensor
LEGACY_NAMES = {"expert_bias_E": "router.expert_bias_E", "w_in_EDF2": "experts.w_in_EDF2",
                "w_out_EFD": "experts.w_out_EFD"}  # old name -> name, relative to the layer


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, token_chunk: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_chunk = token_chunk  # experts run on chunks of this many tokens (0: all at once)
        self.router = Router(dim, cfg)
        self.experts = Experts(cfg.n_routed, dim, cfg.expert_dim, cfg.dispatch)
        self.shared = SwiGLU(dim, cfg.n_shared * cfg.expert_dim) if cfg.n_shared else None
        self.dispatcher = LocalDispatcher()  # parallelize swaps in the expert-parallel one
        self._register_load_state_dict_pre_hook(_rename_legacy)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std, out_std)
        if self.shared is not None:
            nn.init.normal_(self.shared.w_in.weight, std=std)
            nn.init.normal_(self.shared.w_out.weight, std=out_std or std)

    def forward(self, x_BSD: Tensor, modality_BS: Tensor | None = None, real_BS: Tensor | None = None,
                row_sum=None) -> tuple[Tensor, dict[str, Tensor]]:
        """real_BS (bool): tokens to route; the others (padding) get only the shared expert and
        stay out of the load, the balance, the z-loss and the entropy. `row_sum` (autograd sum
        over the ranks that share each row, context parallelism) completes the per-row balance."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        mod_T = (modality_BS.reshape(-1).long() if modality_BS is not None
                 else x_TD.new_zeros(B * S, dtype=torch.long))
        real_T = (real_BS.reshape(-1) if real_BS is not None
                  else torch.ones(B * S, dtype=torch.bool, device=x_TD.device))
        group_T = (mod_T != 0).long() if self.cfg.modality_groups else torch.zeros_like(mod_T)
        r = self.router(x_TD, group_T)
        idx_TK = torch.where(real_T[:, None], r.idx_TK, self.cfg.n_routed)  # padding: the virtual expert
        # as many chunks as every rank of a collective dispatch runs (the same count on each)
        n_chunks = self.dispatcher.chunks(B * S, self.token_chunk, x_TD.device)
        y_TD = over_tokens(self._ffn, self.token_chunk, x_TD, idx_TK, r.w_TK, n_chunks=n_chunks)
        aux = self.router.aux(r, group_T, mod_T, real_T, B, S, row_sum)
        return y_TD.view(B, S, D).to(x_BSD.dtype), aux

    def _ffn(self, x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor) -> Tensor:
        """The routed experts' weighted sum plus the shared expert, per token."""
        y_TD = self.dispatcher(self.experts, x_TD, idx_TK, w_TK)
        return y_TD if self.shared is None else y_TD + self.shared(x_TD)

    @property
    def load_E(self) -> Tensor:
        return self.router.load_E

    @torch.no_grad()
    def accumulate_load(self, load_3E: Tensor) -> None:
        self.router.load_E += load_3E.sum(0)

    def update_bias(self, load_E: Tensor | None = None) -> None:
        self.router.update_bias(load_E)


def _rename_legacy(state_dict, prefix, *args) -> None:
    for old, new in LEGACY_NAMES.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
