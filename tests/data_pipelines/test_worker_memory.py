"""Loader worker memory stays flat over >= 10k samples of a video-heavy mix (slow tier).

Leaks reported with other loaders: PyAV/DALI containers never closed (Open-Sora #526), decord
readers that slow down or pile up (dmlc/decord #280). Here every container and reader lives for
one sample, and the clip cache (media.video_cache_mb) is a bounded LRU, off by default. The test
samples each worker's resident set after every batch; after warm-up (the first 2k samples: the
shuffle buffer filling, the allocator's arenas growing) each worker stays within +-5% of its
median. It prints the figure quoted in docs/BENCHMARKS.md ("Loader worker memory").
"""

import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from dp_shards import children, data_cfg, image_bytes, rss_mb, write_tar

from mmtrain.data_pipelines.config import SourceConfig
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.synth.render import background, encode_mp4
from mmtrain.data_pipelines.tokenizer import ByteTokenizer

SAMPLES, WARMUP = 10_000, 2_000
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _clip(rng, side=64, frames=8) -> bytes:
    """A clip whose frames change (a drifting texture), so every frame is really decoded."""
    bg_HW3 = background(rng, side + 2 * frames, side + 2 * frames)
    video_THW3 = np.stack([bg_HW3[2 * t : 2 * t + side, 2 * t : 2 * t + side] for t in range(frames)])
    return encode_mp4(video_THW3, 8)


def _corpus(root: Path) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng()
    videos = [write_tar(root / f"v{s}.tar", [{"__key__": f"v{s}_{i:03d}", "mp4": _clip(rng),
                                              "txt": f"clip {i}"} for i in range(100)]) for s in range(4)]
    images = [write_tar(root / "i0.tar", [{"__key__": f"i{i:03d}", "png": image_bytes(48, 64, seed=i),
                                           "txt": f"image {i}"} for i in range(100)])]
    return videos, images


def test_worker_rss_is_flat_over_10k_video_samples(tmp_path):
    videos, images = _corpus(tmp_path)
    cfg = data_cfg(train=videos, num_workers=2, seq_len=512, batch_size=4, shuffle_buffer=64, resample=True)
    cfg.train = [SourceConfig("video", videos, 0.85), SourceConfig("image", images, 0.15)]
    loader = build_loader(cfg, ByteTokenizer(), "train")
    rss: dict[int, list[tuple[int, float]]] = {}
    it, seen, t0, rates = iter(loader), 0, time.perf_counter(), []
    while seen < SAMPLES:
        next(it)
        seen = loader.stats()["samples"]
        for pid in children():
            rss.setdefault(pid, []).append((seen, rss_mb(pid)))
        if len(rates) < seen // 2000:  # samples/s per 2k: does decoding slow down as clips pile up?
            rates.append(2000 / (time.perf_counter() - t0))
            t0 = time.perf_counter()
    del it
    assert len(rss) == 2
    lines = []
    for pid, trace in rss.items():
        after = [mb for n, mb in trace if n >= WARMUP]
        level = statistics.median(after)
        lo, hi = min(after) / level - 1, max(after) / level - 1
        at = {k: next(mb for n, mb in trace if n >= k) for k in range(WARMUP, SAMPLES, 2000)}
        lines.append(f"worker {pid}: median {level:.0f} MB after {WARMUP} samples, range {lo:+.1%} .. "
                     f"{hi:+.1%}; " + ", ".join(f"{k}: {mb:.0f}" for k, mb in at.items()))
        assert lo >= -0.05 and hi <= 0.05, lines[-1]
    print(f"\n{seen} samples (video 0.85, image 0.15); samples/s per 2k: "
          + ", ".join(f"{r:.0f}" for r in rates) + "\n" + "\n".join(lines))
