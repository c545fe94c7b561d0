"""One source inside one worker: read -> shuffle -> decode/tokenize -> documents, resumable.

State is small: the reader's cursor (epoch, shard_ord, index), the positions of the raw samples
in the shuffle buffer, the shuffle RNG counter, the pending text chunks, and counters. On
restore the buffered samples are re-read from their shards (members of other samples are
skipped unread) instead of pickling decoded data.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from mmtrain.data_pipelines import ledger as L
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.documents import Document, make_documents
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.ledger import SkipSample
from mmtrain.data_pipelines.rng import CounterRng
from mmtrain.data_pipelines.shards import RawSample, ShardPlan, iter_shard

Pos = tuple[int, int, int]  # (epoch, shard_ord, index)
Item = tuple[Pos, str, RawSample]  # position, shard url, sample
MAX_CONSECUTIVE_SKIPS = 10_000


class Reader:
    """This worker's samples of one source, shard after shard, epoch after epoch."""

    def __init__(self, plan: ShardPlan, report: Callable[[str, str, str], None], cursor: Pos = (0, 0, 0)):
        self.plan, self.report, self.cursor = plan, report, tuple(cursor)
        self._it = None
        self._got_any = False
        self._barren = 0  # consecutive shards that gave this worker nothing

    def _open(self) -> bool:
        epoch, ord, index = self.cursor
        url = self.plan.shard_at(epoch, ord)
        if url is None:
            if self.plan.epochs is not None and epoch + 1 >= self.plan.epochs:
                return False
            self.cursor = (epoch + 1, 0, 0)
            return self._open()
        on_error = (lambda reason, key: self.report(url, key, reason)) if self.plan.owns_shard(ord) else None
        self._it = iter_shard(url, start=index, keep=lambda i: self.plan.owns(ord, i), on_error=on_error,
                              opts=self.plan.read)
        self._url, self._got_any = url, False
        return True

    def _end_shard(self) -> None:
        epoch, ord, _ = self.cursor
        self._it, self.cursor = None, (epoch, ord + 1, 0)
        self._barren = 0 if self._got_any else self._barren + 1
        limit = 10 * len(self.plan.urls) + 10 if self.plan.resample else len(self.plan.urls) + 1
        if self._barren > limit:
            raise DataError(
                f"source {self.plan.source!r}: rank {self.plan.rank} worker {self.plan.worker} read "
                f"{self._barren} shards without a sample it owns (all empty or unreadable, or fewer "
                f"samples than ranks x workers = {self.plan.groups})"
            )

    def next(self) -> Item | None:
        while True:
            if self._it is None and not self._open():
                return None
            sample = next(self._it, None)
            if sample is None:
                self._end_shard()
                continue
            epoch, ord, _ = self.cursor
            self.cursor, self._got_any = (epoch, ord, sample.index + 1), True
            return (epoch, ord, sample.index), self._url, sample


def raw_bytes(item: Item) -> int:
    return sum(len(v) for v in item[2].members.values())


class Shuffler:
    """Reservoir shuffle of raw (undecoded) samples, bounded in samples and in bytes (it fills to
    `size` samples or `max_bytes`, whichever comes first: a function of the data, so resume
    replays it); pass-through when size is 0."""

    def __init__(self, reader: Reader, size: int, rng: CounterRng, max_bytes: int = 1 << 62):
        self.reader, self.size, self.rng, self.max_bytes = reader, size, rng, max_bytes
        self.buf: list[Item] = []
        self.bytes = 0

    def set_buffer(self, buf: list[Item]) -> None:
        self.buf, self.bytes = buf, sum(map(raw_bytes, buf))

    def next(self) -> Item | None:
        if self.size == 0:
            return self.reader.next()
        while len(self.buf) < self.size and self.bytes < self.max_bytes:
            item = self.reader.next()
            if item is None:
                break
            self.buf.append(item)
            self.bytes += raw_bytes(item)
        if not self.buf:
            return None
        j = self.rng.randrange(len(self.buf))
        self.buf[j], self.buf[-1] = self.buf[-1], self.buf[j]
        item = self.buf.pop()
        self.bytes -= raw_bytes(item)
        return item


def fetch(plan: ShardPlan, positions: list[Pos]) -> dict[Pos, tuple[str, RawSample]]:
    """Re-read the raw samples at `positions` (one pass over each shard involved, up to the last)."""
    want: dict[tuple[int, int], set[int]] = defaultdict(set)
    for epoch, ord, index in positions:
        want[(epoch, ord)].add(index)
    out = {}
    for (epoch, ord), indices in want.items():
        url = plan.shard_at(epoch, ord)
        if url is None:
            break
        for s in iter_shard(url, keep=indices.__contains__, stop=max(indices) + 1, opts=plan.read):
            out[(epoch, ord, s.index)] = (url, s)
    missing = [p for p in positions if tuple(p) not in out]
    if missing:
        raise DataError(f"source {plan.source!r}: cannot restore the data state, samples {missing[:3]} "
                        "are gone (shards changed since the checkpoint?)")
    return out


def new_stats() -> dict:
    return {"seen": 0, "ok": 0, "docs": 0, "skipped": Counter(), "kinds": Counter(),
            "text_tokens": 0, "visual_tokens": 0, "max_doc_tokens": 0, "kind_tokens": Counter()}


class SourceStream:
    """Documents of one source for one worker; skipped samples go to `report` and the stats."""

    def __init__(self, index: int, plan: ShardPlan, tok, cfg: DataConfig, shuffle: int,
                 report: Callable[[str, str, str], None]):
        self.index, self.plan, self.tok, self.cfg, self.report_ledger = index, plan, tok, cfg, report
        self.reader = Reader(plan, self._report)
        rng = CounterRng(cfg.seed, plan.source, "shuffle", plan.rank, plan.worker)
        self.shuffler = Shuffler(self.reader, shuffle, rng, cfg.shuffle_buffer_bytes)
        self.pending: tuple[Pos, Sequence[Document], int] | None = None  # a long text: the next chunk
        self.stats = new_stats()
        self._skips_in_a_row = 0

    # ----- reading --------------------------------------------------------------------------
    def _report(self, url: str, key: str, reason: str) -> None:
        self.stats["seen"] += 1
        self.stats["skipped"][reason] += 1
        self.report_ledger(url, key, reason)
        self._check_failure_rate()
        self._skips_in_a_row += 1
        if self._skips_in_a_row > MAX_CONSECUTIVE_SKIPS:
            raise DataError(f"source {self.plan.source!r}: {MAX_CONSECUTIVE_SKIPS} bad samples in a row "
                            f"(last: {reason} in {url})")

    def _check_failure_rate(self) -> None:
        seen, bad = self.stats["seen"], sum(self.stats["skipped"].values())
        if seen >= max(1, self.cfg.min_samples_for_failure_rate) and bad > self.cfg.max_failure_rate * seen:
            top = ", ".join(f"{r} {n}" for r, n in self.stats["skipped"].most_common(3))
            raise DataError(f"source {self.plan.source!r}: {bad} of {seen} samples bad ({bad / seen:.1%} > "
                            f"max_failure_rate {self.cfg.max_failure_rate:.1%}); by reason: {top}; "
                            "see the ledger for shards and keys")

    def _chunk(self, pos: Pos, docs: Sequence[Document], i: int) -> Document:
        """Chunk i of a sample's documents, marked with how to re-create it on resume."""
        doc = docs[i]
        doc.ident = (self.index, tuple(pos), i)
        return doc

    def next_doc(self) -> Document | None:
        """The next document, or None when the source is exhausted (finite splits only)."""
        if self.pending is not None:
            pos, docs, i = self.pending
            self.pending = (pos, docs, i + 1) if i + 1 < len(docs) else None
            return self._emit(self._chunk(pos, docs, i))
        while (item := self.shuffler.next()) is not None:
            pos, url, raw = item
            try:
                kind, docs = make_documents(raw, self.tok, self.cfg)
            except SkipSample as e:
                self._report(url, raw.key, e.reason)
                continue
            except Exception as e:  # a library bug on one odd sample must not end a week-long run
                warnings.warn(f"{url} {raw.key}: {type(e).__name__}: {e}", stacklevel=1)
                self._report(url, raw.key, L.UNEXPECTED)
                continue
            self.stats["seen"] += 1
            self.stats["ok"] += 1
            self.stats["kinds"][kind] += 1
            self._skips_in_a_row = 0
            self._check_failure_rate()
            self.pending = (pos, docs, 1) if len(docs) > 1 else None
            return self._emit(self._chunk(pos, docs, 0))
        return None

    def _emit(self, doc: Document) -> Document:
        st = self.stats
        st["docs"] += 1
        st["visual_tokens"] += doc.n_visual
        st["text_tokens"] += len(doc) - doc.n_visual
        st["kind_tokens"].update({f"{doc.kind}/text": len(doc) - doc.n_visual,
                                  f"{doc.kind}/visual": doc.n_visual})
        st["max_doc_tokens"] = max(st["max_doc_tokens"], len(doc))
        return doc

    # ----- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "cursor": list(self.reader.cursor),
            "buffer": [list(pos) for pos, _, _ in self.shuffler.buf],
            "rng": self.shuffler.rng.counter,
            "chunks": [[*self.pending[0], self.pending[2]]] if self.pending else [],
            "stats": {k: dict(v) if isinstance(v, Counter) else v for k, v in self.stats.items()},
        }

    def positions_needed(self, state: dict) -> list[Pos]:
        return [tuple(p) for p in state["buffer"]] + [tuple(c[:3]) for c in state["chunks"]]

    def load_state_dict(self, state: dict, raws: dict[Pos, tuple[str, RawSample]]) -> None:
        """Restore from `state`, with the raw samples it names already re-read into `raws`."""
        self.reader.cursor = tuple(state["cursor"])
        self.reader._it = None
        self.shuffler.rng.counter = state["rng"]
        self.shuffler.set_buffer([(tuple(p), *raws[tuple(p)]) for p in state["buffer"]])
        self.pending = None
        for *pos, chunk in state["chunks"]:
            _, docs = make_documents(raws[tuple(pos)][1], self.tok, self.cfg)
            self.pending = (tuple(pos), docs, chunk)
        st = state["stats"]
        self.stats = {k: Counter(v) if isinstance(v, dict) else v for k, v in st.items()}

    def regenerate(self, ident: tuple, raws: dict[Pos, tuple[str, RawSample]]) -> Document:
        """Re-create a document the packer held when the state was saved."""
        _, pos, chunk = ident
        try:
            return self._chunk(pos, make_documents(raws[tuple(pos)][1], self.tok, self.cfg)[1], chunk)
        except (SkipSample, IndexError) as e:
            raise DataError(f"source {self.plan.source!r}: cannot re-create sample {pos} on resume ({e}); "
                            "did the data or the data config change?") from None
