"""The plan's peak memory per rank against the peak of the same run on real tensors.

    python -m tools.bench.bench_plan                      # the table of docs/BENCHMARKS.md (~5 min)
    python -m tools.bench.bench_plan --cases tiny:1 tiny:2:ep=2

For each case, `mmtrain plan`'s trace (fake tensors, fake process group of N ranks) and
`mmtrain.plan.trace.measure` (the same two steps on real tensors, N gloo processes under torchrun,
FSDPMemTracker over the second step) report rank 0's peak; the ratio is plan / measured. Both run
the plan's stand-ins (the flash-style attention kernel, the EP dispatcher with stated even splits):
the check is that fake tensors, the fake process group and the planning hooks reproduce the real
step's memory, not that the stand-ins equal flex or the real routing. CPU, fp32.

A case is CONFIG:RANKS[:key=value,...] with dist.* keys (ep=2, dp_replicate=2) and these
shortcuts: `seq` (data.seq_len), `rows` (data.batch_size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHORT = {"seq": "data.seq_len", "rows": "data.batch_size"}
CASES = ["tiny:1", "tiny:2", "tiny:2:ep=2", "tiny:4", "tiny:4:dp_replicate=2", "tiny:4:ep=4",
         "tiny:4:dp_replicate=2,ep=2", "tiny:2:cp=2", "tiny:4:cp=2,ep=2", "small:2:seq=1024,rows=2",
         "small:2:seq=1024,rows=2,cp=2", "small:2:seq=1024,rows=2,ep=2", "tiny:2:tp=2", "tiny:4:tp=2"]
# (small at 4 real ranks needs ~24 GB: more than the 2-core, 23 GB machine of docs/BENCHMARKS.md)
MIB = 2**20


def overrides(spec: str) -> tuple[str, int, list[str]]:
    """'tiny:2:ep=2' -> (configs/tiny.yaml, 2, ['dist.ep=2', ...])."""
    name, ranks, *rest = spec.split(":")
    sets = ["model.decoder.vocab_size=32768"]
    for kv in (rest[0].split(",") if rest else []):
        key, value = kv.split("=")
        sets.append(f"{SHORT.get(key, 'dist.' + key)}={value}")
    return str(REPO / "configs" / f"{name}.yaml"), int(ranks), sets


def planned(spec: str) -> dict:
    from mmtrain.plan.cli import make_plan

    config, ranks, sets = overrides(spec)
    return make_plan(config, ranks, "h100", sets)["memory"]


def measured(spec: str, timeout: float = 600) -> dict:
    config, ranks, sets = overrides(spec)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peak.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "tools.bench.bench_plan", "--worker", config, str(out), *sets]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{spec}: the measured run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def worker(config: str, out: str, sets: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from mmtrain.config import load_config
    from mmtrain.plan.trace import PlanOptions, measure
    from mmtrain.run_config import RunConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = load_config(RunConfig, config, sets)
    result = measure(cfg, PlanOptions(gpus=dist.get_world_size(), rank=dist.get_rank()))
    if dist.get_rank() == 0:
        modules = [{"module": m, "bytes": b} for m, b in result.modules]
        Path(out).write_text(json.dumps({"peak_bytes": result.total, "by_category": result.peak,
                                         "top_modules": modules}))
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=CASES)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.worker[2:])
    print("| case | planned peak (MiB) | measured peak (MiB) | plan / measured |")
    print("|---|---|---|---|")
    for spec in args.cases:
        p, m = planned(spec)["peak_bytes"], measured(spec)["peak_bytes"]
        print(f"| {spec} | {p / MIB:.1f} | {m / MIB:.1f} | {p / m:.3f} |", flush=True)


if __name__ == "__main__":
    main()
