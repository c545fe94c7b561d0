"""GradNorm (Chen et al. 2018, "GradNorm: Gradient Normalization for Adaptive Loss Balancing in Deep
Multitask Networks"), with the LM head as the shared layer (the objective's `head_grad_norm`).

g_i = ||d L_i / d W_shared|| of the unweighted loss, G_i = w_i g_i, Gbar = mean_i G_i,
Ltilde_i = L_i / L_i(0) (L_i(0): first loss seen), r_i = Ltilde_i / mean_j Ltilde_j,
target_i = Gbar r_i^alpha (a constant). sum_i |G_i - target_i| has gradient sign(G_i - target_i) g_i
in w_i; one SGD step, clamp to min_weight, then rescale so the stepped weights keep their sum (K = 3
in all; a task missing from the step keeps its weight). Only tasks with both signals step.
The base weights multiply on top: GradNorm balances the unweighted losses.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.objectives.balance.base import Balancer, Signals, clean, ratio, register


@dataclass
class GradNormConfig:
    lr: float = 0.025  # SGD step on the weights
    alpha: float = 1.5  # how hard slower-training tasks are pushed (0: equal gradient norms)
    min_weight: float = 0.05  # floor on the weights

    def __post_init__(self):
        check(self, "lr", gt=0)
        check(self, "alpha", ge=0)
        check(self, "min_weight", gt=0, le=1)


@register
class GradNormBalancer(Balancer):
    kind = "gradnorm"
    Config = GradNormConfig
    signals = ("task_loss", "head_grad_norm")

    def __init__(self, cfg: GradNormConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.initial_loss: dict[str, float] = {}
        self.grad_norm: dict[str, float] = {}
        self.loss_ratio: dict[str, float] = {}

    def observe(self, signals: Signals, step: int) -> None:
        losses, norms = clean(signals["task_loss"], TASK_NAMES), clean(signals["head_grad_norm"], TASK_NAMES)
        for t, loss in losses.items():
            self.initial_loss.setdefault(t, loss)
        tasks = [t for t in TASK_NAMES if t in losses and t in norms]
        if not tasks:
            return
        self.grad_norm.update({t: norms[t] for t in tasks})
        self.loss_ratio.update({t: ratio(losses[t], self.initial_loss[t]) for t in tasks})
        g_norm = {t: self.mult[t] * norms[t] for t in tasks}
        g_mean = sum(g_norm.values()) / len(tasks)
        lt_mean = sum(self.loss_ratio[t] for t in tasks) / len(tasks)
        before = sum(self.mult[t] for t in tasks)
        for t in tasks:
            target = g_mean * ratio(self.loss_ratio[t], lt_mean) ** self.cfg.alpha
            sign = (g_norm[t] > target) - (g_norm[t] < target)
            self.mult[t] = max(self.mult[t] - self.cfg.lr * sign * norms[t], self.cfg.min_weight)
        after = sum(self.mult[t] for t in tasks)
        for t in tasks:
            self.mult[t] *= before / after

    def scalars(self) -> dict[str, float]:
        out = {f"balance/grad_norm_{t}": g for t, g in self.grad_norm.items()}
        out.update({f"balance/loss_ratio_{t}": r for t, r in self.loss_ratio.items()})
        return out

    def _extra_state(self) -> dict:
        return {"initial_loss": dict(self.initial_loss), "grad_norm": dict(self.grad_norm),
                "loss_ratio": dict(self.loss_ratio)}

    def _load_extra(self, state: dict) -> None:
        for name in ("initial_loss", "grad_norm", "loss_ratio"):
            setattr(self, name, {t: float(v) for t, v in state[name].items()})
