"""Grounding metrics from recomputed attention: text-to-visual mass / entropy / sink, and the pointing game
(its geometry -- token rectangles, box masks, hits, chance levels -- is mmtrain/evaluation/pointing.py, shared
with the collapse diagnostics).

Pointing game (Zhang et al. 2016, adapted to a token grid). For a caption word that names exactly one
object of the medium its text describes (the medium directly before the text), by one of the
object's attributes (colour, shape, size, or a label from --boxes; a word naming several objects is
ambiguous and skipped): take the word's attention over the medium's merged token grid (mean over its
tokens' rows, mean over heads), upsample it to pixels (each token covers a patch*merge square of the
resized frame, scaled back to the medium's original pixels), and take the argmax. The argmax of a
nearest-upsampled map is the whole pixel rectangle of the best token, so it is a *hit* when that
rectangle touches the object's box. A video word is scored on every temporal slice (one token slice
per temporal_patch frames) against the union of its frames' boxes; its accuracy is the fraction of
slices hit.

Two chance levels: `chance` = box area / image area (the classic definition), and `chance_cell` =
the fraction of grid tokens whose rectangle touches the box, i.e. the expected accuracy of a map that
points at a uniformly random token -- the honest baseline on a coarse grid, where a 10-px box on a
16-px token grid touches 1-4 of 16 tokens.

A control for salience: where the medium holds other objects, the same argmax is also scored
against them (`accuracy_other`). A map that finds *an* object but not the named one scores the same
on both; grounding of the word shows as accuracy well above accuracy_other.

Query rows: "token" scores the word's own rows (where the word looks); "predictor" scores the rows
just before it (where the model looks while predicting the word -- for a colour word that cannot be
guessed from text, the row that must read it from the pixels).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from mmtrain.evaluation import pointing
from mmtrain.evaluation.pointing import chance_levels, pointing_hit, touches

from .inputs import DocInputs, MediumInfo, ObjectBoxes, Word
from .maps import DocAttention

# Attribute fields reported as word categories (key.json's British/American spelling is "color").
CATEGORY = {"color": "colour", "colour": "colour", "shape": "shape", "size": "size"}


def word_category(field_name: str) -> str:
    return CATEGORY.get(field_name, "label" if field_name in ("label", "name", "word", "category", "class")
                        else field_name)


def match_object(word: str, objects: list[ObjectBoxes]) -> tuple[int, str] | None:
    """(object index, category) of the one object the word names; None if none or several do."""
    m = pointing.match_object(word, [o.attrs for o in objects])
    return None if m is None else (m[0], word_category(m[1]))


def cell_rects(medium: MediumInfo) -> np.ndarray:
    """(h, w, 4) [x0, y0, x1, y1] of every merged token in the medium's original pixels."""
    return pointing.cell_rects(medium.grid_thw[1:], medium.orig_hw)


def object_mask(obj: ObjectBoxes, medium: MediumInfo, slice_idx: int) -> np.ndarray:
    """bool (orig_h, orig_w): union of the object's boxes in the slice's frames."""
    boxes = [obj.boxes[medium.box_frame(f, len(obj.boxes))] for f in medium.slice_frames[slice_idx]]
    return pointing.boxes_mask(boxes, medium.orig_hw)


@dataclass
class Trial:
    """One scored word (for a video: all its slices)."""

    doc: str
    kind: str  # image / video
    word: str
    category: str
    start: int  # token positions of the word
    end: int
    medium: int
    object: int
    query: str  # "token" or "predictor"
    hits: dict[str, list[bool]]  # layer (or "mean") -> hit per slice
    argmax: dict[str, list[list[int]]]  # layer (or "mean") -> argmax cell per slice
    chance: float  # mean over slices
    chance_cell: float
    hits_other: dict[str, list[bool]] | None = None  # the same argmax against the medium's other objects

    def accuracy_other(self, layer: str) -> float | None:
        return None if self.hits_other is None else float(np.mean(self.hits_other[layer]))

    def accuracy(self, layer: str) -> float:
        return float(np.mean(self.hits[layer]))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accuracy"] = {k: self.accuracy(k) for k in self.hits}
        if self.hits_other is not None:
            d["accuracy_other"] = {k: self.accuracy_other(k) for k in self.hits_other}
        return d


def scorable_words(doc: DocInputs) -> list[tuple[Word, int, str]]:
    """(word, object, category) for words that name one object of the medium their text describes."""
    out = []
    for w in doc.words:
        if w.medium is None or not w.text:
            continue
        m = match_object(w.text, doc.media[w.medium].objects)
        if m is not None:
            out.append((w, *m))
    return out


def pointing_rows(doc: DocInputs) -> list[int]:
    """Every query row the pointing game needs (both queries): what to keep maps for."""
    words = [w for w, _, _ in scorable_words(doc)]
    return sorted({r for w in words for q in ("token", "predictor") for r in word_rows(w, q)})


def word_rows(word: Word, query: str) -> list[int]:
    """The query rows a word is scored with: its own tokens, or the rows predicting them."""
    shift = 0 if query == "token" else 1
    return list(range(word.start - shift, word.end - shift))


def pointing_trials(att: DocAttention, query: str = "token", heads: list[int] | None = None) -> list[Trial]:
    """Score every scorable word of the document, per captured layer and for the mean over layers.
    heads: which heads to average (default all)."""
    doc, out = att.doc, []
    for w, obj_i, cat in scorable_words(doc):
        medium = doc.media[w.medium]
        obj = medium.objects[obj_i]
        rows = word_rows(w, query)
        if not att.has_maps(rows):
            continue  # a predictor row before the first medium (cannot see it), or maps not kept
        maps = {str(l): att.medium_map(l, rows, medium)[heads or slice(None)].mean(0) for l in att.layers}
        maps["mean"] = np.mean([maps[str(l)] for l in att.layers], axis=0)
        rects = cell_rects(medium)
        others = [o for i, o in enumerate(medium.objects) if i != obj_i]
        hits: dict[str, list[bool]] = defaultdict(list)
        hits_other: dict[str, list[bool]] = defaultdict(list)
        argmax: dict[str, list[list[int]]] = defaultdict(list)
        chances, cell_chances = [], []
        for s in range(medium.grid_thw[0]):
            mask = object_mask(obj, medium, s)
            other = np.any([object_mask(o, medium, s) for o in others], axis=0) if others else None
            c, cc = chance_levels(rects, mask)
            chances.append(c)
            cell_chances.append(cc)
            for key, m_thw in maps.items():
                hit, cell = pointing_hit(m_thw[s], rects, mask)
                hits[key].append(hit)
                argmax[key].append(list(cell))
                if other is not None:
                    hits_other[key].append(touches(rects[cell], other))
        out.append(Trial(doc.name, medium.kind_name, w.text, cat, w.start, w.end, w.medium, obj_i, query,
                         dict(hits), dict(argmax), float(np.mean(chances)), float(np.mean(cell_chances)),
                         dict(hits_other) if others else None))
    return out


def summarize_trials(trials: list[Trial], layers: list[int]) -> dict:
    """Per category (and "all"), and per category x medium kind: n, accuracy per layer and for the
    mean map over layers, and the two chance levels (means over words)."""
    groups: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        for key in ("all", t.category, f"{t.category}/{t.kind}"):
            groups[key].append(t)
    out = {}
    for key in sorted(groups, key=lambda k: (k.count("/"), k != "all", k)):
        ts = groups[key]
        multi = [t for t in ts if t.hits_other is not None]
        keys = [*map(str, layers), "mean"]
        out[key] = {
            "n": len(ts),
            "accuracy": {str(l): float(np.mean([t.accuracy(str(l)) for t in ts])) for l in layers},
            "accuracy_mean_layers": float(np.mean([t.accuracy("mean") for t in ts])),
            "chance": float(np.mean([t.chance for t in ts])),
            "chance_cell": float(np.mean([t.chance_cell for t in ts])),
            # Words in media with several objects: the named object vs the others, same argmax.
            "n_multi": len(multi),
            "accuracy_multi": _mean({k: [t.accuracy(k) for t in multi] for k in keys}),
            "accuracy_other": _mean({k: [t.accuracy_other(k) for t in multi] for k in keys}),
        }
    return out


def _mean(d: dict[str, list[float]]) -> dict[str, float] | None:
    return {k: float(np.mean(v)) for k, v in d.items()} if all(d.values()) else None


class AttentionTotals:
    """Running sums of mass / entropy / sink over text rows, per layer and head, across documents."""

    def __init__(self, layers: list[int], n_heads: int):
        self.layers, self.n_heads = list(layers), n_heads
        self.sums = {k: np.zeros((len(layers), n_heads)) for k in ("mass", "entropy", "sink")}
        self.rows = 0
        self.by_kind: dict[str, AttentionTotals] = {}

    def add(self, att: DocAttention, kind: str | None = None) -> None:
        keep = att.stat_rows
        for i, l in enumerate(self.layers):
            r = att.per_layer[l]
            self.sums["mass"][i] += r.mass_HR[:, keep].sum(1).numpy()
            self.sums["entropy"][i] += r.entropy_HR[:, keep].sum(1).numpy()
            self.sums["sink"][i] += r.sink_HR[:, keep].sum(1).numpy()
        self.rows += int(keep.sum())
        if kind is not None:
            self.by_kind.setdefault(kind, AttentionTotals(self.layers, self.n_heads)).add(att)

    def means(self) -> dict[str, np.ndarray]:
        """(L, H) means over rows."""
        return {k: v / max(self.rows, 1) for k, v in self.sums.items()}

    def per_layer(self) -> dict:
        return {"rows": self.rows, **{m: {str(l): float(v[i].mean()) for i, l in enumerate(self.layers)}
                                      for m, v in self.means().items()}}

    def to_dict(self) -> dict:
        out: dict = {"rows": self.rows}
        for k, v in self.means().items():
            out[k] = {"per_layer": {str(l): float(v[i].mean()) for i, l in enumerate(self.layers)},
                      "per_layer_head": {str(l): [float(x) for x in v[i]] for i, l in enumerate(self.layers)}}
        if self.by_kind:
            out["by_kind"] = {k: t.per_layer() for k, t in sorted(self.by_kind.items())}
        return out


def token_records(att: DocAttention) -> list[dict]:
    """Per recomputed text row: the token, the medium it is about, mass per layer (head mean) and
    mass per medium (head mean, per layer)."""
    doc, out = att.doc, []
    for i, pos in enumerate(att.rows):
        if not att.stat_rows[i]:
            continue
        w = doc.word_at(int(pos))
        out.append({
            "pos": int(pos), "token": doc.token_strs[pos], "word": w.text if w else None,
            "medium": doc.target_medium(int(pos)),
            "mass": {str(l): float(att.per_layer[l].mass_HR[:, i].mean()) for l in att.layers},
            "mass_per_medium": {str(l): [float(x) for x in att.medium_mass(l, int(pos)).mean(0)]
                                for l in att.layers} if att.has_maps([int(pos)]) else None,
        })
    return out


class Grounding:
    """Accumulates documents: attention statistics (mass / entropy / sink) and pointing-game trials
    for both query rows. `to_dict()` is the metrics.json content shared by the CLI's modes."""

    QUERIES = ("token", "predictor")

    def __init__(self, layers: list[int], n_heads: int, heads: list[int] | None = None):
        self.layers, self.heads = list(layers), heads
        self.totals = AttentionTotals(layers, n_heads)
        self.trials: dict[str, list[Trial]] = {q: [] for q in self.QUERIES}
        self.kinds: dict[str, int] = defaultdict(int)

    def add(self, att: DocAttention) -> dict[str, list[Trial]]:
        self.totals.add(att, att.doc.kind)
        self.kinds[att.doc.kind] += 1
        new = {q: pointing_trials(att, q, self.heads) for q in self.QUERIES}
        for q, ts in new.items():
            self.trials[q] += ts
        return new

    def headline(self, query: str = "token") -> dict:
        """Colour and shape words: accuracy of the mean map over layers, best layer, chance levels."""
        s = summarize_trials(self.trials[query], self.layers)
        out = {}
        for cat in ("colour", "shape"):
            if cat in s:
                best = max(s[cat]["accuracy"], key=s[cat]["accuracy"].get)
                out[cat] = {"n": s[cat]["n"], "accuracy": s[cat]["accuracy_mean_layers"],
                            "best_layer": int(best), "best_layer_accuracy": s[cat]["accuracy"][best],
                            "chance": s[cat]["chance"], "chance_cell": s[cat]["chance_cell"]}
        return out

    def to_dict(self, per_token: bool = False) -> dict:
        pg = {}
        for q in self.QUERIES:
            pg[q] = {"summary": summarize_trials(self.trials[q], self.layers)}
            if per_token:
                pg[q]["per_token"] = [t.to_dict() for t in self.trials[q]]
        return {"documents": dict(self.kinds), "attention": self.totals.to_dict(),
                "headline": self.headline(), "pointing_game": pg}
