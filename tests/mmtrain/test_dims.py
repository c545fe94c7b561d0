"""The mesh's arithmetic without a process group (mmtrain/parallel/dims.py): every rank has one
coordinate, the ranks of a tp / cp / pp group share the data slot, bad sizes are one-line errors
naming the keys."""

from __future__ import annotations

import itertools

import pytest

from mmtrain.errors import UserError
from mmtrain.parallel.config import DistConfig
from mmtrain.parallel.dims import ParallelDims

MESHES = [dict(tp=2), dict(pp=2), dict(tp=2, pp=2), dict(tp=2, cp=2), dict(dp_replicate=2, tp=2, cp=2),
          dict(pp=2, cp=2, tp=2, dp_replicate=1)]


def _all(world: int, **keys) -> list[ParallelDims]:
    return [ParallelDims.from_config(DistConfig(**keys), world, r) for r in range(world)]


@pytest.mark.parametrize("keys", MESHES, ids=str)
@pytest.mark.parametrize("world", [8, 16])
def test_coordinates_are_a_bijection_and_groups_share_their_data_slot(keys, world):
    ranks = _all(world, **keys)
    d = ranks[0]
    assert d.pp * d.dp_replicate * d.dp_shard * d.cp * d.tp == world
    coords = {(x.pp_rank, x.dp_rank, x.cp_rank, x.tp_rank) for x in ranks}
    assert len(coords) == world  # one coordinate per rank
    for x in ranks:
        assert x.rank_of(x.dp_rank, x.cp_rank, x.tp_rank, x.pp_rank) == x.rank
        assert 0 <= x.dp_rank < x.dp_size == world // (d.pp * d.cp * d.tp)
    # tp innermost: a tp group is neighbouring ranks
    for x in ranks:
        assert x.tp_rank == x.rank % d.tp
    # the data slots: each read by exactly pp * cp * tp ranks
    slots = [x.dp_rank for x in ranks]
    assert all(slots.count(s) == d.pp * d.cp * d.tp for s in set(slots))


def test_the_old_meshes_keep_their_ranks():
    """No tp / pp: the coordinates are the ones before tp and pp existed (checkpoints rely on them)."""
    for world, cp in itertools.product([4, 8], [1, 2]):
        for x in _all(world, cp=cp):
            assert (x.dp_rank, x.cp_rank, x.tp_rank, x.pp_rank) == (x.rank // cp, x.rank % cp, 0, 0)


def test_dp_shard_takes_the_rest():
    d = ParallelDims.from_config(DistConfig(tp=2, pp=2, cp=2), 16)
    assert (d.dp_shard, d.dp_size) == (2, 2)


@pytest.mark.parametrize("keys,world", [(dict(tp=3), 8), (dict(tp=2, pp=2, dp_shard=4), 8), (dict(pp=16), 8)])
def test_a_size_mismatch_is_one_line_naming_the_keys(keys, world):
    with pytest.raises(UserError) as e:
        ParallelDims.from_config(DistConfig(**keys), world)
    msg = str(e.value)
    assert "\n" not in msg and "dist.tp" in msg and "dist.pp" in msg and "dist.dp_shard" in msg


def test_ep_borrows_from_dp_shard_x_cp_not_tp():
    with pytest.raises(UserError, match="dist.ep"):
        ParallelDims.from_config(DistConfig(tp=2, ep=4), 4)
    assert ParallelDims.from_config(DistConfig(tp=2, ep=2), 4).efsdp == 1


def test_ddp_refuses_tp_and_pp():
    for key in ("tp", "pp"):
        with pytest.raises(UserError, match=f"dist.{key}"):
            ParallelDims.from_config(DistConfig(strategy="ddp", **{key: 2}), 2)


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_bad_values_name_the_key(key):
    with pytest.raises(ValueError, match=key):
        DistConfig(**{key: 0})


@pytest.mark.parametrize("key", ["tp", "pp"])
def test_a_mesh_dim_without_an_implementation_is_refused_in_one_line(key):
    d = ParallelDims.from_config(DistConfig(**{key: 2}), 4)
    with pytest.raises(UserError, match=f"dist.{key}"):
        d.refuse_unimplemented()
