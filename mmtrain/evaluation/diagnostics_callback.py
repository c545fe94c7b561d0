"""Collapse diagnostics (mmtrain/evaluation/diagnostics.py) as a callback: at the start, every
`diagnostics.every` steps and at the last step, on the first `diagnostics.batches` val batches.

Each run goes to TensorBoard (`diag/*`, the expert-load heatmap), to `RUN/diagnostics.jsonl`
(rank 0), to the log as `ALARM @ step: ...` lines, and to every callback's `on_diagnostics` (a
balancer that declares a diagnostics signal, the mixture controller). The history is the
callback's state, a checkpoint part (`callback.diagnostics`), so a resumed run neither repeats
the start's run nor loses the curve; the last run is in the summary.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from mmtrain.callbacks import Callback, StepStats
from mmtrain.evaluation.diagnostics import DiagConfig, run_diagnostics
from mmtrain.evaluation.dist_eval import pad_to_most
from mmtrain.evaluation.pointing import grounding_docs
from mmtrain.evaluation.probe import probe_media
from mmtrain.parallel.distributed import all_reduce, broadcast_object

if TYPE_CHECKING:
    from mmtrain.loop.trainer import Trainer

DIAG_FILE = "diagnostics.jsonl"  # one JSON line per diagnostics run (rank 0)


class Diagnostics(Callback):
    name = "diagnostics"

    def __init__(self, cfg: DiagConfig):
        self.cfg = cfg
        self.history: list[dict] = []  # DiagResult.to_dict() of each run: step, alarms, signals
        self._grounding: list | None = None  # the pointing game's val documents, read at first use
        self._probe: list | None = None  # the ViT probe's val images, likewise

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])

    def on_train_start(self, trainer: Trainer) -> None:
        if not self.history:
            self.run(trainer)

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        if self.due(trainer, stats):
            self.run(trainer)

    def due(self, trainer: Trainer, stats: StepStats | None) -> bool:
        """Whether the hook (on_step_end with `stats`, on_train_start without) runs the pass."""
        if stats is None:
            return not self.history
        return trainer.step >= trainer.cfg.train.steps or stats.time_up or trainer.step % self.cfg.every == 0

    def on_train_end(self, trainer: Trainer, summary: dict) -> None:
        summary["diagnostics"] = self.history[-1] if self.history else None

    def run(self, trainer: Trainer) -> None:
        """One run on every rank (the sums are all-reduced, so every rank sees the same result)."""
        env, cfg = trainer.env, self.cfg
        batches = pad_to_most(trainer.val_batches()[:cfg.batches], env, trainer.device, trainer.pad_batch)
        evaluates = trainer.train_module.evaluates  # dist.pp > 1: the pipeline's first rank alone
        if self._grounding is None:
            self._grounding = grounding_docs(trainer.cfg.data, trainer.tokenizer, cfg.pointing_media)
        if self._probe is None:
            self._probe = probe_media(trainer.cfg.data, trainer.tokenizer, cfg.probe_media)
        result = run_diagnostics(trainer.model, batches if evaluates else [], trainer.device, cfg,
                                 trainer.step,
                                 autocast=trainer.autocast, raw_model=trainer.raw_model,
                                 reduce_fn=(lambda t: all_reduce(t, env)) if env.distributed else None,
                                 grounding=self._grounding if evaluates else None,
                                 probe=self._probe if evaluates else None)
        if trainer.pipeline is not None:  # every rank keeps the evaluating ranks' result (rank 0's)
            result = broadcast_object(result, env)
        self.history.append(result.to_dict())  # with its step and alarms
        self._report(trainer, result)
        trainer.callbacks.emit("on_diagnostics", trainer, result)

    def _report(self, trainer: Trainer, result) -> None:
        log, step = trainer.log, trainer.step
        log.scalars(step, result.scalars())
        image_HW3 = result.expert_load_image() if trainer.env.is_main else None
        if image_HW3 is not None:
            log.image(step, "diag/expert_load", image_HW3)
        for alarm in self.history[-1]["alarms"]:
            log.info(f"ALARM @ {step}: {alarm}")
        if trainer.env.is_main:
            with open(trainer.run_dir / DIAG_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(self.history[-1]) + "\n")
