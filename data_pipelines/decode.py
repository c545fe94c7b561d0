"""Decode member bytes: text (UTF-8), images (Pillow) and video (media.video_decoder: decord, with
PyAV as its fallback, or PyAV alone).

Every failure is a `SkipSample` with a reason, never an exception that escapes the loader.
Shapes: T frames, H/W pixels, 3 = RGB; frames are uint8.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import warnings
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.config import MediaConfig
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.preprocess import plan_size

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
    except RecursionError:  # json's C parser guards its recursion: a hostile nesting depth lands here
        raise SkipSample(L.BAD_JSON, "nested too deeply") from None


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
        rgb = to_rgb(im)
        fy, fx = _reduction(*rgb.shape[:2], media)
        if fy > 1 or fx > 1:  # held at most at twice the largest resize target per side
            rgb = Image.fromarray(rgb).reduce((fx, fy))
        return np.array(rgb)  # a writable copy, detached from Pillow's buffer
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


class _Probe(NamedTuple):
    frames: int  # 0 when the container does not say (then packets are counted)
    fps: float
    h: int
    w: int


def _probe(data: bytes) -> _Probe:
    """Frame count, rate and size from the container headers (packets counted, nothing decoded)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise SkipSample(L.CORRUPT_VIDEO, "no video stream")
        stream = container.streams.video[0]
        h, w = stream.codec_context.height, stream.codec_context.width
        n = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        return _Probe(n, float(stream.average_rate or 0), h, w)


def _reduction(h: int, w: int, media: MediaConfig) -> tuple[int, int]:
    """Integer (y, x) factors that keep a decoded frame at least twice the largest resize target
    per side (Pillow's reducing_gap rule): a 4K frame is never held at 4K."""
    H, W = plan_size(h, w, media)
    return max(1, h // (2 * H)), max(1, w // (2 * W))


def _decode_size(h: int, w: int, media: MediaConfig) -> tuple[int, int] | None:
    fy, fx = _reduction(h, w, media)
    return None if fy == fx == 1 else (max(2, h // fy // 2 * 2), max(2, w // fx // 2 * 2))


def _decode_decord(data: bytes, media: MediaConfig, size: tuple[int, int] | None) -> np.ndarray:
    import decord

    h, w = size or (-1, -1)
    vr = decord.VideoReader(io.BytesIO(data), num_threads=1, width=w, height=h)
    if len(vr) == 0:
        raise SkipSample(L.CORRUPT_VIDEO, "no frames")
    idx = sample_frame_indices(len(vr), vr.get_avg_fps(), media)
    uniq = sorted(set(idx))
    frames = vr.get_batch(uniq).asnumpy()  # U H W 3
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"decord returned shape {frames.shape}")
    where = {f: i for i, f in enumerate(uniq)}
    return frames[[where[i] for i in idx]]


def _decode_pyav(data: bytes, media: MediaConfig, probe: _Probe, size: tuple[int, int] | None) -> np.ndarray:
    """Fallback for streams decord mis-sizes (it fails on some frame widths): frame by frame,
    converting only the sampled frames (at the decode size), stopping after the last one."""
    import av

    idx = sample_frame_indices(max(probe.frames, 1), probe.fps, media)
    wanted, kept = set(idx), {}
    h, w = size or (probe.h, probe.w)
    with av.open(io.BytesIO(data)) as container:
        for i, frame in enumerate(container.decode(container.streams.video[0])):
            if i in wanted:
                kept[i] = frame.to_ndarray(format="rgb24", width=w, height=h)
            if i >= idx[-1]:
                break
    if not kept:
        raise SkipSample(L.CORRUPT_VIDEO, "no frames")
    # the header promised frames the stream lacks: those indices take the last frame decoded
    got = sorted(kept)
    return np.stack([kept[max((g for g in got if g <= i), default=got[0])] for i in idx])


class ClipCache:
    """Decoded clips by content: the bytes' blake2b plus the settings that shape the frames -> frames
    (read-only), least recently used out past `budget` bytes. One per process (a loader worker's
    own): the same clip read again, in a later epoch or another document, is not decoded again."""

    def __init__(self, budget: int) -> None:
        self.budget, self.size, self.hits, self.misses = budget, 0, 0, 0
        self._clips: OrderedDict[tuple, np.ndarray] = OrderedDict()

    @staticmethod
    def key(data: bytes, media: MediaConfig) -> tuple:
        return (hashlib.blake2b(data, digest_size=16).digest(), len(data), media.video_fps,
                media.video_min_frames, media.video_max_frames, media.temporal_patch, media.min_pixels,
                media.max_pixels, media.factor, media.max_image_pixels, media.max_source_frames,
                media.video_decoder)

    def get(self, key: tuple) -> np.ndarray | None:
        frames = self._clips.get(key)
        if frames is None:
            self.misses += 1
            return None
        self.hits += 1
        self._clips.move_to_end(key)
        return frames

    def put(self, key: tuple, frames: np.ndarray) -> np.ndarray:
        frames.flags.writeable = False  # shared by every later read: nobody may write into it
        if frames.nbytes <= self.budget:
            self._clips[key] = frames
            self.size += frames.nbytes
            while self.size > self.budget:
                self.size -= self._clips.popitem(last=False)[1].nbytes
        return frames


_CLIP_CACHE: ClipCache | None = None


def clip_cache(media: MediaConfig) -> ClipCache | None:
    """This process's clip cache (None when media.video_cache_mb is 0); resized to the config's budget."""
    global _CLIP_CACHE
    budget = media.video_cache_mb * 2**20
    if not budget:
        return None
    if _CLIP_CACHE is None or _CLIP_CACHE.budget != budget:
        _CLIP_CACHE = ClipCache(budget)
    return _CLIP_CACHE


def decode_video(data: bytes, media: MediaConfig) -> np.ndarray:
    """Bytes -> uint8 (T, H, W, 3), T a multiple of temporal_patch (read-only when it comes from the
    clip cache, `media.video_cache_mb`). Skips are not cached: a bad clip is judged again."""
    cache = clip_cache(media)
    if cache is None:
        return _decode_video(data, media)
    key = cache.key(data, media)
    frames = cache.get(key)
    return frames if frames is not None else cache.put(key, _decode_video(data, media))


def _decode_video(data: bytes, media: MediaConfig) -> np.ndarray:
    """Size and frame caps come from the headers, before anything is decoded; at most the sampled
    frames are held, each at most twice the largest resize target per side."""
    if not data:
        raise SkipSample(L.CORRUPT_VIDEO, "empty member")
    if b"\0" not in data[:4096]:  # text, not a container (and decord would echo it all to stderr)
        raise SkipSample(L.CORRUPT_VIDEO, "not a video container")
    try:
        probe = _probe(data)
    except SkipSample:
        raise
    except Exception as e:
        raise SkipSample(L.CORRUPT_VIDEO, f"{type(e).__name__}: {str(e)[:200]}") from None
    if probe.h < 1 or probe.w < 1:
        raise SkipSample(L.CORRUPT_VIDEO, f"size {probe.w}x{probe.h}")
    if probe.h * probe.w > media.max_image_pixels:
        raise SkipSample(L.TOO_LARGE, f"frames {probe.w}x{probe.h} > max_image_pixels "
                                      f"{media.max_image_pixels}")
    if probe.frames > media.max_source_frames:
        raise SkipSample(L.TOO_LARGE, f"{probe.frames} frames > max_source_frames {media.max_source_frames}")
    size = _decode_size(probe.h, probe.w, media)
    try:
        if media.video_decoder == "pyav":
            return _decode_pyav(data, media, probe, size)
        return _decode_decord(data, media, size)
    except SkipSample:
        raise
    except Exception as first:
        if media.video_decoder == "pyav":
            raise SkipSample(L.CORRUPT_VIDEO, f"{type(first).__name__}: {str(first)[:200]}") from None
        try:
            return _decode_pyav(data, media, probe, size)
        except SkipSample:
            raise
        except Exception:
            raise SkipSample(L.CORRUPT_VIDEO, f"{type(first).__name__}: {str(first)[:200]}") from None
