"""Peak memory of a pipeline rank against the whole run in one process, measured as peak RSS.

    python -m tools.bench.bench_pp_memory [--pp 2] [--steps 2]

A ~270M-parameter dense variant of configs/tiny.yaml (decoder dim 1024, 16 layers, FFN 4096; fp32
AdamW: weights, gradients and two moments, ~16 bytes a parameter) trains `--steps` steps in one
process and at dist.pp = `--pp` (torchrun, gloo), both with `--pp` micro-batches of 2 rows a step
(train.grad_accum; 1F1B holds pp - rank of them on a stage at the peak). Each process reports its
peak resident set size above its size after the imports (the fixed overhead: torch, the
interpreter), so the figure is what the model, its optimizer and the step add. A stage should need
about 1 / pp of one process (plus its share of the embedding, encoder and activations). Needs the
built-in corpus (make data).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODEL = ["model.decoder.moe=null", "model.decoder.dim=1024", "model.decoder.n_layers=16",
         "model.decoder.n_heads=16", "model.decoder.n_kv_heads=4", "model.decoder.ffn_dim=4096",
         "model.decoder.mrope_sections=[8,12,12]", "model.visual_head=false", "loss.visual_next.weight=0"]
RUN = ["data.batch_size=2", "data.seq_len=256", "data.num_workers=0", "train.threads=1",
       "train.eval_every=0", "train.ckpt_every=0", "diagnostics.every=0", "loss.balancer.kind=static"]


def worker(sets: list[str], steps: int, out: str) -> None:
    import resource

    from mmtrain.config import load_config
    from mmtrain.loop.trainer import Trainer
    from mmtrain.parallel.distributed import init_distributed, shutdown
    from mmtrain.run_config import RunConfig
    from tools.bench.childproc import rss_bytes

    cfg = load_config(RunConfig, "configs/tiny.yaml", sets)
    env = init_distributed(cfg.dist, "cpu")
    base = rss_bytes()  # the interpreter and the imports: the same in every process
    trainer = Trainer(cfg, verbose=False, env=env)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    batches = iter(trainer.train_loader)
    for _ in range(steps):
        trainer.train_step(batches)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    rec = {"rank": env.rank, "params": trainer.raw_model.num_params().total, "built_gib": built / 2**30,
           "peak_gib": peak / 2**30}
    with open(f"{out}.{env.rank}", "w") as f:
        json.dump(rec, f)
    if env.distributed:
        shutdown()


def run(pp: int, accum: int, steps: int, out: str) -> list[dict]:
    sets = [*MODEL, *RUN, f"run_dir={out}.run", f"train.grad_accum={accum}", f"dist.pp={pp}"]
    args = ["--worker", "--steps", str(steps), "--out", out, "--set", *sets]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}"] if pp > 1 else []
    cmd = [sys.executable, *launcher, "-m", "tools.bench.bench_pp_memory"]
    subprocess.run(cmd + args, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.load(open(f"{out}.{r}")) for r in range(pp)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="runs/bench_pp_memory")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--set", nargs="*", default=[])
    a = p.parse_args()
    if a.worker:
        return worker(a.set, a.steps, a.out)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    one = run(1, a.pp, a.steps, f"{a.out}.pp1")[0]  # the same micro-batches: pp of them a step
    ranks = run(a.pp, a.pp, a.steps, f"{a.out}.pp{a.pp}")
    print(f"{one['params'] / 1e6:.0f}M parameters, {a.steps} steps; peak RSS above the imports (GiB):")
    print(f"  one process: built {one['built_gib']:.2f}, peak {one['peak_gib']:.2f}")
    for r in ranks:
        print(f"  pp {a.pp} rank {r['rank']}: built {r['built_gib']:.2f}, peak {r['peak_gib']:.2f} "
              f"({r['peak_gib'] / one['peak_gib']:.2f}x one process)")


if __name__ == "__main__":
    main()
