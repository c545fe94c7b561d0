"""The sparse layers' tile kernel on CPU: visible blocks without a mask, no gather where they slide.

A tile's listed blocks are of two kinds. *Visible* blocks -- earlier blocks of the tile's
document that the block rule keeps for every token of the tile -- need no mask; the rest (the
own block, a visual span's blocks, per-token picks, null padding) do. Per chunk of tiles, the
last `Fc` visible blocks of each tile (Fc: the chunk's fewest) run in unmasked fused calls and
the rest in one masked call (causal without a mask when it is just the own text block, and then
read together with a window that ends just before it: one call, one causal mask shared by every
tile), merged by their log-sum-exps: no masked-out key of a visible block is computed. Blocks that
slide with the tile (the window: tile c reads blocks first + c ..) are read as an overlapping
strided view of the K/V table, not gathered, and their gradients added back by slices. The
backward gives each call's fused backward the merged output and log-sum-exp (so each call's
probabilities are the whole softmax's), re-reads K/V instead of saving copies, and adds every
gradient into one K/V buffer: no forward is replayed.

Legend: B batch, G selection heads, K kv heads, Y query tiles, A aligned blocks, Bs block size,
M = R * Bs rows of a tile (R query heads per selection head), D head dim, C tiles in a chunk,
T blocks a call reads per tile, J = T * Bs, n one (row, selection head) of B * G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .blocks import block_tables, tile_keep, tile_mask, visible_blocks, window_blocks
from .config import AttentionConfig
from .meta import AttnMeta
from .select import Selection

Tensor = torch.Tensor
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_CHUNK_BYTES = 32 << 20  # K (or V) one call reads for a chunk


@dataclass
class Part:
    """Blocks one fused call reads for every tile of a chunk."""

    rows_nCT: Tensor  # int64 blocks of the (row, kv head)'s table per tile (null padding: 0, masked)
    first_n: list[int] | None = None  # sliding: tile c reads blocks first + c .. first + c + T - 1
    mask_nCbJ: Tensor | None = None  # bool, the rule over the blocks (None: all visible)
    any_nCb: Tensor | None = None  # bool: the token attends some key of the call
    causal: bool = False  # the own text block only: is_causal, no mask
    bias_bJ: Tensor | None = None  # one additive mask for every tile (the window + own causal block)


@dataclass
class ChunkPlan:
    y0: int  # tiles y0 .. y0 + C of the Y
    C: int
    parts: list[Part]


def _sliding(rows_nCT: Tensor) -> list[int] | None:
    """Starts per n if tile c reads first + c + t (a strided view), else None (host sync)."""
    n, C, T = rows_nCT.shape
    if not rows_nCT.numel():
        return None
    dev = rows_nCT.device
    d_nCT = rows_nCT - torch.arange(C, device=dev)[:, None] - torch.arange(T, device=dev)
    return d_nCT[:, 0, 0].tolist() if bool((d_nCT == d_nCT[:, :1, :1]).all()) else None


def _visible_parts(vis_nCF: Tensor, W: int) -> list[Part]:
    """Unmasked calls over the visible blocks: the window as a view when it slides, the rest gathered."""
    if not vis_nCF.shape[-1]:
        return []
    first = _sliding(vis_nCF)
    if first is not None:
        return [Part(vis_nCF, first)]
    F = vis_nCF.shape[-1]
    first = _sliding(vis_nCF[..., F - W:]) if 0 < W < F else None
    if first is None:
        return [Part(vis_nCF)]
    return [Part(vis_nCF[..., :F - W].contiguous()), Part(vis_nCF[..., F - W:], first)]


def _split(idx_BGCT: Tensor, visible_BGCT: Tensor, null: int) -> tuple[Tensor, Tensor]:
    """-> (B, G, C, Fc) the last Fc visible blocks of each tile (Fc the chunk's fewest), (B, G, C, P)
    the other listed blocks, sorted, null-padded (host sync for the sizes)."""
    X = null + 1
    sorted_BGCT = (idx_BGCT + X * (~visible_BGCT).long()).sort(-1).values % X  # visible first
    F_BGC = visible_BGCT.sum(-1)
    Fc = int(F_BGC.amin()) if idx_BGCT.numel() else 0
    pos_BGCF = (F_BGC - Fc)[..., None] + torch.arange(Fc, device=idx_BGCT.device)
    t_T = torch.arange(idx_BGCT.shape[-1], device=idx_BGCT.device)
    tail_BGCT = (t_T >= (F_BGC - Fc)[..., None]) & (t_T < F_BGC[..., None])
    rest_BGCT = sorted_BGCT.masked_fill(tail_BGCT, null).sort(-1).values
    P = int((rest_BGCT < null).sum(-1).amax()) if rest_BGCT.numel() else 0
    return sorted_BGCT.gather(-1, pos_BGCF), rest_BGCT[..., :P]


def _uneven(visible_BGCT: Tensor) -> bool:
    """More than a quarter of the chunk's visible blocks would go to the masked call (host sync)."""
    F_BGC = visible_BGCT.sum(-1)
    return bool((F_BGC - F_BGC.amin()).sum() * 4 > F_BGC.sum())


@torch.no_grad()
def plan_chunks(meta: AttnMeta, cfg: AttentionConfig, sel: Selection, lists_BGAT: Tensor, t0: int, Y: int,
                D: int) -> list[ChunkPlan]:
    """The chunks of the tiles t0 .. t0 + Y: per chunk the visible calls and the masked call."""
    lay = meta.aligned()
    B, G, A, T = lists_BGAT.shape
    Bs = cfg.block_size
    doc_BXb, skey_BXb = block_tables(meta, Bs)
    C = max(1, min(cfg.gather_chunk, _CHUNK_BYTES // (T * Bs * D * 4)))
    pos_Xb = torch.arange((A + 1) * Bs, device=doc_BXb.device).view(A + 1, Bs)
    plans = []
    todo = [(c0, min(C, t0 + Y - c0), None) for c0 in range(t0, t0 + Y, C)][::-1]
    while todo:
        c0, n, visible_BGCT = todo.pop()
        idx_BGCT = lists_BGAT[:, :, c0:c0 + n]
        if visible_BGCT is None:  # per tile: a half's is a slice of its chunk's
            keep_BGCbT = tile_keep(meta, cfg, idx_BGCT, c0, sel.picks_BGLk)
            visible_BGCT = visible_blocks(meta, idx_BGCT, c0, keep_BGCbT)
        if n >= 8 and _uneven(visible_BGCT):  # e.g. a document's first tiles: halves waste less
            h = n // 2
            todo += [(c0 + h, n - h, visible_BGCT[:, :, h:]), (c0, h, visible_BGCT[:, :, :h])]
            continue
        vis_BGCF, rest_BGCP = _split(idx_BGCT, visible_BGCT, A)
        parts = _visible_parts(vis_BGCF.flatten(0, 1), window_blocks(cfg))
        if rest_BGCP.shape[-1]:
            mask_BGCbJ = tile_mask(rest_BGCP, doc_BXb, skey_BXb, pos_Xb, c0,
                                   tile_keep(meta, cfg, rest_BGCP, c0, sel.picks_BGLk))
            tile_11C = torch.arange(c0, c0 + n, device=idx_BGCT.device).view(1, 1, n)
            own = rest_BGCP.shape[-1] == 1 and bool((rest_BGCP[..., 0] == tile_11C).all())
            causal = own and not bool(lay.vis_BA[:, c0:c0 + n].any())  # own text blocks: causal inside
            rows_nCP = rest_BGCP.masked_fill(rest_BGCP == A, 0).flatten(0, 1)
            any_nCb = None if causal else mask_BGCbJ.any(-1).flatten(0, 1)  # causal: every token sees itself
            parts.append(Part(rows_nCP, _sliding(rows_nCP) if causal else None, mask_BGCbJ.flatten(0, 1),
                              any_nCb, causal))
            parts = _window_with_own(parts, c0, Bs)
        plans.append(ChunkPlan(c0 - t0, n, parts))
    return plans


def _window_with_own(parts: list[Part], c0: int, Bs: int) -> list[Part]:
    """The own causal block read with the window that ends just before it: one sliding call whose
    mask (the same for every tile) is causal over its last block, instead of a second small call."""
    own = parts[-1]
    win = next((p for p in parts[:-1] if p.first_n is not None), None)
    if not own.causal or win is None or own.first_n is None:
        return parts
    Tw = win.rows_nCT.shape[-1]
    if any(f != c0 - Tw for f in win.first_n) or any(f != c0 for f in own.first_n):
        return parts
    dev = own.rows_nCT.device
    bias_bJ = torch.zeros(Bs, (Tw + 1) * Bs, device=dev)
    bias_bJ[:, Tw * Bs:].masked_fill_(torch.ones(Bs, Bs, dtype=torch.bool, device=dev).triu(1), -math.inf)
    both = Part(torch.cat([win.rows_nCT, own.rows_nCT], -1), win.first_n, bias_bJ=bias_bJ)
    return [p for p in parts[:-1] if p is not win] + [both]


def _tiles(x_BHLD: Tensor, b: int, h: int, y0: int, shape: tuple[int, ...]) -> Tensor:
    """A strided view (C, R, Bs, D) of heads h .. h + R, tiles y0 .. y0 + C of row b (no copy)."""
    C, R, Bs, D = shape
    sB, sH, sS, sD = x_BHLD.stride()
    offset = x_BHLD.storage_offset() + b * sB + h * sH + y0 * Bs * sS
    return x_BHLD.as_strided(shape, (Bs * sS, sH, sS, sD), offset)


def _read(x_BKLD: Tensor, b: int, h: int, part: Part, i: int, Bs: int) -> Tensor:
    """(C, 1, T * Bs, D): what the call reads of kv head h of row b for each tile."""
    C, T = part.rows_nCT.shape[1:]
    L, D = x_BKLD.shape[2:]
    sB, sH, sS, sD = x_BKLD.stride()
    base = x_BKLD.storage_offset() + b * sB + h * sH
    if part.first_n is not None:  # overlapping windows of one strided view
        return x_BKLD.as_strided((C, 1, T * Bs, D), (Bs * sS, 0, sS, sD), base + part.first_n[i] * Bs * sS)
    table_AbD = x_BKLD.as_strided((L // Bs, Bs, D), (Bs * sS, sS, sD), base)
    return table_AbD.index_select(0, part.rows_nCT[i].reshape(-1)).view(C, 1, T * Bs, D)


def _bias(part: Part, i: int, dtype: torch.dtype) -> Tensor | None:
    if part.bias_bJ is not None:
        return part.bias_bJ.to(dtype)[None, None]
    if part.mask_nCbJ is None or part.causal:
        return None
    mask_CbJ = part.mask_nCbJ[i]
    return torch.zeros(mask_CbJ.shape, dtype=dtype).masked_fill_(~mask_CbJ, -math.inf)[:, None]


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Outputs (C, R, Bs, D) and log-sum-exps (C, R, Bs) over disjoint keys -> the softmax over their
    union. A row with no key at all gets output 0 and lse +inf (its backward terms vanish)."""
    if len(parts) == 1:
        out, lse = parts[0]
        return out, torch.where(torch.isneginf(lse), math.inf, lse)
    lse_PCRb = torch.stack([lse for _, lse in parts])
    m_CRb = lse_PCRb.amax(0)
    m_CRb = torch.where(torch.isneginf(m_CRb), 0.0, m_CRb)
    w_PCRb = torch.exp(lse_PCRb - m_CRb)
    z_CRb = w_PCRb.sum(0)
    w_PCRb = w_PCRb / z_CRb.clamp_min(1e-30)
    out = parts[0][0] * w_PCRb[0, ..., None].to(parts[0][0].dtype)
    for (o, _), w in zip(parts[1:], w_PCRb[1:]):
        out.addcmul_(o, w[..., None].to(o.dtype))
    return out, torch.where(z_CRb > 0, m_CRb + torch.log(z_CRb), math.inf)


def _chunk_forward(q_CRbD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, b: int, h: int, plan: ChunkPlan, i: int,
                   scale: float) -> tuple[Tensor, Tensor]:
    outs = []
    Bs = q_CRbD.shape[2]
    for part in plan.parts:
        out, lse = _FWD(q_CRbD, _read(k_BKLD, b, h, part, i, Bs), _read(v_BKLD, b, h, part, i, Bs), 0.0,
                        part.causal, attn_mask=_bias(part, i, q_CRbD.dtype), scale=scale)
        if part.any_nCb is not None:
            lse = lse.masked_fill(~part.any_nCb[i][:, None], -math.inf)  # nothing kept: weight 0
        outs.append((out, lse))
    if not outs:
        lse_dtype = torch.promote_types(q_CRbD.dtype, torch.float32)
        return torch.zeros_like(q_CRbD), q_CRbD.new_full(q_CRbD.shape[:3], math.inf, dtype=lse_dtype)
    return _merge(outs)


def _walk(plans: list[ChunkPlan], B: int, G: int, H: int, K: int, Bs: int, D: int):
    """(plan, n, row, first query head, kv head, tile shape) of every call group, in order."""
    R = H // G
    for plan in plans:
        for i in range(B * G):
            b, g = divmod(i, G)
            yield plan, i, b, g * R, g * R // (H // K), (plan.C, R, Bs, D)


def tiles_forward(q_BHYD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, plans: list[ChunkPlan], G: int, Bs: int,
                  scale: float) -> tuple[Tensor, Tensor]:
    """-> out (B, H, Y * Bs, D), lse (B, H, Y * Bs, 1) (no autograd)."""
    B, H, P, D = q_BHYD.shape
    out_BHYD = q_BHYD.new_empty(q_BHYD.shape)
    lse_BHY1 = q_BHYD.new_empty((B, H, P, 1), dtype=torch.promote_types(q_BHYD.dtype, torch.float32))
    for plan, i, b, h0, h, shape in _walk(plans, B, G, H, k_BKLD.shape[1], Bs, D):
        q_CRbD = _tiles(q_BHYD, b, h0, plan.y0, shape)
        out, lse = _chunk_forward(q_CRbD, k_BKLD, v_BKLD, b, h, plan, i, scale)
        _tiles(out_BHYD, b, h0, plan.y0, shape).copy_(out)
        _tiles(lse_BHY1, b, h0, plan.y0, (*shape[:3], 1)).copy_(lse[..., None])
    return out_BHYD, lse_BHY1


def _add_rows(d_AbD: Tensor, g_C1JD: Tensor, part: Part, i: int) -> None:
    """Adds one call's K (or V) gradient into the blocks it read: T slice adds where the call read a
    sliding view (tile c's t-th block is first + c + t), one index_add over flat rows otherwise."""
    A, Bs, D = d_AbD.shape
    C, T = part.rows_nCT.shape[1:]
    g_CTbD = g_C1JD.reshape(C, T, Bs, D)
    if part.first_n is not None:
        f = part.first_n[i]
        for t in range(T):
            d_AbD[f + t:f + t + C].add_(g_CTbD[:, t])
    else:  # 2-D rows: index_add's scatter over (A, Bs, D) is slower
        d_AbD.view(A, Bs * D).index_add_(0, part.rows_nCT[i].reshape(-1), g_CTbD.view(C * T, Bs * D))


def tiles_backward(grad_BHYD: Tensor, q_BHYD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, out_BHYD: Tensor,
                   lse_BHY1: Tensor, plans: list[ChunkPlan], G: int, Bs: int, scale: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's output and log-sum-exp: the fused backwards alone."""
    (grad_BHYD,) = unit_stride(grad_BHYD)
    B, H, P, D = q_BHYD.shape
    K, L = k_BKLD.shape[1], k_BKLD.shape[2]
    dq_BHYD = torch.empty_like(q_BHYD, memory_format=torch.contiguous_format)  # every tile: one chunk
    dk_BKAbD = k_BKLD.new_zeros(B, K, L // Bs, Bs, D)
    dv_BKAbD = torch.zeros_like(dk_BKAbD)
    for plan, i, b, h0, h, shape in _walk(plans, B, G, H, K, Bs, D):
        q, dout, out = (_tiles(t, b, h0, plan.y0, shape) for t in (q_BHYD, grad_BHYD, out_BHYD))
        lse = _tiles(lse_BHY1, b, h0, plan.y0, (*shape[:3], 1))[..., 0]
        dq = None
        for part in plan.parts:
            k, v = _read(k_BKLD, b, h, part, i, Bs), _read(v_BKLD, b, h, part, i, Bs)
            mask = _bias(part, i, q.dtype)
            gq, gk, gv = _BWD(dout, q, k, v, out, lse, 0.0, part.causal, attn_mask=mask, scale=scale)
            dq = gq if dq is None else dq.add_(gq)
            _add_rows(dk_BKAbD[b, h], gk, part, i)
            _add_rows(dv_BKAbD[b, h], gv, part, i)
        _tiles(dq_BHYD, b, h0, plan.y0, shape).copy_(0 if dq is None else dq)
    return dq_BHYD, dk_BKAbD.view(B, K, L, D), dv_BKAbD.view(B, K, L, D)


class TileAttention(torch.autograd.Function):
    """(q (B, H, Y * Bs, D), k / v (B, K, L, D) in aligned slots, plans, G, Bs, scale) -> like q."""

    @staticmethod
    def forward(ctx, q_BHYD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, plans: list[ChunkPlan], G: int, Bs: int,
                scale: float):
        out_BHYD, lse_BHY1 = tiles_forward(q_BHYD, k_BKLD, v_BKLD, plans, G, Bs, scale)
        ctx.save_for_backward(q_BHYD, k_BKLD, v_BKLD, out_BHYD, lse_BHY1)
        ctx.plans, ctx.G, ctx.Bs, ctx.scale = plans, G, Bs, scale
        return out_BHYD

    @staticmethod
    def backward(ctx, grad_BHYD: Tensor):
        grads = tiles_backward(grad_BHYD, *ctx.saved_tensors, ctx.plans, ctx.G, ctx.Bs, ctx.scale)
        return *grads, None, None, None, None


def unit_stride(*xs: Tensor) -> tuple[Tensor, ...]:
    """The kernel reads any strides with a unit last one."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in xs)


def tile_attention(q_BHYD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, plans: list[ChunkPlan], G: int,
                   block_size: int, scale: float) -> Tensor:
    """The chunks' attention: queries of Y tiles (B, H, Y * Bs, D), keys and values in aligned slots
    (B, K, L, D), any strides with a unit last one; -> (B, H, Y * Bs, D)."""
    return TileAttention.apply(*unit_stride(q_BHYD, k_BKLD, v_BKLD), plans, G, block_size, scale)
