"""The balancer interface, the registry of kinds, and the static kind.

A balancer is a stateful callback (checkpoint part `balancer`): `weights()` are the configured
static weights times one adaptive multiplier per task; `observe(signals, step)` gets the signals
it declares (`signals`, names in mmtrain/objectives/balance/signals.py) when their source has them: the
objective's after every optimizer step that was not skipped, the diagnostics' after each run
(`on_diagnostics`). `@register` enters a class under its `kind` with its `Config` dataclass.

All updates are closed-form on python floats: every rank feeds the same all-reduced numbers and so
takes the same step, and the whole state checkpoints as plain python data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

from mmtrain.callbacks import Callback
from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.objectives.balance.signals import SIGNALS

Signals = dict[str, dict[str, float]]  # signal name -> task -> value
BALANCERS: dict[str, type[Balancer]] = {}  # kind -> class, filled by @register


def register(cls: type[Balancer]) -> type[Balancer]:
    """Enter a balancer class under its `kind`; its `signals` must be known ones."""
    unknown = [s for s in cls.signals if s not in SIGNALS]
    if unknown or cls.kind in BALANCERS:
        raise ValueError(f"balancer {cls.kind!r}: unknown signals {unknown} or kind registered twice")
    BALANCERS[cls.kind] = cls
    return cls


def clean(values: dict[str, float] | None, allowed: tuple[str, ...]) -> dict[str, float]:
    """Floats of the finite entries: a skipped (non-finite) step must not poison the state."""
    out = {}
    for name, value in (values or {}).items():
        if name not in allowed:
            raise ValueError(f"unknown task {name!r} (known: {', '.join(allowed)})")
        if math.isfinite(value := float(value)):
            out[name] = value
    return out


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 1.0


@dataclass
class StaticConfig:
    """No knobs: the weights are the configured ones."""


class Balancer(Callback):
    """Static weights `base` times an adaptive multiplier per task (1 here; subclasses adapt it)."""

    kind: ClassVar[str] = "static"
    Config: ClassVar[type] = StaticConfig
    signals: ClassVar[tuple[str, ...]] = ()  # what observe() reads (mmtrain/objectives/balance/signals.py)
    name = "balancer"
    part = "balancer"  # the checkpoint part (not callback.balancer: older checkpoints name it so)

    def __init__(self, cfg, base: dict[str, float]):
        self.cfg = cfg
        self.base = {t: float(base[t]) for t in TASK_NAMES}
        self.mult = dict.fromkeys(TASK_NAMES, 1.0)

    def weights(self) -> dict[str, float]:
        return {t: self.base[t] * self.mult[t] for t in TASK_NAMES}

    def wants(self, source: str) -> list[str]:
        """The declared signals that `source` ("step" or "diagnostics") provides."""
        return [s for s in self.signals if SIGNALS[s].source == source]

    def observe(self, signals: Signals, step: int) -> None:
        """The declared signals of one source (only those), when it has them."""

    def on_diagnostics(self, trainer, result) -> None:
        wanted = self.wants("diagnostics")
        if wanted:
            self.observe({s: getattr(result, SIGNALS[s].attr) for s in wanted}, trainer.step)

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


register(Balancer)  # "static": fixed weights from the config
