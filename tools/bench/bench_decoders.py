"""Per-core decode rates: JPEG/PNG images at 224 and 448 px and H.264 clips, for each decoder installed.

    python -m tools.bench.bench_decoders [--sizes 224 448] [--seconds 2] [--clip-frames 16 --clip-fps 8]

One process, one thread per decoder (decord num_threads=1, PyAV thread_count=1, torch 1 thread),
so CPU seconds are core seconds: a rate is items over the process's CPU time (time.process_time),
the wall rate beside it. Media are shapes-world pixels (a dark textured, noisy background: JPEG
entropy closer to a photo's than flat colour). Rows:

- image `pillow`: Pillow decode to RGB only; `mmtrain`: the loader's path (decode_image with JPEG
  draft + to_medium: resize to the patch grid, normalise, patchify) at the `small` config's media
  settings with max_pixels = the image's own size (no downscale);
- video: each decoder through mmtrain's own decode path (data_pipelines/decode.py) at the `small`
  config's sampling (video_fps 2, 4..16 frames); `frames/s` counts the frames returned (sampled).
  torchcodec and spdl rows say why they do not run when they do not.

The ratio column is against the first row of its group (Pillow for images, PyAV for video), in
this process. decord2 installs as the module `decord` too: run this script again with decord2 on
PYTHONPATH (or installed) and the decord row is labelled by the version it loaded.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from mmtrain.data_pipelines import decode as D
from mmtrain.data_pipelines.batch import IMAGE
from mmtrain.data_pipelines.config import MediaConfig
from mmtrain.data_pipelines.preprocess import Decoded, to_medium
from mmtrain.data_pipelines.synth.render import background, encode_mp4


def small_media(side: int) -> MediaConfig:
    """The `small` config's media settings, the resize target at the medium's own size."""
    return MediaConfig(patch_size=14, temporal_patch=2, merge=2, min_pixels=3136, max_pixels=side * side,
                       video_fps=2.0, video_min_frames=4, video_max_frames=16)


def images(side: int, fmt: str, n: int, rng: np.random.Generator) -> list[bytes]:
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        opts = {"quality": 90} if fmt == "JPEG" else {}
        Image.fromarray(background(rng, side, side)).save(buf, format=fmt, **opts)
        out.append(buf.getvalue())
    return out


def clips(side: int, frames: int, fps: int, n: int, rng: np.random.Generator) -> list[bytes]:
    """Clips whose frames change (a drifting background): a static clip decodes unrealistically fast."""
    out = []
    for _ in range(n):
        bg_HW3 = background(rng, side + frames * 4, side + frames * 4)
        video_THW3 = np.stack([bg_HW3[4 * t : 4 * t + side, 4 * t : 4 * t + side] for t in range(frames)])
        out.append(encode_mp4(video_THW3, fps, codec="libx264"))
    return out


def rate(fn: Callable[[bytes], int], items: list[bytes], seconds: float) -> tuple[float, float]:
    """(units per CPU second, units per wall second) over whole passes for at least `seconds`."""
    fn(items[0])  # warm: first-call library set-up is not a per-item cost
    units, c0, w0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        units += sum(fn(x) for x in items)
    return units / (time.process_time() - c0), units / (time.perf_counter() - w0)


def image_rows(side: int, fmt: str, seconds: float, rng) -> list[tuple[str, float, float]]:
    """Pillow alone, the loader's path at the image's size and, from 448 px, down to 224 px (the
    public per-core figures are for a decode + resize to 224 px)."""
    data = images(side, fmt, 16, rng)

    def bare(b: bytes) -> int:
        Image.open(io.BytesIO(b)).convert("RGB").load()
        return 1

    def loader(b: bytes, media: MediaConfig) -> int:
        rgb_HW3 = D.decode_image(b, media)
        to_medium(Decoded(IMAGE, rgb_HW3[None]), media, media.max_pixels, media.video_max_frames)
        return 1

    rows = [("pillow", *rate(bare, data, seconds))]
    for target in sorted({side, 224}, reverse=True):
        media = small_media(target)
        if target <= side:
            rows.append((f"mmtrain decode+preprocess to {target} px",
                         *rate(lambda b, m=media: loader(b, m), data, seconds)))
    return rows


def video_decoders() -> dict[str, Callable | str]:
    """name -> fn(bytes, media) -> frames, or a one-line reason it does not run here."""
    out: dict[str, Callable | str] = {"pyav": lambda b, m: D._decode_pyav(b, m, D._probe(b), None)}
    try:
        import decord

        out[f"decord {decord.__version__}"] = lambda b, m: D._decode_decord(b, m, None)
    except ImportError as e:
        out["decord"] = f"not installed ({e})"
    out["torchcodec"] = _why_not(lambda: __import__("torchcodec.decoders"))
    out["spdl"] = _why_not(_spdl_demux)
    return out


def _spdl_demux() -> None:
    import spdl.io

    spdl.io.demux_video(encode_mp4(np.zeros((2, 64, 64, 3), np.uint8), 2))  # loads its FFmpeg binding


def _why_not(load: Callable[[], object]) -> str:
    try:
        load()
    except Exception as e:
        cause = e.__cause__ or e
        return f"does not run: {type(cause).__name__}: {str(cause).splitlines()[0][:160]}"
    return "runs, but mmtrain has no decode path for it"


def video_rows(side: int, frames: int, fps: int, seconds: float, rng) -> list[tuple[str, float, float] | str]:
    data, media = clips(side, frames, fps, 6, rng), small_media(side)
    rows: list = []
    for name, fn in video_decoders().items():
        if isinstance(fn, str):
            rows.append(f"{name}: {fn}")
            continue
        rows.append((name, *rate(lambda b, fn=fn: len(fn(b, media)), data, seconds)))
    return rows


def print_group(title: str, unit: str, rows: list) -> None:
    timed = [r for r in rows if not isinstance(r, str)]
    ref = timed[0] if timed else ("-", 1.0)
    print(f"\n{title}\n| decoder | {unit} per core | {unit} per wall s | vs {ref[0]} |\n|---|---|---|---|")
    for r in rows:
        if isinstance(r, str):
            print(f"| {r} | | | |")
        else:
            print(f"| {r[0]} | {r[1]:.0f} | {r[2]:.0f} | {r[1] / ref[1]:.2f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 448])
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per row")
    p.add_argument("--clip-frames", type=int, default=16)
    p.add_argument("--clip-fps", type=int, default=8)
    p.add_argument("--only", choices=("image", "video"), help="one group of rows")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng()
    for side in args.sizes:
        if args.only != "video":
            for fmt in ("JPEG", "PNG"):
                print_group(f"{fmt} {side} px", "images/s", image_rows(side, fmt, args.seconds, rng))
        if args.only != "image":
            n = len(D.sample_frame_indices(args.clip_frames, args.clip_fps, small_media(side)))
            print_group(f"H.264 {side} px, {args.clip_frames} frames at {args.clip_fps} fps, {n} sampled "
                        f"(2 fps; clips/s = frames/s / {n})", "frames/s",
                        video_rows(side, args.clip_frames, args.clip_fps, args.seconds, rng))


if __name__ == "__main__":
    main()
