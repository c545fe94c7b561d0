"""A hostile corpus for the fuzz test: malformed samples and shards of many kinds, each with what
the loader must make of it. Good samples carry a unique label `good<NNNN>` in their text; a bad
one never does. `build(root)` -> (shard specs, good labels, expected ledger entries, kinds)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zlib
from pathlib import Path

import av
import numpy as np
from dp_shards import video_bytes, write_raw_tar
from PIL import Image

# the data config the test reads the corpus with (and passes to `mmtrain data inspect --set`)
LIMITS = {"max_member_bytes": 300_000, "max_text_bytes": 100_000, "max_media_per_doc": 3,
          "shard_retries": 1, "retry_backoff_s": 0.0, "stall_timeout_s": 0.5,
          "media.max_image_pixels": 4_000_000, "media.max_source_frames": 20_000}


def _png(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _jpeg(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG")
    return buf.getvalue()


def _bomb() -> bytes:
    """A PNG whose header claims 30000 x 30000 pixels (made by patching a 1 x 1 one's IHDR)."""
    data = bytearray(_png(Image.new("L", (1, 1))))
    data[16:24] = (30000).to_bytes(4, "big") * 2
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def _empty_video() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
    return buf.getvalue()


def _long_video(frames: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=30)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 90, np.uint8), format="rgb24")
        for _ in range(frames):
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _doc(segments: list) -> str:
    return json.dumps({"segments": segments})


def _members(key: str, sample: dict) -> list[tuple[str, bytes]]:
    return [(f"{key}.{ext}", v if isinstance(v, bytes) else v.encode()) for ext, v in sample.items()]


class Corpus:
    def __init__(self, root: Path):
        self.root, self.good, self.bad, self.kinds, self.specs = root, [], [], set(), []
        self.n = 0

    def label(self) -> str:
        self.n += 1
        self.good.append(f"good{self.n:04d}")
        return self.good[-1]

    def tar(self, name: str, members: list[tuple[str, bytes]]) -> str:
        url = write_raw_tar(self.root / name, members)
        self.specs.append(url)
        return url


def _sample_kinds(c: Corpus) -> tuple[list, list]:
    """(members of mixed.tar, [(key, reason)] expected): one sample per kind."""
    rgb = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    png = _png(Image.fromarray(rgb))
    good = {  # kind -> members (a caption is added)
        "png": {"png": png},
        "wrong_extension_jpg_holding_png": {"jpg": png},
        "sixteen_bit": {"png": _png(Image.fromarray(np.full((20, 20), 40000, np.uint16)))},
        "cmyk_jpeg": {"jpg": _jpeg(Image.fromarray(rgb).convert("CMYK"))},
        "palette_transparency": {"png": _png(Image.fromarray(rgb).quantize(8), transparency=0)},
        "one_bit": {"png": _png(Image.fromarray(rgb).convert("1"))},
        "one_pixel": {"png": _png(Image.new("RGB", (1, 1), (9, 9, 9)))},
        "extreme_aspect": {"png": _png(Image.new("RGB", (1500, 2), (9, 9, 9)))},
        "large_image_reduced": {"png": _png(Image.new("RGB", (1900, 1900), (50, 60, 70)))},
        "video_one_frame": {"mp4": video_bytes(1)},
        "video_10000_frames": {"mp4": _long_video(10_000)},
        "video": {"mp4": video_bytes(6)},
        "mp4_holding_png": {"mp4": png},  # FFmpeg sniffs the content: a one-frame video
    }
    members, bad = [], []
    for kind, sample in good.items():
        c.kinds.add(kind)
        members += _members(kind, {**sample, "txt": f"{c.label()} {kind}"})
    members += _members("plain_text", {"txt": f"{c.label()} plain"})
    members += _members("special_tokens", {"txt": f"{c.label()} <|image_pad|><|bos|>"})
    members += _members("long_text_chunked", {"txt": f"{c.label()} " + "lorem " * 2_000})
    members += _members("../traversal", {"txt": f"{c.label()} name with ../"})
    seg = {"segments": [{"text": f"{c.label()} many"}] + [{"image": f"{i}.png"} for i in range(40)]}
    members += _members("many_images", {"json": json.dumps(seg), **{f"{i}.png": png for i in range(40)}})
    c.kinds |= {"plain_text", "special_tokens", "long_text_chunked", "path_traversal", "many_images_cut"}
    hostile = {  # kind -> (members, reason)
        "garbage_image": ({"png": b"\x89PNG\r\n\x1a\n" + b"x" * 100, "txt": "x"}, "corrupt_image"),
        "half_image": ({"png": png[: len(png) // 2], "txt": "x"}, "corrupt_image"),
        "zero_size_image": ({"png": b"", "txt": "x"}, "corrupt_image"),
        "bomb": ({"png": _bomb(), "txt": "x"}, "too_large"),
        "zero_size_video": ({"mp4": b"", "txt": "x"}, "corrupt_video"),
        "video_without_frames": ({"mp4": _empty_video(), "txt": "x"}, "corrupt_video"),
        "half_video": ({"mp4": video_bytes(8)[:1500], "txt": "x"}, "corrupt_video"),
        "text_as_video": ({"webm": b"plain words " * 50, "txt": "x"}, "corrupt_video"),
        "latin1_text": ({"txt": b"caf\xe9 \xff"}, "bad_text"),
        "empty_text": ({"txt": b""}, "empty_text"),
        "bom_and_blanks": ({"txt": "\ufeff  \n\t "}, "empty_text"),
        "image_without_caption": ({"png": png}, "missing_member"),
        "absent_member": ({"json": _doc([{"text": "a"}, {"image": "7.png"}])}, "missing_member"),
        "malformed_json": ({"json": b"{\"segments\": [}"}, "bad_json"),
        "nested_json": ({"json": b"[" * 40_000 + b"]" * 40_000}, "bad_json"),
        "nested_segments": ({"json": _doc([[[[[{"text": "a"}]]]]])}, "bad_json"),
        "json_number": ({"json": b"42"}, "bad_json"),
        "text_segment_not_a_string": ({"json": _doc([{"text": 5}])}, "bad_json"),
        "obelics_lengths_differ": ({"json": json.dumps({"texts": ["a", None], "images": [None]})},
                                   "bad_json"),
        "interleaved_without_text": ({"json": _doc([{"image": "0.png"}]), "0.png": png}, "empty_text"),
        "unknown_members": ({"xyz": b"?", "cls": b"3"}, "unknown_kind"),
        "member_over_cap": ({"png": b"\0" * 400_000, "txt": "x"}, "too_large"),
        "text_over_cap": ({"txt": "y" * 150_000}, "too_large"),
    }
    for kind, (sample, reason) in hostile.items():
        c.kinds.add(kind)
        members += _members(kind, sample)
        bad.append((kind, reason))
    # mismatched keys: the members of one key are not adjacent -> two samples of that key
    c.kinds.add("split_key")
    members += [("split.png", png), ("between.txt", f"{c.label()} between".encode()),
                ("split.txt", f"{c.label()} split caption".encode())]
    bad.append(("split", "missing_member"))
    return members, bad


def _cut_shards(c: Corpus) -> None:
    """A shard cut at every member boundary, one inside a member, one with a garbage header."""
    full = []
    for i in range(3):
        full += _members(f"k{i}", {"json": json.dumps({"i": i}), "txt": "placeholder"})
    whole = write_raw_tar(c.root / "whole.tar", full)
    with tarfile.open(whole) as tar:
        infos = list(tar)
    Path(whole).unlink()
    for n in range(len(infos)):
        keys = [f"k{i}" for i in range(n // 2)]
        labels = [c.label() for _ in keys]
        body = []
        for key, label in zip(keys, labels):  # the samples before the cut carry labels
            body += _members(key, {"json": json.dumps({"i": 0}), "txt": f"{label} cut{n}"})
        body += full[2 * len(keys) : n + 1]
        tmp = write_raw_tar(c.root / "tmp.tar", body)
        with tarfile.open(tmp) as tar:
            last = list(tar)[-1]
        url = c.root / f"cut{n}.tar"
        url.write_bytes(Path(tmp).read_bytes()[: last.offset_data + -(-last.size // 512) * 512])
        c.specs.append(str(url))
        c.bad.append((str(url), f"k{n // 2}", "truncated_tar"))
    c.kinds.add("cut_at_every_member_boundary")
    mid = write_raw_tar(c.root / "mid.tar", _members("m0", {"txt": "z" * 3000}))
    Path(mid).write_bytes(Path(mid).read_bytes()[:1500])
    c.specs.append(mid)
    c.bad.append((mid, "m0", "truncated_tar"))
    label = c.label()
    hdr = write_raw_tar(c.root / "garbage_header.tar", _members("h0", {"txt": f"{label} ok"}) +
                        _members("h1", {"txt": "lost"}))
    raw = bytearray(Path(hdr).read_bytes())
    raw[1024:1536] = b"\x07" * 512  # the second member's header
    Path(hdr).write_bytes(bytes(raw))
    c.specs.append(hdr)
    c.bad.append((hdr, "h0", "bad_shard"))
    c.good.remove(label)  # h0 may have had more members: it is dropped with the rest
    c.kinds |= {"cut_inside_a_member", "garbage_header"}


def _shard_kinds(c: Corpus) -> None:
    root = c.root
    (root / "empty_file.tar").write_bytes(b"")
    c.specs.append(str(root / "empty_file.tar"))
    c.bad.append((str(root / "empty_file.tar"), "", "empty_shard"))
    c.bad.append((c.tar("no_members.tar", []), "", "empty_shard"))
    (root / "not_a_tar.tar").write_bytes(b"hello, this is not a tar archive\n" * 40)
    c.specs.append(str(root / "not_a_tar.tar"))
    c.bad.append((str(root / "not_a_tar.tar"), "", "bad_shard"))
    gz = root / "compressed.tar.gz"
    gz.write_bytes(gzip.compress(Path(write_raw_tar(root / "plain.tar", _members(
        "gz0", {"txt": f"{c.label()} gz"}))).read_bytes()))
    c.specs.append(str(gz))
    ok = write_raw_tar(root / "piped.tar", _members("p0", {"txt": f"{c.label()} piped"}))
    c.specs.append(f"pipe:cat {ok}; exit 3")  # every sample once, then counted as failed
    c.bad.append((f"pipe:cat {ok}; exit 3", "", "open_failed"))
    for url in ("pipe:exit 1", f"pipe:cat {root}/absent.tar", "pipe:sleep 30"):
        c.specs.append(url)
        c.bad.append((url, "", "open_failed"))
    for i in (0, 2):  # a brace range with a hole: found when read
        write_raw_tar(root / f"range-{i}.tar", _members(f"r{i}", {"txt": f"{c.label()} range"}))
    c.specs.append(str(root / "range-{0..2}.tar"))
    c.bad.append((str(root / "range-1.tar"), "", "open_failed"))
    c.kinds |= {"empty_file", "tar_without_members", "not_a_tar", "gzip_tar", "pipe_exit_status",
                "pipe_fails_at_once", "pipe_missing_file", "pipe_stalls", "missing_shard"}


def build(root: Path) -> Corpus:
    root.mkdir(parents=True, exist_ok=True)
    c = Corpus(root)
    members, bad = _sample_kinds(c)
    mixed = c.tar("mixed.tar", members)
    c.bad += [(mixed, key, reason) for key, reason in bad]
    _cut_shards(c)
    _shard_kinds(c)
    return c
