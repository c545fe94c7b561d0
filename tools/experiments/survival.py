"""Onset of pixel reading as a time-to-event: per-run onset, Kaplan-Meier medians, the log-rank test.

A run's onset is the first diagnostics check whose mismatch gap reaches a threshold; a run that
never reaches it is right-censored at its last check (it may still start later). Across seeds the
Kaplan-Meier estimate handles the censored runs; the log-rank test compares two arms' curves.
"""

from __future__ import annotations

import math


def onset(curve: list[tuple[int, float]], threshold: float) -> tuple[int | None, int | None]:
    """(first step with gap >= threshold or None, last step checked or None). curve: (step, gap)."""
    steps = sorted(curve)
    for step, gap in steps:
        if gap >= threshold:
            return step, step
    return None, (steps[-1][0] if steps else None)


def as_events(onsets: list[tuple[int | None, int | None]]) -> list[tuple[int, bool]]:
    """(time, event) pairs: the onset step with event True, or the last check, censored."""
    return [(o, True) if o is not None else (last, False) for o, last in onsets if last is not None]


def km_curve(events: list[tuple[int, bool]]) -> list[tuple[int, float]]:
    """Kaplan-Meier survival S(t) (share of runs not yet reading) after each event time."""
    at_risk, surv, out = len(events), 1.0, []
    for t in sorted({t for t, _ in events}):
        d = sum(1 for u, e in events if u == t and e)
        if d:
            surv *= 1.0 - d / at_risk
            out.append((t, surv))
        at_risk -= sum(1 for u, _ in events if u == t)
    return out


def km_median(events: list[tuple[int, bool]]) -> int | None:
    """The first time S(t) <= 0.5, or None when fewer than half the runs had started by the end."""
    return next((t for t, s in km_curve(events) if s <= 0.5), None)


def log_rank(a: list[tuple[int, bool]], b: list[tuple[int, bool]]) -> tuple[float, float]:
    """(chi-square with 1 degree of freedom, two-sided p) of the log-rank test of arms a and b."""
    observed = expected = variance = 0.0
    for t in sorted({t for t, e in a + b if e}):
        n1 = sum(1 for u, _ in a if u >= t)
        n2 = sum(1 for u, _ in b if u >= t)
        d1 = sum(1 for u, e in a if u == t and e)
        d = d1 + sum(1 for u, e in b if u == t and e)
        n = n1 + n2
        observed += d1
        expected += d * n1 / n
        if n > 1:
            variance += d * (n1 / n) * (n2 / n) * (n - d) / (n - 1)
    if variance == 0.0:
        return 0.0, 1.0
    chi2 = (observed - expected) ** 2 / variance
    return chi2, math.erfc(math.sqrt(chi2 / 2.0))  # P(chi2_1 > x) = erfc(sqrt(x / 2))
