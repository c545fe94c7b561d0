"""Masked-patch reconstruction in the vision encoder (`loss.visual_ssl`; needs model.vision.ssl_head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrain.checks import check
from mmtrain.models.vision import make_ssl_mask
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, at_least_one, register
from mmtrain.objectives.terms import row_media


@dataclass
class VisualSSLConfig:
    """Masked-patch reconstruction in the vision encoder (needs model.vision.ssl_head: true): a second
    encoder pass over `media_share` of each batch's media with `mask_ratio` of their patches hidden."""

    weight: float = 0.0  # 0: off
    mask_ratio: float = 0.5
    media_share: float = 0.25

    def __post_init__(self):
        check(self, "weight", ge=0)
        check(self, "mask_ratio", gt=0, lt=1)
        check(self, "media_share", gt=0, le=1)


@register
class VisualSSL(Term):
    name = "visual_ssl"
    Config = VisualSSLConfig
    Sums = float  # the masked-patch loss, summed over micro-batches

    def before_forward(self, mb: MicroBatch) -> None:
        mb.kwargs["ssl_mask_N"] = self._mask(mb)

    def row_count(self, mb: MicroBatch) -> torch.Tensor:
        """Masked patches of this rank's batch (a row part: its batch's): the mean's divisor."""
        return mb.held[self.name][1]

    def loss(self, mb: MicroBatch) -> torch.Tensor | None:
        mine, _ = mb.held.pop(self.name)
        if mb.out.visual_ssl is None:
            return None
        # the forward's mean x its masked patches over the global batch's: the data-parallel ranks'
        # terms add up to one process's mean; the ranks of a row's cp x tp group encode the same
        # media (the same mask), so each adds 1 / (cp x tp) of it
        seq = self.obj.cfg.dist.cp * self.obj.cfg.dist.tp
        ssl = mb.out.visual_ssl * mine / at_least_one(mb.row_counts[self.name]) / seq
        mb.sums.visual_ssl += ssl.detach().double()  # a tensor: read at the step's end
        return self.cfg.weight * ssl

    def _mask(self, mb: MicroBatch) -> torch.Tensor:
        """Which patches the term hides: a pure function of (seed, step, data-parallel rank, batch),
        so the ranks of a cp group, which encode the same media, hide the same ones. A pipeline's
        row part of a batch hides the batch's mask's patches of its rows (one process's). Its
        masked count and its batch's -> mb.held."""
        if mb.share_of is None:
            mask_N = self._batch_mask(mb.batch)
            n = mask_N.sum()
            mb.held[self.name] = (n, n)
            return mask_N
        whole_N = self._batch_mask(mb.share_of)
        rows_R = torch.arange(mb.share_rows.start, mb.share_rows.stop, device=whole_N.device)
        mask_N = whole_N[row_media(mb.share_of, rows_R)[1]]
        mb.held[self.name] = (mask_N.sum(), whole_N.sum())
        return mask_N

    def _batch_mask(self, batch) -> torch.Tensor:
        obj = self.obj
        gen = torch.Generator().manual_seed(hash((obj.cfg.train.seed, obj.step, obj.dp_rank,
                                                  batch.patches_NP.shape[0])) % 2**63)
        mask_N = make_ssl_mask(batch.grid_thw_M3.cpu(), self.cfg.mask_ratio, self.cfg.media_share, gen)
        return mask_N.to(obj.device)

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        # the ranks' shares add up to the step's mean
        rep.terms["visual_ssl"] = total.visual_ssl / accum if loss_cfg.visual_ssl.weight else None
