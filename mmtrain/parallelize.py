"""Parallelism applied from outside the model files: activation checkpointing, torch.compile and
FSDP2 (or DDP) over the per-block ModuleLists `model.vision.blocks` and `model.decoder.layers`.

Order (as torchtitan): checkpoint each block, compile each block, then `fully_shard` each block
and finally the root (which holds the embeddings, the vision patch embedding and projector,
the final norm and the LM head). On CUDA with bf16, FSDP2 gathers weights in bf16 and reduces
gradients in fp32 (MixedPrecisionPolicy); the optimizer keeps fp32 shards.

A single process gets only checkpointing and compile: no wrapper, no collective.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mmtrain.distributed import DistEnv
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig


def block_lists(model: MultimodalModel) -> list[nn.ModuleList]:
    return [model.vision.blocks, model.decoder.layers]


def build_model(cfg: RunConfig, env: DistEnv, device: torch.device) -> tuple[MultimodalModel, nn.Module]:
    """-> (the MultimodalModel, the module to call forward on: itself, or its DDP wrapper).

    FSDP on CUDA builds on the meta device and initialises the shards (`dist.meta_init`), so no
    rank ever holds the full model; elsewhere every rank builds the full model from the same
    seed and FSDP keeps its shard (on CPU, DTensor random init would repeat one shard's values).
    """
    fsdp = env.distributed and cfg.dist.strategy == "fsdp"
    meta = fsdp and cfg.dist.meta_init and device.type == "cuda"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = MultimodalModel(cfg.model)
    if not fsdp:
        model = model.to(device)
    _apply_checkpointing_and_compile(model, cfg, device)
    if fsdp:
        _apply_fsdp(model, cfg, env, device)
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
    if cfg.dist.activation_checkpointing:
        prime_probes(device)
    for blocks in block_lists(model):
        for i, block in enumerate(blocks):
            if cfg.dist.activation_checkpointing:
                checkpoint_forward(block)
            if cfg.dist.compile:
                blocks[i] = torch.compile(block)  # state-dict keys gain `_orig_mod.`; DCP strips it


def prime_probes(device: torch.device) -> None:
    """models/moe_dispatch probes `torch._grouped_mm` (forward + backward, cached) on first use.
    Inside a checkpointed block that first use saves tensors its recomputation does not, and
    torch.utils.checkpoint rejects the step; so run the probe up front (RNG left untouched)."""
    from mmtrain.models.moe_dispatch import grouped_mm_supported

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for dtype in (torch.float32, torch.bfloat16):
            grouped_mm_supported(device.type, dtype)


def checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward. An instance-level forward keeps parameter names (and so
    checkpoints) identical with and without checkpointing; hooks such as FSDP's stay outside."""
    inner = block.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def _apply_fsdp(model: MultimodalModel, cfg: RunConfig, env: DistEnv, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (env.world_size,))
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": cfg.dist.reshard_after_forward}
    if device.type == "cuda" and cfg.train.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


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


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm (over all shards on all ranks), clipped to `max_norm` (0: no clip)."""
    clip = max_norm or float("inf")
    params = [p for p in model.parameters() if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(total, DTensor):  # partial norms on each rank -> the global norm everywhere
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, clip, total)
    return float(total)
