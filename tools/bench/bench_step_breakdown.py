"""Where `make train`'s step goes: forward, backward, optimizer and the rest of `Trainer.train_step`
on batches drawn beforehand, the aten ops a step runs (how many, and how much of the step is inside
them vs between them: Python and dispatch), and the same step compiled.

    python -m tools.bench.bench_step_breakdown --config configs/tiny.yaml --steps 20

Run it alone. Phases are timed by wrapping `Objective.micro_batch` (forward + loss), `Tensor.backward`
and `optimizer.step` during the timed steps (CPU ops are synchronous, so the wall time of a call is its
work). The op census is one profiled pass (torch.profiler, CPU): the step's top-level aten ops, their
count and their self time; "between ops" = the unprofiled step minus the time inside top-level ops.
`--compile` adds the same step with `dist.compile: true` (Inductor), after its compile warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager

import torch

from mmtrain.config import load_config
from mmtrain.loop.trainer import Trainer
from mmtrain.parallel.distributed import init_distributed
from mmtrain.run_config import RunConfig

MATMUL = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm", "aten::linear", "aten::matmul",
          "aten::baddbmm", "aten::addbmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


@contextmanager
def _wrapped(obj, name: str, acc: dict, key: str):
    """Accumulate the wall time of obj.name's calls into acc[key] while inside."""
    orig = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, orig)


def build(config: str, overrides: list[str], run_dir: str) -> Trainer:
    over = [f"run_dir={run_dir}", "train.eval_every=0", "train.ckpt_every=0", "diagnostics.every=100000"]
    cfg = load_config(RunConfig, config, over + overrides)
    return Trainer(cfg, verbose=False, env=init_distributed(cfg.dist, cfg.train.device))


def phases(trainer: Trainer, batches: list, n: int) -> dict[str, float]:
    """Mean seconds per step of each phase over n steps (fed from `batches`)."""
    acc: dict[str, float] = defaultdict(float)
    it = iter(batches)
    with _wrapped(trainer.objective, "micro_batch", acc, "forward + loss"), \
            _wrapped(torch.Tensor, "backward", acc, "backward"), \
            _wrapped(trainer.optimizer, "step", acc, "optimizer"):
        t0 = time.perf_counter()
        for _ in range(n):
            trainer.train_step(it)
        total = time.perf_counter() - t0
    out = {k: v / n for k, v in acc.items()}
    out["rest (clip, sums, MoE bias, bookkeeping)"] = total / n - sum(out.values())
    out["step"] = total / n
    return out


def census(trainer: Trainer, batches: list, n: int) -> dict[str, float]:
    """Per step: top-level aten ops and their self time, matmul-class vs the rest."""
    it = iter(batches)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            trainer.train_step(it)
    ops = [e for e in prof.events() if e.name.startswith("aten::") and _top_level(e)]
    inside = sum(e.cpu_time_total for e in ops) / 1e6 / n  # a top-level op's total includes its children
    mm = sum(e.cpu_time_total for e in ops if e.name in MATMUL) / 1e6 / n
    return {"ops": len(ops) / n, "inside ops s": inside, "matmul-class s": mm}


def _top_level(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return False
        p = p.cpu_parent
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time the compiled step")
    ap.add_argument("--scale", action="store_true",
                    help="also time the step at twice the batch: the size-independent part of a step "
                         "(Python, dispatch, per-op set-up) is 2 t(B) - t(2B)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    n = args.steps
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")  # our wrapper, not a misuse
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build(args.config, args.overrides, run_dir)
        live = iter(trainer.train_loader)
        batches = [next(live) for _ in range(args.warmup + 3 * n)]  # the same batches for every pass
        phases(trainer, batches[:args.warmup], args.warmup)
        eager = phases(trainer, batches[args.warmup:args.warmup + n], n)
        ops = census(trainer, batches[args.warmup + n:args.warmup + 2 * n], n)
        print(f"# {args.config} {' '.join(args.overrides)}: {n} steps on batches drawn beforehand, "
              f"{torch.get_num_threads()} threads")
        print("| phase | ms / step | share |\n|---|---|---|")
        for k, v in eager.items():
            print(f"| {k} | {v * 1e3:.1f} | {v / eager['step']:.0%} |")
        between = eager["step"] - ops["inside ops s"]
        print(f"\n{ops['ops']:.0f} top-level aten ops a step; inside them {ops['inside ops s'] * 1e3:.0f} ms "
              f"(matmul-class {ops['matmul-class s'] * 1e3:.0f} ms), between them (Python, dispatch, "
              f"hooks) {between * 1e3:.0f} ms = {between / eager['step']:.0%} of the step "
              f"({between / ops['ops'] * 1e6:.1f} us an op); the profiler's own cost is in 'inside'")
        if args.scale:
            big = build(args.config, [*args.overrides, f"data.batch_size={2 * trainer.cfg.data.batch_size}"],
                        run_dir + "/2b")
            it2 = iter(big.train_loader)
            big_batches = [next(it2) for _ in range(args.warmup + 2 * n)]
            phases(big, big_batches[:args.warmup], args.warmup)
            t_b = [phases(trainer, batches[args.warmup:args.warmup + n], n)["step"]]
            t_2b = [phases(big, big_batches[args.warmup:args.warmup + n], n)["step"]]
            t_b.append(phases(trainer, batches[args.warmup + n:args.warmup + 2 * n], n)["step"])
            t_2b.append(phases(big, big_batches[args.warmup + n:args.warmup + 2 * n], n)["step"])
            tb, t2b = statistics.mean(t_b), statistics.mean(t_2b)
            B = trainer.cfg.data.batch_size
            print(f"\nbatch {B}: {tb * 1e3:.0f} ms, batch {2 * B}: "
                  f"{t2b * 1e3:.0f} ms a step (alternating, 2 rounds) -> size-independent part "
                  f"2 t(B) - t(2B) = {(2 * tb - t2b) * 1e3:.0f} ms = {(2 * tb - t2b) / tb:.0%} of the step")
        if args.compile:
            ctrainer = build(args.config, [*args.overrides, "dist.compile=true"], run_dir + "/c")
            t0 = time.perf_counter()
            phases(ctrainer, batches[:args.warmup], args.warmup)
            warm = time.perf_counter() - t0
            comp = phases(ctrainer, batches[args.warmup:args.warmup + n], n)
            again = phases(trainer, batches[args.warmup:args.warmup + n], n)  # eager again: drift check
            print(f"\ncompiled (Inductor): warm-up {warm:.0f} s for {args.warmup} steps; step "
                  f"{comp['step'] * 1e3:.0f} ms vs eager {eager['step'] * 1e3:.0f} / "
                  f"{again['step'] * 1e3:.0f} ms (before / after) = "
                  f"{statistics.mean([eager['step'], again['step']]) / comp['step']:.2f}x")


if __name__ == "__main__":
    main()
