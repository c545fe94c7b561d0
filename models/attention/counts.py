"""What an attention layer really visits, counted over the real (non-padding) query tokens.

  keys       sum over queries of the keys they attend (the token rule and the block rule): the
             attention FLOPs are 4 * H * head_dim * keys forward (QK^T and AV);
  kept       sum over queries of the key blocks they keep;
  reachable  sum over queries of the blocks they could reach in a full layer (blocks 0 .. nq of
             their document, plus the blocks of their own visual span after nq);
  tokens     real query tokens.
A sparse layer's kept / reachable is its density (1.0 for a full layer). Values are summed over
the batch and averaged over selection heads; tensors, so no host sync until someone reads them.

Legend: B batch, G selection heads, A aligned blocks, Bs block size, C tiles in a chunk,
T listed blocks per tile.
"""

from __future__ import annotations

import torch

from .blocks import sparse_lists, tile_keep
from .config import AttentionConfig
from .meta import AttnMeta
from .select import Selection

Tensor = torch.Tensor
ATTN_COUNTS = ("keys", "kept", "reachable", "tokens")


def _per_token(meta: AttnMeta) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: own-block keys (causal + own span after it), reachable blocks, real."""
    pos_BS = torch.arange(meta.seq_len, device=meta.doc_BS.device)
    nq_BS = meta.nblk_BS
    own_BS = meta.rank_BS % meta.block_size + 1 + (meta.span_last_BS - pos_BS)
    reach_BS = nq_BS + 1 + (meta.span_hi_BS - nq_BS).clamp_min(0)
    return own_BS.double(), reach_BS.double(), meta.real_BS


def full_counts(meta: AttnMeta) -> dict[str, Tensor]:
    if "full_counts" not in meta.cache:
        own_BS, reach_BS, real_BS = _per_token(meta)
        keys_BS = (meta.rank_BS - meta.rank_BS % meta.block_size).double() + own_BS
        meta.cache["full_counts"] = {
            "keys": keys_BS[real_BS].sum(), "kept": reach_BS[real_BS].sum(),
            "reachable": reach_BS[real_BS].sum(), "tokens": real_BS.sum().double()}
    return meta.cache["full_counts"]


@torch.no_grad()
def sparse_counts(meta: AttnMeta, cfg: AttentionConfig, sel: Selection,
                  chunk: int = 256) -> dict[str, Tensor]:
    lay = meta.aligned()
    B, A = meta.batch, lay.aligned_blocks
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    G = lists_BGAT.shape[1]
    count_BX = torch.cat([lay.count_BA, lay.count_BA.new_zeros(B, 1)], 1).double()
    kept_BGL = torch.empty(B, G, A * cfg.block_size, dtype=torch.float64, device=lists_BGAT.device)
    before_BGL = torch.empty_like(kept_BGL)
    for a0 in range(0, A, chunk):
        list_BGCT = lists_BGAT[:, :, a0:a0 + chunk]
        B_, G_, C, T = list_BGCT.shape
        keep_BGCbT = tile_keep(meta, cfg, list_BGCT, a0, sel.picks_BGLk)
        tile_C = torch.arange(a0, a0 + C, device=list_BGCT.device)
        earlier_BGC1T = (list_BGCT < tile_C[:, None])[:, :, :, None]
        cnt_BGC1T = count_BX.gather(1, list_BGCT.reshape(B, -1)).view(B, G, C, 1, T)
        sl = slice(a0 * cfg.block_size, (a0 + C) * cfg.block_size)
        kept_BGL[:, :, sl] = keep_BGCbT.sum(-1).reshape(B, G, -1).double()
        before_BGL[:, :, sl] = (keep_BGCbT & earlier_BGC1T).double().mul(cnt_BGC1T).sum(-1).reshape(B, G, -1)
    own_BS, reach_BS, real_BS = _per_token(meta)
    idx_BGS = lay.slot_BS[:, None].expand(B, G, -1)
    kept_BS = kept_BGL.gather(2, idx_BGS).mean(1)
    keys_BS = before_BGL.gather(2, idx_BGS).mean(1) + own_BS
    return {"keys": keys_BS[real_BS].sum(), "kept": kept_BS[real_BS].sum(),
            "reachable": reach_BS[real_BS].sum(), "tokens": real_BS.sum().double()}
