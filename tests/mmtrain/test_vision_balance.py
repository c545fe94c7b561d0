"""vision.balance over gloo ranks: the media encoded elsewhere than their rows, the tokens sent
back, and the training the same as one process holding every row (losses, gradient norms, expert
loads), with images, video and interleaved documents. At batch_size=2 over 2 data-parallel ranks,
step 5's second row holds no medium (test_vision_plan.py covers empty ranks exhaustively)."""

from __future__ import annotations

import json

import pytest
from dist_runs import HERE as WORKER
from dist_runs import launch, parity_reference, write_config

from mmtrain.config import apply_override, from_dict
from mmtrain.errors import ConfigError
from mmtrain.run_config import RunConfig

pytestmark = pytest.mark.distributed

STEPS = "5"
TILE = "model.decoder.attention.full_tile=16"  # cp chunks of whole tiles; on every run: one reference
MESHES = {  # (ranks, rows, overrides); the reference: one process, the same rows, balance none
    "fsdp2-dp": (2, 2, ["vision.balance=dp"]),
    "cp2-dp_cp": (2, 2, ["dist.cp=2", "vision.balance=dp_cp"]),
    # media cross cp groups (each sent once, from the group rank i % cp), tokens to both of its ranks
    "fsdp2-cp2-ep2-dp_cp": (4, 2, ["dist.cp=2", "dist.ep=2", "vision.balance=dp_cp"]),
}
SLOW = pytest.mark.slow  # beyond CI's time (~15-60 s each)
MORE_MESHES = {  # MMTRAIN_SLOW_TESTS=1
    "fsdp4-dp": (4, 4, ["vision.balance=dp"]),
    "hsdp2x2-dp": (4, 4, ["dist.dp_replicate=2", "vision.balance=dp"]),
    "ddp4-dp": (4, 4, ["dist.strategy=ddp", "vision.balance=dp"]),
    "fsdp2-ac-accum-dp": (2, 2, ["dist.activation_checkpointing=true", "train.grad_accum=2",
                                 "vision.balance=dp"]),
    # dp under cp: balanced among the ranks of one cp coordinate (its own process groups)
    "fsdp2-cp2-dp": (4, 2, ["dist.cp=2", "vision.balance=dp"]),
}


@pytest.fixture(scope="module")
def reference(raw_for, tmp_path_factory):
    """One process's run on `base` overrides (cached: meshes share it)."""
    cache = {}

    def run(base: list[str]) -> dict:
        key = tuple(base)
        if key not in cache:
            out = tmp_path_factory.mktemp("one")
            config = write_config(raw_for, out / "run", base)
            parity_reference(config, out / "one.json", int(STEPS))
            cache[key] = json.loads((out / "one.json").read_text())
        return cache[key]

    return run


@pytest.mark.parametrize("mesh", [*MESHES, *(pytest.param(m, marks=SLOW) for m in MORE_MESHES)])
def test_balanced_encoding_matches_one_process(raw_for, reference, tmp_path, mesh):
    nproc, rows, overrides = {**MESHES, **MORE_MESHES}[mesh]
    base = [f"data.batch_size={rows}", TILE, *(o for o in overrides if "grad_accum" in o)]
    one = reference(base)
    config = write_config(raw_for, tmp_path / "run", [*base, *overrides])
    launch([str(WORKER), "parity", str(config), str(tmp_path / "bal.json"), STEPS], nproc=nproc)
    bal = json.loads((tmp_path / "bal.json").read_text())
    assert bal["traffic"].get("vision_tokens", 0) > 0  # tokens did travel (under cp: to the other rank)
    if mesh != "cp2-dp_cp":  # step 1's rows hold 3 and 1 media: some leave their rows' ranks
        assert bal["traffic"].get("vision_patches", 0) > 0
    assert bal["tokens"] == one["tokens"]
    assert bal["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert bal["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5, abs=0)
    assert bal["expert_bias"] == one["expert_bias"]  # the same expert loads, step by step


HEADS = "model.decoder.n_kv_heads=2"  # a tp rank holds whole KV groups


def _off_and_on(raw_for, tmp_path, nproc: int, base: list[str], overrides: list[str]) -> tuple[dict, dict]:
    """The parity worker at `overrides` with the balance off (its vision.* keys dropped) and on: the
    same tokens, losses and gradient norms (rel 1e-5); -> (off, on)."""
    runs = {}
    for name, sets in (("off", [o for o in overrides if not o.startswith("vision.")]), ("on", overrides)):
        config = write_config(raw_for, tmp_path / name, [*base, *sets])
        launch([str(WORKER), "parity", str(config), str(tmp_path / f"{name}.json"), STEPS], nproc=nproc)
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    off, on = runs["off"], runs["on"]
    assert on["tokens"] == off["tokens"]
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=0)
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5, abs=0)
    return off, on
TP_MESHES = {  # (ranks, rows, overrides); the encoder is replicated over tp, its rows' media on each tp rank
    # dp_cp: each medium once in the world, its tokens to the tp ranks whose chunk reads them
    "tp2-dp_cp": (2, 2, ["dist.tp=2", "vision.balance=dp_cp"]),
    # dp among the data ranks of one tp coordinate (a group per coordinate, as fsdp2-cp2-dp's)
    "fsdp2-tp2-dp": (4, 2, ["dist.tp=2", "vision.balance=dp"]),
    # MMTRAIN_SLOW_TESTS=1: media across tp groups (tp2-dp_cp keeps dp_cp's tp path in CI, and
    # fsdp2-cp2-ep2-dp_cp the sends between units)
    "fsdp2-tp2-dp_cp": (4, 2, ["dist.tp=2", "vision.balance=dp_cp"]),
}


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=SLOW) if m == "fsdp2-tp2-dp_cp" else m
                                  for m in TP_MESHES])
def test_balance_under_tp_matches_it_off_and_spreads_the_encoding(raw_for, tmp_path, mesh):
    """The same run with the balance off and on (TP off = one process: test_tensor_parallel.py);
    the patches each rank's encoder took in, counted: dp_cp encodes each medium once in the world,
    where each tp rank encodes all of its rows' media without it; dp moves media between the data
    ranks of one tp coordinate, so its busiest rank encodes no more than without it."""
    nproc, rows, overrides = TP_MESHES[mesh]
    off, on = _off_and_on(raw_for, tmp_path, nproc, [f"data.batch_size={rows}", HEADS], overrides)
    assert on["expert_bias"] == off["expert_bias"]
    assert on["traffic"].get("vision_tokens", 0) > 0 and on["traffic"]["tp_all_gather"] > 0
    got, was = on["encoded_patches"], off["encoded_patches"]  # per rank, 5 steps
    assert was[0::2] == was[1::2]  # without the balance: a tp pair encodes the same media
    if "dp_cp" in mesh:  # each medium once: the world's total of the rows' media, split over all ranks
        assert sum(got) == sum(was) // 2
        assert all(g < w for g, w in zip(got, was)), (got, was)
    else:  # each tp coordinate balances the same media the same way; the busiest rank no busier
        assert got[0::2] == got[1::2] and sum(got) == sum(was) and max(got) <= max(was)


@pytest.mark.parametrize("cp, tp", [(1, 2), (2, 2)])
def test_balance_groups_are_the_data_ranks_of_one_row_chunk(cp, tp):
    """dp: a group per (cp, tp) coordinate, its data ranks (a tp pair holds the same media, so the
    world would balance copies); dp_cp: the world, in units of the cp x tp ranks of one rows' slot."""
    import torch.distributed as dist
    from dist_runs import fake_process_group

    from mmtrain.parallel.config import DistConfig
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.vision_balance import balance_group

    world = 2 * cp * tp  # dp_shard 2
    for rank in range(world):
        with fake_process_group(world, rank):
            dims = ParallelDims.from_config(DistConfig(cp=cp, tp=tp), world, rank)
            group, unit = balance_group("dp", dims)
            assert unit == 1 and dist.get_process_group_ranks(group) == [
                r for r in range(world) if r % (cp * tp) == dims.seq_rank]
            assert balance_group("dp_cp", dims) == (dist.group.WORLD, cp * tp)


def test_config_names_a_bad_balance(raw_for, tmp_path):
    raw = raw_for(tmp_path / "run")
    apply_override(raw, "vision.balance=dp_cp")
    with pytest.raises(ConfigError, match="dp_cp needs dist.cp or dist.tp > 1"):
        from_dict(RunConfig, raw, source="t")
    apply_override(raw, "vision.balance=ranks")
    with pytest.raises(ConfigError, match="vision.balance: must be one of"):
        from_dict(RunConfig, raw, source="t")


# dist.pp > 1: only stage 0 (pp rank 0) encodes; the balance spreads it over that stage's data ranks
PP_MESHES = {  # (ranks, rows, overrides); tiny's grad_accum 1: each rank's 2 rows in the schedule's 2 parts
    "pp2-fsdp2-dp": (4, 4, ["dist.pp=2", "vision.balance=dp"]),
    # MMTRAIN_SLOW_TESTS=1 (pp2-fsdp2-dp keeps the pp path in CI, tp2-dp_cp the units): dp_cp in units
    # of stage 0's tp pair, each medium encoded once instead of on both tp ranks
    "tp2-pp2-dp_cp": (4, 4, ["dist.pp=2", "dist.tp=2", HEADS, "vision.balance=dp_cp"]),
}


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=SLOW) if "tp2" in m else m for m in PP_MESHES])
def test_balance_under_pp_matches_it_off_and_spreads_stage0s_encoding(raw_for, tmp_path, mesh):
    """PP(2) x FSDP(2): stage 0's two data ranks exchange their micro-batches' media (their schedules
    run the same forwards in the same order, row parts included); the same losses and gradient norms
    as with the balance off, and each stage-0 rank encodes fewer patches than the busier did without
    it (the stage-1 ranks none: they hold no encoder)."""
    nproc, rows, overrides = PP_MESHES[mesh]
    off, on = _off_and_on(raw_for, tmp_path, nproc, [f"data.batch_size={rows}"], overrides)
    assert on["traffic"].get("vision_tokens", 0) > 0  # (dp_cp in one tp pair: its rows' media at hand)
    assert on["traffic"].get("vision_patches", 0) > 0 or "dp_cp" in mesh
    got, was = on["encoded_patches"], off["encoded_patches"]  # per rank, 5 steps; ranks 0, 1: stage 0
    assert got[2:] == was[2:] == [0, 0] and min(was[:2]) > 0, (got, was)
    if "dp_cp" in mesh:  # the tp pair encoded the same media twice; now each medium once
        assert was[0] == was[1] and sum(got) == sum(was) // 2, (got, was)
    assert sum(got) <= sum(was) and max(got) < max(was), (got, was)


@pytest.mark.parametrize("cp, tp", [(1, 1), (1, 2)])
def test_balance_groups_under_pp_are_the_first_stages_ranks(cp, tp):
    """dist.pp 2: the encoder is stage 0's, on pp rank 0 under every schedule: dp balances over its
    data ranks of one (cp, tp) coordinate, dp_cp over all its ranks in units of cp x tp; the other
    stage's ranks balance nothing, and the log line says why (as at PP(2) alone, one data rank)."""
    import torch.distributed as dist
    from dist_runs import fake_process_group

    from mmtrain.parallel.config import DistConfig
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.vision_balance import VisionBalanceConfig, balance_group, install

    seq = cp * tp
    world = 2 * 2 * seq  # pp 2 x dp_shard 2
    for rank in range(world):
        with fake_process_group(world, rank):
            dims = ParallelDims.from_config(DistConfig(pp=2, cp=cp, tp=tp), world, rank)
            group, unit = balance_group("dp", dims)
            if rank >= world // 2:
                assert (group, unit) == (None, 1)
                assert "holds no vision encoder" in install(None, VisionBalanceConfig("dp"), dims)
                assert seq == 1 or balance_group("dp_cp", dims) == (None, 1)
                continue
            assert unit == 1 and dist.get_process_group_ranks(group) == [
                r for r in range(world // 2) if r % seq == dims.seq_rank]
            if seq > 1:
                group, unit = balance_group("dp_cp", dims)
                assert unit == seq and dist.get_process_group_ranks(group) == list(range(world // 2))
    for rank in range(2):  # PP(2) alone: stage 0 has one data rank
        with fake_process_group(2, rank):
            dims = ParallelDims.from_config(DistConfig(pp=2), 2, rank)
            assert balance_group("dp", dims) == (None, 1)
            line = install(None, VisionBalanceConfig("dp"), dims)
            assert ("one data rank on the first pipeline stage" if rank == 0 else "holds no vision") in line
