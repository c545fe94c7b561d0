"""What the data loader costs a training step: `Trainer.train_step` fed by the live loader (its
worker process decoding and packing beside the step) against the same step fed batches taken
from that loader beforehand (the worker idle, its prefetch queue full), in the same run.

    python -m tools.bench.bench_train_step --config configs/tiny.yaml --steps 30 --rounds 2

Rounds alternate: `--steps` live steps, then `--steps` batches are drawn, the worker gets
`--settle` seconds to refill its queue, and those batches are trained on. On a 2-core machine
the gap is the worker's decoding competing with the step's 2 threads, which a loader benchmark
alone (tools/bench/bench_loader.py) does not show. Only `train_step` is timed: evaluation,
diagnostics and checkpoints belong to the run loop; the run directory is temporary.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from mmtrain.config import load_config
from mmtrain.loop.trainer import Trainer
from mmtrain.parallel.distributed import init_distributed
from mmtrain.run_config import RunConfig
from tools.bench.table import print_ratio_table


def _timed(trainer: Trainer, batches, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        trainer.train_step(batches)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds for the worker to refill its queue")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        over = [f"run_dir={run_dir}", "train.eval_every=0", "train.ckpt_every=0"]
        cfg = load_config(RunConfig, args.config, over + args.overrides)
        trainer = Trainer(cfg, verbose=False, env=init_distributed(cfg.dist, cfg.train.device))
        live = iter(trainer.train_loader)
        _timed(trainer, live, args.warmup)
        times: dict[str, list[float]] = {"live loader": [], "batches drawn beforehand": []}
        for _ in range(args.rounds):
            times["live loader"].append(_timed(trainer, live, args.steps))
            drawn = [next(live) for _ in range(args.steps)]
            time.sleep(args.settle)
            times["batches drawn beforehand"].append(_timed(trainer, iter(drawn), args.steps))
    print(f"# {args.config}: {cfg.data.batch_size} x {cfg.data.seq_len} tokens, {cfg.data.num_workers} "
          f"loader worker(s), {cfg.train.threads} threads; medians of {args.rounds} rounds "
          f"of {args.steps} steps")
    print_ratio_table("step fed by", "step", times, "live loader")
    gap = statistics.median(times["live loader"]) - statistics.median(times["batches drawn beforehand"])
    print(f"# the live loader adds {gap * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
