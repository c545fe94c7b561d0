"""VisionBalancer against each rank encoding its own media (gloo, 2 ranks, the real VisionEncoder):
the same visual tokens on every rank and the same encoder gradients summed over ranks -- with a rank
that holds no medium (it encodes the other's), with both ranks holding the same rows (a cp
group: each medium encoded once, its tokens on both), and with a rank that encodes nothing at all.
This file is also the worker.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmtrain.models.vision import VisionConfig, VisionEncoder
from mmtrain.parallel.comm import Traffic
from mmtrain.parallel.vision_balance import VisionBalancer

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve()


def test_balanced_encoding_equals_local_encoding() -> None:
    from dist_runs import launch

    launch([str(HERE)], nproc=2, timeout=120)


def _media(seed: int, grids: list[list[int]], patch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_M3 = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    n = int(grid_M3.prod(-1).sum())
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(seed)), grid_M3


def _grads(enc: VisionEncoder) -> torch.Tensor:
    g = torch.cat([p.grad.reshape(-1) for p in enc.parameters()])
    dist.all_reduce(g)
    return g


def _case(rank: int, grids: list[list[int]], unit: int, seed: int, moves: bool = True) -> None:
    torch.manual_seed(0)
    local = VisionEncoder(VisionConfig(dim=32, depth=1, n_heads=2, patch_size=4, out_norm=True), 24)
    bal = copy.deepcopy(local)
    patches_NP, grid_M3 = _media(seed, grids, local.cfg.patch_dim)
    traffic = Traffic()
    balancer = VisionBalancer(dist.group.WORLD, unit, (1e-3, 1.0, 0.0), traffic)
    ref_QO, got_QO = local(patches_NP, grid_M3), balancer(bal, patches_NP, grid_M3)
    torch.testing.assert_close(got_QO, ref_QO, rtol=1e-5, atol=1e-6)
    g_QO = torch.randn(ref_QO.shape, generator=torch.Generator().manual_seed(rank))  # per-rank upstream
    (ref_QO * g_QO).sum().backward()
    (got_QO * g_QO).sum().backward()
    got_G, ref_G = _grads(bal), _grads(local)
    rel = float((got_G - ref_G).norm() / ref_G.norm())
    assert rel < 1e-5, rel  # fp32 noise only: the media are batched otherwise
    sent = torch.tensor([traffic.sent.get("vision_tokens", 0)])
    dist.all_reduce(sent)
    assert (sent.item() > 0) == moves  # the media did move (or, with nothing to gain, stayed)
    balancer.on_step_end(None, None)  # the logged spread of the modelled cost over the ranks
    last = balancer.last
    bal, unbal = last["vision/cost_max_over_mean"], last["vision/cost_max_over_mean_unbalanced"]
    assert 1 <= bal < unbal if moves else bal == unbal


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    # rank 0: two images and a clip, rank 1: nothing -- rank 1 encodes some of rank 0's media
    _case(rank, [[1, 4, 4], [2, 4, 6], [1, 2, 2]] if rank == 0 else [], unit=1, seed=10 + rank)
    # one cp group of 2: the same rows on both ranks, the media split between them
    _case(rank, [[1, 4, 4], [2, 4, 6], [1, 2, 2], [1, 6, 4]], unit=2, seed=20)
    # one image in all: rank 1 encodes, sends and receives nothing, yet joins every collective
    _case(rank, [[1, 2, 2]] if rank == 0 else [], unit=1, seed=30, moves=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
