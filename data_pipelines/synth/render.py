"""Pixels of the shapes world: images (PNG) and short clips (MP4, H.264 or MPEG-4 Part 2).

Shapes are drawn without anti-aliasing, so an object's box is the tight box of the pixels
that carry its colour. Backgrounds are dark, textured and noisy: a model cannot find objects
by looking for "anything not flat".

Shape legend: H, W = pixels, T = frames, 3 = RGB.
"""

from __future__ import annotations

import io
import math
from types import MappingProxyType

import av
import decord
import numpy as np
from PIL import Image, ImageDraw

from mmtrain.data_pipelines.synth.world import Obj, color_rgb

# Radius of an object as a fraction of a grid cell; large objects still fit inside their cell.
RADIUS = MappingProxyType({"small": 0.22, "large": 0.40})
GROW, SHRINK = 1.5, 0.55  # end radius / start radius of "grows" / "shrinks"
MAX_RADIUS = 0.47  # of a cell: a growing object stays inside its cell


def background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Dark texture: a random low-frequency colour field plus per-pixel noise, values in 0..~85."""
    coarse = Image.fromarray((rng.random((4, 4, 3)) * 255).astype(np.uint8))
    smooth = np.asarray(coarse.resize((w, h), Image.BILINEAR), dtype=np.float32) / 255.0  # H W 3
    img_HW3 = 8.0 + 50.0 * smooth + rng.normal(0.0, 7.0, size=(h, w, 3))
    return np.clip(img_HW3, 0, 255).astype(np.uint8)


def shape_mask(shape: str, cx: float, cy: float, r: float, h: int, w: int) -> np.ndarray:
    """Boolean H x W mask of one shape of radius r centred at (cx, cy)."""
    canvas = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(canvas)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    elif shape == "square":
        s = 0.85 * r  # about the circle's area
        d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=255)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=255)
    elif shape == "star":
        pts = [
            (cx + rr * math.cos(a), cy + rr * math.sin(a))
            for k in range(10)
            for rr, a in [((r if k % 2 == 0 else 0.45 * r), -math.pi / 2 + k * math.pi / 5)]
        ]
        d.polygon(pts, fill=255)
    elif shape == "cross":
        t = 0.35 * r
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=255)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=255)
    else:
        raise ValueError(f"unknown shape: {shape}")
    return np.asarray(canvas) > 0


def box_of(mask_HW: np.ndarray) -> list[int]:
    """[x0, y0, x1, y1] of the mask's pixels, x1/y1 exclusive."""
    ys, xs = np.nonzero(mask_HW)
    if len(xs) == 0:
        raise ValueError("empty shape mask")
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


def paint(img_HW3: np.ndarray, mask_HW: np.ndarray, color: str, rng: np.random.Generator) -> None:
    """Fill the mask with the colour plus mild noise (small enough to keep colours apart)."""
    rgb = np.asarray(color_rgb(color), dtype=np.float32)
    noise = rng.normal(0.0, 6.0, size=(int(mask_HW.sum()), 3))
    img_HW3[mask_HW] = np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _cell_geometry(obj: Obj, size: int, rng: np.random.Generator) -> tuple[float, float, float, float]:
    """(cx, cy, r, cell) for an object placed in its grid cell with a little jitter."""
    cell = size / 3.0
    row, col = obj.cell
    r = RADIUS[obj.size] * cell * rng.uniform(0.9, 1.05)
    slack = max(cell / 2 - r - 1.0, 0.0) * 0.5
    cx = (col + 0.5) * cell + rng.uniform(-slack, slack)
    cy = (row + 0.5) * cell + rng.uniform(-slack, slack)
    return cx, cy, r, cell


def render_image(objs: list[Obj], size: int, rng: np.random.Generator) -> tuple[np.ndarray, list[list[int]]]:
    """A size x size image of the objects and each object's box."""
    img_HW3 = background(rng, size, size)
    boxes = []
    for o in objs:
        cx, cy, r, _ = _cell_geometry(o, size, rng)
        mask_HW = shape_mask(o.shape, cx, cy, r, size, size)
        paint(img_HW3, mask_HW, o.color, rng)
        boxes.append(box_of(mask_HW))
    return img_HW3, boxes


def _trajectory(obj: Obj, size: int, frames: int, rng: np.random.Generator):
    """Per-frame (cx, cy, r): translations cross two cells, grow/shrink stay put."""
    cx, cy, r, cell = _cell_geometry(obj, size, rng)
    dx, dy = {"moves left": (-2, 0), "moves right": (2, 0), "moves up": (0, -2), "moves down": (0, 2)}.get(
        obj.motion or "", (0, 0)
    )
    r_end = {"grows": min(r * GROW, MAX_RADIUS * cell), "shrinks": r * SHRINK}.get(obj.motion or "", r)
    out = []
    for t in range(frames):
        a = t / max(frames - 1, 1)
        out.append((cx + a * dx * cell, cy + a * dy * cell, r + a * (r_end - r)))
    return out


def render_video(
    objs: list[Obj], size: int, frames: int, rng: np.random.Generator
) -> tuple[np.ndarray, list[list[list[int]]]]:
    """T x size x size x 3 frames and, per object, its box in every frame."""
    bg_HW3 = background(rng, size, size)
    paths = [_trajectory(o, size, frames, rng) for o in objs]
    video_THW3 = np.repeat(bg_HW3[None], frames, axis=0)
    boxes: list[list[list[int]]] = [[] for _ in objs]
    for t in range(frames):
        for i, (o, path) in enumerate(zip(objs, paths)):
            mask_HW = shape_mask(o.shape, *path[t], size, size)
            paint(video_THW3[t], mask_HW, o.color, rng)
            boxes[i].append(box_of(mask_HW))
    return video_THW3, boxes


def encode_png(img_HW3: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img_HW3, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def video_codec() -> str:
    """H.264 when this PyAV build has libx264, else MPEG-4 Part 2 (decord reads both)."""
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def encode_mp4(video_THW3: np.ndarray, fps: int, codec: str | None = None) -> bytes:
    """MP4 bytes, yuv420p, no B-frames (one packet per frame: decoders agree on the frame count)."""
    codec = codec or video_codec()
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = video_THW3.shape[2], video_THW3.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # deterministic bytes; parallelism is per shard
        if codec == "libx264":
            # Constant QP, not CRF: x264's CRF rate control gave different bytes for the same
            # frames from run to run (seen with PyAV 18 / libx264 here); QP mode did not.
            stream.options = {"qp": "20", "preset": "veryfast", "bframes": "0"}
        else:
            stream.options = {"b": "1M"}  # the 200 kb/s default smears 64 px clips
        for t, frame_HW3 in enumerate(video_THW3):
            frame = av.VideoFrame.from_ndarray(frame_HW3, format="rgb24")
            frame.pts = t  # explicit timestamps: one frame per 1/fps
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def decord_reads(size: int, frames: int, fps: int) -> bool:
    """Whether decord decodes our clips at this size: decord 0.6 fails on some widths (16, 24,
    48 and 72 among the even widths 16..256) with 'DECORDArrayCopyFromTo: size must match'."""
    clip = encode_mp4(np.zeros((frames, size, size, 3), dtype=np.uint8), fps)
    try:
        vr = decord.VideoReader(io.BytesIO(clip))
        return vr.get_batch(list(range(len(vr)))).shape[0] == frames
    except decord.DECORDError:
        return False
