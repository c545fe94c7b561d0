"""Attention of one new (text) token per row against the KV cache: full and sparse layers.

Full layers: every cached key of the row up to the new token (SDPA with a length mask).

Sparse layers apply the training rule of `models.attention.blocks.kept` to the new token at
position p = len_b (block nq = p // Bs; a text token has no visual span, so no closure): own
block, window, sink, earlier visual blocks, and top_k picks among the completed earlier blocks
not kept already, scored by q . mean(k over the block) in fp32 with the selection head's query
("token": the new token's own q, mean over its GQA group; "block": the mean query of block
nq - 1, one pick set per block). Then only the kept blocks' K/V are gathered: per token
O(T * Bs) keys plus the O(N) block scores of "token" selection ("block" selection scores once
per block), instead of the O(p) keys of a full layer.

Legend: B rows, H query heads, K kv heads, G selection heads, R = H / G query heads per selection
head, E head dim, C cache capacity, N blocks in use, Bs block size, T kept blocks listed, J = T * Bs
gathered keys, k = top_k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mmtrain.models.attention.blocks import kept
from mmtrain.models.attention.config import AttentionConfig
from mmtrain.models.attention.meta import NO_SPAN

from .cache import LayerCache

Tensor = torch.Tensor


def full_decode(q_BH1E: Tensor, lc: LayerCache, p_B: Tensor) -> Tensor:
    """(B, H, 1, E): the new token at p_b over the row's keys 0 .. p_b."""
    n = int(p_B.max()) + 1
    k_BKnE, v_BKnE = lc.k_BKCE[:, :, :n], lc.v_BKCE[:, :, :n]
    mask_B11n = (torch.arange(n, device=p_B.device) <= p_B[:, None])[:, None, None]
    H, K = q_BH1E.shape[1], k_BKnE.shape[1]
    return F.scaled_dot_product_attention(q_BH1E, k_BKnE, v_BKnE, attn_mask=mask_B11n, enable_gqa=H != K)


def selection_heads(cfg: AttentionConfig, H: int, K: int) -> int:
    return H if cfg.select_per == "head" else K


def _base_keep(cfg: AttentionConfig, lc: LayerCache, nq_B: Tensor, N: int) -> tuple[Tensor, Tensor, Tensor]:
    """nq (B, 1, 1), nk (1, 1, N) and the rule without picks, (B, 1, N): what is kept before top-k."""
    nq_B11 = nq_B.view(-1, 1, 1)
    nk_11N = torch.arange(N, device=nq_B.device).view(1, 1, N)
    none = nq_B.new_tensor(NO_SPAN), nq_B.new_tensor(-1)  # a text token: empty closure
    return nq_B11, nk_11N, kept(cfg, nq_B11, nk_11N, lc.vis_BN[:, None, :N], *none)


def _picks(cfg: AttentionConfig, lc: LayerCache, qsel_BGE: Tensor, nq_B11: Tensor, nk_11N: Tensor,
           base_B1N: Tensor) -> Tensor:
    """(B, G, k) doc-relative block ids of the top-k candidates, -1 pads (select.py's rule)."""
    G, K, N = qsel_BGE.shape[1], lc.kmean_BKNE.shape[1], nk_11N.shape[-1]
    km_BGNE = lc.kmean_BKNE[:, :, :N].repeat_interleave(G // K, 1)
    score_BGN = (qsel_BGE[:, :, None, :] @ km_BGNE.transpose(-1, -2))[:, :, 0]
    cand_B1N = (nk_11N < nq_B11) & ~base_B1N
    score_BGN = score_BGN.masked_fill(~cand_B1N, float("-inf"))
    val_BGk, idx_BGk = score_BGN.topk(min(cfg.top_k, N), dim=-1)
    picks_BGk = torch.where(val_BGk > float("-inf"), idx_BGk, -1)
    return F.pad(picks_BGk, (0, cfg.top_k - picks_BGk.shape[-1]), value=-1)


class KeptKeys(NamedTuple):
    """The keys a new token may attend to in a sparse layer, ready to gather (J = T * Bs keys)."""

    flat_N: Tensor  # int64 (B * G * T,) rows of the (B * K * Nc, Bs * E) view of the K/V buffers
    pos_BGJ: Tensor  # int64 position of every gathered key
    listed_BGJ: Tensor  # bool: the key's block is listed (rows and heads keep different counts)


def kept_keys(cfg: AttentionConfig, lc: LayerCache, p_B: Tensor, qsel_BGE: Tensor) -> KeptKeys:
    """The blocks the new token of each row keeps, per selection head (scored with qsel: the
    token's own query or the previous block's mean), as gather indices."""
    Bs = cfg.block_size
    nq_B = p_B // Bs
    N = int(nq_B.max()) + 1
    nq_B11, nk_11N, base_B1N = _base_keep(cfg, lc, nq_B, N)
    keep_BGN = base_B1N.expand(-1, qsel_BGE.shape[1], -1)
    if cfg.top_k:
        picks_BGk = _picks(cfg, lc, qsel_BGE, nq_B11, nk_11N, base_B1N)
        keep_BGN = kept(cfg, nq_B11, nk_11N, lc.vis_BN[:, None, :N], nq_B.new_tensor(NO_SPAN),
                        nq_B.new_tensor(-1), picks_BGk[:, :, None, :])
    # Compact the kept blocks of every (row, head) to the front of a (B, G, T) list (block 0 pads).
    B, G = keep_BGN.shape[:2]
    count_BG = keep_BGN.sum(-1)
    T = max(int(count_BG.max()), 1)
    slot_BGN = torch.where(keep_BGN, keep_BGN.long().cumsum(-1) - 1, T)
    idx_BGT = torch.zeros(B, G, T + 1, dtype=torch.long, device=p_B.device)
    idx_BGT = idx_BGT.scatter_(-1, slot_BGN, nk_11N.expand_as(slot_BGN).contiguous())[..., :T]
    K, Nc = lc.k_BKCE.shape[1], lc.k_BKCE.shape[2] // Bs
    kv_G = torch.arange(G, device=p_B.device) * K // G  # the kv head of each selection head
    flat_BGT = (torch.arange(B, device=p_B.device).view(B, 1, 1) * K + kv_G.view(1, G, 1)) * Nc + idx_BGT
    pos_BGJ = (idx_BGT[..., None] * Bs + torch.arange(Bs, device=p_B.device)).view(B, G, T * Bs)
    listed_BGT = torch.arange(T, device=p_B.device) < count_BG[..., None]
    return KeptKeys(flat_BGT.reshape(-1), pos_BGJ, listed_BGT.repeat_interleave(Bs, -1))


def gather_attend(q_BH1E: Tensor, lc: LayerCache, p_B: Tensor, keys: KeptKeys, block_size: int) -> Tensor:
    """(B, H, 1, E): softmax over the gathered keys only (those at positions <= p_b)."""
    B, H, _, E = q_BH1E.shape
    K, C = lc.k_BKCE.shape[1], lc.k_BKCE.shape[2]
    G, J = keys.pos_BGJ.shape[1:]
    rows = B * K * (C // block_size)
    k_BGJE = lc.k_BKCE.view(rows, block_size * E).index_select(0, keys.flat_N).view(B, G, J, E)
    v_BGJE = lc.v_BKCE.view(rows, block_size * E).index_select(0, keys.flat_N).view(B, G, J, E)
    ok_BG1J = (keys.listed_BGJ & (keys.pos_BGJ <= p_B.view(B, 1, 1)))[:, :, None]
    q_BGRE = q_BH1E.view(B, G, H // G, E)
    dt = torch.promote_types(q_BGRE.dtype, torch.float32)
    s_BGRJ = (q_BGRE.to(dt) @ k_BGJE.to(dt).transpose(-1, -2)) / math.sqrt(E)
    o_BGRE = s_BGRJ.masked_fill(~ok_BG1J, float("-inf")).softmax(-1) @ v_BGJE.to(dt)
    return o_BGRE.reshape(B, H, 1, E).to(q_BH1E.dtype)


def selection_query(cfg: AttentionConfig, lc: LayerCache, q_BH1E: Tensor) -> Tensor:
    """(B, G, E) fp32: the new token's q averaged over each selection head's query heads."""
    B, H, _, E = q_BH1E.shape
    G = selection_heads(cfg, H, lc.k_BKCE.shape[1])
    return q_BH1E.float().view(B, G, H // G, E).mean(2)


def sparse_decode(q_BH1E: Tensor, lc: LayerCache, p_B: Tensor, cfg: AttentionConfig) -> Tensor:
    """(B, H, 1, E) of a sparse layer; keeps lc's block-selection state up to date."""
    Bs = cfg.block_size
    qtok_BGE = selection_query(cfg, lc, q_BH1E)
    if cfg.select == "block":  # one choice per block: rebuilt when a row enters a new block
        if lc.kept is None or bool((p_B % Bs == 0).any()):
            lc.kept = kept_keys(cfg, lc, p_B, lc.qprev_BGE)
        keys = lc.kept
    else:
        keys = kept_keys(cfg, lc, p_B, qtok_BGE)
    out = gather_attend(q_BH1E, lc, p_B, keys, Bs)
    if cfg.select == "block":
        push_block_query(lc, qtok_BGE, p_B, Bs)
    return out


def push_block_query(lc: LayerCache, qtok_BGE: Tensor, p_B: Tensor, block_size: int) -> None:
    """Store the new token's selection query; a row whose block completes moves its mean to qprev."""
    B, G, E = qtok_BGE.shape
    slot_B = p_B % block_size
    lc.qcur_BGbE.scatter_(2, slot_B.view(B, 1, 1, 1).expand(B, G, 1, E), qtok_BGE[:, :, None])
    done_B = slot_B == block_size - 1
    if bool(done_B.any()):
        mean_BGE = lc.qcur_BGbE.sum(-2) / block_size
        lc.qprev_BGE = torch.where(done_B.view(B, 1, 1), mean_BGE, lc.qprev_BGE)
        lc.qcur_BGbE = torch.where(done_B.view(B, 1, 1, 1), 0.0, lc.qcur_BGbE)
