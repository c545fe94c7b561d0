"""Top-k block selection of sparse layers (MoBA-style gating, causal), shared by every backend.

Candidates of a query token: the *completed earlier* blocks of its own document (nk < nq) that
the block rule does not keep already (blocks.kept without picks). Each candidate is scored by
q . mean(k over the block) in fp32 with no new parameters; the top_k best are the picks (fewer
candidates -> fewer picks, -1 pads). A GQA group scores with the mean of its heads' queries
(= the mean of their scores). Who scores (cfg.select):
  * "token": every query token with its own q (MoBA's per-token gating; the reference);
  * "block": one choice per document block nq, scored with the mean query of block nq - 1 of the
    same document (all of it before every token of block nq, so still causal).
Both depend only on the query's own document up to the query's position. Scores are computed
in chunks of tiles against the key-block means (once per layer), so memory is O(chunk x A);
the selection is stored as O(L * k) doc-relative block ids per selection head.

Legend: B batch, H query heads, K kv heads, G selection heads (H or K), S tokens, D head dim,
A aligned blocks, L = A * Bs aligned slots, Bs block size, k = top_k, C tiles in a chunk,
N candidate blocks of a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import kept
from .config import AttentionConfig
from .knockout import live_slots
from .meta import AttnMeta

Tensor = torch.Tensor
_MAX_SCORES = 2**24  # elements of one chunk's score tensor


@dataclass
class Selection:
    """What a sparse layer picked: doc-relative block ids, -1 = none."""

    picks_BGLk: Tensor  # int64 per aligned slot
    block_picks_BGAk: Tensor | None = None  # select == "block": the same per aligned block

    def row(self, meta: AttnMeta) -> Tensor:
        """(B, G, S, k) picks of every token in row order."""
        B, G, _, k = self.picks_BGLk.shape
        idx_BGSk = meta.aligned().slot_BS[:, None, :, None].expand(B, G, meta.seq_len, k)
        return self.picks_BGLk.gather(2, idx_BGSk)


def _identity(meta: AttnMeta) -> bool:
    """The aligned layout is the row itself (documents start on blocks, rows are whole blocks), so
    to / from_aligned need no copy. A host value, cached per forward (not under compile)."""
    if torch.compiler.is_compiling():
        return False
    if "aligned_identity" not in meta.cache:
        src_BL = meta.aligned().src_BL
        slots_L = torch.arange(src_BL.shape[1], device=src_BL.device)
        meta.cache["aligned_identity"] = src_BL.shape[1] == meta.seq_len and bool((src_BL == slots_L).all())
    return meta.cache["aligned_identity"]


def to_aligned(x_BHSD: Tensor, meta: AttnMeta) -> Tensor:
    """(B, H, S, D) -> (B, H, L, D) in the aligned layout, zeros in empty slots."""
    if _identity(meta):
        return x_BHSD
    lay = meta.aligned()
    B, H, S, D = x_BHSD.shape
    src_BL = lay.src_BL
    flat_BL = torch.where(src_BL >= 0, src_BL + S * torch.arange(B, device=src_BL.device)[:, None], B * S)
    x_TF = x_BHSD.transpose(1, 2).reshape(B * S, H * D)
    x_TF = torch.cat([x_TF, x_TF.new_zeros(1, H * D)])
    return x_TF.index_select(0, flat_BL.reshape(-1)).view(B, -1, H, D).transpose(1, 2)


def from_aligned(x_BHLD: Tensor, meta: AttnMeta) -> Tensor:
    """(B, H, L, D) -> (B, H, S, D): every token's slot."""
    if _identity(meta):
        return x_BHLD
    lay = meta.aligned()
    B, H, L, D = x_BHLD.shape
    flat_BS = lay.slot_BS + L * torch.arange(B, device=lay.slot_BS.device)[:, None]
    x_TF = x_BHLD.transpose(1, 2).reshape(B * L, H * D)
    return x_TF.index_select(0, flat_BS.reshape(-1)).view(B, -1, H, D).transpose(1, 2)


def block_means(x_BHLD: Tensor, meta: AttnMeta) -> Tensor:
    """Mean of each aligned block's tokens, fp32: (B, H, A, D); knocked-out tokens left out
    (knockout.py; a block of only those: zeros)."""
    lay = meta.aligned()
    B, H, L, D = x_BHLD.shape
    A, Bs = lay.aligned_blocks, lay.block_size
    live_BL, count_BA = live_slots(meta), lay.count_BA
    x_BHLD = x_BHLD.float()
    if live_BL is not None:
        x_BHLD = x_BHLD * live_BL[:, None, :, None]
        count_BA = live_BL.view(B, A, Bs).sum(-1).float()
    sum_BHAD = x_BHLD.view(B, H, A, Bs, D).sum(-2)
    return sum_BHAD / count_BA.clamp_min(1)[:, None, :, None]


def _top(score_BGMN: Tensor, cand_BGMN: Tensor, k: int, lo: int, first_B1M1: Tensor) -> Tensor:
    """The k best candidates as doc-relative ids (-1 pads): (B, G, M, k)."""
    score_BGMN = score_BGMN.masked_fill(~cand_BGMN, float("-inf"))
    val_BGMk, idx_BGMk = score_BGMN.topk(min(k, score_BGMN.shape[-1]), dim=-1)
    picks_BGMk = torch.where(val_BGMk > float("-inf"), lo + idx_BGMk - first_B1M1, -1)
    pad = k - picks_BGMk.shape[-1]
    return torch.nn.functional.pad(picks_BGMk, (0, pad), value=-1) if pad else picks_BGMk


def _query_vectors(q_BHSD: Tensor, meta: AttnMeta, G: int) -> Tensor:
    """Per aligned slot, the selection head's query (mean over the group's heads): (B, G, L, D)."""
    B, H, _, D = q_BHSD.shape
    q_BHLD = to_aligned(q_BHSD.float(), meta)
    return q_BHLD.view(B, G, H // G, -1, D).mean(2)


@torch.no_grad()
def select_blocks(q_BHSD: Tensor, k_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig) -> Selection:
    """The top-k picks of a sparse layer (see the module docstring)."""
    lay = meta.aligned()
    B, H = q_BHSD.shape[:2]
    K, A, Bs, k = k_BKSD.shape[1], lay.aligned_blocks, cfg.block_size, cfg.top_k
    G = H if cfg.select_per == "head" else K
    if k == 0:
        return Selection(q_BHSD.new_zeros(B, G, A * Bs, 0, dtype=torch.long))
    km_BGAD = block_means(to_aligned(k_BKSD, meta), meta).repeat_interleave(G // K, 1)
    return select_aligned(_query_vectors(q_BHSD, meta, G), km_BGAD, meta, cfg)


def select_aligned(q_BGLD: Tensor | None, km_BGAD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                   tiles: tuple[int, int] | None = None, query_means: Tensor | None = None) -> Selection:
    """The picks from the selection heads' queries per aligned slot and the key-block means.

    For a context-parallel rank (attention/context.py): with select == "block" it gives the
    whole row's `query_means` (B, G, A, D) instead of the queries; per token only the tiles
    t0 .. t1 are scored (the others: -1)."""
    Bs = cfg.block_size
    if cfg.select == "block":
        qm_BGAD = block_means(q_BGLD, meta) if query_means is None else query_means
        prev_BGAD = torch.nn.functional.pad(qm_BGAD[:, :, :-1], (0, 0, 1, 0))  # block a - 1
        bp_BGAk = _select(prev_BGAD, km_BGAD, meta, cfg, per_token=False)
        return Selection(bp_BGAk.repeat_interleave(Bs, 2), bp_BGAk)
    return Selection(_select(q_BGLD, km_BGAD, meta, cfg, per_token=True, tiles=tiles))


def _select(qv_BGMD: Tensor, km_BGAD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
            per_token: bool, tiles: tuple[int, int] | None = None) -> Tensor:
    """Picks for query vectors per slot (per_token) or per aligned block, in chunks of tiles
    (those of `tiles` only: the others get none)."""
    lay = meta.aligned()
    B, G, _, D = qv_BGMD.shape
    A, Bs = lay.aligned_blocks, cfg.block_size
    rows = Bs if per_token else 1  # query vectors per tile
    C = max(1, _MAX_SCORES // (B * G * rows * A))
    t0, t1 = tiles or (0, A)
    out = [qv_BGMD.new_full((B, G, t0 * rows, cfg.top_k), -1, dtype=torch.long)]
    for a0 in range(t0, t1, C):
        a1 = min(t1, a0 + C)
        lo = int(lay.first_BA[:, a0].min())  # the earliest document start the chunk can reach
        q_BGMD = qv_BGMD[:, :, a0 * rows:a1 * rows]
        score_BGMN = q_BGMD @ km_BGAD[:, :, lo:a1].transpose(-1, -2)
        first_B1M1 = lay.first_BA[:, a0:a1].repeat_interleave(rows, 1)[:, None, :, None]
        nq_B1M1 = torch.arange(a0, a1, device=q_BGMD.device).repeat_interleave(rows)[None, None, :, None]
        nq_B1M1 = nq_B1M1 - first_B1M1
        nk_B1MN = torch.arange(lo, a1, device=q_BGMD.device) - first_B1M1
        kvis_B11N = lay.vis_BA[:, None, None, lo:a1]
        if per_token:
            sl = slice(a0 * Bs, a1 * Bs)
            span_lo, span_hi = lay.span_lo_BL[:, None, sl, None], lay.span_hi_BL[:, None, sl, None]
        else:  # a block-level choice: the closure is applied per token later, never scored
            span_lo, span_hi = nq_B1M1.new_tensor(1), nq_B1M1.new_tensor(0)
        base_B1MN = kept(cfg, nq_B1M1, nk_B1MN, kvis_B11N, span_lo, span_hi)
        cand_B1MN = (nk_B1MN >= 0) & (nk_B1MN < nq_B1M1) & ~base_B1MN
        out.append(_top(score_BGMN, cand_B1MN.expand_as(score_BGMN), cfg.top_k, lo, first_B1M1))
    out.append(qv_BGMD.new_full((B, G, (A - t1) * rows, cfg.top_k), -1, dtype=torch.long))
    return torch.cat(out, 2)
