"""Per-forward attention metadata: token ids, the token rule, and block-level summaries.

The token rule (every backend computes exactly this): query i may attend key j iff
    doc[i] == doc[j]  and  (j <= i  or  (span[i] == span[j] and span[i] >= 0)).
Block-level summaries are computed once per forward (`build_meta`) and reused by every layer.
Documents and spans are assumed to be contiguous runs (what the packer writes); if they are not,
the block summaries are supersets, which never changes the function (the token rule is always
applied on top), only how many blocks are visited.

Legend: B batch rows, S tokens, P = Q * Bs tokens padded to whole blocks, Q query blocks,
N key blocks (N == Q), Bs block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


def token_mask(doc_q: Tensor, span_q: Tensor, pos_q: Tensor, doc_k: Tensor, span_k: Tensor,
               pos_k: Tensor) -> Tensor:
    """The token rule, broadcasting over any shapes."""
    return (doc_q == doc_k) & ((pos_k <= pos_q) | ((span_q == span_k) & (span_q >= 0)))


@dataclass
class AttnMeta:
    block_size: int  # Bs
    seq_len: int  # S (unpadded)
    num_blocks: int  # Q == N == ceil(S / Bs)
    doc_BP: Tensor  # int64 document id; padding positions get a value no real token has
    span_BP: Tensor  # int64 span id, -1 for text and block padding
    skey_BP: Tensor  # int64 span key: >= 0 one id per (doc, span) for visual tokens, -(pos+1) for the rest
    count_Q: Tensor  # float32 real tokens per block (Bs, the last one maybe fewer)
    same_doc_BQN: Tensor  # bool: the two blocks share a document
    reach_BQN: Tensor  # bool: same_doc and (n <= q or closure) -- some allowed (i, j) pair may exist
    closure_BQN: Tensor  # bool: n holds part of a visual span that has a token in q
    sink_BQN: Tensor  # bool: n holds the first token of a document that has a token in q
    visual_BQN: Tensor  # bool: n holds a visual token of a document present in q
    full_BQN: Tensor  # bool: every (i in q, j in n) pair is allowed (n < q, one doc, no padding)
    has_spans: bool  # any visual token in the batch (flash cannot do bidirectional spans)
    docs_contiguous: bool  # every document is one run of tokens (flash's cu_seqlens need it)
    # Per-forward cache of what every full layer shares (gather index lists, flex BlockMask).
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return self.doc_BP.shape[0]

    @property
    def padded_len(self) -> int:
        return self.num_blocks * self.block_size


def _group_extent(b_T: Tensor, ids_T: Tensor, pos_T: Tensor, ids2_T: Tensor | None = None):
    """Per token: first and last position of its group (b, id[, id2]) -- works for any ids."""
    key_TC = torch.stack([b_T, ids_T] + ([ids2_T] if ids2_T is not None else []), dim=-1)
    _, inv_T = torch.unique(key_TC, dim=0, return_inverse=True)
    n = int(inv_T.max()) + 1 if inv_T.numel() else 0
    first_U = torch.full((n,), 2**62, dtype=torch.long, device=pos_T.device)
    last_U = torch.full((n,), -1, dtype=torch.long, device=pos_T.device)
    first_U = first_U.scatter_reduce(0, inv_T, pos_T, "amin")
    last_U = last_U.scatter_reduce(0, inv_T, pos_T, "amax")
    return first_U[inv_T], last_U[inv_T]


@torch.no_grad()
def build_meta(doc_ids_BS: Tensor, span_ids_BS: Tensor, block_size: int) -> AttnMeta:
    """Build the metadata once per forward; every layer (and every backend) reuses it."""
    if doc_ids_BS.shape != span_ids_BS.shape or doc_ids_BS.dim() != 2:
        raise ValueError(f"doc_ids/span_ids: need equal (B, S) shapes (got {tuple(doc_ids_BS.shape)} "
                         f"and {tuple(span_ids_BS.shape)})")
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1 (got {block_size})")
    dev = doc_ids_BS.device
    B, S = doc_ids_BS.shape
    Bs = block_size
    Q = -(-S // Bs)
    P = Q * Bs
    doc_BS, span_BS = doc_ids_BS.long(), span_ids_BS.long()
    pad_doc = doc_BS.amin() - 1  # a tensor: no host sync
    doc_BP = torch.cat([doc_BS, pad_doc.expand(B, P - S)], dim=1)
    span_BP = torch.cat([span_BS, span_BS.new_full((B, P - S), -1)], dim=1)
    real_P = torch.arange(P, device=dev) < S
    count_Q = real_P.view(Q, Bs).sum(-1).float()

    # Document range of each block (real tokens only).
    big = torch.iinfo(torch.long).max
    lo_BQ = doc_BP.masked_fill(~real_P, big).view(B, Q, Bs).amin(-1)
    hi_BQ = doc_BP.masked_fill(~real_P, -big).view(B, Q, Bs).amax(-1)
    same_doc_BQN = (lo_BQ[:, :, None] <= hi_BQ[:, None, :]) & (lo_BQ[:, None, :] <= hi_BQ[:, :, None])
    q_Q = torch.arange(Q, device=dev)
    causal_QN = q_Q[None, :] <= q_Q[:, None]

    b_BS = torch.arange(B, device=dev)[:, None].expand(B, S)
    pos_BS = torch.arange(S, device=dev)[None, :].expand(B, S)
    qblk_BS = pos_BS // Bs
    flat_q_BS = b_BS * Q + qblk_BS  # index of (b, query block)

    # Sink: the block holding the first token of every document present in the query block.
    first_BS, _ = _group_extent(b_BS.reshape(-1), doc_BS.reshape(-1), pos_BS.reshape(-1))
    run_start_BS = torch.ones_like(doc_BS, dtype=torch.bool)
    run_start_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    docs_contiguous = bool((run_start_BS.reshape(-1) == (first_BS == pos_BS.reshape(-1))).all())
    sink_BQN = torch.zeros(B * Q * Q, dtype=torch.bool, device=dev)
    sink_BQN[flat_q_BS.reshape(-1) * Q + first_BS // Bs] = True
    sink_BQN = sink_BQN.view(B, Q, Q)

    # Closure: the blocks holding the rest of every visual span present in the query block.
    vis_BS = span_BS >= 0
    lo_BQ_span = torch.full((B * Q,), Q, dtype=torch.long, device=dev)
    hi_BQ_span = torch.full((B * Q,), -1, dtype=torch.long, device=dev)
    # Span key: the token rule is doc[i] == doc[j] and (j <= i or skey[i] == skey[j]).
    skey_BP = -torch.arange(1, P + 1, device=dev)[None].repeat(B, 1)
    if bool(vis_BS.any()):
        first_V, last_V = _group_extent(b_BS[vis_BS], doc_BS[vis_BS], pos_BS[vis_BS], span_BS[vis_BS])
        skey_BP[:, :S][vis_BS] = first_V  # the span's first position: unique per (row, doc, span)
        lo_BQ_span = lo_BQ_span.scatter_reduce(0, flat_q_BS[vis_BS], first_V // Bs, "amin")
        hi_BQ_span = hi_BQ_span.scatter_reduce(0, flat_q_BS[vis_BS], last_V // Bs, "amax")
    closure_BQN = (q_Q >= lo_BQ_span.view(B, Q, 1)) & (q_Q <= hi_BQ_span.view(B, Q, 1))
    vis_BP = span_BP >= 0
    vlo_BN = doc_BP.masked_fill(~vis_BP, big).view(B, Q, Bs).amin(-1)
    vhi_BN = doc_BP.masked_fill(~vis_BP, -big).view(B, Q, Bs).amax(-1)
    visual_BQN = (vlo_BN[:, None, :] <= hi_BQ[:, :, None]) & (lo_BQ[:, :, None] <= vhi_BN[:, None, :])

    reach_BQN = same_doc_BQN & (causal_QN | closure_BQN)
    uniform_BQ = (lo_BQ == hi_BQ) & (count_Q == Bs)
    full_BQN = (uniform_BQ[:, :, None] & uniform_BQ[:, None, :] & (lo_BQ[:, :, None] == lo_BQ[:, None, :])
                & (q_Q[None, :] < q_Q[:, None]))
    return AttnMeta(
        block_size=Bs, seq_len=S, num_blocks=Q, doc_BP=doc_BP, span_BP=span_BP, skey_BP=skey_BP,
        count_Q=count_Q,
        same_doc_BQN=same_doc_BQN, reach_BQN=reach_BQN, closure_BQN=closure_BQN, sink_BQN=sink_BQN,
        visual_BQN=visual_BQN, full_BQN=full_BQN, has_spans=bool(vis_BS.any()),
        docs_contiguous=docs_contiguous,
    )
