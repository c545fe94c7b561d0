"""Data-parallel overhead on CPU: 2 gloo processes (FSDP2, DDP) against 1 process, same run.

    python -m tools.bench.bench_distributed [--config configs/tiny.yaml] [--steps 40] [--batch-size 4]

Every side is a real `mmtrain.train` run (torchrun --standalone for 2 processes) on the built-in
corpus (`make data`; or --corpus DIR), one intra-op thread per process, data in the main process
(data.num_workers=0), no eval or checkpoint in between. Per-step numbers come from each run's
metrics.jsonl: the median over steps after the first 5, compute = step time minus data wait.

- weak scaling: 2 ranks x batch B against 1 process x batch B. Ideal: the same step time and
  twice the tokens/s; `overhead` = 2-rank compute step / 1-process compute step.
- same global batch: 2 ranks x B against 1 process x 2B with 2 threads (both cores either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(config: str, run_dir: Path, nproc: int, threads: int, batch: int, steps: int, corpus: Path | None,
        strategy: str = "fsdp") -> dict:
    sets = [f"run_dir={run_dir}", f"train.steps={steps}", f"train.threads={threads}",
            f"data.batch_size={batch}", "data.num_workers=0", "train.eval_every=0", "train.ckpt_every=0",
            "train.eval_batches=1", "train.log_every=1000", "optim.warmup_steps=5",
            f"dist.strategy={strategy}"]
    if corpus is not None:
        sets += _corpus_overrides(config, corpus)
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "mmtrain.train", config, "--quiet", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if "eval" not in r][5:]  # step records only
    step = statistics.median(r["step_s"] for r in recs)
    compute = statistics.median(r["step_s"] - r["wait_s"] for r in recs)
    tokens = statistics.median(r["tokens"] for r in recs)
    return {"step_s": step, "compute_s": compute, "tokens_per_step": tokens, "tokens_per_s": tokens / step}


def _corpus_overrides(config: str, corpus: Path) -> list[str]:
    import yaml

    raw = yaml.safe_load(Path(config).read_text())
    out = [f"data.tokenizer={corpus / 'tokenizer.json'}"]
    for split in ("train", "val"):
        srcs = [{**s, "shards": [str(corpus / split / f"{s['name']}-*.tar")]} for s in raw["data"][split]]
        out.append(f"data.{split}={json.dumps(srcs)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--corpus", type=Path, help="shapes-world corpus (default: the config's paths)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4, help="rows per rank (B)")
    args = ap.parse_args()
    B, n = args.batch_size, args.steps
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        sides = {
            "1 proc x B (1 thread)": run(args.config, t / "a", 1, 1, B, n, args.corpus),
            "2 ranks x B FSDP2 (gloo)": run(args.config, t / "b", 2, 1, B, n, args.corpus),
            "2 ranks x B DDP (gloo)": run(args.config, t / "c", 2, 1, B, n, args.corpus, "ddp"),
            "1 proc x 2B (2 threads)": run(args.config, t / "d", 1, 2, 2 * B, n, args.corpus),
        }
    base, same = sides["1 proc x B (1 thread)"], sides["1 proc x 2B (2 threads)"]
    print(f"{'side':28s} {'step ms':>8s} {'compute ms':>10s} {'tok/step':>8s} {'tok/s':>8s} "
          f"{'overhead':>8s} {'vs 1x2B':>8s}")
    for name, r in sides.items():
        overhead = r["compute_s"] / base["compute_s"]
        vs_same = r["tokens_per_s"] / same["tokens_per_s"]
        print(f"{name:28s} {r['step_s'] * 1e3:8.1f} {r['compute_s'] * 1e3:10.1f} {r['tokens_per_step']:8.0f} "
              f"{r['tokens_per_s']:8.0f} {overhead:8.2f} {vs_same:8.2f}")
    print("overhead: compute step time / 1 proc x B (ideal 1.00 for 2 ranks x B); "
          "vs 1x2B: tokens/s / 1 proc x 2B with 2 threads")


if __name__ == "__main__":
    main()
