"""Prefetch bounded in bytes (`data.prefetch_bytes`), beside DataLoader's bound in batches.

DataLoader bounds ready batches by count (prefetch_factor per worker); a `small` batch carries
~0.3 GB of float32 patches, so count alone lets a loader that outruns a slow step hold GBs of
host RAM per rank. Here each DataLoader worker has a share (prefetch_bytes / workers) and starts
its next batch only while the bytes it sent and the main process has not taken are below it: at
most share + one batch per worker. Shares are per worker, not pooled: the main process takes
batches round-robin, so a pooled budget filled by one worker could block the worker it waits on.
"""

from __future__ import annotations

import multiprocessing as mp
import os

WAIT_S = 0.1  # re-check period of a waiting worker (closed flag, parent gone)


class ByteBudget:
    """Sent-but-not-taken bytes per DataLoader worker, in shared memory (made before the workers
    fork, from the default start method's context, which DataLoader uses too)."""

    def __init__(self, total_bytes: int, num_workers: int):
        ctx = mp.get_context()
        self.share = total_bytes // num_workers if total_bytes else 0  # 0: no byte bound, only counted
        self._out = ctx.Array("q", num_workers, lock=False)
        self._peak = ctx.Value("q", 0, lock=False)
        self._closed = ctx.Value("b", 0, lock=False)
        self._cond = ctx.Condition()
        self._parent = os.getpid()

    def wait_for_room(self, worker: int) -> None:
        """In a worker, before it builds a batch: wait while its share is used up."""
        if not self.share:
            return
        with self._cond:
            while self._out[worker] >= self.share and not self._closed.value and os.getppid() == self._parent:
                self._cond.wait(WAIT_S)

    def sent(self, worker: int, nbytes: int) -> None:
        with self._cond:
            self._out[worker] += nbytes
            self._peak.value = max(self._peak.value, sum(self._out))

    def taken(self, worker: int, nbytes: int) -> None:
        """In the main process, as it takes a batch."""
        with self._cond:
            self._out[worker] -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        """The consumer stopped: no worker waits any more (DataLoader then shuts them down)."""
        with self._cond:
            self._closed.value = 1
            self._cond.notify_all()

    @property
    def peak_bytes(self) -> int:
        """Most bytes sent and not yet taken at any moment, all workers together."""
        return self._peak.value
