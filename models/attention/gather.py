"""The `gather` backend: pure PyTorch block-sparse attention, trainable on CPU and GPU.

Per query block, the selected key blocks (a fixed count T per layer call = the most any query block
selected; shorter lists are padded with a "null" block whose keys match no query) are gathered, the
token rule is applied inside them, and a softmax over the T * Bs gathered keys gives the output.
Vectorised over query blocks, processed in chunks of query blocks to bound the transient memory;
with `gather_checkpoint` each chunk is recomputed in backward (activation memory O(S * D) + the
chunk's transient O(C * T * Bs^2)); without it autograd keeps O(S * T * Bs) probabilities.
Full (non-sparse) layers use the same kernel with the selection = every reachable block
(same document, not in the future except span closures): exact, and never S x S.
The token rule is evaluated as doc[i] == doc[j] and (j <= i or skey[i] == skey[j]) with the span
key of `AttnMeta` (equal iff same (doc, span) visual span, or i == j): the same rule, fewer passes.

Legend: B batch, H query heads, K kv heads, S tokens, P padded tokens (= Q * Bs), D head dim,
Q query blocks, N key blocks, X = N + 1 (with the null block), G selection heads (H or K),
R = H // G query heads per selection head, M = R * Bs query rows of a block, C query blocks in a
chunk, T gathered blocks per query block, J = T * Bs gathered keys, Bs block size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .meta import AttnMeta

Tensor = torch.Tensor
_MAX_SCORE_ELEMS = 2**25  # cap on a chunk's score tensor (elements), whatever gather_chunk says


def gather_indices(sel_BGQN: Tensor, rows: int = 1024) -> tuple[Tensor, int]:
    """Selected block ids, ascending, padded with the null block id N to the max count T: (B, G, Q, T).

    Done in chunks of query-block rows with int32 keys, so the transient stays O(rows * N)."""
    B, G, Q, N = sel_BGQN.shape
    T = max(int(sel_BGQN.sum(-1).amax()), 1)
    rank_N = torch.arange(N, 0, -1, device=sel_BGQN.device, dtype=torch.int32)  # earlier block: larger key
    idx_BGQT = torch.empty(B, G, Q, T, dtype=torch.long, device=sel_BGQN.device)
    for r0 in range(0, Q, rows):
        key_BGrN = sel_BGQN[:, :, r0:r0 + rows] * rank_N
        val_BGrT, i_BGrT = key_BGrN.topk(T, dim=-1)
        idx_BGQT[:, :, r0:r0 + rows] = torch.where(val_BGrT > 0, i_BGrT, N)
    return idx_BGQT, T


def _chunk(q_BGCMD: Tensor, k_BGXbD: Tensor, v_BGXbD: Tensor, idx_BGCT: Tensor, doc_BXb: Tensor,
           skey_BXb: Tensor, pos_Xb: Tensor, c0: int) -> Tensor:
    B, G, C, M, D = q_BGCMD.shape
    T, Bs = idx_BGCT.shape[-1], k_BGXbD.shape[-2]
    b_B111 = torch.arange(B, device=idx_BGCT.device).view(B, 1, 1, 1)
    g_1G11 = torch.arange(G, device=idx_BGCT.device).view(1, G, 1, 1)
    k_BGCJD = k_BGXbD[b_B111, g_1G11, idx_BGCT].view(B, G, C, T * Bs, D)
    v_BGCJD = v_BGXbD[b_B111, g_1G11, idx_BGCT].view(B, G, C, T * Bs, D)
    # Token rule inside the gathered blocks (null-block keys carry a doc no query has).
    doc_BGCJ = doc_BXb[b_B111, idx_BGCT].view(B, G, C, T * Bs)
    skey_BGCJ = skey_BXb[b_B111, idx_BGCT].view(B, G, C, T * Bs)
    kpos_BGCJ = pos_Xb[idx_BGCT].view(B, G, C, T * Bs)
    doc_B1Cb1 = doc_BXb[:, None, c0:c0 + C, :, None]
    skey_B1Cb1 = skey_BXb[:, None, c0:c0 + C, :, None]
    qpos_1Cb1 = pos_Xb[None, c0:c0 + C, :, None]
    mask_BGCbJ = (doc_B1Cb1 == doc_BGCJ[:, :, :, None]) & (
        (kpos_BGCJ[:, :, :, None] <= qpos_1Cb1) | (skey_B1Cb1 == skey_BGCJ[:, :, :, None]))
    s_BGCMJ = q_BGCMD @ k_BGCJD.transpose(-1, -2)
    s_BGCMJ = s_BGCMJ.to(torch.promote_types(s_BGCMJ.dtype, torch.float32))
    s_BGCRbJ = s_BGCMJ.view(B, G, C, M // Bs, Bs, T * Bs).masked_fill(~mask_BGCbJ[:, :, :, None], -math.inf)
    p_BGCMJ = s_BGCRbJ.softmax(-1).view(B, G, C, M, T * Bs)
    return p_BGCMJ.to(v_BGCJD.dtype) @ v_BGCJD


def attend_gather(q_BHSD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, meta: AttnMeta, sel_BGQN: Tensor,
                  chunk: int = 32, use_checkpoint: bool = True) -> Tensor:
    """Attention restricted to the selected blocks (sel G = H, K, or 1 for a head-independent one)."""
    B, H, S, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    Q, Bs, P = meta.num_blocks, meta.block_size, meta.padded_len
    if sel_BGQN.shape[1] == 1 and "gather_full" in meta.cache:  # full layers: same lists every layer
        idx_BGQT, T = meta.cache["gather_full"]
    else:
        idx_BGQT, T = gather_indices(sel_BGQN)
        if sel_BGQN.shape[1] == 1:
            meta.cache["gather_full"] = (idx_BGQT, T)
    if sel_BGQN.shape[1] == 1:  # head-independent selection: gather per kv head
        idx_BGQT = idx_BGQT.expand(B, K, Q, T)
    G, R = idx_BGQT.shape[1], H // idx_BGQT.shape[1]
    pad = (0, 0, 0, P + Bs - S)  # whole blocks + the null block
    k_BKXD, v_BKXD = F.pad(k_BKSD, pad), F.pad(v_BKSD, pad)
    if G == H and H != K:
        k_BKXD, v_BKXD = k_BKXD.repeat_interleave(H // K, 1), v_BKXD.repeat_interleave(H // K, 1)
    k_BGXbD, v_BGXbD = k_BKXD.view(B, G, Q + 1, Bs, D), v_BKXD.view(B, G, Q + 1, Bs, D)
    q_BGRQbD = F.pad(q_BHSD * (1 / math.sqrt(D)), pad[:3] + (P - S,)).view(B, G, R, Q, Bs, D)
    q_BGQMD = q_BGRQbD.permute(0, 1, 3, 2, 4, 5).reshape(B, G, Q, R * Bs, D)
    null = meta.doc_BP.amin() - 1  # a doc no query has
    doc_BXb = torch.cat([meta.doc_BP, null.expand(B, Bs)], 1).view(B, Q + 1, Bs)
    skey_BXb = F.pad(meta.skey_BP, (0, Bs), value=-(P + 1)).view(B, Q + 1, Bs)
    pos_Xb = torch.arange(P + Bs, device=q_BHSD.device).view(Q + 1, Bs)
    C = max(1, min(chunk, _MAX_SCORE_ELEMS // (B * H * Bs * T * Bs)))
    ckpt = use_checkpoint and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q_BHSD, k_BKSD, v_BKSD))
    outs = []
    for c0 in range(0, Q, C):
        args = (q_BGQMD[:, :, c0:c0 + C], k_BGXbD, v_BGXbD, idx_BGQT[:, :, c0:c0 + C], doc_BXb, skey_BXb,
                pos_Xb, c0)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if ckpt else _chunk(*args))
    out_BGQRbD = torch.cat(outs, dim=2).view(B, G, Q, R, Bs, D)
    out_BHPD = out_BGQRbD.permute(0, 1, 3, 2, 4, 5).reshape(B, H, P, D)
    return out_BHPD[:, :, :S].to(q_BHSD.dtype)
