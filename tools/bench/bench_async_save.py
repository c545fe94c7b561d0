"""What an asynchronous checkpoint buys the loop: the trainer's steps with a save every `--every`
steps, written synchronously (`train.async_save: false`) or staged and written in the background
(`true`), against the same steps without saves, in the same process.

    python -m tools.bench.bench_async_save --config configs/tiny.yaml --steps 12 --every 2 --rounds 2

Each side trains `--steps` steps on batches drawn beforehand (the loader is not what is measured)
and times them with their saves, the last background write included (every save is committed
before a side's clock stops). `blocked` is what one save call holds the loop: the whole save when
synchronous, the staging (a CPU copy of model and optimizer, the other parts serialised) when
asynchronous. Rounds alternate the sides; the run directory is temporary.
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

SIDES = {"no checkpoint": None, "sync save": False, "async save": True}


def _side(trainer: Trainer, batches: list, every: int, background: bool | None) -> tuple[float, list[float]]:
    """-> (seconds per step, seconds each save call blocked the loop)."""
    blocked = []
    t0 = time.perf_counter()
    for i in range(1, len(batches) + 1):
        trainer.train_step(iter(batches[i - 1:i]))
        trainer.checkpointer.poll()  # as fit does at every step boundary
        if background is not None and i % every == 0:
            trainer.cfg.train.async_save = background
            t = time.perf_counter()
            trainer.save_checkpoint()
            blocked.append(time.perf_counter() - t)
    trainer.checkpointer.poll(wait=True)
    return (time.perf_counter() - t0) / len(batches), blocked


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per side per round")
    ap.add_argument("--every", type=int, default=2, help="a save every this many steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        over = [f"run_dir={run_dir}", "train.eval_every=0", "train.ckpt_every=0", "train.keep_last=1"]
        cfg = load_config(RunConfig, args.config, over + args.overrides)
        trainer = Trainer(cfg, verbose=False, env=init_distributed(cfg.dist, cfg.train.device))
        live = iter(trainer.train_loader)
        batches = [next(live) for _ in range(args.steps)]
        _side(trainer, batches[:2], 1, True)  # warm-up: first steps, first save of each kind
        _side(trainer, batches[:2], 1, False)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        blocked: dict[str, list[float]] = {side: [] for side in SIDES if SIDES[side] is not None}
        for _ in range(args.rounds):
            for side, background in SIDES.items():
                per_step, held = _side(trainer, batches, args.every, background)
                times[side].append(per_step)
                blocked.get(side, []).extend(held)
        mib = sum(f.stat().st_size for f in trainer.checkpointer.latest().rglob("*") if f.is_file()) / 2**20
    print(f"# {args.config}: {trainer.raw_model.num_params()}, checkpoint {mib:.1f} MiB, a save every "
          f"{args.every} steps; medians of {args.rounds} rounds of {args.steps} steps")
    print_ratio_table("steps with", "step", times, "sync save")
    for side, held in blocked.items():
        print(f"# {side}: the save call holds the loop {statistics.median(held) * 1e3:.1f} ms (median)")


if __name__ == "__main__":
    main()
