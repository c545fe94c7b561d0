"""The reliance-driven mixture controller (`data.mix.controller`), as a callback.

At every diagnostics run it reads each media task's gap (`signal`, by default the mismatch gap) and,
per media task (why the feed and not the loss weights: ARCHITECTURE, "Objectives, balancing, diagnostics"):

    gap < low_gap, or fell by more than `fall` since the last check  ->  boost *= up (<= max_boost)
    gap > high_gap                                                   ->  boost -> 1 by `relax`
    otherwise                                                        ->  unchanged

Boosts start at `initial_boost` (1: the configured mix). A source's weight is its configured weight
times its task's boost (`tasks`), the document shares clipped to `min_share`/`max_share`; while the
run's media-task token share is above `max_media_share` no boost rises and every boost shrinks by
`up`. Weights go to `Trainer.set_train_weights`. Inputs are all-reduced (every rank decides alike);
boosts, previous gaps and token counters are the replicated
part `callback.mix`, re-applied before the data position loads, so resume is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmtrain.callbacks import Callback, StepStats
from mmtrain.data_pipelines.batch import MEDIA_TASKS
from mmtrain.data_pipelines.config import MixControllerConfig, SourceConfig
from mmtrain.objectives.balance.signals import SIGNALS

if TYPE_CHECKING:
    from mmtrain.evaluation.diagnostics import DiagResult
    from mmtrain.loop.trainer import Trainer

SIGNAL_OF = {"mismatch": "mismatch_gap", "blank": "reliance_gap"}  # controller.signal -> the signal read



def clip_shares(shares: dict[str, float], lo: dict[str, float], hi: dict[str, float]) -> dict[str, float]:
    """Shares (summing to 1) moved into [lo, hi] per source: x = clip(c * share, lo, hi) with the one
    scale c that makes them sum to 1 (bisection: the sum grows with c), so the sources no bound
    touches keep their ratios. Bounds that cannot sum to 1 leave the clipped shares renormalised."""
    lo_, hi_ = {n: lo.get(n, 0.0) for n in shares}, {n: hi.get(n, 1.0) for n in shares}

    def at(c: float) -> dict[str, float]:
        return {n: min(max(c * v, lo_[n]), hi_[n]) for n, v in shares.items()}

    if not sum(lo_.values()) <= 1.0 <= sum(hi_.values()):
        out = at(1.0)
        return {n: v / sum(out.values()) for n, v in out.items()}
    a, b = 0.0, 1.0
    while sum(at(b).values()) < 1.0 and b < 1e12:
        b *= 2.0
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if sum(at(mid).values()) < 1.0 else (a, mid)
    out = at(b)
    total = sum(out.values())
    return {n: v / total for n, v in out.items()}  # exact sum; moves a bound by < 1e-15


class MixController(Callback):
    name = "mix"

    def __init__(self, cfg: MixControllerConfig, sources: list[SourceConfig],
                 use_weights: Callable[[dict[str, float]], bool]):
        self.cfg, self.use_weights = cfg, use_weights
        self.base = {s.name: s.weight for s in sources}  # the configured weights
        self.boost = dict.fromkeys(sorted(set(cfg.tasks.values())), cfg.initial_boost)
        self.prev_gap: dict[str, float] = {}
        self.tokens = {"media": 0, "all": 0}  # trained tokens since the start (all ranks)
        self.history: list[dict] = []  # one entry per decision: step, gaps, boosts, shares
        self.restart_s = 0.0  # data wait of the steps right after a change (the loader's restart)
        self._changed = False
        self.shares = self._shares()  # derived from the boosts: recomputed only when they change
        self.use_weights(self.weights())  # the bounds may already move the configured shares

    # ----- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"boost": dict(self.boost), "prev_gap": dict(self.prev_gap), "tokens": dict(self.tokens),
                "history": list(self.history), "restart_s": self.restart_s}

    def load_state_dict(self, state: dict) -> None:
        self.boost = dict(state["boost"])
        self.prev_gap = dict(state["prev_gap"])
        self.tokens = dict(state["tokens"])
        self.history = list(state["history"])
        self.restart_s = float(state["restart_s"])
        self.shares = self._shares()
        self.use_weights(self.weights())  # replicated parts load first: the data position goes back
        # into a loader with the weights it was read under

    # ----- the rule ------------------------------------------------------------------------
    def weights(self) -> dict[str, float]:
        """Loader weights now (a copy; logged every step, so not recomputed there)."""
        return dict(self.shares)

    def _shares(self) -> dict[str, float]:
        """Configured weight x boost, as shares clipped to the bounds."""
        raw = {n: w * self.boost.get(self.cfg.tasks.get(n, ""), 1.0) for n, w in self.base.items()}
        total = sum(raw.values())
        return clip_shares({n: w / total for n, w in raw.items()}, self.cfg.min_share, self.cfg.max_share)

    def media_share(self) -> float | None:
        return self.tokens["media"] / self.tokens["all"] if self.tokens["all"] else None

    def decide(self, gaps: dict[str, float], step: int) -> bool:
        """Update the boosts from this check's gaps; -> whether the weights changed."""
        cfg, before = self.cfg, self.shares
        over_cap = (self.media_share() or 0.0) > cfg.max_media_share
        for task in self.boost:
            gap = gaps.get(task)
            if gap is None or not math.isfinite(gap):
                continue  # no tokens of this task in the diagnostics batches: no evidence either way
            prev = self.prev_gap.get(task)
            self.prev_gap[task] = gap
            if over_cap:
                self.boost[task] = max(1.0, self.boost[task] / cfg.up)
            elif gap < cfg.low_gap or (prev is not None and prev - gap > cfg.fall):
                self.boost[task] = min(cfg.max_boost, self.boost[task] * cfg.up)
            elif gap > cfg.high_gap:
                self.boost[task] = 1.0 + (self.boost[task] - 1.0) * (1.0 - cfg.relax)
        after = self.shares = self._shares()
        self.history.append({"step": step, "gap": dict(gaps), "boost": dict(self.boost),
                             "shares": dict(after), "media_share": self.media_share(), "over_cap": over_cap})
        return after != before

    # ----- hooks ---------------------------------------------------------------------------
    def on_diagnostics(self, trainer: Trainer, result: DiagResult) -> None:
        if trainer.step < self.cfg.warmup_steps or trainer.step >= trainer.cfg.train.steps:
            return
        gaps = getattr(result, SIGNALS[SIGNAL_OF[self.cfg.signal]].attr)
        if self.decide(gaps, trainer.step):
            self._changed = self.use_weights(self.weights())
            shares = " ".join(f"{n} {v:.2f}" for n, v in self.weights().items())
            trainer.log.info(f"step {trainer.step}: mixture -> {shares} (gap {self.cfg.signal}: "
                             + ", ".join(f"{t} {g:+.3f}" for t, g in gaps.items()) + ")")

    def on_step_end(self, trainer: Trainer, stats: StepStats) -> None:
        media = sum(stats.task_tokens.get(t, 0) for t in MEDIA_TASKS)
        self.tokens["media"] += media
        self.tokens["all"] += sum(stats.task_tokens.values())
        if self._changed:  # this step's data wait included the loader's restart
            self.restart_s += stats.data_wait_s
            self._changed = False

    def on_log(self, trainer: Trainer, stats: StepStats, scalars: dict[str, float]) -> None:
        scalars.update({f"mix/share_{n}": v for n, v in self.weights().items()})
        scalars.update({f"mix/boost_{t}": b for t, b in self.boost.items()})
        if self.media_share() is not None:
            scalars["mix/media_token_share"] = self.media_share()

    def on_train_end(self, trainer: Trainer, summary: dict) -> None:
        summary["mix"] = {"shares": self.weights(), "boost": dict(self.boost),
                          "media_share": self.media_share(), "decisions": len(self.history),
                          "restart_s": self.restart_s, "signal": self.cfg.signal}
