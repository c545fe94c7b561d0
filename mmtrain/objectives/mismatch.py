"""Media swapped across documents: the in-distribution counterfactual of the mismatch gap
(evaluation.evaluate) and of the mismatch contrast (objectives.contrast).

Legend: B rows, S tokens, M media, N patches.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from mmtrain.data_pipelines.batch import PackedBatch


def document_keys(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) int64: each token's document as one number, unique across rows (row * (S + 1) + doc
    id: doc ids index the row's documents, so < S; padding, doc id -1, gets a key no document of any
    row has). Keys keep the (row, doc id) order. No host sync (the span is S + 1, not the max id)."""
    B, S = doc_ids_BS.shape
    span = S + 1
    row_BS = torch.arange(B, device=doc_ids_BS.device)[:, None].expand(B, S)
    return row_BS * span + doc_ids_BS.long()


def mismatch_media(batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """The batch with each document's media replaced by real media of other documents, and the
    (B, S) bool mask of the tokens of the documents that received at least one foreign medium.

    A document is (row, doc id). Media are grouped by (kind, t, h, w), so every patch block keeps its
    size and the token layout (placeholders, positions, spans) is unchanged. Within a group ordered by
    document (then medium index), a medium takes the pixels of the medium n//2 places further on
    (cyclically) when no document holds more than half of the group's n media: a permutation of the
    group's blocks that never pairs two media of one document. Otherwise (one document holds most of
    the group) medium j of the k-th document takes medium j mod n' of the (k+1)-th document (n' its
    media; cyclically): media repeat, but still never come from the own document. A group whose media
    all belong to one document, and a medium without visual tokens, keep their own pixels (and count
    for no document). Deterministic: no random numbers.
    """
    B, S = batch.doc_ids_BS.shape
    swapped_BS = torch.zeros(B, S, dtype=torch.bool, device=batch.doc_ids_BS.device)
    if batch.media_kind_M.shape[0] == 0:
        return batch, swapped_BS
    doc_M = media_documents(batch)
    grids = [tuple(g) for g in batch.grid_thw_M3.tolist()]
    source_M = media_sources(doc_M, batch.media_kind_M.tolist(), grids)
    moved = {doc_M[m] for m, src in enumerate(source_M) if src != m}
    if not moved:
        return batch, swapped_BS
    index_N = torch.cat([block for _, block in media_blocks(batch.grid_thw_M3, source_M)])
    return (replace(batch, patches_NP=batch.patches_NP[index_N.to(batch.patches_NP.device)]),
            swapped_tokens(batch, moved))


def media_documents(batch: PackedBatch) -> list[int]:
    """Each medium's document key (`document_keys`, from its placeholders); -1: no visual tokens."""
    key_BS = document_keys(batch.doc_ids_BS)
    visual_BS = (batch.media_ids_BS >= 0) & (batch.doc_ids_BS >= 0)
    doc_M = torch.full((batch.media_kind_M.shape[0],), -1, dtype=torch.long, device=key_BS.device)
    return doc_M.scatter_(0, batch.media_ids_BS[visual_BS].long(), key_BS[visual_BS]).tolist()


def media_sources(doc_M: list[int], kinds: list[int], grids: list[tuple]) -> list[int]:
    """medium -> the medium whose pixels it takes (itself: kept), grouped by (kind, grid) (see
    mismatch_media). A pure function of the media's documents, kinds and grids: the same list over
    all of a global batch's media gives every data rank one process's donors (contrast_donors.py)."""
    groups: dict[tuple, list[int]] = {}
    for m, doc in enumerate(doc_M):
        if doc >= 0:
            groups.setdefault((kinds[m], *grids[m]), []).append(m)
    source_M = list(range(len(doc_M)))
    for members in groups.values():
        for m, src in _cross_document_sources(members, doc_M).items():
            source_M[m] = src
    return source_M


def media_blocks(grid_thw_M3: torch.Tensor, media: list[int]) -> list[tuple[int, torch.Tensor]]:
    """[(medium, its patch indices)] for `media` (indices into the batch's media, any order)."""
    sizes_M = grid_thw_M3.long().prod(-1).tolist()
    starts_M = [0, *itertools.accumulate(sizes_M)]
    return [(m, torch.arange(starts_M[m], starts_M[m] + sizes_M[m])) for m in media]


def swapped_tokens(batch: PackedBatch, docs: set[int]) -> torch.Tensor:
    """(B, S) bool: the tokens of the documents `docs` (keys: those with a medium from elsewhere)."""
    key_BS = document_keys(batch.doc_ids_BS)
    docs_D = torch.tensor(sorted(docs), dtype=torch.long, device=key_BS.device)
    return torch.isin(key_BS, docs_D) & (batch.doc_ids_BS >= 0)


def _cross_document_sources(members: list[int], doc_M: list[int]) -> dict[int, int]:
    """medium -> the medium whose pixels it takes, within one (kind, grid) group (see mismatch_media)."""
    by_doc: dict[int, list[int]] = {}
    for m in sorted(members, key=lambda m: (doc_M[m], m)):
        by_doc.setdefault(doc_M[m], []).append(m)
    if len(by_doc) < 2:
        return {}
    n, blocks = len(members), list(by_doc.values())
    if max(len(b) for b in blocks) <= n // 2:
        order = [m for b in blocks for m in b]
        return {m: order[(i + n // 2) % n] for i, m in enumerate(order)}
    out = {}
    for k, block in enumerate(blocks):
        donor = blocks[(k + 1) % len(blocks)]
        out.update({m: donor[j % len(donor)] for j, m in enumerate(block)})
    return out
