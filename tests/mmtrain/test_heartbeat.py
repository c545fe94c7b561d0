"""The heartbeat watchdog (mmtrain/loop/heartbeat.py) in one process: several ranks' heartbeats on one
TCPStore, their exits caught. A rank whose beats stop is named, with its section, by every other
rank; its bound follows its section; a rank that stopped cleanly ("done") is never named.
The 4-rank drills on real processes: tests/mmtrain/test_fault_drills.py."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mmtrain.loop.heartbeat import EXIT_CODE, Heartbeat, watched
from mmtrain.run_config import HeartbeatConfig

FAST = dict(interval_s=0.05, floor_s=0.4, section_s=3.0, startup_s=2.0)


def _server(timeout_s: float):
    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def _group(world: int, cfg: HeartbeatConfig):
    """`world` heartbeats on one store; -> (heartbeats, {rank: exit code}) (an exit ends the thread);
    every watchdog stopped on the way out."""
    server = _server(5)
    codes: dict[int, int] = {}

    def exit_fn(rank):
        def leave(code):
            codes[rank] = code  # (the watchdog thread then ends, as os._exit would end the process)
        return leave

    hbs = [Heartbeat(cfg, dist.PrefixStore("t", server), r, world, exit_fn=exit_fn(r)) for r in range(world)]
    try:
        yield hbs, codes
    finally:
        for hb in hbs:
            hb._stop.set()


def _silence(hb: Heartbeat) -> None:
    """As SIGSTOP: the rank's beats stop, and it never says it is done."""
    hb._stop.set()
    hb._thread.join()


def _wait_for(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "never happened"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_silent_rank_is_named_by_every_other_rank_with_its_section(capfd):
    cfg = HeartbeatConfig(**FAST)
    with _group(4, cfg) as (hbs, codes):
        for hb in hbs:  # a few timed steps: the step bound is max(k x median, floor)
            for step in range(1, 4):
                hb.step_begin(step)
                hb.step_end()
            hb.step_begin(4)
        _silence(hbs[2])
        took = _wait_for(lambda: len(codes) == 3, timeout=5)
        assert set(codes) == {0, 1, 3} and set(codes.values()) == {EXIT_CODE}
        assert cfg.floor_s - cfg.interval_s <= took < cfg.floor_s + 1.0  # the bound, give or take ticks
        verdicts = {hb.verdict for r, hb in enumerate(hbs) if r != 2}
        assert len(verdicts) == 1  # one line, the same on every rank
        line = verdicts.pop()
        assert "rank 2 silent for" in line and "in step (step 4)" in line
        assert "rank 0 silent" not in line and "rank 1 silent" not in line
        err = capfd.readouterr().err
        assert all(f"mmtrain: rank {r}: heartbeat: rank 2 silent" in err for r in (0, 1, 3))


def test_bounds_follow_the_section():
    cfg = HeartbeatConfig(**FAST)
    with _group(2, cfg) as (hbs, _codes):
        hb = hbs[0]
        assert hb.bound_of(None) == cfg.startup_s  # not seen yet: still starting
        assert hb.bound_of("3 step 1") == cfg.startup_s  # no step timed yet: a first compile
        hb.steps.extend([0.2, 0.3, 0.25])
        assert hb.bound_of("9 step 4") == max(cfg.k * 0.25, cfg.floor_s)
        hb.steps.extend([1.0, 1.0, 1.0, 1.0])
        assert hb.bound_of("9 step 8") == pytest.approx(cfg.k * statistics.median(hb.steps))
        for section in ("load", "eval", "checkpoint"):
            assert hb.bound_of(f"5 {section} 4") == cfg.section_s
        assert hb.bound_of("7 done 8") == float("inf")


def test_a_peer_in_a_long_section_or_done_is_not_named():
    """Silent past the step bound but inside an eval's (as while a call holds its GIL), or done."""
    cfg = HeartbeatConfig(**FAST)
    with _group(3, cfg) as (hbs, codes):
        for hb in hbs:
            hb.step_begin(1)
            hb.step_end()
        hbs[1].mark("eval", 1)
        _silence(hbs[1])
        hbs[2].stop()
        time.sleep(3 * cfg.floor_s)
        assert codes == {}
        time.sleep(cfg.section_s)  # past the eval's own bound: named
        _wait_for(lambda: 0 in codes, timeout=2)
        assert "rank 1 silent" in hbs[0].verdict and "in eval" in hbs[0].verdict
        assert "rank 2" not in hbs[0].verdict


def test_a_rank_watches_the_next_ranks_on_a_ring():
    assert watched(0, 4, 8) == [1, 2, 3]
    assert watched(3, 4, 8) == [0, 1, 2]
    assert watched(14, 16, 3) == [15, 0, 1]
    assert watched(0, 1, 8) == []


def test_config_checks():
    with pytest.raises(ValueError, match="floor_s: must be >= 2 x interval_s"):
        HeartbeatConfig(interval_s=6.0)
    with pytest.raises(ValueError, match="section_s, startup_s: must be >= floor_s"):
        HeartbeatConfig(section_s=5.0)
    with pytest.raises(ValueError, match="k: must be >= 1"):
        HeartbeatConfig(k=0.5)


def test_the_verdict_thread_never_hangs_on_a_gone_store():
    """The store's host gone: store calls fail within their timeout and the rank leaves, naming it."""
    cfg = HeartbeatConfig(**FAST)
    server = _server(1)
    client = dist.TCPStore("localhost", server.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=1))
    codes: list[int] = []
    done = threading.Event()

    def leave(code):
        codes.append(code)
        done.set()

    hb = Heartbeat(cfg, client, 0, 2, exit_fn=leave)
    del server
    assert done.wait(10)
    assert codes == [EXIT_CODE] and "store stopped answering" in hb.verdict
