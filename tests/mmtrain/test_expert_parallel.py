"""The expert-parallel dispatcher against the local one (gloo, 2 and 4 ranks): the same outputs,
input gradients and router/shared gradients on every rank, and expert gradients equal to the sum
of every rank's local gradients for the experts it holds -- on skewed loads (ranks that receive
no row), ranks whose tokens are all padding (they send none), and under activation checkpointing.
This file is also the worker: `torchrun ... test_expert_parallel.py`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from mmtrain.models.moe import MoE, MoEConfig
from mmtrain.parallel.comm import Traffic
from mmtrain.parallel.expert_parallel import shard_experts

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve()


@pytest.mark.parametrize("nproc", [2, 4])
def test_all_to_all_dispatch_equals_local_dispatch(nproc: int) -> None:
    from dist_runs import launch

    launch([str(HERE)], nproc=nproc, timeout=120)


def _inputs(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x_BSD = torch.randn(2, 12, 32, generator=gen)
    mod_BS = torch.randint(0, 3, (2, 12), generator=gen)
    real_BS = torch.rand(2, 12, generator=gen) > 0.3  # some padding everywhere
    if rank == world - 1:
        real_BS[:] = False  # all padding: this rank sends no row
    return x_BSD, mod_BS, real_BS


def _step(moe: MoE, x_BSD, mod_BS, real_BS, g_BSD) -> tuple[torch.Tensor, torch.Tensor]:
    x_BSD = x_BSD.clone().requires_grad_(True)
    y_BSD, aux = checkpoint(moe, x_BSD, mod_BS, real_BS, use_reentrant=False)
    ((y_BSD * g_BSD).sum() + aux["moe_seq_balance"] + aux["router_z"]).backward()
    return y_BSD.detach(), x_BSD.grad


def _check(bias_E: torch.Tensor, rank: int, world: int, travels: bool) -> None:
    torch.manual_seed(0)
    local = MoE(32, MoEConfig(n_routed=8, top_k=2, n_shared=1, expert_dim=16, dispatch="batched"))
    local.router.expert_bias_E.copy_(bias_E)
    ep = copy.deepcopy(local)
    traffic = Traffic()
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    shard_experts([ep], mesh, traffic)
    x_BSD, mod_BS, real_BS = _inputs(rank, world)
    g_BSD = torch.randn(x_BSD.shape, generator=torch.Generator().manual_seed(7 + rank))
    y_l, dx_l = _step(local, x_BSD, mod_BS, real_BS, g_BSD)
    y_e, dx_e = _step(ep, x_BSD, mod_BS, real_BS, g_BSD)
    torch.testing.assert_close(y_e, y_l, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx_e, dx_l, atol=1e-6, rtol=1e-5)
    for name in ("router.weight", "shared.w_in.weight", "shared.w_out.weight"):
        torch.testing.assert_close(ep.get_parameter(name).grad, local.get_parameter(name).grad, msg=name)
    L = 8 // world
    for name in ("w_in_EDF2", "w_out_EFD"):
        total = local.experts.get_parameter(name).grad.clone()
        dist.all_reduce(total)  # every rank's rows for these experts
        mine = ep.experts.get_parameter(name).grad.to_local()
        torch.testing.assert_close(mine, total[rank * L:(rank + 1) * L], atol=1e-6, rtol=1e-5, msg=name)
    sent = torch.tensor([traffic.sent.get("ep_all_to_all", 0)])
    dist.all_reduce(sent)
    assert (sent.item() > 0) == travels  # counted when rows leave their rank, and only then


def worker() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _check(torch.zeros(8), rank, world, travels=True)  # balanced-ish routing
    skew = torch.full((8,), -10.0)
    skew[:2] = 10.0  # every row goes to experts 0 and 1: rank 0's; the others receive none
    _check(skew, rank, world, travels=world > 2)  # with 2 ranks rank 0 keeps all (rank 1: padding)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(worker())
