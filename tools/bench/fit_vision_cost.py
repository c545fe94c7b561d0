"""Fit `vision.cost_a/b/c` (the vision balance's per-medium cost a n^2 + b n + c, n patches) to
the measured forward + backward time of the config's VisionEncoder on one medium at a time.

    python -m tools.bench.fit_vision_cost --config configs/base.yaml --device cuda --repeats 5
    python -m tools.bench.fit_vision_cost --config configs/small.yaml      (CPU: <= --budget-s)
    python -m tools.bench.fit_vision_cost --quick                           (a smoke run)

Run it alone on the training hardware (the fit is only as good as the timings). Sizes: images of
g x g patches and clips of t x g x g, g a multiple of merge; each the median of `--repeats` after
a warm-up, smallest first. A size whose time, extrapolated from the last one as n^2 (an upper
bound), would overrun `--budget-s` ends the sweep (on CPU a large ViT reaches only the smaller sizes). Prints
each size's time and the overrides to paste; only the ratios matter, so they are scaled to b = 1
when b > 0 (times in microseconds otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmtrain.config import load_config
from mmtrain.models.vision import VisionEncoder
from mmtrain.run_config import RunConfig


def fit(n_K: list[int], t_K: list[float]) -> tuple[float, float, float]:
    """Least squares t = a n^2 + b n + c with a, b, c >= 0 (a cost, not a curve): a term whose
    coefficient comes out negative is dropped and the rest refitted."""
    n = torch.tensor(n_K, dtype=torch.float64)
    cols_K3 = torch.stack([n * n, n, torch.ones_like(n)], 1)
    t_K1 = torch.tensor(t_K, dtype=torch.float64)[:, None]
    active = [0, 1, 2]
    while True:
        coef = torch.linalg.lstsq(cols_K3[:, active], t_K1).solution[:, 0].tolist()
        if min(coef) >= 0 or len(active) == 1:
            out = [0.0, 0.0, 0.0]
            for j, x in zip(active, coef):
                out[j] = max(x, 0.0)
            return out[0], out[1], out[2]
        active.pop(coef.index(min(coef)))


def sizes(merge: int, max_side: int, frames: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Smallest first (ties: fewer frames)."""
    sides = sorted({merge * k for k in (1, 2, 4, 8, 12, 16, 24, 32) if merge * k <= max_side})
    return sorted(((t, g, g) for t in frames for g in sides), key=lambda s: (s[0] * s[1] * s[2], s[0]))


def time_one(enc, grid: tuple[int, int, int], repeats: int, device: torch.device) -> float:
    """Median seconds of forward + backward on one medium."""
    n = grid[0] * grid[1] * grid[2]
    x_NP = torch.randn(n, enc.cfg.patch_dim, device=device)
    g_13 = torch.tensor([grid], device=device)
    out = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc(x_NP, g_13).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first is a warm-up
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-side", type=int, default=64, help="largest grid side in patches")
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 4, 16], help="grid t of the media")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=150.0, help="time for the sweep (a guard, see above)")
    ap.add_argument("--quick", action="store_true",
                    help="sides <= 8, frames 1 4, 1 repeat, no budget: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_side, args.frames, args.repeats, args.budget_s = 8, [1, 4], 1, float("inf")
    cfg = load_config(RunConfig, args.config, ["model.decoder.vocab_size=512"]).model
    device = torch.device(args.device)
    torch.manual_seed(0)
    enc = VisionEncoder(cfg.vision, cfg.decoder.dim, cfg.decoder.attention).to(device)
    n_K, t_K, t0 = [], [], time.perf_counter()
    for grid in sizes(cfg.vision.merge, args.max_side, tuple(args.frames)):
        n = grid[0] * grid[1] * grid[2]
        left = args.budget_s - (time.perf_counter() - t0)
        if t_K and t_K[-1] * 1e-6 * (n / n_K[-1]) ** 2 * (args.repeats + 1) > left:  # attention: n^2
            print(f"grid {grid}: n {n:>7}  skipped, and the larger ones (--budget-s {args.budget_s:g})")
            break
        n_K.append(n)
        t_K.append(time_one(enc, grid, args.repeats, device) * 1e6)
        print(f"grid {grid}: n {n_K[-1]:>7}  {t_K[-1]:>12.1f} us", flush=True)
    if len(set(n_K)) < 3:
        raise SystemExit(f"only {len(set(n_K))} sizes fit in --budget-s {args.budget_s:g}: raise it")
    a, b, c = fit(n_K, t_K)
    if b > 0:
        a, b, c = a / b, 1.0, c / b
    print(f"--set vision.cost_a={a:.4g} --set vision.cost_b={b:.4g} --set vision.cost_c={c:.4g}")


if __name__ == "__main__":
    main()
