"""A heartbeat watchdog: a rank whose process went silent (killed, SIGSTOPped, its node gone) is named
within seconds by the others, instead of after `dist.timeout_s` in their next collective.

Each rank publishes `"<seq> <section> <step>"` under its own key in the job's TCPStore (torchrun's
store, reached through MASTER_ADDR/MASTER_PORT with a connection of its own; the key prefix is this
torchrun attempt's, so a restart never reads the previous attempt's beats). The training thread
publishes at every step boundary and on entering a section (checkpoint save or load, evaluation);
the watchdog thread republishes every `interval_s` and reads its peers' keys (the next `watch`
ranks on a ring: O(world) store traffic, not O(world^2)).

A peer is silent when its value has not changed for longer than its section's bound:

    step            max(k x median step time, floor_s)   (before the first step is timed: startup_s)
    checkpoint, load, eval  section_s                           (a slow checkpoint or evaluation is live)
    start           startup_s                            (model build, first compile)

The beat thread needs the GIL, so a long call that holds it (pickling a checkpoint, a compile's C++
parts) pauses the beats of a live rank too: the bounds are what keep it from being named. The rank
that sees a silent peer writes one verdict line to the store, prints it and exits with EXIT_CODE;
every other rank's watchdog reads the verdict at its next tick and exits with the same line, so
torchrun sees the group fail (and restarts it with --max-restarts) with the culprit named.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmtrain.run_config import HeartbeatConfig

EXIT_CODE = 70  # the heartbeat's own: a peer went silent (EX_SOFTWARE)
VERDICT = "verdict"
LEFT = "left"  # ranks that printed the verdict
STEP_WINDOW = 50  # step times the median is taken over


@dataclass
class _Peer:
    value: str | None = None  # its last published "<seq> <section> <step>"; None: not seen yet
    changed: float = field(default_factory=time.monotonic)  # when we saw the value change


class Heartbeat:
    """One rank's side: `mark` sections from the training thread, the watchdog in a daemon thread."""

    def __init__(self, cfg: HeartbeatConfig, store, rank: int, world: int, exit_fn=os._exit):
        self.cfg, self.store, self.rank, self.world = cfg, store, rank, world
        self.peers = {p: _Peer() for p in watched(rank, world, cfg.watch)}
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.section, self.step, self._seq = "start", 0, 0
        self._t_step: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exit = exit_fn
        self.verdict: str | None = None
        self._publish()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    # ----- the training thread ----------------------------------------------------------------
    def step_begin(self, step: int) -> None:
        self._t_step = time.monotonic()
        self.mark("step", step)

    def step_end(self) -> None:
        """The step's time joins the median (scheduled sections are timed apart, not here)."""
        if self._t_step is not None:
            self.steps.append(time.monotonic() - self._t_step)
            self._t_step = None

    @contextlib.contextmanager
    def in_section(self, name: str):
        """A section with its own bound (save, load, eval); back to the previous one after it."""
        before = self.section
        self.mark(name, self.step)
        try:
            yield
        finally:
            self.mark(before, self.step)

    def mark(self, section: str, step: int) -> None:
        self.section, self.step = section, step
        self._publish()  # now, from this thread: a call that then holds the GIL cannot hide it

    def stop(self) -> None:
        """The run ended cleanly: peers stop watching this rank (its beats end with it)."""
        self.mark("done", self.step)
        self._stop.set()
        self._thread.join(timeout=self.cfg.interval_s + self.cfg.floor_s)

    # ----- the watchdog thread ----------------------------------------------------------------
    def _publish(self) -> None:
        with self._lock:
            self._seq += 1
            value = f"{self._seq} {self.section} {self.step}"
        with contextlib.suppress(RuntimeError):  # a store that stopped answering: the watchdog says so
            self.store.set(str(self.rank), value)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                line = self.tick()
            except RuntimeError as e:  # the store timed out or is gone (it lives with torchrun's agent)
                line = f"the job's store stopped answering ({str(e).splitlines()[0][:120]})"
            if line is not None and not self._stop.is_set():
                self._leave(line)
                return

    def tick(self, now: float | None = None) -> str | None:
        """Beat, read the peers, judge; -> the verdict line when the job must stop (else None)."""
        if self.store.check([VERDICT]):
            return self.store.get(VERDICT).decode()
        self._publish()
        now = time.monotonic() if now is None else now
        self._read(now)
        silent = [(p, peer) for p, peer in self.peers.items()
                  if now - peer.changed > self.bound_of(peer.value)]
        if not silent:
            return None
        line = self.describe(silent, now)
        # the first verdict stays: a rank that judged a moment later prints the same line
        return self.store.compare_set(VERDICT, "", line).decode() or line

    def _read(self, now: float) -> None:
        seen = [p for p, peer in self.peers.items() if peer.value is not None]
        unseen = [p for p in self.peers if p not in seen and self.store.check([str(p)])]
        keys = seen + unseen
        for p, raw in zip(keys, self.store.multi_get([str(p) for p in keys]) if keys else [], strict=True):
            value = raw.decode()
            if value != self.peers[p].value:
                self.peers[p].value, self.peers[p].changed = value, now

    def bound_of(self, value: str | None) -> float:
        """How long a peer may stay unchanged in the section it last published (None: not yet seen)."""
        section = value.split()[1] if value else "start"
        if section == "done":
            return float("inf")
        if section == "step" and self.steps:
            return max(self.cfg.k * statistics.median(self.steps), self.cfg.floor_s)
        return self.cfg.section_s if section in ("load", "eval", "checkpoint") else self.cfg.startup_s

    def describe(self, silent: list[tuple[int, _Peer]], now: float) -> str:
        parts = []
        for p, peer in silent:
            _, section, step = (peer.value or "0 start 0").split()
            parts.append(f"rank {p} silent for {now - peer.changed:.1f} s in {section} (step {step}), "
                         f"bound {self.bound_of(peer.value):.1f} s")
        median = f"{statistics.median(self.steps):.2f} s" if self.steps else "none yet"
        return (f"heartbeat: {'; '.join(parts)} (k {self.cfg.k:g} x median step {median}, floor "
                f"{self.cfg.floor_s:g} s; seen by rank {self.rank})")

    def _leave(self, line: str) -> None:
        """Print the verdict and exit non-zero, once every live rank has printed it too (or after a
        few ticks): the first to exit makes the launcher stop the rest, which must have named it."""
        self.verdict = line
        # one write: the ranks of a node share torchrun's stderr, and print's two writes interleave
        sys.stderr.write(f"mmtrain: rank {self.rank}: {line}; exiting at t={time.time():.3f}\n")
        sys.stderr.flush()
        live = self.world - len(set(re.findall(r"rank (\d+) silent", line)))
        deadline = time.monotonic() + 3 * self.cfg.interval_s + 2.0  # a loaded host's late tick
        with contextlib.suppress(RuntimeError):  # a gone store: leave now
            left = self.store.add(LEFT, 1)
            while left < live and time.monotonic() < deadline:
                time.sleep(self.cfg.interval_s / 10)
                left = self.store.add(LEFT, 0)
        sys.stdout.flush()
        self._exit(EXIT_CODE)


class NoHeartbeat:
    """One process, or `train.heartbeat.enabled: false`: the same calls, nothing watched."""

    def step_begin(self, step: int) -> None:
        pass

    def step_end(self) -> None:
        pass

    @contextlib.contextmanager
    def in_section(self, name: str):
        yield

    def stop(self) -> None:
        pass


def watched(rank: int, world: int, watch: int) -> list[int]:
    """The next `watch` ranks after `rank` on a ring (every other rank when the group is smaller)."""
    return [(rank + i) % world for i in range(1, min(watch, world - 1) + 1)]


def start(cfg: HeartbeatConfig, rank: int, world: int) -> Heartbeat | NoHeartbeat:
    """The watchdog of this rank of a torchrun job (nothing in one process or when disabled)."""
    import torch.distributed as dist

    real_group = dist.is_initialized() and dist.get_backend() != "fake"  # (the fake one has no store)
    if not cfg.enabled or world < 2 or not real_group or "MASTER_ADDR" not in os.environ:
        return NoHeartbeat()
    try:
        store = job_store(cfg)
    except RuntimeError as e:  # a process group set up without torchrun's store (init_method=file://...)
        print(f"mmtrain: rank {rank}: heartbeat off: no job store at torchrun's address "
              f"({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
        return NoHeartbeat()
    return Heartbeat(cfg, store, rank, world)


def job_store(cfg: HeartbeatConfig):
    """A client of the job's TCPStore of its own (the process group's client may be blocked in a
    rendezvous wait), its calls bounded by floor_s; keys private to this torchrun attempt."""
    import torch.distributed as dist

    from mmtrain.parallel.distributed import restart_count

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=cfg.floor_s), wait_for_workers=False)
    return dist.PrefixStore(f"mmtrain/attempt_{restart_count()}/heartbeat", client)
