"""Generation prompts: an image or video file, a shard sample, or JSONL records -> documents laid out
exactly as training lays them out (the data pipeline's own `parse_sample` / `build_documents`).

An image-text document in training is `<|bos|> <|image_start|> pads <|image_end|> caption <|eos|>`
(video alike); a prompt is that document cut before its end: the medium, then the prompt text
(none: the model captions the medium, as the corpus's captions start right after the medium).
A shard sample keeps its media and drops its caption (an interleaved one: the text after its last
medium), which is returned as the reference. The token budget may shrink media as in training;
a prompt text that does not fit is an error, never cut.

JSONL: one object a line, `{"image": PATH}`, `{"video": PATH}`, `{"segments": [...]}` (as for
`mmtrain data write`; paths relative to the file) or `{"text": ...}` (text only), with an optional
`"prompt"` (the text after the media) and `"name"`; an image/video record's `"text"` is its
reference caption.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mmtrain.data_pipelines.config import DataConfig, MediaConfig
from mmtrain.data_pipelines.decode import decode_image, decode_json, decode_video
from mmtrain.data_pipelines.documents import Document, build_documents, encode, parse_sample
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.preprocess import Decoded
from mmtrain.data_pipelines.shards import RawSample, expand_shards, iter_shard
from mmtrain.data_pipelines.tokenizer import Tokenizer
from mmtrain.errors import UserError

IMAGE_KIND, VIDEO_KIND = 1, 2  # data_pipelines.batch IMAGE / VIDEO


@dataclass
class Prompt:
    name: str
    kind: str  # "image", "video", "interleaved" or "text"
    segments: list  # str and Decoded media, in order (what `parse_sample` returns), without the prompt
    text: str = ""  # the prompt text after the media
    reference: str | None = None  # the sample's own caption (what followed the media)
    meta: dict | None = None  # the sample's key.json (objects, boxes)


def read_medium(path: str | Path, kind: str, media: MediaConfig) -> tuple[bytes, Decoded]:
    """An image or video file's bytes and decoded frames (UserError when unreadable)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"--{kind} {path}: cannot read: {e.strerror or e}") from None
    try:
        frames = decode_image(data, media)[None] if kind == "image" else decode_video(data, media)
    except SkipSample as e:
        raise UserError(f"--{kind} {path}: cannot decode {kind}: {e}") from None
    return data, Decoded(IMAGE_KIND if kind == "image" else VIDEO_KIND, frames)


def medium_file(path: str | Path, kind: str, media: MediaConfig, text: str = "") -> Prompt:
    """An image or video file (then `text`)."""
    return Prompt(Path(path).name, kind, [read_medium(path, kind, media)[1]], text)


def sample_prompt(raw: RawSample, media: MediaConfig, text: str = "") -> Prompt:
    """A webdataset sample: its media (and the text between them), its caption as the reference."""
    try:
        kind, segments = parse_sample(raw, media)
    except SkipSample as e:
        raise UserError(f"{raw.key}: cannot use this sample: {e}") from None
    meta = decode_json(raw.members["json"]) if "json" in raw.members else None
    if kind == "text":  # no media: the sample's text (or the given one) is the whole prompt
        return Prompt(raw.key, kind, [], text or segments[0])
    last = max(i for i, s in enumerate(segments) if isinstance(s, Decoded))
    tail = " ".join(s for s in segments[last + 1:] if isinstance(s, str)) or None
    return Prompt(raw.key, kind, segments[:last + 1], text, tail, meta if isinstance(meta, dict) else None)


def read_sample(shard: str, key: str) -> RawSample:
    """The sample `key` of a shard (a path, glob or brace range)."""
    return read_samples(shard, [key])[0]


def read_samples(shard: str, keys: list[str]) -> list[RawSample]:
    """The samples `keys` (in that order) of the shards a spec names, read in one pass."""
    found: dict[str, RawSample] = {}
    for url in expand_shards([shard], "--shard"):
        for raw in iter_shard(url):
            for k in (raw.key, os.path.basename(raw.key)):
                if k in keys:
                    found.setdefault(k, raw)
            if len(found) == len(set(keys)):
                return [found[k] for k in keys]
    missing = next(k for k in keys if k not in found)
    raise UserError(f"--key {missing}: no such sample in {shard}")


def iter_val_samples(cfg: DataConfig) -> Iterator[tuple[str, RawSample]]:
    """(source name, sample) of the val split, round-robin over its sources, each read in order."""
    if not cfg.val:
        raise UserError("data.val: the checkpoint's config has no val sources")

    def source(src):
        for url in expand_shards(src.shards, src.name):
            for raw in iter_shard(url):
                yield src.name, raw

    iters = [source(s) for s in cfg.val]
    while iters:
        for it in list(iters):
            item = next(it, None)
            if item is None:
                iters.remove(it)
            else:
                yield item


def jsonl_prompts(path: str | Path, media: MediaConfig, text: str = "") -> list[Prompt]:
    """Every record of a JSONL file (see the module docstring); `text` for records without a prompt."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--jsonl {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    out = [_record(f"{path}:{n}", line, path.parent, media, text) for n, line in enumerate(lines, 1)
           if line.strip()]
    if not out:
        raise UserError(f"--jsonl {path}: no records")
    return out


def _record(where: str, line: str, base: Path, media: MediaConfig, text: str) -> Prompt:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not JSON: {e}") from None
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object")
    prompt = rec.get("prompt", text)
    if not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' must be a string")
    name = str(rec.get("name", where))
    for kind in ("image", "video"):
        if kind in rec:
            p = medium_file(base / str(rec[kind]), kind, media, prompt)
            return replace(p, name=name, reference=rec.get("text"))
    if "segments" in rec:
        return replace(_segments(where, rec["segments"], base, media), name=name, text=prompt)
    if isinstance(rec.get("text"), str):
        return Prompt(name, "text", [], prompt + rec["text"] if prompt else rec["text"])
    raise UserError(f"{where}: needs 'image', 'video', 'segments' or 'text'")


def _segments(where: str, segs, base: Path, media: MediaConfig) -> Prompt:
    if not isinstance(segs, list) or not segs:
        raise UserError(f"{where}: 'segments' must be a non-empty list")
    out: list = []
    for i, seg in enumerate(segs):
        kinds = [k for k in ("text", "image", "video") if isinstance(seg, dict) and k in seg]
        if len(kinds) != 1:
            raise UserError(f"{where}: segment {i} needs exactly one of text/image/video")
        value = seg[kinds[0]]
        if kinds[0] == "text":
            out.append(str(value))
        else:
            out.extend(medium_file(base / str(value), kinds[0], media).segments)
    return Prompt(where, "interleaved", out)


def prompt_document(p: Prompt, tok: Tokenizer, cfg: DataConfig) -> Document:
    """The prompt as a training document without its end: bos, segments, prompt text."""
    segments = [*p.segments, p.text] if p.text or not p.segments else p.segments
    kind = "text" if not any(isinstance(s, Decoded) for s in segments) else \
        p.kind if p.kind in ("image", "video") else "interleaved"
    want = sum(len(encode(tok, s)) for s in segments if isinstance(s, str))
    if kind == "text":
        segments = [" ".join(segments)]
    try:
        docs = build_documents(kind, segments, tok, cfg)
    except SkipSample as e:
        raise UserError(f"{p.name}: the prompt does not fit in the context of {cfg.seq_len} tokens "
                        f"({e})") from None
    doc = docs[0]
    have = int(((doc.modality_L == 0) & ~np.isin(doc.tokens_L, tok.special.as_tuple())).sum())
    n_media = sum(isinstance(s, Decoded) for s in segments)
    if len(docs) > 1 or have < want or len(doc.media) < n_media:  # the budget would cut the prompt
        raise UserError(f"{p.name}: the prompt ({want} text tokens, {n_media} media) is longer than the "
                        f"context of {cfg.seq_len} tokens")
    end = len(doc) - 1  # drop the end-of-document token: generation continues from there
    return replace(doc, tokens_L=doc.tokens_L[:end], labels_L=doc.labels_L[:end],
                   modality_L=doc.modality_L[:end], span_L=doc.span_L[:end], pos_3L=doc.pos_3L[:, :end])
