"""Per-modality losses: each a per-token mean over the trained tokens of one task.

Legend: B rows, S sequence, V vocabulary. Tasks (data_pipelines.batch): text-only documents,
documents with images (image_text), documents with video (video_text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_NAMES


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


def head_grads(hidden_BSD: torch.Tensor, logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
               task_BS: torch.Tensor, head_VD: torch.Tensor,
               counts: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Gradient (V, D) of each task's per-token mean cross-entropy wrt the LM head weight, in closed form.

    For GradNorm, whose shared layer is the head (logits = hidden @ head.T, no bias): on the task's T
    trained tokens delta_TV = (softmax(logits) - onehot(label)) / N_task and grad_VD = delta^T @ hidden.
    No autograd and no graph: fp32 under no_grad with autocast off. Costs one extra (T x V) softmax and a
    (V x T) @ (T x D) matmul per step, about the head's weight-gradient matmul again.

    `counts` overrides N_task (global token counts in distributed runs, so the all-reduced sum of the
    ranks' grads is the global gradient). Tasks with no tokens (in `counts` when given, else here) are
    left out; with `counts`, a task with none of its tokens on this rank gets zeros, so every rank
    returns the same keys to all-reduce.
    """
    if tuple(head_VD.shape) != (logits_BSV.shape[-1], hidden_BSD.shape[-1]):
        raise ValueError(f"head_VD: expected shape (V, D) = {(logits_BSV.shape[-1], hidden_BSD.shape[-1])} "
                         f"(got {tuple(head_VD.shape)})")
    trained_BS = labels_BS != IGNORE_INDEX
    grads = {}
    with torch.no_grad(), torch.autocast(hidden_BSD.device.type, enabled=False):
        for task_id, name in enumerate(TASK_NAMES):
            sel_BS = trained_BS & (task_BS == task_id)
            n = float(counts[name]) if counts is not None else float(sel_BS.sum())
            if n <= 0:
                continue
            labels_T = labels_BS[sel_BS]
            delta_TV = logits_BSV[sel_BS].float().softmax(-1)
            delta_TV[torch.arange(len(labels_T), device=delta_TV.device), labels_T] -= 1.0
            grads[name] = delta_TV.div_(n).T @ hidden_BSD[sel_BS].float()  # zeros when T = 0
    return grads


def head_grad_norms(hidden_BSD: torch.Tensor, logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                    task_BS: torch.Tensor, head_VD: torch.Tensor,
                    counts: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """||d mean_task CE / d head_VD||_F per task present (see head_grads for the method and cost)."""
    grads = head_grads(hidden_BSD, logits_BSV, labels_BS, task_BS, head_VD, counts)
    return {name: torch.linalg.matrix_norm(grad_VD) for name, grad_VD in grads.items()}
