"""The vision encoder's modelled cost per rank under each `vision.balance` mode, for the planned
batch (the same rows on every data-parallel rank).

Cost of a medium of n patches: `vision.cost_a` n^2 + `cost_b` n + `cost_c` (the balancer's own
model; only ratios matter). The assignment is the balancer's (mmtrain/parallel/vision_plan.py:
`assign`, `rank_costs`), on the sizes every rank would gather:
    none    each rank encodes all the media of its rows (under cp: every cp rank, the whole row's)
    dp      LPT over the dp_size ranks of one (cp, tp) coordinate (units of one rank)
    dp_cp   LPT over the world, units of the cp x tp ranks holding the same rows (only when cp x tp > 1)
"""

from __future__ import annotations

from mmtrain.parallel.vision_plan import assign, rank_costs


def vision_costs(vision_cfg, media_N: list[int], mesh: dict) -> dict:
    """-> {"balance": the configured mode, "modes": {mode: {"max", "mean", "max_over_mean"}}}: the
    encoder cost of the busiest rank and of the mean rank, per mode."""
    cost = (vision_cfg.cost_a, vision_cfg.cost_b, vision_cfg.cost_c)
    seq = mesh.get("cp", 1) * mesh.get("tp", 1)  # ranks holding the same rows
    dp = mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1)
    groups = {"none": None, "dp": (dp, 1)} | ({"dp_cp": (dp * seq, seq)} if seq > 1 else {})
    modes = {}
    for mode, group in groups.items():
        if group is None or not media_N:
            per_rank = [rank_costs([media_N], [[0] * len(media_N)], 1, *cost)[0]]
        else:
            ranks, unit = group
            sizes_U = [list(media_N) for _ in range(ranks // unit)]
            per_rank = rank_costs(sizes_U, assign(sizes_U, ranks, *cost), ranks, *cost)
        top, mean = max(per_rank), sum(per_rank) / len(per_rank)
        modes[mode] = {"max": top, "mean": mean, "max_over_mean": top / mean if mean else 1.0}
    return {"balance": vision_cfg.balance, "cost": list(cost), "modes": modes}
