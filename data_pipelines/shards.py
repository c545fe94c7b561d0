"""Shards: spec expansion, the per-(rank, worker) shard plan, and reading samples out of a tar.

A sample is the tar members that share a key (webdataset's rule: the basename up to its first
dot; the rest, lower-cased, is the member's extension, e.g. `doc7.0.png` -> key `doc7`, ext
`0.png`). A position in a source's stream is (epoch, shard_ord, index): the `index`-th sample
of the shard at place `shard_ord` of this worker's shard order in `epoch`; positions are what
the loader checkpoints and re-reads on resume.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.remote import PipeStream, is_remote, open_url
from mmtrain.data_pipelines.rng import CounterRng

try:
    from braceexpand import braceexpand
except ImportError:  # webdataset depends on it; keep a tiny fallback anyway
    braceexpand = None

_TAR_EXTS = (".tar", ".tar.gz", ".tgz")
_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class RawSample(NamedTuple):
    key: str
    members: dict[str, bytes]  # ext -> bytes
    index: int  # the sample's place in its shard (counting every sample, owned or not)
    too_large: str = ""  # why a member was left unread (over max_member_bytes): the sample is skipped


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
    names = _braces(spec)
    for i, s in enumerate(names):
        if s.startswith("pipe:") or "://" in s:
            out.append(s)
        elif 0 < i < len(names) - 1 and s.endswith(_TAR_EXTS) and not glob.has_magic(s):
            # inside a brace range only the ends are checked: stat-ing 100k paths on every rank
            # is slow on network file systems; a hole is found when read (counted open_failed)
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
    read: ReadOptions = field(default_factory=lambda: ReadOptions())
    _order: tuple = field(default=(None, None), init=False, repr=False, compare=False)

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
        """This worker's shard order in `epoch`, computed once per epoch (a permutation of 100k
        shards takes ~0.1 s: not something to redo at every shard)."""
        if self._order[0] != epoch:
            n = len(self.urls)
            order = CounterRng(self.seed, self.source, "shards", epoch).permutation(n) if self.shuffle \
                else list(range(n))
            if not self.split_samples:
                order = order[self.rank :: self.world_size][self.worker :: self.num_workers]
            self._order = (epoch, order)
        return self._order[1]

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
@dataclass(frozen=True)
class ReadOptions:
    """How shards are read: a cap on member bytes, retries of remote/pipe shards, stall timeout."""

    max_member_bytes: int = 1 << 28
    retries: int = 3  # extra tries of a `pipe:`/remote shard that fails (resuming after the last sample)
    backoff_s: float = 1.0  # wait before retry i: backoff_s * 2**(i-1)
    stall_timeout_s: float = 300.0  # a command that sends nothing for this long has failed
    open_timeout_s: float = 60.0  # a file not opened within this long (a hung mount, a FIFO) has failed


class _Info(tarfile.TarInfo):
    """Notes how an archive ended: tarfile stops iterating *silently* when the data ends at a
    header boundary, inside a header, or at a garbage header; only a zero block is a real end."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):
            tar.ended = L.TRUNCATED_TAR
            raise
        except tarfile.EOFHeaderError:
            raise
        except tarfile.InvalidHeaderError:
            tar.ended = L.BAD_SHARD
            raise


@dataclass
class _Outcome:
    """What one attempt at reading a shard found."""

    next_index: int = 0  # past the last sample yielded: a retry starts here
    total: int = 0  # samples the archive held
    complete: bool = False  # the data ended (well or not), not the consumer: judge the exit status
    problem: tuple[str, str] | None = None  # (reason, key): the archive is cut or corrupt
    error: str | None = None  # the file or command failed (a retry may help if remote)


def iter_shard(
    url: str,
    start: int = 0,
    keep: Callable[[int], bool] | None = None,
    on_error: Callable[[str, str], None] | None = None,
    stop: int | None = None,
    opts: ReadOptions = ReadOptions(),
) -> Iterator[RawSample]:
    """Samples of one shard with index >= start (and < stop) for which keep(index) holds.

    Members of other samples are skipped without reading their data. Problems are reported once
    as on_error(reason, key): an archive cut short (at any byte, the partial last sample dropped),
    a corrupt archive, a shard without samples, a shard that cannot be read. A `pipe:`/remote
    shard whose command fails (exit status, stall) is retried with backoff, resuming after the
    last sample it gave, so no sample is delivered twice.
    """
    report = on_error or (lambda reason, key: None)
    tries = opts.retries + 1 if is_remote(url) else 1
    for attempt in range(tries):
        if attempt:
            time.sleep(opts.backoff_s * 2 ** (attempt - 1))
        out = _Outcome(next_index=start)
        yield from _attempt(url, start, keep, stop, opts, out)
        if out.error is None:
            if out.problem is not None:
                report(*out.problem)
            elif out.total == 0 and out.complete:
                report(L.EMPTY_SHARD, "")
            return
        start = out.next_index
    warnings.warn(f"shard {url}: {out.error}" + (f" ({tries} tries)" if tries > 1 else ""), stacklevel=2)
    report(L.OPEN_FAILED, "")


def _attempt(url, start, keep, stop, opts: ReadOptions, out: _Outcome) -> Iterator[RawSample]:
    try:
        stream = open_url(url, opts.stall_timeout_s, opts.open_timeout_s)
    except OSError as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    try:
        yield from _read_tar(stream, start, keep, stop, opts, out)
    except OSError as e:  # the file or the command's stream failed (not the archive's format)
        out.error = f"{type(e).__name__}: {e}"
    finally:  # also when the consumer stops early: then the command is stopped, not judged
        failed = _finish(stream, out.complete and out.error is None)
        out.error = out.error or failed


def _finish(stream, read_all: bool) -> str | None:
    if isinstance(stream, PipeStream):
        return stream.finish(read_all)
    try:
        stream.close()  # webdataset's pipes raise their exit status here
    except Exception as e:
        return f"{type(e).__name__}: {e}" if read_all else None
    return None


def _read_tar(stream, start, keep, stop, opts: ReadOptions, out: _Outcome) -> Iterator[RawSample]:
    key, index, members, bad = None, -1, None, ""
    try:
        tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_Info)  # noqa: SIM115 (a generator owns it)
    except tarfile.ReadError as e:
        out.complete = True
        msg = str(e)
        reason = L.TRUNCATED_TAR if "truncated" in msg else L.BAD_SHARD
        out.problem = None if "empty file" in msg else (reason, "")
        return
    try:
        for info in tar:
            m = _MEMBER.match(info.name)
            if not info.isreg() or m is None or os.path.basename(info.name).startswith("__"):
                continue
            if m.group(1) != key:
                if members is not None:
                    yield RawSample(key, members, index, bad)
                    out.next_index = index + 1
                key, index, bad = m.group(1), index + 1, ""
                out.total = index + 1
                if stop is not None and index >= stop:
                    return
                members = {} if index >= start and (keep is None or keep(index)) else None
            if members is not None:
                if info.size > opts.max_member_bytes:  # skipped unread: the sample is counted too_large
                    bad = f"{m.group(2)} has {info.size} bytes > max_member_bytes {opts.max_member_bytes}"
                else:
                    members[m.group(2).lower()] = tar.extractfile(info).read()
            tar.members = []  # stream mode keeps every TarInfo otherwise
    except (tarfile.TarError, EOFError, ValueError):
        out.problem, out.complete = (L.TRUNCATED_TAR, key or ""), True
        return
    ended = getattr(tar, "ended", None)
    if ended is not None:  # cut at a member boundary or a garbage header: the last sample may be partial
        out.problem = (ended, key or "")
        out.complete = True
        return
    if members is not None:
        yield RawSample(key, members, index, bad)
        out.next_index = index + 1
    out.complete = True
