"""The mismatch contrast (`loss.contrast`; objectives/contrast.py): swapped-media copies of the media
rows ride in the training forward as extra rows; the hinge on the documents' CE gaps."""

from __future__ import annotations

import torch

from mmtrain.objectives.contrast import ContrastConfig, ContrastSums, contrast_term, extend
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, register


@register
class Contrast(Term):
    name = "contrast"
    Config = ContrastConfig
    Sums = ContrastSums

    def before_forward(self, mb: MicroBatch) -> None:
        self._extended, self._rows = extend(mb.batch)
        if self._rows is None:
            return
        mb.inputs, mb.labels_BS = self._extended.model_inputs(), self._extended.labels_BS
        mask_N = mb.kwargs.get("ssl_mask_N")
        if mask_N is not None:  # the copies' patches are never masked
            extra_N = self._extended.patches_NP.shape[0] - mask_N.shape[0]
            mb.kwargs["ssl_mask_N"] = torch.cat([mask_N, mask_N.new_zeros(extra_N)])

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        rows, self._rows = self._rows, None
        if rows is None:
            return None
        ce_swap_RS, _ = mb.head.ce(mb.rows, self._extended.labels_BS.shape[0])
        term = contrast_term(mb.losses.ce_BS, ce_swap_RS, rows, self.cfg.margin, mb.sums.contrast)
        return self.cfg.weight * term / mb.world  # a mean per rank, as visual_ssl

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        if loss_cfg.contrast.weight:  # the step's mean hinge (before the weight)
            rep.terms["contrast"] = total.contrast.term / (accum * world)
        rep.figures["contrast_stats"] = total.contrast.figures()
