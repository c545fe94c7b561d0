"""One document for attention maps: the model's inputs plus what the maps need to be drawn and scored.

Built with the data pipeline's own functions (`parse_sample`, `build_documents`, `assemble`), so the
model sees exactly what training feeds it. On top, this records where each medium's merged tokens
sit, the frames the model saw (and which source frames they are), which text segment describes which
medium (the medium directly before it), the words of every text segment, and object boxes in the
medium's original pixels (from a sample's `key.json` or `--boxes`).

Legend: L tokens of the document, T frames, H/W pixels.
"""

from __future__ import annotations

import io
import json
import os
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrain.data_pipelines.batch import IMAGE, TEXT, VIDEO, PackedBatch
from mmtrain.data_pipelines.config import DataConfig, MediaConfig
from mmtrain.data_pipelines.decode import (
    IMAGE_EXTS,
    VIDEO_EXTS,
    decode_json,
    sample_frame_indices,
)
from mmtrain.data_pipelines.documents import Document, build_documents, encode, parse_sample
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.packing import assemble
from mmtrain.data_pipelines.preprocess import Decoded, subsample
from mmtrain.data_pipelines.shards import RawSample
from mmtrain.data_pipelines.tokenizer import Tokenizer
from mmtrain.errors import UserError
from mmtrain.evaluation.pointing import uniform_box
from mmtrain.inference.prompts import read_medium

KIND_NAMES = {IMAGE: "image", VIDEO: "video"}
# Object fields that are not one-word attributes a caption word could name.
_NOT_ATTRIBUTES = {"box", "boxes", "position", "motion", "kind", "caption"}
_LABEL_FIELDS = {"label", "name", "word", "category", "class"}
_PUNCT = string.punctuation + "“”‘’"


class NoMediaError(UserError):
    """The sample has no image or video (nothing for text to look at)."""


@dataclass
class ObjectBoxes:
    """One object: the words that name it and its box per source frame (an image has one)."""

    attrs: dict[str, str]  # field -> lower-case word, e.g. {"color": "red", "shape": "circle"}
    boxes: list[tuple[float, float, float, float]]  # [x0, y0, x1, y1] original px, x1/y1 exclusive


@dataclass
class MediumInfo:
    index: int  # medium number in the document (0, 1, ...)
    kind: int  # IMAGE or VIDEO
    start: int  # position of its first placeholder in the document
    grid_thw: tuple[int, int, int]  # merged token grid: t slices of h x w tokens
    resized_hw: tuple[int, int]  # pixels of the resized frame the vision encoder saw
    orig_hw: tuple[int, int]  # pixels of the decoded source frame (boxes live here)
    frames_THW3: np.ndarray  # uint8 source-resolution frames the model saw (an image: one)
    slice_frames: list[list[int]]  # per temporal slice: its frames' indices into frames_THW3
    source_frames: list[int] | None  # per frame: index in the source video (None: unknown)
    objects: list[ObjectBoxes] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]

    def box_frame(self, frame: int, n_boxes: int) -> int:
        """Which of an object's n_boxes per-frame boxes belongs to frame `frame` of frames_THW3."""
        if self.source_frames is not None and n_boxes > 1:
            return min(self.source_frames[frame], n_boxes - 1)
        return uniform_box(frame, len(self.frames_THW3), n_boxes)


@dataclass
class TextSegment:
    start: int  # token positions [start, end)
    end: int
    medium: int | None  # the medium this text describes: the one directly before it, else None
    truncated: bool  # the token budget cut this segment


@dataclass
class Word:
    start: int  # token positions [start, end)
    end: int
    text: str  # lower case, punctuation stripped ("" for punctuation)
    segment: int
    medium: int | None  # the medium its segment describes


@dataclass
class DocInputs:
    name: str  # sample key or file name
    kind: str  # "image", "video" or "interleaved"
    document: Document
    batch: PackedBatch  # the document alone in one row (no padding)
    media: list[MediumInfo]
    segments: list[TextSegment]
    words: list[Word]
    token_strs: list[str]  # readable piece of every token
    special_L: np.ndarray  # bool: bos/eos/markers/placeholders (no text)

    def __len__(self) -> int:
        return len(self.document)

    def word_at(self, pos: int) -> Word | None:
        return next((w for w in self.words if w.start <= pos < w.end), None)

    def segment_at(self, pos: int) -> TextSegment | None:
        return next((s for s in self.segments if s.start <= pos < s.end), None)

    def target_medium(self, pos: int) -> int | None:
        """The medium a text token is about: its segment's medium, else the nearest one before it."""
        seg = self.segment_at(pos)
        if seg is not None and seg.medium is not None:
            return seg.medium
        before = [m.index for m in self.media if m.start < pos]
        return before[-1] if before else None


# ----- objects and boxes -----------------------------------------------------------------------
def _box(value, where: str) -> tuple[float, float, float, float]:
    if not (isinstance(value, (list, tuple)) and len(value) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise UserError(f"{where}: a box must be [x0, y0, x1, y1] (got {str(value)[:60]})")
    x0, y0, x1, y1 = (float(v) for v in value)
    if not (x1 > x0 and y1 > y0):
        raise UserError(f"{where}: a box needs x1 > x0 and y1 > y0 (got {list(value)})")
    return x0, y0, x1, y1


def parse_objects(objs, where: str = "boxes") -> list[ObjectBoxes]:
    """key.json-style objects ({"color": .., "shape": .., "box" or "boxes": ..}), a list of them,
    {"objects": [...]}, or {word: box} -> ObjectBoxes."""
    if isinstance(objs, dict) and isinstance(objs.get("objects"), list):
        objs = objs["objects"]
    if isinstance(objs, dict):  # {"cat": [x0, y0, x1, y1], ...}
        return [ObjectBoxes({"label": str(k).lower()}, [_box(v, f"{where}: {k}")]) for k, v in objs.items()]
    if not isinstance(objs, list):
        raise UserError(f"{where}: expected a list of objects or {{word: box}} (got {type(objs).__name__})")
    out = []
    for i, o in enumerate(objs):
        if not isinstance(o, dict) or ("box" not in o and "boxes" not in o):
            raise UserError(f"{where}[{i}]: an object needs a 'box' or per-frame 'boxes'")
        boxes = [_box(o["box"], f"{where}[{i}]")] if "box" in o else \
            [_box(b, f"{where}[{i}]") for b in o["boxes"]]
        if not boxes:
            raise UserError(f"{where}[{i}]: 'boxes' is empty")
        attrs = {k: v.strip().lower() for k, v in o.items()
                 if isinstance(v, str) and k not in _NOT_ATTRIBUTES and v.strip() and " " not in v.strip()}
        out.append(ObjectBoxes(attrs, boxes))
    return out


def load_boxes(spec: str) -> list[ObjectBoxes]:
    """--boxes: a JSON file or inline JSON (see parse_objects)."""
    text = spec
    if not spec.lstrip().startswith(("{", "[")):
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"--boxes {spec}: cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"--boxes: not valid JSON: {e}") from None
    return parse_objects(data, "--boxes")


def _media_objects(meta) -> list[list[ObjectBoxes]] | None:
    """Objects per medium from a sample's key.json (image/video: one medium; interleaved: per segment)."""
    if not isinstance(meta, dict):
        return None
    try:
        if isinstance(meta.get("segments"), list):
            return [parse_objects(s.get("objects") or [], "key.json") for s in meta["segments"]
                    if isinstance(s, dict) and (s.get("image") is not None or s.get("video") is not None)]
        if isinstance(meta.get("objects"), list):
            return [parse_objects(meta["objects"], "key.json")]
    except UserError:
        return None  # boxes we cannot read: no pointing game for this sample, maps still work
    return None


# ----- media provenance ------------------------------------------------------------------------
def video_source_indices(data: bytes, media: MediaConfig) -> list[int] | None:
    """Which source frames `decode_video` picks (decord's frame count and rate), None if unknown."""
    try:
        import decord

        vr = decord.VideoReader(io.BytesIO(data), num_threads=1)
        return sample_frame_indices(len(vr), vr.get_avg_fps(), media)
    except Exception:
        try:
            import av

            with av.open(io.BytesIO(data)) as c:
                stream = c.streams.video[0]
                n = sum(1 for _ in c.decode(stream))
                return sample_frame_indices(n, float(stream.average_rate or 0), media)
        except Exception:
            return None


def _member(raw: RawSample, ref) -> bytes | None:
    """The member an interleaved segment names ("0.png", "key.0.png", a path, or an index)."""
    name = os.path.basename(str(ref)).lower()
    base = os.path.basename(raw.key).lower()
    if name.startswith(base + "."):
        name = name[len(base) + 1:]
    if name in raw.members:
        return raw.members[name]
    hits = [e for e in raw.members if e.startswith(name + ".")] if name.isdigit() else []
    return raw.members[hits[0]] if len(hits) == 1 else None


def _media_bytes(raw: RawSample, meta) -> list[bytes | None]:
    """Member bytes of each medium in document order (to recover video frame indices)."""
    m = raw.members
    ext = next((e for e in VIDEO_EXTS + IMAGE_EXTS if e in m), None)
    if ext is not None:
        return [m[ext]]
    out: list[bytes | None] = []
    if isinstance(meta, dict) and isinstance(meta.get("segments"), list):
        for s in meta["segments"]:
            ref = s.get("image") if isinstance(s, dict) and s.get("image") is not None else \
                s.get("video") if isinstance(s, dict) else None
            if ref is not None:
                out.append(_member(raw, ref))
    elif isinstance(meta, dict) and isinstance(meta.get("images"), list):
        out = [_member(raw, im) for im in meta["images"] if im is not None]
    return out


# ----- building ------------------------------------------------------------------------------
def _words(tok: Tokenizer, ids: list[int], start: int, segment: int, medium: int | None) -> list[Word]:
    """Group a text segment's tokens into words: a token starting with a space, or punctuation,
    starts a new word; whitespace tokens end one."""
    words: list[Word] = []
    cur: Word | None = None
    for j, i in enumerate(ids):
        piece = tok.decode([i])
        core = piece.strip()
        if not core:
            cur = None
            continue
        is_punct = all(c in _PUNCT for c in core)
        if cur is None or piece[:1].isspace() or is_punct or not cur.text:
            cur = Word(start + j, start + j + 1, "", segment, medium)
            words.append(cur)
            cur.text = core
        else:
            cur.end += 1
            cur.text += core
    for w in words:
        w.text = w.text.lower().strip(_PUNCT)
    return words


def _layout(doc: Document, segments: list, tok: Tokenizer):
    """Walk the segments the document was built from: text segments, media positions, words."""
    n_body = len(doc) - 1  # eos last
    pos, k, prev = 1, 0, None  # bos first
    texts, media_starts, words = [], [], []
    for seg in segments:
        if pos >= n_body:
            break
        if isinstance(seg, list):
            take = min(len(seg), n_body - pos)
            if take == 0:
                continue
            if doc.tokens_L[pos:pos + take].tolist() != seg[:take]:
                raise RuntimeError(f"document layout mismatch at token {pos}")  # a bug, not bad input
            words += _words(tok, seg[:take], pos, len(texts), prev)
            texts.append(TextSegment(pos, pos + take, prev, take < len(seg)))
            pos, prev = pos + take, None
        else:
            media_starts.append(pos + 1)  # after the start marker
            pos, prev, k = pos + doc.media_tokens[k] + 2, k, k + 1
    return texts, media_starts, words


def build_doc_inputs(name: str, kind: str, segments: list, tok: Tokenizer, cfg: DataConfig,
                     media_bytes: list[bytes | None] | None = None,
                     media_objects: list[list[ObjectBoxes]] | None = None,
                     strict_text: bool = False) -> DocInputs:
    """Segments (str and Decoded media, as `parse_sample` returns them) -> DocInputs.

    strict_text: a text segment the token budget would cut is an error (user-given text), not a cut.
    """
    if kind == "text" or not any(isinstance(s, Decoded) for s in segments):
        raise NoMediaError(f"{name}: has no image or video")
    try:
        (doc,) = build_documents(kind, segments, tok, cfg)
    except SkipSample as e:
        raise UserError(f"{name}: does not fit in the context of {cfg.seq_len} tokens ({e})") from None
    enc = [encode(tok, s) if isinstance(s, str) else s for s in segments]
    texts, starts, words = _layout(doc, enc, tok)
    if strict_text and (any(s.truncated for s in texts)
                        or sum(1 for s in enc if isinstance(s, list) and s) > len(texts)):
        n_text = sum(len(s) for s in enc if isinstance(s, list))
        raise UserError(f"--text: {n_text} tokens do not fit in the context of {cfg.seq_len} tokens "
                        f"next to the {kind} ({doc.n_visual} visual tokens at the smallest size); shorten it")
    decoded = [s for s in segments if isinstance(s, Decoded)]
    media = []
    for k, (m, start) in enumerate(zip(doc.media, starts)):
        media.append(_medium_info(k, m, start, decoded[k], cfg.media,
                                  (media_bytes or [])[k] if k < len(media_bytes or []) else None,
                                  (media_objects or [])[k] if k < len(media_objects or []) else []))
    s = tok.special
    special = set(s.as_tuple())
    patch_dim = 3 * cfg.media.temporal_patch * cfg.media.patch_size ** 2
    batch = assemble([[doc]], len(doc), s.pad, patch_dim)
    return DocInputs(
        name=name, kind=kind, document=doc, batch=batch, media=media, segments=texts, words=words,
        token_strs=[tok.token_str(int(i)) for i in doc.tokens_L],
        special_L=np.array([int(i) in special for i in doc.tokens_L]) | (doc.modality_L != TEXT),
    )


def _medium_info(k: int, m, start: int, d: Decoded, media: MediaConfig, data: bytes | None,
                 objects: list[ObjectBoxes]) -> MediumInfo:
    gt, gh, gw = m.grid_thw  # pre-merge patch grid
    tp, p, mg = media.temporal_patch, media.patch_size, media.merge
    if m.kind == IMAGE:
        frames, src, slices = d.frames_THWC[:1], [0], [[0]]
    else:
        n = gt * tp  # frames after the budget's subsampling
        frames = subsample(d.frames_THWC, n)
        idx = video_source_indices(data, media) if data is not None else None
        src = subsample(np.asarray(idx), n).tolist() if idx is not None and len(idx) == len(d.frames_THWC) \
            else None
        slices = [list(range(s * tp, (s + 1) * tp)) for s in range(gt)]
    return MediumInfo(index=k, kind=m.kind, start=start, grid_thw=(gt, gh // mg, gw // mg),
                      resized_hw=(gh * p, gw * p), orig_hw=d.hw, frames_THW3=frames, slice_frames=slices,
                      source_frames=src, objects=objects)


# ----- entry points ------------------------------------------------------------------------------
def doc_from_sample(raw: RawSample, tok: Tokenizer, cfg: DataConfig, text: str | None = None,
                    objects: list[ObjectBoxes] | None = None) -> DocInputs:
    """A webdataset sample (image-text, video-text or interleaved). `text` replaces the caption of
    an image/video sample; `objects` replace the boxes of its (first) medium. Raises SkipSample for
    a sample the loader would skip, NoMediaError for a text-only one."""
    kind, segments = parse_sample(raw, cfg.media)
    meta = decode_json(raw.members["json"]) if "json" in raw.members else None
    if text is not None:
        if kind not in ("image", "video"):
            raise UserError(f"{raw.key}: --text replaces the caption of an image or video sample, "
                            f"not of a {kind} one")
        segments = [s if not isinstance(s, str) else text for s in segments]
    per_medium = _media_objects(meta) or []
    if objects is not None:
        per_medium = [objects] + per_medium[1:]
    return build_doc_inputs(raw.key, kind, segments, tok, cfg, _media_bytes(raw, meta), per_medium,
                            strict_text=text is not None)


def doc_from_file(path: str | Path, kind: str, text: str, tok: Tokenizer, cfg: DataConfig,
                  objects: list[ObjectBoxes] | None = None) -> DocInputs:
    """An image or video file followed by `text` (the layout of an image-text / video-text sample)."""
    data, medium = read_medium(path, kind, cfg.media)
    if not text.strip():
        raise UserError("--text: give the text whose attention to show, e.g. --text \"a red circle\"")
    return build_doc_inputs(Path(path).name, kind, [medium, text.strip()], tok, cfg, [data], [objects or []],
                            strict_text=True)
