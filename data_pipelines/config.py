"""Data config: sources, media preprocessing, loader knobs (one dataclass per component)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmtrain.checks import check


@dataclass
class SourceConfig:
    """One weighted source: shard specs (paths, globs, brace ranges, `pipe:` commands)."""

    name: str = "data"
    shards: list[str] = field(default_factory=list)
    weight: float = 1.0  # relative share of documents drawn from this source

    def __post_init__(self):
        if not self.name:
            raise ValueError(f"name: must be non-empty (got {self.name!r})")
        check(self, "weight", gt=0)


@dataclass
class MediaConfig:
    patch_size: int = 8
    temporal_patch: int = 2  # frames per tubelet; an image is one frame repeated this often
    merge: int = 2  # spatial merge of the vision encoder: H and W are multiples of patch*merge
    min_pixels: int = 32 * 32  # per frame, after resize
    max_pixels: int = 128 * 128
    video_fps: float = 2.0  # frames sampled per second of video (uniform in time)
    video_min_frames: int = 2
    video_max_frames: int = 8
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # CLIP statistics
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    max_image_pixels: int = 40_000_000  # per image or video frame, from its headers (bombs); more: skipped
    max_source_frames: int = 100_000  # frames of a video, from its headers (decode time); more: skipped

    def __post_init__(self):
        check(self, "patch_size", "temporal_patch", "merge", "video_min_frames", "max_image_pixels",
              "max_source_frames", ge=1)
        factor = self.patch_size * self.merge
        if self.min_pixels < factor * factor:
            raise ValueError(f"min_pixels: must be >= (patch_size*merge)^2 = {factor * factor} "
                             f"(got {self.min_pixels})")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels: must be >= min_pixels {self.min_pixels} (got {self.max_pixels})")
        if self.video_max_frames % self.temporal_patch:
            raise ValueError(f"video_max_frames: must be a multiple of temporal_patch {self.temporal_patch} "
                             f"(got {self.video_max_frames})")
        check(self, "video_fps", gt=0)
        if self.video_max_frames < self.video_min_frames:
            raise ValueError(f"video_max_frames: must be >= video_min_frames {self.video_min_frames} "
                             f"(got {self.video_max_frames})")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean/std: need 3 values each (got {self.mean}, {self.std})")
        check(self, "std", gt=0)

    @property
    def factor(self) -> int:
        """H and W of every resized frame are multiples of this."""
        return self.patch_size * self.merge


@dataclass
class DataConfig:
    train: list[SourceConfig] = field(default_factory=list)
    val: list[SourceConfig] = field(default_factory=list)
    tokenizer: str = "byte"  # "byte" or a HF tokenizers JSON path (or a directory holding tokenizer.json)
    seq_len: int = 1024  # tokens per packed row (text + one placeholder per merged visual token)
    batch_size: int = 8  # rows per batch
    num_workers: int = 2  # loader processes per rank; 0 = in the main process
    prefetch_factor: int = 2  # batches each worker keeps ready
    shuffle_buffer: int = 256  # train samples per source kept for shuffling (0: stream order)
    shuffle_buffer_bytes: int = 128 << 20  # ... and at most this many raw bytes (per source and worker)
    resample: bool = False  # train: draw shards with replacement forever (else epochs of split shards)
    pack_lookahead: int = 16  # documents the packer may look ahead to fill a row
    max_failure_rate: float = 0.1  # skipped / read samples above this (per worker) aborts the run
    min_samples_for_failure_rate: int = 200  # the rate is judged only after this many samples
    max_member_bytes: int = 256 << 20  # a larger tar member is left unread, its sample skipped (too_large)
    max_text_bytes: int = 8 << 20  # the same for txt/json members (a text costs ~45 bytes a token)
    max_media_per_doc: int = 32  # an interleaved document is cut before its next medium past this
    shard_retries: int = 3  # extra tries of a failing pipe:/remote shard (resuming after its last sample)
    retry_backoff_s: float = 1.0  # wait before retry i: retry_backoff_s * 2**(i-1)
    stall_timeout_s: float = 300.0  # a pipe:/remote shard sending nothing this long has failed
    allow_changed_shards: bool = False  # resume with another shard list or mixture: warn instead of error
    seed: int = 0
    media: MediaConfig = field(default_factory=MediaConfig)

    def __post_init__(self):
        check(self, "seq_len", ge=8)
        check(self, "batch_size", "prefetch_factor", "pack_lookahead", "max_member_bytes", "max_text_bytes",
              "max_media_per_doc", "shuffle_buffer_bytes", ge=1)
        check(self, "retry_backoff_s", "num_workers", "shuffle_buffer", "min_samples_for_failure_rate",
              "shard_retries", ge=0)
        check(self, "stall_timeout_s", gt=0)
        check(self, "max_failure_rate", ge=0, le=1)
        for split in ("train", "val"):
            names = [s.name for s in getattr(self, split)]
            if len(set(names)) != len(names):
                raise ValueError(f"{split}: source names must be unique (got {names})")
