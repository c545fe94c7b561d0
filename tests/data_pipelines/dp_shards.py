"""Tiny shards for the data-pipeline tests (imported by the test files next to it)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from pathlib import Path

import av
import numpy as np
import webdataset as wds
from PIL import Image

from mmtrain.data_pipelines.config import DataConfig, MediaConfig, SourceConfig


def image_bytes(h: int = 24, w: int = 40, fmt: str = "PNG", mode: str = "RGB", seed=None) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    im = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def video_bytes(frames: int = 8, h: int = 32, w: int = 32, fps: int = 8, values=None) -> bytes:
    """mp4 (h264 if available); frame t is flat grey `values[t]` (default 20 * t)."""
    buf = io.BytesIO()
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            s.options = {"bframes": "0", "crf": "10"}
        for t in range(frames):
            v = values[t] if values is not None else 20 * t
            f = av.VideoFrame.from_ndarray(np.full((h, w, 3), v, np.uint8), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def write_tar(path: Path, samples: list[dict]) -> str:
    """samples: {"__key__": k, ext: bytes | str | dict}; dicts become JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as w:
        for s in samples:
            enc = {k: (json.dumps(v).encode() if isinstance(v, (dict, list)) else
                       v.encode() if isinstance(v, str) and k != "__key__" else v) for k, v in s.items()}
            w.write(enc)
    return str(path)


def write_raw_tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    """A tar with exactly these members (no webdataset encoding)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def text_shards(root: Path, n_shards: int, per_shard: int, prefix: str = "t") -> list[str]:
    """Text samples whose text names them: "<prefix>-<shard>-<i> ..."."""
    out = []
    for s in range(n_shards):
        samples = [{"__key__": f"{prefix}{s:02d}_{i:03d}", "txt": f"{prefix}-{s}-{i} " + "x" * (i % 7)}
                   for i in range(per_shard)]
        out.append(write_tar(root / f"{prefix}-{s:03d}.tar", samples))
    return out


def mixed_samples(n: int, tag: str = "m") -> list[dict]:
    """A cycle of text, image-text, video-text and interleaved samples."""
    out = []
    for i in range(n):
        key = f"{tag}{i:04d}"
        kind = i % 4
        if kind == 0:
            out.append({"__key__": key, "txt": f"text {tag} {i}"})
        elif kind == 1:
            png = image_bytes(20 + i % 5, 30, seed=i)
            out.append({"__key__": key, "png": png, "txt": f"image {tag} {i}"})
        elif kind == 2:
            out.append({"__key__": key, "mp4": video_bytes(6, 32, 32), "txt": f"video {tag} {i}"})
        else:
            seg = {"segments": [{"text": f"doc {tag} {i} a"}, {"image": "0.png"}, {"text": "b"}]}
            out.append({"__key__": key, "json": seg, "0.png": image_bytes(16, 16, seed=i)})
    return out


def small_media(**kw) -> MediaConfig:
    base = dict(patch_size=4, temporal_patch=2, merge=2, min_pixels=8 * 8, max_pixels=16 * 16,
                video_fps=4.0, video_min_frames=2, video_max_frames=4)
    base.update(kw)
    return MediaConfig(**base)


def data_cfg(train: list[str] | None = None, val: list[str] | None = None, **kw) -> DataConfig:
    base = dict(seq_len=64, batch_size=2, num_workers=0, shuffle_buffer=4, pack_lookahead=4,
                max_failure_rate=1.0, media=small_media())
    base.update(kw)
    return DataConfig(
        train=[SourceConfig("a", train)] if train else [],
        val=[SourceConfig("v", val)] if val else [],
        **base,
    )


def bad_shards(root: Path) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Shards with one sample of every bad kind (+ a truncated and an empty shard), and the
    ledger entries they must produce. Needs media.max_image_pixels < 64 * 64."""
    bad = str(root / "bad.tar")
    samples = [
        ({"__key__": "good_text", "txt": "fine"}, None),
        ({"__key__": "good_image", "png": image_bytes(16, 16), "txt": "ok"}, None),
        ({"__key__": "corrupt", "png": b"\x89PNG\r\n\x1a\n broken", "txt": "x"}, "corrupt_image"),
        ({"__key__": "garbage_video", "mp4": b"junk" * 40, "txt": "x"}, "corrupt_video"),
        ({"__key__": "no_caption", "png": image_bytes(16, 16)}, "missing_member"),
        ({"__key__": "absent", "json": {"segments": [{"text": "a"}, {"image": "0.png"}]}}, "missing_member"),
        ({"__key__": "malformed", "json": b"{oops"}, "bad_json"),
        ({"__key__": "latin1", "txt": b"caf\xe9"}, "bad_text"),
        ({"__key__": "blank", "txt": "  \n"}, "empty_text"),
        ({"__key__": "huge", "png": image_bytes(64, 64), "txt": "x"}, "too_large"),
    ]
    write_tar(Path(bad), [s for s, _ in samples])
    expected = [(bad, s["__key__"], r) for s, r in samples if r]
    full = write_tar(root / "full.tar", [{"__key__": f"c{i}", "txt": "y" * 3000} for i in range(3)])
    with tarfile.open(full) as tar:
        offset = [m.offset_data for m in tar][1]
    cut = root / "cut.tar"
    cut.write_bytes(Path(full).read_bytes()[: offset + 10])
    Path(full).unlink()
    (root / "empty.tar").write_bytes(b"")
    expected += [(str(cut), "c1", "truncated_tar"), (str(root / "empty.tar"), "", "empty_shard")]
    return [bad, str(cut), str(root / "empty.tar")], expected


def make_folder(root):
    """A folder: 2 image-text, 1 video-text, 1 text, 1 interleaved, 1 image without caption."""
    (root / "pics").mkdir(parents=True)
    (root / "cat.jpg").write_bytes(image_bytes(16, 24, fmt="JPEG"))
    (root / "cat.txt").write_text("a cat")
    (root / "dog.PNG").write_bytes(image_bytes(16, 16))
    (root / "dog.txt").write_text("a dog")
    (root / "dog.json").write_text(json.dumps({"boxes": [[0, 0, 4, 4]]}))
    (root / "clip.mp4").write_bytes(video_bytes(4))
    (root / "clip.txt").write_text("it moves")
    (root / "note.txt").write_text("just text")
    (root / "pics" / "a.png").write_bytes(image_bytes(8, 8))
    (root / "story.json").write_text(json.dumps({"segments": [{"text": "see"}, {"image": "pics/a.png"}]}))
    (root / "orphan.png").write_bytes(image_bytes(8, 8))
    return 5


def make_jsonl(root):
    """A JSONL file: text, image, video, interleaved, plus a missing file and a non-JSON line."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "m").mkdir()
    (root / "m" / "x.webp").write_bytes(image_bytes(8, 8, fmt="WEBP"))
    (root / "m" / "v.mp4").write_bytes(video_bytes(4))
    (root / "m" / "old.gif").write_bytes(image_bytes(8, 8, fmt="GIF"))
    lines = [
        {"text": "plain"},
        {"image": "m/x.webp", "text": "webp pic", "source": "web"},
        {"video": "m/v.mp4", "text": "a clip"},
        {"segments": [{"image": "m/old.gif"}, {"text": "after"}, {"video": "m/v.mp4"}]},
        {"image": "m/missing.jpg", "text": "gone"},
    ]
    path = root / "data.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    return path, 4


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident set (VmRSS) or its peak (VmHWM), MB; 0 once it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def children() -> list[int]:
    """This process's child processes (a loader's workers)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return sorted(pids)
