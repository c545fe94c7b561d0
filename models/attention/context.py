"""Context parallelism: a rank holds a contiguous chunk of every row and attends its own queries.

The P ranks of a context-parallel group hold the tokens [lo, hi) = [r * S / P, (r + 1) * S / P)
of every row (all of them read the same rows, so the per-token metadata -- documents, spans,
blocks -- is the whole row's on every rank). What crosses ranks, through `ContextComm` (the
trainer's implementation lives in mmtrain/parallel/context_parallel.py):
  * full layers: K and V of the whole row, all-gathered (Llama 3's way: document masks and
    visual spans need nothing else); the rank's query tiles run the gather kernel over them;
  * sparse layers: the per-block key sums (and, with select == "block", query sums), summed over
    the group, give every rank the whole row's block means; each rank selects for its own query
    tokens with exactly the single-process rule, then fetches only the K/V rows of the blocks its
    tiles keep and it does not hold (one uneven all-to-all), so traffic follows what is kept.
    The fetched blocks fill an aligned K/V buffer whose other slots stay zero and are never attended.
The result for a query token is the single-process one: the same keys, the same rule, the same
picks. Tokens of a tile that belong to another rank ride along with zero queries and are dropped.

Every rank of the group makes the same collectives, forward and backward, whatever its chunk
holds: a rank whose chunk is only padding runs no tile but keeps the fetched K/V in its graph, so
its backward joins the reverse exchange too. Host syncs (each stalls a GPU queue): the tile range
(loop bounds; once per forward, shared by the sparse layers) and the fetch's split sizes (one
`.tolist()` per sparse layer: the all-to-all takes host lists).

Legend: B rows, H query heads, K kv heads, G selection heads, S row tokens, s = hi - lo the rank's
tokens, D head dim, A aligned blocks, Bs block size, L = A * Bs aligned slots, Y the rank's tiles,
P ranks of the group, n rows exchanged, F = 2 * K * D (a slot's key and value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .blocks import sparse_lists
from .config import AttentionConfig
from .gather import attend_gather_full, sparse_tiles
from .meta import AttnMeta
from .select import select_aligned

Tensor = torch.Tensor


class ContextComm(Protocol):
    """The collectives of one context-parallel group (every rank calls each in the same order)."""

    rank: int
    size: int

    def gather_seq(self, x_BHsD: Tensor) -> Tensor: ...  # autograd all-gather along dim 2

    def sum(self, x: Tensor) -> Tensor: ...  # autograd all-reduce (its backward sums the grads)

    def sum_(self, x: Tensor) -> Tensor: ...  # in place, no autograd

    def gather_flags(self, x: Tensor) -> Tensor: ...  # (P, *x.shape), no autograd

    def exchange(self, x_nF: Tensor, out_P: list[int], in_P: list[int]) -> Tensor: ...  # autograd a2a


@dataclass
class ContextShard:
    comm: ContextComm
    seq_len: int  # S
    tiles_of: tuple | None = None  # (meta, its tile range): `_tile_range`'s memo for one forward
    # the ranks of consecutive chunks whose tokens each layer's attention projects together (tensor
    # parallelism's tp group all-gathers them: mmtrain/parallel/tensor_parallel.py); 1: its own
    span: int = 1

    @property
    def chunk(self) -> int:
        return -(-self.seq_len // self.comm.size)

    @property
    def lo(self) -> int:
        return min(self.comm.rank * self.chunk, self.seq_len)

    @property
    def hi(self) -> int:
        return min(self.lo + self.chunk, self.seq_len)

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's chunk of a whole-row tensor."""
        return x.narrow(dim, self.lo, self.hi - self.lo)

    def rotary_local(self, pos_ids_3BS: Tensor) -> Tensor:
        """The positions whose rotary tables the layers' attention takes: this rank's chunk, or its
        span's chunks (each rank computes them: no collective)."""
        lo = self.comm.rank // self.span * self.span * self.chunk
        lo, hi = min(lo, self.seq_len), min(lo + self.span * self.chunk, self.seq_len)
        return pos_ids_3BS.narrow(2, lo, hi - lo)


def attend_context(q_BHsD: Tensor, k_BKsD: Tensor, v_BKsD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                   sparse: bool, shard: ContextShard) -> Tensor:
    if not sparse:
        k_BKSD, v_BKSD = shard.comm.gather_seq(k_BKsD), shard.comm.gather_seq(v_BKsD)
        return attend_gather_full(q_BHsD, k_BKSD, v_BKSD, meta, cfg, q_start=shard.lo)
    return _attend_sparse(q_BHsD, k_BKsD, v_BKsD, meta, cfg, shard)


def _to_aligned_local(x_BHsD: Tensor, slot_Bs: Tensor, L: int) -> Tensor:
    """The rank's tokens into their aligned slots (B, H, L, D); zeros elsewhere."""
    B, H, s, D = x_BHsD.shape
    flat_Bs = slot_Bs + L * torch.arange(B, device=slot_Bs.device)[:, None]
    x_nF = x_BHsD.transpose(1, 2).reshape(B * s, H * D)
    out_nF = x_nF.new_zeros(B * L, H * D).index_copy(0, flat_Bs.reshape(-1), x_nF)
    return out_nF.view(B, L, H, D).transpose(1, 2)


def _tile_range(meta: AttnMeta, shard: ContextShard) -> tuple[int, int]:
    """The aligned tiles holding the rank's real tokens (padding's outputs are never read); (0, 0)
    when it holds none. One host sync per forward: every sparse layer shares the meta."""
    if shard.tiles_of is not None and shard.tiles_of[0] is meta:
        return shard.tiles_of[1]
    ablk_Bs, real_Bs = shard.local(meta.ablk_BS), shard.local(meta.real_BS)
    big = torch.iinfo(ablk_Bs.dtype).max
    lo_hi = torch.stack([torch.where(real_Bs, ablk_Bs, big).amin(),
                         torch.where(real_Bs, ablk_Bs, -1).amax() + 1])
    t0, t1 = lo_hi.tolist() if real_Bs.numel() else (big, 0)  # host sync: the tile loop's bounds
    shard.tiles_of = (meta, (t0, t1) if t1 > 0 else (0, 0))
    return shard.tiles_of[1]


def _partial_means(x_BHsD: Tensor, meta: AttnMeta, shard: ContextShard) -> Tensor:
    """(B, H, A, D) fp32: the rank's share of every aligned block's mean (summed over the group:
    the means), straight from its tokens (nothing of size L)."""
    lay = meta.aligned()
    B, H, s, D = x_BHsD.shape
    A = lay.aligned_blocks
    rows_BH1 = torch.arange(B * H, device=x_BHsD.device).view(B, H, 1)
    flat_BHs = rows_BH1 * A + shard.local(meta.ablk_BS)[:, None, :]  # (b, h, block) of each token
    sum_nD = x_BHsD.new_zeros(B * H * A, D, dtype=torch.float32).index_add_(
        0, flat_BHs.reshape(-1), x_BHsD.detach().float().reshape(-1, D))
    return sum_nD.view(B, H, A, D) / lay.count_BA.clamp_min(1)[:, None, :, None]


def _select(q_BHsD, k_BKsD, meta, cfg, shard, slot_Bs, tiles):
    """The whole row's block means (partial sums over the group), then the rank's picks."""
    lay = meta.aligned()
    B, H = q_BHsD.shape[:2]
    K, L = k_BKsD.shape[1], lay.num_slots
    G = H if cfg.select_per == "head" else K
    km_BKAD = shard.comm.sum_(_partial_means(k_BKsD, meta, shard))
    q_BGsD = q_BHsD.detach().float().view(B, G, H // G, -1, q_BHsD.shape[-1]).mean(2)
    if cfg.select == "block":  # per block: the previous block's mean query, summed over the group
        qm_BGAD = shard.comm.sum_(_partial_means(q_BGsD, meta, shard))
        sel = select_aligned(None, km_BKAD.repeat_interleave(G // K, 1), meta, cfg, query_means=qm_BGAD)
    else:
        sel = select_aligned(_to_aligned_local(q_BGsD, slot_Bs, L), km_BKAD.repeat_interleave(G // K, 1),
                             meta, cfg, tiles=tiles)
    mine_BL = torch.zeros(B, L, dtype=torch.bool, device=slot_Bs.device).scatter_(
        1, slot_Bs, shard.local(meta.real_BS))
    sel.picks_BGLk = torch.where(mine_BL[:, None, :, None], sel.picks_BGLk, -1)  # others' tokens: none
    return sel


def _fetch(k_BKsD: Tensor, v_BKsD: Tensor, need_BA: Tensor, meta: AttnMeta, shard: ContextShard,
           slot_Bs: Tensor) -> tuple[Tensor, Tensor]:
    """Aligned (B, K, L, D) keys and values holding the rank's own slots and the slots of the
    blocks it needs, fetched from their owners; zeros elsewhere."""
    lay, comm = meta.aligned(), shard.comm
    B, K, s, D = k_BKsD.shape
    L, Bs = lay.num_slots, lay.block_size
    owner_BL = torch.where(lay.src_BL >= 0, lay.src_BL // shard.chunk, -1)
    need_PBL = comm.gather_flags(need_BA).repeat_interleave(Bs, -1)
    mine_BL = owner_BL == comm.rank
    kv_nF = torch.cat([k_BKsD, v_BKsD], 1).transpose(1, 2).reshape(B * s, 2 * K * D)  # row order
    row_B1 = s * torch.arange(B, device=k_BKsD.device)[:, None]
    local_BL = torch.where(mine_BL, lay.src_BL - shard.lo, 0) + row_B1
    peer_P = torch.arange(comm.size, device=owner_BL.device) != comm.rank
    send_Pn = (mine_BL & need_PBL).flatten(1) & peer_P[:, None]  # (P, B * L): rows to each peer
    recv_n = (need_PBL[comm.rank] & (owner_BL >= 0) & ~mine_BL).flatten()  # rows from their owners
    recv_P = torch.zeros(comm.size, dtype=torch.int64, device=owner_BL.device).scatter_add_(
        0, owner_BL.flatten().clamp_min(0), recv_n.long())
    in_P, out_P = torch.stack([send_Pn.sum(1), recv_P]).tolist()  # host sync: the exchange's splits
    # (peer, b, slot) order on both sides: the n first of an argsort that puts the others last
    n_send = _first(send_Pn.flatten(), sum(in_P)) % (B * L)
    got_nF = comm.exchange(kv_nF.index_select(0, local_BL.flatten().index_select(0, n_send)), out_P, in_P)
    key_n = owner_BL.flatten().clamp_min(0) * (B * L) + torch.arange(B * L, device=owner_BL.device)
    n_recv = key_n.masked_fill(~recv_n, key_n.numel() * comm.size).argsort()[:sum(out_P)]
    flat_Bs = slot_Bs + L * torch.arange(B, device=slot_Bs.device)[:, None]
    flat_n = torch.cat([flat_Bs.reshape(-1), n_recv])
    buf_nF = kv_nF.new_zeros(B * L, 2 * K * D).index_copy(0, flat_n, torch.cat([kv_nF, got_nF]))
    k_BKLD, v_BKLD = buf_nF.view(B, L, 2 * K, D).transpose(1, 2).split(K, 1)
    return k_BKLD, v_BKLD


def _first(mask_n: Tensor, n: int) -> Tensor:
    """The indices of the n set entries of mask_n, in order (n known: no sync, unlike nonzero)."""
    idx_n = torch.arange(mask_n.numel(), device=mask_n.device)
    return idx_n.masked_fill(~mask_n, mask_n.numel()).argsort()[:n]


def _attend_sparse(q_BHsD: Tensor, k_BKsD: Tensor, v_BKsD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                   shard: ContextShard) -> Tensor:
    lay = meta.aligned()
    B, H, s, D = q_BHsD.shape
    A, Bs, L = lay.aligned_blocks, cfg.block_size, lay.num_slots
    slot_Bs = shard.local(lay.slot_BS)
    t0, t1 = _tile_range(meta, shard)
    sel = _select(q_BHsD, k_BKsD, meta, cfg, shard, slot_Bs, (t0, t1))
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    need_BA = torch.zeros(B, A + 1, dtype=torch.bool, device=q_BHsD.device).scatter_(
        1, lists_BGAT[:, :, t0:t1].reshape(B, -1), True)[:, :A]  # the null block A: dropped
    k_BKLD, v_BKLD = _fetch(k_BKsD, v_BKsD, need_BA, meta, shard, slot_Bs)
    q_BHYD = _to_aligned_local(q_BHsD, slot_Bs, L)[:, :, t0 * Bs:t1 * Bs]
    out_BHYD = sparse_tiles(q_BHYD, k_BKLD, v_BKLD, meta, cfg, sel, lists_BGAT, t0, q_BHsD, k_BKsD, v_BKsD)
    if t1 == t0:  # padding only: zeros, still tied to q, k, v and to the fetched K/V, so that its
        # backward runs the reverse exchange that the peers run (else they wait for it forever)
        tied = k_BKsD.sum() + v_BKsD.sum() + k_BKLD.sum() + v_BKLD.sum() + out_BHYD.sum()
        return q_BHsD * 0 + tied * 0
    idx_Bs = (slot_Bs - t0 * Bs).clamp(0, out_BHYD.shape[2] - 1)
    out_BHsD = out_BHYD.gather(2, idx_Bs[:, None, :, None].expand(B, H, s, D))
    real_B1s1 = shard.local(meta.real_BS)[:, None, :, None]
    return torch.where(real_B1s1, out_BHsD, 0).to(q_BHsD.dtype)  # padding: never read
