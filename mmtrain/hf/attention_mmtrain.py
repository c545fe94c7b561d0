"""mmtrain's attention rule for the HF classes: the token rule, the sparse layers' block rule and
their top-k block selection, over a whole row (no cache, prefill) or for one new token (decode).

Token rule (every layer): query i attends key j of its own document iff j <= i, or i and j are in
one visual span (an image, a video frame: bidirectional inside). Padding attends only itself.

Block rule (sparse layers): blocks are counted from the document's first token (block n = ranks
[n Bs, (n+1) Bs)). Query block nq keeps key block nk when: nk == nq (own); nq - ceil(W / Bs) <=
nk < nq (window); nk == 0 (sink); nk < nq holds a visual token (visual_always); nk lies in the
query's own visual span (closure); or nk is one of its top_k picks: among the completed earlier
blocks (nk < nq) not kept already, the best by q . mean(k over block nk) in fp32, q being the
selection head's query (the mean over its GQA group's heads, or per head): the token's own q
("token"), or the mean q of block nq - 1 ("block", one pick set per block; the closure is not
excluded from its candidates). All of it reads the document up to the query only: causal.

Legend: B rows, S queries (= keys when no cache), T cached keys, H query heads, K kv heads,
G selection heads, E head dim, N blocks, Bs block size, k top_k, P spans of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layout_mmtrain import Layout

Tensor = torch.Tensor
NO_SPAN = 2**40  # closure of a text token: the empty range [NO_SPAN, -1]


@dataclass(frozen=True)
class SparseRule:
    block_size: int
    window: int
    top_k: int
    sink: bool
    visual_always: bool
    select: str
    select_per: str

    @classmethod
    def of(cls, config) -> SparseRule:
        return cls(
            config.sparse_block_size,
            config.sparse_window,
            config.sparse_top_k,
            config.sparse_sink,
            config.sparse_visual_always,
            config.sparse_select,
            config.sparse_select_per,
        )

    def heads(self, H: int, K: int) -> int:
        return H if self.select_per == "head" else K


def kept(
    rule: SparseRule,
    nq: Tensor,
    nk: Tensor,
    kvis: Tensor,
    clo: Tensor,
    chi: Tensor,
    picks: Tensor | None = None,
) -> Tensor:
    """The block rule, broadcasting; picks carries one more trailing dim (k, -1 = none)."""
    before = nk < nq
    wb = -(-rule.window // rule.block_size)
    keep = (nk == nq) | (before & (nk >= nq - wb)) | ((nk >= clo) & (nk <= chi))
    if rule.sink:
        keep = keep | (nk == 0)
    if rule.visual_always:
        keep = keep | (before & kvis)
    if picks is not None and picks.shape[-1]:
        keep = keep | (picks == nk.unsqueeze(-1)).any(-1)
    return keep


def top_picks(score: Tensor, cand: Tensor, k: int) -> Tensor:
    """The k best candidates' block ids (last dim), -1 where fewer exist."""
    val, idx = score.masked_fill(~cand, float("-inf")).topk(min(k, score.shape[-1]), dim=-1)
    picks = torch.where(val > float("-inf"), idx, -1)
    return F.pad(picks, (0, k - picks.shape[-1]), value=-1)


def token_mask(lay: Layout) -> Tensor:
    """(B, 1, S, S) bool: the token rule."""
    r, rank, span = lay.real_BS, lay.rank_BS, lay.span_BS
    S = r.shape[1]
    same_span = (span[:, :, None] == span[:, None, :]) & (span[:, :, None] >= 0)
    ok = r[:, :, None] & r[:, None, :] & ((rank[:, None, :] <= rank[:, :, None]) | same_span)
    return (ok | torch.eye(S, dtype=torch.bool, device=r.device))[:, None]


@dataclass
class BlockTables:
    """A row's per-block tables (what the cache keeps for a sparse layer)."""

    nblk_BS: Tensor  # int64 document block of every token
    count_BN: Tensor  # fp32 tokens in every block
    kmean_BKNE: Tensor  # fp32 mean key of every block
    vis_BN: Tensor  # bool: the block holds a visual token
    qsel_BGSE: Tensor  # fp32 selection queries
    qslots_BGNbE: Tensor | None  # fp32 selection queries by block slot (N + 1 blocks), "block" only


def _by_block(x_BhSE: Tensor, lay: Layout, nblk_BS: Tensor, N: int, Bs: int) -> Tensor:
    """(B, h, N, Bs, E): every real token at its document slot, zeros elsewhere."""
    B, h, S, E = x_BhSE.shape
    slot_BS = torch.where(lay.real_BS, lay.rank_BS, N * Bs)  # padding: a spare slot, dropped
    buf = x_BhSE.new_zeros(B, h, N * Bs + 1, E)
    buf.scatter_(2, slot_BS[:, None, :, None].expand(B, h, S, E), x_BhSE)
    return buf[:, :, :-1].view(B, h, N, Bs, E)


def block_tables(q_BHSE: Tensor, k_BKSE: Tensor, lay: Layout, rule: SparseRule) -> BlockTables:
    B, H, S, E = q_BHSE.shape
    K, Bs = k_BKSE.shape[1], rule.block_size
    G = rule.heads(H, K)
    nblk_BS = torch.where(lay.real_BS, lay.rank_BS // Bs, 0)
    N = int(nblk_BS.max()) + 1
    count_BN = torch.zeros(B, N + 1, device=q_BHSE.device).scatter_add_(
        1, torch.where(lay.real_BS, nblk_BS, N), torch.ones(B, S, device=q_BHSE.device)
    )[:, :N]
    kmean_BKNE = (
        _by_block(k_BKSE.float(), lay, nblk_BS, N, Bs).sum(-2) / count_BN.clamp_min(1)[:, None, :, None]
    )
    vis_BN = torch.zeros(B, N + 1, dtype=torch.bool, device=q_BHSE.device).scatter_reduce(
        1, torch.where(lay.real_BS, nblk_BS, N), lay.span_BS >= 0, "amax"
    )[:, :N]
    qsel_BGSE = q_BHSE.float().view(B, G, H // G, S, E).mean(2)
    qslots = _by_block(qsel_BGSE, lay, nblk_BS, N + 1, Bs) if rule.select == "block" else None
    return BlockTables(nblk_BS, count_BN, kmean_BKNE, vis_BN, qsel_BGSE, qslots)


def _closure(lay: Layout, nblk_BS: Tensor) -> tuple[Tensor, Tensor]:
    """Per token: the first and last block of its visual span (text: the empty range)."""
    vis_BS = lay.span_BS >= 0
    if not bool(vis_BS.any()):
        return torch.full_like(nblk_BS, NO_SPAN), torch.full_like(nblk_BS, -1)
    P = int(lay.span_BS.max()) + 1
    span_BS = torch.where(vis_BS, lay.span_BS, P)
    lo_BP = torch.full((nblk_BS.shape[0], P + 1), NO_SPAN, device=nblk_BS.device).scatter_reduce(
        1, span_BS, nblk_BS, "amin"
    )
    hi_BP = torch.full_like(lo_BP, -1).scatter_reduce(1, span_BS, nblk_BS, "amax")
    return (
        torch.where(vis_BS, lo_BP.gather(1, span_BS), NO_SPAN),
        torch.where(vis_BS, hi_BP.gather(1, span_BS), -1),
    )


def prefill_keep(tab: BlockTables, lay: Layout, rule: SparseRule) -> Tensor:
    """(B, G, S, N) bool: the blocks each query keeps (picks included)."""
    B, G = tab.qsel_BGSE.shape[:2]
    N = tab.kmean_BKNE.shape[2]
    K = tab.kmean_BKNE.shape[1]
    nq_B1S1 = tab.nblk_BS[:, None, :, None]
    nk_N = torch.arange(N, device=nq_B1S1.device)
    kvis_B11N = tab.vis_BN[:, None, None, :]
    clo_BS, chi_BS = _closure(lay, tab.nblk_BS)
    clo_B1S1, chi_B1S1 = clo_BS[:, None, :, None], chi_BS[:, None, :, None]
    if not rule.top_k:
        return kept(rule, nq_B1S1, nk_N, kvis_B11N, clo_B1S1, chi_B1S1).expand(B, G, -1, -1)
    km_BGNE = tab.kmean_BKNE.repeat_interleave(G // K, 1)
    if rule.select == "block":  # per block nq, scored with the mean query of block nq - 1
        qm_BGNE = tab.qslots_BGNbE[:, :, :N].sum(-2) / tab.count_BN.clamp_min(1)[:, None, :, None]
        prev_BGNE = F.pad(qm_BGNE[:, :, :-1], (0, 0, 1, 0))
        nq_N1 = nk_N[:, None]
        empty = nk_N.new_tensor(NO_SPAN), nk_N.new_tensor(-1)
        base_B1NN = kept(rule, nq_N1, nk_N, tab.vis_BN[:, None, None, :], *empty)
        cand_B1NN = (nk_N < nq_N1) & ~base_B1NN
        picks_BGNk = top_picks(
            prev_BGNE @ km_BGNE.transpose(-1, -2), cand_B1NN.expand(B, G, N, N), rule.top_k
        )
        picks_BGSk = picks_BGNk.gather(2, tab.nblk_BS[:, None, :, None].expand(B, G, -1, rule.top_k))
    else:
        base_B1SN = kept(rule, nq_B1S1, nk_N, kvis_B11N, clo_B1S1, chi_B1S1)
        cand_B1SN = (nk_N < nq_B1S1) & ~base_B1SN
        score_BGSN = tab.qsel_BGSE @ km_BGNE.transpose(-1, -2)
        picks_BGSk = top_picks(score_BGSN, cand_B1SN.expand_as(score_BGSN), rule.top_k)
    return kept(rule, nq_B1S1, nk_N, kvis_B11N, clo_B1S1, chi_B1S1, picks_BGSk[..., None, :])


def prefill_mask(tab: BlockTables, lay: Layout, rule: SparseRule, tok_B1SS: Tensor) -> Tensor:
    """(B, G, S, S) bool: the token rule AND the block rule of a sparse layer."""
    keep_BGSN = prefill_keep(tab, lay, rule)
    B, G, S, _ = keep_BGSN.shape
    keep_BGSS = keep_BGSN.gather(3, tab.nblk_BS[:, None, None, :].expand(B, G, S, S))
    return tok_B1SS & (keep_BGSS | ~lay.real_BS[:, None, :, None])  # padding keeps itself
