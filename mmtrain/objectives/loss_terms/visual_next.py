"""Next visual token prediction on the decoder's visual positions (`loss.visual_next`; needs
model.visual_head: models/visual_next.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrain.checks import check
from mmtrain.models.visual_next import chunk_pairs, target_count
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, at_least_one, register
from mmtrain.objectives.terms import visual_next_loss


@dataclass
class VisualNextConfig:
    """Next visual token prediction on the decoder's visual positions (needs model.visual_head: true;
    models/visual_next.py): each visual token regresses the pixels of the next merged token of its
    medium from the decoder's final hidden state, so every medium gives targets that only its pixels
    can meet, whatever its caption says."""

    weight: float = 0.0  # 0: off
    normalize: bool = True  # each target token to mean 0 / variance 1 over its values (as MAE)

    def __post_init__(self):
        check(self, "weight", ge=0)


@register
class VisualNext(Term):
    name = "visual_next"
    Config = VisualNextConfig
    Sums = float  # the pixel loss, summed over micro-batches

    def before_forward(self, mb: MicroBatch) -> None:
        mb.kwargs["visual_next"] = True

    def row_count(self, mb: MicroBatch) -> int:
        """Target values of the forward's media (with the contrast, the copies'; a pipeline's row
        part: its batch's, `mb.ref`): the mean's divisor, summed over the data-parallel ranks."""
        vision = self.obj.cfg.model.vision
        grid_M3 = (mb.inputs if mb.ref is None else mb.ref)["grid_thw_M3"]
        return target_count(grid_M3, vision.merge, vision.merge ** 2 * vision.patch_dim)

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        if mb.out.visual_next_KT is None:
            return None
        # this rank's squared errors (its chunk's under cp / tp) over the global count: the ranks'
        # terms add up to one process's mean over the global batch
        vn = self._term(mb.out.visual_next_KT, mb.inputs, at_least_one(mb.row_counts[self.name]))
        mb.sums.visual_next += vn.detach().double()
        return self.cfg.weight * vn

    def _term(self, pred_KT: torch.Tensor, inputs: dict, count) -> torch.Tensor:
        """Context parallelism: the pairs of this rank's chunk of the rows (`chunk_pairs`)."""
        merge, c = self.obj.cfg.model.vision.merge, self.obj.context
        keep_K = None if c is None else chunk_pairs(inputs["modality_BS"], inputs["grid_thw_M3"], merge,
                                                    c.lo, c.hi)[2]
        return visual_next_loss(pred_KT, inputs["patches_NP"], inputs["grid_thw_M3"], merge,
                                self.cfg.normalize, keep_K, count)

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        on = loss_cfg.visual_next.weight
        rep.terms["visual_next"] = total.visual_next / accum if on else None  # the ranks' shares add up
