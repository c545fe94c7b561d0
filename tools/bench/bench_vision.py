"""Vision tower forward + backward with media grouped by size (what `VisionEncoder` does) against
the same tower over the media in input order (`group_by_size = False`), in the same run.

    python -m tools.bench.bench_vision --config configs/tiny.yaml --images 22 --clips 5 --steps 20 --threads 2

The batch is a shapes-world mix: `--images` images and `--clips` clips (frames / temporal patch
grids of 8x8 patches), in a random order (seeded), as the packer delivers them. Both sides share
the weights and inputs; steps interleaved; medians. The last line is the largest difference
between the two sides' outputs and patch gradients.
"""

from __future__ import annotations

import argparse
import time

import torch

from mmtrain.config import load_config
from mmtrain.models import MultimodalModel
from mmtrain.run_config import RunConfig
from tools.bench.table import print_ratio_table


def media_batch(n_images: int, n_clips: int, t: int, grid: int, patch_dim: int,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> patches (N, P), grid_thw (M, 3): images (1, grid, grid) and clips (t, grid, grid) shuffled."""
    g = torch.Generator().manual_seed(seed)
    grids = [[1, grid, grid]] * n_images + [[t, grid, grid]] * n_clips
    grid_M3 = torch.tensor(grids)[torch.randperm(len(grids), generator=g)]
    return torch.randn(int(grid_M3.prod(-1).sum()), patch_dim, generator=g), grid_M3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--images", type=int, default=22)
    ap.add_argument("--clips", type=int, default=5)
    ap.add_argument("--frames", type=int, default=8, help="frames per clip (grid t = frames / tp)")
    ap.add_argument("--grid", type=int, default=8, help="patches per side")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, args.config, ["model.decoder.vocab_size=512"]).model
    enc = MultimodalModel(cfg).vision
    patches_NP, grid_M3 = media_batch(args.images, args.clips, args.frames // cfg.vision.temporal_patch,
                                      args.grid, cfg.vision.patch_dim, args.seed)
    times: dict[str, list[float]] = {"input order": [], "grouped by size": []}
    results = {}
    for i in range(args.steps + 2):
        for side in times:
            enc.group_by_size = side == "grouped by size"
            x_NP = patches_NP.clone().requires_grad_()
            enc.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out_QO = enc(x_NP, grid_M3)
            out_QO.square().mean().backward()
            if i >= 2:
                times[side].append(time.perf_counter() - t0)
            results[side] = (out_QO.detach(), x_NP.grad)
    diff = max(float((a - b).abs().max()) for a, b in zip(*results.values()))
    print(f"# {args.config} vision tower, attention backend {enc.attn_cfg.backend}: {args.images} images + "
          f"{args.clips} clips, {patches_NP.shape[0]} patches, {args.threads} threads, "
          f"medians of {args.steps} steps")
    print_ratio_table("media", "fwd+bwd", times, "input order")
    print(f"# largest difference in outputs and patch gradients: {diff:.2e}")


if __name__ == "__main__":
    main()
