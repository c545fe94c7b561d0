"""The `flex` backend: FlexAttention with a BlockMask from the block lists + the rules in mask_mod.

mask_mod is the ground truth (the token rule, and for sparse layers the block rule with the
per-token picks); the BlockMask lists every kernel tile pair where mask_mod can be true, so the
kernel skips the rest. Sparse layers run on the aligned layout (meta.py), as in `gather`: their
tile lists are `blocks.sparse_lists`, coarsened to flex's tile, and a coarse pair whose blocks
are all visible to all its queries (`blocks.visible_blocks`) is "full". Full layers run on the row
layout: a tile visits the range of tiles its tokens can reach (`blocks.full_intervals`), and
tile pairs inside one document strictly below the diagonal go in the "full" lists (no mask_mod
evaluated there). The compiled kernel is the CUDA training path; on CPU (torch 2.13) compiled
flex is inference only, so `attend_flex` refuses to build a graph for backward there.

Flex's Triton kernels need the BlockMask's block size to be a multiple of their tiles (128), so
a sparse layer's BlockMask is built at Bf = lcm(Bs, 128) (a coarse pair is listed if any of its
Bs-pairs is); a full layer's at 128 (it has no blocks).

Compiled flex (`dynamic=False`) compiles once per shape: a full layer's is (B, S); a sparse
layer's L = A * Bs, with A bounded (meta.py: static under a document cap, else one of
`aligned_sizes`), and the BlockMask's (B, H, X, X) follows A. Host reads while building the
masks (each a stall of the GPU queue; none changes a shape the kernel sees):
  * meta.aligned_blocks without a document cap (one int per forward, cached);
  * select.py's per-chunk earliest document start (`_select`: bounds the scored key range);
  * blocks.py's list widths T (`_dedupe`) and range widths W (`_ranges`): the lists are sized to
    the longest, not to A (memory O(A * T) instead of O(A * A)).
Full layers' BlockMask reads none (document contiguity is the tensor `meta.contiguous`).

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, G selection heads (H, K),
Bs block size, Bf = lcm(Bs, 128) flex block size, f = Bf // Bs, X / Y coarse query / key tiles,
A aligned blocks, L aligned slots, T listed blocks per tile, k = top_k.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .blocks import full_intervals, kept, sparse_lists, tile_keep, visible_blocks
from .config import AttentionConfig
from .meta import AttnMeta, token_mask
from .registry import BOTH, Backend, register_backend
from .select import Selection, from_aligned, to_aligned

Tensor = torch.Tensor


@functools.cache
def compiled_flex():
    """torch.compile(flex_attention), built once per process (no module-level state)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _kv_lists(sel_BGXY: Tensor) -> tuple[Tensor, Tensor]:
    num_BGX = sel_BGXY.sum(-1).to(torch.int32)
    idx_BGXY = (~sel_BGXY).to(torch.uint8).sort(dim=-1, stable=True).indices.to(torch.int32)
    return num_BGX, idx_BGXY


def _pad(x_BL: Tensor, extra: int, value) -> Tensor:
    """Tables long enough for any kernel tile overrun past the end."""
    fill = torch.as_tensor(value, dtype=x_BL.dtype, device=x_BL.device).expand(x_BL.shape[0], extra)
    return torch.cat([x_BL, fill], 1)


def _coarse_table(lists_BGAT: Tensor, A: int, f: int) -> Tensor:
    """(B, G, A, T) fine lists (null = A) -> (B, G, X, X) bool coarse tile pairs."""
    B, G, _, T = lists_BGAT.shape
    X = -(-A // f)
    fine_BGXT = F.pad(lists_BGAT, (0, 0, 0, X * f - A), value=A).view(B, G, X, f * T)
    coarse_BGXT = torch.where(fine_BGXT < A, fine_BGXT // f, X)
    table_BGXY = torch.zeros(B, G, X, X + 1, dtype=torch.bool, device=lists_BGAT.device)
    return table_BGXY.scatter_(-1, coarse_BGXT, True)[..., :X]


def _full_table(meta: AttnMeta, cfg: AttentionConfig, sel: Selection, lists_BGAT: Tensor, f: int,
                chunk: int = 256) -> Tensor:
    """(B, G, X, X) coarse tile pairs every query of which sees every key: all f x f block pairs
    visible (blocks.visible_blocks) and the query tile without empty slots."""
    lay = meta.aligned()
    B, G, A, T = lists_BGAT.shape
    X = -(-A // f)
    count_BGXY = torch.zeros(B, G, X, X + 1, dtype=torch.int32, device=lists_BGAT.device)
    for a0 in range(0, A, chunk):
        list_BGCT = lists_BGAT[:, :, a0:a0 + chunk]
        C = list_BGCT.shape[2]
        keep_BGCbT = tile_keep(meta, cfg, list_BGCT, a0, sel.picks_BGLk)
        whole_B1C1 = (lay.count_BA[:, a0:a0 + C] == cfg.block_size)[:, None, :, None]
        vis_BGCT = visible_blocks(meta, list_BGCT, a0, keep_BGCbT) & whole_B1C1
        y_BGCT = torch.where(vis_BGCT, list_BGCT // f, X)
        x_C = torch.arange(a0, a0 + C, device=y_BGCT.device) // f
        flat_BGCT = x_C[:, None] * (X + 1) + y_BGCT
        count_BGXY.view(B, G, -1).scatter_add_(2, flat_BGCT.reshape(B, G, -1),
                                               vis_BGCT.int().reshape(B, G, -1))
    return count_BGXY[..., :X] == f * f


def sparse_block_mask(meta: AttnMeta, cfg: AttentionConfig, sel: Selection, H: int):
    """BlockMask of a sparse layer over the aligned layout (L slots)."""
    from torch.nn.attention.flex_attention import BlockMask

    lay = meta.aligned()
    A, Bs, L = lay.aligned_blocks, cfg.block_size, lay.num_slots
    Bf = math.lcm(Bs, 128)
    lists_BGAT = sparse_lists(meta, cfg, sel.picks_BGLk, sel.block_picks_BGAk)
    table_BGXY = _coarse_table(lists_BGAT, A, Bf // Bs)
    full_BGXY = _full_table(meta, cfg, sel, lists_BGAT, Bf // Bs)  # no mask_mod evaluated there
    if table_BGXY.shape[1] not in (1, H):
        table_BGXY = table_BGXY.repeat_interleave(H // table_BGXY.shape[1], 1)
        full_BGXY = full_BGXY.repeat_interleave(H // full_BGXY.shape[1], 1)
    extra = 2 * Bf
    doc_BL, skey_BL = _pad(lay.doc_BL, extra, meta.null), _pad(lay.skey_BL, extra, -(2**50))
    span_lo_BL, span_hi_BL = _pad(lay.span_lo_BL, extra, 1), _pad(lay.span_hi_BL, extra, 0)
    beyond_BE = torch.arange(A, A + extra, device=doc_BL.device).expand(meta.batch, -1)
    first_BA = torch.cat([lay.first_BA, beyond_BE], 1)
    vis_BA = F.pad(lay.vis_BA, (0, extra))
    G, k = sel.picks_BGLk.shape[1], sel.picks_BGLk.shape[-1]
    picks = [F.pad(sel.picks_BGLk[..., j], (0, extra), value=-1) for j in range(k)]  # k tables (B, G, L)
    R = H // G

    def mask_mod(b, h, q_idx, kv_idx):
        rule = token_mask(doc_BL[b, q_idx], skey_BL[b, q_idx], q_idx, doc_BL[b, kv_idx], skey_BL[b, kv_idx],
                          kv_idx)
        qa, ka = q_idx // Bs, kv_idx // Bs
        nq, nk = qa - first_BA[b, qa], ka - first_BA[b, ka]
        keep = kept(cfg, nq, nk, vis_BA[b, ka], span_lo_BL[b, q_idx], span_hi_BL[b, q_idx])
        for p_BGL in picks:
            keep = keep | (p_BGL[b, h // R, q_idx] == nk)
        return rule & keep

    n_part, i_part = _kv_lists(table_BGXY & ~full_BGXY)
    n_full, i_full = _kv_lists(full_BGXY)
    return BlockMask.from_kv_blocks(n_part, i_part, n_full, i_full, BLOCK_SIZE=Bf, mask_mod=mask_mod,
                                    seq_lengths=(L, L))


def full_block_mask(meta: AttnMeta):
    """BlockMask of a full layer over the row layout (cached per forward: every full layer shares it)."""
    from torch.nn.attention.flex_attention import BlockMask

    if "flex_full" in meta.cache:
        return meta.cache["flex_full"]
    B, S, Bf = meta.batch, meta.seq_len, 128  # full layers have no blocks: flex's own tile
    X = -(-S // Bf)
    lo_BX, hi_BX = full_intervals(meta, Bf)
    y_Y = torch.arange(X, device=lo_BX.device)
    reach_BXY = (y_Y >= lo_BX[..., None]) & (y_Y <= hi_BX[..., None])
    # Full pairs: tile X lies in one document entirely, tile Y < X too (then every j < i).
    doc_BP = F.pad(meta.doc_BS, (0, X * Bf - S), value=-(2**40))
    d_BXf = doc_BP.view(B, X, Bf)
    one_BX = (d_BXf == d_BXf[..., :1]).all(-1) & (d_BXf[..., 0] > -(2**40))
    first_BX = F.pad(meta.first_BS, (0, X * Bf - S)).view(B, X, Bf)[..., 0]
    lo_full_BX = -(-first_BX // Bf)
    full_BXY = (one_BX[..., None] & (y_Y >= lo_full_BX[..., None]) & (y_Y < y_Y[:, None]) & reach_BXY
                & meta.contiguous)  # a tensor: no host read
    extra = 2 * Bf
    doc_BX, skey_BX = _pad(meta.doc_BS, X * Bf - S + extra, meta.null), meta.skey_BS
    pad_BE = -torch.arange(S + 1, X * Bf + extra + 1, device=skey_BX.device).expand(B, -1)
    skey_BX = torch.cat([skey_BX, pad_BE], 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return token_mask(doc_BX[b, q_idx], skey_BX[b, q_idx], q_idx, doc_BX[b, kv_idx], skey_BX[b, kv_idx],
                          kv_idx)

    n_part, i_part = _kv_lists((reach_BXY & ~full_BXY)[:, None])
    n_full, i_full = _kv_lists(full_BXY[:, None])
    meta.cache["flex_full"] = BlockMask.from_kv_blocks(n_part, i_part, n_full, i_full, BLOCK_SIZE=Bf,
                                                       mask_mod=mask_mod, seq_lengths=(S, S))
    return meta.cache["flex_full"]


def attend_flex(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig,
                sel: Selection | None, compiled: bool = True) -> Tensor:
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BKSD, v_BKSD))
    if needs_grad and q_BHSD.device.type != "cuda":
        raise RuntimeError("backend: flex has no backward on CPU in this torch; use 'gather' or 'auto'")
    H, K = q_BHSD.shape[1], k_BKSD.shape[1]
    if compiled:
        fn = compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    if sel is None:
        return fn(q_BHSD, k_BKSD, v_BKSD, block_mask=full_block_mask(meta), enable_gqa=H != K)
    q_BHLD, k_BKLD, v_BKLD = (to_aligned(x, meta) for x in (q_BHSD, k_BKSD, v_BKSD))
    out_BHLD = fn(q_BHLD, k_BKLD, v_BKLD, block_mask=sparse_block_mask(meta, cfg, sel, H), enable_gqa=H != K)
    return from_aligned(out_BHLD, meta)


register_backend(Backend("flex", attend_flex, layers=BOTH, devices=("cpu", "cuda"), train=("cuda",), auto=2))
