"""`mmtrain data write`: turn a folder of media or a JSONL file into webdataset shards.

    mmtrain data write --from folder SRC_DIR --out DIR [--shard-size N]
    mmtrain data write --from jsonl  SRC.jsonl --out DIR [--shard-size N]

Folder: files sharing a path stem form a sample: `cat.jpg` + `cat.txt` (+ `cat.json` metadata)
is image-text, `clip.mp4` + `clip.txt` video-text, a lone `note.txt` text, a `doc.json` with
"segments" (media paths relative to it) interleaved. JSONL: one object a line, `{"text": ...}`,
`{"image": PATH, "text": ...}`, `{"video": PATH, "text": ...}` or `{"segments": [...]}`, paths
relative to the JSONL file; other keys go to `key.json` as metadata. Media bytes are copied
unchanged (other image formats Pillow reads are converted to PNG). A record that cannot be
written is reported and skipped. Shards are `DIR/<prefix>-NNNNNN.tar`, written atomically; a
second call into the same DIR with the same prefix continues the numbering (and keys), so it
never replaces shards written before; `--overwrite` deletes them first.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import webdataset as wds
from PIL import Image

from mmtrain.data_pipelines.decode import IMAGE_EXTS, VIDEO_EXTS
from mmtrain.data_pipelines.errors import DataError

CONVERTIBLE = ("gif", "bmp", "tif", "tiff", "ppm", "pgm", "tga")


class BadRecord(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source_kind", choices=("folder", "jsonl"), required=True,
                   help="what SRC is: a folder of media with sidecar .txt/.json, or a JSONL file")
    p.add_argument("src", help="the source folder or JSONL file")
    p.add_argument("--out", required=True, help="output directory for the shards")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--prefix", default="shard", help="shard file prefix (default 'shard')")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any record was skipped")
    p.add_argument("--overwrite", action="store_true",
                   help="delete DIR/<prefix>-*.tar first (default: continue their numbering)")


# ----- records -> sample members -----------------------------------------------------------------
def _read_medium(path: Path, kinds: tuple[str, ...]) -> tuple[str, bytes]:
    ext = path.suffix.lower().lstrip(".")
    if not path.is_file():
        raise BadRecord(f"file not found: {path}")
    data = path.read_bytes()
    if ext in kinds:
        return ext, data
    if ext in CONVERTIBLE and kinds == IMAGE_EXTS:
        try:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).save(buf, format="PNG")
        except Exception as e:
            raise BadRecord(f"{path}: cannot convert to PNG ({e})") from None
        return "png", buf.getvalue()
    raise BadRecord(f"{path}: unsupported extension .{ext} (expected one of {', '.join(kinds)})")


def _text(rec: dict, required: bool) -> str | None:
    text = rec.get("text")
    if text is None and required:
        raise BadRecord("record without 'text'")
    if text is not None and not isinstance(text, str):
        raise BadRecord(f"'text' must be a string, got {type(text).__name__}")
    return text


def _segments(rec: dict, base: Path, members: dict) -> list[dict]:
    out = []
    for i, seg in enumerate(rec["segments"]):
        kind = [k for k in ("text", "image", "video") if isinstance(seg, dict) and k in seg]
        if len(kind) != 1:
            raise BadRecord(f"segment {i}: needs exactly one of text/image/video")
        if kind[0] == "text":
            out.append({"text": str(seg["text"])})
            continue
        ext, data = _read_medium(base / seg[kind[0]], IMAGE_EXTS if kind[0] == "image" else VIDEO_EXTS)
        members[f"{i}.{ext}"] = data
        out.append({kind[0]: f"{i}.{ext}"})
    return out


def record_to_members(rec: dict, base: Path) -> dict[str, bytes]:
    """One JSONL-style record (paths relative to `base`) -> {ext: bytes} of one sample."""
    if not isinstance(rec, dict):
        raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    members: dict[str, bytes] = {}
    meta = {k: v for k, v in rec.items() if k not in ("text", "image", "video", "segments")}
    if "segments" in rec:
        if not isinstance(rec["segments"], list) or not rec["segments"]:
            raise BadRecord("'segments' must be a non-empty list")
        members["json"] = json.dumps({**meta, "segments": _segments(rec, base, members)}).encode()
        return members
    for kind, exts in (("image", IMAGE_EXTS), ("video", VIDEO_EXTS)):
        if kind in rec:
            ext, data = _read_medium(base / str(rec[kind]), exts)
            members[ext] = data
            members["txt"] = _text(rec, required=True).encode()
            break
    else:
        text = _text(rec, required=True)
        members["txt"] = text.encode()
    if meta:
        members["json"] = json.dumps(meta).encode()
    return members


# ----- sources -----------------------------------------------------------------------------------
def jsonl_records(path: Path) -> Iterator[tuple[str, dict | BadRecord, Path]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line), path.parent
            except json.JSONDecodeError as e:
                yield f"{path}:{n}", BadRecord(f"not JSON: {e}"), path.parent


def _folder_record(files: dict[str, Path]) -> dict:
    rec: dict = {}
    if "json" in files:
        meta = json.loads(files["json"].read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise BadRecord(f"{files['json']}: expected a JSON object")
        rec.update(meta)
    if "txt" in files:
        rec["text"] = files["txt"].read_text(encoding="utf-8")
    for ext, path in files.items():
        if ext in IMAGE_EXTS or ext in CONVERTIBLE:
            rec["image"] = path.name
        elif ext in VIDEO_EXTS:
            rec["video"] = path.name
    return rec


def _segment_media(paths: list[Path]) -> set[Path]:
    """Files that interleaved documents (.json with "segments") name: not samples of their own."""
    used = set()
    for path in paths:
        if path.suffix.lower() != ".json":
            continue
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        for seg in meta.get("segments", []) if isinstance(meta, dict) else []:
            for k in ("image", "video"):
                if isinstance(seg, dict) and isinstance(seg.get(k), str):
                    used.add((path.parent / seg[k]).resolve())
    return used


def folder_records(root: Path) -> Iterator[tuple[str, dict | BadRecord, Path]]:
    paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    used = _segment_media(paths)
    groups: dict[Path, dict[str, Path]] = {}
    for path in paths:
        if path.resolve() not in used:
            groups.setdefault(path.with_suffix(""), {})[path.suffix.lower().lstrip(".")] = path
    for stem, files in groups.items():
        try:
            yield str(stem), _folder_record(files), stem.parent
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, BadRecord) as e:
            yield str(stem), BadRecord(str(e)), stem.parent


# ----- writing -----------------------------------------------------------------------------------
def existing_shards(out: Path, prefix: str) -> list[Path]:
    """`<prefix>-NNNNNN.tar` already in `out` (what a new call must not replace)."""
    return sorted(p for p in out.glob(f"{glob.escape(prefix)}-*.tar") if p.stem[len(prefix) + 1:].isdigit())


class ShardSink:
    """Numbered shards of `shard_size` samples from number `start` on; each written to .tmp and
    renamed when complete. Keys carry `start` when it is not 0, so they stay unique across calls."""

    def __init__(self, out: Path, prefix: str, shard_size: int, start: int = 0):
        self.out, self.prefix, self.shard_size, self.start = out, prefix, shard_size, start
        self.count, self.shards, self._writer, self._tmp = 0, [], None, None

    def write(self, members: dict[str, bytes]) -> None:
        if self.count % self.shard_size == 0:
            self._finish()
            final = self.out / f"{self.prefix}-{self.start + len(self.shards):06d}.tar"
            self._tmp = final.with_name(final.name + ".tmp")
            self._writer = wds.TarWriter(str(self._tmp))
            self.shards.append(final)
        key = f"{self.count:09d}" if not self.start else f"{self.start:06d}_{self.count:09d}"
        self._writer.write({"__key__": key, **members})
        self.count += 1

    def _finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            os.replace(self._tmp, self.shards[-1])
            self._writer = None

    def close(self) -> None:
        self._finish()


def _first_number(out: Path, args: argparse.Namespace) -> int:
    old = existing_shards(out, args.prefix)
    if old and args.overwrite:
        for path in old:
            path.unlink()
        print(f"--overwrite: deleted {len(old)} shards {args.prefix}-*.tar in {out}", file=sys.stderr)
        return 0
    if not old:
        return 0
    start = int(old[-1].stem[len(args.prefix) + 1:]) + 1
    print(f"{out} already holds {len(old)} shards {args.prefix}-*.tar: numbering continues at "
          f"{args.prefix}-{start:06d}.tar (--overwrite replaces them)", file=sys.stderr)
    return start


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.src), Path(args.out)
    if args.shard_size < 1:
        raise DataError(f"--shard-size: must be >= 1 (got {args.shard_size})")
    if args.source_kind == "folder" and not src.is_dir():
        raise DataError(f"--from folder: not a directory: {src}")
    if args.source_kind == "jsonl" and not src.is_file():
        raise DataError(f"--from jsonl: file not found: {src}")
    out.mkdir(parents=True, exist_ok=True)
    records = folder_records(src) if args.source_kind == "folder" else jsonl_records(src)
    sink, skipped = ShardSink(out, args.prefix, args.shard_size, _first_number(out, args)), 0
    try:
        for where, rec, base in records:
            try:
                if isinstance(rec, BadRecord):
                    raise rec
                sink.write(record_to_members(rec, base))
            except BadRecord as e:
                skipped += 1
                print(f"skipped {where}: {e}", file=sys.stderr)
    finally:
        sink.close()
    print(f"wrote {sink.count} samples in {len(sink.shards)} shards to {out} ({skipped} skipped)")
    return 1 if (args.strict and skipped) or sink.count == 0 else 0
