"""Loader throughput against a bare webdataset + Pillow/decord decode loop, in the same run.

    python tools/bench/bench_loader.py [--corpus DIR] [--workers 0 1 2] [--seq-len 256]

Both sides read the same shards once in order (the loader as a one-pass val split, so they
see exactly the same samples). The bare loop only decodes: text to str, images with Pillow to
RGB, video with decord at the loader's frame indices. The loader also resizes, normalises,
patchifies, tokenizes, mixes and packs. Without --corpus a shapes-world corpus is written to a
temporary directory first. The ratio is loader samples/s over bare-loop samples/s; the bare
loop is one process, so with N workers the ratio may exceed 1.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import decord
import webdataset as wds
from PIL import Image

from mmtrain.data_pipelines.config import DataConfig, MediaConfig, SourceConfig
from mmtrain.data_pipelines.decode import IMAGE_EXTS, VIDEO_EXTS, sample_frame_indices
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.shards import expand_shards
from mmtrain.data_pipelines.tokenizer import load_tokenizer

KINDS = ("image", "video", "interleaved", "text")


def bare_decode(sample: dict, media: MediaConfig) -> None:
    for ext, data in sample.items():
        if ext.startswith("__"):
            continue
        kind = ext.rsplit(".", 1)[-1]
        if kind in IMAGE_EXTS:
            Image.open(io.BytesIO(data)).convert("RGB").load()
        elif kind in VIDEO_EXTS:
            vr = decord.VideoReader(io.BytesIO(data), num_threads=1)
            idx = sample_frame_indices(len(vr), vr.get_avg_fps(), media)
            vr.get_batch(sorted(set(idx))).asnumpy()
        elif kind == "txt":
            data.decode("utf-8")
        elif kind == "json":
            json.loads(data)


def bench_bare(urls: list[str], media: MediaConfig) -> tuple[int, float]:
    t0, n = time.perf_counter(), 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        bare_decode(sample, media)
        n += 1
    return n, time.perf_counter() - t0


def bench_loader(cfg: DataConfig, tok) -> tuple[int, int, float]:
    loader = build_loader(cfg, tok, "val")
    t0, tokens = time.perf_counter(), 0
    for batch in loader:
        tokens += batch.num_tokens()
    return loader.stats()["samples"], tokens, time.perf_counter() - t0


def profile(urls: list[str], cfg: DataConfig, tok, top: int) -> None:
    """Where the 0-worker loader's time goes beyond the bare loop's (BENCHMARKS: the 0.85 goal)."""
    import cProfile
    import pstats

    n_bare, t_bare = bench_bare(urls, cfg.media)
    cfg.num_workers = 0
    prof = cProfile.Profile()
    prof.enable()
    n, _, t = bench_loader(cfg, tok)
    prof.disable()
    print(f"bare loop {n_bare} samples {t_bare:.2f} s; loader (profiled) {n} samples {t:.2f} s; "
          f"ratio {(n / t) / (n_bare / t_bare):.2f}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def corpus_config(root: Path, args) -> DataConfig:
    sources = [SourceConfig(k, [str(p) for p in sorted((root / "train").glob(f"{k}-*.tar"))])
               for k in KINDS if list((root / "train").glob(f"{k}-*.tar"))]
    media = MediaConfig(patch_size=8, temporal_patch=2, merge=2, min_pixels=1024, max_pixels=4096,
                        video_fps=8.0, video_min_frames=2, video_max_frames=8)
    tok = root / "tokenizer.json"
    return DataConfig(val=sources, seq_len=args.seq_len, batch_size=args.batch_size, media=media,
                      tokenizer=str(tok) if tok.exists() else "byte", max_failure_rate=1.0)


def write_synth(out: Path, scale: int, image_size: int, video_size: int) -> None:
    from mmtrain.data_pipelines.synth.config import SynthConfig
    from mmtrain.data_pipelines.synth.writer import write_corpus

    n = dict(n_image=150 * scale, n_video=40 * scale, n_interleaved=40 * scale, n_text=100 * scale)
    cfg = SynthConfig(**n, n_val=4, shard_size=25 * scale, image_size=image_size, video_size=video_size)
    write_corpus(out, cfg, log=None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, help="a shapes-world corpus dir (DIR/train/<kind>-*.tar)")
    p.add_argument("--scale", type=int, default=8, help="size of the corpus written without --corpus")
    p.add_argument("--image-size", type=int, default=64, help="px of its images (64 = the built-in corpus)")
    p.add_argument("--video-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2, help="runs per row, interleaved; the best is kept")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead: a bare pass, then a 0-worker loader pass under cProfile: its top N")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.corpus or Path(tmp)
        if args.corpus is None:
            write_synth(root, args.scale, args.image_size, args.video_size)
        cfg = corpus_config(root, args)
        tok = load_tokenizer(cfg.tokenizer)
        urls = [u for s in cfg.val for u in expand_shards(s.shards, s.name)]
        bench_bare(urls[:2], cfg.media)  # warm the page cache and the libraries
        if args.profile:
            return profile(urls, cfg, tok, args.profile)
        best: dict = {}
        for _ in range(args.repeat):  # interleaved, so a busy moment hurts every row alike
            n_bare, t = bench_bare(urls, cfg.media)
            best["bare"] = min(best.get("bare", t), t)
            for nw in args.workers:
                cfg.num_workers = nw
                n, tokens, t = bench_loader(cfg, tok)
                best[nw] = min(best.get(nw, (float("inf"), 0, 0)), (t, n, tokens))
        bare_sps = n_bare / best["bare"]
        rows = [("bare wds+decode", 0, bare_sps, float("nan"), 1.0)]
        for nw in args.workers:
            t, n, tokens = best[nw]
            rows.append(("mmtrain loader", nw, n / t, tokens / t, (n / t) / bare_sps))
    print(f"{len(urls)} shards, {n_bare} samples, seq_len {args.seq_len}, batch {args.batch_size}")
    print(f"{'pipeline':<18}{'workers':>8}{'samples/s':>12}{'tokens/s':>12}{'ratio':>8}")
    for name, nw, sps, tps, ratio in rows:
        print(f"{name:<18}{nw:>8}{sps:>12.1f}{tps:>12.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
