"""Cache layers for transformers' Cache API: K/V like `DynamicLayer`, plus what mmtrain's layers need.

`DynamicCache(config=model.config)` builds one layer per entry of `config.layer_types` (the
classes register themselves under "mmtrain_full" / "mmtrain_sparse"). Every layer keeps the rows'
state: which cached positions are real (left padding is not), the document length so far and the
M-RoPE offset of the next text token (rope_delta: position - rank; media advance the position by
max(t, h, w)). A sparse layer also keeps its block tables: the fp32 mean key of every document
block (the current block's refreshed at each step, so it is final once the block completes; only
completed blocks are ever scored), whether a block holds a visual token, and for "block"
selection the mean selection query of every completed block and the current block's queries by
slot. Decoding appends one text token per row; its attention applies the block rule
(attention_mmtrain.py) against these tables, so it equals the full forward.

Legend: B rows, T cached positions, H query heads, K kv heads, G selection heads, E head dim,
N blocks, Bs block size, k top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .attention_mmtrain import NO_SPAN, BlockTables, SparseRule, kept, top_picks

Tensor = torch.Tensor


class _RowState:
    """Per-row tensors (batch first) that follow the cache through beam reordering and selection."""

    _row_fields: tuple[str, ...] = ("real_BT", "len_B", "rope_delta_B")

    def _apply_rows(self, fn) -> None:
        for name in self._row_fields:
            if getattr(self, name, None) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_rows(lambda t: t[indices])

    def reset(self) -> None:
        super().reset()
        self._apply_rows(lambda t: None)

    def set_rows(self, real_BT: Tensor, len_B: Tensor, rope_delta_B: Tensor) -> None:
        self.real_BT, self.len_B, self.rope_delta_B = real_BT, len_B, rope_delta_B


class MmtrainFullCacheLayer(_RowState, DynamicLayer):
    _layer_type = "mmtrain_full"
    is_croppable = False  # the rows' state cannot be cut back


class MmtrainSparseCacheLayer(_RowState, DynamicLayer):
    _layer_type = "mmtrain_sparse"
    is_croppable = False
    _row_fields = (*_RowState._row_fields, "kmean_BKNE", "vis_BN", "qmean_BGNE", "qcur_BGbE")

    def fill(self, tab: BlockTables, rule: SparseRule) -> None:
        """Block tables of a prefilled prompt (tab from attention_mmtrain.block_tables)."""
        self.kmean_BKNE, self.vis_BN = tab.kmean_BKNE, tab.vis_BN
        self.qmean_BGNE = self.qcur_BGbE = None
        if tab.qslots_BGNbE is not None:
            N = tab.kmean_BKNE.shape[2]
            self.qmean_BGNE = tab.qslots_BGNbE[:, :, :N].sum(-2) / tab.count_BN.clamp_min(1)[:, None, :, None]
            cur_B = self.len_B // rule.block_size  # the block the next token goes to (N: a new one)
            idx = cur_B.view(-1, 1, 1, 1, 1).expand(
                -1, tab.qslots_BGNbE.shape[1], 1, *tab.qslots_BGNbE.shape[3:]
            )
            self.qcur_BGbE = tab.qslots_BGNbE.gather(2, idx)[:, :, 0].clone()

    def decode_mask(self, q_BH1E: Tensor, rule: SparseRule, key_rank_BT: Tensor) -> Tensor:
        """(B, G, 1, T) bool: the keys the new token (at rank len_B - 1, already cached) may attend."""
        Bs, p_B = rule.block_size, self.len_B - 1
        nq_B = p_B // Bs
        self._grow(int(nq_B.max()) + 1)
        self._refresh_kmean(nq_B, p_B, Bs)
        B, H, _, E = q_BH1E.shape
        K = self.keys.shape[1]
        G = rule.heads(H, K)
        qtok_BGE = q_BH1E.float().view(B, G, H // G, E).mean(2)
        N = self.kmean_BKNE.shape[2]
        nq_B11, nk_11N = nq_B.view(B, 1, 1), torch.arange(N, device=p_B.device).view(1, 1, N)
        kvis_B1N = self.vis_BN[:, None]
        empty = nq_B.new_tensor(NO_SPAN), nq_B.new_tensor(-1)  # a text token: no closure
        picks_BGk = None
        if rule.top_k:
            if rule.select == "block":
                prev_B = (nq_B - 1).clamp_min(0).view(B, 1, 1, 1).expand(B, G, 1, E)
                qv_BGE = self.qmean_BGNE.gather(2, prev_B)[:, :, 0]
            else:
                qv_BGE = qtok_BGE
            km_BGNE = self.kmean_BKNE.repeat_interleave(G // K, 1)
            score_BGN = (qv_BGE[:, :, None] @ km_BGNE.transpose(-1, -2))[:, :, 0]
            cand_B1N = (nk_11N < nq_B11) & ~kept(rule, nq_B11, nk_11N, kvis_B1N, *empty)
            picks_BGk = top_picks(score_BGN, cand_B1N.expand_as(score_BGN), rule.top_k)[:, :, None, :]
        keep_BGN = kept(rule, nq_B11, nk_11N, kvis_B1N, *empty, picks_BGk).expand(B, G, N)
        if rule.select == "block":
            self._push_query(qtok_BGE, p_B, Bs)
        nblk_BT = (key_rank_BT // Bs).clamp(0, N - 1)
        ok_BGT = keep_BGN.gather(2, nblk_BT[:, None].expand(B, G, -1))
        return (ok_BGT & self.real_BT[:, None] & (key_rank_BT <= p_B[:, None])[:, None])[:, :, None]

    def _grow(self, N: int) -> None:
        have = self.kmean_BKNE.shape[2]
        if have >= N:
            return
        self.kmean_BKNE = F.pad(self.kmean_BKNE, (0, 0, 0, N - have))
        self.vis_BN = F.pad(self.vis_BN, (0, N - have))
        if self.qmean_BGNE is not None:
            self.qmean_BGNE = F.pad(self.qmean_BGNE, (0, 0, 0, N - have))

    def _refresh_kmean(self, nq_B: Tensor, p_B: Tensor, Bs: int) -> None:
        """Mean key of each row's current block: sum of its cached keys (zeros past the row) / Bs."""
        B, K, T, E = self.keys.shape
        first_B = T - self.len_B  # left padding: the document is the last len_B positions
        pos_Bb = first_B[:, None] + nq_B[:, None] * Bs + torch.arange(Bs, device=p_B.device)
        ok_Bb = pos_Bb < T
        idx = pos_Bb.clamp_max(T - 1).view(B, 1, Bs, 1).expand(B, K, Bs, E)
        blk_BKbE = torch.where(ok_Bb[:, None, :, None], self.keys.gather(2, idx), 0).float()
        self.kmean_BKNE.scatter_(
            2, nq_B.view(B, 1, 1, 1).expand(B, K, 1, E), (blk_BKbE.sum(-2) / Bs)[:, :, None]
        )

    def _push_query(self, qtok_BGE: Tensor, p_B: Tensor, Bs: int) -> None:
        """The new token's selection query into its slot; a completed block's mean into qmean."""
        B, G, E = qtok_BGE.shape
        slot_B = p_B % Bs
        self.qcur_BGbE.scatter_(2, slot_B.view(B, 1, 1, 1).expand(B, G, 1, E), qtok_BGE[:, :, None])
        done_B = slot_B == Bs - 1
        if bool(done_B.any()):
            mean_BGE = self.qcur_BGbE.sum(-2) / Bs
            idx = (p_B // Bs).view(B, 1, 1, 1).expand(B, G, 1, E)
            cur_BGE = self.qmean_BGNE.gather(2, idx)[:, :, 0]
            self.qmean_BGNE.scatter_(2, idx, torch.where(done_B.view(B, 1, 1), mean_BGE, cur_BGE)[:, :, None])
            self.qcur_BGbE = torch.where(done_B.view(B, 1, 1, 1), 0.0, self.qcur_BGbE)


__all__ = ["MmtrainFullCacheLayer", "MmtrainSparseCacheLayer"]
