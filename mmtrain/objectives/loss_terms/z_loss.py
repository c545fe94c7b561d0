"""z-loss (`loss.z_loss`, a weight, no section): z_loss * mean lse^2 over trained tokens; in a
distributed run scaled to this rank's share of the global trained tokens, so the ranks add up."""

from __future__ import annotations

import torch

from mmtrain.objectives.loss_terms.base import MicroBatch, Term, register
from mmtrain.objectives.terms import z_loss_of


@register
class ZLoss(Term):
    name = "z_loss"

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return bool(loss_cfg.z_loss)

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        batch = mb.batch
        z = z_loss_of(mb.head.lse(0, mb.rows), batch.labels_BS)
        if mb.counts_T is not None:  # exact in f32 as tokens < 2^24 (a python float did the same)
            z = z * (batch.loss_mask_BS.sum() / mb.counts_T[-1].clamp(min=1.0)).float()
        return self.obj.cfg.loss.z_loss * z
