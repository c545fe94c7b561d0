"""Next visual token prediction on the decoder's visual positions (`loss.visual_next`; needs
model.visual_head: models/visual_next.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrain.checks import check
from mmtrain.models.visual_next import chunk_pairs, target_count
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, register
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

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        if mb.out.visual_next_KT is None:
            return None
        # a mean over this rank's predicted tokens (the forward's media: with the contrast, the copies')
        # a part of one process's forward (a pipeline's row part, `mb.ref`): its squared errors over
        # that forward's count, so the parts add up
        pred_KT = mb.out.visual_next_KT
        count = None if mb.ref is None else target_count(
            mb.ref["grid_thw_M3"], self.obj.cfg.model.vision.merge, pred_KT.shape[-1])
        vn = self._term(pred_KT, mb.inputs, count)
        mb.sums.visual_next += vn.detach().double()
        return self.cfg.weight * vn / mb.world

    def _term(self, pred_KT: torch.Tensor, inputs: dict, count: int | None = None) -> torch.Tensor:
        """Context parallelism: its chunk's squared errors over the group's count, times the group
        size -- so that the group's terms over `world` add up to the rows' mean over data-parallel
        ranks, as a mean per rank does without it."""
        merge, c = self.obj.cfg.model.vision.merge, self.obj.context
        keep_K = None if c is None else chunk_pairs(inputs["modality_BS"], inputs["grid_thw_M3"], merge,
                                                    c.lo, c.hi)[2]
        vn = visual_next_loss(pred_KT, inputs["patches_NP"], inputs["grid_thw_M3"], merge,
                              self.cfg.normalize, keep_K, count)
        return vn if c is None else vn * c.comm.size

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        on = loss_cfg.visual_next.weight
        rep.terms["visual_next"] = total.visual_next / (accum * world) if on else None
