"""One analysed document -> picture files: per-token heatmaps (PNG; video: strip + GIF), the frames
the model saw, and the block pattern of each sparse layer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrain.data_pipelines.batch import TEXT

from . import plots
from .maps import DocAttention
from .metrics import scorable_words


@dataclass
class TokenPictures:
    pos: int  # the token
    row: int  # the query row shown (pos, or pos - 1 for --query predictor)
    medium: int
    files: list[Path]
    mass: dict[int, float]  # layer -> head-mean mass on this medium


@dataclass
class DocPictures:
    media: list[Path] = field(default_factory=list)
    tokens: dict[int, TokenPictures] = field(default_factory=dict)
    blocks: dict[int, Path] = field(default_factory=dict)
    curves: dict[int, Path] = field(default_factory=dict)  # first token of a word -> its knockout curves


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:24] or "tok"


def layer_kinds(att: DocAttention) -> dict[int, str]:
    return {l: " S" if att.per_layer[l].sparse else " F" for l in att.layers}


def wanted(att: DocAttention, pos: int, tokens: list[str] | None) -> bool:
    if not tokens:
        return True
    w = att.doc.word_at(pos)
    piece = att.doc.token_strs[pos].lower().strip()
    return piece in tokens or (w is not None and w.text in tokens)


def render_document(att: DocAttention, out: Path, heads: str | list[int] = "mean",
                    tokens: list[str] | None = None, query: str = "token", prefix: str = "") -> DocPictures:
    """Write the pictures of one document under `out`; -> what was written, for the report."""
    doc, pics = att.doc, DocPictures()
    out.mkdir(parents=True, exist_ok=True)
    stem = prefix + slug(doc.name)
    kinds = layer_kinds(att)
    for m in doc.media:
        path = out / f"{stem}_medium{m.index}.png"
        plots.medium_strip(m, f"{m.kind_name} {m.index + 1}: what the model saw").save(path)
        pics.media.append(path)
    named = {p: (doc.media[w.medium], obj) for w, obj, _ in scorable_words(doc)
             for p in range(w.start, w.end)}
    for i, pos in enumerate(att.rows.tolist()):
        row = pos if query == "token" else pos - 1
        k = doc.target_medium(pos)
        if (not att.stat_rows[i] or k is None or not wanted(att, pos, tokens)
                or not att.has_maps([row])):
            continue
        medium = doc.media[k]
        maps = {l: att.medium_map(l, [row], medium) for l in att.layers}
        masses = {l: att.medium_mass(l, row)[:, k] for l in att.layers}
        obj = named[pos][1] if pos in named and named[pos][0] is medium else None
        title = f"'{doc.token_strs[pos]}' (token {pos}, {query} row) -> {medium.kind_name} {k + 1}"
        base = out / f"{stem}_t{pos:04d}_{slug(doc.token_strs[pos])}"
        if medium.kind_name == "image":
            o = medium.objects[obj] if obj is not None else None
            boxes = [(o.boxes[0], "target: " + plots.object_label(o))] if o is not None else None
            pic = plots.image_token_picture(maps, medium, heads, title, kinds, boxes)
            pic.save(base.with_suffix(".png"))
            files = [base.with_suffix(".png")]
        else:
            per_slice = None
            if obj is not None:
                o = medium.objects[obj]
                label = "target: " + plots.object_label(o)
                per_slice = [[(o.boxes[medium.box_frame(f, len(o.boxes))], label) for f in fr[:1]]
                             for fr in medium.slice_frames]
            strip, gif = plots.video_token_pictures(maps, medium, heads, title, kinds, per_slice)
            strip.save(base.with_suffix(".png"))
            plots.save_gif(gif, base.with_suffix(".gif"))
            files = [base.with_suffix(".png"), base.with_suffix(".gif")]
        pics.tokens[pos] = TokenPictures(pos, row, k, files, {l: float(v.mean()) for l, v in masses.items()})
    for l in att.layers:
        r = att.per_layer[l]
        if r.kept_GQN is None:
            continue
        N, Bs = r.reach_QN.shape[1], att.block_size
        vis = np.zeros(N * Bs, bool)
        vis[: len(doc)] = doc.document.modality_L != TEXT
        visual_N = vis.reshape(N, Bs).any(1)
        path = out / f"{stem}_blocks_L{l}.png"
        plots.block_pattern(r.kept_GQN.numpy(), r.reach_QN.numpy(), visual_N, l, path)
        pics.blocks[l] = path
    return pics

