"""The attention layer shared by the vision encoder and the decoder: projections, QK-norm,
rotary, GQA; the attention itself is `models.attention.attend` (one semantics, many backends).

The fused projection `wqkv` stores its rows grouped by KV head: for each group g its r = H / K
query heads, then k head g, then v head g (each E rows). A contiguous block of rows is then whole
GQA groups, so tensor parallelism's Shard(0) of the weight gives a rank whole groups
(mmtrain/parallel/tensor_parallel.py); `qkv_order` maps it to the [q | k | v] order HF uses.

Legend: B batch rows, S tokens, D model dim, H query heads, K kv heads, E head dim,
F rotary pairs (E / 2).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionConfig, attend
from .norms import RMSNorm
from .rope import apply_rotary

Tensor = torch.Tensor


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, qk_norm: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"n_heads: must divide dim {dim} (got {n_heads})")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: must divide n_heads {n_heads} (got {n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        # QK-norm (per head, over the head dim) bounds the attention logits: the first thing to
        # blow up when modalities compete (Chameleon) or a ViT trains from scratch (ViT-22B).
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def forward(self, x_BSD: Tensor, cos_B1SF: Tensor, sin_B1SF: Tensor, meta, cfg: AttentionConfig,
                sparse: bool = False, capture: dict | None = None, stats: dict | None = None,
                context=None, return_qk: bool = False) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """`context` (attention/context.py): x is this rank's chunk of every row. `return_qk`: also
        q and k (detached), what captures and attention counts are computed from."""
        q_BHSE, k_BKSE, v_BKSE = self.project(x_BSD, cos_B1SF, sin_B1SF)
        o_BHSE = attend(q_BHSE, k_BKSE, v_BKSE, meta, cfg, sparse=sparse, capture=capture, stats=stats,
                        context=context)
        if return_qk:
            return self.output(o_BHSE), q_BHSE.detach(), k_BKSE.detach()
        return self.output(o_BHSE)

    def project(self, x_BSD: Tensor, cos_B1SF: Tensor, sin_B1SF: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, S, E), k and v (B, K, S, E): QK-norm and rotary applied (what a KV cache keeps)."""
        B, S, _ = x_BSD.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        q_BSHE, k_BSKE, v_BSKE = split_qkv(self.wqkv(x_BSD), H, K, E)
        q_BHSE, k_BKSE, v_BKSE = (t.transpose(1, 2) for t in (q_BSHE, k_BSKE, v_BSKE))
        if self.q_norm is not None:
            q_BHSE, k_BKSE = self.q_norm(q_BHSE), self.k_norm(k_BKSE)
        q_BHSE = apply_rotary(q_BHSE, cos_B1SF, sin_B1SF)
        k_BKSE = apply_rotary(k_BKSE, cos_B1SF, sin_B1SF)
        return q_BHSE, k_BKSE, v_BKSE.contiguous()

    def output(self, o_BHSE: Tensor) -> Tensor:
        """Attention output (B, H, S, E) -> (B, S, D)."""
        B, H, S, E = o_BHSE.shape
        return self.wo(o_BHSE.transpose(1, 2).reshape(B, S, H * E))

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.wqkv.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


def split_qkv(qkv_BSF: Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The grouped wqkv's output (B, S, (H + 2K) E) -> q (B, S, H, E), k and v (B, S, K, E)."""
    B, S, _ = qkv_BSF.shape
    H, K, E = n_heads, n_kv_heads, head_dim
    q_BSKrE, k_BSK1E, v_BSK1E = qkv_BSF.view(B, S, K, H // K + 2, E).split([H // K, 1, 1], dim=3)
    return q_BSKrE.reshape(B, S, H, E), k_BSK1E.squeeze(3), v_BSK1E.squeeze(3)


def qkv_order(n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """Row indices that turn the grouped `wqkv` into rows [q | k | v] (heads in order inside each):
    `w_grouped[qkv_order(...)]`; `argsort` of it goes back."""
    H, K, E = n_heads, n_kv_heads, head_dim
    r = H // K
    slot_GR = torch.arange(K * (r + 2)).view(K, r + 2)  # the grouped layout's head slots
    heads = torch.cat([slot_GR[:, :r].reshape(-1), slot_GR[:, r], slot_GR[:, r + 1]])
    return (heads[:, None] * E + torch.arange(E)).reshape(-1)
