"""Fault injection (`train.faults`), as a callback: what the NaN, kill, stop, slow and resume tests and
the chaos run (tools/bench/chaos.py) provoke.

It runs after every other callback, so a simulated crash comes where a real one would hurt most:
after everything a step does, or with a checkpoint's files written but not committed (with
train.async_save: in the background writer, halfway through the files). Kills and stops fire in the
first launch only, so that a torchrun restart resumes and finishes. Each fault prints one line
(`mmtrain: fault: ...` with the wall time) to stderr when it fires: the drills time the detection
from it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import Callback, StepStats
from mmtrain.parallel.distributed import restart_count

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer
    from mmtrain.run_config import FaultConfig


def faults_configured(cfg: FaultConfig) -> bool:
    return bool(cfg.nan_at_step or cfg.kill_at_step or cfg.kill_in_save_at_step or cfg.kill_mid_step
                or cfg.stop_at_step or (cfg.slow_s and cfg.slow_at))


def announce(rank: int, what: str) -> None:
    sys.stderr.write(f"mmtrain: fault: rank {rank} {what} at t={time.time():.3f}\n")  # one write: ranks share
    sys.stderr.flush()  # torchrun's stderr, and print's two writes interleave


def hold_gil(seconds: float) -> None:
    """Sleep in one C call that keeps the GIL (PyDLL does not release it): what a long pickle or a
    compile's C++ part does to the process's other threads, the heartbeat's among them."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


class FaultInjection(Callback):
    name = "faults"

    def __init__(self, cfg: FaultConfig, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.mine = rank == cfg.rank  # the other ranks must notice, not be hit
        self.slow = {}  # (where, step) -> seconds, on the faulty rank only
        for item in cfg.slow_at if self.mine else ():
            where, _, step = item.partition("@")
            self.slow[where, int(step)] = cfg.slow_s

    def on_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """The loss of step `nan_at_step` becomes NaN on the faulty rank (every micro-batch)."""
        step = trainer.step + 1
        self._be_slow("compile", step, hold_gil)
        if self.cfg.kill_mid_step == step:  # the forward done, the backward's collectives ahead
            self._signal(signal.SIGKILL, f"SIGKILL mid-step {step}")
        if self.mine and self.cfg.nan_at_step == step:
            announce(self.rank, f"NaN loss in step {step}")
            return loss * float("nan")
        return loss

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        if self.mine and self.cfg.nan_at_step == trainer.step:
            announce(self.rank, f"NaN step {trainer.step} {'skipped' if stats.skipped else 'NOT skipped'}")
        self._be_slow("step", trainer.step, time.sleep)
        if self.cfg.kill_at_step == trainer.step:
            self._signal(signal.SIGKILL, f"SIGKILL after step {trainer.step}")
        if self.cfg.stop_at_step == trainer.step:
            self._signal(signal.SIGSTOP, f"SIGSTOP after step {trainer.step}")

    def on_eval(self, trainer: Trainer, record: dict) -> None:
        self._be_slow("eval", trainer.step, hold_gil)

    def on_train_start(self, trainer: Trainer) -> None:
        if trainer.cfg.train.async_save:  # half written = in the background writer, the step going on
            trainer.checkpointer.while_writing = self._kill_in_save

    def on_checkpoint_written(self, trainer: Trainer, step: int) -> None:
        self._be_slow("save", step, hold_gil)
        if not trainer.cfg.train.async_save:
            self._kill_in_save(step)

    def _kill_in_save(self, step: int) -> None:
        if self.cfg.kill_in_save_at_step == step:
            self._signal(signal.SIGKILL, f"SIGKILL in the save of step {step}")

    def _be_slow(self, where: str, step: int, wait) -> None:
        seconds = self.slow.pop((where, step), 0.0)  # once: a step's micro-batches share it
        if seconds:
            announce(self.rank, f"slow for {seconds:g} s in {where} of step {step}")
            wait(seconds)

    def _signal(self, sig: signal.Signals, what: str) -> None:
        if self.mine and restart_count() == 0:
            announce(self.rank, what)
            os.kill(os.getpid(), sig)
