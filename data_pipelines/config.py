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
    # decoded clips kept per loader process, by content, least recently used out past this many MiB:
    # a small corpus read for several epochs decodes each clip once (0: off; video decoding is most
    # of a loader's CPU, which on a 2-core machine is the step's: docs/BENCHMARKS.md)
    video_cache_mb: int = 0
    # decord (0.6: fastest per core here, unmaintained; PyAV takes over the clips it fails on) or
    # pyav (maintained; 0.84-0.86x decord 0.6's frames a core here): docs/BENCHMARKS.md, "Per-core
    # decode rates"
    video_decoder: str = "decord"

    def __post_init__(self):
        check(self, "patch_size", "temporal_patch", "merge", "video_min_frames", "max_image_pixels",
              "max_source_frames", ge=1)
        check(self, "video_cache_mb", ge=0)
        check(self, "video_decoder", choices=("decord", "pyav"))
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
class MixControllerConfig:
    """The reliance-driven mixture controller (mmtrain/objectives/mixture.py): at each diagnostics
    run it raises the document share of the sources of a media task whose reliance gap is low or
    falling, and relaxes it back toward the configured weights once the gap is healthy."""

    kind: str = "none"  # none | reliance
    signal: str = "mismatch"  # which gap it reads: mismatch (own vs another document's media) | blank
    tasks: dict[str, str] = field(default_factory=dict)  # media source -> the task it feeds (image_text...)
    low_gap: float = 0.1  # nats: a gap below this raises the task's sources
    fall: float = 0.15  # ... and so does a drop by more than this since the previous check
    high_gap: float = 0.3  # above this the boost relaxes toward 1 (the configured weights)
    up: float = 1.5  # boost factor per low check
    relax: float = 0.5  # share of the boost's excess over 1 removed per healthy check
    max_boost: float = 8.0  # a source's weight is at most this multiple of its configured weight
    initial_boost: float = 1.0  # every task's boost at step 0 (> 1: start media-heavy, release later)
    min_share: dict[str, float] = field(default_factory=dict)  # source -> floor of its document share
    max_share: dict[str, float] = field(default_factory=dict)  # source -> ceiling of its document share
    max_media_share: float = 1.0  # cap on the run's realised media-task token share (1: none)
    warmup_steps: int = 0  # no decision before this step (an untrained vision path gives noise)

    def __post_init__(self):
        check(self, "kind", choices=("none", "reliance"))
        check(self, "signal", choices=("mismatch", "blank"))
        media = ("image_text", "video_text")
        bad = {k: v for k, v in self.tasks.items() if v not in media}
        if bad:
            raise ValueError(f"tasks: each source's task must be one of {media} (got {bad})")
        if self.kind == "reliance" and not self.tasks:
            raise ValueError("tasks: kind reliance needs the media task of each media source, "
                             "e.g. {image: image_text, video: video_text}")
        check(self, "low_gap", "fall", "warmup_steps", ge=0)
        check(self, "relax", ge=0, le=1)
        check(self, "up", "max_boost", ge=1)
        if not 1.0 <= self.initial_boost <= self.max_boost:
            raise ValueError(f"initial_boost: must be in [1, max_boost {self.max_boost}] "
                             f"(got {self.initial_boost})")
        check(self, "max_media_share", gt=0, le=1)
        if self.high_gap < self.low_gap:
            raise ValueError(f"high_gap: must be >= low_gap {self.low_gap} (got {self.high_gap})")
        for name, bounds in (("min_share", self.min_share), ("max_share", self.max_share)):
            bad = {k: v for k, v in bounds.items() if not 0 <= v <= 1}
            if bad:
                raise ValueError(f"{name}: shares must be in [0, 1] (got {bad})")
        if sum(self.min_share.values()) > 1:
            raise ValueError(f"min_share: the floors sum to more than 1 (got {self.min_share})")
        bad = [k for k in self.min_share if k in self.max_share and self.min_share[k] > self.max_share[k]]
        if bad:
            raise ValueError(f"min_share: above max_share for {bad}")


@dataclass
class MixConfig:
    controller: MixControllerConfig = field(default_factory=MixControllerConfig)


@dataclass
class DataConfig:
    train: list[SourceConfig] = field(default_factory=list)
    val: list[SourceConfig] = field(default_factory=list)
    tokenizer: str = "byte"  # "byte" or a HF tokenizers JSON path (or a directory holding tokenizer.json)
    seq_len: int = 1024  # tokens per packed row (text + one placeholder per merged visual token)
    batch_size: int = 8  # rows per batch
    # visual budgets per row (0: none): the packer holds a document back rather than exceed one
    max_media_per_row: int = 0
    max_visual_tokens_per_row: int = 0
    num_workers: int = 2  # loader processes per rank; 0 = in the main process
    prefetch_factor: int = 2  # batches each worker keeps ready
    # ... and at most this many bytes of ready batches per rank (0: no byte bound): each worker
    # starts its next batch only while its share (prefetch_bytes / num_workers) is not used up, so
    # a slow GPU step cannot make the loader fill host RAM (a `small` batch is ~0.3 GB of patches)
    prefetch_bytes: int = 4 << 30
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
    open_timeout_s: float = 60.0  # a shard not opened within this long (a hung mount): counted, skipped
    # fewer shards than ranks x workers: "split" = every reader reads every shard and keeps its
    # share of the samples (said once, with both numbers); "error" = refuse, naming both numbers
    shard_shortage: str = "split"
    allow_changed_shards: bool = False  # resume with another shard list or mixture: warn instead of error
    seed: int = 0
    media: MediaConfig = field(default_factory=MediaConfig)
    mix: MixConfig = field(default_factory=MixConfig)

    def __post_init__(self):
        check(self, "seq_len", ge=8)
        check(self, "batch_size", "prefetch_factor", "pack_lookahead", "max_member_bytes", "max_text_bytes",
              "max_media_per_doc", "shuffle_buffer_bytes", ge=1)
        check(self, "retry_backoff_s", "num_workers", "shuffle_buffer", "min_samples_for_failure_rate",
              "shard_retries", "max_media_per_row", "max_visual_tokens_per_row", "prefetch_bytes", ge=0)
        check(self, "stall_timeout_s", "open_timeout_s", gt=0)
        check(self, "shard_shortage", choices=("split", "error"))
        if 0 < self.max_media_per_row < self.max_media_per_doc:  # else such a document fits no row
            raise ValueError(f"max_media_per_row: {self.max_media_per_row} < max_media_per_doc "
                             f"{self.max_media_per_doc} (lower max_media_per_doc to it)")
        check(self, "max_failure_rate", ge=0, le=1)
        for split in ("train", "val"):
            names = [s.name for s in getattr(self, split)]
            if len(set(names)) != len(names):
                raise ValueError(f"{split}: source names must be unique (got {names})")
        ctl, names = self.mix.controller, {s.name for s in self.train}
        named = set(ctl.tasks) | set(ctl.min_share) | set(ctl.max_share)
        unknown = sorted(named - names) if self.train else []
        if unknown:
            raise ValueError(f"mix.controller: no train source named {unknown} (sources: {sorted(names)})")
