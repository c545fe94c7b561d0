"""Loss-weight balancers (`loss.balancer`): a registry of kinds, each a stateful callback with its
own config dataclass, reading the signals it declares (base.py, signals.py).

    loss.balancer.kind: gradnorm          # one of KINDS
    loss.balancer.gradnorm: {alpha: 1.0}  # that kind's knobs (its Config); the others' are ignored

`BalanceConfig` is built from the registry: `kind` plus one section per registered kind. A new kind
is one file (a `Balancer` subclass with `kind`, `Config`, `signals`, `@register`) and its import
below. Configs written before the sections (flat knobs, as every older checkpoint's config.yaml
has them) still load: each flat knob goes to every kind that has a knob of that name.
"""

from __future__ import annotations

import dataclasses

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import TASK_NAMES
from mmtrain.objectives.balance import dwa, gradnorm, reliance_guard, uncertainty  # noqa: F401  (they register)
from mmtrain.objectives.balance.base import BALANCERS, Balancer, Signals

KINDS = tuple(BALANCERS)


def _post_init(self) -> None:
    check(self, "kind", choices=KINDS)


def _knobs(cls: type[Balancer]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls.Config)}


def _legacy_keys(cls, raw: dict) -> dict:
    """Flat knobs of the one-section config (e.g. `window: 20`) -> the sections that own them."""
    raw = dict(raw)
    for key in [k for k in raw if k != "kind" and k not in BALANCERS]:
        owners = [kind for kind, c in BALANCERS.items() if key in _knobs(c)]
        if not owners:
            continue  # left for the loader to name as an unknown key
        value = raw.pop(key)
        for kind in owners:
            raw[kind] = {key: value, **(raw.get(kind) or {})}
    return raw


BalanceConfig = dataclasses.make_dataclass(
    "BalanceConfig",
    [("kind", str, dataclasses.field(default="static")),
     *[(kind, cls.Config, dataclasses.field(default_factory=cls.Config)) for kind, cls in BALANCERS.items()]],
    namespace={"__post_init__": _post_init, "legacy_keys": classmethod(_legacy_keys),
               "__doc__": "`kind` (one of KINDS) and each kind's knobs, a section per kind."},
)
BalanceConfig.__module__ = __name__


def build_balancer(cfg: BalanceConfig, base: dict[str, float]) -> Balancer:
    """`base`: the configured static weight of every task in TASK_NAMES."""
    if cfg.kind not in BALANCERS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)} (got {cfg.kind!r})")
    missing = [t for t in TASK_NAMES if t not in base]
    if missing:
        raise ValueError(f"base weights: missing {', '.join(missing)}")
    return BALANCERS[cfg.kind](getattr(cfg, cfg.kind), base)


__all__ = ["KINDS", "BalanceConfig", "Balancer", "Signals", "build_balancer"]
