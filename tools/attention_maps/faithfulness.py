"""`mmtrain-attn --faithfulness`: each method's maps judged by knockout (mmtrain/evaluation/knockout.py),
against random orders, the box oracle and insertion; video words also by one temporal slice at a time.

Per scored word (a word naming one boxed object, `metrics.scorable_words`; its predictor rows) the
methods of mmtrain/evaluation/attribution.py give maps over the medium's tokens; every map's order,
`draws` random orders and the oracle order (tokens by the share of their pixels inside the object's
box, per slice for video) are knocked out. Aggregates per method (ratio of sums over words):
  deletion_ratio   deletion AUC / the random orders' (95% bootstrap interval over words and draws);
  deletion_z       (deletion AUC - the random orders') / the spread of the random orders' over draws;
  oracle_ratio     deletion AUC / the box oracle's (NaN where the oracle's is not positive);
  insertion_20     (lp with only the top 20% kept - lp all masked) / (full - all masked);
  insertion_auc    insertion AUC / (full - all masked) (both NaN where the medium is worth <= 0).

Legend: W words, N random draws, F fractions, V visual tokens, t/h/w the medium's merged token grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmtrain.evaluation.attribution import (
    WordSpan,
    default_method,
    doc_attributions,
    heads_map,
    method_names,
    pick_heads,
)
from mmtrain.evaluation.knockout import (
    FRACS,
    Prepared,
    WordCurves,
    deletion_auc,
    encode_media,
    excess_z,
    insertion_auc,
    order_of,
    ratio_interval,
    run_word,
)

from .inputs import DocInputs, MediumInfo
from .metrics import cell_rects, object_mask, scorable_words

ORACLE = "box oracle"


@dataclass
class ScoredWord:
    doc: str
    kind: str  # image / video
    word: str
    category: str
    span: WordSpan
    medium: MediumInfo
    object: int
    maps: dict  # method -> (V,), "per_head" -> (L, H, V)
    inputs: dict  # the document's model inputs (shared by its words)
    prepared: Prepared
    curves: WordCurves | None = None


def doc_words(model, doc: DocInputs, device) -> list[ScoredWord]:
    """The document's scored words with their maps (one forward and a backward per word)."""
    spans, picked = [], []
    for w, obj, cat in scorable_words(doc):
        m = doc.media[w.medium]
        if w.start - 1 < m.start + m.n_tokens:
            continue  # its predictor row cannot see the whole medium
        spans.append(WordSpan(w.start, w.end, m.start, m.n_tokens))
        picked.append((w, obj, cat, m))
    if not spans:
        return []
    inputs = {k: v.to(device) for k, v in doc.batch.model_inputs().items()}
    maps = doc_attributions(model, inputs, spans)
    visual_QD = encode_media(model, inputs)  # once a document; each word's cut keeps what precedes it
    return [ScoredWord(doc.name, m.kind_name, w.text, cat, s, m, obj, mp, inputs,
                       Prepared.of(model, inputs, s, visual_QD))
            for (w, obj, cat, m), s, mp in zip(picked, spans, maps)]


def oracle_order(sw: ScoredWord, rng: np.random.Generator) -> np.ndarray:
    """Tokens by the share of their pixels inside the object's box (per temporal slice), ties random."""
    m = sw.medium
    rects = cell_rects(m).astype(int)
    share = []
    for s in range(m.grid_thw[0]):
        mask = object_mask(m.objects[sw.object], m, s)
        share.append([[mask[y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)].mean() for x0, y0, x1, y1 in row]
                      for row in rects])
    return order_of(np.asarray(share, float).reshape(-1), rng)


def knock_words(model, words: list[ScoredWord], draws: int, rng: np.random.Generator,
                methods: list[str]) -> None:
    for sw in words:
        orders = {k: order_of(sw.maps[k], rng) for k in methods}
        orders[ORACLE] = oracle_order(sw, rng)
        t, h, w = sw.medium.grid_thw
        slices = np.repeat(np.arange(t), h * w) if sw.kind == "video" else None
        sw.curves = run_word(model, sw.prepared, orders, draws, rng, slices)


def summarize(words: list[ScoredWord], methods: list[str], rng: np.random.Generator) -> dict:
    """metrics.json's "faithfulness" (without the sanity check): per method and the controls."""
    cs = [sw.curves for sw in words]
    full_W = np.array([c.full for c in cs])
    gap_W = full_W - np.array([c.empty for c in cs])  # what the whole medium is worth to the word
    rnd_WN = np.array([[deletion_auc(c.full, r) for r in c.random_del] for c in cs])
    oracle_W = np.array([deletion_auc(c.full, c.deletion[ORACLE]) for c in cs])
    out = {"methods": {}, "words": len(words), "draws": int(rnd_WN.shape[1]), "fractions": list(FRACS),
           "medium_gap": float(gap_W.mean()),
           "random": {"deletion_auc": float(rnd_WN.mean()),
                      "deletion_auc_95": [float(x) for x in np.percentile(rnd_WN.mean(0), [2.5, 97.5])],
                      "deletion_curve": _mean_drop(cs, None, full_W),
                      "deletion_curve_95": _random_band(cs, full_W)},
           "oracle": {"deletion_auc": float(oracle_W.mean()),
                      "deletion_curve": _mean_drop(cs, ORACLE, full_W)}}
    # insertion's shares of what the medium is worth: undefined (NaN) where it is worth nothing or
    # less to the words (masking it all helps them: a shuffled model), not a division by ~0
    worth = gap_W.sum() if gap_W.sum() > 0 else float("nan")
    for k in [*methods, ORACLE]:
        del_W = np.array([deletion_auc(c.full, c.deletion[k]) for c in cs])
        ins_W = np.array([insertion_auc(c.empty, c.insertion[k]) for c in cs])
        ratio, lo, hi = ratio_interval(del_W, rnd_WN, rng)
        i20 = FRACS.index(0.20)
        out["methods"][k] = {
            "deletion_auc": float(del_W.mean()), "deletion_ratio": ratio, "deletion_ratio_95": [lo, hi],
            "deletion_z": excess_z(del_W, rnd_WN),
            "oracle_ratio": float(del_W.sum() / oracle_W.sum()) if oracle_W.sum() > 0 else float("nan"),
            "insertion_auc": float(ins_W.sum() / worth),
            "insertion_20": float(sum(c.insertion[k][i20] - c.empty for c in cs) / worth),
            "deletion_curve": _mean_drop(cs, k, full_W),
            "insertion_curve": [float(np.mean([c.insertion[k][i] - c.empty for c in cs]))
                                for i in range(len(FRACS))],
        }
    # by z: defined whatever the sign of the random orders' AUC (a ratio is not, where random
    # deletion raises the word's log-probability)
    ranked = sorted(methods, key=lambda k: -out["methods"][k]["deletion_z"])
    out["best"] = ranked[0]
    out["runner_up"] = ranked[1] if len(ranked) > 1 else None
    out["default"] = default_method(sum(m.startswith("grad L") for m in methods))
    out["video"] = _video(words, out["default"])
    return out


def _mean_drop(cs: list[WordCurves], k: str | None, full_W: np.ndarray) -> list[float]:
    if k is None:
        return [float(np.mean([full - c.random_del[:, i].mean() for c, full in zip(cs, full_W)]))
                for i in range(len(FRACS))]
    return [float(np.mean([full - c.deletion[k][i] for c, full in zip(cs, full_W)]))
            for i in range(len(FRACS))]


def _random_band(cs: list[WordCurves], full_W: np.ndarray) -> list[list[float]]:
    """2.5 and 97.5 percentiles over draws of the mean drop over words, per fraction."""
    drop_NF = np.mean([full - c.random_del for c, full in zip(cs, full_W)], axis=0)
    return np.percentile(drop_NF, [2.5, 97.5], axis=0).tolist()


def _video(words: list[ScoredWord], default: str) -> dict:
    """Which frames each video word relied on: the temporal slice whose knockout drops its
    log-probability most, beside the default map's share per slice."""
    per_word, agree = [], []
    for sw in words:
        if sw.curves is None or sw.curves.slices is None:
            continue
        drop_t = sw.curves.full - sw.curves.slices
        t = sw.medium.grid_thw[0]
        share_t = sw.maps[default].reshape(t, -1).sum(1)
        share_t = share_t / max(share_t.sum(), 1e-12)
        s = int(np.argmax(drop_t))
        m = sw.medium
        frames = [m.source_frames[f] if m.source_frames else f for f in m.slice_frames[s]]
        per_word.append({"doc": sw.doc, "word": sw.word, "slice_drop": np.round(drop_t, 4).tolist(),
                         "relied_slice": s, "relied_frames": frames,
                         "map_slice_share": np.round(share_t, 4).tolist()})
        agree.append(int(np.argmax(share_t)) == s)
    return {"words": len(per_word), "map_top_slice_agrees": float(np.mean(agree)) if agree else None,
            "per_word": per_word}


def evaluate(model, docs_words: list[ScoredWord], draws: int, seed: int = 0) -> dict:
    """Pick the localisation heads over all words, knock out every word, summarise."""
    rng = np.random.default_rng(seed)
    heads = pick_heads([sw.maps["per_head"] for sw in docs_words])
    for sw in docs_words:
        sw.maps["heads"] = heads_map(sw.maps["per_head"], heads)
    methods = method_names(model.cfg.decoder.n_layers)
    knock_words(model, docs_words, draws, rng, methods)
    out = summarize(docs_words, methods, rng)
    out["heads"] = [f"L{l}H{h}" for l, h in heads]
    return out
