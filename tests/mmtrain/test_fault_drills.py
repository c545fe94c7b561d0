"""Fault drills on gloo at 4 ranks, EP(2) x FSDP(2) (dist.ep=2: the experts split over 2 ranks and
sharded over 2, the dense weights over 4); one case adds CP(2). Each injects one fault on one rank
(`train.faults`) and checks that the job notices it, names it, and resumes with nothing lost:

- SIGKILL mid-step (after a forward, its backward's collectives ahead): the other ranks are gone
  within 10 s, the launcher's root cause names the rank;
- SIGSTOP (hung, alive): every other rank exits within max(3 x median step, floor) + 5 s with the
  heartbeat's line naming it (mmtrain/loop/heartbeat.py), long before dist.timeout_s;
- SIGKILL inside an async checkpoint write: that checkpoint is never committed, resume takes the one
  before;
- NaN on one rank: every rank skips the same step;
- a slow but live rank (its GIL held in the first step, an eval and a save; asleep in a step) is
  never named.

After a kill or a stop the run resumes from its newest committed checkpoint and every step's loss
equals the uninterrupted run's (warm forked ranks here; under `torchrun --max-restarts 1`, the same
restart a launch script gets, in the slow tier).
"""

from __future__ import annotations

import re
import statistics
import time

import pytest
from dist_runs import checkpoint_names, losses, reference_run, step_records, train, write_config

pytestmark = pytest.mark.distributed
EP2 = ["data.batch_size=1", "dist.ep=2"]  # test_mesh's mesh: its reference run is shared
CP2 = [*EP2, "model.decoder.attention.full_tile=16", "dist.cp=2"]
TIMEOUT_S = 60  # dist.timeout_s of dist_runs.RUN_OVERRIDES: what must not be what fired
# the drills' watchdog: beats every 0.5 s, a step's floor 3 s (the issue's formula, a lower floor)
FAST_HB = ["train.heartbeat.interval_s=0.5", "train.heartbeat.floor_s=3"]


@pytest.fixture(scope="module")
def ep2_ref(raw_for, tmp_path_factory):
    """The uninterrupted run (8 steps, a checkpoint every 2), shared with test_mesh's."""
    return reference_run(write_config(raw_for, tmp_path_factory.mktemp("drills") / "ref", EP2), 4)


def _config(raw_for, tmp_path, name: str, mesh=EP2):
    run = tmp_path / name
    return run, write_config(raw_for, run, mesh)


def _fault_time(stderr: str, what: str) -> float:
    m = re.search(rf"mmtrain: fault: rank \d+ {what} at t=([\d.]+)", stderr)
    assert m, f"no fault line {what!r}:\n{stderr[-3000:]}"
    return float(m.group(1))


def _exits(stderr: str) -> dict[int, tuple[str, float]]:
    """Each rank's heartbeat line: rank -> (verdict, exit time)."""
    found = re.findall(r"mmtrain: rank (\d+): (heartbeat: .*?); exiting at t=([\d.]+)", stderr)
    return {int(r): (line, float(t)) for r, line, t in found}


def _root_cause(stderr: str) -> tuple[int, int] | None:
    """(rank, exit code) of the launcher's first observed failure: the warm launcher's one line, or
    torchrun's block (MMTRAIN_COLD_LAUNCH=1)."""
    warm = re.search(r"root cause \(first observed failure\): rank (\d+) .* exitcode (-?\d+)", stderr)
    cold = re.search(r"Root Cause \(first observed failure\):.*?rank\s+: (\d+) .*?exitcode\s+: (-?\d+)",
                     stderr, re.S)
    found = warm or cold
    return (int(found.group(1)), int(found.group(2))) if found else None


def _median_step(run) -> float:
    return statistics.median(r["step_s"] for r in step_records(run).values())


def _resumed(run, ref, at: int) -> None:
    assert f"resumed from {run / f'step_{at}'} at step {at}" in (run / "train.log").read_text()
    assert losses(run) == losses(ref)  # every step, bit for bit


# ----- SIGKILL ----------------------------------------------------------------------------------------
def test_sigkill_is_named_and_the_resume_is_exact(raw_for, tmp_path, ep2_ref):
    run, config = _config(raw_for, tmp_path, "run")
    ref = ep2_ref
    p = train(config, 4, "train.faults.kill_mid_step=5", "train.faults.rank=2", check=False)
    t_end = time.time()
    assert p.returncode != 0
    assert _root_cause(p.stderr) == (2, -9), p.stderr[-3000:]
    assert t_end - _fault_time(p.stderr, "SIGKILL mid-step 5") < 10  # every survivor gone
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, 4)
    _resumed(run, ref, 4)


# ----- SIGSTOP ----------------------------------------------------------------------------------------
def _check_stop_named(p, run, floor_s: float, stopped: int = 1, after: int = 5) -> None:
    """Every other rank left with the heartbeat's line naming the stopped rank, within
    max(3 x median step, floor) + 5 s of the stop; no collective timed out."""
    assert p.returncode != 0
    t_stop = _fault_time(p.stderr, f"SIGSTOP after step {after}")
    exits = _exits(p.stderr)
    assert sorted(exits) == sorted(set(range(4)) - {stopped}), p.stderr[-3000:]
    limit = max(3 * _median_step(run), floor_s) + 5
    for rank, (line, t) in exits.items():
        assert f"rank {stopped} silent for" in line and f"in step (step {after})" in line, line
        assert t - t_stop < limit, (rank, t - t_stop, limit)
    assert "Timed out" not in p.stderr and "timed out" not in p.stderr  # not dist.timeout_s
    assert max(t for _, t in exits.values()) - t_stop < TIMEOUT_S


@pytest.mark.parametrize("mesh", [
    pytest.param(EP2, id="ep2"),
    # CP(2) changes what a step runs, not how a silent rank is seen: the ep2 case keeps the path
    pytest.param(CP2, id="ep2-cp2", marks=pytest.mark.slow),
])
def test_sigstop_is_named_by_the_heartbeat_and_the_resume_is_exact(raw_for, tmp_path, ep2_ref, mesh):
    run, config = _config(raw_for, tmp_path, "run", mesh)
    ref = ep2_ref if mesh is EP2 else reference_run(write_config(raw_for, tmp_path / "ref", mesh), 4)
    p = train(config, 4, "train.faults.stop_at_step=5", "train.faults.rank=1", *FAST_HB, check=False)
    _check_stop_named(p, run, floor_s=3)
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, 4)
    _resumed(run, ref, 4)


# ----- a kill inside an asynchronous checkpoint write --------------------------------------------------
def test_kill_in_an_async_save_leaves_it_uncommitted_and_resumes_from_the_one_before(raw_for, tmp_path,
                                                                                    ep2_ref):
    run, config = _config(raw_for, tmp_path, "run")
    fault = ["train.faults.kill_in_save_at_step=6", "train.faults.rank=3"]
    p = train(config, 4, "train.async_save=true", *fault, check=False)
    assert p.returncode != 0
    _fault_time(p.stderr, "SIGKILL in the save of step 6")
    assert checkpoint_names(run) == [".step_6.tmp", "step_2", "step_4"]  # step 6: written, never committed
    train(config, 4, "train.async_save=true")
    _resumed(run, ep2_ref, 4)  # nothing lost: the async run's losses are the synchronous reference's
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]


# ----- NaN on one rank ---------------------------------------------------------------------------------
def test_nan_on_one_rank_is_skipped_by_every_rank(raw_for, tmp_path):
    run, config = _config(raw_for, tmp_path, "run")
    p = train(config, 4, "train.faults.nan_at_step=3", "train.faults.rank=3")
    assert "NaN step 3 skipped" in p.stderr
    assert [s for s, r in step_records(run).items() if r["skipped"]] == [3]
    for log in ("train.log", *(f"train.rank{r}.log" for r in (1, 2, 3))):  # every rank dropped the update
        assert "step 3: non-finite loss or gradient, update skipped" in (run / log).read_text(), log


# ----- a slow but live rank ----------------------------------------------------------------------------
def test_a_slow_but_live_rank_is_never_named(raw_for, tmp_path):
    """Rank 2 is 1.5 x the step floor late four times: its GIL held in the first step (a first
    compile), in an evaluation and in a synchronous save (a long pickle), and asleep in a step (a
    slow filesystem). The run finishes; no rank is named."""
    run, config = _config(raw_for, tmp_path, "run")
    slow = ["train.faults.rank=2", "train.faults.slow_s=4.5", "train.eval_every=4",
            "train.faults.slow_at=[compile@1, step@3, eval@4, save@6]"]
    p = train(config, 4, *slow, *FAST_HB)
    for where, step in (("compile", 1), ("step", 3), ("eval", 4), ("save", 6)):
        _fault_time(p.stderr, f"slow for 4.5 s in {where} of step {step}")
    assert "heartbeat:" not in p.stderr
    assert sorted(step_records(run)) == list(range(1, 9))


# ----- under torchrun --max-restarts 1: the restart resumes by itself -------------------------------------
# slow: torchrun's restart path is kept in the fast tier by test_distributed's
# test_kill_and_resume_two_ranks_is_exact, the kill and the stop here by the warm cases above
@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    pytest.param(["train.faults.kill_mid_step=5", "train.faults.rank=2"], id="sigkill"),
    pytest.param(["train.faults.stop_at_step=5", "train.faults.rank=1", *FAST_HB], id="sigstop"),
])
def test_torchrun_restarts_the_job_and_the_resume_is_exact(raw_for, tmp_path, ep2_ref, fault):
    run, config = _config(raw_for, tmp_path, "run")
    p = train(config, 4, *fault, max_restarts=1)
    if "stop" in fault[0]:
        exits = _exits(p.stderr)
        assert sorted(exits) == [0, 2, 3], p.stderr[-4000:]
        assert all("rank 1 silent" in line for line, _ in exits.values())
    _resumed(run, ep2_ref, 4)
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]


# slow (a compile on every rank): test_a_slow_but_live_rank_is_never_named keeps the path, a first
# step that holds the GIL past the floor
@pytest.mark.slow
def test_a_real_first_compile_is_never_named(raw_for, tmp_path):
    """dist.compile (aot_eager: Dynamo's trace and AOT autograd, no code generation) on 2 ranks: the
    first eval and the first step compile on both, past the drills' 3 s floor; the heartbeat stays
    quiet."""
    run = tmp_path / "run"
    config = write_config(raw_for, run, ["data.batch_size=1", "train.steps=3"])
    p = train(config, 2, "dist.compile=true", "dist.compile_backend=aot_eager", *FAST_HB)
    assert "heartbeat:" not in p.stderr
    assert sorted(step_records(run)) == [1, 2, 3]
    assert step_records(run)[1]["step_s"] > 3  # the compile did outlast the floor
