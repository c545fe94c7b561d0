"""The loader the trainer uses: sources -> mixture -> packer -> PackedBatch, exactly resumable.

Resume design. Every stage inside a worker is a deterministic function of (seed, rank, logical
worker, epoch) plus a small cursor (`WorkerPipeline.state_dict`). A worker attaches its state
after each batch (and the ledger entries it added) to the batch it yields. The main process
keeps the last state per logical worker and which worker comes next: torch's DataLoader hands
out batches round-robin over its workers, starting at worker 0, so on resume DataLoader worker
j runs logical worker (j + next) % num_workers from its saved state. Buffered samples and the
documents the packer held are re-read from their shards, never pickled.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmtrain.data_pipelines.agree import rank_sync
from mmtrain.data_pipelines.batch import TEXT, PackedBatch
from mmtrain.data_pipelines.config import DataConfig
from mmtrain.data_pipelines.errors import DataError
from mmtrain.data_pipelines.ledger import Ledger
from mmtrain.data_pipelines.mixing import Mixer
from mmtrain.data_pipelines.packing import Packer, assemble
from mmtrain.data_pipelines.prefetch import ByteBudget
from mmtrain.data_pipelines.rng import CounterRng, hash64
from mmtrain.data_pipelines.shards import ReadOptions, ShardPlan, expand_shards
from mmtrain.data_pipelines.stream import SourceStream, fetch
from mmtrain.data_pipelines.tokenizer import Tokenizer

STATE_VERSION = 1


@dataclass
class _Source:
    name: str
    urls: list[str]
    weight: float


@dataclass
class _Wire:
    """A batch in transit from a worker (a dataclass: DataLoader's collation leaves it alone)."""

    buf: torch.Tensor
    specs: list
    slot: int = -1  # the DataLoader worker that sent it (whose prefetch share it uses)


def to_wire(batch: PackedBatch, slot: int = -1) -> _Wire:
    """All tensors of a batch in ONE shared-memory buffer: a worker then sends one segment per
    batch instead of eleven (torch shares each tensor separately, and that dominated IPC)."""
    specs, total = [], 0
    for f in fields(batch):
        t = getattr(batch, f.name)
        offset = -(-total // 64) * 64  # aligned, so every dtype can view its slice
        specs.append((f.name, t.dtype, tuple(t.shape), offset, t.numel() * t.element_size()))
        total = offset + specs[-1][-1]
    buf = torch.empty(total, dtype=torch.uint8).share_memory_()
    flat = buf.numpy()
    for (name, _, _, offset, nbytes) in specs:
        flat[offset : offset + nbytes] = getattr(batch, name).numpy().reshape(-1).view(np.uint8)
    return _Wire(buf, specs, slot)


def from_wire(w: _Wire) -> PackedBatch:
    return PackedBatch(**{name: w.buf[offset : offset + nbytes].view(dtype).view(shape)
                          for name, dtype, shape, offset, nbytes in w.specs})


@dataclass
class _Failure:
    """A DataError raised in a worker, carried to the main process as a value (one clean line)."""

    message: str


class WorkerPipeline:
    """What one (rank, logical worker) computes: an iterator of (batch, state, ledger entries)."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, split: str, sources: list[_Source],
                 rank: int, world_size: int, worker: int, num_workers: int, start: list | None = None):
        self.cfg, self.tok, self.worker = cfg, tok, worker
        train = split == "train"
        self.delta: list[tuple[str, str, str]] = []
        self.streams = []
        for i, src in enumerate(sources):
            plan = ShardPlan(src.urls, src.name, cfg.seed, rank, world_size, worker, num_workers,
                             shuffle=train, resample=train and cfg.resample, epochs=None if train else 1,
                             read=read_options(cfg))
            stream = SourceStream(i, plan, tok, cfg, cfg.shuffle_buffer if train else 0, self._ledger)
            if start is not None:
                stream.reader.cursor = tuple(start[i])
            self.streams.append(stream)
        self.mixer = Mixer([s.weight for s in sources], CounterRng(cfg.seed, "mix", rank, worker))
        self.packer = Packer(cfg.seq_len, cfg.batch_size, cfg.pack_lookahead, cfg.max_media_per_row,
                             cfg.max_visual_tokens_per_row)
        self.pack = Counter()
        m = cfg.media
        self.patch_dim = 3 * m.temporal_patch * m.patch_size * m.patch_size

    def _ledger(self, shard: str, key: str, reason: str) -> None:
        self.delta.append((shard, key, reason))

    def _pull(self):
        while (i := self.mixer.choose()) is not None:
            doc = self.streams[i].next_doc()
            if doc is not None:
                self.mixer.took(i)
                return doc
            self.mixer.exhausted(i)
        return None

    def __iter__(self):
        while (rows := self.packer.next_rows(self._pull)) is not None:
            batch = assemble(rows, self.cfg.seq_len, self.tok.special.pad, self.patch_dim)
            self._count(batch)
            if self.packer.held_back:  # only under a visual budget: `pack` as before without one
                self.pack.update(held_back=self.packer.held_back)
                self.packer.held_back = 0
            delta, self.delta = self.delta, []
            yield batch, self.state_dict(), delta

    def _count(self, batch: PackedBatch) -> None:
        real = batch.task_BS.numpy() >= 0  # NumPy views: no torch thread pool in the loop
        visual = int((real & (batch.modality_BS.numpy() != TEXT)).sum())
        self.pack.update(batches=1, rows=batch.tokens_BS.shape[0], slots=batch.tokens_BS.numel(),
                         tokens=int(real.sum()), visual_tokens=visual, media=len(batch.media_kind_M))

    def state_dict(self) -> dict:
        return {"worker": self.worker, "sources": [s.state_dict() for s in self.streams],
                "mixer": self.mixer.state_dict(), "packer": [list(d.ident) for d in self.packer.pending],
                "pack": dict(self.pack)}

    def load_state_dict(self, state: dict) -> None:
        pending = [(i, tuple(pos), chunk) for i, pos, chunk in state["packer"]]
        for i, (stream, st) in enumerate(zip(self.streams, state["sources"])):
            needed = stream.positions_needed(st) + [pos for j, pos, _ in pending if j == i]
            raws = fetch(stream.plan, needed)
            stream.load_state_dict(st, raws)
            self.packer.pending += [stream.regenerate(ident, raws) for ident in pending if ident[0] == i]
        self.packer.pending.sort(key=lambda d: pending.index(d.ident))
        self.mixer.load_state_dict(state["mixer"])
        self.pack = Counter(state["pack"])



class _WorkerDataset(IterableDataset):
    """What each DataLoader worker runs: logical worker (id + rotation) % num_workers."""

    def __init__(self, make_pipeline, states: list, rotation: int):
        self.make_pipeline, self.states, self.rotation = make_pipeline, states, rotation

    def __iter__(self):
        info = get_worker_info()
        n = info.num_workers if info else 1
        logical = ((info.id if info else 0) + self.rotation) % n
        return self.make_pipeline(logical, self.states[logical])


class Loader:
    def __init__(self, cfg: DataConfig, tok: Tokenizer, split: str, rank: int, world_size: int,
                 sources: list[_Source]):
        self.cfg, self.tok, self.split, self.rank, self.world_size = cfg, tok, split, rank, world_size
        self.sources = sources
        self.num_workers = cfg.num_workers
        self.ledger = Ledger()
        self._budget: ByteBudget | None = None  # the current iteration's, with workers
        self._reset()

    def _reset(self, start: list | None = None) -> None:
        self._states: list[dict | None] = [None] * max(1, self.num_workers)
        self._next = 0
        self._start = start  # per-source start cursors after a layout change (see load_state_dict)

    def _pipeline(self, logical: int, state: dict | None):
        """What one logical worker yields: (batch, state, ledger entries), or a _Failure item for a
        DataError (a worker cannot raise one cleanly); from worker processes a batch travels as
        one shared buffer (see to_wire)."""
        try:
            p = WorkerPipeline(self.cfg, self.tok, self.split, self.sources, self.rank, self.world_size,
                               logical, max(1, self.num_workers), self._start)
            if state is not None:
                p.load_state_dict(state)
            yield from (p if self.num_workers == 0 else self._sent(p))
        except DataError as e:
            yield _Failure(str(e))

    def _sent(self, p: WorkerPipeline):
        """In a worker process: batches as wires, each begun only while this worker's prefetch
        share has room (data.prefetch_bytes, prefetch.py)."""
        slot, budget, items = get_worker_info().id, self._budget, iter(p)
        while True:
            budget.wait_for_room(slot)
            if (item := next(items, None)) is None:
                return
            batch, st, delta = item
            wire = to_wire(batch, slot)
            budget.sent(slot, wire.buf.numel())
            yield wire, st, delta

    def _items(self):
        if self.num_workers == 0:
            return self._pipeline(0, self._states[0])
        self._budget = ByteBudget(self.cfg.prefetch_bytes, self.num_workers)  # before the workers fork
        ds = _WorkerDataset(self._pipeline, list(self._states), self._next)
        return iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                               prefetch_factor=self.cfg.prefetch_factor))

    def __iter__(self):
        if self.split == "val":  # one deterministic pass, the same every time
            self._reset()
            self.ledger = Ledger()
        # train: every rank takes one batch per micro-batch, so a failure is agreed on each batch
        sync = rank_sync() if self.split == "train" else None
        items = self._items()
        try:
            yield from self._batches(items, sync)
        finally:
            if self._budget is not None:
                self._budget.close()  # a worker waiting for room must not hold up the shutdown

    def _batches(self, items, sync):
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except Exception as e:  # a worker that died (e.g. a segfault in a decoder)
                if sync is None:
                    raise
                item = _Failure(f"{type(e).__name__}: {e}")
            failure = item.message if isinstance(item, _Failure) else None
            if sync is not None:
                failure = sync(failure)
            if failure is not None:
                raise DataError(failure)
            batch, state, delta = item
            if isinstance(batch, _Wire):
                self._budget.taken(batch.slot, batch.buf.numel())
                batch = from_wire(batch)
            self._states[state["worker"]] = state
            self._next = (state["worker"] + 1) % len(self._states)
            self.ledger.extend(delta)
            yield batch

    @property
    def prefetch_peak_bytes(self) -> int:
        """The most bytes of batches the workers held ready at once in the latest iteration."""
        return self._budget.peak_bytes if self._budget is not None else 0

    def set_weights(self, weights: dict[str, float]) -> bool:
        """New mixture weights for the named sources (the others keep theirs); -> whether any changed.

        Takes effect at the next `iter()`: its workers start from the states of the batches consumed
        so far (the resume path), so batches prefetched under the old weights are re-made, none is
        lost or repeated, and a run that resumes here draws exactly what this one draws."""
        unknown = sorted(set(weights) - {s.name for s in self.sources})
        if unknown:
            raise ValueError(f"set_weights: no source named {unknown}")
        bad = {k: w for k, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"set_weights: weights must be > 0 (got {bad})")
        changed = False
        for s in self.sources:
            if s.name in weights and weights[s.name] != s.weight:
                s.weight, changed = float(weights[s.name]), True
        return changed

    # ----- state ----------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"split": self.split, "rank": self.rank, "world_size": self.world_size,
                "num_workers": self.num_workers, "sources": [s.name for s in self.sources]}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, **self._layout(), "next_worker": self._next,
                "workers": list(self._states), "ledger": self.ledger.state_dict(),
                "fingerprint": fingerprint(self.cfg, self.sources)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state version {state.get('version')} is not {STATE_VERSION}")
        self.ledger.load_state_dict(state["ledger"])
        if self._changed_shards(state.get("fingerprint")):
            self._reset(start=_next_epoch_cursors(state, self.sources, self.cfg.resample))
            return
        saved = {k: state[k] for k in self._layout()}
        if saved != self._layout():
            self._reset(start=_next_epoch_cursors(state, self.sources, self.cfg.resample))
            warnings.warn(f"data layout changed since the checkpoint ({saved} -> {self._layout()}): "
                          "exact resume is impossible, every source restarts at its next epoch", stacklevel=2)
            return
        self._states = list(state["workers"])
        self._next = state["next_worker"]
        self._start = None

    def _changed_shards(self, saved: dict | None) -> bool:
        """Compare what the saved state was built from with this loader: a changed shard list is an
        error (or, with allow_changed_shards, a warning and a restart at each source's next epoch);
        changed weights or seed are a warning. -> whether the saved positions are meaningless."""
        now = fingerprint(self.cfg, self.sources)
        if saved is None or saved == now:
            return False
        shards = [n for n in sorted(set(saved["shards"]) | set(now["shards"]))
                  if saved["shards"].get(n) != now["shards"].get(n)]
        mixing = "" if saved["mixing"] == now["mixing"] else f"mixing {saved['mixing']} -> {now['mixing']}"
        what = "; ".join(filter(None, [
            shards and f"shard list of source(s) {', '.join(map(repr, shards))} "
                       f"({', '.join(_count_change(saved, now, n) for n in shards)})", mixing]))
        if shards and not self.cfg.allow_changed_shards:
            raise DataError(f"data.{self.split} changed since the checkpoint: {what}; set "
                            "data.allow_changed_shards: true to resume anyway (each source restarts at "
                            "its next epoch)")
        warnings.warn(f"data.{self.split} changed since the checkpoint: {what}" +
                      ("; every source restarts at its next epoch" if shards else ""), stacklevel=3)
        return bool(shards)

    def stats(self) -> dict:
        return summarize(self.sources, [s for s in self._states if s is not None])


def read_options(cfg: DataConfig) -> ReadOptions:
    return ReadOptions(cfg.max_member_bytes, cfg.shard_retries, cfg.retry_backoff_s, cfg.stall_timeout_s,
                       cfg.open_timeout_s)


def fingerprint(cfg: DataConfig, sources: list[_Source]) -> dict:
    """What the loader's batches are a function of: a digest of each source's shard list (sizes
    are not read: start-up stays free of per-shard I/O) and the mixing config."""
    return {"shards": {s.name: [len(s.urls), hash64(*s.urls)] for s in sources},
            "mixing": {"seed": cfg.seed, "weights": {s.name: s.weight for s in sources}}}


def _count_change(saved: dict, now: dict, name: str) -> str:
    a, b = saved["shards"].get(name), now["shards"].get(name)
    return f"{name}: {a[0] if a else 'absent'} -> {b[0] if b else 'absent'} shards"


def _next_epoch_cursors(state: dict, sources: list[_Source], resample: bool) -> list | None:
    """Start cursors past everything the saved state read (epoch + 1; resample: next shard draw)."""
    names = state.get("sources", [])
    workers = [w for w in state.get("workers", []) if w is not None]
    out = []
    for src in sources:
        cursors = [w["sources"][names.index(src.name)]["cursor"] for w in workers if src.name in names]
        if not cursors:
            out.append((0, 0, 0))
        elif resample:
            out.append((0, max(c[1] for c in cursors) + 1, 0))
        else:
            out.append((max(c[0] for c in cursors) + 1, 0, 0))
    return out


def summarize(sources: list[_Source], states: list[dict]) -> dict:
    """Loader stats from the workers' latest states (they carry cumulative counters)."""
    per_source, pack = {}, Counter()
    for st in states:
        pack.update(st["pack"])
    for i, src in enumerate(sources):
        agg = {"seen": 0, "ok": 0, "docs": 0, "text_tokens": 0, "visual_tokens": 0, "max_doc_tokens": 0,
               "skipped": Counter(), "kinds": Counter(), "kind_tokens": Counter()}
        for st in states:
            s = st["sources"][i]["stats"]
            for k in ("seen", "ok", "docs", "text_tokens", "visual_tokens"):
                agg[k] += s[k]
            agg["max_doc_tokens"] = max(agg["max_doc_tokens"], s["max_doc_tokens"])
            agg["skipped"].update(s["skipped"])
            agg["kinds"].update(s["kinds"])
            agg["kind_tokens"].update(s["kind_tokens"])
        per_source[src.name] = {k: dict(v) if isinstance(v, Counter) else v for k, v in agg.items()}
    docs = sum(s["docs"] for s in per_source.values())
    total_w = sum(s.weight for s in sources)
    mixture = {s.name: {"target": s.weight / total_w, "realised": per_source[s.name]["docs"] / max(docs, 1)}
               for s in sources}
    return {
        "sources": per_source,
        "samples": sum(s["seen"] for s in per_source.values()),
        "kinds": dict(sum((Counter(s["kinds"]) for s in per_source.values()), Counter())),
        "kind_tokens": dict(sum((Counter(s["kind_tokens"]) for s in per_source.values()), Counter())),
        "skipped": dict(sum((Counter(s["skipped"]) for s in per_source.values()), Counter())),
        "mixture": mixture,
        "batches": pack["batches"],
        "media": pack["media"],
        "held_back": pack["held_back"],  # documents a row's visual budget made wait (data.max_*_per_row)
        "tokens": {"text": pack["tokens"] - pack["visual_tokens"], "visual": pack["visual_tokens"],
                   "padding": pack["slots"] - pack["tokens"]},
        "packing_efficiency": pack["tokens"] / pack["slots"] if pack["slots"] else 0.0,
    }


def build_loader(cfg: DataConfig, tokenizer: Tokenizer, split: Literal["train", "val"],
                 rank: int = 0, world_size: int = 1) -> Loader:
    if split not in ("train", "val"):
        raise ValueError(f"split: must be 'train' or 'val' (got {split!r})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, world_size={world_size}) (got {rank})")
    configs = cfg.train if split == "train" else cfg.val
    if not configs:
        raise DataError(f"data.{split}: no sources configured")
    sources = [_Source(s.name, expand_shards(s.shards, s.name), s.weight) for s in configs]
    if not (split == "train" and cfg.resample):  # resampling draws shards: any count serves every reader
        for src in sources:
            check_shard_count(src, world_size, max(1, cfg.num_workers), cfg.shard_shortage, split)
    return Loader(cfg, tokenizer, split, rank, world_size, sources)


def check_shard_count(src: _Source, world_size: int, num_workers: int, shortage: str, split: str) -> None:
    """Fewer shards than readers (ranks x workers) would leave readers empty, and a rank with
    nothing hangs its peers in their next collective: refuse, or split by sample and say so."""
    readers = world_size * num_workers
    if len(src.urls) >= readers:
        return
    what = (f"data.{split} source {src.name!r}: {len(src.urls)} shard(s) < ranks x workers = "
            f"{world_size} x {num_workers} = {readers}")
    if shortage == "error":
        raise DataError(f"{what}; write at least {readers} shards, lower data.num_workers, or set "
                        "data.shard_shortage: split")
    warnings.warn(f"{what}: every reader reads all {len(src.urls)} and keeps 1 sample in {readers} "
                  "(data.shard_shortage: error refuses)", stacklevel=3)
