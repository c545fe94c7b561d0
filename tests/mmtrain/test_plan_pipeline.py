"""The plan's pipeline arithmetic against torch's own schedules (mmtrain/plan/pipe.py)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import _ComputationType as Op

from mmtrain.plan.pipe import micro_batches_in_flight


def _torch_in_flight(cls, pp: int, rank: int, m: int) -> float:
    """The most stage-forwards rank `rank` holds without their backward, in torch's own action list
    for that rank (two stages a rank), in units of a micro-batch through both."""
    sched = cls.__new__(cls)  # the per-rank order needs only these (no process group, no stages)
    sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = pp, m, 2
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    sched._num_stages = sched.num_stages = 2 * pp
    live = peak = 0
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        if action.computation_type == Op.FORWARD:
            live += 1
        elif action.computation_type in (Op.FULL_BACKWARD, Op.BACKWARD_INPUT):  # activations freed
            live -= 1
        peak = max(peak, live)
    return peak / 2


@pytest.mark.parametrize("cls", [ScheduleInterleaved1F1B, ScheduleZBVZeroBubble], ids=lambda c: c.__name__)
def test_the_plans_micro_batches_in_flight_are_torchs(cls):
    """Interleaved1F1B's warm-up holds (v - 1) rounds + 2 per hop from the last rank; the closed form
    min(m, pp - rank) of 1F1B was 25-45% low for it."""
    name = cls.__name__.removeprefix("Schedule")
    for pp in (2, 4, 8):
        for m in range(1, 4 * pp + 1):
            if name == "Interleaved1F1B" and m % pp:
                continue  # torch requires a multiple of pp
            want = [_torch_in_flight(cls, pp, r, m) for r in range(pp)]
            assert [micro_batches_in_flight(name, pp, r, m) for r in range(pp)] == want, (pp, m)


def _stage_bytes(sets: list[str], world: int, rank: int) -> int:
    """The trainer's bytes at rest on `rank`: its PipelineModel's stages (shards), fake process group."""
    import torch
    from dist_runs import fake_process_group, state_bytes

    from mmtrain.config import load_config
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline_model import PipelineModel
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", sets)
    with fake_process_group(world, rank):
        dims = ParallelDims.from_config(cfg.dist, world, rank)
        pm = PipelineModel(cfg, DistEnv(rank, world, rank, world), torch.device("cpu"), dims)
        return state_bytes(pm.parts)


@pytest.mark.budget(40)  # 4 plans and 4 fake-group builds: 14 s alone
@pytest.mark.parametrize("gpus", [2, 4], ids=["pp2", "pp2-fsdp2"])
def test_the_plans_stage_bytes_are_the_trainers(gpus):
    """Parameters (and buffers) at rest per rank: the plan traces every stage holding the encoder,
    the embedding and the head, and takes off what the rank's stages lack; the trainer's stages hold
    exactly that (no replica: mmtrain/parallel/pipeline_replica.py)."""
    from mmtrain.plan.cli import make_plan

    sets = ["model.decoder.vocab_size=512", "data.batch_size=2", "dist.pp=2", "train.grad_accum=2",
            "loss.visual_next.weight=0"]
    for rank in (0, gpus - 1):  # the first stage's first rank, the last stage's last
        plan = make_plan("configs/tiny.yaml", gpus, "h100", sets, rank=rank)
        assert plan["memory"]["by_category"]["parameters"] == _stage_bytes(sets, gpus, rank), rank


@pytest.mark.parametrize("schedule, accum, rows, want", [
    ("1F1B", 1, 8, (2, 4)),  # configs/tiny.yaml at dist.pp 2: each batch split in two
    ("1F1B", 2, 8, (2, 8)),  # grad_accum gives enough
    ("DualPipeV", 1, 8, (4, 2)),  # one a stage: 2 x pp
    ("1F1B", 1, 3, (3, 1)),  # the fewest parts that divide the rows
])
def test_the_plan_splits_batches_into_the_trainers_micro_batches(schedule, accum, rows, want):
    """The plan's micro-batches (count, rows) are the trainer's row parts (`pipeline.row_parts`)."""
    from mmtrain.config import load_config
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.plan.pipe import stage_plan
    from mmtrain.run_config import RunConfig

    sets = ["dist.pp=2", f"dist.pp_schedule={schedule}", f"train.grad_accum={accum}",
            f"data.batch_size={rows}", "model.decoder.vocab_size=512"]
    cfg = load_config(RunConfig, "configs/tiny.yaml", sets)
    info = stage_plan(cfg, ParallelDims.from_config(cfg.dist, 2))
    assert (info["microbatches"], info["rows"]) == want


def test_rows_that_cannot_fill_the_schedule_are_refused_in_one_line():
    from mmtrain.errors import UserError
    from mmtrain.parallel.pipeline import row_parts

    with pytest.raises(UserError, match="data.batch_size") as e:
        row_parts("DualPipeV", 2, 1, 1)  # one row cannot make 4 micro-batches
    assert "\n" not in str(e.value)
