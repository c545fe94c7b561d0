"""What the trainer holds at dist.pp > 1: this rank's stages, one module over them, an evaluation replica.

    pipe = PipelineModel(cfg, env, device, dims)
    pipe.module     # this rank's stages as one nn.Module with the full model's parameter names:
                    # the optimizer and the checkpoint see it (DCP reshards it to any other mesh)
    pipe.refresh()  # the whole model for evaluation, diagnostics and captioning (they need whole
                    # forwards): on the pipeline's first rank (`evaluates`) a replica in host memory
                    # loaded from the stages block by block (mmtrain/parallel/pipeline_replica.py)
    pipe.clip(max_norm) / pipe.update_moe_bias(env)   # the norm and the bias step over all stages

Each rank builds only its stages: the model is built on the meta device (free), split, and each
stage given the values one process gives its blocks (`pipeline.materialize`), so no rank ever
holds the whole model, at build time included (`dist.pp_split: measured` times a meta copy with
one layer of each kind given values: stage_timing.timing_model).

Order (torchtitan's): split the model into stages (mmtrain/parallel/pipeline.py), then
activation-checkpoint each stage's blocks, then (dist.compile) compile them, then (dist.tp > 1)
split each stage's decoder layers over tp (mmtrain/parallel/tensor_parallel.py), then FSDP2 each
stage's blocks and the stage itself over its pp slice's dense mesh (dp_replicate, fsdp; fsdp
includes tp) when that has more than one rank.
torch's PipelineStage drives FSDP itself: no gradient reduce before a stage's last micro-batch.

Under tp the stages run under the sequence-parallel `context` (the (cp, tp) row shard): tp rank t
of stage s holds its chunk (B, S / tp, D) of every row and sends it to tp rank t of stage s + 1
(Megatron's way; the pp groups are one per tp coordinate, dims.py).
"""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.errors import UserError
from mmtrain.models.multimodal import MultimodalModel, draw_init_seed
from mmtrain.parallel.context_parallel import context_shard
from mmtrain.parallel.dims import ParallelDims
from mmtrain.parallel.distributed import DistEnv, all_reduce
from mmtrain.parallel.parallelize import compute_dtype, prime_probes, scale_expert_grads, shard_blocks
from mmtrain.parallel.pipeline import (
    StageModel,
    block_stage,
    build_stage_models,
    check_pipeline_config,
    checkpoint_stages,
    compile_stages,
    materialize,
    pp_grad_norm,
    pp_grad_norm_of,
    stage_ranges,
    stage_rank,
)
from mmtrain.parallel.pipeline_replica import PipelineReplica
from mmtrain.parallel.stage_timing import measured_costs, timing_model
from mmtrain.parallel.tensor_parallel import apply_tp_layers, check_tp

Tensor = torch.Tensor


def check_pipeline_mesh(cfg, dims: ParallelDims) -> None:
    """One-line refusals of the meshes the trainer's pipeline does not build (yet), naming the key."""
    if dims.ep > 1 and cfg.model.decoder.moe is None:
        raise UserError("dist.ep: > 1 needs MoE layers (model.decoder.moe)")
    check_pipeline_config(cfg, dims)
    if dims.tp > 1:
        check_tp(cfg, dims)  # the stages split their layers as the whole model does


class StageUnion(nn.Module):
    """Several stages of one rank (Interleaved1F1B, V-shaped schedules) as one module whose parameter
    names are the full model's: the stages' vision, embedding, layers, norm and head, shared."""

    def __init__(self, parts: list[StageModel]):
        super().__init__()
        first = next((p for p in parts if p.is_first), None)
        last = next((p for p in parts if p.is_last), None)
        self.vision = first.vision if first is not None else None
        self.decoder = nn.Module()
        self.decoder.embed = first.decoder.embed if first is not None else None
        layers = {str(i): p.decoder.layers[str(i)] for p in parts for i in p.layer_ids}
        self.decoder.layers = nn.ModuleDict(layers)
        self.decoder.norm = last.decoder.norm if last is not None else None
        self.decoder.lm_head = last.decoder.lm_head if last is not None else None
        self.visual_head = last.visual_head if last is not None else None


class PipelineModel:
    def __init__(self, cfg, env: DistEnv, device: torch.device, dims: ParallelDims, traffic=None):
        check_pipeline_mesh(cfg, dims)
        self.cfg, self.dims, self.device = cfg, dims, device
        # the one draw from the global RNG one process's MultimodalModel takes; every block's values
        # then come from its own seed (models/multimodal.seeded_init), so a stage built alone on the
        # meta device and given values block by block equals the same blocks of one process's model
        seed = draw_init_seed()
        with torch.device("meta"):
            skeleton = MultimodalModel(cfg.model, init_seed=seed)
        costs = (measured_costs(timing_model(skeleton, device), cfg, device)  # world MAX: one cut
                 if cfg.dist.pp_split == "measured" else None)
        d, S = cfg.dist, cfg.data.seq_len
        self.ranges = stage_ranges(skeleton, d.pp_schedule, dims.pp, S, d.pp_vision_stage, costs)
        self.parts = [materialize(part, device) for part in build_stage_models(
            skeleton, d.pp_schedule, dims.pp_rank, dims.pp, S, ranges=self.ranges)]
        if cfg.dist.activation_checkpointing:
            checkpoint_stages(self.parts, device)
        if cfg.dist.compile:  # after checkpointing, before the tp split (parallelize.build_model's order)
            compile_stages(self.parts, cfg.dist.compile_backend)
        elif cfg.model.decoder.ffn_chunk > 0:  # its token chunks checkpoint: the probe first (parallelize)
            prime_probes(device)
        if dims.tp > 1:  # after the split (a deep copy would share the patched forwards' closures)
            apply_tp_layers([p.decoder.layers[str(i)] for p in self.parts for i in p.layer_ids], dims, device,
                         cfg.data.seq_len, traffic)
        # sequence parallelism: this rank's chunk of every row crosses the stage boundaries
        self.context = context_shard(dims, device, cfg.data.seq_len, traffic)
        for part in self.parts:
            part.context = self.context
        sharded = dims.dp_size * dims.seq_size > 1  # the dense mesh's fsdp includes tp (dims.py)
        # what crosses a stage boundary: h_BSD in the dtype the stage computes in (bf16 under FSDP2's
        # bf16 policy: a boundary declared fp32 makes NCCL wait for twice the bytes sent, a hang)
        self.boundary_dtype = compute_dtype(cfg, device, sharded)
        if sharded:
            dims.dense_mesh(device.type)  # collective: every rank, whether its stages have experts or not
            if dims.ep > 1:
                dims.expert_mesh(device.type)
                dims.expert_fsdp_mesh(device.type)
                dims.stage_mesh(device.type)  # the MoE chunk count's group (expert_parallel.py)
            for part in self.parts:
                _shard_stage(part, cfg, dims, device, traffic)
        self.module = self.parts[0] if len(self.parts) == 1 else StageUnion(self.parts)
        self.group = dims.pp_mesh(device.type).get_group()
        self.last = next((p for p in self.parts if p.is_last), self.parts[-1])  # the objective's head
        # evaluation's whole model: in host memory on the pipeline's first rank (pipeline_replica.py)
        self.replica = PipelineReplica(cfg.model, seed, dims.pp_rank == 0, device)
        self.stale = True  # the replica lags the stages (set after every optimizer step)

    @torch.no_grad()
    def scale_expert_grads(self) -> None:
        """The routed experts' gradients divided by ep (parallelize.scale_expert_grads, per stage)."""
        if self.dims.ep > 1:
            for part in self.parts:
                scale_expert_grads(part, self.dims)

    def clip(self, max_norm: float) -> Tensor:
        """The gradient norm over all stages (and shards), gradients clipped to `max_norm`."""
        return pp_grad_norm(self.parts, self.group, max_norm).detach()

    def part_norm(self, grads: list[Tensor]) -> Tensor:
        """The norm of a part's gradients (grad_parts.py) summed over the stages."""
        return pp_grad_norm_of(grads, self.group, self.device)

    def update_moe_bias(self, env: DistEnv) -> None:
        """The balancing bias step of each stage's MoE layers from the load of every rank: an (L, E)
        count each rank fills at its own layers, summed over the world (a layer lives on one stage of
        a pipeline, so the sum is its load over the data ranks, as in one process)."""
        self.stale = True  # the optimizer step moved the weights
        self.replica.release()  # host memory only around evaluation points (pipeline_replica.py)
        dec = self.cfg.model.decoder
        if not any(dec.is_moe(i) for i in range(dec.n_layers)):
            return
        moes = {i: m for p in self.parts for i, m in p.moe_layers().items()}
        load_LE = torch.zeros(dec.n_layers, dec.moe.n_routed, dtype=torch.int64, device=self.device)
        for i, moe in moes.items():
            load_LE[i] = moe.load_E
        all_reduce(load_LE, env)
        for i, moe in moes.items():
            moe.update_bias(load_LE[i])

    def refresh(self) -> MultimodalModel:
        """The evaluation model: the replica loaded with every stage's current weights (a collective
        over the pipeline group and each stage's meshes) on the pipeline's first rank; the meta
        skeleton elsewhere (`evaluates` says which)."""
        if self.stale:
            schedule, pp, ranges = self.cfg.dist.pp_schedule, self.dims.pp, self.ranges
            self.replica.refresh(self.parts, lambda name: stage_rank(schedule, block_stage(name, ranges), pp),
                                 self.group)
            self.stale = False
        return self.replica.model

    @property
    def evaluates(self) -> bool:
        """Whether this rank runs evaluation, diagnostics and captioning (its pipeline's first rank)."""
        return self.replica.holder


def _shard_stage(part: StageModel, cfg, dims: ParallelDims, device: torch.device, traffic) -> None:
    """FSDP2 over the pp slice's dense mesh (parallelize.shard_blocks): with dist.ep > 1 the stage's
    routed experts first, then each vision block and decoder layer, then the stage."""
    blocks = [*(part.vision.blocks if part.vision is not None else []),
              *(part.decoder.layers[str(i)] for i in part.layer_ids)]
    shard_blocks(part, list(part.moe_layers().values()), blocks, cfg, dims, device, traffic)
