"""The model's auxiliary losses (MoE sequence balance, router z-loss): always on when the model has
them; means over rows / tokens, so each rank adds its share 1 / world."""

from __future__ import annotations

import torch

from mmtrain.objectives.loss_terms.base import MicroBatch, Term, register


@register
class MoEAux(Term):
    name = "moe_aux"

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return True

    def loss(self, mb: MicroBatch) -> list[torch.Tensor]:
        return [aux / mb.world if mb.world > 1 else aux for aux in mb.out.aux_losses.values()]
