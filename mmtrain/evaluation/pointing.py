"""The pointing game (Zhang et al. 2016, on a token grid), shared by `mmtrain-attn` and the collapse
diagnostics.

A caption word that names exactly one object of its medium (by colour, shape or size) points where
its attention over the medium's merged token grid peaks (mean over its tokens' rows and the heads);
each token covers a patch*merge square of the resized frame, i.e. a rectangle of the medium's
original pixels, and the word *hits* when the argmax token's rectangle touches the object's box.
A video word is scored on every temporal slice (temporal_patch frames) against the union of its
frames' boxes. Chance: `chance` = box area / image area; `chance_cell` = the share of tokens whose
rectangle touches the box (what a uniformly random token scores: the honest baseline on a coarse grid).

The diagnostics' version (`grounding_docs`, `pointing_scores`): the first val images/videos whose
key.json has objects with boxes, each with its own caption as in training; every word's rows are
recomputed with the layer's own mask (`recompute_probs`), the map is the mean over layers, and the
accuracy per category is the mean over words (of the share of slices hit).

Legend: B rows, S tokens, H heads, R query rows, t/h/w merged token grid, V visual tokens of a medium.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.documents import Document, build_documents, encode
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.packing import assemble
from mmtrain.data_pipelines.shards import RawSample
from mmtrain.data_pipelines.tokenizer import Tokenizer
from mmtrain.errors import UserError
from mmtrain.inference.prompts import iter_val_samples, sample_prompt
from mmtrain.models.attention import build_meta, recompute_probs

Box = tuple[float, float, float, float]  # [x0, y0, x1, y1] original px, x1/y1 exclusive
# key.json attribute fields the pointing game scores -> category (British/American spelling)
CATEGORY = {"color": "colour", "colour": "colour", "shape": "shape", "size": "size"}
T = TypeVar("T")


# ----- geometry ---------------------------------------------------------------------------------
def cell_rects(grid_hw: tuple[int, int], orig_hw: tuple[int, int]) -> np.ndarray:
    """(h, w, 4) [x0, y0, x1, y1] of every merged token in the medium's original pixels."""
    (h, w), (oh, ow) = grid_hw, orig_hw
    ys, xs = np.linspace(0, oh, h + 1), np.linspace(0, ow, w + 1)
    y0, x0 = np.meshgrid(ys[:-1], xs[:-1], indexing="ij")
    y1, x1 = np.meshgrid(ys[1:], xs[1:], indexing="ij")
    return np.stack([x0, y0, x1, y1], axis=-1)


def boxes_mask(boxes: Sequence[Box], orig_hw: tuple[int, int]) -> np.ndarray:
    """bool (orig_h, orig_w): the union of the boxes."""
    mask = np.zeros(orig_hw, dtype=bool)
    for x0, y0, x1, y1 in boxes:
        ys = slice(max(0, int(np.floor(y0))), max(0, int(np.ceil(y1))))
        mask[ys, max(0, int(np.floor(x0))):max(0, int(np.ceil(x1)))] = True
    return mask


def touches(rect: np.ndarray, mask: np.ndarray) -> bool:
    x0, y0, x1, y1 = rect
    return bool(mask[int(np.floor(y0)):int(np.ceil(y1)), int(np.floor(x0)):int(np.ceil(x1))].any())


def pointing_hit(map_hw: np.ndarray, rects_hw4: np.ndarray, mask: np.ndarray) -> tuple[bool, tuple[int, int]]:
    """(hit, argmax cell): does the best token's pixel rectangle touch the mask?"""
    r, c = np.unravel_index(int(np.argmax(map_hw)), map_hw.shape)
    return touches(rects_hw4[r, c], mask), (int(r), int(c))


def chance_levels(rects_hw4: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(box area share, share of tokens whose rectangle touches the box)."""
    cells = [touches(rect, mask) for rect in rects_hw4.reshape(-1, 4)]
    return float(mask.mean()), float(np.mean(cells))


def uniform_box(frame: int, n_frames: int, n_boxes: int) -> int:
    """Which of an object's per-frame boxes belongs to frame `frame` of the n_frames the model saw,
    when the source frame indices are unknown (frames sampled uniformly over the clip)."""
    return 0 if n_boxes == 1 else min(n_boxes - 1, int((frame + 0.5) * n_boxes / n_frames))


def match_object(word: str, objects: Sequence[dict[str, str]]) -> tuple[int, str] | None:
    """(object index, field) of the one object with an attribute equal to `word`; None if none or
    several objects have it (an ambiguous word is not scored)."""
    hits = [(i, f) for i, o in enumerate(objects) for f, v in o.items() if v == word]
    return hits[0] if len({i for i, _ in hits}) == 1 else None


# ----- the diagnostics' grounding set ------------------------------------------------------------
@dataclass
class GroundingDoc:
    name: str
    document: Document  # the training document: medium, then its caption
    start: int  # position of the medium's first placeholder
    grid_thw: tuple[int, int, int]  # merged token grid
    orig_hw: tuple[int, int]
    words: list[tuple[int, int, int, str]]  # (first token, end token, object, category)
    boxes: list[list[Box]]  # per object: one box per source frame (an image: one)
    temporal_patch: int


def box_objects(meta) -> list[tuple[dict[str, str], list[Box]]]:
    """key.json's objects as (attribute field -> lower-case value, boxes); [] if any box is unreadable."""
    objs = meta.get("objects") if isinstance(meta, dict) else None
    out = []
    for o in objs if isinstance(objs, list) else []:
        o = o if isinstance(o, dict) else {}
        boxes = [o["box"]] if "box" in o else o.get("boxes")
        ok = isinstance(boxes, list) and boxes and all(isinstance(b, list) and len(b) == 4 for b in boxes)
        if not ok:
            return []  # boxes we cannot read: no pointing game for this sample
        out.append(({f: str(v).lower() for f, v in o.items() if f in CATEGORY and isinstance(v, str)},
                    [tuple(map(float, b)) for b in boxes]))
    return out


def _word_tokens(tok: Tokenizer, ids: list[int], text: str) -> list[tuple[int, int, str]]:
    """(first token, end token, word) of every word of `text` encoded as ids (char offsets from
    decoding prefixes: the tokenizer keeps none)."""
    ends = [len(tok.decode(ids[:j + 1])) for j in range(len(ids))]
    starts = [0, *ends[:-1]]
    out = []
    for m in re.finditer(r"[a-z]+", text.lower()):
        toks = [j for j in range(len(ids)) if starts[j] < m.end() and ends[j] > m.start()]
        if toks:
            out.append((toks[0], toks[-1] + 1, m.group(0)))
    return out


def grounding_doc(name: str, kind: str, segments: list, caption: str, meta, tok: Tokenizer,
                  cfg: DataConfig) -> GroundingDoc | None:
    """One image/video sample with its caption as a training document, with the words to score."""
    objects = box_objects(meta)
    if not objects:
        return None
    (doc,) = build_documents(kind, [*segments, caption], tok, cfg)
    ids = encode(tok, caption)
    start = 2  # <|bos|> <|start|> placeholders...
    c0 = start + doc.media_tokens[0] + 1
    if len(doc.media) != 1 or doc.tokens_L[c0:c0 + len(ids)].tolist() != ids:
        return None  # the budget cut the caption
    words = []
    for a, b, w in _word_tokens(tok, ids, caption):
        m = match_object(w, [attrs for attrs, _ in objects])
        if m is not None:
            words.append((c0 + a, c0 + b, m[0], CATEGORY[m[1]]))
    gt, gh, gw = doc.media[0].grid_thw
    merge = cfg.media.merge
    return GroundingDoc(name, doc, start, (gt, gh // merge, gw // merge), segments[0].hw, words,
                        [bx for _, bx in objects], cfg.media.temporal_patch) if words else None


def first_val(cfg: DataConfig, n: int, scan: int, make: Callable[[RawSample], T | None]) -> list[T]:
    """make(sample) for the first val samples (of the first `scan`) until n are not None; a sample
    that cannot be used (SkipSample, UserError, ValueError) is passed over."""
    out: list[T] = []
    if n <= 0 or not cfg.val:
        return out
    for i, (_, raw) in enumerate(iter_val_samples(cfg)):
        if len(out) >= n or i >= scan:
            break
        try:
            item = make(raw)
        except (SkipSample, UserError, ValueError):
            continue
        if item is not None:
            out.append(item)
    return out


def grounding_docs(cfg: DataConfig, tok: Tokenizer, n: int, scan: int = 400) -> list[GroundingDoc]:
    """The first n val images/videos whose key.json has objects with boxes (and a caption)."""

    def make(raw: RawSample) -> GroundingDoc | None:
        p = sample_prompt(raw, cfg.media)
        if p.kind not in ("image", "video") or not p.reference:
            return None
        return grounding_doc(raw.key, p.kind, p.segments, p.reference, p.meta, tok, cfg)

    return first_val(cfg, n, scan, make)


@torch.no_grad()
def pointing_scores(model, docs: list[GroundingDoc], device: torch.device, model_cfg,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                    ) -> dict:
    """{category: {"n": words, "accuracy", "chance_cell"}} of the mean-over-layers maps, for a model
    (wrapped or not) in eval mode and its `ModelConfig`."""
    dec = model_cfg.decoder
    S = max(len(d.document) for d in docs)
    batch = assemble([[d.document] for d in docs], S, 0, model_cfg.vision.patch_dim).to(device)
    inputs = batch.model_inputs()
    with autocast():
        out = model(**inputs, capture_layers=list(range(dec.n_layers)), compute_logits=False)
    meta = build_meta(inputs["doc_ids_BS"], inputs["span_ids_BS"], dec.attention.block_size)
    rows = [(b, p) for b, d in enumerate(docs) for a, e, _, _ in d.words for p in range(a, e)]
    rows_R2 = torch.tensor(rows, dtype=torch.long, device=device)
    maps_RV = _visual_probs(out.captures, meta, dec, rows_R2, docs)
    return _score(docs, maps_RV)


def _visual_probs(captures, meta, dec, rows_R2, docs) -> list[np.ndarray]:
    """Per row: its probabilities over its medium's tokens, mean over heads and layers (V,)."""
    sums = [0.0] * rows_R2.shape[0]
    for layer in range(dec.n_layers):
        p_HRS = recompute_probs(captures[layer], meta, dec.attention, dec.is_sparse(layer), rows_R2).float()
        p_RS = p_HRS.mean(0).cpu().numpy()
        for r, (b, _) in enumerate(rows_R2.tolist()):
            d = docs[b]
            sums[r] = sums[r] + p_RS[r, d.start:d.start + int(np.prod(d.grid_thw))] / dec.n_layers
    return sums


def _score(docs: list[GroundingDoc], maps_RV: list[np.ndarray]) -> dict:
    acc: dict[str, list[float]] = {}
    chance: dict[str, list[float]] = {}
    r = 0
    for d in docs:
        t, h, w = d.grid_thw
        rects = cell_rects((h, w), d.orig_hw)
        n_frames = t * d.temporal_patch
        for a, e, obj, cat in d.words:
            map_thw = np.mean(maps_RV[r:r + e - a], axis=0).reshape(t, h, w)
            r += e - a
            hits, cells = [], []
            for s in range(t):
                frames = range(s * d.temporal_patch, (s + 1) * d.temporal_patch)
                boxes = d.boxes[obj]
                mask = boxes_mask([boxes[uniform_box(f, n_frames, len(boxes))] for f in frames], d.orig_hw)
                hits.append(pointing_hit(map_thw[s], rects, mask)[0])
                cells.append(chance_levels(rects, mask)[1])
            acc.setdefault(cat, []).append(float(np.mean(hits)))
            chance.setdefault(cat, []).append(float(np.mean(cells)))
    return {c: {"n": len(v), "accuracy": float(np.mean(v)), "chance_cell": float(np.mean(chance[c]))}
            for c, v in sorted(acc.items())}
