"""One training step's micro-batches through a pipeline schedule (dist.pp > 1).

    step = PipelineStep(objective, parts, "1F1B", pp_group, device, accum)
    loss = step.run(batches, sums)   # forward + backward of every micro-batch; -> sum of loss / accum

The micro-batches are the step's gradient-accumulation micro-batches (`train.grad_accum`), in
order, each split into `parts` equal row parts when there are fewer than the schedule needs
(`pipeline.row_parts`: tiny's grad_accum 1 at dist.pp 2 runs 2 micro-batches of 4 of its 8 rows).
A part's terms take their means over its whole batch (`Objective.prepare(share_of=...)`: the
batch's token counts, its visual targets), so the parts' losses add up to the batch's. Every rank
of the pipeline prepares each micro-batch (global token counts, the terms' before_forward hooks:
the same collectives on every rank), the schedule runs the stages, and the
last stage's loss_fn is the objective's `finish` on a ModelOutput built from the stage's output:
the hidden states, the LM head's logits and the MoE auxiliary losses carried across the stages.
The loss_fn returns loss x data_world / accum, which is what the one-process loop backwards
(the schedule does not rescale). Only the last stage adds to the step's sums; the trainer's
whole-world reduce of them gives every rank the same totals, so every stage takes the same
decisions (skip, balancer weights).
"""

from __future__ import annotations

import contextlib
import time

import torch

from mmtrain.data_pipelines.batch import IGNORE_INDEX, PackedBatch
from mmtrain.frozen import frozen_state
from mmtrain.models.multimodal import ModelOutput
from mmtrain.objectives.chunked_ce import head_ce
from mmtrain.objectives.heads import head_weight
from mmtrain.objectives.terms import MEDIA_TASK_IDS, dummy_batch, reliance_sums, take_rows, token_losses
from mmtrain.parallel.distributed import all_reduce
from mmtrain.parallel.pipeline import AUX_NAMES, CARRIED, StageModel, build_schedule, run_schedule

TW = "token_weighting"  # its blank CE's key in mb.held (the term reads it there)


def pad_rows(mb, rows: int) -> None:
    """`mb`'s forward padded with rows of padding (no token trained, no medium, no document) to
    `rows`; `mb.ref` keeps the unpadded forward (the aux terms' divisors are its)."""
    inputs = mb.inputs
    extra = rows - inputs["tokens_BS"].shape[0]
    if extra < 0:
        raise ValueError(f"a micro-batch of {inputs['tokens_BS'].shape[0]} rows exceeds the stages' {rows}")
    if mb.ref is None:
        mb.ref = inputs
    if not extra:
        return
    pad = dummy_batch(inputs["tokens_BS"].shape[1], inputs["patches_NP"].shape[-1]).model_inputs()
    rows_BS = {k: torch.cat([v, pad[k].to(v).expand(extra, -1)])
               for k, v in inputs.items() if k.endswith("_BS")}
    pos_3BS = inputs["pos_ids_3BS"]
    pos_3BS = torch.cat([pos_3BS, pad["pos_ids_3BS"].to(pos_3BS).expand(3, extra, -1)], 1)
    mb.inputs = {**inputs, **rows_BS, "pos_ids_3BS": pos_3BS}
    labels_BS = mb.batch.labels_BS if mb.labels_BS is None else mb.labels_BS
    mb.labels_BS = torch.cat([labels_BS, labels_BS.new_full((extra, labels_BS.shape[1]), IGNORE_INDEX)])


class PipelineStep:
    def __init__(self, objective, parts: list[StageModel], schedule: str, pp_group, device: torch.device,
                 accum: int, dtype: torch.dtype = torch.float32, row_parts: int = 1):
        self.objective, self.parts, self.name = objective, parts, schedule
        self.group, self.device, self.accum, self.dtype = pp_group, device, accum, dtype
        self.row_parts = row_parts  # each batch's rows in this many micro-batches
        self.last = next((p for p in parts if p.is_last), None)
        self.schedule = None  # built on the first step: its shapes come from the first batch
        self._loss = None
        self._frozen = None  # a forward-only pass of loss.token_weighting ("blank" / "real") or None

    def run(self, batches: list[PackedBatch], sums) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; -> the sum of their losses / accum on the
        rank holding the last stage (float64, no host read), zero elsewhere."""
        if len(batches) != self.accum:
            raise ValueError(f"train.grad_accum: {self.accum} micro-batches expected, got {len(batches)}")
        mbs = [mb for b in batches for mb in self._prepare(b, sums)]
        if self.schedule is None:
            self.schedule = build_schedule(self.name, self.parts, self.group, self.device, len(mbs),
                                           self._loss_fn, mbs[0].inputs, self.dtype)
        args = [(mb.inputs["tokens_BS"],) for mb in mbs]
        if self.objective.token_weighting is not None:
            self._frozen_passes(mbs, args, sums)
        measured = self.objective.measures_attention  # a log step: the layers count what they visit
        for part in self.parts:
            part.records.clear()
            part.attn_records.clear()
            part.measure_attn = measured
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.objective.autocast():  # the trainer's (bf16 on CUDA), as its one-process forward
            run_schedule(self.schedule, args, [self._stage_inputs(mb) for mb in mbs], mbs)
        for part in self.parts:  # this rank's layers; the objective sums every layer over the world
            for counts in part.attn_records:
                self.objective.add_attention(counts)
            part.measure_attn = False
        return self._loss

    def _frozen_passes(self, mbs: list, args: list, sums) -> None:
        """loss.token_weighting: every micro-batch forward with its media blanked, then with them,
        through the stages, forward only, in eval mode, the RNG restored (`frozen_state`, as the
        one-process blank pass); the last stage keeps each one's blank and real CE, and every rank
        joins the reduce of each batch's reliance sums (`_reliance_sums`): the weights' per-task
        means are one process's over the global batch before any backward. All rows are forwarded
        (the stages' shapes are static; rows never attend across, so a media row's CE is the
        one-process pass's on its media rows alone)."""
        t0 = time.perf_counter()
        for kind in ("blank", "real"):
            inputs = [{**mb.inputs, "patches_NP": torch.zeros_like(mb.inputs["patches_NP"])}
                      if kind == "blank" else mb.inputs for mb in mbs]
            self._frozen = kind
            try:
                with torch.no_grad(), contextlib.ExitStack() as stack, self.objective.autocast():
                    for part in self.parts:
                        stack.enter_context(frozen_state(part, self.device))
                    run_schedule(self.schedule, args, inputs, mbs, forward_only=True)
            finally:
                self._frozen = None
        self._reliance_sums(mbs)
        if self.device.type == "cuda":  # the forwards' GPU time, not their launch time
            torch.cuda.synchronize(self.device)
        sums.token_weighting.seconds += time.perf_counter() - t0

    def _reliance_sums(self, mbs: list) -> None:
        """Each batch's reliance sums (`terms.reliance_sums`) over its row parts, summed over the world
        (the data-parallel ranks and a row's tp / cp chunks of the last stage; the other stages add
        zeros) -> its micro-batches' `mb.held` on the last stage."""
        k, floor = self.row_parts, self.objective.token_weighting.cfg.floor
        totals_G2T = torch.zeros(len(mbs) // k, 2, len(MEDIA_TASK_IDS), dtype=torch.float64,
                                 device=self.device)
        if self.last is not None:
            for i, mb in enumerate(mbs):
                totals_G2T[i // k] += reliance_sums(mb.held.pop("real"), mb.held[TW], mb.batch.labels_BS,
                                                    mb.batch.task_BS, floor)
        all_reduce(totals_G2T, self.objective.env)
        if self.last is not None:
            for i, mb in enumerate(mbs):
                mb.held["reliance_sums"] = totals_G2T[i // k]

    def _own_ce(self, h_BSD: torch.Tensor, mb) -> torch.Tensor:
        """(B, s) per-token CE of the micro-batch's own rows (its chunk under tp / cp), the LM head
        full or chunked as the training loss's."""
        obj, labels_BS = self.objective, mb.batch.labels_BS
        h_BSD = h_BSD[:labels_BS.shape[0]]
        if obj.cfg.loss.ce_chunk:
            return head_ce(h_BSD, head_weight(obj.raw_model), labels_BS, obj.cfg.loss.ce_chunk)[0]
        return token_losses(self.last.decoder.logits(h_BSD), labels_BS)

    @staticmethod
    def _stage_inputs(mb) -> dict:
        """The stages' keyword inputs: the model's, and visual_ssl's patch mask (stage 0 reads it)."""
        mask_N = mb.kwargs.get("ssl_mask_N")
        return mb.inputs if mask_N is None else {**mb.inputs, "ssl_mask_N": mask_N}

    def _prepare(self, batch: PackedBatch, sums) -> list:
        """The batch's micro-batches: itself, or its `row_parts` equal row parts (with their media);
        with the contrast's copies, padded to twice their own rows (the stages' shapes are static)."""
        k = self.row_parts
        B = batch.tokens_BS.shape[0]
        if k == 1:
            mbs = [self.objective.prepare(batch, sums)]
        else:
            if B % k:
                raise ValueError(f"a batch of {B} rows does not split into {k} equal micro-batches")
            rows_kR = torch.arange(B, device=batch.tokens_BS.device).view(k, B // k)
            mbs = [self.objective.prepare(take_rows(batch, rows_R), sums, share_of=batch,
                                          share_rows=range(int(rows_R[0]), int(rows_R[-1]) + 1))
                   for rows_R in rows_kR]
        if any(t.name == "contrast" for t in self.objective.terms):
            for mb in mbs:  # at most one copy a row
                pad_rows(mb, 2 * (B // k))
        return mbs

    def _loss_fn(self, output: tuple[torch.Tensor, torch.Tensor], mb) -> torch.Tensor:
        h_BSD, carry_C = output
        obj = self.objective
        if self._frozen is not None:  # token weighting's forward-only passes: keep the CE, no loss
            mb.held[TW if self._frozen == "blank" else "real"] = self._own_ce(h_BSD, mb)
            return h_BSD.new_zeros((), dtype=torch.float32)
        logits = None if obj.cfg.loss.ce_chunk else self.last.decoder.logits(h_BSD)
        aux = {name: carry_C[CARRIED.index(name)] for name in AUX_NAMES}
        # loss.visual_ssl: stage 0's masked-patch loss, carried here (its gradient flows back there)
        ssl = carry_C[CARRIED.index("visual_ssl")] if "ssl_mask_N" in mb.kwargs else None
        pred_KT = (self.last.visual_next_pred(h_BSD, mb.inputs["modality_BS"], mb.inputs["grid_thw_M3"])
                   if mb.kwargs.get("visual_next") else None)  # loss.visual_next: its head on this stage
        mb.out = ModelOutput(logits, h_BSD, aux, None, None, {}, None, visual_ssl=ssl, visual_next_KT=pred_KT)
        loss = obj.finish(mb)
        self._loss = self._loss + loss.detach().double() / self.accum
        return loss * (obj.data_world / self.accum)
