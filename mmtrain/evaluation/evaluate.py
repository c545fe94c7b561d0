"""Held-out evaluation: per-modality loss and accuracy, and two visual reliance gaps per media task.

The mismatch gap, the verdict on whether the text reads the pixels: the loss with each document's
media swapped for other documents' real media of the same kind and patch grid (`mismatch_media`)
minus the loss with its own media, both on the trained tokens of the documents that got a foreign
medium. In distribution: near zero means the text ignores the pixels (modality collapse).
The blanked reliance gap: the loss with every medium blanked (patches set to 0, i.e. the
normalisation mean: a flat grey; `terms.blank_media`) minus the loss with the real media, on all
tokens. Blank media are out of distribution: that gap can be large in runs that never read pixels.

Legend: B rows, S tokens, T tasks (TASK_NAMES), C summed columns (SUMS), M media.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from mmtrain.data_pipelines.batch import IGNORE_INDEX, MEDIA_TASKS, TASK_NAMES, PackedBatch
from mmtrain.objectives.mismatch import mismatch_media
from mmtrain.objectives.terms import TaskLosses, blank_media, task_losses

Autocast = Callable[[], contextlib.AbstractContextManager]
# The per-task sums an evaluation adds up (exactly summable across batches and ranks).
SUMS = ("loss", "correct", "tokens", "blank_loss", "mismatch_real_loss", "mismatch_loss", "mismatch_tokens")


@dataclass
class EvalResult:
    loss: dict[str, float] = field(default_factory=dict)  # per-token mean, real media
    accuracy: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    blank_loss: dict[str, float] = field(default_factory=dict)  # media blanked (media tasks only)
    # Media swapped across documents (mismatch_media), on the trained tokens of the documents that got
    # a foreign medium; only media tasks with such tokens.
    mismatch_loss: dict[str, float] = field(default_factory=dict)  # per-token mean, swapped media
    mismatch_real_loss: dict[str, float] = field(default_factory=dict)  # ... the same tokens, own media
    mismatch_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def reliance_gap(self) -> dict[str, float]:
        """Blanked (out of distribution): blank loss minus real loss."""
        return {t: self.blank_loss[t] - self.loss[t] for t in self.blank_loss if t in self.loss}

    @property
    def mismatch_gap(self) -> dict[str, float]:
        """The verdict on reading the pixels: swapped-media loss minus own-media loss, same tokens."""
        return {t: self.mismatch_loss[t] - self.mismatch_real_loss[t] for t in self.mismatch_loss}

    def scalars(self, prefix: str = "val") -> dict[str, float]:
        out = {f"{prefix}/loss_{k}": v for k, v in self.loss.items()}
        out.update({f"{prefix}/acc_{k}": v for k, v in self.accuracy.items()})
        out.update({f"{prefix}/reliance_gap_{k}": v for k, v in self.reliance_gap.items()})
        out.update({f"{prefix}/mismatch_gap_{k}": v for k, v in self.mismatch_gap.items()})
        return out

    def to_dict(self) -> dict:
        return {"loss": self.loss, "accuracy": self.accuracy, "tokens": self.tokens,
                "blank_loss": self.blank_loss, "reliance_gap": self.reliance_gap,
                "mismatch_loss": self.mismatch_loss, "mismatch_real_loss": self.mismatch_real_loss,
                "mismatch_tokens": self.mismatch_tokens, "mismatch_gap": self.mismatch_gap}

    def sums_TC(self) -> torch.Tensor:
        """(T, C) float64: the per-task sums (columns SUMS) these means were formed from."""
        rows = []
        for task in TASK_NAMES:
            n, m = self.tokens.get(task, 0), self.mismatch_tokens.get(task, 0)
            rows.append([self.loss.get(task, 0.0) * n, self.accuracy.get(task, 0.0) * n, n,
                         self.blank_loss.get(task, 0.0) * n, self.mismatch_real_loss.get(task, 0.0) * m,
                         self.mismatch_loss.get(task, 0.0) * m, m])
        return torch.tensor(rows, dtype=torch.float64)

    @classmethod
    def from_sums(cls, sums_TC: torch.Tensor) -> EvalResult:
        """The means of (T, C) per-task sums (columns SUMS); tasks without tokens are left out."""
        out = cls()
        for task, row in zip(TASK_NAMES, sums_TC.tolist()):
            s = dict(zip(SUMS, row))
            n, m = int(s["tokens"]), int(s["mismatch_tokens"])
            if n == 0:
                continue
            out.tokens[task], out.loss[task], out.accuracy[task] = n, s["loss"] / n, s["correct"] / n
            if task in MEDIA_TASKS:
                out.blank_loss[task] = s["blank_loss"] / n
            if task in MEDIA_TASKS and m > 0:
                out.mismatch_tokens[task] = m
                out.mismatch_loss[task] = s["mismatch_loss"] / m
                out.mismatch_real_loss[task] = s["mismatch_real_loss"] / m
        return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[PackedBatch],
    device: torch.device,
    autocast: Autocast = contextlib.nullcontext,
) -> EvalResult:
    """Per task: loss and accuracy with the real media; per media task also the loss with blanked media
    and the two losses of the mismatch gap. Three forwards a batch, whatever it holds (the forwards are
    collective under FSDP)."""
    was_training = model.training
    model.eval()
    sums_TC = torch.zeros(len(TASK_NAMES), len(SUMS), dtype=torch.float64)
    try:
        for batch in batches:
            _add_batch(model, batch.to(device), autocast, sums_TC)
    finally:
        model.train(was_training)
    return EvalResult.from_sums(sums_TC)


def _add_batch(model: nn.Module, batch: PackedBatch, autocast: Autocast, sums_TC: torch.Tensor) -> None:
    """Adds one batch's sums (columns SUMS) to sums_TC: forwards with real, blanked, swapped media."""
    mismatched, swapped_BS = mismatch_media(batch)
    swapped_labels_BS = batch.labels_BS.masked_fill(~swapped_BS, IGNORE_INDEX)
    logits_BSV = _logits(model, batch, autocast)
    _add(sums_TC, task_losses(logits_BSV, batch.labels_BS, batch.task_BS),
         loss="loss_sum", correct="correct", tokens="count")
    _add(sums_TC, task_losses(logits_BSV, swapped_labels_BS, batch.task_BS),
         mismatch_real_loss="loss_sum", mismatch_tokens="count")
    del logits_BSV  # free before the next forward
    _add(sums_TC, task_losses(_logits(model, blank_media(batch), autocast), batch.labels_BS, batch.task_BS),
         blank_loss="loss_sum")
    _add(sums_TC, task_losses(_logits(model, mismatched, autocast), swapped_labels_BS, batch.task_BS),
         mismatch_loss="loss_sum")


def _logits(model: nn.Module, batch: PackedBatch, autocast: Autocast) -> torch.Tensor:
    with autocast():
        return model(**batch.model_inputs()).logits_BSV


def _add(sums_TC: torch.Tensor, losses: TaskLosses, **columns: str) -> None:
    """sums_TC[:, column] += the TaskLosses field named for it, per task."""
    for column, name in columns.items():
        per_task = getattr(losses, name)
        sums_TC[:, SUMS.index(column)] += torch.stack([per_task[t] for t in TASK_NAMES]).double().cpu()
