"""The dense reference backend: materialise the (B, H, S, S) mask; eager fp32 softmax or SDPA.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Q query blocks, N key blocks,
G selection heads (H or K), Bs block size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .meta import AttnMeta, token_mask

Tensor = torch.Tensor


def expand_blocks(sel_BGQN: Tensor, H: int, block_size: int, S: int) -> Tensor:
    """Block selection -> token-level (B, H, S, S) bool (H from G by repeating each group)."""
    x_BGSS = sel_BGQN.repeat_interleave(block_size, -1).repeat_interleave(block_size, -2)
    x_BGSS = x_BGSS[..., :S, :S]
    return x_BGSS.repeat_interleave(H // sel_BGQN.shape[1], 1)


def dense_mask(meta: AttnMeta, sel_BGQN: Tensor | None, H: int) -> Tensor:
    """(B, 1 or H, S, S) bool: the token rule, AND the block selection of a sparse layer."""
    S = meta.seq_len
    doc_BS, span_BS = meta.doc_BP[:, :S], meta.span_BP[:, :S]
    pos_S = torch.arange(S, device=doc_BS.device)
    mask_BSS = token_mask(doc_BS[:, :, None], span_BS[:, :, None], pos_S[:, None],
                          doc_BS[:, None, :], span_BS[:, None, :], pos_S[None, :])
    if sel_BGQN is None:
        return mask_BSS[:, None]
    return mask_BSS[:, None] & expand_blocks(sel_BGQN, H, meta.block_size, S)


def dense_probs(q_BHSD: Tensor, k_BKSD: Tensor, mask_BHSS: Tensor) -> Tensor:
    """Eager attention probabilities (B, H, S, S), fp32 (or fp64 for fp64 inputs)."""
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    dt = torch.promote_types(q_BHSD.dtype, torch.float32)
    k_BHSD = k_BKSD.to(dt).repeat_interleave(H // K, 1)
    s_BHSS = (q_BHSD.to(dt) @ k_BHSD.transpose(-1, -2)) / math.sqrt(q_BHSD.shape[-1])
    return s_BHSS.masked_fill(~mask_BHSS, float("-inf")).softmax(-1)


def attend_dense(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta,
                 sel_BGQN: Tensor | None, eager: bool) -> Tensor:
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    mask_BHSS = dense_mask(meta, sel_BGQN, H)
    if eager:
        p_BHSS = dense_probs(q_BHSD, k_BKSD, mask_BHSS)
        v_BHSD = v_BKSD.to(p_BHSS.dtype).repeat_interleave(H // K, 1)
        return (p_BHSS @ v_BHSD).to(q_BHSD.dtype)
    return F.scaled_dot_product_attention(q_BHSD, k_BKSD, v_BKSD, attn_mask=mask_BHSS,
                                          enable_gqa=H != K)
