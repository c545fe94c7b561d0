"""The run's time left, shown on the progress line: the steps left x the recent step time, plus every
scheduled event left x its own measured duration.

    eta = steps_left x step_s + evals_left x eval_s + diagnostics_left x diag_s + ckpts_left x ckpt_s

A step-only estimate (a progress bar's) is wrong all run long when evaluations with captions,
diagnostics passes and checkpoints take a tenth of it. Each event is timed where the loop runs it;
the schedule (`train.eval_every`, `diagnostics.every`, `train.ckpt_every`, plus the final evaluation,
diagnostics and checkpoint) says how many are left. Evaluation and diagnostics also run at step 0,
so both are measured before the first step; a checkpoint is estimated at 0 s until the first one.
`train.time_limit_min` caps the steps left.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

EVENTS = ("eval", "diagnostics", "checkpoint")
RECENT_STEPS = 50  # the running median's window: spans a few log steps, still follows drift


def due_left(step: int, total: int, every: int) -> int:
    """Events of a schedule still to run once `step` steps are done, counting step `step`'s own (the
    progress line is printed before them): the multiples of `every` in [step, total), plus the final
    one at `total` (every run ends with one)."""
    if step > total:
        return 0
    inner = (total - 1) // every - (step - 1) // every if every else 0
    return inner + 1


@dataclass
class Eta:
    total_steps: int
    every: dict[str, int]  # event -> its interval in steps (0: only the final one)
    time_limit_s: float = 0.0  # train.time_limit_min x 60; 0: none
    _steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    steps_s: float = 0.0  # all ordinary steps' wall time
    _events: dict[str, list[float]] = field(default_factory=dict)

    def step_done(self, seconds: float) -> None:
        """Wall time of one ordinary step: the step, its logging and callbacks, no scheduled event."""
        self._steps.append(seconds)
        self.steps_s += seconds

    def event_done(self, kind: str, seconds: float) -> None:
        if kind not in EVENTS:
            raise ValueError(f"eta: unknown event {kind!r} (one of {EVENTS})")
        self._events.setdefault(kind, []).append(seconds)

    def event_s(self, kind: str) -> float:
        """The mean of this event's recent durations (the last 3: evals grow as captions lengthen)."""
        times = self._events.get(kind)
        return statistics.fmean(times[-3:]) if times else 0.0

    def remaining(self, step: int, elapsed_s: float = 0.0) -> float | None:
        """Seconds left after `step` steps (None before a step has been timed). `elapsed_s`: since
        launch, for the time limit."""
        if not self._steps:
            return None
        step_s = statistics.median(self._steps)
        steps_left = self.total_steps - step
        if self.time_limit_s:
            steps_left = min(steps_left, max(0, math.ceil((self.time_limit_s - elapsed_s) / step_s)))
        end = step + steps_left
        events = sum(due_left(step, end, self.every.get(k, 0)) * self.event_s(k) for k in EVENTS)
        return steps_left * step_s + events


    def totals(self) -> dict[str, float]:
        """Seconds spent per event kind so far (the summary's time breakdown)."""
        return {k: sum(self._events.get(k, [])) for k in EVENTS}


def format_eta(seconds: float | None) -> str:
    """'eta 7m05s' (or 'eta 1h02m'); '' before it is known."""
    if seconds is None:
        return ""
    s = int(round(seconds))
    if s >= 3600:
        return f"eta {s // 3600}h{s % 3600 // 60:02d}m"
    return f"eta {s // 60}m{s % 60:02d}s"
