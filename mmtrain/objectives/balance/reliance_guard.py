"""Raise the weight of a media task whose visual reliance gap collapses (text stays at 1).

Per media task at each diagnostics run: best_i = max(best_i, gap_i); if gap_i < min_gap or
gap_i < (1 - tolerance) best_i then w_i = min(w_i gain, max_weight), else w_i = 1 + (w_i - 1) decay.
The gap is the loss with the media blanked minus the loss with it: how much the text uses the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import MEDIA_TASKS
from mmtrain.objectives.balance.base import Balancer, Signals, clean, register


@dataclass
class RelianceGuardConfig:
    min_gap: float = 0.05  # a visual reliance gap below this is "collapsed"
    tolerance: float = 0.25  # also raise the weight when the gap fell below (1 - tolerance) * best gap
    gain: float = 1.5  # multiplier per diagnostics run that finds the gap shrinking
    decay: float = 0.5  # otherwise relax toward 1: w = 1 + (w - 1) * decay
    max_weight: float = 4.0  # cap on the multiplier

    def __post_init__(self):
        check(self, "min_gap", ge=0)
        check(self, "tolerance", "decay", ge=0, le=1)
        check(self, "gain", "max_weight", ge=1)


@register
class RelianceGuardBalancer(Balancer):
    kind = "reliance_guard"
    Config = RelianceGuardConfig
    signals = ("reliance_gap",)

    def __init__(self, cfg: RelianceGuardConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.best: dict[str, float] = {}
        self.gap: dict[str, float] = {}

    def observe(self, signals: Signals, step: int) -> None:
        cfg = self.cfg
        for t, gap in clean(signals["reliance_gap"], MEDIA_TASKS).items():
            self.gap[t] = gap
            best = self.best[t] = max(self.best.get(t, gap), gap)
            if gap < cfg.min_gap or gap < (1 - cfg.tolerance) * best:
                self.mult[t] = min(self.mult[t] * cfg.gain, cfg.max_weight)
            else:
                self.mult[t] = 1 + (self.mult[t] - 1) * cfg.decay

    def scalars(self) -> dict[str, float]:
        out = {f"balance/best_gap_{t}": g for t, g in self.best.items()}
        out.update({f"balance/gap_{t}": g for t, g in self.gap.items()})
        return out

    def _extra_state(self) -> dict:
        return {"best": dict(self.best), "gap": dict(self.gap)}

    def _load_extra(self, state: dict) -> None:
        self.best = {t: float(v) for t, v in state["best"].items()}
        self.gap = {t: float(v) for t, v in state["gap"].items()}
