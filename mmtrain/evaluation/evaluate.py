"""Held-out evaluation: per-modality loss and accuracy, and the visual reliance gap.

The reliance gap of a task is its loss with every medium blanked (patches set to 0, i.e. the
normalisation mean: a flat grey; `terms.blank_media`) minus its loss with the real media. Near
zero means the text ignores the pixels: modality collapse. Blank media are out of distribution;
`mismatch_media` gives the in-distribution counterpart (the diagnostics' mismatch gap): each
document's media swapped for another document's real media of the same kind and patch grid.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from mmtrain.data_pipelines.batch import MEDIA_TASKS, TASK_NAMES, PackedBatch
from mmtrain.objectives.terms import blank_media, task_losses


@dataclass
class EvalResult:
    loss: dict[str, float] = field(default_factory=dict)  # per-token mean, real media
    accuracy: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    blank_loss: dict[str, float] = field(default_factory=dict)  # media blanked (media tasks only)

    @property
    def reliance_gap(self) -> dict[str, float]:
        return {t: self.blank_loss[t] - self.loss[t] for t in self.blank_loss if t in self.loss}

    def scalars(self, prefix: str = "val") -> dict[str, float]:
        out = {f"{prefix}/loss_{k}": v for k, v in self.loss.items()}
        out.update({f"{prefix}/acc_{k}": v for k, v in self.accuracy.items()})
        out.update({f"{prefix}/reliance_gap_{k}": v for k, v in self.reliance_gap.items()})
        return out

    def to_dict(self) -> dict:
        return {"loss": self.loss, "accuracy": self.accuracy, "tokens": self.tokens,
                "blank_loss": self.blank_loss, "reliance_gap": self.reliance_gap}


def mismatch_media(batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """The batch with each document's media replaced by real media of other documents, and the
    (B, S) bool mask of the tokens of the documents that received at least one foreign medium.

    A document is (row, doc id). Media are grouped by (kind, t, h, w), so every patch block keeps its
    size and the token layout (placeholders, positions, spans) is unchanged. Within a group ordered by
    document (then medium index), a medium takes the pixels of the medium n//2 places further on
    (cyclically) when no document holds more than half of the group's n media: a permutation of the
    group's blocks that never pairs two media of one document. Otherwise (one document holds most of
    the group) medium j of the k-th document takes medium j mod n' of the (k+1)-th document (n' its
    media; cyclically): media repeat, but still never come from the own document. A group whose media
    all belong to one document, and a medium without visual tokens, keep their own pixels (and count
    for no document). Deterministic: no random numbers.
    """
    B, S = batch.doc_ids_BS.shape
    M = batch.media_kind_M.shape[0]
    swapped_BS = torch.zeros(B, S, dtype=torch.bool, device=batch.doc_ids_BS.device)
    if M == 0:
        return batch, swapped_BS
    # The document of each medium, from its placeholder tokens: key = row * span + doc id.
    span = int(batch.doc_ids_BS.max().clamp(min=0)) + 2
    row_BS = torch.arange(B, device=swapped_BS.device)[:, None].expand(B, S)
    key_BS = row_BS * span + batch.doc_ids_BS.long()
    visual_BS = (batch.media_ids_BS >= 0) & (batch.doc_ids_BS >= 0)
    doc_M = torch.full((M,), -1, dtype=torch.long, device=key_BS.device)  # -1: no tokens
    doc_M = doc_M.scatter_(0, batch.media_ids_BS[visual_BS].long(), key_BS[visual_BS]).tolist()
    grids = [tuple(g) for g in batch.grid_thw_M3.tolist()]
    kinds = batch.media_kind_M.tolist()
    groups: dict[tuple, list[int]] = {}
    for m in range(M):
        if doc_M[m] >= 0:
            groups.setdefault((kinds[m], *grids[m]), []).append(m)
    source_M = list(range(M))
    for members in groups.values():
        for m, src in _cross_document_sources(members, doc_M).items():
            source_M[m] = src
    moved = [m for m in range(M) if source_M[m] != m]
    if not moved:
        return batch, swapped_BS
    sizes_M = [t * h * w for t, h, w in grids]
    starts_M = [0, *itertools.accumulate(sizes_M)]
    index_N = torch.cat([torch.arange(starts_M[s], starts_M[s] + sizes_M[s]) for s in source_M])
    patches_NP = batch.patches_NP[index_N.to(batch.patches_NP.device)]
    docs = torch.tensor(sorted({doc_M[m] for m in moved}), device=key_BS.device)
    swapped_BS = torch.isin(key_BS, docs) & (batch.doc_ids_BS >= 0)
    return replace(batch, patches_NP=patches_NP), swapped_BS


def _cross_document_sources(members: list[int], doc_M: list[int]) -> dict[int, int]:
    """medium -> the medium whose pixels it takes, within one (kind, grid) group (see mismatch_media)."""
    by_doc: dict[int, list[int]] = {}
    for m in sorted(members, key=lambda m: (doc_M[m], m)):
        by_doc.setdefault(doc_M[m], []).append(m)
    if len(by_doc) < 2:
        return {}
    n, blocks = len(members), list(by_doc.values())
    if max(len(b) for b in blocks) <= n // 2:
        order = [m for b in blocks for m in b]
        return {m: order[(i + n // 2) % n] for i, m in enumerate(order)}
    out = {}
    for k, block in enumerate(blocks):
        donor = blocks[(k + 1) % len(blocks)]
        out.update({m: donor[j % len(donor)] for j, m in enumerate(block)})
    return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[PackedBatch],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> EvalResult:
    """Loss per task with real media, and with blank media for the media tasks."""
    was_training = model.training
    model.eval()
    try:
        real = _accumulate(model, batches, device, autocast, transform=None)
        blank = _accumulate(model, batches, device, autocast, transform=blank_media)
    finally:
        model.train(was_training)
    result = EvalResult()
    for task in TASK_NAMES:
        n = int(real["count"][task])
        if n == 0:
            continue
        result.tokens[task] = n
        result.loss[task] = real["sum"][task] / n
        result.accuracy[task] = real["correct"][task] / n
        if task in MEDIA_TASKS:
            result.blank_loss[task] = blank["sum"][task] / n
    return result


def _accumulate(model, batches, device, autocast, transform) -> dict[str, dict[str, float]]:
    totals = {key: dict.fromkeys(TASK_NAMES, 0.0) for key in ("sum", "correct", "count")}
    for batch in batches:
        if transform is not None:
            batch = transform(batch)
        batch = batch.to(device)
        with autocast():
            out = model(**batch.model_inputs())
        losses = task_losses(out.logits_BSV, batch.labels_BS, batch.task_BS)
        for task in TASK_NAMES:
            totals["sum"][task] += float(losses.loss_sum[task])
            totals["correct"][task] += float(losses.correct[task])
            totals["count"][task] += float(losses.count[task])
    return totals
