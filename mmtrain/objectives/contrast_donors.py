"""The mismatch contrast's donors drawn from the global batch under data parallelism.

One process swaps each document's media for other documents' among all the rows of its forward
(`mismatch.mismatch_media`); a data-parallel rank holds only its share of those rows. So that every
rank swaps exactly what one process holding the global batch would, the ranks of one data-parallel
group (the ranks of one (pp, cp, tp) coordinate: they hold distinct rows) exchange their media rows'
media lists -- each medium's document, kind and grid, a few numbers (`all_gather_object`) -- and
each plans the whole batch's donors (`mismatch.media_sources` on the lists in rank order, the order
one process's rows have), then the chosen media's patches travel from the rank holding them in one
all-to-all (a rank receives as many patches as its own swapped media hold, at most its media's).
Every rank of the group joins both collectives at every micro-batch, with or without media rows.

    donors = DonorExchange(group)          # None: one data rank, nothing to exchange
    copy, swapped_BS = donors.mismatch_media(media_rows)   # = mismatch_media on one process's rows

Legend: B rows, S tokens, M media, N patches, P patch values.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.objectives.mismatch import media_blocks, media_documents, media_sources, swapped_tokens
from mmtrain.parallel.comm import all_to_all_single


class DonorExchange:
    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def mismatch_media(self, rows: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
        """`rows` (this rank's media rows) with each document's media swapped as one process swaps
        them over the group's rows in rank order, and the (B, S) mask of the swapped documents."""
        B, S = rows.doc_ids_BS.shape
        doc_M = media_documents(rows) if rows.media_kind_M.shape[0] else []
        mine = (B, doc_M, rows.media_kind_M.tolist(), [tuple(g) for g in rows.grid_thw_M3.tolist()])
        ranks: list = [None] * self.size
        dist.all_gather_object(ranks, mine, group=self.group)
        # one process's keys: row (counted over the earlier ranks' rows) x (S + 1) + doc id
        docs, kinds, grids, owner, first, row0 = [], [], [], [], [], 0
        for q, (rows_q, doc_q, kinds_q, grids_q) in enumerate(ranks):
            first.append(len(docs))
            docs += [d + row0 * (S + 1) if d >= 0 else -1 for d in doc_q]
            kinds, grids, owner = kinds + kinds_q, grids + grids_q, owner + [q] * len(doc_q)
            row0 += rows_q
        source = media_sources(docs, kinds, grids)
        base = first[self.rank]
        moved = {doc_M[m] for m in range(len(doc_M)) if source[base + m] != base + m}
        swapped_BS = (swapped_tokens(rows, moved) if moved
                      else torch.zeros(B, S, dtype=torch.bool, device=rows.doc_ids_BS.device))
        patches_NP = self._fetch(rows, source, owner, first, grids)
        return replace(rows, patches_NP=patches_NP), swapped_BS

    def _fetch(self, rows: PackedBatch, source: list[int], owner: list[int], first: list[int],
               grids: list[tuple]) -> torch.Tensor:
        """This rank's media's patches from their sources: its own, or received in one all-to-all
        (each rank sends, per peer, the patches of its media that the peer's media take, in the
        peer's media order; every rank computes the same plan from the gathered lists)."""
        me, P = self.rank, rows.patches_NP.shape[-1]
        ends = [*first[1:], len(source)]
        size = [t * h * w for t, h, w in grids]
        send = [[source[g] - first[me] for g in range(first[q], ends[q]) if owner[source[g]] == me]
                for q in range(self.size)]
        send[me] = []
        own = dict(media_blocks(rows.grid_thw_M3, list(range(ends[me] - first[me]))))  # patch indices
        out_parts = [rows.patches_NP[own[m].to(rows.patches_NP.device)] for s in send for m in s]
        in_P = [sum(size[first[me] + m] for m in s) for s in send]
        out_P = [sum(size[source[g]] for g in range(first[me], ends[me]) if owner[source[g]] == q)
                 if q != me else 0 for q in range(self.size)]
        sent_NP = torch.cat(out_parts) if out_parts else rows.patches_NP.new_zeros(0, P)
        got_NP = rows.patches_NP.new_empty(sum(out_P), P)
        all_to_all_single(got_NP, sent_NP.contiguous(), out_P, in_P, self.group)
        # this rank's media in order: its own source's patches, or the next block from its owner
        got = got_NP.split(out_P)  # per peer
        taken = [0] * self.size
        parts = []
        for g in range(first[me], ends[me]):
            q, s = owner[source[g]], source[g]
            if q == me:
                parts.append(rows.patches_NP[own[s - first[me]].to(rows.patches_NP.device)])
            else:
                parts.append(got[q][taken[q]:taken[q] + size[s]])
                taken[q] += size[s]
        return torch.cat(parts) if parts else rows.patches_NP


def donor_exchange(dims) -> DonorExchange | None:
    """This rank's exchange over the data-parallel ranks of its (pp, cp, tp) coordinate; None with
    one data rank. Every rank calls it (new_group is collective: every group, in one order)."""
    if dims.dp_size == 1:
        return None
    mine = None
    for p in range(dims.pp):
        for c in range(dims.cp):
            for t in range(dims.tp):
                ranks = [dims.rank_of(d, c, t, p) for d in range(dims.dp_size)]
                group = dist.new_group(ranks)
                mine = group if dims.rank in ranks else mine
    return DonorExchange(mine)
