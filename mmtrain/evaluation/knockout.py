"""Knockout faithfulness: does a map show where the model reads? Mask the visual keys the map
ranks first, in every layer and for every query (the decoder's `knockout_BS`,
models/attention/knockout.py: a mask, so the input stays in distribution), and measure the drop
in the word's log-probability.

For a word and an order of its medium's V visual tokens (most important first):
  deletion   the top k of V knocked out, k = ceil-free round(f * V) >= 1 for f in FRACS;
  insertion  every token of the medium knocked out except the top k.
Conditions are batch rows of one forward (the medium is encoded once; the document is cut after
the word: what a position computes depends only on its document up to it). Curves are
log-probabilities; the AUCs are trapezoids over f in [0, max FRACS], divided by its width:
  deletion AUC  = mean drop  full - lp(f)               (higher: the order finds what it reads)
  insertion AUC = mean gain  lp_ins(f) - lp(all masked)  (higher: the top tokens carry it)
Controls: random orders (`draws` of them, deletion), the box oracle (tokens inside the object's box
first). A video word also gets one temporal slice knocked out at a time (the frames it relied on).

Legend: B batch rows (conditions), S tokens, V visual tokens of the medium, F fractions, N draws,
Q visual tokens of the (cut) document, D decoder dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from mmtrain.data_pipelines.batch import TEXT
from mmtrain.data_pipelines.packing import assemble

from .attribution import WordSpan, default_method, doc_attributions, word_logprob

Tensor = torch.Tensor
FRACS = (0.05, 0.10, 0.20, 0.40)
CHUNK = 128  # conditions per forward


def top_counts(V: int, fracs=FRACS) -> list[int]:
    return [min(V, max(1, round(f * V))) for f in fracs]


def order_of(map_V: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Tokens by decreasing map value, ties in random order (a flat map is a random order)."""
    perm = rng.permutation(len(map_V))
    return perm[np.argsort(-np.asarray(map_V)[perm], kind="stable")]


@torch.no_grad()
def encode_media(model, inputs: dict[str, Tensor]) -> Tensor:
    """(Q, D) every medium of the document, as the decoder receives them."""
    return model.vision(inputs["patches_NP"], inputs["grid_thw_M3"])


@dataclass
class Prepared:
    """One word's document, cut after the word, with its visual tokens encoded once."""

    inputs: dict[str, Tensor]  # the decoder's inputs (one row)
    visual_QD: Tensor
    word: WordSpan

    @classmethod
    @torch.no_grad()
    def of(cls, model, inputs: dict[str, Tensor], word: WordSpan,
           visual_QD: Tensor | None = None) -> Prepared:
        """visual_QD: the whole document's encoded media (`encode_media`), when already at hand."""
        if visual_QD is None:
            visual_QD = encode_media(model, inputs)
        names = ("tokens_BS", "pos_ids_3BS", "doc_ids_BS", "span_ids_BS", "modality_BS")
        cut = {k: inputs[k][..., :word.end] for k in names}
        n_vis = int((cut["modality_BS"] != TEXT).sum())  # media after the word are cut away
        return cls(cut, visual_QD[:n_vis], word)


@torch.no_grad()
def knocked_logprobs(model, p: Prepared, knock_BV: np.ndarray) -> np.ndarray:
    """(B,) the word's log-probability with the medium's tokens knock_BV (bool) knocked out."""
    S, w = p.inputs["tokens_BS"].shape[1], p.word
    dev = p.visual_QD.device
    out = []
    for b0 in range(0, len(knock_BV), CHUNK):
        kv_BV = torch.as_tensor(knock_BV[b0:b0 + CHUNK], device=dev)
        n = kv_BV.shape[0]
        knock_BS = torch.zeros(n, S, dtype=torch.bool, device=dev)
        knock_BS[:, w.vis0:w.vis0 + w.n_vis] = kv_BV
        rows = {k: v.expand(*v.shape[:-2], n, S) for k, v in p.inputs.items()}
        o = model.decoder(rows["tokens_BS"], rows["pos_ids_3BS"], rows["doc_ids_BS"], rows["span_ids_BS"],
                          rows["modality_BS"], p.visual_QD.repeat(n, 1), knockout_BS=knock_BS)
        out.append(word_logprob(model, o.hidden_BSD, rows["tokens_BS"], w).double().cpu())
    return torch.cat(out).numpy()


def order_masks(order_V: np.ndarray, V: int, fracs=FRACS) -> np.ndarray:
    """(2F, V) deletion masks (top k knocked) then insertion masks (all but the top k knocked)."""
    dele = np.zeros((len(fracs), V), bool)
    for i, k in enumerate(top_counts(V, fracs)):
        dele[i, order_V[:k]] = True
    return np.concatenate([dele, ~dele])


@dataclass
class WordCurves:
    """Log-probabilities of one word under every condition (F fractions)."""

    full: float  # nothing knocked out
    empty: float  # the whole medium knocked out
    deletion: dict[str, np.ndarray] = field(default_factory=dict)  # order -> (F,)
    insertion: dict[str, np.ndarray] = field(default_factory=dict)
    random_del: np.ndarray | None = None  # (N, F)
    slices: np.ndarray | None = None  # video: (t,) with one temporal slice knocked out

    def to_dict(self) -> dict:
        f = lambda a: None if a is None else np.round(np.asarray(a, float), 5).tolist()  # noqa: E731
        return {"full": self.full, "empty": self.empty,
                "deletion": {k: f(v) for k, v in self.deletion.items()},
                "insertion": {k: f(v) for k, v in self.insertion.items()},
                "random_deletion_mean": f(None if self.random_del is None else self.random_del.mean(0)),
                "slices": f(self.slices)}


def run_word(model, p: Prepared, orders: dict[str, np.ndarray], draws: int, rng: np.random.Generator,
             slices_V: np.ndarray | None = None, insertion: bool = True) -> WordCurves:
    """Every condition of one word in batched forwards: full, empty, each order's deletion (and
    insertion), `draws` random orders (deletion), and for a video one knocked slice at a time
    (slices_V: the temporal slice of every token)."""
    V, F = p.word.n_vis, len(FRACS)
    named = list(orders)
    masks = [np.zeros((1, V), bool), np.ones((1, V), bool)]
    masks += [order_masks(orders[k], V)[:2 * F if insertion else F] for k in named]
    masks += [order_masks(rng.permutation(V), V)[:F] for _ in range(draws)]
    if slices_V is not None:
        masks.append(slices_V[None] == np.arange(slices_V.max() + 1)[:, None])
    lp = knocked_logprobs(model, p, np.concatenate(masks))
    c = WordCurves(float(lp[0]), float(lp[1]))
    i = 2
    for k in named:
        c.deletion[k] = lp[i:i + F]
        if insertion:
            c.insertion[k] = lp[i + F:i + 2 * F]
        i += 2 * F if insertion else F
    c.random_del = lp[i:i + draws * F].reshape(draws, F)
    i += draws * F
    if slices_V is not None:
        c.slices = lp[i:]
    return c


def deletion_auc(full: float, lp_F: np.ndarray, fracs=FRACS) -> float:
    """Mean drop over f in [0, max]: trapezoid of full - lp(f), from 0 at f = 0."""
    x = np.array([0.0, *fracs])
    y = np.concatenate([[0.0], full - np.asarray(lp_F)])
    return float(np.trapezoid(y, x) / x[-1])


def insertion_auc(empty: float, lp_F: np.ndarray, fracs=FRACS) -> float:
    """Mean gain over f in [0, max]: trapezoid of lp_ins(f) - empty, from 0 at f = 0."""
    return -deletion_auc(empty, lp_F, fracs)


def excess_z(num_W: np.ndarray, den_WN: np.ndarray) -> float:
    """How far the order's mean deletion AUC lies above the random orders', in standard deviations of
    the random orders' mean over words (one value per draw): ~N(0, 1) for an order no better than
    random, whatever the scale (a ratio is unstable where random deletion costs ~0)."""
    per_draw_N = den_WN.mean(0)
    return float((num_W.mean() - per_draw_N.mean()) / max(per_draw_N.std(ddof=1), 1e-12))


def ratio_interval(num_W: np.ndarray, den_WN: np.ndarray, rng: np.random.Generator, n_boot: int = 1000
                   ) -> tuple[float, float, float]:
    """sum(num) / sum(mean over draws of den) with a 95% bootstrap interval (words and draws
    resampled). A ratio whose denominator is not positive (random deletion costs nothing) is NaN."""
    W, N = den_WN.shape
    idx = rng.integers(0, W, (n_boot, W))
    d_idx = rng.integers(0, N, (n_boot, N))
    num_b = np.array([num_W.sum(), *(num_W[i].sum() for i in idx)])
    den_b = np.array([den_WN.mean(1).sum(), *(den_WN[i][:, j].mean(1).sum() for i, j in zip(idx, d_idx))])
    ratio_b = np.where(den_b > 0, num_b / np.where(den_b > 0, den_b, 1), np.nan)
    lo, hi = np.percentile(ratio_b[1:], [2.5, 97.5]) if not np.isnan(ratio_b[1:]).any() else (np.nan, np.nan)
    return float(ratio_b[0]), float(lo), float(hi)


def grounding_faithfulness(model, docs, device, n_words: int, draws: int, seed: int = 0) -> dict:
    """The training diagnostics' number: the default method's deletion AUC over random orders' on
    the first n_words words of the pointing game's documents (pointing.GroundingDoc), model in eval
    mode (unwrapped). {} without words, under tensor parallelism (the taps would see this rank's
    heads only) and with sharded weights (FSDP: its pieces run outside the root's forward, where the
    parameters are shards; the pipeline's replica and one process measure it)."""
    dec = model.cfg.decoder
    if any(layer.attn.n_heads != dec.n_heads for layer in model.decoder.layers):
        return {}
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return {}
    rng = np.random.default_rng(seed)
    method = default_method(dec.n_layers)
    num, den = [], []
    patch_dim = model.cfg.vision.patch_dim
    for d in docs:
        n_vis = int(np.prod(d.grid_thw))
        spans = [WordSpan(a, e, d.start, n_vis) for a, e, _, _ in d.words][:n_words - len(num)]
        if not spans:
            break
        inputs = {k: v.to(device) for k, v in assemble([[d.document]], len(d.document), 0, patch_dim)
                  .model_inputs().items()}
        visual_QD = encode_media(model, inputs)
        for w, maps in zip(spans, doc_attributions(model, inputs, spans)):
            c = run_word(model, Prepared.of(model, inputs, w, visual_QD),
                         {"map": order_of(maps[method], rng)}, draws, rng, insertion=False)
            num.append(deletion_auc(c.full, c.deletion["map"]))
            den.append([deletion_auc(c.full, r) for r in c.random_del])
    if not num:
        return {}
    ratio, lo, hi = ratio_interval(np.array(num), np.array(den), rng)
    z = excess_z(np.array(num), np.array(den))
    # None where undefined (a random order's AUC <= 0): the record is JSON and checkpointed history
    return {"method": method, "words": len(num), "deletion_ratio": _finite(ratio),
            "deletion_ratio_95": [_finite(lo), _finite(hi)], "deletion_z": _finite(z)}


def _finite(x) -> float | None:
    return float(x) if np.isfinite(x) else None
