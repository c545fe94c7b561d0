"""Parallelism applied from outside the model files: activation checkpointing, torch.compile,
expert parallelism and FSDP2 / HSDP (or DDP) over the per-block ModuleLists `model.vision.blocks`
and `model.decoder.layers`, on the mesh of mmtrain/parallel/dims.py.

Order (as torchtitan): checkpoint each block, compile each block, shard the routed experts over
`ep` (mmtrain/parallel/expert_parallel.py), `fully_shard` each MoE layer's experts on the expert
mesh's (dp_replicate, efsdp[ x tp]) part, then each block and finally the root (embeddings, the vision
patch embedding and projector, the final norm and the LM head) on the dense (dp_replicate, fsdp)
mesh: HSDP when dp_replicate > 1 (`shard_blocks`, which each pipeline stage's FSDP shares:
mmtrain/parallel/pipeline_model.py). On CUDA with bf16, FSDP2 gathers weights in bf16 and reduces
gradients in fp32 (MixedPrecisionPolicy); the optimizer keeps fp32 shards.

Gradient scale: backward runs on each rank's loss share x world size and FSDP2 averages over its
mesh, so dense gradients come out exact; an expert's gradient sums the ep ranks' rows (the
all-to-all's backward) before FSDP averages over the world / ep ranks of its own mesh, so
`scale_expert_grads` divides by ep (an explicit multiply rather than FSDP's divide factor, whose
PREMUL_SUM gloo lacks). Clipping takes the norm per mesh and combines them (`clip_grad_norm`).

A single process gets only checkpointing and compile: no wrapper, no collective.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mmtrain.errors import UserError
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.parallel.comm import Traffic
from mmtrain.parallel.dims import ParallelDims
from mmtrain.parallel.distributed import DistEnv
from mmtrain.parallel.expert_parallel import shard_experts
from mmtrain.parallel.tensor_parallel import apply_tp, check_tp, replicated_parts

if TYPE_CHECKING:
    from mmtrain.run_config import RunConfig


def block_lists(model: MultimodalModel) -> list[nn.ModuleList]:
    return [model.vision.blocks, model.decoder.layers]


def build_model(cfg: RunConfig, env: DistEnv, device: torch.device, dims: ParallelDims | None = None,
                traffic: Traffic | None = None) -> tuple[MultimodalModel, nn.Module]:
    """-> (the MultimodalModel, the module to call forward on: itself, or its DDP wrapper).

    FSDP on CUDA builds on the meta device and initialises the shards (`dist.meta_init`), so no
    rank ever holds the full model; elsewhere every rank builds the full model from the same
    seed and FSDP keeps its shard (on CPU, DTensor random init would repeat one shard's values).
    """
    dims = dims or ParallelDims.from_config(cfg.dist, env.world_size, env.rank)
    dims.refuse_unimplemented()
    fsdp = env.distributed and cfg.dist.strategy == "fsdp"
    meta = fsdp and cfg.dist.meta_init and device.type == "cuda"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = MultimodalModel(cfg.model)
    if not fsdp:
        model = model.to(device)
    _apply_checkpointing_and_compile(model, cfg, device)
    if dims.tp > 1:
        check_tp(cfg, dims)
        apply_tp(model, dims, device, cfg.data.seq_len, traffic)
    if fsdp:
        _apply_fsdp(model, cfg, dims, device, traffic)
        if meta:
            model.to_empty(device=device)
            model.init_weights()
        return model, model
    if env.distributed:  # ddp
        ids = [device.index] if device.type == "cuda" else None
        # no buffer sync in forward: each rank's MoE load counters are its own until all-reduced
        # (torch >= 2.13 spells it forward_sync_buffers; broadcast_buffers before)
        sync = ("forward_sync_buffers" if "forward_sync_buffers" in
                inspect.signature(nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, **{sync: False})
        return model, ddp
    return model, model


def _apply_checkpointing_and_compile(model: MultimodalModel, cfg: RunConfig, device: torch.device) -> None:
    if cfg.dist.activation_checkpointing or cfg.model.decoder.ffn_chunk > 0:
        prime_probes(device)  # both checkpoint: the FFN's token chunks (models/chunked.py) too
    for blocks in block_lists(model):
        for block in blocks:
            if cfg.dist.activation_checkpointing:
                checkpoint_forward(block)
    if cfg.dist.compile:
        compile_blocks(model, cfg.dist.compile_backend)


def compile_blocks(model: MultimodalModel, backend: str = "inductor") -> None:
    """torch.compile every vision block and decoder layer, before FSDP wraps them (its hooks then run
    around the compiled call; nothing may call `_orig_mod`, which would skip them). State-dict keys
    gain `_orig_mod.`; DCP strips it.

    Layers of one kind share graphs (Dynamo keys them on the code object): one per layer kind
    (full / sparse x dense / MoE FFN) x measured or not (log steps' attention counts, captures:
    decoder.py) x grad mode x train / eval mode. Dynamo's recompile limit (8 by default) is raised to
    that bound, or past it layers would run eagerly."""
    dec = model.decoder.cfg
    kinds = len(set(dec.layer_kinds()))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, layer_graphs(kinds))
    for blocks in block_lists(model):
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=backend)


def layer_graphs(kinds: int) -> int:
    """The most graphs the decoder layers' forward compiles to (compile_blocks)."""
    return kinds * 2 * 2 * 2  # x measured x grad mode x train / eval


def prime_probes(device: torch.device) -> None:
    """models/moe/grouped_mm probes `torch._grouped_mm` (forward + backward, cached) on first use.
    Inside a checkpointed block that first use saves tensors its recomputation does not, and
    torch.utils.checkpoint rejects the step; so run the probe up front (RNG left untouched)."""
    from mmtrain.models.moe.grouped_mm import grouped_mm_supported

    # this rank's CUDA device only (`cuda` without an index: the current one, not cuda:0)
    own = [] if device.type != "cuda" else \
        [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=own):
        for dtype in (torch.float32, torch.bfloat16):
            grouped_mm_supported(device.type, dtype)


def checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward. An instance-level forward keeps parameter names (and so
    checkpoints) identical with and without checkpointing; hooks such as FSDP's stay outside."""
    inner = block.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def _apply_fsdp(model: MultimodalModel, cfg: RunConfig, dims: ParallelDims, device: torch.device,
                traffic: Traffic | None) -> None:
    moes = list(model.moe_layers().values())
    if dims.ep > 1 and not moes:
        raise UserError("dist.ep: > 1 needs MoE layers (model.decoder.moe)")
    blocks = [block for blocks in block_lists(model) for block in blocks]
    shard_blocks(model, moes, blocks, cfg, dims, device, traffic)


def compute_dtype(cfg: RunConfig, device: torch.device, sharded: bool = True) -> torch.dtype:
    """The dtype an FSDP2-sharded block computes (and hands on) in: bf16 parameters on CUDA with
    train.dtype bfloat16 (the MixedPrecisionPolicy below; on CPU with dist.cpu_mixed_precision), else
    fp32. Unsharded fp32 parameters keep the residual stream fp32 under autocast too (a bf16 matmul
    output added to it is promoted)."""
    on = device.type == "cuda" or cfg.dist.cpu_mixed_precision
    bf16 = sharded and on and cfg.train.dtype == "bfloat16"
    return torch.bfloat16 if bf16 else torch.float32


def shard_blocks(root: nn.Module, moes: list[nn.Module], blocks: list[nn.Module], cfg: RunConfig,
                 dims: ParallelDims, device: torch.device, traffic: Traffic | None) -> None:
    """FSDP2 of a whole model or of one pipeline stage (`root`): with dist.ep > 1 first the routed
    experts of `moes` Shard(0) over ep and `fully_shard` on the expert mesh's (dp_replicate, efsdp[ x tp])
    part, then each of `blocks` and finally `root` on the dense (dp_replicate, fsdp) mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"reshard_after_forward": cfg.dist.reshard_after_forward}
    if compute_dtype(cfg, device) == torch.bfloat16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if dims.ep > 1 and moes:
        experts = dims.expert_mesh(device.type)
        try:
            stage = dims.stage_mesh(device.type).get_group() if dims.pp > 1 else None  # None: the world
            shard_experts(moes, experts["ep"], traffic, stage)
        except ValueError as e:
            raise UserError(str(e)) from None
        fsdp_mesh = dims.expert_fsdp_mesh(device.type)  # (dp_replicate, efsdp[ x tp])
        for moe in moes:
            fully_shard(moe.experts, mesh=fsdp_mesh, **kwargs)
    dense = _fsdp_part(dims.dense_mesh(device.type), "fsdp")
    for block in blocks:
        if (parts := replicated_parts(block)) is None:
            fully_shard(block, mesh=dense, **kwargs)
        else:
            _shard_tp_layer(block, parts, dense, dims, device, kwargs)
    # the root stays gathered after forward (FSDP2's default for a root): backward needs it first
    fully_shard(root, mesh=dense, **{**kwargs, "reshard_after_forward": None})


def _shard_tp_layer(layer: nn.Module, parts: tuple, dense, dims: ParallelDims,
                    device: torch.device, kwargs: dict) -> None:
    """A tp-split decoder layer (tensor_parallel.py): its plain parameters over the dense mesh (dp x
    tp: their gradients are partial per tp rank), the routed experts a unit of their own and the
    small ones (norms, router) one unit kept gathered from forward to backward (a list's modules
    each reshard after their own forward: one all-gather each); then the layer over the dp dims
    only, its matmul weights Shard over tp beneath. Those weights' gradients
    leave backward already summed over the tp group's tokens, so FSDP divides their sum by dp x tp
    (the world's loss scale) instead of averaging over dp: on gloo, which has no PREMUL_SUM, by a
    plain sum and a divide. (Not when the shard group is one rank: torch 2.13 then divides its copy
    by the factor and divides again after a forced-sum reduce.)"""
    from torch.distributed.fsdp import fully_shard

    small, experts = parts
    if experts is not None:
        fully_shard(experts, mesh=dense, **kwargs)
    fully_shard(small, mesh=dense, **{**kwargs, "reshard_after_forward": False})
    mesh = dims.layer_fsdp_mesh(device.type)
    fully_shard(layer, mesh=mesh, **kwargs)
    layer.set_gradient_divide_factor(float(mesh.size() * dims.tp))
    layer.set_force_sum_reduction_for_comms(device.type != "cuda" and dims.dp_shard * dims.cp > 1)


def _fsdp_part(mesh, shard_dim: str):
    """FSDP2's mesh: (dp_replicate, shard_dim) for HSDP, else the shard dim alone (plain FSDP)."""
    return mesh["dp_replicate", shard_dim] if mesh["dp_replicate"].size() > 1 else mesh[shard_dim]


@torch.no_grad()
def scale_expert_grads(model: MultimodalModel, dims: ParallelDims) -> None:
    """Divide the routed experts' gradients by ep (see the module docstring); after the last
    micro-batch's backward, before clipping."""
    if dims.ep == 1:
        return
    for moe in model.moe_layers().values():
        for p in moe.experts.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / dims.ep)


def grad_sync(model: nn.Module, env: DistEnv, last: bool):
    """Context for one micro-batch: gradients are reduced across ranks only on the last one.

    FSDP2: no reduce-scatter and no resharding after backward before the last micro-batch
    (the unsharded gradients accumulate locally); DDP: `no_sync`.
    """
    if not env.distributed:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDPModule
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (over all shards on all ranks) as a 0-dim tensor (no host read), the
    gradients clipped to `max_norm` (0: no clip).

    Gradients on different meshes (dense FSDP and the experts') cannot meet in one DTensor op:
    the norm is taken per mesh and the squares summed."""
    clip = max_norm or float("inf")
    params = [p for p in model.parameters() if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, clip).detach()
    total = global_norm([p.grad for p in params])
    for group in _by_mesh(params, lambda p: p.grad).values():
        torch.nn.utils.clip_grads_with_norm_(group, clip, total)
    return total.detach()


def global_norm(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """L2 norm of `tensors` (plain, or DTensors on any meshes) over all shards on all ranks: the norm
    per mesh, the squares summed. A collective for DTensors: every rank calls it alike. With none,
    0 on `device` (the run's: a result that goes into a collective must live where its group does)."""
    if not tensors:
        return torch.zeros((), device=device)
    norms = [_mesh_norm(group) for group in _by_mesh(tensors).values()]
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()


def _by_mesh(items: list, tensor=lambda t: t) -> dict:
    """`items` grouped by the device mesh of `tensor(item)` (None: a plain tensor), in first-seen order."""
    groups: dict = {}
    for item in items:
        groups.setdefault(getattr(tensor(item), "device_mesh", None), []).append(item)
    return groups


def _mesh_norm(group: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of one mesh's tensors: DTensor's partial norm made full, except on the experts'
    mesh under tp, (efsdp x tp, ep), whose dims DTensor's redistribution cannot flatten into one
    group (torch 2.13 raises KeyError): there the local shards' squares are summed by hand over
    every mesh dim that shards them. (Only there: by hand, a mesh whose groups were resolved by
    name in an earlier fake process group, as `mmtrain plan`'s successive plans make, fails.)"""
    if not isinstance(group[0], DTensor):
        return torch.nn.utils.get_total_norm(group, 2.0)
    mesh = group[0].device_mesh
    if not any(name.endswith("_tp") for name in mesh.mesh_dim_names or ()):
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    sq = torch.nn.utils.get_total_norm([t.to_local() for t in group], 2.0).square()
    for d in range(mesh.ndim):
        if any(not t.placements[d].is_replicate() for t in group):
            dist.all_reduce(sq, group=mesh.get_group(d))
    return sq.sqrt()
