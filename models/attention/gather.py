"""The `gather` backend: pure PyTorch block-sparse attention, trainable on CPU and GPU.

A tile is a block of Bs query tokens; per tile the key blocks it visits (T per call, shorter
lists padded with a null block whose keys match no query) are gathered, the token rule (and for
sparse layers the block rule, `blocks.kept`) applied inside them, and a softmax over the gathered
keys gives the output, in chunks of tiles to bound the transient memory.
  * sparse layers run on the aligned layout (meta.py): tiles are document blocks, the lists come
    from `blocks.sparse_lists`; on CPU the fused kernel is tiles.py (no mask where every key is
    visible, its own backward) for blocks of >= TILE_MIN_BLOCK tokens; elsewhere, or with small
    blocks, the chunks below (one fused masked call per chunk, or "eager");
  * full layers run on the row layout in tiles of cfg.full_tile tokens: a tile visits the range
    of tiles its tokens can reach (`blocks.full_intervals`), generated per chunk.
With `gather_checkpoint` the chunks below are recomputed in backward once a layer's gathered
tiles would hold more than `gather_checkpoint_mib`.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, G selection heads (H, K),
R = H // G, Bs block size, M = R * Bs rows of a tile, X tiles + the null block, C tiles in a
chunk, T gathered blocks per tile, J = T * Bs, A aligned blocks, L = A * Bs aligned slots,
Q row blocks, P = Q * Bs (sparse_tiles: Y * Bs, the tiles asked for); s: a rank's queries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .blocks import block_tables, full_intervals, sparse_lists, tile_keep, tile_mask
from .config import AttentionConfig
from .meta import AttnMeta
from .opaque import attend_sparse_opaque
from .registry import ANY, BOTH, FULL, SPARSE, Backend, register_backend
from .sdpa import attend_sdpa_opaque
from .select import Selection, from_aligned, to_aligned
from .tiles import plan_chunks, tile_attention, tiles_backward, tiles_forward, unit_stride

Tensor = torch.Tensor
_MAX_SCORE_ELEMS = 2**25  # cap on a chunk's score tensor (elements), whatever gather_chunk says


def _chunk(q_BGCMD: Tensor, k_BGXbD: Tensor, v_BGXbD: Tensor, idx_BGCT: Tensor, doc_BXb: Tensor,
           skey_BXb: Tensor, pos_Xb: Tensor, c0: int, keep_BGCbT: Tensor | None, fused: bool = False
           ) -> Tensor:
    B, G, C, M, D = q_BGCMD.shape
    X1, T, Bs = k_BGXbD.shape[2], idx_BGCT.shape[-1], k_BGXbD.shape[-2]
    # index_select on flattened blocks: its backward is an index_add (advanced indexing's
    # index_put with accumulate is several times slower on CPU).
    flat_N = (idx_BGCT + X1 * torch.arange(B * G, device=idx_BGCT.device).view(B, G, 1, 1)).reshape(-1)
    k_BGCJD = k_BGXbD.reshape(B * G * X1, Bs * D).index_select(0, flat_N).view(B, G, C, T * Bs, D)
    v_BGCJD = v_BGXbD.reshape(B * G * X1, Bs * D).index_select(0, flat_N).view(B, G, C, T * Bs, D)
    mask_BGCbJ = tile_mask(idx_BGCT, doc_BXb, skey_BXb, pos_Xb, c0, keep_BGCbT)
    if fused:
        return _fused(q_BGCMD, k_BGCJD, v_BGCJD, mask_BGCbJ)
    s_BGCMJ = q_BGCMD @ k_BGCJD.transpose(-1, -2)
    s_BGCMJ = s_BGCMJ.to(torch.promote_types(s_BGCMJ.dtype, torch.float32))
    s_BGCRbJ = s_BGCMJ.view(B, G, C, M // Bs, Bs, T * Bs).masked_fill(~mask_BGCbJ[:, :, :, None], -math.inf)
    p_BGCMJ = s_BGCRbJ.softmax(-1).view(B, G, C, M, T * Bs)
    return p_BGCMJ.to(v_BGCJD.dtype) @ v_BGCJD


def _fused(q_BGCMD: Tensor, k_BGCJD: Tensor, v_BGCJD: Tensor, mask_BGCbJ: Tensor) -> Tensor:
    """The same tile attention as one fused SDPA call: every tile a batch entry whose R query heads
    share its one key head (GQA; 4-D, so CPU runs its flash kernel), the tile's rule as an additive
    mask broadcast over the heads (q is scaled already)."""
    B, G, C, M, D = q_BGCMD.shape
    Bs, J = mask_BGCbJ.shape[-2:]
    N, R = B * G * C, M // Bs
    bias_N1bJ = torch.zeros((N, 1, Bs, J), dtype=q_BGCMD.dtype, device=q_BGCMD.device).masked_fill(
        ~mask_BGCbJ.reshape(N, 1, Bs, J), -math.inf)
    out_NRbD = F.scaled_dot_product_attention(q_BGCMD.reshape(N, R, Bs, D), k_BGCJD.reshape(N, 1, J, D),
                                              v_BGCJD.reshape(N, 1, J, D), attn_mask=bias_N1bJ, scale=1.0,
                                              enable_gqa=R > 1)
    return out_NRbD.reshape(B, G, C, M, D)


def _tiles(x_BHPD: Tensor, G: int, X: int, Bs: int) -> Tensor:
    """(B, H, X * Bs, D) queries -> (B, G, X, R * Bs, D) (R heads of a selection head per tile)."""
    B, H, _, D = x_BHPD.shape
    x_BGRXbD = x_BHPD.view(B, G, H // G, X, Bs, D)
    return x_BGRXbD.permute(0, 1, 3, 2, 4, 5).reshape(B, G, X, H // G * Bs, D)


def _untile(out_BGXMD: Tensor, H: int, Bs: int) -> Tensor:
    B, G, X, M, D = out_BGXMD.shape
    return out_BGXMD.view(B, G, X, H // G, Bs, D).permute(0, 1, 3, 2, 4, 5).reshape(B, H, X * Bs, D)


def _kv_blocks(x_BKPD: Tensor, G: int, Bs: int) -> Tensor:
    """(B, K, X * Bs, D) -> (B, G, X + 1, Bs, D) with the null block appended (zeros)."""
    B, K, P, D = x_BKPD.shape
    x_BKPD = F.pad(x_BKPD, (0, 0, 0, Bs))
    if G != K:
        x_BKPD = x_BKPD.repeat_interleave(G // K, 1)
    return x_BKPD.view(B, G, P // Bs + 1, Bs, D)


def _run(q_BGYMD, k_BGXbD, v_BGXbD, doc_BXb, skey_BXb, chunk, ckpt, lists, fused=False, t0: int = 0
         ) -> Tensor:
    """Loop over chunks of tiles; `lists(c0, C)` -> (idx_BGCT, keep_BGCbT or None). The queries
    are the Y tiles t0 .. t0 + Y of the layout's X (all of them by default; a context-parallel
    rank runs only its own)."""
    Y, X, Bs = q_BGYMD.shape[2], k_BGXbD.shape[2] - 1, k_BGXbD.shape[-2]
    pos_Xb = torch.arange((X + 1) * Bs, device=q_BGYMD.device).view(X + 1, Bs)
    outs = []
    c0, C = t0, chunk
    while c0 < t0 + Y:
        idx_BGCT, keep_BGCbT = lists(c0, min(C, t0 + Y - c0))
        args = (q_BGYMD[:, :, c0 - t0:c0 - t0 + idx_BGCT.shape[2]], k_BGXbD, v_BGXbD, idx_BGCT, doc_BXb,
                skey_BXb, pos_Xb, c0, keep_BGCbT, fused)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if ckpt else _chunk(*args))
        c0 += idx_BGCT.shape[2]
    return torch.cat(outs, dim=2) if outs else q_BGYMD


def _chunk_size(chunk: int, B: int, H: int, Bs: int, T: int) -> int:
    return max(1, min(chunk, _MAX_SCORE_ELEMS // max(1, B * H * Bs * T * Bs)))


def _wants_ckpt(cfg: AttentionConfig, q_tiles: Tensor, T: int, Bs: int, *qkv: Tensor) -> bool:
    """Checkpoint the chunks? Only in a forward that will be differentiated, and only when what
    the tiles save -- gathered keys and values (T blocks of Bs rows of D) and the fused call's
    (M, T * Bs) mask per tile, for q_tiles (..., tiles, M, D) -- exceeds gather_checkpoint_mib."""
    if not (cfg.gather_checkpoint and torch.is_grad_enabled() and any(t.requires_grad for t in qkv)):
        return False
    M, D = q_tiles.shape[-2:]
    tile_bytes = T * Bs * (2 * D * q_tiles.element_size() + M * 4)
    return q_tiles.numel() // (M * D) * tile_bytes > cfg.gather_checkpoint_mib * 2**20


def attend_gather_sparse(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                         sel: Selection) -> Tensor:
    """A sparse layer on the aligned layout (every tile one document block)."""
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    q_BHLD, k_BKLD, v_BKLD = (to_aligned(t, meta) for t in (q_BHSD, k_BKSD, v_BKSD))
    out_BHLD = sparse_tiles(q_BHLD, k_BKLD, v_BKLD, meta, cfg, sel, lists_BGAT, 0, q_BHSD, k_BKSD, v_BKSD)
    return from_aligned(out_BHLD, meta).to(q_BHSD.dtype)


TILE_MIN_BLOCK = 32  # below, a (row, head) call of 32 tiles is too small: one batched call per chunk


def tile_kernel(cfg: AttentionConfig, q: Tensor) -> bool:
    """Whether a sparse layer runs the CPU tile kernel (tiles.py)."""
    if q.device.type != "cpu":
        return False
    return cfg.gather_kernel == "tiles" or (cfg.gather_kernel == "sdpa" and cfg.block_size >= TILE_MIN_BLOCK)


def _tile_setup(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                sel: Selection):
    """The CPU tile kernel's inputs for a whole layer: q, k, v aligned, the chunk plans, G."""
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    plans = plan_chunks(meta, cfg, sel, lists_BGAT, 0, meta.aligned().aligned_blocks, q_BHSD.shape[-1])
    qkv = unit_stride(*(to_aligned(t, meta) for t in (q_BHSD, k_BKSD, v_BKSD)))
    return (*qkv, plans, lists_BGAT.shape[1])


def saved_forward(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                  sel: Selection) -> tuple[Tensor, Tensor] | None:
    """A sparse layer's (out (B, H, S, D), lse (B, H, S)) by the CPU tile kernel, for a backward
    that does not replay it (the compiled op, opaque.py); None where that kernel does not run."""
    if not tile_kernel(cfg, q_BHSD):
        return None
    *qkv, plans, G = _tile_setup(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)
    out_BHLD, lse_BHL1 = tiles_forward(*qkv, plans, G, cfg.block_size, 1 / math.sqrt(q_BHSD.shape[-1]))
    return from_aligned(out_BHLD, meta), from_aligned(lse_BHL1, meta)[..., 0]


def saved_backward(grad_BHSD: Tensor, q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, out_BHSD: Tensor,
                   lse_BHS: Tensor, meta: AttnMeta, cfg: AttentionConfig, sel: Selection
                   ) -> tuple[Tensor, Tensor, Tensor] | None:
    """(dq, dk, dv) from `saved_forward`'s output and lse (to_aligned's inverse is from_aligned:
    every token has one slot; empty slots get zero queries and gradients)."""
    if not tile_kernel(cfg, q_BHSD):
        return None
    *qkv, plans, G = _tile_setup(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)
    lse_BHS = lse_BHS.to(torch.promote_types(q_BHSD.dtype, torch.float32))  # the op returns float32
    saved = (to_aligned(t, meta) for t in (grad_BHSD, out_BHSD, lse_BHS[..., None]))
    grad_BHLD, out_BHLD, lse_BHL1 = unit_stride(*saved)
    grads = tiles_backward(grad_BHLD, *qkv, out_BHLD, lse_BHL1, plans, G, cfg.block_size,
                           1 / math.sqrt(q_BHSD.shape[-1]))
    return tuple(from_aligned(g, meta) for g in grads)


def sparse_tiles(q_BHYD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                 sel: Selection, lists_BGAT: Tensor, t0: int, *qkv: Tensor) -> Tensor:
    """The sparse rule's tile attention: queries of the aligned tiles t0 .. t0 + Y (B, H, Y * Bs, D),
    keys and values in aligned slots (B, K, L, D), each tile visiting its list; -> like q.
    `qkv`: the layer's inputs, whose grad decides the chunk checkpointing. The whole layer's tiles
    in one process (t0 = 0), a context-parallel rank's own otherwise (context.py)."""
    B, H, P, D = q_BHYD.shape
    G, T, Bs = lists_BGAT.shape[1], lists_BGAT.shape[-1], cfg.block_size
    if tile_kernel(cfg, q_BHYD):  # tiles.py: no mask where none is needed
        plans = plan_chunks(meta, cfg, sel, lists_BGAT, t0, P // Bs, D)
        return tile_attention(q_BHYD, k_BKLD, v_BKLD, plans, G, Bs, 1 / math.sqrt(D))
    doc_BXb, skey_BXb = block_tables(meta, Bs)

    def lists(c0: int, C: int):
        idx_BGCT = lists_BGAT[:, :, c0:c0 + C]
        return idx_BGCT, tile_keep(meta, cfg, idx_BGCT, c0, sel.picks_BGLk)

    q_BGYMD = _tiles(q_BHYD * (1 / math.sqrt(D)), G, P // Bs, Bs)
    k_BGXbD, v_BGXbD = _kv_blocks(k_BKLD, G, Bs), _kv_blocks(v_BKLD, G, Bs)
    C = _chunk_size(cfg.gather_chunk, B, H, Bs, T)
    ckpt = _wants_ckpt(cfg, q_BGYMD, T, Bs, *qkv)
    out = _run(q_BGYMD, k_BGXbD, v_BGXbD, doc_BXb, skey_BXb, C, ckpt, lists, cfg.gather_kernel != "eager", t0)
    return _untile(out, H, Bs)


def attend_gather_full(q_BHsD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                       q_start: int = 0) -> Tensor:
    """A full layer on the row layout: each tile visits every block its tokens can reach. The
    queries are the row's tokens q_start .. q_start + s (all of them by default; q_start a multiple
    of cfg.full_tile), the keys the whole row."""
    B, H, s, D = q_BHsD.shape
    S, K, Bs = meta.seq_len, k_BKSD.shape[1], cfg.full_tile  # row tiles: any size computes the same
    Q = -(-S // Bs)
    P = Q * Bs
    lo_BQ, hi_BQ = full_intervals(meta, Bs)
    T = max(int((hi_BQ - lo_BQ + 1).amax()), 1)
    pad = (0, 0, 0, P - S)
    t0 = q_start // Bs
    Y = -(-s // Bs)
    q_BKYMD = _tiles(F.pad(q_BHsD * (1 / math.sqrt(D)), (0, 0, 0, Y * Bs - s)), K, Y, Bs)
    k_BKXbD, v_BKXbD = _kv_blocks(F.pad(k_BKSD, pad), K, Bs), _kv_blocks(F.pad(v_BKSD, pad), K, Bs)
    doc_BXb = torch.cat([meta.padded("doc", Bs), meta.null.expand(B, Bs)], 1).view(B, Q + 1, Bs)
    skey_BXb = torch.cat([meta.padded("skey", Bs), meta.skey_BS.new_full((B, Bs), -(2**50))], 1)
    skey_BXb = skey_BXb.view(B, Q + 1, Bs)
    t_T = torch.arange(T, device=q_BHsD.device)

    def lists(c0: int, C: int):
        idx_BCT = lo_BQ[:, c0:c0 + C, None] + t_T
        idx_BCT = torch.where(idx_BCT <= hi_BQ[:, c0:c0 + C, None], idx_BCT, Q)
        return idx_BCT[:, None].expand(B, K, -1, T), None

    C = _chunk_size(cfg.gather_chunk, B, H, Bs, T)
    ckpt = _wants_ckpt(cfg, q_BKYMD, T, Bs, q_BHsD, k_BKSD, v_BKSD)
    fused = cfg.gather_kernel != "eager"
    out_BKYMD = _run(q_BKYMD, k_BKXbD, v_BKXbD, doc_BXb, skey_BXb, C, ckpt, lists, fused, t0)
    return _untile(out_BKYMD, H, Bs)[:, :, :s].to(q_BHsD.dtype)


def run_gather(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
               sel: Selection | None) -> Tensor:
    if sel is None:
        return attend_gather_full(q_BHSD, k_BKSD, v_BKSD, meta, cfg)
    return attend_gather_sparse(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sel)


register_backend(Backend("gather", run_gather, layers=BOTH, devices=ANY, train=ANY,
                         # full layers too: their tile ranges are read on the host (the full op's
                         # body resolves gather again and runs it; backward recomputes)
                         opaque={SPARSE: attend_sparse_opaque, FULL: attend_sdpa_opaque},
                         saved=(saved_forward, saved_backward), auto=4))
