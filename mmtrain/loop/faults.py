"""Fault injection (`train.faults`), as a callback: what the NaN, kill and resume tests provoke.

It runs after every other callback, so a simulated crash comes where a real one would hurt most:
after everything a step does, or with a checkpoint's files written but not committed (with
train.async_save: in the background writer, halfway through the files). Kills fire in the first
launch only, so that a torchrun restart resumes and finishes.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import Callback, StepStats
from mmtrain.parallel.distributed import restart_count

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer
    from mmtrain.run_config import FaultConfig


def faults_configured(cfg: FaultConfig) -> bool:
    return bool(cfg.nan_at_step or cfg.kill_at_step or cfg.kill_in_save_at_step)


class FaultInjection(Callback):
    name = "faults"

    def __init__(self, cfg: FaultConfig, rank: int):
        self.cfg = cfg
        self.mine = rank == cfg.rank  # the other ranks must notice, not be hit

    def on_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """The loss of step `nan_at_step` becomes NaN on the faulty rank (every micro-batch)."""
        if self.mine and self.cfg.nan_at_step == trainer.step + 1:
            return loss * float("nan")
        return loss

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        if self.cfg.kill_at_step == trainer.step:
            self._kill()

    def on_train_start(self, trainer: Trainer) -> None:
        if trainer.cfg.train.async_save:  # half written = in the background writer, the step going on
            trainer.checkpointer.while_writing = self._kill_in_save

    def on_checkpoint_written(self, trainer: Trainer, step: int) -> None:
        if not trainer.cfg.train.async_save:
            self._kill_in_save(step)

    def _kill_in_save(self, step: int) -> None:
        if self.cfg.kill_in_save_at_step == step:
            self._kill()

    def _kill(self) -> None:
        if self.mine and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
