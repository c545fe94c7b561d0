"""Sparse block selection (MoBA-style), shared by every backend so that they compute one function.

Per query block q (and per head or per GQA group), the kept key blocks are
    base = own block | window blocks (the ceil(window / Bs) blocks before q) | span closure
           | sink (if cfg.sink) | visual blocks (if cfg.visual_always),   all AND reach
    top-k: the cfg.top_k best blocks among the *remaining* candidates (n < q, reachable, not in base),
           scored by mean_{i in q} q_i . mean_{j in n} k_j (fp32; GQA groups average their heads' scores).
`reach` restricts everything to blocks that share a document with q and are not in q's future
(except the closure: the blocks of the visual spans present in q, kept both ways).
Selection is a discrete choice made under no_grad.

Legend: B batch, H query heads, K kv heads, S tokens, D head dim, Q query blocks, N key blocks,
G selection heads (H for select_per="head", K for "kv_group"), R = H // K, Bs block size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import AttentionConfig
from .meta import AttnMeta

Tensor = torch.Tensor


def block_mean(x_BHSD: Tensor, meta: AttnMeta) -> Tensor:
    """Mean of each block's real tokens, fp32: (B, H, Q, D)."""
    B, H, S, D = x_BHSD.shape
    x_BHPD = F.pad(x_BHSD.float(), (0, 0, 0, meta.padded_len - S))
    sum_BHQD = x_BHPD.view(B, H, meta.num_blocks, meta.block_size, D).sum(-2)
    return sum_BHQD / meta.count_Q[:, None]


def base_blocks(meta: AttnMeta, cfg: AttentionConfig) -> Tensor:
    """Blocks every head keeps: own, window, closure, sink, visual (all within reach): (B, Q, N)."""
    q_Q = torch.arange(meta.num_blocks, device=meta.doc_BP.device)
    diff_QN = q_Q[:, None] - q_Q[None, :]
    n_win = -(-cfg.window // meta.block_size)
    base_BQN = ((diff_QN >= 0) & (diff_QN <= n_win))[None] | meta.closure_BQN
    if cfg.sink:
        base_BQN = base_BQN | meta.sink_BQN
    if cfg.visual_always:
        base_BQN = base_BQN | meta.visual_BQN
    return base_BQN & meta.reach_BQN


@torch.no_grad()
def select_blocks(q_BHSD: Tensor, k_BKSD: Tensor, meta: AttnMeta, cfg: AttentionConfig) -> Tensor:
    """The boolean block selection of a sparse layer: (B, G, Q, N)."""
    B, H, _, _ = q_BHSD.shape
    K = k_BKSD.shape[1]
    G = H if cfg.select_per == "head" else K
    Q = meta.num_blocks
    base_BQN = base_blocks(meta, cfg)
    if cfg.top_k == 0:
        return base_BQN[:, None].expand(B, G, Q, Q).contiguous()
    q_Q = torch.arange(Q, device=base_BQN.device)
    cand_BQN = meta.reach_BQN & (q_Q[None, :] < q_Q[:, None]) & ~base_BQN
    qm_BKRQD = block_mean(q_BHSD, meta).view(B, K, H // K, Q, -1)
    if G == K:  # a group's score is the mean of its heads' scores = the score of the mean query
        qm_BKRQD = qm_BKRQD.mean(2, keepdim=True)
    km_BKND = block_mean(k_BKSD, meta)
    score_BGQN = torch.einsum("bkrqd,bknd->bkrqn", qm_BKRQD, km_BKND).reshape(B, G, Q, Q)
    score_BGQN = score_BGQN.masked_fill(~cand_BQN[:, None], float("-inf"))
    val_BGQT, idx_BGQT = score_BGQN.topk(min(cfg.top_k, Q), dim=-1)
    picked_BGQN = torch.zeros_like(cand_BQN[:, None].expand(B, G, Q, Q))
    picked_BGQN = picked_BGQN.scatter(-1, idx_BGQT, val_BGQT > float("-inf"))
    return base_BQN[:, None] | picked_BGQN
