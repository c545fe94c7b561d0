"""Homoscedastic uncertainty weighting (Kendall et al. 2018, "Multi-Task Learning Using Uncertainty
to Weigh Losses for Scene Geometry and Semantics").

Per task a log-variance s_i (init 0) and weight exp(-s_i). The objective exp(-s_i) L_i + s_i has
d/ds_i = 1 - exp(-s_i) L_i, so observe() takes s_i -= lr * (1 - exp(-s_i) L_i): the plain-SGD step
autograd would take, in closed form so every rank steps identically from all-reduced losses. The fixed
point is exp(-s_i) = 1 / L_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.objectives.balance.base import Balancer, Signals, clean, register


@dataclass
class UncertaintyConfig:
    lr: float = 0.025  # SGD step on the log-variances

    def __post_init__(self):
        check(self, "lr", gt=0)


@register
class UncertaintyBalancer(Balancer):
    kind = "uncertainty"
    Config = UncertaintyConfig
    signals = ("task_loss",)

    def __init__(self, cfg: UncertaintyConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.log_var = dict.fromkeys(TASK_NAMES, 0.0)

    def observe(self, signals: Signals, step: int) -> None:
        for t, loss in clean(signals["task_loss"], TASK_NAMES).items():
            s = self.log_var[t]
            self.log_var[t] = s - self.cfg.lr * (1.0 - math.exp(-s) * loss)
            self.mult[t] = math.exp(-self.log_var[t])

    def scalars(self) -> dict[str, float]:
        return {f"balance/log_var_{t}": s for t, s in self.log_var.items()}

    def _extra_state(self) -> dict:
        return {"log_var": dict(self.log_var)}

    def _load_extra(self, state: dict) -> None:
        self.log_var = {t: float(state["log_var"][t]) for t in TASK_NAMES}
