"""`vision.balance` measured on gloo ranks (CPU, one thread a process) on real batches: what
tools/bench/bench_vision_balance.py computes, timed and weighed.

    python -m tools.bench.bench_vision_ranks --part encoder --ranks 2 4 --steps 10
    python -m tools.bench.bench_vision_ranks --part step --ranks 4 --steps 15
    python -m tools.bench.bench_vision_ranks --part memory --cp 2 4 --steps 8
    (any of them with --quick: a smoke run of a few steps)

Defaults: configs/video_heavy.yaml (`make data-video`). Run each part alone on a quiet machine.

- encoder: each rank reads its own data-parallel slot of the loader. Per step and rank, the
  encoder's forward + backward on the media it encodes, timed alone (`compute`: the rank's own
  media without balancing, the ones the plan gives it with `dp`), then the encoding as training
  does it, every rank starting together (`wall`: the slowest rank's time; with `dp` the grid
  all-gather and both all-to-alls, each way, included). Printed: the mean over steps of max / mean
  compute across ranks, and of the max wall.
- step: two `mmtrain.train` runs (fsdp, `vision.balance` none and dp); the median step time after
  the first steps (compute = step minus data wait), from each run's metrics.jsonl.
- memory: one cp group of C ranks holding the same rows. The bytes the encoder's forward saves for
  its backward (saved-tensor hooks; storages counted once, parameters not), per rank: `none` (each
  cp rank encodes every medium of its rows) and `dp_cp` (each medium once in the group).
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


def launch_workers(part: str, nproc: int, args: argparse.Namespace) -> dict:
    """torchrun this module's worker of `part` on `nproc` ranks -> rank 0's JSON line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "tools.bench.bench_vision_ranks", "--worker", part, "--config", args.config,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           *[a for s in args.set for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"{part} at {nproc} ranks exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- workers (one process per rank) ----

def _setup(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    from mmtrain.config import load_config
    from mmtrain.data_pipelines.tokenizer import load_tokenizer
    from mmtrain.models import MultimodalModel
    from mmtrain.run_config import RunConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = load_config(RunConfig, args.config, args.set)
    tok = load_tokenizer(cfg.data.tokenizer)
    cfg.model.decoder.vocab_size = cfg.model.decoder.vocab_size or tok.vocab_size
    torch.manual_seed(cfg.train.seed)
    return cfg, tok, MultimodalModel(cfg.model).vision


class _Recorder:
    """Stands in for the encoder inside VisionBalancer: keeps what this rank was given to encode."""

    def __init__(self, vision) -> None:
        self.vision, self.cfg = vision, vision.cfg

    def __call__(self, x_NP, grid_E3):
        self.x_NP, self.grid_E3 = x_NP, grid_E3
        return self.vision(x_NP, grid_E3)


def _fwd_bwd(seed: int, encode, *inputs) -> float:
    """Seconds of out = encode(*inputs); (out * g).sum().backward(), g fixed per seed."""
    import torch

    t0 = time.perf_counter()
    out_QO = encode(*inputs)
    g_QO = torch.randn(out_QO.shape, generator=torch.Generator().manual_seed(seed))
    (out_QO * g_QO).sum().backward()
    return time.perf_counter() - t0


def encoder_worker(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.parallel.vision_balance import VisionBalancer

    cfg, tok, vision = _setup(args)
    me, W = dist.get_rank(), dist.get_world_size()
    it = iter(build_loader(cfg.data, tok, "train", me, W))
    balancer = VisionBalancer(dist.group.WORLD, 1, (cfg.vision.cost_a, cfg.vision.cost_b, cfg.vision.cost_c))
    rows = []  # per step: compute none, compute dp, wall none, wall dp
    for step in range(args.warmup + args.steps):
        b = next(it)
        x_NP, grid_M3 = b.patches_NP, b.grid_thw_M3
        rec = _Recorder(vision)
        with torch.no_grad():
            balancer(rec, x_NP, grid_M3)
        c_none = _fwd_bwd(step, vision, x_NP, grid_M3)
        c_dp = _fwd_bwd(step, vision, rec.x_NP, rec.grid_E3)
        dist.barrier()
        w_none = _fwd_bwd(step, vision, x_NP, grid_M3)
        dist.barrier()
        w_dp = _fwd_bwd(step, balancer, vision, x_NP, grid_M3)
        vision.zero_grad(set_to_none=True)
        if step >= args.warmup:
            rows.append([c_none, c_dp, w_none, w_dp])
    got = [None] * W
    dist.all_gather_object(got, rows)
    dist.destroy_process_group()
    if me:
        return None
    per_step = list(zip(*got))  # [step][rank][4]

    def spread(k: int) -> float:
        return statistics.mean(max(r[k] for r in s) / statistics.mean(r[k] for r in s) for s in per_step)

    return {"ranks": W, "compute_max_over_mean_none": spread(0), "compute_max_over_mean_dp": spread(1),
            "compute_mean_s": statistics.mean(r[0] for s in per_step for r in s),
            "wall_max_s_none": statistics.mean(max(r[2] for r in s) for s in per_step),
            "wall_max_s_dp": statistics.mean(max(r[3] for r in s) for s in per_step)}


def _saved_bytes(params: list, run, *inputs) -> int:
    """Bytes of the tensors autograd saves while `run(*inputs)` runs; storages once, parameters not."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(*inputs)
    del out
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    return sum(n for ptr, n in seen.items() if ptr not in ptrs)


def memory_worker(args: argparse.Namespace) -> dict | None:
    import torch.distributed as dist

    from mmtrain.data_pipelines.loader import build_loader
    from mmtrain.parallel.vision_balance import VisionBalancer

    cfg, tok, vision = _setup(args)
    me, C = dist.get_rank(), dist.get_world_size()
    it = iter(build_loader(cfg.data, tok, "train"))  # one cp group: the same rows on every rank
    balancer = VisionBalancer(dist.group.WORLD, C, (cfg.vision.cost_a, cfg.vision.cost_b, cfg.vision.cost_c))
    rows, params = [], list(vision.parameters())  # per step: bytes none, bytes dp_cp
    for _ in range(args.steps):
        b = next(it)
        none = _saved_bytes(params, vision, b.patches_NP, b.grid_thw_M3)
        bal = _saved_bytes(params, balancer, vision, b.patches_NP, b.grid_thw_M3, b.modality_BS)
        rows.append([none, bal])
    got = [None] * C
    dist.all_gather_object(got, rows)
    dist.destroy_process_group()
    if me:
        return None
    per_step = list(zip(*got))
    MiB = 2 ** 20
    return {"cp": C, "saved_MiB_none": statistics.mean(max(r[0] for r in s) for s in per_step) / MiB,
            "saved_MiB_dp_cp": statistics.mean(max(r[1] for r in s) for s in per_step) / MiB,
            "saved_MiB_dp_cp_mean": statistics.mean(statistics.mean(r[1] for r in s) for s in per_step) / MiB}


# ---- whole training steps ----

def train_sets(args: argparse.Namespace, balance: str, run_dir: Path) -> list[str]:
    """The overrides of one timed `mmtrain.train` run (the checkpoint and eval at its end are untimed)."""
    return [f"run_dir={run_dir}", f"train.steps={args.warmup + args.steps}", "train.threads=1",
            "data.num_workers=0", "train.eval_every=0", "train.ckpt_every=0", "train.log_every=1000",
            "train.eval_batches=1", "diagnostics.every=0", "loss.balancer.kind=static", "captions.images=0",
            "captions.videos=0", "dist.strategy=fsdp", f"vision.balance={balance}", *args.set]


def train_run(args: argparse.Namespace, nproc: int, balance: str, run_dir: Path) -> dict:
    sets = train_sets(args, balance, run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mmtrain.train", args.config, "--quiet", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"train ({balance}) exited {out.returncode}:\n{out.stderr[-3000:]}")
    recs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "eval" not in r and "step_s" in r][args.warmup:]
    return {"step_s": statistics.median(r["step_s"] for r in recs),
            "compute_s": statistics.median(r["step_s"] - r["wait_s"] for r in recs), "steps": len(recs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("encoder", "step", "memory"), default="encoder")
    ap.add_argument("--config", default="configs/video_heavy.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="encoder: 2 4; step: 4")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="memory: cp group sizes")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (encoder 10, step 15, memory 8)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before measuring (encoder 2, step 5)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 measured steps, 1 warm-up")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", choices=("encoder", "memory"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    default_steps = {"encoder": 10, "step": 15, "memory": 8}[args.worker or args.part]
    args.steps = args.steps or (2 if args.quick else default_steps)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 5 if args.part == "step" else 2
    if args.worker:
        r = {"encoder": encoder_worker, "memory": memory_worker}[args.worker](args)
        if r is not None:
            print(json.dumps(r), flush=True)
        return
    print(f"{args.config}: {args.part}, {args.steps} steps after {args.warmup}", flush=True)
    if args.part == "encoder":
        print(f"{'ranks':>5} {'compute max/mean none':>22} {'dp':>6} {'wall max none ms':>17} {'dp ms':>8}")
        for R in args.ranks or [2, 4]:
            r = launch_workers("encoder", R, args)
            print(f"{R:>5} {r['compute_max_over_mean_none']:>22.3f} {r['compute_max_over_mean_dp']:>6.3f} "
                  f"{1e3 * r['wall_max_s_none']:>17.1f} {1e3 * r['wall_max_s_dp']:>8.1f}", flush=True)
    elif args.part == "memory":
        print(f"{'cp':>3} {'saved MiB/rank none':>20} {'dp_cp max':>10} {'dp_cp mean':>11}")
        for C in args.cp:
            r = launch_workers("memory", C, args)
            print(f"{C:>3} {r['saved_MiB_none']:>20.2f} {r['saved_MiB_dp_cp']:>10.2f} "
                  f"{r['saved_MiB_dp_cp_mean']:>11.2f}", flush=True)
    else:
        print(f"{'ranks':>5} {'balance':>7} {'step ms':>8} {'compute ms':>11}")
        with tempfile.TemporaryDirectory() as tmp:
            for R in args.ranks or [4]:
                for balance in ("none", "dp"):
                    r = train_run(args, R, balance, Path(tmp) / f"{balance}_{R}")
                    print(f"{R:>5} {balance:>7} {1e3 * r['step_s']:>8.1f} {1e3 * r['compute_s']:>11.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
