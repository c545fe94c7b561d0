"""Held-out evaluation: per-modality loss and accuracy, and the visual reliance gap.

The reliance gap of a task is its loss with every medium blanked (patches set to 0, i.e. the
normalisation mean: a flat grey) minus its loss with the real media. Near zero means the text
ignores the pixels: modality collapse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from mmtrain.data_pipelines.batch import TASK_NAMES, PackedBatch
from mmtrain.objectives import task_losses

MEDIA_TASKS = ("image_text", "video_text")


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


def blank_media(batch: PackedBatch) -> PackedBatch:
    return replace(batch, patches_NP=torch.zeros_like(batch.patches_NP))


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
