"""Expert parallelism: each rank of an `ep` group holds E / ep routed experts of every MoE layer,
and the rows routed to an expert travel to its rank and back by uneven all-to-all.

`shard_experts` turns each layer's expert weights into Shard(0) DTensors on the `ep` mesh (so DCP
saves and reshards them like any other DTensor) and installs `AllToAllDispatcher` as the layer's
dispatcher: the model file keeps its seam (models/moe/dispatch.py) and knows nothing of ranks.

Every rank makes the same calls in the same order, whatever its batch: the layer first agrees on
its chunk count (`chunks`: the most any rank's tokens need, one all-reduce over all ranks), so a
rank with fewer tokens (the one-row eval pad batch, contrast copies, token weighting's rows)
dispatches empty chunks rather than leaving its peers waiting. One dispatch, per MoE layer and
token chunk:
    1. sort this rank's T*K rows by global expert (padding rows, the virtual expert, are dropped:
       never sent);
    2. all-to-all the (ep, E_loc) row counts, then the rows themselves (uneven splits; a rank may
       send or receive none);
    3. regroup the received rows from (source rank, local expert) to (local expert, source rank)
       order and run the local experts;
    4. undo 3 and 2 (the reverse all-to-all), weight and sum each token's K rows where it lives.
Autograd runs the same all-to-alls backwards, so activation checkpointing replays them in order.

Host syncs, all inherent: the agreed chunk count (a loop bound) and, per dispatch, the split sizes
(all_to_all_single takes them as host lists: one `.tolist()` of the send and receive counts).

Legend: T tokens, K top_k, R = T*K rows, n rows of real experts, E experts, L = E / ep local
experts, P ep ranks, D model dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.models.chunked import chunk_count
from mmtrain.models.moe import MoE
from mmtrain.models.moe.dispatch import combine, sort_by_expert
from mmtrain.parallel.comm import AllToAll, Traffic

Tensor = torch.Tensor


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, n_experts: int, traffic: Traffic | None = None,
                 stage_group: dist.ProcessGroup | None = None) -> None:
        self.group, self.P = group, dist.get_world_size(group)
        self.stage_group = stage_group  # the chunk count's (None: the world)
        self.me, self.E = dist.get_rank(group), n_experts
        self.L = n_experts // self.P
        self.traffic = traffic

    def chunks(self, T: int, chunk: int, device: torch.device) -> int:
        """The chunk count of every rank: the most any rank's T needs. Over the stage's ranks, not just
        the ep group: each chunk also calls the experts module, whose FSDP unshard all-gathers over the
        expert mesh's other dims (efsdp, dp_replicate), which join other ep groups. Not over the world:
        under dist.pp the other stages run other layers and never join (a hang at PP x EP x ffn_chunk)."""
        if chunk <= 0:
            return 1  # one dispatch per layer on every rank
        n = torch.tensor([chunk_count(T, chunk)], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.stage_group)
        return int(n.item())  # host sync: a loop bound

    def __call__(self, experts: nn.Module, x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor) -> Tensor:
        rows = sort_by_expert(idx_TK, self.E)
        send_PL = rows.counts_E.view(self.P, self.L)
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL, send_PL.contiguous(), group=self.group)  # rows to expect
        send_P, recv_P = torch.stack([send_PL.sum(1), recv_PL.sum(1)]).tolist()  # host sync: the splits
        n = sum(send_P)
        x_nD = x_TD.index_select(0, rows.token_R[:n])  # real experts' rows only: padding stays home
        x_recv = self._exchange(x_nD, recv_P, send_P)
        order, counts_L = _by_local_expert(recv_PL, sum(recv_P))
        y_grouped = experts(x_recv.index_select(0, order), counts_L)
        y_recv = torch.empty_like(y_grouped).index_copy(0, order, y_grouped)  # back to arrival order
        y_nD = self._exchange(y_recv, send_P, recv_P)
        y_RD = torch.cat([y_nD, y_nD.new_zeros(rows.token_R.shape[0] - n, y_nD.shape[1])])
        return combine(y_RD, rows, w_TK, x_TD)

    def _exchange(self, x_ND: Tensor, out_P: list[int], in_P: list[int]) -> Tensor:
        """Uneven all-to-all with autograd: in_P[p] rows to rank p, out_P[p] rows from it."""
        return AllToAll.apply(x_ND, out_P, in_P, self.group, self._count)

    def _count(self, x_ND: Tensor, in_P: list[int]) -> None:
        if self.traffic is not None:  # rows to the other ranks (our own never leave)
            others = sum(in_P) - in_P[self.me]
            self.traffic.add("ep_all_to_all", others * x_ND[:1].numel() * x_ND.element_size())


def _by_local_expert(recv_PL: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The arrival order is (source rank, local expert); -> the permutation to (local expert,
    source rank) order and the rows per local expert. n: the rows received (known on the host, so
    repeat_interleave needs no sync)."""
    P, L = recv_PL.shape
    expert_n = torch.arange(L, device=recv_PL.device).repeat(P).repeat_interleave(recv_PL.reshape(-1),
                                                                                 output_size=n)
    return torch.argsort(expert_n, stable=True), recv_PL.sum(0)


def shard_experts(moes: list[MoE], ep_mesh, traffic: Traffic | None = None, stage_group=None) -> None:
    """Shard(0) the routed experts of each layer over `ep_mesh` and route their rows there.

    Every rank built the whole model from the same seed (or on the meta device): each keeps its
    own slice, with no communication."""
    from torch.distributed.tensor import DTensor, Shard

    P, me = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moes:
        if moe.cfg.n_routed % P:
            raise ValueError(f"dist.ep: {P} must divide model.decoder.moe.n_routed {moe.cfg.n_routed}")
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            mine = param.data.chunk(P)[me].clone()
            sharded = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.cfg.n_routed, traffic, stage_group)
