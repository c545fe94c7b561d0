"""SynthConfig: the sizes of the built-in shapes-world corpus."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mmtrain.checks import check

KINDS = ("image", "video", "interleaved", "text")
SPLITS = ("train", "val")


@dataclass
class SynthConfig:
    """Defaults: a corpus for a few-minute CPU training run, written in ~11 s on 2 idle cores."""

    seed: int = 0
    n_image: int = 6000  # train samples per kind; 0 skips the kind
    n_video: int = 1500
    n_interleaved: int = 1500
    n_text: int = 4000
    n_val: int = 100  # val samples of every kind
    shard_size: int = 250  # samples per shard (many shards: loader workers split by shard)
    image_size: int = 64  # px, square
    video_size: int = 64  # px, square, even (yuv420p)
    frames: int = 8
    fps: int = 8
    vocab_size: int = 1024  # upper bound: BPE stops earlier once every word is one token
    min_images: int = 2  # images per interleaved document
    max_images: int = 4
    workers: int = 0  # processes rendering shards, 0 = one per CPU core (max 8); bytes do not depend on it

    def __post_init__(self):
        check(self, "seed", "n_image", "n_video", "n_interleaved", "n_text", "n_val", "workers", ge=0)
        if self.n_image + self.n_video + self.n_interleaved + self.n_text == 0:
            raise ValueError("n_image: all train counts are 0 (got 0); nothing to write")
        check(self, "shard_size", "fps", "min_images", ge=1)
        check(self, "image_size", "video_size", ge=32)  # px
        if self.video_size % 2:
            raise ValueError(f"video_size: must be even for yuv420p video (got {self.video_size})")
        check(self, "frames", ge=2)  # a clip needs 2 frames to show motion
        check(self, "vocab_size", ge=265)  # 256 bytes + 9 specials
        if not self.min_images <= self.max_images <= 9:
            raise ValueError(f"max_images: must be in [min_images, 9] (got {self.max_images})")

    def count(self, split: str, kind: str) -> int:
        return self.n_val if split == "val" else getattr(self, f"n_{kind}")

    @classmethod
    def small(cls, **overrides) -> SynthConfig:
        """A corpus for tests and smoke runs: written in about a second."""
        base = cls(
            n_image=48, n_video=12, n_interleaved=12, n_text=48, n_val=6, shard_size=16,
            image_size=48, video_size=64, frames=4, fps=4, vocab_size=512, workers=1,
        )  # fmt: skip
        return replace(base, **overrides)
