"""Dynamic Weight Average (Liu et al. 2019, "End-to-End Multi-Task Learning with Attention").

r_i = Lbar_i(last window) / Lbar_i(window before), w_i = K exp(r_i / T) / sum_j exp(r_j / T), K = 3.
Windows are `window` consecutive observed steps; Lbar_i averages the steps of the window where task i
was present. Weights change when a window completes. A task with fewer than two windows seen gets
r = 1; a task absent for a whole window keeps its previous window means (and so its ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.objectives.balance.base import Balancer, Signals, clean, ratio, register


@dataclass
class DWAConfig:
    temperature: float = 2.0  # softmax temperature: higher -> weights closer to 1
    window: int = 20  # steps per loss average; ratio = last window's mean / the window before's

    def __post_init__(self):
        check(self, "window", ge=1)
        check(self, "temperature", gt=0)


@register
class DWABalancer(Balancer):
    kind = "dwa"
    Config = DWAConfig
    signals = ("task_loss",)

    def __init__(self, cfg: DWAConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.n_steps = 0
        self.cur_sum = dict.fromkeys(TASK_NAMES, 0.0)
        self.cur_n = dict.fromkeys(TASK_NAMES, 0)
        self.means = {t: [] for t in TASK_NAMES}  # the task's last two window means, oldest first
        self.ratio = dict.fromkeys(TASK_NAMES, 1.0)

    def observe(self, signals: Signals, step: int) -> None:
        for t, loss in clean(signals["task_loss"], TASK_NAMES).items():
            self.cur_sum[t] += loss
            self.cur_n[t] += 1
        self.n_steps += 1
        if self.n_steps % self.cfg.window == 0:
            self._close_window()

    def _close_window(self) -> None:
        for t in TASK_NAMES:
            if self.cur_n[t]:
                self.means[t] = [*self.means[t], self.cur_sum[t] / self.cur_n[t]][-2:]
            if len(self.means[t]) == 2:
                self.ratio[t] = ratio(self.means[t][1], self.means[t][0])
        self.cur_sum = dict.fromkeys(TASK_NAMES, 0.0)
        self.cur_n = dict.fromkeys(TASK_NAMES, 0)
        logits = {t: r / self.cfg.temperature for t, r in self.ratio.items()}
        top = max(logits.values())  # stable softmax: a huge ratio must not overflow exp
        exp = {t: math.exp(x - top) for t, x in logits.items()}
        total = sum(exp.values())
        self.mult = {t: len(TASK_NAMES) * e / total for t, e in exp.items()}

    def scalars(self) -> dict[str, float]:
        return {f"balance/dwa_ratio_{t}": r for t, r in self.ratio.items()}

    def _extra_state(self) -> dict:
        return {"n_steps": self.n_steps, "cur_sum": dict(self.cur_sum), "cur_n": dict(self.cur_n),
                "means": {t: list(m) for t, m in self.means.items()}, "ratio": dict(self.ratio)}

    def _load_extra(self, state: dict) -> None:
        self.n_steps = int(state["n_steps"])
        self.cur_sum = {t: float(state["cur_sum"][t]) for t in TASK_NAMES}
        self.cur_n = {t: int(state["cur_n"][t]) for t in TASK_NAMES}
        self.means = {t: [float(m) for m in state["means"][t]] for t in TASK_NAMES}
        self.ratio = {t: float(state["ratio"][t]) for t in TASK_NAMES}
