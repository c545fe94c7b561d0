"""The run config: one YAML file = one run. Components own their dataclasses; this composes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from mmtrain.checks import check
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.evaluation.caption_config import CaptionEvalConfig
from mmtrain.evaluation.diagnostics import DiagConfig
from mmtrain.models.multimodal import ModelConfig
from mmtrain.objectives.balance import BALANCERS, BalanceConfig
from mmtrain.objectives.balance.signals import check_signals
from mmtrain.objectives.mixture import SIGNAL_OF


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 50  # linear warmup, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self):
        check(self, "lr", gt=0)
        check(self, "weight_decay", "warmup_steps", "grad_clip", ge=0)
        check(self, "betas", ge=0, lt=1)
        check(self, "min_lr_ratio", ge=0, le=1)


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


@dataclass
class TokenWeightingConfig:
    """Token reliance weighting (mmtrain/objectives/terms.py, reliance_weights): each trained token of a
    media task is weighted by how much the pixels help predict it, from an extra forward without
    grad with every medium blanked, on the rows that hold such tokens (about their share of a
    forward's cost). Per task and micro-batch the weights average 1; text tokens keep weight 1."""

    strength: float = 0.0  # 0: off (no extra forward); 1: weights proportional to the reliance
    floor: float = 0.05  # nats added to max(blank CE - real CE, 0): unhelped tokens keep some weight

    def __post_init__(self):
        check(self, "strength", ge=0, le=1)
        check(self, "floor", gt=0)


@dataclass
class LossConfig:
    """Per-modality loss weights (the base weights every balancer starts from or multiplies), the
    balancer that adapts them, and the extra terms."""

    text: float = 1.0
    image_text: float = 1.0
    video_text: float = 1.0
    z_loss: float = 1e-4  # weight of mean(logsumexp(logits)^2) over trained tokens
    balancer: BalanceConfig = field(default_factory=BalanceConfig)
    visual_ssl: VisualSSLConfig = field(default_factory=VisualSSLConfig)
    token_weighting: TokenWeightingConfig = field(default_factory=TokenWeightingConfig)

    def __post_init__(self):
        check(self, "text", "image_text", "video_text", "z_loss", ge=0)


@dataclass
class FaultConfig:
    """Fault injection, for tests and drills only (0 = off). The kill knobs fire in the first launch
    only: after a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) they are ignored. With
    train.async_save a save is half written in its background writer (DCP's shards are, the rest
    not), while the training goes on."""

    nan_at_step: int = 0  # the loss of this optimizer step (1-based) becomes NaN on `rank`
    kill_at_step: int = 0  # `rank` SIGKILLs itself after this step's update, before its eval/checkpoint
    kill_in_save_at_step: int = 0  # ... while the checkpoint of this step is half written
    rank: int = 0  # the rank the faults hit (the others must notice: skip together, or exit)

    def __post_init__(self):
        check(self, "nan_at_step", "kill_at_step", "kill_in_save_at_step", "rank", ge=0)


@dataclass
class StageConfig:
    """A curriculum stage: until optimizer step `until_step` only these data.train sources are mixed
    (with their configured weights). After the last stage every data.train source is."""

    until_step: int = 0
    sources: list[str] = field(default_factory=list)

    def __post_init__(self):
        check(self, "until_step", ge=1)
        if not self.sources:
            raise ValueError("sources: must name at least one data.train source")


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"  # autocast dtype on CUDA; CPU trains in fp32
    threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the start and the end
    eval_batches: int = 0  # 0: the whole val split
    ckpt_every: int = 200  # 0: only the final checkpoint
    keep_last: int = 2
    async_save: bool = False  # write checkpoints in the background while training goes on (DCP async_save)
    max_skipped_steps: int = 10  # consecutive non-finite steps before the run stops
    time_limit_min: float = 0.0  # stop cleanly (final eval + checkpoint) after this long; 0: no limit
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: from the GPU name (H100/H200), else no MFU
    faults: FaultConfig = field(default_factory=FaultConfig)
    stages: list[StageConfig] = field(default_factory=list)  # e.g. text first, media added later

    def __post_init__(self):
        ends = [s.until_step for s in self.stages]
        if ends != sorted(set(ends)):
            raise ValueError(f"stages: until_step must increase (got {ends})")
        check(self, "steps", "grad_accum", "log_every", "keep_last", "max_skipped_steps", ge=1)
        check(self, "threads", "eval_every", "eval_batches", "ckpt_every", "time_limit_min", "peak_tflops",
              ge=0)


@dataclass
class DistConfig:
    """Parallelism, applied from outside the model (mmtrain/parallel/parallelize.py). Under torchrun with
    WORLD_SIZE > 1 the ranks shard the model (fsdp) or replicate it (ddp); a single process uses
    only `activation_checkpointing` and `compile`."""

    strategy: Literal["fsdp", "ddp"] = "fsdp"  # fsdp: FSDP2 fully_shard per vision block / decoder layer
    # The mesh (mmtrain/parallel/dims.py): dp_replicate x dp_shard x cp = the world size.
    dp_replicate: int = 1  # HSDP: replicas of the sharded model (e.g. one per node); ddp: the world
    dp_shard: int = -1  # ranks each replica shards over; -1: the rest of the world
    cp: int = 1  # context parallelism: ranks that split every row between them
    ep: int = 1  # expert parallelism: ranks that split each MoE layer's routed experts (from dp_shard x cp)
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: float = 600.0  # collective timeout: a dead or stuck rank ends the job instead of a hang
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (ZeRO-3) or keep them
    activation_checkpointing: bool = False  # recompute each vision block and decoder layer in backward
    compile: bool = False  # torch.compile each vision block and decoder layer
    meta_init: bool = True  # FSDP on CUDA: build on the meta device, shard, then initialise (no full copy)

    def __post_init__(self):
        check(self, "timeout_s", gt=0)
        check(self, "dp_replicate", "cp", "ep", ge=1)
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"dp_shard: must be >= 1 or -1 (the rest of the world) (got {self.dp_shard})")


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    diagnostics: DiagConfig = field(default_factory=DiagConfig)
    captions: CaptionEvalConfig = field(default_factory=CaptionEvalConfig)  # captioning eval (every eval)

    def __post_init__(self):
        self._check_objectives()
        self._check_context_parallel()
        known = {s.name for s in self.data.train}
        for i, stage in enumerate(self.train.stages):
            for name in stage.sources:
                if name not in known:
                    raise ValueError(f"train.stages.{i}.sources: {name!r} is not a data.train source "
                                     f"(known: {', '.join(sorted(known))})")
        media, vision = self.data.media, self.model.vision
        for name in ("patch_size", "temporal_patch", "merge"):
            if getattr(media, name) != getattr(vision, name):
                raise ValueError(
                    f"model.vision.{name}: must equal data.media.{name} "
                    f"({getattr(vision, name)} != {getattr(media, name)})"
                )

    def _check_context_parallel(self) -> None:
        """A cp rank holds seq_len / cp tokens of every row, in whole tiles of both layer kinds."""
        cp, attn = self.dist.cp, self.model.decoder.attention
        if cp == 1:
            return
        unit = cp * math.lcm(attn.block_size, attn.full_tile)
        if self.data.seq_len % unit:
            raise ValueError(f"dist.cp: data.seq_len {self.data.seq_len} must be a multiple of cp x "
                             f"lcm(block_size, full_tile) = {unit}")
        if self.dist.strategy != "fsdp":
            raise ValueError("dist.cp: > 1 needs dist.strategy: fsdp")
        if self.loss.token_weighting.strength:
            raise ValueError("dist.cp: > 1 does not combine with loss.token_weighting (it takes "
                             "whole-row forwards of its own)")

    def _check_objectives(self) -> None:
        if self.loss.visual_ssl.weight > 0 and not self.model.vision.ssl_head:
            raise ValueError("loss.visual_ssl.weight: > 0 needs model.vision.ssl_head: true")
        kind = self.loss.balancer.kind
        check_signals(self, BALANCERS[kind].signals, f"loss.balancer.kind: {kind}")
        ctl = self.data.mix.controller
        if ctl.kind != "none":
            check_signals(self, (SIGNAL_OF[ctl.signal],), f"data.mix.controller.kind: {ctl.kind}")
        if ctl.kind != "none" and self.train.stages:
            raise ValueError("data.mix.controller: not combinable with train.stages (both set the "
                             "train mixture); use one")
