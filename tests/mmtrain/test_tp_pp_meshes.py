"""The trainer at TP(2) x PP(2) composed with activation checkpointing, FSDP and EP, and at TP(2) x
PP(4) (gloo, one thread a rank): the losses, gradient norms (global and per part), token counts and
MoE expert biases of one process on the same rows, step by step (test_pipeline_trainer.py's parity worker
and checks). The plain TP(2) x PP(2) case runs in CI (test_pipeline_trainer.py); these with
MMTRAIN_SLOW_TESTS=1.
"""

from __future__ import annotations

import pytest
from test_pipeline_trainer import _check_trainer_parity, _trainer_parity

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow  # make test-slow
TP2_PP2 = ["dist.tp=2", "dist.pp=2", "model.decoder.n_kv_heads=2"]
MESHES = {  # (ranks, overrides); the non-dist ones apply to both sides
    # the recompute reissues the tp collectives inside each stage's backward, micro-batch by micro-batch
    "tp2-pp2-ac": (4, [*TP2_PP2, "dist.activation_checkpointing=true"]),
    # 8 ranks: each stage's layers FSDP2 over (dp_shard 2 x tp 2), two data slots of a row each
    "tp2-pp2-fsdp2": (8, TP2_PP2),
    # + the routed experts Shard(0) over ep 2 (from dp_shard), FSDP2 over efsdp x tp; every layer
    # MoE, so both stages (rank 0's too) dispatch over ep
    "tp2-pp2-fsdp2-ep2": (8, [*TP2_PP2, "dist.ep=2", "model.decoder.moe.first_dense_layers=0"]),
    # M3's pipeline degree: 4 stages of one layer, 4 micro-batches (1F1B), each split over tp
    "tp2-pp4": (8, ["dist.tp=2", "dist.pp=4", "model.decoder.n_kv_heads=2", "model.decoder.n_layers=4",
                    "train.grad_accum=4"]),
}


@SLOW
@pytest.mark.parametrize("mesh", list(MESHES))
def test_trainer_at_tp2_pp2_meshes_matches_one_process(raw_for, tmp_path, mesh):
    nproc, overrides = MESHES[mesh]
    both = [o for o in overrides if not o.startswith("dist.")]
    one, pp = _trainer_parity(raw_for, tmp_path, nproc, overrides, base=both)
    _check_trainer_parity(one, pp)
    assert pp["traffic"]["tp_all_gather"] > 0 and pp["traffic"]["tp_reduce_scatter"] > 0
    if "dist.ep=2" in overrides:
        assert pp["traffic"]["ep_all_to_all"] > 0
