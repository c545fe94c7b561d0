"""Two real training steps of a config on fake tensors, as rank R of a fake N-rank process group.

What runs is the trainer's: ParallelDims' mesh, parallelize's checkpointing and FSDP2 / HSDP / EP
sharding (`_apply_fsdp`, with the CUDA bf16 MixedPrecisionPolicy when the config trains in bf16 on
CUDA), AdamW from mmtrain/optim.py, and the Objective's forward and losses, then backward, expert
gradient scaling, clipping and the optimizer step, as `Trainer.train_step` does them. Device
"cpu" (fake CUDA tensors abort in backward on a CPU-only build): CUDA's bf16 autocast is modelled
by CPU autocast to bf16. Stand-ins (standin.py): attention kernels, EP split sizes, host reads.

The first step is only its optimizer step (on zero gradients: AdamW's state); the second is the
real step, measured: the peak per category and per module
(FSDPMemTracker), and the collectives by mesh dimension (comm.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mmtrain.errors import UserError

CATEGORIES = {  # FSDPMemTracker's reference types -> the report's categories
    "Sharded Param": "parameters", "Buffer": "parameters", "Unsharded Param": "gathered weights",
    "All Gather": "gathered weights", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients", "OptState": "optimizer state", "Activation": "activations",
    "Inputs": "activations", "Temp": "temporaries",
}


@dataclass
class PlanOptions:
    gpus: int
    rank: int = 0
    visual_frac: float = 0.5  # share of a row's tokens that are image tokens
    ep_imbalance: float = 1.0  # rows this rank's experts receive / the uniform share
    keep_rate: float | None = None  # sparse layers' kept share of the causal pairs (None: the rule's cap)
    per_node: int = 8
    exact: bool = False  # the reference bookkeeping (torch's FSDPMemTracker) instead of tracker.py's


@dataclass
class Trace:
    rank: int
    peak: dict[str, float]  # category -> bytes at the step's peak
    modules: list[tuple[str, float]]  # the top modules by their own peak
    comm: dict[tuple[str, str], list[float]]  # (mesh dim, kind) -> [calls, wire bytes]
    tokens: int  # tokens of a rank's micro-batch (its chunk of the rows under cp)
    visual_tokens: int
    patches: int
    mesh: dict = field(default_factory=dict)
    crosses: dict[str, bool] = field(default_factory=dict)  # mesh dim -> its group spans nodes
    flops: dict[str, float] = field(default_factory=dict)  # component -> FLOPs per step (flops.py)
    media_patches: list[int] = field(default_factory=list)  # patches of each medium of the rows
    own_counts: dict[str, int] = field(default_factory=dict)  # the trainer's own Traffic (tp: its kinds)
    pipeline: dict = field(default_factory=dict)  # pp > 1: the rank's stages and schedule (pipe.py)

    @property
    def total(self) -> float:
        return sum(self.peak.values())


class _CudaType:
    """parallelize reads only `device.type` to pick the mixed-precision policy."""

    type, index = "cuda", None


def trace(cfg, opts: PlanOptions) -> Trace:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan: a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=opts.rank, world_size=opts.gpus)
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        return _run(cfg, opts, FakeTensorMode(allow_non_fake_inputs=True))
    finally:
        dist.destroy_process_group()


def measure(cfg, opts: PlanOptions) -> Trace:
    """The same two steps on real tensors, in a process group the caller set up (gloo, or none for
    one rank): what the plan's peak is checked against (tools/bench/bench_plan.py)."""
    if opts.gpus > 1 and not dist.is_initialized():
        raise RuntimeError("measure: needs the process group of the run")
    return _run(cfg, opts, None)


def dims_for(cfg, gpus: int, rank: int = 0):
    from mmtrain.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.dist, gpus, rank)
    if dims.pp > 1:  # the plan traces a rank's stages itself (pipe.py): no refusal of pp here
        from mmtrain.parallel.pipeline import check_pipeline_config

        check_pipeline_config(cfg, dims)
    if dims.tp > 1:
        from mmtrain.parallel.tensor_parallel import check_tp

        check_tp(cfg, dims)  # the trainer's rules, one line naming the key
    if dims.ep > 1 and cfg.model.decoder.moe is None:
        raise UserError("dist.ep: > 1 needs MoE layers (model.decoder.moe)")
    if dims.ep > 1 and cfg.model.decoder.moe.n_routed % dims.ep:
        raise UserError(f"dist.ep: {dims.ep} must divide model.decoder.moe.n_routed "
                        f"{cfg.model.decoder.moe.n_routed}")
    return dims


def _run(cfg, opts: PlanOptions, fake) -> Trace:
    """Two steps (fake: on fake tensors; None: real ones), the second measured."""
    from mmtrain.plan.standin import standin_backend

    with standin_backend():
        return _run_with_standin(cfg, opts, fake)


def _run_with_standin(cfg, opts: PlanOptions, fake) -> Trace:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from mmtrain.plan.batch import plan_batch
    from mmtrain.plan.comm import CommCounter, crosses_nodes, group_names
    from mmtrain.plan.flops import component_flops
    from mmtrain.plan.standin import PlanMode, context_standin, vision_group
    from mmtrain.plan.tracker import PlanMemTracker

    dims = dims_for(cfg, opts.gpus, opts.rank)
    dims.dense_mesh("cpu")  # outside fake mode: the groups are real
    if dims.ep > 1:
        dims.expert_mesh("cpu")
    if dims.cp > 1:
        dims.cp_mesh("cpu")
    if dims.tp > 1:
        dims.tp_mesh("cpu"), dims.seq_mesh("cpu")
    step = _Step(cfg, dims, fake, opts)
    batch = plan_batch(cfg, fake, opts.visual_frac)
    names, crosses = group_names(dims), crosses_nodes(dims, opts.per_node)
    if (group := vision_group(step.model)) is not None:  # vision.balance's exchanges and grid gathers
        names[group.group_name] = "vision"
        crosses["vision"] = len({r // opts.per_node for r in dist.get_process_group_ranks(group)}) > 1
    counter = CommCounter(names)
    with PlanMode(fake) if fake is not None else contextlib.nullcontext(), context_standin():
        step.warm_up()  # the first step's optimizer state
        tracker = (FSDPMemTracker if opts.exact else PlanMemTracker)(step.model, step.optimizer)
        with tracker, counter:
            step.run(batch)
    peak = {}
    for ref, nbytes in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items():
        if ref in CATEGORIES:
            peak[CATEGORIES[ref]] = peak.get(CATEGORIES[ref], 0) + nbytes
    flops = component_flops(step.model, batch, cfg.train.grad_accum, opts.keep_rate,
                            cfg.dist.activation_checkpointing, dims.seq_size,
                            getattr(step.model.encode_media, "encoded", None))
    return Trace(opts.rank, peak, _top_modules(tracker), dict(counter.calls),
                 batch.num_tokens() // dims.seq_size,
                 int((batch.modality_BS != 0).sum()), batch.patches_NP.shape[0],
                 {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "ep": dims.ep,
                  "tp": dims.tp},
                 crosses, flops, batch.grid_thw_M3.prod(-1).tolist(), dict(step.traffic.sent))


def _top_modules(tracker, n: int = 8) -> list[tuple[str, float]]:
    """Decoder layers and vision blocks by their own peak (what is live while they run)."""
    peaks = [(st.mod_fqn, max(st.local_peak.values(), default=0)) for st in tracker.memory_tracking.values()]
    return sorted(peaks, key=lambda p: -p[1])[:n]


class _Step:
    """The trainer's step on the planned model (mirrors `Trainer.train_step`)."""

    def __init__(self, cfg, dims, fake, opts: PlanOptions) -> None:
        from mmtrain.objectives.balance import build_balancer
        from mmtrain.objectives.objective import Objective
        from mmtrain.optim import build_optimizer
        from mmtrain.parallel.context_parallel import context_shard
        from mmtrain.parallel.distributed import DistEnv
        from mmtrain.parallel.parallelize import prime_probes
        from mmtrain.plan.standin import plan_dispatchers, plan_vision_balance

        prime_probes(torch.device("cpu"))  # grouped_mm's probe runs real tensors: before fake mode
        cfg.model.decoder.attention.backend = "plan"
        self.cfg, self.dims, self.fake = cfg, dims, fake
        self.env = DistEnv(opts.rank, opts.gpus, opts.rank % 8, min(opts.gpus, 8))
        cuda_bf16 = cfg.train.device == "cuda" and cfg.train.dtype == "bfloat16"
        from mmtrain.parallel.comm import Traffic

        self.traffic = Traffic()  # what the trainer's own layers count (tp), beside comm.py's count
        self.model = _parallelized(cfg, dims, cuda_bf16, self.traffic)
        with fake or contextlib.nullcontext():  # fake: parameters, gradients, optimizer state too
            self.model.to_empty(device="cpu")
            if fake is None:
                torch.manual_seed(0)
                self.model.init_weights()
            self.optimizer = build_optimizer(self.model, cfg.optim)
        plan_dispatchers(self.model, opts.ep_imbalance)
        plan_vision_balance(self.model, cfg, dims)  # vision.balance: the trainer's balancer
        from mmtrain.data_pipelines.batch import TASK_NAMES

        balancer = build_balancer(cfg.loss.balancer, {t: getattr(cfg.loss, t) for t in TASK_NAMES})
        bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731  (CUDA's, modelled)
        autocast = bf16 if cuda_bf16 else contextlib.nullcontext
        context = context_shard(dims, torch.device("cpu"), cfg.data.seq_len, None)  # None: no cp
        self.objective = Objective(cfg, self.model, balancer, env=self.env, device=torch.device("cpu"),
                                   raw_model=self.model, dp_rank=dims.dp_rank, cp_rank=dims.cp_rank,
                                   context=context, autocast=autocast)

    def warm_up(self) -> None:
        """What a first step leaves behind, without its forward: AdamW's state from zero gradients."""
        with torch.no_grad(), self.fake or contextlib.nullcontext():
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, batch) -> None:
        from mmtrain.parallel.parallelize import clip_grad_norm, grad_sync, scale_expert_grads

        accum, world = self.cfg.train.grad_accum, self.env.world_size
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.objective.begin_step(0)
        for i in range(accum):
            with grad_sync(self.model, self.env, last=i == accum - 1):
                loss = self.objective.micro_batch(batch, sums)
                (loss * world / accum).backward()
        self.objective.end_backward()
        scale_expert_grads(self.model, self.dims)
        clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        sums.reduce(self.env, torch.device("cpu"))
        self.optimizer.step()
        self.model.update_moe_bias(lambda t: dist.all_reduce(t))


def _parallelized(cfg, dims, cuda_bf16: bool, traffic=None):
    """parallelize.build_model's FSDP path as on CUDA with meta_init: built and sharded on the meta
    device (DTensor sharding does not run on fake tensors), then `to_empty` (under fake mode)."""
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.parallelize import _apply_fsdp, block_lists, checkpoint_forward

    if cfg.dist.strategy != "fsdp":
        raise UserError("dist.strategy: plan covers fsdp (ddp replicates the whole model: its memory is "
                        "the one-process model's)")
    with torch.device("meta"):
        model = MultimodalModel(cfg.model)
    if cfg.dist.activation_checkpointing:
        for blocks in block_lists(model):
            for block in blocks:
                checkpoint_forward(block)
    if dims.tp > 1:  # the trainer's order: checkpointing, tp, then FSDP
        from mmtrain.parallel.tensor_parallel import apply_tp

        apply_tp(model, dims, torch.device("cpu"), cfg.data.seq_len, traffic)
    _apply_fsdp(model, cfg, dims, _CudaType if cuda_bf16 else torch.device("cpu"), None)
    return model
