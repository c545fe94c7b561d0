"""Self-reducing sums: a dataclass of float fields, `dict[str, float]` fields (the same keys in the
same order on every rank) and nested `Sums`, which all-reduces itself in one float64 collective.

    sums = StepSums(); sums.tokens += n; ...; total = sums.reduce(env, device)  # all ranks' sums

One process: `reduce` returns `self`, unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import torch

from mmtrain.parallel.distributed import DistEnv, all_reduce


@dataclasses.dataclass
class Sums:
    def flat(self) -> list[float]:
        """Every number, in field order (dict fields in their keys' order)."""
        out: list[float] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Sums):
                out += value.flat()
            elif isinstance(value, dict):
                out += [float(v) for v in value.values()]
            else:
                out.append(float(value))
        return out

    def _fill(self, numbers: Iterator[float]) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Sums):
                value._fill(numbers)
            elif isinstance(value, dict):
                setattr(self, f.name, {k: next(numbers) for k in value})
            else:
                setattr(self, f.name, next(numbers))

    def reduce(self, env: DistEnv, device: torch.device) -> Sums:
        """A copy holding the sums over all ranks (a collective: every rank calls it)."""
        if not env.distributed:
            return self
        vec = torch.tensor(self.flat(), dtype=torch.float64, device=device)
        total = copy.deepcopy(self)
        total._fill(iter(all_reduce(vec, env).tolist()))
        return total
