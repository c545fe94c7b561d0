"""Curriculum stages (`train.stages`), as a callback.

Until step `until_step` only the named data.train sources are mixed, with a seed of their own
(data.seed + stage: a stage does not replay another's stream); then the next stage; after the last
one every source. At a boundary the train loader is rebuilt for the new stage.

The stage is the callback's state, a checkpoint part (`callback.curriculum`). Replicated parts load
before the per-rank data position (mmtrain/state/train_state.py), and loading the stage rebuilds that
stage's loader first, so the saved position goes back into the loader it came from: resume is
exact on either side of a boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mmtrain.callbacks import Callback, StepStats
from mmtrain.checks import check
from mmtrain.data_pipelines.config import DataConfig

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer


@dataclass
class StageConfig:
    """A curriculum stage: until optimizer step `until_step` only these data.train sources are mixed
    (with their configured weights). After the last stage every data.train source is."""

    until_step: int = 0
    sources: list[str] = field(default_factory=list)

    def __post_init__(self):
        check(self, "until_step", ge=1)
        if not self.sources:
            raise ValueError("sources: must name at least one data.train source")


def stage_at(until_steps: list[int], step: int) -> int:
    """Index of the stage that step `step + 1` belongs to (len(until_steps): all sources)."""
    return next((i for i, end in enumerate(until_steps) if step < end), len(until_steps))


def stage_data(data: DataConfig, stages: list[StageConfig], stage: int) -> DataConfig:
    """The data config of a stage: its sources only, and a seed of its own."""
    if not stages:
        return data
    if stage == len(stages):
        return replace(data, seed=data.seed + stage)
    keep = set(stages[stage].sources)
    return replace(data, train=[s for s in data.train if s.name in keep], seed=data.seed + stage)


class Curriculum(Callback):
    """Switches the train loader at stage boundaries through `use_data(DataConfig)`."""

    name = "curriculum"

    def __init__(self, data: DataConfig, stages: list[StageConfig], use_data: Callable[[DataConfig], None]):
        self.data, self.stages, self.use_data = data, stages, use_data
        self.stage = 0  # the trainer starts on stage 0's loader

    def state_dict(self) -> dict:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict) -> None:
        self.enter(state["stage"])

    def stage_data(self, stage: int) -> DataConfig:
        return stage_data(self.data, self.stages, stage)

    def enter(self, stage: int) -> bool:
        """Rebuild the train loader for `stage` unless it is the current one; -> whether it changed."""
        if stage == self.stage:
            return False
        self.stage = stage
        self.use_data(self.stage_data(stage))
        return True

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        if self.enter(stage_at([s.until_step for s in self.stages], trainer.step)):
            names = ", ".join(s.name for s in self.stage_data(self.stage).train)
            trainer.log.info(f"step {trainer.step}: curriculum stage {self.stage} ({names})")
