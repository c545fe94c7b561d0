"""Linear probes of the vision encoder: does the ViT *see* an object's colour, shape and size?

Each val image whose key.json has objects with boxes (`probe_media`) is encoded once; per object,
the merged visual tokens are pooled over its box (each token weighted by the area its pixel
rectangle shares with the box) and a multinomial logistic regression per attribute (colour, shape,
size) is fitted on the objects of two of every three images and scored on the third's. Three
feature sets, the same pooling and probe: `vit` (the projected tokens the decoder reads), `vit_pre`
(the merged ViT features before the projector) and `pixels` (each token's raw patches, the ViT's
input: the reference a ViT that keeps the attribute should reach); `chance` predicts the training
objects' majority class. High `vit` with a low caption/mismatch gap: the decoder does not read what
the ViT sees; `vit` near chance with `pixels` high: the ViT does not see it.

Deterministic (fixed split, zero init, a fixed number of full-batch L-BFGS steps in float64 on
CPU); no random numbers. Every rank runs it alike (the forward is collective under FSDP).

Legend: B rows, M media, N patches, P patch dim, Q merged tokens, F features, O objects, C classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.decode import IMAGE_EXTS
from mmtrain.data_pipelines.documents import Document, build_documents
from mmtrain.data_pipelines.packing import assemble
from mmtrain.data_pipelines.shards import RawSample
from mmtrain.data_pipelines.tokenizer import Tokenizer
from mmtrain.evaluation.pointing import CATEGORY, Box, box_objects, cell_rects, first_val
from mmtrain.inference.prompts import Prompt, sample_prompt
from mmtrain.models.vision import patch_layout

Tensor = torch.Tensor
ATTRIBUTES = ("colour", "shape", "size")
FEATURES = ("vit", "vit_pre", "pixels")
HELD_OUT_EVERY = 3  # media i with i % 3 == 2 are held out
L2 = 1e-2  # on z-scored features: mean cross-entropy + L2 * |W|^2
STEPS = 50  # L-BFGS iterations at most (one full-batch step call; ~40 converge on tiny)


@dataclass
class ProbeMedium:
    name: str
    document: Document  # the training document: the image, then its caption
    grid_hw: tuple[int, int]  # merged token grid
    orig_hw: tuple[int, int]
    objects: list[tuple[dict[str, str], Box]]  # attribute -> value, box in original pixels


def probe_media(cfg: DataConfig, tok: Tokenizer, n: int, scan: int = 2000) -> list[ProbeMedium]:
    """The first n val images (of the first `scan` val samples) whose key.json has objects with boxes."""

    def make(raw: RawSample) -> ProbeMedium | None:
        if "json" not in raw.members or not any(e in raw.members for e in IMAGE_EXTS):
            return None  # decode images only
        return _medium(sample_prompt(raw, cfg.media), tok, cfg)

    return first_val(cfg, n, scan, make)


def _medium(p: Prompt, tok: Tokenizer, cfg: DataConfig) -> ProbeMedium | None:
    objects = [({CATEGORY[f]: v for f, v in attrs.items()}, boxes[0]) for attrs, boxes in box_objects(p.meta)]
    if p.kind != "image" or not objects:
        return None
    (doc,) = build_documents("image", [*p.segments, p.reference or ""], tok, cfg)
    _, h, w = doc.media[0].grid_thw
    merge = cfg.media.merge
    return ProbeMedium(p.name, doc, (h // merge, w // merge), p.segments[0].hw, objects)


@torch.no_grad()
def probe_scores(model: nn.Module, media: list[ProbeMedium], device: torch.device, raw_model: nn.Module,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> dict[str, dict]:
    """{attribute: {"vit", "vit_pre", "pixels", "chance": held-out accuracy, "n": objects,
    "held_out": objects}} for `model` (wrapped or not, eval mode) and its unwrapped `raw_model`."""
    if not media:
        return {}
    vision = raw_model.cfg.vision
    S = max(len(m.document) for m in media)
    batch = assemble([[m.document] for m in media], S, 0, vision.patch_dim).to(device)
    captured: dict[str, Tensor] = {}

    def before(_module, args, _out):
        captured["vit_pre"] = args[0]

    def after(_module, _args, out_QD):  # the encoder's output (after vision.out_norm, when on)
        captured["vit"] = out_QD

    handles = [raw_model.vision.projector.register_forward_hook(before),
               raw_model.vision.register_forward_hook(after)]
    try:
        with autocast():
            model(**batch.model_inputs(), compute_logits=False)
    finally:
        for handle in handles:
            handle.remove()
    captured["pixels"] = pixel_features(batch.patches_NP, batch.grid_thw_M3, vision.merge, vision.in_channels)
    return score_features(captured, media)


def pixel_features(patches_NP: Tensor, grid_thw_M3: Tensor, merge: int, channels: int) -> Tensor:
    """(Q, merge^2 * 2C): per merged token, the mean and std of each channel of each of its patches
    (the ViT's input, summarised), in the encoder's merged token order."""
    _, _, src_N = patch_layout(grid_thw_M3, patches_NP.shape[0], merge)
    x_NCK = patches_NP.index_select(0, src_N).float().unflatten(1, (channels, -1))  # P = C * K
    stats_N2C = torch.stack([x_NCK.mean(2), x_NCK.std(2, correction=0)], 1)
    return stats_N2C.reshape(-1, merge * merge * 2 * channels)


def score_features(features: dict[str, Tensor], media: list[ProbeMedium]) -> dict[str, dict]:
    """Probe each (Q, F) feature set (tokens of `media` in order) per attribute (see the module doc)."""
    weights_OQ, attrs, held_O = _pooling(media)
    pooled = {k: weights_OQ @ f.detach().to("cpu", torch.float64) for k, f in features.items()}
    out = {}
    for attr in ATTRIBUTES:
        has_O = torch.tensor([attr in a for a in attrs], dtype=torch.bool)
        labels = [a[attr] for a in attrs if attr in a]
        held = held_O[has_O]
        if held.all() or not held.any():
            continue
        res = {k: heldout_accuracy(x_OF[has_O], labels, ~held) for k, x_OF in pooled.items()}
        out[attr] = {**res, "chance": majority_accuracy(labels, ~held), "n": len(labels),
                     "held_out": int(held.sum())}
    return out


def _pooling(media: list[ProbeMedium]) -> tuple[Tensor, list[dict[str, str]], Tensor]:
    """(O, Q) pooling weights of every object over all tokens, attributes per object, held-out (O,)."""
    Q = sum(m.grid_hw[0] * m.grid_hw[1] for m in media)
    rows, attrs, held, start = [], [], [], 0
    for i, m in enumerate(media):
        rects_V4 = cell_rects(m.grid_hw, m.orig_hw).reshape(-1, 4)
        for a, box in m.objects:
            w_V = box_weights(rects_V4, box)
            if w_V.sum() > 0:
                row = np.zeros(Q)
                row[start:start + len(w_V)] = w_V / w_V.sum()
                rows.append(row)
                attrs.append(a)
                held.append(i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
        start += len(rects_V4)
    return torch.tensor(np.array(rows).reshape(-1, Q)), attrs, torch.tensor(held, dtype=torch.bool)


def box_weights(rects_V4: np.ndarray, box: Box) -> np.ndarray:
    """(V,) area each token's [x0, y0, x1, y1] rectangle shares with the box."""
    x0, y0, x1, y1 = box
    dx = np.clip(np.minimum(rects_V4[:, 2], x1) - np.maximum(rects_V4[:, 0], x0), 0, None)
    dy = np.clip(np.minimum(rects_V4[:, 3], y1) - np.maximum(rects_V4[:, 1], y0), 0, None)
    return dx * dy


def majority_accuracy(labels: list[str], train_O: Tensor) -> float:
    """Held-out accuracy of always answering the training objects' most common class."""
    train = [y for y, t in zip(labels, train_O.tolist()) if t]
    top = max(sorted(set(train)), key=train.count)
    held = [y for y, t in zip(labels, train_O.tolist()) if not t]
    return sum(y == top for y in held) / len(held)


def heldout_accuracy(x_OF: Tensor, labels: list[str], train_O: Tensor, l2: float = L2,
                     steps: int = STEPS) -> float:
    """Fit an L2-regularised multinomial logistic regression on the `train_O` objects (features
    z-scored with their statistics) and return its accuracy on the others."""
    classes = sorted({y for y, t in zip(labels, train_O.tolist()) if t})
    y_O = torch.tensor([classes.index(y) if y in classes else -1 for y in labels])
    x_OF = x_OF.to(torch.float64)
    mean_F, std_F = x_OF[train_O].mean(0), x_OF[train_O].std(0, correction=0)
    flat_F = std_F <= 1e-9 * (1 + mean_F.abs())  # constant on the training objects: no information
    z_OF = ((x_OF - mean_F) / torch.where(flat_F, 1.0, std_F)).masked_fill(flat_F, 0.0)
    W_FC = torch.zeros(z_OF.shape[1], len(classes), dtype=torch.float64, requires_grad=True)
    b_C = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W_FC, b_C], lr=1, max_iter=steps, tolerance_grad=1e-10,
                            tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")
    z_train, y_train = z_OF[train_O], y_O[train_O]

    def closure() -> Tensor:
        opt.zero_grad()
        logits = z_train @ W_FC + b_C
        loss = torch.nn.functional.cross_entropy(logits, y_train) + l2 * W_FC.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    pred_O = (z_OF[~train_O] @ W_FC + b_C).argmax(1)
    return float((pred_O == y_O[~train_O]).double().mean())
