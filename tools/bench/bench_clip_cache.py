"""What `data.media.video_cache_mb` saves a loader: ms of CPU per batch of the train loader, in this
process (no worker), with the clip cache off and on, after the same warm-up.

    python -m tools.bench.bench_clip_cache --config configs/tiny.yaml --warmup 300 --batches 100

Both loaders draw `--warmup` batches first (enough for the cache to have met most clips once: tiny
reads its 1,500 train clips in ~260 batches), then `--batches` are timed; the rounds alternate.
On a 2-core machine a loader worker's CPU is the step's (docs/BENCHMARKS.md), so this is what the
cache takes off `make train`'s steps.
"""

from __future__ import annotations

import argparse
import time

from mmtrain.config import load_config
from mmtrain.data_pipelines import decode
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.run_config import RunConfig


def loader(config: str, cache_mb: int):
    cfg = load_config(RunConfig, config, ["data.num_workers=0", f"data.media.video_cache_mb={cache_mb}"])
    return iter(build_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), "train", 0, 1))


def timed(it, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--cache-mb", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    its = {"off": loader(a.config, 0), "on": loader(a.config, a.cache_mb)}  # one process-wide cache:
    for it in its.values():  # the "off" loader's config has none, so it never touches it
        timed(it, a.warmup)
    times: dict[str, list[float]] = {k: [] for k in its}
    for _ in range(a.rounds):
        for k, it in its.items():
            times[k].append(timed(it, a.batches))
    cache = decode._CLIP_CACHE
    off, on = min(times["off"]), min(times["on"])
    print(f"# {a.config}: {a.batches} batches x {a.rounds} rounds after {a.warmup}, one process; best round")
    print(f"| clip cache | ms / batch |\n|---|---|\n| off | {off * 1e3:.1f} |\n| on ({a.cache_mb} MiB) | "
          f"{on * 1e3:.1f} |")
    print(f"# saves {(off - on) * 1e3:.1f} ms a batch ({1 - on / off:.0%}); "
          f"cache {cache.size / 2**20:.0f} MiB, "
          f"{cache.hits} hits / {cache.misses} misses over all {a.warmup + a.rounds * a.batches} batches")


if __name__ == "__main__":
    main()
