"""Skipped-sample bookkeeping: why a sample was dropped, and the ledger checkpoints keep.

A bad sample never crashes the loader: the stage that finds it raises `SkipSample(reason)`,
the source stream catches it, counts it and appends (shard, key, reason) to the ledger.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

# Reasons (stable strings: they appear in stats, the ledger and `mmtrain data inspect`).
CORRUPT_IMAGE = "corrupt_image"  # Pillow cannot decode it (truncated, garbage)
TOO_LARGE = "too_large"  # more pixels than media.max_image_pixels (decompression bomb)
CORRUPT_VIDEO = "corrupt_video"  # cannot be decoded, or has no frames
MISSING_MEMBER = "missing_member"  # e.g. an image without caption, a segment naming an absent member
BAD_JSON = "bad_json"  # malformed JSON or an interleaved doc without usable segments
BAD_TEXT = "bad_text"  # not UTF-8
EMPTY_TEXT = "empty_text"  # nothing left to learn from after stripping
UNKNOWN_KIND = "unknown_kind"  # no member the pipeline knows how to read
TOO_LONG = "too_long"  # does not fit in seq_len even after the budget policy (see documents.py)
TRUNCATED_TAR = "truncated_tar"  # the archive ends early (inside a member, or at a boundary without
#                                  its end block): the partial last sample and the rest are lost
BAD_SHARD = "bad_shard"  # not a tar archive, or a garbage header inside one
EMPTY_SHARD = "empty_shard"  # a shard without a single sample
OPEN_FAILED = "open_failed"  # the shard cannot be opened or read: missing file, or a pipe/remote
#                              command that failed (exit status, stall) after its retries
UNEXPECTED = "unexpected_error"  # any other exception while making the sample (also warned about)

REASONS = (
    CORRUPT_IMAGE, TOO_LARGE, CORRUPT_VIDEO, MISSING_MEMBER, BAD_JSON, BAD_TEXT, EMPTY_TEXT,
    UNKNOWN_KIND, TOO_LONG, TRUNCATED_TAR, BAD_SHARD, EMPTY_SHARD, OPEN_FAILED, UNEXPECTED,
)


class SkipSample(Exception):
    """Raised by decode/preprocess/document stages for a sample that must be skipped."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Entry(NamedTuple):
    shard: str
    key: str
    reason: str


class Ledger:
    """Append-only list of skipped samples; counts stay exact past `max_entries`."""

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self.entries: list[Entry] = []
        self.counts: Counter[str] = Counter()

    def add(self, shard: str, key: str, reason: str) -> None:
        self.counts[reason] += 1
        if len(self.entries) < self.max_entries:
            self.entries.append(Entry(shard, key, reason))

    def extend(self, entries) -> None:
        for e in entries:
            self.add(*e)

    def __len__(self) -> int:
        return sum(self.counts.values())

    def __iter__(self):
        return iter(self.entries)

    def state_dict(self) -> dict:
        return {"entries": [tuple(e) for e in self.entries], "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.entries = [Entry(*e) for e in state["entries"]]
        self.counts = Counter(state["counts"])
