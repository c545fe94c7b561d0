"""What the trainer steps (OLMo-core's TrainModule): the model it trains, evaluates and checkpoints,
and a step's forward, backward, clip and bias update, the same calls at dist.pp == 1 and > 1.

    tm = build_train_module(cfg, env, device, dims, traffic)
    tm.model, tm.raw_model   # the whole model to evaluate (forward on `model`: itself or its DDP
                             # wrapper); dist.pp > 1: a replica loaded from the stages (`refresh`)
                             # in host memory on the pipeline's first rank, a meta skeleton elsewhere
    tm.evaluates             # whether this rank runs evaluation, diagnostics and captioning
    tm.trained               # what the optimizer and the checkpoint see (pp: this rank's stages)
    tm.head                  # where the objective finds the LM head (pp: the last stage), else None
    tm.encoder               # the module whose training forwards encode the media (its encode_media:
                             # vision.balance); pp: stage 0 where this rank holds it, else None
    tm.context               # the sequence shard of a row ((cp, tp) chunk), or None
    tm.bind(objective)       # once built: the step's forwards and losses are the objective's
    tm.forward_backward(train_iter, sums, on_loss)   # the step's train.grad_accum micro-batches
    tm.clip(max_norm)        # the global gradient norm (0-dim tensor), gradients clipped
    tm.update_moe_bias()     # after an optimizer step: the MoE balancing bias from every rank's load
    tm.refresh()             # before evaluation, diagnostics, captioning (pp: loads the replica)

`TrainModule` runs the micro-batches one at a time through the whole model (FSDP2 / DDP from
mmtrain/parallel/parallelize.py); `PipelineTrainModule` holds this rank's stages
(mmtrain/parallel/pipeline_model.py) and runs the micro-batches through the schedule
(mmtrain/loop/pipeline_step.py). The one backwards this rank's loss share x world size, the other
x the data world (the stages of a pipeline share a data rank); FSDP's average makes either exact.
"""

from __future__ import annotations

import time

import torch

from mmtrain.loop.grad_parts import GradParts
from mmtrain.loop.host_copy import batch_to_device
from mmtrain.loop.pipeline_step import PipelineStep
from mmtrain.parallel.context_parallel import context_shard
from mmtrain.parallel.dims import ParallelDims
from mmtrain.parallel.distributed import DistEnv, all_reduce
from mmtrain.parallel.parallelize import build_model, clip_grad_norm, grad_sync, scale_expert_grads
from mmtrain.parallel.pipeline import row_parts
from mmtrain.parallel.pipeline_model import PipelineModel


def build_train_module(cfg, env: DistEnv, device: torch.device, dims: ParallelDims, traffic=None):
    """-> a PipelineTrainModule at dist.pp > 1, else a TrainModule."""
    cls = PipelineTrainModule if dims.pp > 1 else TrainModule
    return cls(cfg, env, device, dims, traffic)


def next_batch(train_iter, sums, device: torch.device):
    """The loader's next batch on `device`; the wait for it counts as the step's data wait."""
    t0 = time.perf_counter()
    batch = next(train_iter)
    sums.wait_s += time.perf_counter() - t0
    return batch_to_device(batch, device)  # pinned + asynchronous on CUDA


class TrainModule:
    """dist.pp == 1: one process, or FSDP2 / HSDP / DDP over the ranks (with EP, CP, TP)."""

    pipeline = None
    evaluates = True  # every rank evaluates its own batches

    def __init__(self, cfg, env: DistEnv, device: torch.device, dims: ParallelDims, traffic=None):
        self.env, self.device, self.dims, self.accum = env, device, dims, cfg.train.grad_accum
        self.raw_model, self.model = build_model(cfg, env, device, dims, traffic)
        self.trained, self.head = self.model, None
        self.encoder = self.raw_model
        self.context = context_shard(dims, device, cfg.data.seq_len, traffic)  # or None
        self.objective = None

    def bind(self, objective) -> None:
        self.objective = objective

    def grad_parts(self) -> GradParts:
        return GradParts(self.raw_model)

    def forward_backward(self, train_iter, sums, on_loss) -> None:
        """Forward and backward of the step's micro-batches, one at a time; `on_loss` sees each."""
        accum, world = self.accum, self.env.world_size
        for i in range(accum):
            batch = next_batch(train_iter, sums, self.device)
            with grad_sync(self.model, self.env, last=i == accum - 1):
                loss = on_loss(self.objective.micro_batch(batch, sums))  # e.g. a NaN
                (loss * world / accum).backward()
            sums.loss = sums.loss + loss.detach().double() / accum  # on the device: no sync here
        scale_expert_grads(self.raw_model, self.dims)

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model, max_norm)

    def update_moe_bias(self) -> None:
        env = self.env
        self.raw_model.update_moe_bias(lambda t: all_reduce(t, env) if env.distributed else None)

    def refresh(self) -> None:
        """Nothing to gather: the trained model is the evaluated one."""


class PipelineTrainModule:
    """dist.pp > 1: `trained` is this rank's stages, `model` = `raw_model` the evaluation replica on
    the pipeline's first rank (`evaluates`), its meta-device skeleton on the others."""

    def __init__(self, cfg, env: DistEnv, device: torch.device, dims: ParallelDims, traffic=None):
        self.cfg, self.env, self.device = cfg, env, device
        self.pipeline = PipelineModel(cfg, env, device, dims, traffic)
        self.raw_model = self.model = self.pipeline.replica.model
        self.evaluates = self.pipeline.evaluates
        self.trained = self.pipeline.module
        self.head = self.pipeline.last  # the LM head's stage: the objective's model
        self.encoder = next((p for p in self.pipeline.parts if p.is_first), None)  # pp rank 0's
        self.context = self.pipeline.context  # the stages' own (tp's chunk)
        self.step = None

    def bind(self, objective) -> None:
        """The schedule's loss_fn is the objective's (refuses the terms it cannot run, in one line)."""
        pipe, cfg = self.pipeline, self.cfg
        parts = row_parts(cfg.dist.pp_schedule, pipe.dims.pp, cfg.data.batch_size, cfg.train.grad_accum)
        self.step = PipelineStep(objective, pipe.parts, cfg.dist.pp_schedule, pipe.group, self.device,
                                 cfg.train.grad_accum, pipe.boundary_dtype, parts)

    def grad_parts(self) -> GradParts:
        return GradParts(self.trained, self.pipeline.part_norm)

    def forward_backward(self, train_iter, sums, on_loss) -> None:
        """The step's micro-batches through the schedule; `on_loss` sees the step's loss (this rank's
        share: zero off the last stage)."""
        batches = [next_batch(train_iter, sums, self.device) for _ in range(self.cfg.train.grad_accum)]
        sums.loss = on_loss(self.step.run(batches, sums))
        self.pipeline.scale_expert_grads()

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.pipeline.clip(max_norm)

    def update_moe_bias(self) -> None:
        self.pipeline.update_moe_bias(self.env)  # marks the evaluation replica stale too

    def refresh(self) -> None:
        """The evaluation replica loaded with every stage's weights, if they moved (a collective:
        every rank calls it at the same points)."""
        self.pipeline.refresh()
