"""What the collapse cure's terms cost on a pipeline: train-step time of configs/tiny.yaml's recipe with
the mismatch contrast or token weighting, against the recipe alone, in one process and at PP(2) x 1F1B.

    python -m tools.bench.bench_pp_terms [--steps 12] [--config configs/tiny.yaml]    # needs make data

Each (mesh, variant) is its own launch (torchrun with 2 gloo processes for PP(2), 1 thread a process)
of `Trainer.train_step` on the config's data (grad_accum 1: at PP(2) each batch's 8 rows run as the
schedule's 2 micro-batches of 4), eval, diagnostics and checkpoints off, the static balancer; the
median step time after the first 2 steps. Ratios are against the recipe alone on the same mesh.
At PP the contrast pads every forward to twice its rows and token weighting runs two forward-only
passes through the stages (blank and real media) where one process runs one blank pass over the
media rows (docs/DISTRIBUTED.md): this measures what that costs on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "recipe": [],
    "contrast": ["loss.contrast.weight=1"],
    "token weighting": ["loss.token_weighting.strength=1"],
}
COMMON = ["train.eval_every=0", "train.ckpt_every=0", "diagnostics.every=0", "loss.balancer.kind=static",
          "train.threads=1", "data.num_workers=0"]


def child(config: str, sets: list[str], steps: int, out: str) -> None:
    """Under torchrun (PP) or alone: `steps` train steps; rank 0 writes the step times."""
    from mmtrain.config import load_config
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import exit_now, init_distributed, shutdown
    from mmtrain.run_config import RunConfig

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(RunConfig, config, [*sets, f"run_dir={tmp}/run"])
        env = init_distributed(cfg.dist, "cpu")
        trainer = Trainer(cfg, verbose=False, env=env)
        it = iter(trainer.train_loader)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(it)
            times.append(time.perf_counter() - t0)
        if env.is_main:
            Path(out).write_text(json.dumps(times))
        if env.distributed:
            shutdown()
            exit_now(0)


def launch(config: str, sets: list[str], nproc: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                                  if nproc > 1 else [])
        cmd += [str(Path(__file__)), "--child", config, str(steps), str(out), *sets]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        return statistics.median(json.loads(out.read_text())[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    rows = []
    for mesh, nproc, dist_sets in (("one process", 1, []), ("PP(2) x 1F1B", 2, ["dist.pp=2"])):
        base = None
        for name, sets in VARIANTS.items():
            s = launch(args.config, [*COMMON, *dist_sets, *sets], nproc, args.steps)
            base = base or s
            rows.append((mesh, name, s, s / base))
    print(f"{args.config}: median step after 2, {args.steps} steps, 1 thread a process")
    print("| mesh | variant | step (ms) | vs the recipe |")
    print("|---|---|---|---|")
    for mesh, name, s, r in rows:
        print(f"| {mesh} | {name} | {s * 1e3:.0f} | {r:.2f}x |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[5:], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(main())
