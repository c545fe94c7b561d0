"""What a config's loader feeds the vision encoder: the share of media tokens that are video and
the spread of patch counts per medium (max / min), on real batches.

    python -m tools.bench.media_mix --config configs/video_heavy.yaml --batches 50 \
        --min-video-share 0.4 --min-spread 8

Exits 1 (after printing the figures) when a given bound is not met.
"""

from __future__ import annotations

import argparse
import sys

from mmtrain.config import load_config
from mmtrain.data_pipelines.batch import VIDEO
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.run_config import RunConfig


def media_mix(cfg: RunConfig, n_batches: int) -> dict:
    """-> video share of the visual tokens, min and max patches of a medium, media and batches seen."""
    it = iter(build_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), "train"))
    video = tokens = media = 0
    lo, hi = None, 0
    for _ in range(n_batches):
        b = next(it)
        n_M = b.grid_thw_M3.prod(-1)
        tok_M = n_M // cfg.data.media.merge ** 2
        video += int(tok_M[b.media_kind_M == VIDEO].sum())
        tokens += int(tok_M.sum())
        media += len(n_M)
        if len(n_M):
            lo = min(int(n_M.min()), lo if lo is not None else int(n_M.min()))
            hi = max(int(n_M.max()), hi)
    return {"video_share": video / max(tokens, 1), "min_patches": lo or 0, "max_patches": hi,
            "spread": hi / lo if lo else 0.0, "media": media, "batches": n_batches}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/video_heavy.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--min-video-share", type=float, default=None)
    ap.add_argument("--min-spread", type=float, default=None)
    args = ap.parse_args(argv)
    r = media_mix(load_config(RunConfig, args.config, args.set), args.batches)
    print(f"{r['batches']} batches, {r['media']} media: video {100 * r['video_share']:.1f}% of media tokens; "
          f"patches per medium {r['min_patches']}..{r['max_patches']} ({r['spread']:.1f}x)")
    ok = ((args.min_video_share is None or r["video_share"] >= args.min_video_share)
          and (args.min_spread is None or r["spread"] >= args.min_spread))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
