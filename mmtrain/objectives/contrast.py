"""The mismatch contrast (`loss.contrast`): a term that pays the text for reading its own media.

The rows of a micro-batch that hold media-task trained tokens are copied with each document's media
swapped for other documents' real media of the same kind and grid (`mismatch.mismatch_media`: in
distribution, the mismatch gap's counterfactual), and the copies join the training forward as extra
rows (`terms.cat_rows`; documents never attend across rows, so the batch's own rows are unchanged).
Per document that got a foreign medium, gap_d = the mean over its trained tokens of (CE with the
swapped media - CE with its own media); the term is weight * mean_d relu(margin - gap_d).

Why it can start reading where more weight on the caption loss does not: its gradient is the
own-media gradient minus the swapped-media gradient over the same text, so all that does not depend
on the pixels (the caption's grammar and the text prior, most of a caption's gradient) cancels, and
what is left is how the pixels should change the prediction. The hinge switches a document off once
its text reads its media by `margin` nats a token, so the swapped loss is not pushed up for ever.
Cost: a forward and backward of the copied rows (about the media documents' share of the rows).
The copies are rows of the forward like any other: the MoE's balance term and expert load count them.

Legend: B rows, S tokens, R copied rows, T selected tokens, D documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.models.attention.context import ContextShard
from mmtrain.objectives.mismatch import document_keys, mismatch_media
from mmtrain.objectives.sums import Sums
from mmtrain.objectives.terms import cat_rows, media_tokens, take_rows


@dataclass
class ContrastConfig:
    """The mismatch contrast: `weight` 0 is off (no extra rows)."""

    weight: float = 0.0
    margin: float = 0.2  # nats a token: a document whose gap reaches it adds no gradient

    def __post_init__(self):
        check(self, "weight", ge=0)
        check(self, "margin", gt=0)


@dataclass
class ContrastSums(Sums):
    """Over micro-batches (and, reduced, ranks)."""

    term: float = 0.0  # sum over micro-batches of this rank's share of the mean hinge (before the weight)
    gap: float = 0.0  # sum of the documents' gaps
    docs: float = 0.0  # documents contrasted
    active: float = 0.0  # of them, below the margin (still pushing)

    def figures(self) -> dict[str, float] | None:
        """The step's train-side mismatch gap (mean over documents) and the share still pushing."""
        if not self.docs:
            return None
        return {"train_gap": self.gap / self.docs, "active": self.active / self.docs, "docs": self.docs}


@dataclass
class ContrastRows:
    """Which rows of an extended batch are the swapped copies, and of which rows."""

    rows: int  # B: the batch's own rows, first in the extended batch
    own_R: torch.Tensor  # (R,) the batch row each copy was made from
    selected_RS: torch.Tensor  # (R, S) bool: trained media tokens of documents with a foreign medium
    doc_ids_RS: torch.Tensor  # (R, S) the copies' document ids


def extend(batch: PackedBatch, donors=None) -> tuple[PackedBatch, ContrastRows | None]:
    """`batch` with swapped-media copies of its rows that have something to contrast appended;
    (batch, None) when none has (no media task here, or no medium with a foreign donor). `donors`
    (data parallelism, contrast_donors.py): the donors one process would pick over every data
    rank's rows; every rank joins its collectives, with or without media rows."""
    rows_R = media_tokens(batch.labels_BS, batch.task_BS).any(1).nonzero().squeeze(1)
    if donors is None and not len(rows_R):
        return batch, None
    swap = mismatch_media if donors is None else donors.mismatch_media
    copy, swapped_RS = swap(take_rows(batch, rows_R))
    if not len(rows_R):
        return batch, None
    selected_RS = swapped_RS & media_tokens(copy.labels_BS, copy.task_BS)
    useful_R = selected_RS.any(1)
    if not useful_R.any():
        return batch, None
    if not useful_R.all():  # rows whose documents kept their own media: no forward for them
        keep_R = useful_R.nonzero().squeeze(1)
        copy, rows_R, selected_RS = take_rows(copy, keep_R), rows_R[keep_R], selected_RS[keep_R]
    rows = ContrastRows(batch.labels_BS.shape[0], rows_R, selected_RS, copy.doc_ids_BS)
    return cat_rows(batch, copy), rows


def part_rows(extended: PackedBatch, rows: ContrastRows, lo: int, hi: int
              ) -> tuple[PackedBatch | None, ContrastRows | None]:
    """A pipeline's row part [lo, hi) of a batch `extend`ed whole (so its copies' donors are the
    batch's, as one process's): the copies of those rows and their ContrastRows (own rows numbered
    from lo); (None, None) when none of them has a copy."""
    mine_R = ((rows.own_R >= lo) & (rows.own_R < hi)).nonzero().squeeze(1)
    if not len(mine_R):
        return None, None
    copies = take_rows(extended, rows.rows + mine_R)
    return copies, ContrastRows(hi - lo, rows.own_R[mine_R] - lo, rows.selected_RS[mine_R],
                                rows.doc_ids_RS[mine_R])


def document_count(rows: ContrastRows) -> int:
    """The contrasted documents (those with a selected token: `document_gaps`' D)."""
    return int(torch.unique(document_keys(rows.doc_ids_RS)[rows.selected_RS]).numel())


def document_gaps(ce_real_RS: torch.Tensor, ce_swap_RS: torch.Tensor, rows: ContrastRows,
                  context: ContextShard | None = None) -> torch.Tensor:
    """(D,) per contrasted document: mean over its selected tokens of swapped CE - own CE.

    With `context` the CEs are this rank's chunk [lo, hi) of each row (the copies are rows like any
    other, split where the originals are): the documents are numbered from the whole rows, as on
    every rank of the group; each rank sums its chunk's tokens per document, and the group's sum
    is its value, its gradient flowing into this rank's tokens only (the others' share enters
    detached: each rank backwards its own tokens, the group's gradients add up to the whole row's)."""
    sel_RS = rows.selected_RS
    _, doc_T = torch.unique(document_keys(rows.doc_ids_RS)[sel_RS], return_inverse=True)
    n_D = torch.bincount(doc_T).to(ce_swap_RS.dtype)
    if context is None:
        diff_T = (ce_swap_RS - ce_real_RS)[sel_RS]
        return torch.zeros_like(n_D).index_add_(0, doc_T, diff_T) / n_D
    doc_RS = torch.full(sel_RS.shape, -1, dtype=doc_T.dtype, device=doc_T.device)
    doc_RS[sel_RS] = doc_T
    sel_Rs = sel_RS[:, context.lo:context.hi]
    diff_t = (ce_swap_RS - ce_real_RS)[sel_Rs]
    mine_D = torch.zeros_like(n_D).index_add_(0, doc_RS[:, context.lo:context.hi][sel_Rs], diff_t)
    group_D = context.comm.sum_(mine_D.detach().clone())
    return (mine_D + (group_D - mine_D.detach())) / n_D


def contrast_term(ce_own_BS: torch.Tensor, ce_swap_RS: torch.Tensor, rows: ContrastRows, margin: float,
                  sums: ContrastSums, context: ContextShard | None = None,
                  n_docs=None) -> torch.Tensor:
    """The hinge summed over the contrasted documents over `n_docs` (default theirs: the mean; the
    global batch's documents, so that the ranks' terms add up) with its graph; the step's figures -> sums
    (tensors: read at the step's end). `ce_own_BS`: the batch's own rows' per-token CE, `ce_swap_RS`
    the copies' (both with their graphs; the loss's head gives them, full or chunked). With `context`
    (a row split over cp / tp ranks) the CEs are this rank's chunk: see `document_gaps`."""
    gap_D = document_gaps(ce_own_BS[rows.own_R], ce_swap_RS, rows, context)
    hinge_D = (margin - gap_D).clamp(min=0)
    term = hinge_D.mean() if n_docs is None else hinge_D.sum() / n_docs
    sums.gap += gap_D.detach().sum().double()
    sums.docs += gap_D.shape[0]  # a host number already: torch.unique sized gap_D
    sums.active += (hinge_D > 0).sum().double()
    return term
