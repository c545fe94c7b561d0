"""Context parallelism's collectives: the `ContextComm` that models/attention/context.py calls,
over the `cp` group of the mesh (mmtrain/parallel/dims.py: cp is the innermost dim, so a group is
cp consecutive ranks that read the same rows), and the rank's chunk of a batch's targets.

Gradients: an all-gather's backward sums every rank's gradient for this rank's chunk (an
all-reduce then a slice on gloo, which has no reduce-scatter; reduce-scatter elsewhere); an
all-reduce's backward is an all-reduce; the fetch exchange runs its reverse all-to-all.
Bytes sent to other ranks are counted in `Traffic` by kind (cp_kv_all_gather, cp_block_sums,
cp_kv_fetch, cp_row_sums).

Legend: B rows, H heads, s the rank's tokens, S = P * s, D head dim, P ranks of the group.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.models.attention.context import ContextShard
from mmtrain.parallel.comm import AllToAll, Traffic

Tensor = torch.Tensor


class CPComm:
    def __init__(self, group: dist.ProcessGroup, traffic: Traffic | None = None) -> None:
        self.group, self.traffic = group, traffic
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.gloo = dist.get_backend(group) == "gloo"

    def _count(self, kind: str, nbytes: int) -> None:
        if self.traffic is not None:
            self.traffic.add(kind, nbytes)

    def gather_seq(self, x_BHsD: Tensor) -> Tensor:
        self._count("cp_kv_all_gather", x_BHsD.numel() * x_BHsD.element_size() * (self.size - 1))
        return _GatherSeq.apply(x_BHsD, self)

    def sum(self, x: Tensor) -> Tensor:
        self._count("cp_row_sums", x.numel() * x.element_size() * (self.size - 1))
        return _Sum.apply(x, self.group)

    def sum_(self, x: Tensor) -> Tensor:
        self._count("cp_block_sums", x.numel() * x.element_size() * (self.size - 1))
        dist.all_reduce(x, group=self.group)
        return x

    def gather_flags(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, x.to(torch.uint8).contiguous(), group=self.group)
        return torch.stack(parts).bool()

    def exchange(self, x_nF: Tensor, out_P: list[int], in_P: list[int]) -> Tensor:
        return AllToAll.apply(x_nF, out_P, in_P, self.group, self._count_fetch)

    def _count_fetch(self, x_nF: Tensor, in_P: list[int]) -> None:
        self._count("cp_kv_fetch", (sum(in_P) - in_P[self.rank]) * x_nF[:1].numel() * x_nF.element_size())


class _GatherSeq(torch.autograd.Function):
    """(B, H, s, D) on each rank -> (B, H, P * s, D), the chunks in rank order."""

    @staticmethod
    def forward(ctx, x_BHsD: Tensor, comm: CPComm) -> Tensor:
        ctx.comm = comm
        parts = [torch.empty_like(x_BHsD) for _ in range(comm.size)]
        dist.all_gather(parts, x_BHsD.contiguous(), group=comm.group)
        return torch.cat(parts, 2)

    @staticmethod
    def backward(ctx, g_BHSD: Tensor):
        comm = ctx.comm
        s = g_BHSD.shape[2] // comm.size
        if comm.gloo:  # no reduce-scatter on gloo
            g_BHSD = g_BHSD.contiguous().clone()
            dist.all_reduce(g_BHSD, group=comm.group)
            return g_BHSD.narrow(2, comm.rank * s, s), None
        out = torch.empty_like(g_BHSD.narrow(2, 0, s)).contiguous()
        dist.reduce_scatter(out, [c.contiguous() for c in g_BHSD.split(s, 2)], group=comm.group)
        return out, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def context_shard(dims, device: torch.device, seq_len: int, traffic: Traffic | None) -> ContextShard | None:
    """This rank's chunk of every row and its group's collectives; None without context parallelism.
    Under tensor parallelism the chunk is the (cp, tp) group's: sequence parallelism
    (mmtrain/parallel/tensor_parallel.py) splits each cp chunk between the tp ranks."""
    if dims.seq_size == 1:
        return None
    mesh = dims.cp_mesh(device.type)["cp"] if dims.tp == 1 else dims.seq_mesh(device.type)["seq"]
    # span: a tp group's attention projects its ranks' chunks together (their rotary too)
    return ContextShard(CPComm(mesh.get_group(), traffic), seq_len, span=dims.tp)


def local_targets(batch: PackedBatch, shard: ContextShard) -> PackedBatch:
    """The batch with every per-token field narrowed to the rank's chunk (the targets its logits
    predict); the media stay whole (the vision tower encodes them all on every rank)."""
    per_token = {f.name: shard.local(getattr(batch, f.name)) for f in fields(batch) if f.name.endswith("_BS")}
    return replace(batch, **per_token, pos_ids_3BS=shard.local(batch.pos_ids_3BS, dim=2))
