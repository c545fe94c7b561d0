"""Weighted mixture of sources: which source the next document comes from.

Draws are per document (a chunk of a long text counts as one), from a counter-based RNG keyed
by (seed, rank, worker): the same seed gives the same interleave, and the state is a counter.
An exhausted source (finite splits) leaves the mixture; the others keep their relative weights.
"""

from __future__ import annotations

from mmtrain.data_pipelines.rng import CounterRng


class Mixer:
    def __init__(self, weights: list[float], rng: CounterRng):
        if not weights or min(weights) <= 0:
            raise ValueError(f"weights: need at least one, all > 0 (got {weights})")
        self.weights = list(weights)
        self.rng = rng
        self.active = [True] * len(weights)
        self.counts = [0] * len(weights)  # documents drawn per source

    def choose(self) -> int | None:
        """Index of the source to draw from next; None once every source is exhausted."""
        live = [(i, w) for i, (w, a) in enumerate(zip(self.weights, self.active)) if a]
        if not live:
            return None
        u = self.rng.random() * sum(w for _, w in live)
        for i, w in live:
            u -= w
            if u < 0:
                return i
        return live[-1][0]

    def took(self, i: int) -> None:
        self.counts[i] += 1

    def exhausted(self, i: int) -> None:
        self.active[i] = False

    def ratios(self) -> list[float]:
        total = sum(self.counts)
        return [c / total if total else 0.0 for c in self.counts]

    def state_dict(self) -> dict:
        return {"rng": self.rng.counter, "active": list(self.active), "counts": list(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.counter = state["rng"]
        self.active = list(state["active"])
        self.counts = list(state["counts"])
