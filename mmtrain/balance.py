"""Loss-weight balancers: map per-modality losses to weights each step.

One interface, chosen in the config (`loss.balancer`). The static balancer is the baseline;
adaptive ones (DWA, uncertainty, GradNorm, reliance guard) plug in behind the same methods.
"""

from __future__ import annotations

from data_pipelines.batch import TASK_NAMES
from mmtrain.run_config import LossConfig


class StaticBalancer:
    """Fixed weights from the config."""

    def __init__(self, cfg: LossConfig):
        self._weights = {name: float(getattr(cfg, name)) for name in TASK_NAMES}

    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def observe(self, losses: dict[str, float], step: int) -> None:
        """Called after every optimizer step with that step's per-task mean losses."""

    def state_dict(self) -> dict:
        return {"weights": dict(self._weights)}

    def load_state_dict(self, state: dict) -> None:
        self._weights = dict(state["weights"])


def build_balancer(cfg: LossConfig) -> StaticBalancer:
    if cfg.balancer == "static":
        return StaticBalancer(cfg)
    raise ValueError(f"balancer: unknown balancer {cfg.balancer!r}")
