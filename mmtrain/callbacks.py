"""Callbacks: what the trainer does besides stepping, behind one small interface (OLMo-core's pattern).

    on_train_start(trainer)               after resume and the first eval, before the first step
    on_loss(trainer, loss) -> loss        each micro-batch: this rank's share of its loss, before backward
    on_step_end(trainer, stats)           after every step (or skipped step); `trainer.step` is that step
    on_log(trainer, stats, scalars)       on log steps: add TensorBoard scalars to `scalars`
    on_eval(trainer, record)              after each evaluation: add entries to its history record
    on_diagnostics(trainer, result)       after each diagnostics run (a DiagResult, the same on every rank)
    on_checkpoint_written(trainer, step)  every rank's files are written, not yet committed
    on_checkpoint(trainer, path)          the checkpoint at `path` is committed
    on_train_end(trainer, summary)        after the final checkpoint: add entries to the summary

Every hook runs on every rank in list order (so it may use collectives): built-ins, the user's
(`Trainer(cfg, callbacks=[...])`), fault injection last (ARCHITECTURE, "The loop and its callbacks").
A Stateful callback is the checkpoint part `callback.<name>` (or its `part`), rank 0's copy unless `per_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.distributed.checkpoint.stateful import Stateful

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer


@dataclass(kw_only=True)
class StepStats:
    """What one optimizer step did, all ranks together (built by mmtrain/objectives/objective.py)."""

    loss: float
    task_loss: dict[str, float]
    task_acc: dict[str, float]
    grad_norm: float
    tokens: int  # all ranks
    data_wait_s: float  # mean over ranks
    step_s: float
    skipped: bool
    visual_tokens: int = 0
    media: int = 0
    patches: int = 0
    time_up: bool = False
    task_tokens: dict[str, int] = field(default_factory=dict)  # trained tokens per task, all ranks
    terms: dict[str, float | None] = field(default_factory=dict)  # extra loss terms' step means, by name
    figures: dict[str, dict[str, float]] = field(default_factory=dict)  # e.g. token weighting's cost

    def tokens_per_s_per_device(self, world_size: int) -> float:
        return self.tokens / world_size / max(self.step_s, 1e-9)

    def wait_fraction(self) -> float:
        return self.data_wait_s / max(self.step_s, 1e-9)


class Callback:
    """Base class: every hook is a no-op; override the ones you need (see the module docstring)."""

    name: ClassVar[str] = "callback"  # the checkpoint part is `callback.<name>`: unique per trainer
    per_rank: ClassVar[bool] = False  # state in each rank's file instead of rank 0's
    part: ClassVar[str | None] = None  # the checkpoint part's name, if not `callback.<name>`

    def on_train_start(self, trainer: Trainer) -> None:
        pass

    def on_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        pass

    def on_log(self, trainer: Trainer, stats: StepStats, scalars: dict[str, float]) -> None:
        pass

    def on_eval(self, trainer: Trainer, record: dict) -> None:
        pass

    def on_diagnostics(self, trainer: Trainer, result) -> None:
        pass

    def on_checkpoint_written(self, trainer: Trainer, step: int) -> None:
        pass

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        pass

    def on_train_end(self, trainer: Trainer, summary: dict) -> None:
        pass


class Callbacks:
    """An ordered list of callbacks, called like one."""

    def __init__(self, callbacks: list[Callback]):
        names = [c.name for c in callbacks if isinstance(c, Stateful)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:  # two parts under one name would overwrite each other in the checkpoint
            raise ValueError(f"callbacks: stateful callbacks need unique names (got {dup} twice)")
        self.items = list(callbacks)

    def __iter__(self):
        return iter(self.items)

    def get(self, kind: type[Callback]) -> Callback | None:
        """The first callback of this class, if any."""
        return next((c for c in self.items if isinstance(c, kind)), None)

    def parts(self, per_rank: bool) -> dict[str, Stateful]:
        """The stateful callbacks as checkpoint parts: `callback.<name>` (or their `part`)."""
        return {c.part or f"callback.{c.name}": c for c in self.items
                if isinstance(c, Stateful) and c.per_rank == per_rank}

    def emit(self, hook: str, trainer: Trainer, *args) -> None:
        """Call `hook` (e.g. "on_step_end") of every callback, in order."""
        for c in self.items:
            getattr(c, hook)(trainer, *args)

    def on_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        for c in self.items:  # each sees the loss as the ones before it left it
            loss = c.on_loss(trainer, loss)
        return loss
