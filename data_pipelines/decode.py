"""Decode member bytes: text (UTF-8), images (Pillow) and video (decord, PyAV as a fallback).

Every failure is a `SkipSample` with a reason, never an exception that escapes the loader.
Shapes: T frames, H/W pixels, 3 = RGB; frames are uint8.
"""

from __future__ import annotations

import io
import json
import math
import warnings

import numpy as np
from PIL import Image, ImageOps

from data_pipelines import ledger as L
from data_pipelines.config import MediaConfig
from data_pipelines.ledger import SkipSample
from data_pipelines.preprocess import plan_size

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTS = ("mp4", "webm", "mkv")
# Transparent pixels become mid-grey: close to the normalisation mean, so "nothing" is ~0.
ALPHA_BACKGROUND = (128, 128, 128, 255)
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def decode_text(data: bytes, what: str = "txt") -> str:
    try:
        text = data.decode("utf-8").lstrip("\ufeff").strip()
    except UnicodeDecodeError as e:
        raise SkipSample(L.BAD_TEXT, f"{what}: {e.reason} at byte {e.start}") from None
    if not text:
        raise SkipSample(L.EMPTY_TEXT, what)
    return text


def decode_json(data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SkipSample(L.BAD_JSON, str(e).splitlines()[0]) from None


# ----- images ---------------------------------------------------------------------------------
def _open_image(data: bytes, media: MediaConfig) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise SkipSample(L.TOO_LARGE, str(e)) from None
    except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError from broken headers
        raise SkipSample(L.CORRUPT_IMAGE, f"{type(e).__name__}: {e}") from None
    w, h = im.size
    if w * h > media.max_image_pixels:
        raise SkipSample(L.TOO_LARGE, f"{w}x{h} > max_image_pixels {media.max_image_pixels}")
    if w < 1 or h < 1:
        raise SkipSample(L.CORRUPT_IMAGE, f"size {w}x{h}")
    return im


def _draft(im: Image.Image, media: MediaConfig) -> None:
    """JPEG: decode at 1/2..1/8 scale when the target is that much smaller (much faster)."""
    if im.format != "JPEG":
        return
    w, h = im.size
    H, W = plan_size(h, w, media)
    scale = math.sqrt(H * W / (h * w))
    if scale < 0.5:
        im.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))


def to_rgb(im: Image.Image) -> np.ndarray:
    """Any Pillow mode -> uint8 (H, W, 3): palette, grey, alpha (over grey), CMYK, 16-bit, float."""
    if im.mode == "RGB":
        return np.asarray(im)
    if im.mode in _SIXTEEN_BIT or im.mode == "F":
        a = np.asarray(im).astype(np.float32)
        a = a / 257.0 if im.mode in _SIXTEEN_BIT else a  # 0..65535 -> 0..255
        grey = np.clip(np.rint(a), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND)
        return np.asarray(Image.alpha_composite(bg, rgba).convert("RGB"))
    return np.asarray(im.convert("RGB"))  # P, L, 1, CMYK, YCbCr, LAB, HSV


def decode_image(data: bytes, media: MediaConfig) -> np.ndarray:
    """Bytes -> uint8 (H, W, 3), EXIF orientation applied."""
    im = _open_image(data, media)
    try:
        _draft(im, media)
        im = ImageOps.exif_transpose(im)
        return np.array(to_rgb(im))  # a writable copy, detached from Pillow's buffer
    except SkipSample:
        raise
    except Exception as e:  # truncated data surfaces on load: OSError, SyntaxError, ValueError...
        raise SkipSample(L.CORRUPT_IMAGE, f"{type(e).__name__}: {e}") from None


# ----- video ----------------------------------------------------------------------------------
def sample_frame_indices(n_frames: int, fps: float, media: MediaConfig) -> list[int]:
    """Frames at media.video_fps, uniform in time, count clamped to [min, max] frames and padded
    (repeating the last frame) to a multiple of temporal_patch."""
    if not fps or not math.isfinite(fps) or fps <= 0:
        fps = media.video_fps  # unknown rate: take one frame per frame
    duration = n_frames / fps
    n = round(duration * media.video_fps)
    n = min(max(n, media.video_min_frames), media.video_max_frames)
    idx = [min(n_frames - 1, int((i + 0.5) * n_frames / n)) for i in range(n)]
    pad = -n % media.temporal_patch
    return idx + [idx[-1]] * pad


def _decode_decord(data: bytes, media: MediaConfig) -> np.ndarray:
    import decord

    vr = decord.VideoReader(io.BytesIO(data), num_threads=1)
    if len(vr) == 0:
        raise SkipSample(L.CORRUPT_VIDEO, "no frames")
    idx = sample_frame_indices(len(vr), vr.get_avg_fps(), media)
    uniq = sorted(set(idx))
    frames = vr.get_batch(uniq).asnumpy()  # U H W 3
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"decord returned shape {frames.shape}")
    where = {f: i for i, f in enumerate(uniq)}
    return frames[[where[i] for i in idx]]


def _decode_pyav(data: bytes, media: MediaConfig) -> np.ndarray:
    """Fallback for streams decord mis-sizes (it fails on some frame widths)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 0)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    if not frames:
        raise SkipSample(L.CORRUPT_VIDEO, "no frames")
    idx = sample_frame_indices(len(frames), fps, media)
    return np.stack([frames[i] for i in idx])


def decode_video(data: bytes, media: MediaConfig) -> np.ndarray:
    """Bytes -> uint8 (T, H, W, 3), T a multiple of temporal_patch."""
    if not data:
        raise SkipSample(L.CORRUPT_VIDEO, "empty member")
    if b"\0" not in data[:4096]:  # text, not a container (and decord would echo it all to stderr)
        raise SkipSample(L.CORRUPT_VIDEO, "not a video container")
    try:
        frames_THW3 = _decode_decord(data, media)
    except SkipSample:
        raise
    except Exception as first:
        try:
            frames_THW3 = _decode_pyav(data, media)
        except SkipSample:
            raise
        except Exception:
            raise SkipSample(L.CORRUPT_VIDEO, f"{type(first).__name__}: {str(first)[:200]}") from None
    T, H, W, _ = frames_THW3.shape
    if media.max_image_pixels < H * W:
        raise SkipSample(L.TOO_LARGE, f"frames {W}x{H} > max_image_pixels {media.max_image_pixels}")
    return frames_THW3
