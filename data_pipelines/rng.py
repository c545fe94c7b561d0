"""Counter-based randomness: the state of a stream is (key, counter), two ints to checkpoint.

Every random choice in the pipeline (shard order, shuffle buffer, mixture) comes from a
`CounterRng` keyed by what it belongs to (seed, source, rank, worker, epoch), so resuming
needs only the counter, and the choices never depend on Python's or NumPy's global RNGs.
"""

from __future__ import annotations

import hashlib

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def hash64(*parts) -> int:
    """A stable 64-bit hash of simple values (ints, strs, tuples), the same in every process."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class CounterRng:
    """Draw i is splitmix64(hash(key) + i * golden): random access, tiny state."""

    def __init__(self, *key, counter: int = 0):
        self.seed = hash64(*key)
        self.counter = counter

    def bits(self) -> int:
        self.counter += 1
        return _splitmix64((self.seed + self.counter * _GOLDEN) & _MASK)

    def random(self) -> float:
        """Uniform in [0, 1)."""
        return (self.bits() >> 11) * (1.0 / (1 << 53))

    def randrange(self, n: int) -> int:
        return self.bits() % n  # bias < n / 2^64: irrelevant at these sizes

    def permutation(self, n: int) -> list[int]:
        """Fisher-Yates over range(n)."""
        order = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.randrange(i + 1)
            order[i], order[j] = order[j], order[i]
        return order
