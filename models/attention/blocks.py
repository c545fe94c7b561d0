"""The sparse block rule (one definition for every backend) and the per-tile key-block lists.

`kept(...)` says whether a query token keeps a key block of its own document (blocks are
document-relative, meta.py; nq the query's block, nk the key's): own (nk == nq, the token rule
inside), window (nq - ceil(window / Bs) <= nk < nq), sink (nk == 0), visual (nk < nq holding a
visual token), closure (the blocks of the query's own visual span), picks (select.py). It is
causal by construction; the tests check it as a property.
`sparse_lists`: per aligned block (a kernel tile) and selection head, the sorted union of the
blocks any of its tokens keeps, null-padded (block A) to T; `tile_keep` / `tile_mask` apply the
rule per token inside a tile's blocks; `visible_blocks` are the blocks a tile needs no mask for.
Memory O(A * T), never A x A.

Legend: B batch rows, G selection heads, A aligned blocks, Bs block size, L = A * Bs slots,
T listed blocks per tile, k = top_k, C tiles in a chunk, Q row blocks.
"""

from __future__ import annotations

import torch

from .config import AttentionConfig
from .meta import AttnMeta

Tensor = torch.Tensor


def window_blocks(cfg: AttentionConfig) -> int:
    return -(-cfg.window // cfg.block_size)


def kept(cfg: AttentionConfig, nq: Tensor, nk: Tensor, kvis: Tensor, span_lo: Tensor, span_hi: Tensor,
         picks: Tensor | None = None) -> Tensor:
    """The block rule above, broadcasting (picks carries one extra trailing dim of k, -1 = none)."""
    before = nk < nq
    keep = (nk == nq) | (before & (nk >= nq - window_blocks(cfg))) | ((nk >= span_lo) & (nk <= span_hi))
    if cfg.sink:
        keep = keep | (nk == 0)
    if cfg.visual_always:
        keep = keep | (before & kvis)
    if picks is not None and picks.shape[-1]:
        keep = keep | (picks == nk.unsqueeze(-1)).any(-1)
    return keep


def _dedupe(x_BGAT: Tensor, null: int) -> Tensor:
    """Sorted distinct entries per row, nulls last, trimmed to the longest row (host sync)."""
    x_BGAT = x_BGAT.sort(-1).values
    dup_BGAT = torch.zeros_like(x_BGAT, dtype=torch.bool)
    dup_BGAT[..., 1:] = x_BGAT[..., 1:] == x_BGAT[..., :-1]
    x_BGAT = x_BGAT.masked_fill(dup_BGAT, null).sort(-1).values
    T = max(int((x_BGAT < null).sum(-1).amax()), 1) if x_BGAT.numel() else 1
    return x_BGAT[..., :T]


def _ranges(lo_BA: Tensor, hi_BA: Tensor, null: int) -> Tensor:
    """(B, A, W) lists lo, lo + 1, ..., hi (null past hi), W = the longest range (host sync)."""
    W = max(int((hi_BA - lo_BA + 1).amax()), 0) if lo_BA.numel() else 0
    idx_BAW = lo_BA[..., None] + torch.arange(W, device=lo_BA.device)
    return torch.where(idx_BAW <= hi_BA[..., None], idx_BAW, null)


def _visual_lists(first_BA: Tensor, vis_BA: Tensor, null: int) -> Tensor:
    """Per aligned block a: the visual blocks of its document before a, as (B, A, V)."""
    B, A = vis_BA.shape
    a_A = torch.arange(A, device=vis_BA.device)
    vpos_BA = torch.where(vis_BA, a_A, null).sort(-1).values  # visual blocks first, in order
    before_BA = vis_BA.long().cumsum(1) - vis_BA.long()  # visual blocks strictly before a
    lo_BA = before_BA.gather(1, first_BA)
    idx_BAV = _ranges(lo_BA, before_BA - 1, -1)
    got_BAV = vpos_BA.gather(1, idx_BAV.clamp_min(0).view(B, -1)).view(idx_BAV.shape)
    return torch.where(idx_BAV >= 0, got_BAV, null)


def sparse_lists(meta: AttnMeta, cfg: AttentionConfig, picks_BGLk: Tensor,
                 block_picks_BGAk: Tensor | None = None) -> Tensor:
    """(B, G, A, T) sorted aligned key blocks each tile visits, padded with the null block A."""
    lay = meta.aligned()
    B, A, Bs = meta.batch, lay.aligned_blocks, cfg.block_size
    G, k = picks_BGLk.shape[1], picks_BGLk.shape[-1]
    a_BA = torch.arange(A, device=lay.first_BA.device).expand(B, A)
    first_BA = lay.first_BA
    win_BAW = a_BA[..., None] - torch.arange(window_blocks(cfg) + 1, device=a_BA.device)
    parts = [torch.where(win_BAW >= first_BA[..., None], win_BAW, A)]
    if cfg.sink:
        parts.append(first_BA[..., None])
    if cfg.visual_always:
        parts.append(_visual_lists(first_BA, lay.vis_BA, A))
    span_BL = lay.span_lo_BL <= lay.span_hi_BL
    first_BL = first_BA.repeat_interleave(Bs, 1)
    big = torch.iinfo(torch.long).max
    span_lo_BA = torch.where(span_BL, lay.span_lo_BL + first_BL, big).view(B, A, Bs).amin(-1)
    span_hi_BA = torch.where(span_BL, lay.span_hi_BL + first_BL, -1).view(B, A, Bs).amax(-1)
    parts.append(_ranges(torch.where(span_hi_BA >= 0, span_lo_BA, 0), span_hi_BA, A))
    base_BGAW = torch.cat(parts, -1)[:, None].expand(B, G, A, -1)
    if not k:
        return _dedupe(base_BGAW, A)
    if block_picks_BGAk is not None:
        pk_BGAW = block_picks_BGAk
    else:
        pk_BGAW = picks_BGLk.reshape(B, G, A, Bs * k)
    pk_BGAW = torch.where(pk_BGAW >= 0, pk_BGAW + first_BA[:, None, :, None], A)
    return _dedupe(torch.cat([base_BGAW, pk_BGAW], -1), A)


def tile_keep(meta: AttnMeta, cfg: AttentionConfig, list_BGCT: Tensor, a0: int,
              picks_BGLk: Tensor) -> Tensor:
    """(B, G, C, Bs, T) the block rule for every token of tiles a0 .. a0 + C against their lists."""
    lay = meta.aligned()
    B, G, C, T = list_BGCT.shape
    Bs = cfg.block_size
    first_B1C11 = lay.first_BA[:, a0:a0 + C].view(B, 1, C, 1, 1)
    nq_B1C11 = torch.arange(a0, a0 + C, device=list_BGCT.device).view(1, 1, C, 1, 1) - first_B1C11
    nk_BG1T = list_BGCT[:, :, :, None, :] - first_B1C11
    vis_BX = torch.cat([lay.vis_BA, lay.vis_BA.new_zeros(B, 1)], 1)  # the null block: not visual
    kvis_BGC1T = vis_BX.gather(1, list_BGCT.reshape(B, -1)).view(B, G, C, 1, T)
    sl = slice(a0 * Bs, (a0 + C) * Bs)
    span_lo_B1Cb1 = lay.span_lo_BL[:, sl].view(B, 1, C, Bs, 1)
    span_hi_B1Cb1 = lay.span_hi_BL[:, sl].view(B, 1, C, Bs, 1)
    k = picks_BGLk.shape[-1]
    pk_BGCb1k = picks_BGLk[:, :, sl].reshape(B, G, C, Bs, 1, k)
    return kept(cfg, nq_B1C11, nk_BG1T, kvis_BGC1T, span_lo_B1Cb1, span_hi_B1Cb1, pk_BGCb1k)


def full_intervals(meta: AttnMeta, tile: int) -> tuple[Tensor, Tensor]:
    """Full layers, row layout in tiles of `tile` tokens: per tile q the range [lo, hi] of tiles its
    tokens can reach (first tile of their documents .. q, or the end of a visual span of theirs)."""
    key = ("full_intervals", tile)
    if key not in meta.cache:
        B, S = meta.batch, meta.seq_len
        Q = -(-S // tile)
        q_BQ = torch.arange(Q, device=meta.doc_BS.device).expand(B, Q)
        tile_BS = torch.arange(S, device=q_BQ.device).expand(B, S) // tile
        lo_BQ = q_BQ.clone().scatter_reduce(1, tile_BS, meta.first_BS // tile, "amin")
        hi_BQ = q_BQ.clone().scatter_reduce(1, tile_BS, meta.span_last_BS // tile, "amax")
        meta.cache[key] = (lo_BQ, hi_BQ)
    return meta.cache[key]


def block_tables(meta: AttnMeta, Bs: int) -> tuple[Tensor, Tensor]:
    """(B, A + 1, Bs) document and span key of every aligned slot in blocks, the null block last
    (a document no query has, keys no query matches): what `tile_mask` looks up."""
    lay = meta.aligned()
    B, A = meta.batch, lay.aligned_blocks
    doc_BXb = torch.cat([lay.doc_BL, meta.null.expand(B, Bs)], 1).view(B, A + 1, Bs)
    skey_BXb = torch.cat([lay.skey_BL, lay.skey_BL.new_full((B, Bs), -(2**50))], 1).view(B, A + 1, Bs)
    return doc_BXb, skey_BXb


def tile_mask(idx_BGCT: Tensor, doc_BXb: Tensor, skey_BXb: Tensor, pos_Xb: Tensor, c0: int,
              keep_BGCbT: Tensor | None) -> Tensor:
    """(B, G, C, Bs, T * Bs) the token rule of tiles c0 .. c0 + C over their listed blocks (null-block
    keys carry a doc no query has), AND the block rule `keep` if given."""
    B, G, C, T = idx_BGCT.shape
    Bs = doc_BXb.shape[-1]
    b_B111 = torch.arange(B, device=idx_BGCT.device).view(B, 1, 1, 1)
    doc_BGCJ = doc_BXb[b_B111, idx_BGCT].view(B, G, C, T * Bs)
    skey_BGCJ = skey_BXb[b_B111, idx_BGCT].view(B, G, C, T * Bs)
    kpos_BGCJ = pos_Xb[idx_BGCT].view(B, G, C, T * Bs)
    doc_B1Cb1 = doc_BXb[:, None, c0:c0 + C, :, None]
    skey_B1Cb1 = skey_BXb[:, None, c0:c0 + C, :, None]
    qpos_1Cb1 = pos_Xb[None, c0:c0 + C, :, None]
    mask_BGCbJ = (doc_B1Cb1 == doc_BGCJ[:, :, :, None]) & (
        (kpos_BGCJ[:, :, :, None] <= qpos_1Cb1) | (skey_B1Cb1 == skey_BGCJ[:, :, :, None]))
    if keep_BGCbT is not None:
        mask_BGCbJ = mask_BGCbJ & keep_BGCbT.repeat_interleave(Bs, -1)
    return mask_BGCbJ


def visible_blocks(meta: AttnMeta, list_BGCT: Tensor, a0: int, keep_BGCbT: Tensor) -> Tensor:
    """(B, G, C, T) the listed blocks every real token of tiles a0 .. a0 + C sees whole: earlier
    blocks of the tile's document (never partial) that the block rule `keep` (tile_keep) keeps
    for all of them, so attention over them needs no mask."""
    lay = meta.aligned()
    C, Bs = list_BGCT.shape[2], keep_BGCbT.shape[3]
    tile_11C1 = torch.arange(a0, a0 + C, device=list_BGCT.device).view(1, 1, C, 1)
    real_BCb = torch.arange(Bs, device=list_BGCT.device) < lay.count_BA[:, a0:a0 + C, None]
    earlier_BGCT = (list_BGCT < tile_11C1) & (list_BGCT >= lay.first_BA[:, None, a0:a0 + C, None])
    return earlier_BGCT & (keep_BGCbT | ~real_BCb[:, None, ..., None]).all(-2)
