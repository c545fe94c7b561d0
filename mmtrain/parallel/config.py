"""The distributed setup's config (section `dist`): the mesh, the wrappers and the process group.
Its own module because distributed.py, dims.py and parallelize.py all read it and run_config.py
composes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmtrain.checks import check

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")  # pipeline.SCHEDULES' keys


@dataclass
class DistConfig:
    """Parallelism, applied from outside the model (mmtrain/parallel/parallelize.py). Under torchrun with
    WORLD_SIZE > 1 the ranks shard the model (fsdp) or replicate it (ddp); a single process uses
    only `activation_checkpointing` and `compile`."""

    strategy: Literal["fsdp", "ddp"] = "fsdp"  # fsdp: FSDP2 fully_shard per vision block / decoder layer
    # The mesh (mmtrain/parallel/dims.py): pp x dp_replicate x dp_shard x cp x tp = the world size.
    dp_replicate: int = 1  # HSDP: replicas of the sharded model (e.g. one per node); ddp: the world
    dp_shard: int = -1  # ranks each replica shards over; -1: the rest of the world
    cp: int = 1  # context parallelism: ranks that split every row between them
    tp: int = 1  # tensor parallelism: ranks that split every layer's heads / FFN width (innermost)
    pp: int = 1  # pipeline parallelism: stages, each a slice of the layers (outermost)
    # torch.distributed.pipelining's schedule by name (mmtrain/parallel/pipeline.py); micro-batches are
    # train.grad_accum's, each split into equal row parts when fewer than one a rank (DualPipeV: one a
    # stage). Interleaved1F1B / ZBVZeroBubble / DualPipeV run 2 stages a rank.
    pp_schedule: str = "1F1B"
    # the vision encoder, its projector and the token embedding on a stage of their own (stage 0, no
    # decoder layer); the decoder layers split over the other pp x stages-a-rank - 1 stages
    pp_vision_stage: bool = False
    # where the stages are cut: flops (pipeline.stage_costs, a FLOP model) or measured (one forward +
    # backward of the encoder, each layer kind and the head timed on the device before the split,
    # the max over the ranks: mmtrain/parallel/stage_timing.py)
    pp_split: Literal["flops", "measured"] = "flops"
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's routed experts (from dp_shard x cp)
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # collective timeout: a dead or stuck rank ends the job instead of a hang
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (ZeRO-3) or keep them
    activation_checkpointing: bool = False  # recompute each vision block and decoder layer in backward
    compile: bool = False  # torch.compile each vision block and decoder layer
    # torch.compile's backend: inductor (the production path); aot_eager traces the same graphs
    # (Dynamo + AOTAutograd, FSDP2's hooks included) without generating code: the CPU tests' choice
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    meta_init: bool = True  # FSDP on CUDA: build on the meta device, shard, then initialise (no full copy)
    # train.dtype bfloat16's FSDP2 policy (bf16 weights, fp32 gradient reduction) on CPU too: gloo runs
    # it, so the GPU path's dtypes (stage boundaries, reduce dtypes) are exercised before a GPU sees them
    cpu_mixed_precision: bool = False

    def __post_init__(self):
        check(self, "timeout_s", gt=0)
        check(self, "compile_backend", choices=("inductor", "aot_eager"))
        check(self, "pp_schedule", choices=PP_SCHEDULES)
        check(self, "pp_split", choices=("flops", "measured"))
        check(self, "dp_replicate", "cp", "tp", "pp", "ep", ge=1)
        if self.pp_vision_stage and self.pp < 2:
            raise ValueError(f"pp_vision_stage: a stage of its own for the vision encoder needs dist.pp >= 2 "
                             f"(got pp {self.pp}); set pp_vision_stage: false")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"dp_shard: must be >= 1 or -1 (the rest of the world) (got {self.dp_shard})")
