"""The dense reference backend: materialise the (B, H, S, S) mask; eager fp32 softmax or SDPA.

The mask is the token rule AND, for a sparse layer, the block rule (`blocks.kept`) evaluated for
every (query, key) pair of a document with doc-relative block numbers: no lists, no layout.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, G selection heads (H or K),
k = top_k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .blocks import kept
from .config import AttentionConfig
from .knockout import visible_keys
from .meta import AttnMeta, token_mask
from .opaque import attend_sparse_opaque
from .registry import ANY, BOTH, SPARSE, Backend, register_backend
from .select import Selection

Tensor = torch.Tensor


def key_visual_BS(meta: AttnMeta) -> Tensor:
    """Per token: its document block holds a visual token (the visual_always rule, per key)."""
    return meta.aligned().vis_BA.gather(1, meta.ablk_BS)


def rule_rows(meta: AttnMeta, cfg: AttentionConfig | None, sel: Selection | None, b_R: Tensor,
              i_R: Tensor) -> Tensor:
    """(G or 1, R, S) bool: what query rows (b_R, i_R) may attend, over all S keys of their row."""
    S = meta.seq_len
    pos_S = torch.arange(S, device=meta.doc_BS.device)
    doc_RS, skey_RS = meta.doc_BS[b_R], meta.skey_BS[b_R]
    mask_RS = token_mask(meta.doc_BS[b_R, i_R, None], meta.skey_BS[b_R, i_R, None], i_R[:, None],
                         doc_RS, skey_RS, pos_S[None])
    visible_RS = visible_keys(meta, b_R, i_R)
    if visible_RS is not None:  # a key knockout (knockout.py)
        mask_RS = mask_RS & visible_RS
    if sel is None:
        return mask_RS[None]
    nblk_BS = meta.nblk_BS
    picks_GRk = sel.row(meta)[b_R, :, i_R].transpose(0, 1)
    keep_GRS = kept(cfg, nblk_BS[b_R, i_R, None], nblk_BS[b_R], key_visual_BS(meta)[b_R],
                    meta.span_lo_BS[b_R, i_R, None], meta.span_hi_BS[b_R, i_R, None],
                    picks_GRk[:, :, None, :])
    return mask_RS[None] & keep_GRS


def dense_mask(meta: AttnMeta, cfg: AttentionConfig | None, sel: Selection | None, H: int) -> Tensor:
    """(B, 1 or H, S, S) bool: the token rule, AND the block rule of a sparse layer."""
    B, S = meta.batch, meta.seq_len
    i_S = torch.arange(S, device=meta.doc_BS.device)
    rows = [rule_rows(meta, cfg, sel, torch.full_like(i_S, b), i_S) for b in range(B)]
    mask_BGSS = torch.stack(rows)
    return mask_BGSS if mask_BGSS.shape[1] == 1 else mask_BGSS.repeat_interleave(H // mask_BGSS.shape[1], 1)


def dense_probs(q_BHSD: Tensor, k_BKSD: Tensor, mask_BHSS: Tensor) -> Tensor:
    """Eager attention probabilities (B, H, S, S), fp32 (or fp64 for fp64 inputs)."""
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    dt = torch.promote_types(q_BHSD.dtype, torch.float32)
    k_BHSD = k_BKSD.to(dt).repeat_interleave(H // K, 1)
    s_BHSS = (q_BHSD.to(dt) @ k_BHSD.transpose(-1, -2)) / math.sqrt(q_BHSD.shape[-1])
    return s_BHSS.masked_fill(~mask_BHSS, float("-inf")).softmax(-1)


def attend_dense(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                 sel: Selection | None, eager: bool) -> Tensor:
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    mask_BHSS = dense_mask(meta, cfg, sel, H)
    if eager:
        p_BHSS = dense_probs(q_BHSD, k_BKSD, mask_BHSS)
        v_BHSD = v_BKSD.to(p_BHSS.dtype).repeat_interleave(H // K, 1)
        return (p_BHSS @ v_BHSD).to(q_BHSD.dtype)
    return F.scaled_dot_product_attention(q_BHSD, k_BKSD, v_BKSD, attn_mask=mask_BHSS, enable_gqa=H != K)


def run_dense(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
              sel: Selection | None) -> Tensor:
    return attend_dense(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel, eager=cfg.dense_impl == "eager")


# Sparse layers as the opaque op under torch.compile: their selection reads the host. Full layers
# trace (the mask is S x S from tensors alone).
register_backend(Backend("dense", run_dense, layers=BOTH, devices=ANY, train=ANY,
                         opaque={SPARSE: attend_sparse_opaque}, knockout=True))
