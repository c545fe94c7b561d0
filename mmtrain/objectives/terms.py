"""Per-modality losses: each a per-token mean over the trained tokens of one task.

Legend: B rows, S sequence, V vocabulary, R rows taken, N patches, M media, T tokens (in
`visual_next_loss`: K visual tokens with a next-token target, T target values each). Tasks
(data_pipelines.batch): text-only documents, documents with images (image_text), documents with
video (video_text).

Token reliance weighting (`loss.token_weighting`): within a media task, a caption token's
cross-entropy is weighted by how much the pixels help predict it -- its loss with every medium
blanked minus its loss with the real media -- so the tokens that need the image carry the gradient.

Next visual token prediction (`loss.visual_next`): the MSE of the visual head's pixels against the
next merged token's of the same medium (models/visual_next.py says which).

Batch helpers the losses and their callers share: `take_rows` (a row subset with its media),
`cat_rows` (two batches' rows in one forward: the mismatch contrast's), `blank_media` (every medium a
flat grey: the reliance gap's and token weighting's blank pass) and `dummy_batch` (one row of padding
that adds nothing to any sum: a rank short of batches forwards it when forwards are collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    TASK_IMAGE_TEXT,
    TASK_NAMES,
    TASK_PAD,
    TASK_VIDEO_TEXT,
    PackedBatch,
)
from mmtrain.models.visual_next import next_targets

MEDIA_TASK_IDS = (TASK_IMAGE_TEXT, TASK_VIDEO_TEXT)


@dataclass
class TaskLosses:
    """Summed loss, correct predictions and token counts per task (for exact means across batches)."""

    loss_sum: dict[str, torch.Tensor]
    correct: dict[str, torch.Tensor]
    count: dict[str, torch.Tensor]
    ce_BS: torch.Tensor | None = None  # per-token cross-entropy (with its graph): for `reweighted`

    def mean(self, task: str) -> torch.Tensor:
        return self.loss_sum[task] / self.count[task].clamp(min=1)


def token_losses(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per position in fp32; 0 where the label is IGNORE_INDEX."""
    ce_BS = F.cross_entropy(
        logits_BSV.float().flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce_BS.view_as(labels_BS)


def task_losses(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, task_BS: torch.Tensor) -> TaskLosses:
    """From full logits (evaluation, diagnostics, the objective's reference path)."""
    with torch.no_grad():
        hit_BS = (logits_BSV.argmax(-1) == labels_BS) & (labels_BS != IGNORE_INDEX)
    return task_sums(token_losses(logits_BSV, labels_BS), hit_BS, labels_BS, task_BS)


def task_sums(ce_BS: torch.Tensor, hit_BS: torch.Tensor, labels_BS: torch.Tensor,
              task_BS: torch.Tensor) -> TaskLosses:
    """Per-task sums of per-token CE (with its graph) and hits, and trained-token counts: tensors,
    no host sync."""
    trained_BS = labels_BS != IGNORE_INDEX
    sums, correct, counts = {}, {}, {}
    for task_id, name in enumerate(TASK_NAMES):
        sel_BS = trained_BS & (task_BS == task_id)
        sums[name] = (ce_BS * sel_BS).sum()
        correct[name] = (hit_BS & sel_BS).sum()
        counts[name] = sel_BS.sum()
    return TaskLosses(sums, correct, counts, ce_BS)


def reweighted(losses: TaskLosses, weights_BS: torch.Tensor, labels_BS: torch.Tensor,
               task_BS: torch.Tensor) -> TaskLosses:
    """`losses` with each task's loss_sum = sum(w * ce) over its trained tokens; counts (so the
    divisor of the mean) and hits unchanged. Needs `losses.ce_BS` (from task_losses)."""
    trained_BS = labels_BS != IGNORE_INDEX
    wce_BS = losses.ce_BS * weights_BS
    sums = {name: (wce_BS * (trained_BS & (task_BS == task_id))).sum()
            for task_id, name in enumerate(TASK_NAMES)}
    return replace(losses, loss_sum=sums)


def visual_next_loss(pred_KT: torch.Tensor, patches_NP: torch.Tensor, grid_thw_M3: torch.Tensor,
                     merge: int, normalize: bool, keep_K: torch.Tensor | None = None,
                     count: int | torch.Tensor | None = None) -> torch.Tensor:
    """fp32 MSE of the visual head's pixels (`ModelOutput.visual_next_KT`) against the next tokens'
    (models/visual_next.py), mean over the predicted tokens and their values. No token with a
    target (no media, or one-token media): 0, still tied to the head (DDP wants its gradient).
    `keep_K` (context parallelism: the pairs in this rank's chunk, `visual_next.chunk_pairs`): the
    squared errors of those tokens. `count`: the divisor (default the targets' K x T): the global
    batch's K x T (`target_count`, summed over data-parallel ranks), so the ranks' terms add up."""
    target_KT = next_targets(patches_NP, grid_thw_M3, merge, normalize)
    count = max(target_KT.numel(), 1) if count is None else count
    if keep_K is not None:
        target_KT = target_KT[keep_K.to(target_KT.device)]
    return (pred_KT.float() - target_KT).square().sum() / count


def media_tokens(labels_BS: torch.Tensor, task_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: trained tokens of the media tasks (the ones token weighting reweights)."""
    return (labels_BS != IGNORE_INDEX) & ((task_BS == TASK_IMAGE_TEXT) | (task_BS == TASK_VIDEO_TEXT))


def _reliance(ce_real_BS: torch.Tensor, ce_blank_BS: torch.Tensor, floor: float) -> torch.Tensor:
    return (ce_blank_BS.float() - ce_real_BS.float()).clamp(min=0) + floor


@torch.no_grad()
def reliance_sums(ce_real_BS: torch.Tensor, ce_blank_BS: torch.Tensor, labels_BS: torch.Tensor,
                  task_BS: torch.Tensor, floor: float) -> torch.Tensor:
    """(2, media tasks) float64: per media task, the sum of r (`reliance_weights`) over its trained
    tokens and their count (float64 keeps the counts exact)."""
    r_BS, trained_BS = _reliance(ce_real_BS, ce_blank_BS, floor), labels_BS != IGNORE_INDEX
    sels = [trained_BS & (task_BS == task_id) for task_id in MEDIA_TASK_IDS]  # (B, S) each
    r_BS = r_BS.double()  # summed in float64: a row's chunks (cp / tp) and parts add in any order
    return torch.stack([torch.stack([(r_BS * sel_BS).sum() for sel_BS in sels]),
                        torch.stack([sel_BS.sum() for sel_BS in sels]).double()])


@torch.no_grad()
def reliance_weights(ce_real_BS: torch.Tensor, ce_blank_BS: torch.Tensor, labels_BS: torch.Tensor,
                     task_BS: torch.Tensor, strength: float, floor: float,
                     totals: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S) fp32 loss weights: 1 except on the media tasks' trained tokens, where
    w = (1 - strength) + strength * r / mean_task(r), r = max(ce_blank - ce_real, 0) + floor.

    The mean is over the task's trained tokens here, so each task's weights average 1 and
    its loss keeps its scale; `floor` (nats, > 0) keeps a token the pixels do not help from
    dropping out, and makes equal deltas give weights of 1. `totals`: every task's sum of r and
    token count (`reliance_sums`) over the global batch, given (a distributed run's, summed over
    the ranks: chunks of a cp / tp group, data ranks, a pipeline's row parts); default these rows'.
    """
    r_BS, trained_BS = _reliance(ce_real_BS, ce_blank_BS, floor), labels_BS != IGNORE_INDEX
    sels = [trained_BS & (task_BS == task_id) for task_id in MEDIA_TASK_IDS]  # (B, S) each
    if totals is None:
        totals = reliance_sums(ce_real_BS, ce_blank_BS, labels_BS, task_BS, floor)
    r_sums, counts = totals[0].to(r_BS.dtype), totals[1].long()
    w_BS = torch.ones_like(r_BS)
    for sel_BS, r_sum, n in zip(sels, r_sums, counts):
        w_BS = torch.where(sel_BS, (1 - strength) + strength * r_BS / (r_sum / n.clamp(min=1)), w_BS)
    return w_BS


@torch.no_grad()
def reliance_stats(ce_real_BS: torch.Tensor, ce_blank_BS: torch.Tensor, weights_BS: torch.Tensor,
                   labels_BS: torch.Tensor, task_BS: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for the log, over the media tasks' trained tokens: tokens, delta (sum of
    max(ce_blank - ce_real, 0)), top / top_n (sum and count of the top-decile weights)."""
    sel_BS = media_tokens(labels_BS, task_BS)
    w_T = weights_BS[sel_BS]
    k = math.ceil(w_T.numel() / 10)
    return {"tokens": sel_BS.sum(), "delta": (ce_blank_BS - ce_real_BS).clamp(min=0)[sel_BS].sum(),
            "top": w_T.topk(k).values.sum(), "top_n": torch.tensor(k)}


def row_media(batch: PackedBatch, rows_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_M, keep_N) bool: the media the rows `rows_R` name, and those media's patches."""
    media_ids_RS = batch.media_ids_BS[rows_R].long()
    keep_M = torch.zeros(batch.media_kind_M.shape[0], dtype=torch.bool, device=media_ids_RS.device)
    keep_M[media_ids_RS[media_ids_RS >= 0]] = True
    keep_N = keep_M.repeat_interleave(batch.grid_thw_M3.prod(-1), output_size=batch.patches_NP.shape[0])
    return keep_M, keep_N


def take_rows(batch: PackedBatch, rows_R: torch.Tensor) -> PackedBatch:
    """The batch of rows `rows_R` (ascending) with their media: patches, grids and kinds of the media
    those rows' placeholders name, renumbered 0..M'-1 in the same row-major order. Documents never
    cross rows or attend into each other, so the rows' outputs equal those of the whole batch."""
    media_ids_RS = batch.media_ids_BS[rows_R].long()
    keep_M, keep_N = row_media(batch, rows_R)
    new_id_M = keep_M.long().cumsum(0) - 1
    renumbered_RS = (torch.where(media_ids_RS >= 0, new_id_M[media_ids_RS.clamp(min=0)], -1)
                     if len(new_id_M) else media_ids_RS)  # a batch without media: all -1 already
    return PackedBatch(
        tokens_BS=batch.tokens_BS[rows_R], labels_BS=batch.labels_BS[rows_R],
        doc_ids_BS=batch.doc_ids_BS[rows_R], span_ids_BS=batch.span_ids_BS[rows_R],
        modality_BS=batch.modality_BS[rows_R], task_BS=batch.task_BS[rows_R],
        pos_ids_3BS=batch.pos_ids_3BS[:, rows_R], media_ids_BS=renumbered_RS.to(batch.media_ids_BS.dtype),
        patches_NP=batch.patches_NP[keep_N], grid_thw_M3=batch.grid_thw_M3[keep_M],
        media_kind_M=batch.media_kind_M[keep_M],
    )


def cat_rows(first: PackedBatch, second: PackedBatch) -> PackedBatch:
    """`first`'s rows then `second`'s (same row length), media in the same order: the placeholders
    of every row are filled row-major, so `second`'s media follow `first`'s and its ids shift by M."""
    shift = first.media_kind_M.shape[0]
    media_ids_BS = torch.where(second.media_ids_BS >= 0, second.media_ids_BS + shift, second.media_ids_BS)
    rows = {name: torch.cat([getattr(first, name), getattr(second, name)])
            for name in ("tokens_BS", "labels_BS", "doc_ids_BS", "span_ids_BS", "modality_BS", "task_BS",
                         "patches_NP", "grid_thw_M3", "media_kind_M")}
    return PackedBatch(**rows, pos_ids_3BS=torch.cat([first.pos_ids_3BS, second.pos_ids_3BS], 1),
                       media_ids_BS=torch.cat([first.media_ids_BS, media_ids_BS]))


def blank_media(batch: PackedBatch) -> PackedBatch:
    return replace(batch, patches_NP=torch.zeros_like(batch.patches_NP))


def dummy_batch(seq_len: int, patch_dim: int) -> PackedBatch:
    """One row of padding: every label ignored, no media (the vision encoder still runs)."""
    S = seq_len
    return PackedBatch(
        tokens_BS=torch.zeros(1, S, dtype=torch.long),
        labels_BS=torch.full((1, S), IGNORE_INDEX, dtype=torch.long),
        doc_ids_BS=torch.full((1, S), -1, dtype=torch.int32),  # padding
        span_ids_BS=torch.full((1, S), -1, dtype=torch.int32),
        modality_BS=torch.zeros(1, S, dtype=torch.int8),
        task_BS=torch.full((1, S), TASK_PAD, dtype=torch.int8),
        pos_ids_3BS=torch.arange(S).expand(3, 1, S).contiguous(),
        media_ids_BS=torch.full((1, S), -1, dtype=torch.int32),
        patches_NP=torch.zeros(0, patch_dim),
        grid_thw_M3=torch.zeros(0, 3, dtype=torch.long),
        media_kind_M=torch.zeros(0, dtype=torch.int8),
    )


def z_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)^2) over trained tokens: keeps logit norms from drifting up."""
    return z_loss_of(torch.logsumexp(logits_BSV.float(), dim=-1), labels_BS)


def z_loss_of(lse_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    trained_BS = labels_BS != IGNORE_INDEX
    return (lse_BS.square() * trained_BS).sum() / trained_BS.sum().clamp(min=1)


def weighted_total(losses: TaskLosses, weights: dict[str, float]) -> torch.Tensor:
    """Sum over tasks of weight * per-token mean. A task without tokens adds an exact 0.0 (its sum
    is 0 over a count clamped to 1): no host sync to ask whether it has any."""
    total = torch.zeros((), device=next(iter(losses.loss_sum.values())).device)
    for name in TASK_NAMES:
        if weights.get(name, 0.0):
            total = total + weights[name] * losses.mean(name)
    return total


def head_grads(hidden_BSD: torch.Tensor, logits_BSV: torch.Tensor | None, labels_BS: torch.Tensor,
               task_BS: torch.Tensor, head_VD: torch.Tensor,
               counts: dict[str, torch.Tensor] | None = None, chunk: int = 0) -> dict[str, torch.Tensor]:
    """Gradient (V, D) of each task's per-token mean cross-entropy wrt the LM head weight, in closed form.

    For GradNorm, whose shared layer is the head (logits = hidden @ head.T, no bias): on the task's T
    trained tokens delta_TV = (softmax(logits) - onehot(label)) / N_task and grad_VD = delta^T @ hidden.
    No autograd and no graph: fp32 under no_grad with autocast off. Costs one extra (T x V) softmax and a
    (V x T) @ (T x D) matmul per step, about the head's weight-gradient matmul again. `logits_BSV`
    None (the chunked loss): the logits of `chunk` selected tokens at a time, from hidden @ head.T.

    `counts` overrides N_task (global token counts in distributed runs, so the all-reduced sum of the
    ranks' grads is the global gradient). Tasks with no tokens (in `counts` when given, else here) are
    left out; with `counts`, a task with none of its tokens on this rank gets zeros, so every rank
    returns the same keys to all-reduce. Host syncs: the counts and the boolean selections.
    """
    V = head_VD.shape[0] if logits_BSV is None else logits_BSV.shape[-1]
    if tuple(head_VD.shape) != (V, hidden_BSD.shape[-1]):
        raise ValueError(f"head_VD: expected shape (V, D) = {(V, hidden_BSD.shape[-1])} "
                         f"(got {tuple(head_VD.shape)})")
    trained_BS = labels_BS != IGNORE_INDEX
    grads = {}
    with torch.no_grad(), torch.autocast(hidden_BSD.device.type, enabled=False):
        for task_id, name in enumerate(TASK_NAMES):
            sel_BS = trained_BS & (task_BS == task_id)
            n = float(counts[name]) if counts is not None else float(sel_BS.sum())
            if n <= 0:
                continue
            if logits_BSV is not None:
                grads[name] = _head_grad(logits_BSV[sel_BS].float(), labels_BS[sel_BS],
                                         hidden_BSD[sel_BS].float(), n)  # zeros when T = 0
                continue
            h_TD, labels_T = hidden_BSD[sel_BS].float(), labels_BS[sel_BS]
            g_VD = torch.zeros(head_VD.shape, device=h_TD.device)
            for lo in range(0, max(len(labels_T), 1), chunk):
                sl = slice(lo, lo + chunk)
                g_VD += _head_grad(h_TD[sl] @ head_VD.float().T, labels_T[sl], h_TD[sl], n)
            grads[name] = g_VD
    return grads


def _head_grad(logits_TV: torch.Tensor, labels_T: torch.Tensor, h_TD: torch.Tensor, n: float) -> torch.Tensor:
    delta_TV = logits_TV.softmax(-1)
    delta_TV[torch.arange(len(labels_T), device=delta_TV.device), labels_T] -= 1.0
    return delta_TV.div_(n).T @ h_TD
