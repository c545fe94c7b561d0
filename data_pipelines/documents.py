"""Raw sample -> tokenized Document(s): kind detection, segments, token budget, M-RoPE positions.

Layout: `<|bos|>` segments... `<|eos|>`; a medium is `<start>` + one pad per merged visual token
+ `<end>`; image-text and video-text put the medium before the caption.

Token budget (every document must fit in seq_len), in this order:
  1. halve the pixel budget of all media, down to min_pixels;
  2. halve the frame budget of videos, down to video_min_frames;
  3. cut at a segment boundary (interleaved) or truncate the text segment that overflows;
  4. if no text token survives: skip the sample as "too_long".
Text-only documents longer than seq_len are split into chunks of seq_len tokens, each its own
document (the first starts with `<|bos|>`, the last ends with `<|eos|>`).

Legend: L = tokens of one document.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    TASK_IMAGE_TEXT,
    TASK_TEXT,
    TASK_VIDEO_TEXT,
    TEXT,
    VIDEO,
)
from mmtrain.data_pipelines.config import DataConfig, MediaConfig
from mmtrain.data_pipelines.decode import (
    IMAGE_EXTS,
    VIDEO_EXTS,
    decode_image,
    decode_json,
    decode_text,
    decode_video,
)
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.preprocess import Decoded, Medium, grid_for, to_medium
from mmtrain.data_pipelines.shards import RawSample
from mmtrain.data_pipelines.tokenizer import Tokenizer

KINDS = ("text", "image", "video", "interleaved")


@dataclass
class Document:
    tokens_L: np.ndarray  # int64
    labels_L: np.ndarray  # int64, IGNORE_INDEX where no loss
    modality_L: np.ndarray  # int8
    span_L: np.ndarray  # int32, 0.. within the document, -1 for text
    pos_3L: np.ndarray  # int64 M-RoPE (t, h, w), restarting at 0
    task: int
    kind: str
    media: list[Medium] = field(default_factory=list)
    media_tokens: list[int] = field(default_factory=list)  # placeholders per medium, in order
    ident: tuple = ()  # (source index, position, chunk): how the loader re-creates it on resume

    def __len__(self) -> int:
        return len(self.tokens_L)

    @property
    def n_visual(self) -> int:
        return int((self.modality_L != TEXT).sum())


# ----- raw sample -> segments ------------------------------------------------------------------
def _first(members: dict, exts: tuple[str, ...]) -> str | None:
    return next((e for e in exts if e in members), None)


def _member(raw: RawSample, ref) -> bytes:
    """The member an interleaved segment names: "0.png", "key.0.png", a path ending in either, or 0."""
    name = os.path.basename(str(ref))
    base = os.path.basename(raw.key)
    if name.startswith(base + "."):
        name = name[len(base) + 1 :]
    name = name.lower()
    if name in raw.members:
        return raw.members[name]
    hits = [e for e in raw.members if e.startswith(name + ".")] if name.isdigit() else []
    if len(hits) == 1:
        return raw.members[hits[0]]
    raise SkipSample(L.MISSING_MEMBER, f"segment names {ref!r}, not in the sample")


def _segments_of(meta) -> list[tuple[str, object]]:
    """(type, value) pairs from {"segments": [...]} or the OBELICS/MMC4 parallel lists."""
    if isinstance(meta, dict) and isinstance(meta.get("segments"), list):
        pairs = []
        for seg in meta["segments"]:
            d = seg if isinstance(seg, dict) else {}
            kinds = [k for k in ("text", "image", "video") if d.get(k) is not None]
            if len(kinds) != 1:
                raise SkipSample(L.BAD_JSON, f"segment needs one of text/image/video: {type(seg).__name__} "
                                             f"with {sorted(map(str, d))[:4]}")
            pairs.append((kinds[0], seg[kinds[0]]))
        return pairs
    texts, images = (meta.get("texts"), meta.get("images")) if isinstance(meta, dict) else (None, None)
    if isinstance(texts, list) and isinstance(images, list):
        if len(texts) != len(images):
            raise SkipSample(L.BAD_JSON, f"texts ({len(texts)}) and images ({len(images)}) differ in length")
        return [("image", im) if im is not None else ("text", t) for t, im in zip(texts, images)
                if im is not None or t is not None]
    raise SkipSample(L.BAD_JSON, "json has neither 'segments' nor 'texts'/'images'")


def _interleaved(raw: RawSample, meta, media: MediaConfig, max_media: int) -> list:
    out: list = []
    n_media = 0
    for typ, value in _segments_of(meta):
        if typ == "text":
            if not isinstance(value, str):
                raise SkipSample(L.BAD_JSON, f"text segment is {type(value).__name__}")
            if value.strip():
                out.append(value)
            continue
        if n_media == max_media:  # cut before decoding more: the budget would cut here anyway
            break
        n_media += 1
        if typ == "image":
            out.append(Decoded(IMAGE, decode_image(_member(raw, value), media)[None]))
        else:
            out.append(Decoded(VIDEO, decode_video(_member(raw, value), media)))
    if not out:
        raise SkipSample(L.BAD_JSON, "no segments")
    if not any(isinstance(s, str) for s in out):
        raise SkipSample(L.EMPTY_TEXT, "interleaved document without text")
    return out


def _check_sizes(raw: RawSample, max_text_bytes: int) -> None:
    if raw.too_large:
        raise SkipSample(L.TOO_LARGE, raw.too_large)
    for ext in ("txt", "json"):
        if len(raw.members.get(ext, b"")) > max_text_bytes:
            raise SkipSample(L.TOO_LARGE, f"{ext} has {len(raw.members[ext])} bytes > "
                                          f"max_text_bytes {max_text_bytes}")


def parse_sample(raw: RawSample, media: MediaConfig, max_text_bytes: int = DataConfig.max_text_bytes,
                 max_media: int = DataConfig.max_media_per_doc) -> tuple[str, list]:
    """-> (kind, segments); a segment is a str or a Decoded medium. Raises SkipSample."""
    _check_sizes(raw, max_text_bytes)
    m = raw.members
    image_ext, video_ext = _first(m, IMAGE_EXTS), _first(m, VIDEO_EXTS)
    if video_ext or image_ext:
        if "txt" not in m:
            raise SkipSample(L.MISSING_MEMBER, f"{video_ext or image_ext} without a txt caption")
        caption = decode_text(m["txt"])
        if video_ext:
            return "video", [Decoded(VIDEO, decode_video(m[video_ext], media)), caption]
        return "image", [Decoded(IMAGE, decode_image(m[image_ext], media)[None]), caption]
    if "json" in m:
        meta = decode_json(m["json"])
        is_doc = isinstance(meta, dict) and ("segments" in meta or "texts" in meta)
        if is_doc or "txt" not in m:
            return "interleaved", _interleaved(raw, meta, media, max_media)
    if "txt" in m:
        return "text", [decode_text(m["txt"])]
    raise SkipSample(L.UNKNOWN_KIND, f"members {sorted(m)[:6]}")


# ----- budget ---------------------------------------------------------------------------------
def _levels(hi: int, lo: int) -> list[int]:
    out = [hi]
    while out[-1] // 2 > lo:
        out.append(out[-1] // 2)
    return out + [lo] if out[-1] != lo else out


def _frame_levels(media: MediaConfig) -> list[int]:
    tp = media.temporal_patch
    lo = -(-media.video_min_frames // tp) * tp
    return [max(tp, -(-f // tp) * tp) for f in _levels(media.video_max_frames, lo)]


def _seg_cost(seg, media: MediaConfig, px: int, frames: int) -> int:
    if isinstance(seg, list):  # token ids
        return len(seg)
    t, h, w = grid_for(seg, media, px, frames)
    return 2 + t * (h // media.merge) * (w // media.merge)


def fit_budget(segments: list, cfg: DataConfig) -> tuple[list, int, int]:
    """Segments (token-id lists and Decoded media) -> (segments to keep, pixel budget, frame budget).

    Raises SkipSample(too_long) when not a single text token would survive.
    """
    media, room = cfg.media, cfg.seq_len - 2  # bos + eos
    # data.max_visual_tokens_per_row: a document must fit an empty row's visual budget too
    # (else the packer could never place it): scaled down like for seq_len, then cut
    vis_room = cfg.max_visual_tokens_per_row or room
    px_levels = _levels(media.max_pixels, media.min_pixels)
    fr_levels = _frame_levels(media)
    tries = [(px, fr_levels[0]) for px in px_levels] + [(px_levels[-1], fr) for fr in fr_levels[1:]]
    for px, fr in tries:
        costs = [_seg_cost(s, media, px, fr) for s in segments]
        if sum(costs) <= room and _visual(segments, costs) <= vis_room:
            return segments, px, fr
    kept, used, vis = [], 0, 0
    for seg in segments:  # 3. cut at a segment boundary / truncate the overflowing text
        cost = _seg_cost(seg, media, px, fr)
        seen = 0 if isinstance(seg, list) else cost - 2  # its placeholders (not the two markers)
        if used + cost <= room and vis + seen <= vis_room:
            kept.append(seg)
            used, vis = used + cost, vis + seen
            continue
        if isinstance(seg, list) and room - used > 0:
            kept.append(seg[: room - used])
        break
    if not any(isinstance(s, list) and s for s in kept):
        raise SkipSample(L.TOO_LONG, f"media alone exceed seq_len {cfg.seq_len} or "
                                     f"max_visual_tokens_per_row {cfg.max_visual_tokens_per_row}")
    return kept, px, fr


def _visual(segments: list, costs: list[int]) -> int:
    """Visual placeholders of the segments (a medium's cost less its two markers)."""
    return sum(c - 2 for s, c in zip(segments, costs) if not isinstance(s, list))


# ----- segments -> document ---------------------------------------------------------------------
class _Builder:
    """Walks the segments in order, noting runs; `arrays` fills each per-token array once."""

    def __init__(self):
        self.runs: list[tuple] = []  # (start, text ids) or (start, Medium, pad id, merged t/h/w, span0)
        self.n = 0  # tokens so far
        self.pos = 0  # next M-RoPE position
        self.span = 0
        self.media_tokens: list[int] = []

    def text(self, ids: list[int], target: bool = True) -> None:
        """Text tokens; target=False for bos and media markers (no loss on predicting them)."""
        self.runs.append((self.n, self.pos, (ids, target)))
        self.n += len(ids)
        self.pos += len(ids)

    def medium(self, m: Medium, pad_id: int, merge: int) -> None:
        t, h, w = m.grid_thw[0], m.grid_thw[1] // merge, m.grid_thw[2] // merge
        self.runs.append((self.n, self.pos, (m.kind, pad_id, t, h, w, self.span)))
        self.span += t if m.kind == VIDEO else 1
        self.media_tokens.append(t * h * w)
        self.n += t * h * w
        self.pos += max(t, h, w)

    def arrays(self):
        tokens_L = np.empty(self.n, np.int64)
        modality_L = np.full(self.n, TEXT, np.int8)
        span_L = np.full(self.n, -1, np.int32)
        pos_3L = np.empty((3, self.n), np.int64)
        target_L = np.zeros(self.n, bool)  # may be predicted: text and eos
        for start, pos, run in self.runs:
            if len(run) == 2:
                ids, target = run
                sl = slice(start, start + len(ids))
                tokens_L[sl], target_L[sl] = ids, target
                pos_3L[:, sl] = np.arange(pos, pos + len(ids))
                continue
            kind, pad_id, t, h, w, span0 = run
            sl = slice(start, start + t * h * w)
            tokens_L[sl], modality_L[sl] = pad_id, kind
            grid_3thw = np.indices((t, h, w)).reshape(3, -1)  # raster (t, h, w) of the merged grid
            span_L[sl] = span0 + (grid_3thw[0] if kind == VIDEO else 0)
            pos_3L[:, sl] = pos + grid_3thw
        return tokens_L, modality_L, span_L, pos_3L, target_L


def _document(b: _Builder, task: int, kind: str, media: list[Medium]) -> Document:
    """Labels: the next token within the document where it is text or eos, else IGNORE_INDEX."""
    tokens_L, modality_L, span_L, pos_3L, target_L = b.arrays()
    labels_L = np.empty_like(tokens_L)
    labels_L[:-1] = np.where(target_L[1:], tokens_L[1:], IGNORE_INDEX)
    labels_L[-1] = IGNORE_INDEX
    return Document(tokens_L, labels_L, modality_L, span_L, pos_3L, task, kind, media, b.media_tokens)


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of text with special ids dropped: a caption spelling "<|image_pad|>" must not
    create a placeholder without a medium."""
    special = set(tok.special.as_tuple())
    return [i for i in tok.encode(text) if i not in special]


def _task(segments: list) -> int:
    kinds = {s.kind for s in segments if isinstance(s, Decoded)}
    return TASK_VIDEO_TEXT if VIDEO in kinds else TASK_IMAGE_TEXT if IMAGE in kinds else TASK_TEXT


class TextChunks(Sequence):
    """The documents of one text, `seq_len` tokens each, built when asked for: a long text holds
    4 bytes a token here instead of ~45 in finished documents."""

    def __init__(self, ids_L: np.ndarray, seq_len: int):
        self.ids_L, self.seq_len = ids_L, seq_len

    def __len__(self) -> int:
        return -(-len(self.ids_L) // self.seq_len)

    def __getitem__(self, i: int) -> Document:
        if not -len(self) <= i < len(self):
            raise IndexError(f"chunk {i} of {len(self)}")
        i %= len(self)
        b = _Builder()
        b.text(self.ids_L[i * self.seq_len : (i + 1) * self.seq_len].tolist())  # bos is only ever first
        return _document(b, TASK_TEXT, "text", [])


def text_documents(text: str, tok: Tokenizer, seq_len: int) -> TextChunks:
    s = tok.special
    return TextChunks(np.asarray([s.bos, *encode(tok, text), s.eos], np.int32), seq_len)


def build_documents(kind: str, segments: list, tok: Tokenizer, cfg: DataConfig) -> Sequence[Document]:
    """Segments -> one Document (or several text chunks). Raises SkipSample(too_long)."""
    if kind == "text":
        return text_documents(segments[0], tok, cfg.seq_len)
    media_cfg, s = cfg.media, tok.special
    segments = [encode(tok, x) if isinstance(x, str) else x for x in segments]
    kept, px, frames = fit_budget(segments, cfg)
    b, media = _Builder(), []
    b.text([s.bos], target=False)
    for seg in kept:
        if isinstance(seg, list):
            b.text(seg)
            continue
        m = to_medium(seg, media_cfg, px, frames)
        start, pad, end = ((s.image_start, s.image_pad, s.image_end) if m.kind == IMAGE
                           else (s.video_start, s.video_pad, s.video_end))
        b.text([start], target=False)
        b.medium(m, pad, media_cfg.merge)
        b.text([end], target=False)
        media.append(m)
    b.text([s.eos])
    return [_document(b, _task(kept), kind, media)]


def make_documents(raw: RawSample, tok: Tokenizer, cfg: DataConfig) -> tuple[str, Sequence[Document]]:
    """The whole per-sample path: decode, preprocess, tokenize. Deterministic; raises SkipSample."""
    kind, segments = parse_sample(raw, cfg.media, cfg.max_text_bytes, cfg.max_media_per_doc)
    return kind, build_documents(kind, segments, tok, cfg)
