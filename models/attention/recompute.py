"""Capture-and-recompute of attention probabilities (attention-map tool, collapse diagnostics).

Fused kernels return no probabilities, so a layer called with `capture` stores q and k (and its
selection); `recompute_probs` recomputes softmax(q.k^T / sqrt(d) + mask) for chosen query rows,
in chunks of rows (memory O(rows_chunk * H * S), never S x S), with exactly the mask the layer
used: the token rule AND, for a sparse layer, the block rule with its recorded picks.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, G selection heads (H, K),
R query rows, r rows in a chunk, Bs block size.
"""

from __future__ import annotations

import math

import torch

from .config import AttentionConfig
from .dense import rule_rows
from .meta import AttnMeta
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
    sel = None
    if sparse:
        sel = capture.get("selection")
        if sel is None:
            sel = select_blocks(q_BHSD, k_BKSD, meta, cfg)
    b_R, i_R = _rows(query_rows.to(q_BHSD.device).long(), batch)
    out_HRS = torch.empty(H, len(i_R), S, dtype=torch.float32, device=q_BHSD.device)
    for b in b_R.unique().tolist():
        where_R = (b_R == b).nonzero().squeeze(1)
        k_KDS = k_BKSD[b].float().transpose(-1, -2)
        for r0 in range(0, len(where_R), chunk):
            rows_r = where_R[r0:r0 + chunk]
            i_r = i_R[rows_r]
            q_KXrD = q_BHSD[b, :, i_r].float().view(K, H // K, len(i_r), D)  # X = H // K
            s_HrS = (q_KXrD @ k_KDS[:, None]).reshape(H, len(i_r), S) / math.sqrt(D)
            mask_GrS = rule_rows(meta, cfg, sel, b_R[rows_r], i_r)
            mask_HrS = mask_GrS.repeat_interleave(H // mask_GrS.shape[0], 0)
            out_HRS[:, rows_r] = s_HrS.masked_fill(~mask_HrS, float("-inf")).softmax(-1)
    return out_HRS


@torch.no_grad()
def block_pattern(capture: dict, meta: AttnMeta, cfg: AttentionConfig, sparse: bool, batch: int = 0,
                  chunk: int = 256) -> tuple[Tensor, Tensor]:
    """What a layer did at block level in one batch row, for pictures (an inspection-size row).

    -> kept (G, Q, Q) float: the share of the real query tokens of row block x that attend at
    least one key of row block y; reach (Q, Q) bool: the same is possible in a full layer."""
    Bs, S, Q = meta.block_size, meta.seq_len, meta.row_blocks
    sel = capture.get("selection") if sparse else None
    if sparse and sel is None:
        sel = select_blocks(capture["q"], capture["k"], meta, cfg)
    G = 1 if sel is None else sel.picks_BGLk.shape[1]
    kept_GQQ = torch.zeros(G, Q, Q, dtype=torch.float32)
    reach_QQ = torch.zeros(Q, Q, dtype=torch.bool)
    real_S = meta.real_BS[batch].cpu()
    for r0 in range(0, S, chunk):
        i_r = torch.arange(r0, min(S, r0 + chunk), device=meta.doc_BS.device)
        b_r = torch.full_like(i_r, batch)
        full_rS = rule_rows(meta, None, None, b_r, i_r)[0].cpu()
        mask_GrS = rule_rows(meta, cfg, sel, b_r, i_r).cpu() if sparse else full_rS[None]
        keep_r = real_S[i_r.cpu()]
        pad = (0, Q * Bs - S)
        hit_GrQ = torch.nn.functional.pad(mask_GrS, pad).view(G, len(i_r), Q, Bs).any(-1)[:, keep_r]
        reach_rQ = torch.nn.functional.pad(full_rS, pad).view(len(i_r), Q, Bs).any(-1)[keep_r]
        qblk_r = (i_r.cpu() // Bs)[keep_r]
        kept_GQQ.index_add_(1, qblk_r, hit_GrQ.float())
        reach_QQ.index_put_((qblk_r,), reach_rQ, accumulate=True)
    n_Q = torch.zeros(Q).index_add_(0, (torch.arange(S) // Bs)[real_S], torch.ones(int(real_S.sum())))
    return kept_GQQ / n_Q.clamp_min(1)[:, None], reach_QQ
