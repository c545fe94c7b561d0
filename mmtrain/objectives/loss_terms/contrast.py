"""The mismatch contrast (`loss.contrast`; objectives/contrast.py): swapped-media copies of the media
rows ride in the training forward as extra rows; the hinge on the documents' CE gaps."""

from __future__ import annotations

import torch

from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.objectives.contrast import (
    ContrastConfig,
    ContrastRows,
    ContrastSums,
    contrast_term,
    document_count,
    extend,
    part_rows,
)
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, at_least_one, register
from mmtrain.objectives.terms import cat_rows


@register
class Contrast(Term):
    name = "contrast"
    Config = ContrastConfig
    Sums = ContrastSums

    def __init__(self, obj):
        super().__init__(obj)
        self._step_batch, self._step = None, None  # a pipeline's batch: (extended, rows, documents)

    def before_forward(self, mb: MicroBatch) -> None:
        # under cp / tp the copies are made of the whole rows (the model reads whole rows) and the
        # labels narrowed to this rank's chunk, as the batch's own (objective.prepare)
        extended, rows, n_docs = self._extend(mb)
        mb.held[self.name] = (extended, rows, n_docs)
        if rows is None:
            return
        c, labels_BS = self.obj.context, extended.labels_BS
        mb.inputs = extended.model_inputs()
        mb.labels_BS = labels_BS if c is None else c.local(labels_BS)
        mask_N = mb.kwargs.get("ssl_mask_N")
        if mask_N is not None:  # the copies' patches are never masked
            extra_N = extended.patches_NP.shape[0] - mask_N.shape[0]
            mb.kwargs["ssl_mask_N"] = torch.cat([mask_N, mask_N.new_zeros(extra_N)])

    def _extend(self, mb: MicroBatch) -> tuple[PackedBatch, ContrastRows | None, int]:
        """(the forward's rows, its ContrastRows or None, this rank's batch's contrasted documents).
        A pipeline's row part of a batch (`mb.share_of`): the batch extended whole, once (its
        donors), and this part's rows with their copies; one process's forward (`mb.ref`) and
        document count are the batch's."""
        own = mb.batch if mb.whole is None else mb.whole
        donors = self.obj.donors
        if mb.share_of is None:
            extended, rows = extend(own, donors)
            return extended, rows, 0 if rows is None else document_count(rows)
        if self._step_batch is not mb.share_of:  # the batch's first part: extended and counted once
            extended, rows = extend(mb.share_of, donors)
            self._step_batch = mb.share_of
            self._step = (extended, rows, 0 if rows is None else document_count(rows))
        extended, rows, n_docs = self._step
        if rows is None:
            return own, None, 0
        mb.ref = extended.model_inputs()
        copies, mine = part_rows(extended, rows, mb.share_rows.start, mb.share_rows.stop)
        return (own, None, n_docs) if mine is None else (cat_rows(own, copies), mine, n_docs)

    def row_count(self, mb: MicroBatch) -> int:
        return mb.held[self.name][2]

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        extended, rows, _ = mb.held.pop(self.name)
        if rows is None:
            return None
        ce_swap_RS, _ = mb.head.ce(mb.rows, extended.labels_BS.shape[0])
        c = self.obj.context  # cp / tp: this rank's chunk of the rows, the hinge the group's
        n_docs = at_least_one(mb.row_counts[self.name])  # the global batch's documents
        term = contrast_term(mb.losses.ce_BS, ce_swap_RS, rows, self.cfg.margin, mb.sums.contrast, c, n_docs)
        # cp / tp: every rank of the group holds the hinge's value, its gradient through its own tokens
        # only: a value share of 1 / size, the gradient whole (each rank's tokens' part of it)
        size = 1 if c is None else c.comm.size
        mb.sums.contrast.term += term.detach().double() / size
        return self.cfg.weight * (term if size == 1 else (size * term - (size - 1) * term.detach()) / size)

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        if loss_cfg.contrast.weight:  # the step's mean hinge (before the weight)
            rep.terms["contrast"] = total.contrast.term / accum  # the ranks' shares add up
        rep.figures["contrast_stats"] = total.contrast.figures()
