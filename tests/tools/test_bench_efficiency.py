"""bench_efficiency's breakdown of the CPU tile kernel: what it counts must add up."""

import torch

from mmtrain.models.attention import tiles
from tools.bench import bench_efficiency as be


def test_breakdown_counts_every_kept_pair_and_restores_the_kernel():
    torch.manual_seed(0)
    fwd, bwd = tiles._FWD, tiles._BWD
    args = be.parse_args(["--breakdown", "--seq", "1024", "--repeats", "1"])
    r = be.breakdown(1024, "default", args)
    assert tiles._FWD is fwd and tiles._BWD is bwd  # the timers are taken off again
    assert r["kept"] > 0 and r["computed"] >= r["kept"]  # a call evaluates at least the pairs kept
    assert r["computed"] < 1.5 * r["kept"]  # masked work is the own block's upper half and span edges
    assert 0 < r["kernel"] <= r["total"]
    kinds = r["kinds"]
    for (direction, kind), (n, _, pairs) in kinds.items():  # the backward runs the forward's calls
        other = kinds[("bwd" if direction == "fwd" else "fwd", kind)]
        assert other[0] == n and other[2] == pairs
