"""The model's auxiliary losses (MoE sequence balance, router z-loss): always on when the model has
them; means over rows / token slots, so each rank adds its share 1 / world, and each of a pipeline's
equal row parts of a batch (`mb.shares`) its share of that (the batch's mean when every row has a
token of each expert group: a row without any counts in no part's mean, as in one process's)."""

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
        n = mb.world * mb.shares
        return [aux / n if n > 1 else aux for aux in mb.out.aux_losses.values()]
