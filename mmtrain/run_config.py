"""The run config: one YAML file = one run. Components own their dataclasses (next to their code:
data_pipelines/config.py, the model's in models/, OptimConfig in mmtrain/optim.py, DistConfig in
mmtrain/parallel/config.py, LossConfig in mmtrain/objectives/objective.py, ...); this composes them.

What stays here is the loop's own section, `train` (TrainConfig, its FaultConfig and HeartbeatConfig):
beside their code they would sit in mmtrain/loop/, the top of the trainer, which imports this module."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from mmtrain.checks import check
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.evaluation.caption_config import CaptionEvalConfig
from mmtrain.evaluation.diagnostics_report import DiagConfig
from mmtrain.models.multimodal import ModelConfig
from mmtrain.objectives.balance import BALANCERS
from mmtrain.objectives.balance.signals import check_signals
from mmtrain.objectives.curriculum import StageConfig
from mmtrain.objectives.mixture import SIGNAL_OF
from mmtrain.objectives.objective import LossConfig
from mmtrain.optim import OptimConfig
from mmtrain.parallel.config import DistConfig
from mmtrain.parallel.vision_balance import VisionBalanceConfig

SLOW_PLACES = ("compile", "eval", "save", "step")  # train.faults.slow_at


@dataclass
class FaultConfig:
    """Fault injection, for tests and drills only (0 = off). The kill knobs fire in the first launch
    only: after a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) they are ignored. With
    train.async_save a save is half written in its background writer (DCP's shards are, the rest
    not), while the training goes on."""

    nan_at_step: int = 0  # the loss of this optimizer step (1-based) becomes NaN on `rank`
    kill_at_step: int = 0  # `rank` SIGKILLs itself after this step's update, before its eval/checkpoint
    kill_in_save_at_step: int = 0  # ... while the checkpoint of this step is half written
    kill_mid_step: int = 0  # ... inside this step, after its first forward (the others in its collectives)
    stop_at_step: int = 0  # `rank` SIGSTOPs itself after this step's update (a hung rank, alive)
    slow_s: float = 0.0  # `rank` is slow but live this long at each place of `slow_at`
    slow_at: list[str] = field(default_factory=list)  # "<where>@<step>", where: compile (in the first
    # step, GIL held), eval, save (a synchronous save; GIL held), step (sleeping: GIL free)
    rank: int = 0  # the rank the faults hit (the others must notice: skip together, or exit)

    def __post_init__(self):
        check(self, "nan_at_step", "kill_at_step", "kill_in_save_at_step", "kill_mid_step", "stop_at_step",
              "rank", "slow_s", ge=0)
        for item in self.slow_at:
            where, _, step = item.partition("@")
            if where not in SLOW_PLACES or not step.isdigit():
                raise ValueError(f"slow_at: each must be <where>@<step>, where one of "
                                 f"{', '.join(SLOW_PLACES)} (got {item!r})")


@dataclass
class HeartbeatConfig:
    """`train.heartbeat`: the watchdog that names a silent rank (mmtrain/loop/heartbeat.py), on
    whenever there is more than one rank."""

    enabled: bool = True
    k: float = 3.0  # a peer in a step is silent after k x the median step time ...
    floor_s: float = 10.0  # ... or this, whichever is longer
    section_s: float = 600.0  # the bound inside a checkpoint save or load and an evaluation
    startup_s: float = 600.0  # the bound before the first step is timed (build, first compile)
    interval_s: float = 1.0  # how often the watchdog beats and reads its peers
    watch: int = 8  # peers each rank reads (the next ones on a ring; the whole group if smaller)

    def __post_init__(self):
        check(self, "k", ge=1)
        check(self, "floor_s", "section_s", "startup_s", "interval_s", gt=0)
        check(self, "watch", ge=1)
        if self.floor_s < 2 * self.interval_s:
            raise ValueError(f"floor_s: must be >= 2 x interval_s (got {self.floor_s} < 2 x "
                             f"{self.interval_s})")
        if min(self.section_s, self.startup_s) < self.floor_s:
            raise ValueError(f"section_s, startup_s: must be >= floor_s (got {self.section_s}, "
                             f"{self.startup_s} < {self.floor_s})")


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
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    stages: list[StageConfig] = field(default_factory=list)  # e.g. text first, media added later

    def __post_init__(self):
        ends = [s.until_step for s in self.stages]
        if ends != sorted(set(ends)):
            raise ValueError(f"stages: until_step must increase (got {ends})")
        check(self, "steps", "grad_accum", "log_every", "keep_last", "max_skipped_steps", ge=1)
        check(self, "threads", "eval_every", "eval_batches", "ckpt_every", "time_limit_min", "peak_tflops",
              ge=0)


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    vision: VisionBalanceConfig = field(default_factory=VisionBalanceConfig)  # encoder work across ranks
    diagnostics: DiagConfig = field(default_factory=DiagConfig)
    captions: CaptionEvalConfig = field(default_factory=CaptionEvalConfig)  # captioning eval (every eval)

    def __post_init__(self):
        self._check_objectives()
        self._check_context_parallel()
        if self.vision.balance == "dp_cp" and self.dist.cp * self.dist.tp == 1:
            raise ValueError("vision.balance: dp_cp needs dist.cp or dist.tp > 1 (use dp)")
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

    def _check_objectives(self) -> None:
        if self.loss.visual_ssl.weight > 0 and not self.model.vision.ssl_head:
            raise ValueError("loss.visual_ssl.weight: > 0 needs model.vision.ssl_head: true")
        if self.loss.visual_next.weight > 0 and not self.model.visual_head:
            raise ValueError("loss.visual_next.weight: > 0 needs model.visual_head: true")
        kind = self.loss.balancer.kind
        check_signals(self, BALANCERS[kind].signals, f"loss.balancer.kind: {kind}")
        ctl = self.data.mix.controller
        if ctl.kind != "none":
            check_signals(self, (SIGNAL_OF[ctl.signal],), f"data.mix.controller.kind: {ctl.kind}")
        if ctl.kind != "none" and self.train.stages:
            raise ValueError("data.mix.controller: not combinable with train.stages (both set the "
                             "train mixture); use one")
