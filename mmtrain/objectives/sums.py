"""Self-reducing sums: a dataclass of float fields, `dict[str, float]` fields (the same keys in the
same order on every rank) and nested `Sums`, which all-reduces itself in one float64 collective.

    sums = StepSums(); sums.tokens += n; ...; total = sums.reduce(env, device)  # all ranks' sums

One process: `reduce` returns `self`, unchanged. Fields may hold 0-dim device tensors (the
objective adds them without a host sync); `floats()` -- and `reduce` -- read them all in one transfer.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import torch

from mmtrain.parallel.distributed import DistEnv, all_reduce


@dataclasses.dataclass
class Sums:
    def flat(self) -> list[float | torch.Tensor]:
        """Every number (a python number or a 0-dim tensor), in field order (dicts in their keys')."""
        out: list = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Sums):
                out += value.flat()
            elif isinstance(value, dict):
                out += list(value.values())
            else:
                out.append(value)
        return out

    def _vector(self, device: torch.device) -> torch.Tensor:
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in self.flat()])

    def floats(self) -> Sums:
        """A copy with every number a python float (one host transfer); `self` when all are already."""
        tensors = [v for v in self.flat() if isinstance(v, torch.Tensor)]
        if not tensors:
            return self
        total = copy.deepcopy(self)
        total._fill(iter(self._vector(tensors[0].device).tolist()))
        return total

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
        vec = self._vector(device)
        total = copy.deepcopy(self)
        total._fill(iter(all_reduce(vec, env).tolist()))
        return total
