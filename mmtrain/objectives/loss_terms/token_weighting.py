"""Token reliance weighting (`loss.token_weighting`; objectives/token_weighting.py): a blank-media
forward before the training forward, then the media tasks' losses reweighted (no loss of its own).
At dist.pp > 1 the pipeline runs the blank forwards through its stages (loop/pipeline_step.py) and
hands each micro-batch its blank CE (and a row part its batch's reliance sums) in `mb.held`."""

from __future__ import annotations

import torch

from mmtrain.objectives.heads import head_weight
from mmtrain.objectives.loss_terms.base import MicroBatch, Reported, Term, register
from mmtrain.objectives.terms import MEDIA_TASK_IDS, TaskLosses, reliance_sums
from mmtrain.objectives.token_weighting import TokenWeighting, TokenWeightingConfig, TokenWeightingSums
from mmtrain.parallel.distributed import all_reduce


@register
class TokenWeightingTerm(Term):
    name = "token_weighting"
    Config = TokenWeightingConfig
    Sums = TokenWeightingSums

    def __init__(self, obj):
        super().__init__(obj)
        self.tw = TokenWeighting(self.cfg, obj.model, obj.device, obj.autocast, obj.pad_batch,
                                 obj.cfg.dist.strategy == "fsdp", obj.cfg.loss.ce_chunk,
                                 lambda: head_weight(obj.raw_model), context=obj.context)

    @classmethod
    def enabled(cls, loss_cfg) -> bool:
        return bool(loss_cfg.token_weighting.strength)

    def before_forward(self, mb: MicroBatch) -> None:
        # first, so that its activations are gone before the training graph's; under cp / tp it
        # reads the whole rows (the model does) and gives this rank's chunk, as mb.batch
        if self.obj.pp > 1:  # the pipeline's frozen passes fill mb.held
            return
        rows = mb.batch if mb.whole is None else mb.whole
        mb.held[self.name] = self.tw.blank_ce(rows, mb.counts_T, mb.sums.token_weighting)

    def reweight(self, mb: MicroBatch, losses: TaskLosses) -> TaskLosses:
        blank_BS, totals = mb.held.pop(self.name, None), mb.held.pop("reliance_sums", None)
        obj = self.obj
        if totals is None and obj.env.distributed:  # (a pipeline's come with the micro-batch)
            # the per-task reliance means over the global batch, as one process's: every rank joins
            # (zeros where it has no media row); a row's cp / tp chunks hold distinct tokens
            batch = mb.batch
            totals = (torch.zeros(2, len(MEDIA_TASK_IDS), dtype=torch.float64, device=obj.device)
                      if blank_BS is None else reliance_sums(losses.ce_BS.detach(), blank_BS, batch.labels_BS,
                                                             batch.task_BS, self.cfg.floor))
            totals = all_reduce(totals, obj.env)
        return losses if blank_BS is None else self.tw.reweight(losses, blank_BS, mb.batch,
                                                                mb.sums.token_weighting, totals)

    @classmethod
    def report(cls, loss_cfg, total, accum: int, world: int, rep: Reported) -> None:
        rep.figures["token_weighting"] = total.token_weighting.figures(world)

