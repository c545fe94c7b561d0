"""A quick look at the first samples of a source: their kinds and their media's sizes and rates,
from headers only (Pillow's size, the container's frame rate): what `data config` sets media from."""

from __future__ import annotations

import io
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field

from PIL import Image

from mmtrain.data_pipelines.decode import IMAGE_EXTS, VIDEO_EXTS, _probe
from mmtrain.data_pipelines.shards import RawSample, iter_shard

_NUMBERED = re.compile(r"^(.*?)(\d+)(\.tar|\.tar\.gz|\.tgz)$")


@dataclass
class Scan:
    kinds: Counter = field(default_factory=Counter)  # text / image / video / interleaved / bad
    image_px: list[tuple[int, int]] = field(default_factory=list)  # (h, w) of images
    video: list[tuple[float, int, int, int]] = field(default_factory=list)  # (fps, frames, h, w)

    @property
    def samples(self) -> int:
        return sum(self.kinds.values())

    def name(self) -> str:
        """The source's kind when its samples share one, else "mixed"."""
        good = [k for k in self.kinds if k != "bad"]
        return good[0] if len(good) == 1 else "mixed"

    def describe(self) -> str:
        parts = [f"{k} {n}" for k, n in self.kinds.most_common()]
        return f"{', '.join(parts)} of the first {self.samples} samples"

    def median_fps(self) -> float | None:
        rates = [fps for fps, *_ in self.video if fps > 0]
        return statistics.median(rates) if rates else None


def _kind(raw: RawSample) -> str:
    """As `documents.parse_sample` decides, from member names only."""
    top = {e for e in raw.members if "." not in e}  # "0.png" belongs to an interleaved document
    if top & set(VIDEO_EXTS) or top & set(IMAGE_EXTS):
        return ("video" if top & set(VIDEO_EXTS) else "image") if "txt" in top else "bad"
    if "json" in top and (len(top) < len(raw.members) or "txt" not in top):
        return "interleaved"
    return "text" if "txt" in top else "bad"


def _measure(raw: RawSample, scan: Scan) -> None:
    for ext, data in raw.members.items():
        last = ext.rsplit(".", 1)[-1]
        try:
            if last in IMAGE_EXTS:
                w, h = Image.open(io.BytesIO(data)).size
                scan.image_px.append((h, w))
            elif last in VIDEO_EXTS:
                p = _probe(data)
                scan.video.append((p.fps, p.frames, p.h, p.w))
        except Exception:  # a corrupt medium: the loader counts it when it reads it
            scan.kinds["bad"] += 1


def scan_source(urls: list[str], max_samples: int) -> Scan:
    """Kinds and media sizes of the first `max_samples` samples of `urls` (in order)."""
    scan = Scan()
    for url in urls:
        for raw in iter_shard(url, on_error=lambda reason, key: scan.kinds.update(["bad"])):
            if scan.samples >= max_samples:
                return scan
            scan.kinds[_kind(raw)] += 1
            _measure(raw, scan)
    return scan


def compact(urls: list[str]) -> list[str]:
    """Shard paths as few specs: runs of consecutive numbers become brace ranges
    (`s-{000000..000041}.tar`); other paths stay as they are."""
    out: list[str] = []
    run: list[tuple[str, int, str, int]] = []  # (head, number, tail, width)

    def flush():
        if run:
            head, lo, tail, width = run[0]
            hi = run[-1][1]
            numbers = f"{lo:0{width}d}" if lo == hi else f"{{{lo:0{width}d}..{hi:0{width}d}}}"
            out.append(f"{head}{numbers}{tail}")
            run.clear()

    for url in urls:
        m = _NUMBERED.match(url)
        item = (m.group(1), int(m.group(2)), m.group(3), len(m.group(2))) if m else None
        follows = run and item and item[0::2] == run[-1][0::2] and item[1:] == (run[-1][1] + 1, *run[-1][2:])
        if follows:
            run.append(item)
            continue
        flush()
        if item:
            run.append(item)
        else:
            out.append(url)
    flush()
    return out
