"""Tensor (+ sequence) parallelism on CPU with gloo (mmtrain/parallel/tensor_parallel.py): a run at
TP(2), TP(4), FSDP(2) x TP(2) and TP(2) x CP(2) gives the losses, gradient norms and MoE expert
biases of one process on the same rows, over 5 steps of the tiny corpus (images, video,
interleaved documents; MoE layers; sparse layers that select); config the TP split cannot serve is
a one-line error naming the key.
"""

from __future__ import annotations

import json
import os

import pytest
from dist_runs import HERE as WORKER
from dist_runs import launch, write_config

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.skipif(not os.environ.get("MMTRAIN_SLOW_TESTS"),
                          reason="beyond CI's time: MMTRAIN_SLOW_TESTS=1")
STEPS = 5
HEADS = {2: ["model.decoder.n_kv_heads=2"],  # a tp rank holds whole KV groups
         4: ["model.decoder.n_heads=4", "model.decoder.n_kv_heads=4",
             "model.decoder.mrope_sections=[1, 1, 2]"]}
TILE = ["model.decoder.attention.full_tile=16"]  # under cp: chunks of whole tiles
MESHES = {  # (ranks, rows, overrides)
    "tp2": (2, 2, ["dist.tp=2", *HEADS[2]]),
    "tp4": (4, 2, ["dist.tp=4", *HEADS[4]]),
    "fsdp2-tp2": (4, 2, ["dist.tp=2", *HEADS[2]]),
    "tp2-cp2": (4, 2, ["dist.tp=2", "dist.cp=2", *HEADS[2], *TILE]),
}


def _parity(raw_for, tmp_path, mesh: str) -> tuple[dict, dict]:
    nproc, rows, overrides = MESHES[mesh]
    base = [f"data.batch_size={rows}", *(o for o in overrides if not o.startswith("dist."))]
    one_cfg = write_config(raw_for, tmp_path / "one", base)
    launch([str(WORKER), "parity", str(one_cfg), str(tmp_path / "one.json"), str(STEPS)])
    config = write_config(raw_for, tmp_path / "run", [*base, *overrides])
    launch([str(WORKER), "parity", str(config), str(tmp_path / "tp.json"), str(STEPS)], nproc=nproc)
    return tuple(json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "tp"))


def _check(one: dict, tp: dict) -> None:
    assert tp["tokens"] == one["tokens"]
    assert tp["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
    assert tp["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5, abs=0)
    assert tp["expert_bias"] == one["expert_bias"]  # the same expert loads, step by step
    assert tp["traffic"]["tp_all_gather"] > 0 and tp["traffic"]["tp_reduce_scatter"] > 0


@pytest.mark.parametrize("mesh", ["tp2"])
def test_tensor_parallel_ranks_match_one_process(raw_for, tmp_path, mesh):
    _check(*_parity(raw_for, tmp_path, mesh))


@SLOW
@pytest.mark.parametrize("mesh", ["tp4", "fsdp2-tp2", "tp2-cp2"])
def test_tensor_parallel_meshes_match_one_process(raw_for, tmp_path, mesh):
    _check(*_parity(raw_for, tmp_path, mesh))


@pytest.mark.parametrize("overrides, key", [
    ([], "model.decoder.n_kv_heads"),  # the tiny model's one KV head cannot split
    ([*HEADS[2], "model.decoder.ffn_dim=63"], "model.decoder.ffn_dim"),
    ([*HEADS[2], "data.seq_len=191"], "data.seq_len"),
    ([*HEADS[2], "dist.compile=true"], "dist.compile"),
    ([*HEADS[2], "vision.balance=dp"], "vision.balance"),
])
def test_what_tp_cannot_split_is_one_line_naming_the_key(make_config, tmp_path, overrides, key):
    from mmtrain.errors import UserError
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.tensor_parallel import check_tp

    cfg = make_config(tmp_path, ["dist.tp=2", *overrides])
    with pytest.raises(UserError) as e:
        check_tp(cfg, ParallelDims.from_config(cfg.dist, 2))
    assert key in str(e.value) and "\n" not in str(e.value)
