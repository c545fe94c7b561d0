"""Agreeing on a data failure across the ranks of a job.

A `DataError` (failure rate exceeded, a worker without samples, a dead loader worker) happens on
one rank; the others would go on into the next collective of the step and wait out its timeout
(600 s by default). The train loader therefore agrees on every batch: one all-reduce of a small
integer (the lowest failing rank, if any), and only on failure a broadcast of that rank's message,
so that every rank raises the same error at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def rank_sync() -> Callable[[str | None], str | None] | None:
    """failure (or None) on this rank -> the failure of the lowest failing rank, the same on every
    rank; None when this process is not one rank of several (nothing to agree on)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def sync(failure: str | None) -> str | None:
        first = torch.tensor([rank if failure is not None else world], device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        src = int(first.item())
        if src == world:
            return None
        box = [failure]
        dist.broadcast_object_list(box, src=src, device=device if nccl else None)
        return f"rank {src}: {box[0]}"

    return sync
