"""What the objectives cost: train-step time of GradNorm and of the visual SSL term against static
weights, and the collapse diagnostics against the training they interrupt -- in one process.

    python -m tools.bench.bench_objectives [--config configs/tiny.yaml] [--steps 10] [--rounds 3]

Each variant is a Trainer on the same config, seed and data (one per variant, built up front).
Rounds interleave the variants (`--steps` steps each) so that machine load drifts hit all of them;
the first round is warm-up and not counted. The diagnostics cost is one `run_diagnostics` call
over `diagnostics.batches` val batches, as a fraction of the `diagnostics.every` steps it follows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmtrain.config import load_config
from mmtrain.evaluation.diagnostics import run_diagnostics
from mmtrain.loop.trainer import Trainer
from mmtrain.run_config import RunConfig

VARIANTS = {
    "static": [],
    "gradnorm": ["loss.balancer.kind=gradnorm"],
    "visual_ssl": ["model.vision.ssl_head=true", "loss.visual_ssl.weight=1.0"],
}


def build(config: Path, overrides: list[str], run_dir: Path) -> Trainer:
    cfg = load_config(RunConfig, config, [*overrides, f"run_dir={run_dir}", "data.num_workers=0"])
    return Trainer(cfg, verbose=False)


def time_steps(trainer: Trainer, it, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(it)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    ap.add_argument("--steps", type=int, default=10, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the config's)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build(args.config, over, Path(tmp) / name) for name, over in VARIANTS.items()}
        if args.threads:
            torch.set_num_threads(args.threads)
        iters = {name: iter(t.train_loader) for name, t in trainers.items()}
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for r in range(args.rounds + 1):
            for name, trainer in trainers.items():
                s = time_steps(trainer, iters[name], args.steps)
                if r:
                    times[name].append(s)
        static = trainers["static"]
        diag_cfg = static.cfg.diagnostics
        batches = static.val_batches()[:diag_cfg.batches]
        diag_s = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            run_diagnostics(static.model, batches, static.device, diag_cfg, static.step,
                            raw_model=static.raw_model)
            diag_s.append(time.perf_counter() - t0)
    base = statistics.median(times["static"])
    print(f"{args.config}: {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    print("| variant | step (ms, median) | vs static |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.0f} | {med / base:.2f}x |")
    every = diag_cfg.every or 100
    d = statistics.median(diag_s)
    print(f"| diagnostics ({diag_cfg.batches} batches) | {d * 1e3:.0f} per call | "
          f"{d / (every * base):.1%} of {every} static steps |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
