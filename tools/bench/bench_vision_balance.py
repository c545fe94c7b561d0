"""The vision encoder's per-step cost across ranks without and with `vision.balance`: arithmetic on
real batches' patch counts under the cost model a n^2 + b n + c (no timing, no model).

    python -m tools.bench.bench_vision_balance --config configs/video_heavy.yaml --ranks 8 16 32 64 --steps 10
    python -m tools.bench.bench_vision_balance --config configs/video_heavy.yaml --cp 2 --steps 10
    (--quick: 8 ranks, 2 steps -- a smoke run)

Each rank's batch of a step is the next batch of one loader (independent draws of the same
mixture, as the dp ranks' loaders are). With `--cp C`, C consecutive ranks share one batch: without
balancing each of them encodes all of its media (C times the work); with `dp` each cp rank still
encodes all media of its rows, balanced over the ranks of its cp coordinate; with `dp_cp` each
medium is encoded once. Per rank count: the mean over steps of max / mean rank cost (1.0: perfectly
even, the mean taken over the work actually needed) and of the max rank cost relative to none.
"""

from __future__ import annotations

import argparse

from mmtrain.config import load_config
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.parallel.vision_plan import assign, rank_costs
from mmtrain.run_config import RunConfig


def step_costs(sizes_U: list[list[int]], cp: int, cost: tuple[float, float, float]) -> tuple[list, list]:
    """-> (unbalanced, balanced) cost per rank of one step; sizes_U: patches per medium per cp group."""
    unbal = [rank_costs([s], [[0] * len(s)], 1, *cost)[0] for s in sizes_U for _ in range(cp)]
    G = len(sizes_U) * cp
    return unbal, rank_costs(sizes_U, assign(sizes_U, G, *cost), G, *cost)


def dp_costs(sizes_U: list[list[int]], cp: int, cost: tuple[float, float, float]) -> list[float]:
    """`vision.balance: dp` under cp: balanced over the U ranks of one cp coordinate, and every cp
    coordinate does the same (each cp rank encodes all media of its rows)."""
    U = len(sizes_U)
    return [c for c in rank_costs(sizes_U, assign(sizes_U, U, *cost), U, *cost) for _ in range(cp)]


def summarize(steps: list[list[list[int]]], cp: int, cost: tuple[float, float, float]) -> dict:
    """Mean over steps of max/mean (the needed work's mean) without and with balancing, and max ratio."""
    out = {"unbalanced": 0.0, "balanced": 0.0, "max_ratio": 0.0, "dp": 0.0}
    for sizes_U in steps:
        unbal, bal = step_costs(sizes_U, cp, cost)
        mean = sum(bal) / len(bal)  # each medium once: the work there is to do
        if mean == 0:
            continue
        out["unbalanced"] += max(unbal) / mean / len(steps)
        out["balanced"] += max(bal) / mean / len(steps)
        out["max_ratio"] += max(bal) / max(unbal) / len(steps)
        out["dp"] += (max(dp_costs(sizes_U, cp, cost)) / mean if cp > 1 else max(bal) / mean) / len(steps)
    return out


def read_sizes(config: str, n_batches: int, overrides: list[str] = ()) -> list[list[int]]:
    cfg = load_config(RunConfig, config, list(overrides))
    it = iter(build_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), "train"))
    return [next(it).grid_thw_M3.prod(-1).tolist() for _ in range(n_batches)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="default 8 16 32 64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--cost", type=float, nargs=3, default=None, help="a b c (default: vision.cost_*)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--quick", action="store_true", help="8 ranks (or --ranks), 2 steps: a smoke run")
    args = ap.parse_args(argv)
    args.ranks = args.ranks or ([8] if args.quick else [8, 16, 32, 64])
    args.steps = 2 if args.quick else args.steps
    if any(R % args.cp for R in args.ranks):
        raise SystemExit(f"--ranks: each must be a multiple of --cp {args.cp} (got {args.ranks})")
    cfg = load_config(RunConfig, args.config, args.set)
    cost = tuple(args.cost) if args.cost else (cfg.vision.cost_a, cfg.vision.cost_b, cfg.vision.cost_c)
    groups = max(args.ranks) // args.cp
    batches = read_sizes(args.config, args.steps * groups, args.set)
    bal = "dp_cp" if args.cp > 1 else "dp"
    print(f"{args.config}: cost {cost[0]:g} n^2 + {cost[1]:g} n + {cost[2]:g}, cp {args.cp}, "
          f"{args.steps} steps")
    print(f"{'ranks':>6} {'max/mean none':>14}" + (f" {'dp':>6}" if args.cp > 1 else "")
          + f" {bal:>6} {f'max {bal}/none':>14}")
    for R in args.ranks:
        U = R // args.cp
        steps = [batches[s * U:(s + 1) * U] for s in range(args.steps)]
        r = summarize(steps, args.cp, cost)
        print(f"{R:>6} {r['unbalanced']:>14.3f}" + (f" {r['dp']:>6.3f}" if args.cp > 1 else "")
              + f" {r['balanced']:>6.3f} {r['max_ratio']:>14.3f}")


if __name__ == "__main__":
    main()
