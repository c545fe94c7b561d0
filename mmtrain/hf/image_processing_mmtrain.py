"""Images and videos -> mmtrain's patches, exactly as its data pipeline makes them (remote code).

Image: a path or a PIL image is read as mmtrain reads a file (JPEG draft decoding when the target
is much smaller, EXIF orientation, any mode to RGB with transparency over mid-grey); an array is
taken as RGB uint8 (H, W, 3). Frames more than twice the largest target per side are first
box-reduced by an integer factor. Video: a (T, H, W, 3) uint8 array or a list of frames, all
decoded frames of the clip; `fps` (its frame rate) picks video_fps frames per second uniformly in
time, clamped to [video_min_frames, video_max_frames] and padded with the last frame to a multiple
of the temporal patch (without `fps`, one frame per frame). mmtrain decodes video files with
decord, which scales large frames while decoding: the same frames only when no reduction applies.

Then (preprocess): an aspect-preserving size, both sides multiples of patch * merge, area within
[min_pixels, the budget's max_pixels]; bicubic resize (Pillow, reducing_gap 2); an image repeated
temporal_patch times; normalised (x / 255 - mean) / std in float32; cut into (temporal_patch x
patch x patch) tubelets in raster (t, h, w) order, each channel-major. Grids are (t, h, w) in
patches before the merge.

Legend: T frames, H/W pixels, C channels, N patches of a medium, P patch dim.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
from transformers.image_processing_utils import BaseImageProcessor

ALPHA_BACKGROUND = (128, 128, 128, 255)  # transparent pixels become mid-grey (mmtrain's decode)
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")


class MmtrainImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        patch_size: int = 8,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        min_pixels: int = 1024,
        max_pixels: int = 16384,
        video_fps: float = 2.0,
        video_min_frames: int = 2,
        video_max_frames: int = 8,
        image_mean: list | None = None,
        image_std: list | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.patch_size, self.temporal_patch_size, self.merge_size = (
            patch_size,
            temporal_patch_size,
            merge_size,
        )
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video_fps, self.video_min_frames, self.video_max_frames = (
            video_fps,
            video_min_frames,
            video_max_frames,
        )
        self.image_mean = list(image_mean or (0.48145466, 0.4578275, 0.40821073))
        self.image_std = list(image_std or (0.26862954, 0.26130258, 0.27577711))

    # ----- decoding (what mmtrain does to a file before the budget picks a size) ---------------------
    def load_image(self, image) -> np.ndarray:
        """-> uint8 (H, W, 3)."""
        if isinstance(image, (str, Path)):
            image = Image.open(image)
        if isinstance(image, Image.Image):
            self._draft(image)
            rgb = _to_rgb(ImageOps.exif_transpose(image))
        else:
            rgb = np.asarray(image)
            if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[-1] != 3:
                raise ValueError(f"images: an array must be uint8 (H, W, 3) (got {rgb.dtype} {rgb.shape})")
        return self._reduce(rgb)

    def load_video(self, video, fps: float | None = None) -> np.ndarray:
        """All frames of a clip -> the sampled uint8 (T, H, W, 3), T a multiple of the temporal patch."""
        frames = [
            np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in video
        ]
        if not frames or frames[0].ndim != 3 or frames[0].shape[-1] != 3:
            raise ValueError("videos: each needs frames of shape (H, W, 3)")
        idx = self.frame_indices(len(frames), fps)
        return np.stack([self._reduce(frames[i]) for i in idx])

    def frame_indices(self, n_frames: int, fps: float | None) -> list[int]:
        if not fps or not math.isfinite(fps) or fps <= 0:
            fps = self.video_fps  # unknown rate: one frame per frame
        n = round(n_frames / fps * self.video_fps)
        n = min(max(n, self.video_min_frames), self.video_max_frames)
        idx = [min(n_frames - 1, int((i + 0.5) * n_frames / n)) for i in range(n)]
        return idx + [idx[-1]] * (-n % self.temporal_patch_size)

    def _draft(self, im: Image.Image) -> None:
        if im.format != "JPEG":
            return
        w, h = im.size
        H, W = self.plan_size(h, w)
        scale = math.sqrt(H * W / (h * w))
        if scale < 0.5:
            im.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))

    def _reduce(self, rgb: np.ndarray) -> np.ndarray:
        h, w = rgb.shape[:2]
        H, W = self.plan_size(h, w)
        fy, fx = max(1, h // (2 * H)), max(1, w // (2 * W))
        return np.array(Image.fromarray(rgb).reduce((fx, fy))) if fy > 1 or fx > 1 else np.array(rgb)

    # ----- the budget's sizes and the patches ------------------------------------------------------
    def plan_size(self, h: int, w: int, max_pixels: int | None = None) -> tuple[int, int]:
        f = self.patch_size * self.merge_size
        lo, hi = self.min_pixels, max(max_pixels or self.max_pixels, self.min_pixels)
        H, W = max(f, round(h / f) * f), max(f, round(w / f) * f)
        if hi < H * W:
            beta = math.sqrt(h * w / hi)
            H, W = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        elif lo > H * W:
            beta = math.sqrt(lo / (h * w))
            H, W = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        while hi < H * W and max(H, W) > f:  # extreme aspect ratios
            if H >= W:
                H -= f
            else:
                W -= f
        return H, W

    def budget_levels(self) -> list[tuple[int, int]]:
        """(max_pixels, max_frames) in the order mmtrain tries them when a document is too long."""
        px = _levels(self.max_pixels, self.min_pixels)
        tp = self.temporal_patch_size
        lo = -(-self.video_min_frames // tp) * tp
        fr = [max(tp, -(-f // tp) * tp) for f in _levels(self.video_max_frames, lo)]
        return [(p, fr[0]) for p in px] + [(px[-1], f) for f in fr[1:]]

    def grid(
        self, frames_THWC: np.ndarray, is_video: bool, max_pixels: int, max_frames: int
    ) -> tuple[int, int, int]:
        H, W = self.plan_size(*frames_THWC.shape[1:3], max_pixels)
        n = min(len(frames_THWC), max_frames) if is_video else self.temporal_patch_size
        return n // self.temporal_patch_size, H // self.patch_size, W // self.patch_size

    def patches(
        self, frames_THWC: np.ndarray, is_video: bool, max_pixels: int, max_frames: int
    ) -> np.ndarray:
        """-> float32 (N, P) of one medium (frames from load_image()[None] or load_video)."""
        H, W = self.plan_size(*frames_THWC.shape[1:3], max_pixels)
        if is_video:
            frames = _resize(_subsample(frames_THWC, min(len(frames_THWC), max_frames)), H, W)
        else:
            frames = np.repeat(_resize(frames_THWC, H, W), self.temporal_patch_size, axis=0)
        p, tp = self.patch_size, self.temporal_patch_size
        T, C = frames.shape[0], frames.shape[-1]
        x = frames.reshape(T // tp, tp, H // p, p, W // p, p, C).transpose(0, 2, 4, 6, 1, 3, 5)
        x = x.reshape(-1, C, tp * p * p)  # N tubelets, channel-major
        std_C1 = np.asarray(self.image_std, np.float32)[:, None]
        x_f32 = x.astype(np.float32)
        x_f32 *= 1.0 / (255.0 * std_C1)
        x_f32 -= np.asarray(self.image_mean, np.float32)[:, None] / std_C1
        return x_f32.reshape(len(x_f32), -1)

    def preprocess(self, images=None, videos=None, video_fps=None, **kwargs) -> dict:
        """Media alone at the full budget: pixel_values / image_grid_thw (and ..._videos)."""
        out = {}
        for key, media, is_video in (("image", images, False), ("video", videos, True)):
            if media is None:
                continue
            decoded = [self.load_video(m, video_fps) if is_video else self.load_image(m)[None] for m in media]
            px, fr = self.max_pixels, self.video_max_frames
            name = "pixel_values_videos" if is_video else "pixel_values"
            out[name] = np.concatenate([self.patches(d, is_video, px, fr) for d in decoded])
            out[f"{key}_grid_thw"] = np.array([self.grid(d, is_video, px, fr) for d in decoded], np.int64)
        return out

    def __call__(self, images=None, videos=None, **kwargs) -> dict:
        return self.preprocess(images, videos, **kwargs)


def _levels(hi: int, lo: int) -> list[int]:
    out = [hi]
    while out[-1] // 2 > lo:
        out.append(out[-1] // 2)
    return out + [lo] if out[-1] != lo else out


def _subsample(frames_THWC: np.ndarray, n: int) -> np.ndarray:
    T = len(frames_THWC)
    if n >= T:
        return frames_THWC
    return frames_THWC[[min(T - 1, int((i + 0.5) * T / n)) for i in range(n)]]


def _resize(frames_THWC: np.ndarray, H: int, W: int) -> np.ndarray:
    if frames_THWC.shape[1:3] == (H, W):
        return frames_THWC
    return np.stack(
        [np.asarray(Image.fromarray(f).resize((W, H), Image.BICUBIC, reducing_gap=2.0)) for f in frames_THWC]
    )


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode == "RGB":
        return np.asarray(im)
    if im.mode in _SIXTEEN_BIT or im.mode == "F":
        a = np.asarray(im).astype(np.float32)
        a = a / 257.0 if im.mode in _SIXTEEN_BIT else a
        grey = np.clip(np.rint(a), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND)
        return np.asarray(Image.alpha_composite(bg, rgba).convert("RGB"))
    return np.asarray(im.convert("RGB"))


__all__ = ["MmtrainImageProcessor"]
