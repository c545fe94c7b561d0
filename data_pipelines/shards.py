"""Shards: spec expansion, the per-(rank, worker) shard plan, and reading samples out of a tar.

A sample is the tar members that share a key (webdataset's rule: the basename up to its first
dot; the rest, lower-cased, is the member's extension, e.g. `doc7.0.png` -> key `doc7`, ext
`0.png`). A position in a source's stream is (epoch, shard_ord, index): the `index`-th sample
of the shard at place `shard_ord` of this worker's shard order in `epoch`; positions are what
the loader checkpoints and re-reads on resume.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from data_pipelines import ledger as L
from data_pipelines.errors import DataError
from data_pipelines.rng import CounterRng

try:
    from braceexpand import braceexpand
except ImportError:  # webdataset depends on it; keep a tiny fallback anyway
    braceexpand = None

_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class RawSample(NamedTuple):
    key: str
    members: dict[str, bytes]  # ext -> bytes
    index: int  # the sample's place in its shard (counting every sample, owned or not)


# ----- spec expansion -------------------------------------------------------------------------
def _braces(spec: str) -> list[str]:
    if braceexpand is not None:
        return list(braceexpand(spec))
    m = re.search(r"\{(\d+)\.\.(\d+)\}", spec)
    if not m:
        return [spec]
    lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
    head, tail = spec[: m.start()], spec[m.end() :]
    return [x for i in range(lo, hi + 1) for x in _braces(f"{head}{i:0{width}d}{tail}")]


def expand_spec(spec: str) -> list[str]:
    """One spec -> shard URLs. Brace ranges, globs, directories (their *.tar), `pipe:`/URLs as-is."""
    out: list[str] = []
    for s in _braces(spec):
        if s.startswith("pipe:") or "://" in s:
            out.append(s)
        elif glob.has_magic(s):
            out.extend(sorted(p for p in glob.glob(s) if os.path.isfile(p)))
        elif os.path.isdir(s):
            out.extend(sorted(glob.glob(os.path.join(s, "*.tar"))))
        elif os.path.isfile(s):
            out.append(s)
        else:
            raise DataError(f"shard not found: {s}" + (f" (from spec {spec!r})" if s != spec else ""))
    if not out:
        raise DataError(f"shard spec matches nothing: {spec!r}")
    return out


def expand_shards(specs: list[str], source: str = "") -> list[str]:
    if not specs:
        raise DataError(f"source {source!r}: no shard specs given")
    return [url for spec in specs for url in expand_spec(spec)]


# ----- the shard plan -------------------------------------------------------------------------
@dataclass
class ShardPlan:
    """Which shards (and samples) one (rank, worker) reads, epoch by epoch.

    Epoch mode: every epoch a permutation of all shards (the same on every rank), split by rank,
    then by worker: within an epoch each sample is read by exactly one (rank, worker). With fewer
    shards than ranks x workers it falls back to splitting by sample: every worker reads every
    shard and keeps the samples with (shard_ord + index) % groups == its group id.
    Resample mode: shard_ord draws a shard with replacement, forever (epoch stays 0).
    """

    urls: list[str]
    source: str
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1
    shuffle: bool = True
    resample: bool = False
    epochs: int | None = None  # None: forever

    @property
    def groups(self) -> int:
        return self.world_size * self.num_workers

    @property
    def group_id(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def split_samples(self) -> bool:
        return not self.resample and len(self.urls) < self.groups

    def _my_shards(self, epoch: int) -> list[int]:
        n = len(self.urls)
        rng = CounterRng(self.seed, self.source, "shards", epoch)
        order = rng.permutation(n) if self.shuffle else list(range(n))
        if self.split_samples:
            return order
        return order[self.rank :: self.world_size][self.worker :: self.num_workers]

    def shard_at(self, epoch: int, ord: int) -> str | None:
        """URL of this worker's `ord`-th shard in `epoch`; None past the epoch's (or stream's) end."""
        if self.epochs is not None and epoch >= self.epochs:
            return None
        if self.resample:
            key = (self.seed, self.source, "resample", self.rank, self.worker)
            return self.urls[CounterRng(*key, counter=ord).randrange(len(self.urls))]
        mine = self._my_shards(epoch)
        return self.urls[mine[ord]] if ord < len(mine) else None

    def owns(self, ord: int, index: int) -> bool:
        return not self.split_samples or (ord + index) % self.groups == self.group_id

    def owns_shard(self, ord: int) -> bool:
        """Whether this worker reports shard-level problems (one reporter per shard)."""
        return not self.split_samples or ord % self.groups == self.group_id


# ----- tar reading ----------------------------------------------------------------------------
def _open(url: str):
    if url.startswith("pipe:") or "://" in url:
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open(url, "rb")


def _close(stream) -> None:
    with contextlib.suppress(Exception):  # a pipe we stopped reading early exits non-zero: nothing lost
        stream.close()


def iter_shard(
    url: str,
    start: int = 0,
    keep: Callable[[int], bool] | None = None,
    on_error: Callable[[str, str], None] | None = None,
    stop: int | None = None,
) -> Iterator[RawSample]:
    """Samples of one shard with index >= start (and < stop) for which keep(index) holds.

    Members of other samples are skipped without reading their data. Problems are reported as
    on_error(reason, key) and end the shard: an unreadable shard, a truncated tar (the partial
    last sample is dropped), a shard without samples.
    """
    report = on_error or (lambda reason, key: None)
    try:
        stream = _open(url)
    except Exception:
        report(L.OPEN_FAILED, "")
        return
    try:
        n = yield from _read_tar(stream, start, keep, report, stop)
        if n == 0:
            report(L.EMPTY_SHARD, "")
    finally:
        _close(stream)


def _read_tar(stream, start, keep, report, stop) -> Iterator[RawSample]:
    """Yields wanted samples; returns how many samples the tar held (0 if it held none)."""
    key, index, members = None, -1, None
    try:
        tar = tarfile.open(fileobj=stream, mode="r|*")  # noqa: SIM115 (a generator owns it)
    except tarfile.ReadError as e:
        report(L.EMPTY_SHARD if "empty" in str(e) else L.TRUNCATED_TAR, "")
        return -1
    try:
        for info in tar:
            m = _MEMBER.match(info.name)
            if not info.isreg() or m is None or os.path.basename(info.name).startswith("__"):
                continue
            if m.group(1) != key:
                if members is not None:
                    yield RawSample(key, members, index)
                key, index = m.group(1), index + 1
                if stop is not None and index >= stop:
                    return index
                wanted = index >= start and (keep is None or keep(index))
                members = {} if wanted else None
            if members is not None:
                members[m.group(2).lower()] = tar.extractfile(info).read()
            tar.members = []  # stream mode keeps every TarInfo otherwise
    except (tarfile.TarError, EOFError, OSError, ValueError):
        report(L.TRUNCATED_TAR, key or "")
        return max(index + 1, 1)
    if members is not None:
        yield RawSample(key, members, index)
    return index + 1
