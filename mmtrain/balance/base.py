"""Loss-weight balancers: map per-task losses (and, if needed, gradient norms or reliance gaps) to weights.

One interface, chosen in the config (`loss.balancer.kind`). Each balancer keeps an adaptive multiplier
per task; the weight the trainer uses is the configured static weight times that multiplier, so the
static weights stay a preference on top of whatever the adaptive rule does.

All updates are closed-form on python floats: every rank feeds the same all-reduced numbers and so
takes the same step, and the whole state checkpoints as plain python data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import TASK_NAMES

KINDS = ("static", "dwa", "uncertainty", "gradnorm", "reliance_guard")
MEDIA_TASKS = ("image_text", "video_text")  # tasks with a visual reliance gap


@dataclass
class BalanceConfig:
    kind: Literal["static", "dwa", "uncertainty", "gradnorm", "reliance_guard"] = "static"
    temperature: float = 2.0  # DWA softmax temperature: higher -> weights closer to 1
    window: int = 20  # DWA: steps per loss average; ratio = last window's mean / the window before's
    lr: float = 0.025  # uncertainty / gradnorm: SGD step on the log-variances / on the GradNorm weights
    alpha: float = 1.5  # GradNorm: how hard slower-training tasks are pushed (0: equal gradient norms)
    min_gap: float = 0.05  # reliance guard: a visual reliance gap below this is "collapsed"
    tolerance: float = 0.25  # ... also raise the weight when the gap fell below (1 - tolerance) * best gap
    gain: float = 1.5  # ... multiplier per diagnostic check that finds the gap shrinking
    decay: float = 0.5  # ... otherwise relax toward 1: w = 1 + (w - 1) * decay
    max_weight: float = 4.0  # ... cap on the reliance multiplier
    min_weight: float = 0.05  # GradNorm floor on its weights (DWA's and uncertainty's stay > 0 anyway)

    def __post_init__(self):
        check(self, "kind", choices=KINDS)
        check(self, "window", ge=1)
        check(self, "temperature", "lr", gt=0)
        check(self, "alpha", "min_gap", ge=0)
        check(self, "tolerance", "decay", ge=0, le=1)
        check(self, "gain", "max_weight", ge=1)
        check(self, "min_weight", gt=0, le=1)


def _clean(values: dict[str, float] | None, allowed: tuple[str, ...]) -> dict[str, float]:
    """Floats of the finite entries: a skipped (non-finite) step must not poison the state."""
    out = {}
    for name, value in (values or {}).items():
        if name not in allowed:
            raise ValueError(f"unknown task {name!r} (known: {', '.join(allowed)})")
        if math.isfinite(value := float(value)):
            out[name] = value
    return out


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 1.0


class Balancer:
    """Static weights `base` times an adaptive multiplier per task (1 here; subclasses adapt it)."""

    kind = "static"
    needs_grad_norms = False  # observe() wants ||d L_task / d W_shared|| of the unweighted task losses
    needs_reliance = False  # observe_reliance() wants the visual reliance gaps

    def __init__(self, cfg: BalanceConfig, base: dict[str, float]):
        self.cfg = cfg
        self.base = {t: float(base[t]) for t in TASK_NAMES}
        self.mult = dict.fromkeys(TASK_NAMES, 1.0)

    def weights(self) -> dict[str, float]:
        return {t: self.base[t] * self.mult[t] for t in TASK_NAMES}

    def observe(self, losses: dict[str, float], step: int,
                grad_norms: dict[str, float] | None = None) -> None:
        """After every optimizer step: that step's per-token mean loss of each task in the batch."""

    def observe_reliance(self, gaps: dict[str, float], step: int) -> None:
        """Every N steps: the visual reliance gap (loss blanked - loss with media) per media task."""

    def scalars(self) -> dict[str, float]:
        """Internal state for TensorBoard (the weights themselves are logged from weights())."""
        return {}

    def state_dict(self) -> dict:
        return {"kind": self.kind, "multipliers": dict(self.mult), **self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("kind", "static")  # checkpoints from before the adaptive balancers: static
        if saved != self.kind and saved != "static":
            warnings.warn(f"balancer: checkpoint has {saved!r} state, config says {self.kind!r}: "
                          "starting the balancer afresh", stacklevel=2)
        if saved != self.kind or saved == "static":  # static has no state beyond the config
            return
        self.mult = {t: float(state["multipliers"][t]) for t in TASK_NAMES}
        self._load_extra(state)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra(self, state: dict) -> None:
        pass


class StaticBalancer(Balancer):
    """Fixed weights from the config."""


class DWABalancer(Balancer):
    """Dynamic Weight Average (Liu et al. 2019, "End-to-End Multi-Task Learning with Attention").

    r_i = Lbar_i(last window) / Lbar_i(window before), w_i = K exp(r_i / T) / sum_j exp(r_j / T), K = 3.
    Windows are `window` consecutive observe() calls; Lbar_i averages the steps of the window where task i
    was present. Weights change when a window completes. A task with fewer than two windows seen gets
    r = 1; a task absent for a whole window keeps its previous window means (and so its ratio).
    """

    kind = "dwa"

    def __init__(self, cfg: BalanceConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.n_steps = 0
        self.cur_sum = dict.fromkeys(TASK_NAMES, 0.0)
        self.cur_n = dict.fromkeys(TASK_NAMES, 0)
        self.means = {t: [] for t in TASK_NAMES}  # the task's last two window means, oldest first
        self.ratio = dict.fromkeys(TASK_NAMES, 1.0)

    def observe(self, losses: dict[str, float], step: int,
                grad_norms: dict[str, float] | None = None) -> None:
        for t, loss in _clean(losses, TASK_NAMES).items():
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
                self.ratio[t] = _ratio(self.means[t][1], self.means[t][0])
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


class UncertaintyBalancer(Balancer):
    """Homoscedastic uncertainty weighting (Kendall et al. 2018, "Multi-Task Learning Using Uncertainty
    to Weigh Losses for Scene Geometry and Semantics").

    Per task a log-variance s_i (init 0) and weight exp(-s_i). The objective exp(-s_i) L_i + s_i has
    d/ds_i = 1 - exp(-s_i) L_i, so observe() takes s_i -= lr * (1 - exp(-s_i) L_i): the plain-SGD step
    autograd would take, in closed form so every rank steps identically from all-reduced losses. The fixed
    point is exp(-s_i) = 1 / L_i.
    """

    kind = "uncertainty"

    def __init__(self, cfg: BalanceConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.log_var = dict.fromkeys(TASK_NAMES, 0.0)

    def observe(self, losses: dict[str, float], step: int,
                grad_norms: dict[str, float] | None = None) -> None:
        for t, loss in _clean(losses, TASK_NAMES).items():
            s = self.log_var[t]
            self.log_var[t] = s - self.cfg.lr * (1.0 - math.exp(-s) * loss)
            self.mult[t] = math.exp(-self.log_var[t])

    def scalars(self) -> dict[str, float]:
        return {f"balance/log_var_{t}": s for t, s in self.log_var.items()}

    def _extra_state(self) -> dict:
        return {"log_var": dict(self.log_var)}

    def _load_extra(self, state: dict) -> None:
        self.log_var = {t: float(state["log_var"][t]) for t in TASK_NAMES}


class GradNormBalancer(Balancer):
    """GradNorm (Chen et al. 2018, "GradNorm: Gradient Normalization for Adaptive Loss Balancing in Deep
    Multitask Networks"), with the LM head as the shared layer (objectives.head_grad_norms).

    g_i = ||d L_i / d W_shared|| of the unweighted loss, G_i = w_i g_i, Gbar = mean_i G_i,
    Ltilde_i = L_i / L_i(0) (L_i(0): first loss seen), r_i = Ltilde_i / mean_j Ltilde_j,
    target_i = Gbar r_i^alpha (a constant). sum_i |G_i - target_i| has gradient sign(G_i - target_i) g_i
    in w_i; one SGD step, clamp to min_weight, then rescale so the stepped weights keep their sum (K = 3
    in all; a task missing from the step keeps its weight). Only tasks in both losses and grad_norms step.
    The base weights multiply on top: GradNorm balances the unweighted losses.
    """

    kind = "gradnorm"
    needs_grad_norms = True

    def __init__(self, cfg: BalanceConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.initial_loss: dict[str, float] = {}
        self.grad_norm: dict[str, float] = {}
        self.loss_ratio: dict[str, float] = {}

    def observe(self, losses: dict[str, float], step: int,
                grad_norms: dict[str, float] | None = None) -> None:
        losses, norms = _clean(losses, TASK_NAMES), _clean(grad_norms, TASK_NAMES)
        for t, loss in losses.items():
            self.initial_loss.setdefault(t, loss)
        tasks = [t for t in TASK_NAMES if t in losses and t in norms]
        if not tasks:
            return
        self.grad_norm.update({t: norms[t] for t in tasks})
        self.loss_ratio.update({t: _ratio(losses[t], self.initial_loss[t]) for t in tasks})
        g_norm = {t: self.mult[t] * norms[t] for t in tasks}
        g_mean = sum(g_norm.values()) / len(tasks)
        lt_mean = sum(self.loss_ratio[t] for t in tasks) / len(tasks)
        before = sum(self.mult[t] for t in tasks)
        for t in tasks:
            target = g_mean * _ratio(self.loss_ratio[t], lt_mean) ** self.cfg.alpha
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


class RelianceGuardBalancer(Balancer):
    """Raise the weight of a media task whose visual reliance gap collapses (text stays at 1).

    Per media task at each diagnostic check: best_i = max(best_i, gap_i); if gap_i < min_gap or
    gap_i < (1 - tolerance) best_i then w_i = min(w_i gain, max_weight), else w_i = 1 + (w_i - 1) decay.
    The gap is the loss with the media blanked minus the loss with it: how much the text uses the pixels.
    """

    kind = "reliance_guard"
    needs_reliance = True

    def __init__(self, cfg: BalanceConfig, base: dict[str, float]):
        super().__init__(cfg, base)
        self.best: dict[str, float] = {}
        self.gap: dict[str, float] = {}

    def observe_reliance(self, gaps: dict[str, float], step: int) -> None:
        cfg = self.cfg
        for t, gap in _clean(gaps, MEDIA_TASKS).items():
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


_BALANCERS = {cls.kind: cls for cls in (StaticBalancer, DWABalancer, UncertaintyBalancer, GradNormBalancer,
                                        RelianceGuardBalancer)}


def build_balancer(cfg: BalanceConfig, base: dict[str, float]) -> Balancer:
    """`base`: the configured static weight of every task in TASK_NAMES."""
    if cfg.kind not in _BALANCERS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)} (got {cfg.kind!r})")
    missing = [t for t in TASK_NAMES if t not in base]
    if missing:
        raise ValueError(f"base weights: missing {', '.join(missing)}")
    return _BALANCERS[cfg.kind](cfg, base)
