"""Per-modality losses: each a per-token mean over the trained tokens of one task.

Legend: B rows, S sequence, V vocabulary. Tasks (data_pipelines.batch): text-only documents,
documents with images (image_text), documents with video (video_text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_pipelines.batch import IGNORE_INDEX, TASK_NAMES


@dataclass
class TaskLosses:
    """Summed loss, correct predictions and token counts per task (for exact means across batches)."""

    loss_sum: dict[str, torch.Tensor]
    correct: dict[str, torch.Tensor]
    count: dict[str, torch.Tensor]

    def mean(self, task: str) -> torch.Tensor:
        return self.loss_sum[task] / self.count[task].clamp(min=1)


def token_losses(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per position in fp32; 0 where the label is IGNORE_INDEX."""
    ce_BS = F.cross_entropy(
        logits_BSV.float().flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce_BS.view_as(labels_BS)


def task_losses(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, task_BS: torch.Tensor) -> TaskLosses:
    ce_BS = token_losses(logits_BSV, labels_BS)
    trained_BS = labels_BS != IGNORE_INDEX
    with torch.no_grad():
        hit_BS = (logits_BSV.argmax(-1) == labels_BS) & trained_BS
    sums, correct, counts = {}, {}, {}
    for task_id, name in enumerate(TASK_NAMES):
        sel_BS = trained_BS & (task_BS == task_id)
        sums[name] = (ce_BS * sel_BS).sum()
        correct[name] = (hit_BS & sel_BS).sum()
        counts[name] = sel_BS.sum()
    return TaskLosses(sums, correct, counts)


def z_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)^2) over trained tokens: keeps logit norms from drifting up."""
    trained_BS = labels_BS != IGNORE_INDEX
    lse_BS = torch.logsumexp(logits_BSV.float(), dim=-1)
    return (lse_BS.square() * trained_BS).sum() / trained_BS.sum().clamp(min=1)


def weighted_total(losses: TaskLosses, weights: dict[str, float]) -> torch.Tensor:
    """Sum over tasks present in the batch of weight * per-token mean."""
    total = torch.zeros((), device=next(iter(losses.loss_sum.values())).device)
    for name in TASK_NAMES:
        if weights.get(name, 0.0) and int(losses.count[name]) > 0:
            total = total + weights[name] * losses.mean(name)
    return total
