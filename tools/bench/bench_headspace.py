"""Loader headspace at GPU step rates: the trainer's loader vs replayed batches under the same step.

    python -m tools.bench.bench_headspace --step-ms 20 40 80 [--config configs/small.yaml]
        [--corpus DIR] [--workers 0 1 2] [--mixes image video interleaved] [--steps 6]

SPDL's headspace method. A stand-in step sleeps for the step time (a GPU step leaves the host's
cores to the loader) and takes its next batch first; the same step fed by batches cached in
memory (replayed) is the reference. Per mix (one kind at 0.7 of the documents, the others 0.1
each), worker count and step time: the loader-fed step time against the replayed one (the gap),
and data_wait_frac (seconds waiting for a batch / step seconds, as the trainer logs it).

Cores a GPU: the mix's core-seconds per batch, read at 0 workers in this process (process CPU
time; mmtrain/plan/loader.py, the arithmetic `mmtrain plan` prints), over the step time.

The loader is the trainer's: `build_loader(cfg.data, ..., "train")` on the config's data settings
(seq_len, batch_size, media, shuffle buffer, resample), its sources pointed at a shapes-world
corpus. Without --corpus one is written first at the `small` config's sizes (224 px images and
clips, as configs/small.yaml's header writes it), a few hundred samples of each kind.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mmtrain.config import load_config
from mmtrain.data_pipelines.config import DataConfig, SourceConfig
from mmtrain.data_pipelines.loader import build_loader
from mmtrain.data_pipelines.tokenizer import load_tokenizer
from mmtrain.plan.loader import cores_per_gpu
from mmtrain.run_config import RunConfig

KINDS = ("image", "video", "interleaved", "text")


def mix_data(data: DataConfig, root: Path, heavy: str) -> DataConfig:
    train = [SourceConfig(k, [str(root / "train" / f"{k}-*.tar")], 0.7 if k == heavy else 0.1) for k in KINDS]
    return replace(data, train=train, val=[], tokenizer=str(root / "tokenizer.json"))


def write_corpus(root: Path, size: int) -> None:
    from mmtrain.data_pipelines.synth.config import SynthConfig
    from mmtrain.data_pipelines.synth.writer import write_corpus as write

    cfg = SynthConfig(n_image=400, n_video=200, n_interleaved=200, n_text=400, n_val=2, shard_size=25,
                      image_size=size, video_size=size)
    write(root, cfg, log=None)


def cached_batches(data: DataConfig, tok, n: int, warmup: int) -> tuple[list, float]:
    """(n batches to replay, core-seconds per batch) from the loader at 0 workers."""
    it = iter(build_loader(replace(data, num_workers=0), tok, "train"))
    for _ in range(warmup):
        next(it)
    c0 = time.process_time()
    out = [next(it) for _ in range(n)]
    return out, (time.process_time() - c0) / n


def stand_in_steps(batches, steps: int, step_s: float) -> tuple[float, float]:
    """(mean step seconds, data_wait_frac): take the next batch, then 'compute' for step_s."""
    wait, t_start = 0.0, time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        next(batches)
        wait += time.perf_counter() - t0
        time.sleep(step_s)
    total = time.perf_counter() - t_start
    return total / steps, wait / total


def replayed(cache: list):
    while True:
        yield from cache


def rows_for_mix(data: DataConfig, tok, args) -> list[dict]:
    cache, core_s = cached_batches(data, tok, args.cache, args.warmup)
    ref = {ms: stand_in_steps(replayed(cache), args.steps, ms / 1e3)[0] for ms in args.step_ms}
    del cache
    rows = []
    for nw in args.workers:
        it = iter(build_loader(replace(data, num_workers=nw), tok, "train"))
        for _ in range(args.warmup + nw):  # worker start-up and the shuffle buffers filling
            next(it)
        for ms in args.step_ms:
            step, frac = stand_in_steps(it, args.steps, ms / 1e3)
            rows.append({"workers": nw, "step_ms": ms, "replay_ms": ref[ms] * 1e3, "loader_ms": step * 1e3,
                         "gap": step / ref[ms] - 1, "data_wait_frac": frac, "core_s": core_s,
                         "cores": cores_per_gpu(core_s, 1, ms / 1e3)})
        del it
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, nargs="+", required=True,
                   help="stand-in step times, e.g. the plan's roofline step for the config and 0.5x, 2x it")
    p.add_argument("--config", default="configs/small.yaml", help="whose data settings the loader uses")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--corpus", type=Path, help="a shapes-world corpus dir (else one is written)")
    p.add_argument("--size", type=int, default=224, help="px of the written corpus's images and clips")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--mixes", nargs="+", default=["image", "video", "interleaved"], choices=KINDS[:3])
    p.add_argument("--steps", type=int, default=6, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=1, help="batches before timing (plus one per worker)")
    p.add_argument("--cache", type=int, default=2, help="batches cached for the replay")
    args = p.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.corpus or Path(tmp)
        if args.corpus is None:
            write_corpus(root, args.size)
        tok = load_tokenizer(str(root / "tokenizer.json"))
        d, m = cfg.data, cfg.data.media
        print(f"{args.config}: seq_len {d.seq_len}, batch {d.batch_size}, max_pixels {m.max_pixels}, "
              f"video {m.video_fps:g} fps {m.video_min_frames}..{m.video_max_frames} frames; "
              f"{args.steps} timed steps a row")
        print("| mix | workers | step ms | replayed ms | loader ms | gap | data_wait_frac | core-s a batch "
              "| cores a GPU |\n|---|---|---|---|---|---|---|---|---|")
        for heavy in args.mixes:
            for r in rows_for_mix(mix_data(cfg.data, root, heavy), tok, args):
                print(f"| {heavy}-heavy | {r['workers']} | {r['step_ms']:g} | {r['replay_ms']:.1f} | "
                      f"{r['loader_ms']:.1f} | {r['gap']:+.0%} | {r['data_wait_frac']:.2f} | "
                      f"{r['core_s']:.3f} | {r['cores']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
