"""Capture-and-recompute of attention probabilities (attention-map tool, collapse diagnostics).

Fused kernels return no probabilities, so a layer called with `capture` stores q and k (and its
block selection); `recompute_probs` recomputes softmax(q.k^T / sqrt(d) + mask) for chosen query
rows, in chunks of rows (memory O(rows_chunk * H * S), never S x S), with exactly the mask the
layer used: the token rule AND the recorded `kv_blocks` of a sparse layer.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, G selection heads (H, K),
R query rows, r rows in a chunk, Bs block size.
"""

from __future__ import annotations

import math

import torch

from .config import AttentionConfig
from .meta import AttnMeta, token_mask
from .select import select_blocks

Tensor = torch.Tensor


def _rows(query_rows: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    if query_rows.dim() == 1:
        return torch.full_like(query_rows, batch), query_rows
    if query_rows.dim() == 2 and query_rows.shape[1] == 2:
        return query_rows[:, 0], query_rows[:, 1]
    raise ValueError(f"query_rows: need (R,) positions or (R, 2) (batch, position) pairs "
                     f"(got shape {tuple(query_rows.shape)})")


@torch.no_grad()
def recompute_probs(capture: dict, meta: AttnMeta, cfg: AttentionConfig, sparse: bool, query_rows: Tensor,
                    chunk: int = 64, batch: int = 0) -> Tensor:
    """Probabilities over keys (H, R, S) fp32 for query rows: positions (R,) of row `batch`, or
    (R, 2) (batch, position) pairs."""
    q_BHSD, k_BKSD = capture["q"], capture["k"]
    B, H, S, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    sel_BGQN = None
    if sparse:
        sel_BGQN = capture.get("kv_blocks")
        if sel_BGQN is None:
            sel_BGQN = select_blocks(q_BHSD, k_BKSD, meta, cfg)
    b_R, i_R = _rows(query_rows.to(q_BHSD.device).long(), batch)
    out_HRS = torch.empty(H, len(i_R), S, dtype=torch.float32, device=q_BHSD.device)
    pos_S = torch.arange(S, device=q_BHSD.device)
    doc_BS, span_BS = meta.doc_BP[:, :S], meta.span_BP[:, :S]
    for b in b_R.unique().tolist():
        where_R = (b_R == b).nonzero().squeeze(1)
        k_KDS = k_BKSD[b].float().transpose(-1, -2)
        for r0 in range(0, len(where_R), chunk):
            rows_r = where_R[r0:r0 + chunk]
            i_r = i_R[rows_r]
            q_KXrD = q_BHSD[b, :, i_r].float().view(K, H // K, len(i_r), D)  # X = H // K
            s_HrS = (q_KXrD @ k_KDS[:, None]).reshape(H, len(i_r), S) / math.sqrt(D)
            mask_rS = token_mask(doc_BS[b, i_r, None], span_BS[b, i_r, None], i_r[:, None],
                                 doc_BS[b, None], span_BS[b, None], pos_S[None])
            mask_HrS = mask_rS[None].expand(H, -1, -1)
            if sel_BGQN is not None:
                sel_GrN = sel_BGQN[b][:, i_r // meta.block_size]
                sel_GrS = sel_GrN.repeat_interleave(meta.block_size, -1)[..., :S]
                mask_HrS = mask_HrS & sel_GrS.repeat_interleave(H // sel_GrS.shape[0], 0)
            out_HRS[:, rows_r] = s_HrS.masked_fill(~mask_HrS, float("-inf")).softmax(-1)
    return out_HRS
