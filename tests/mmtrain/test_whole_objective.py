"""The collapse cure at every mesh: configs/tiny.yaml's own objective (next-visual-token term, z-loss,
MoE aux) plus the mismatch contrast and token weighting, at grad_accum 1, gives one process's losses,
gradient norms and expert biases on the same rows over 5 steps, with the sparse layers selecting.

Every term's mean is one process's over the global batch at any mesh: task and z-loss counts and the
terms' whole-row divisors (visual targets, contrasted documents, masked patches) are summed over the
data-parallel ranks before the forward (`Objective._row_counts`), token weighting's per-task means
over the ranks' tokens, a pipeline's row parts over their batch (loop/pipeline_step.py), and the
contrast's donors one process's over every data rank's rows (objectives/contrast_donors.py).
"""

from __future__ import annotations

import pytest
from test_pipeline_trainer import _check_trainer_parity, _trainer_parity

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow

WHOLE = ["data.batch_size=4", "train.grad_accum=1", "model.visual_head=true", "loss.visual_next.weight=1",
         "loss.contrast.weight=1", "loss.token_weighting.strength=1",
         # one model for every mesh: cp's chunks of whole tiles, tp's whole kv-head groups
         "model.decoder.attention.full_tile=16", "model.decoder.n_kv_heads=2", "model.decoder.n_layers=4"]
MESHES = {  # ranks, dist overrides
    "cp2": (2, ["dist.cp=2"]),
    "tp2": (2, ["dist.tp=2"]),
    "pp2-1f1b": (2, ["dist.pp=2"]),
    "pp2-interleaved": (2, ["dist.pp=2", "dist.pp_schedule=Interleaved1F1B"]),
    "tp2-pp2": (4, ["dist.pp=2", "dist.tp=2"]),
    # the contrast's donors: one process's over both data ranks' rows (contrast_donors.py)
    "fsdp2-cp2-ep2": (4, ["dist.cp=2", "dist.ep=2"]),
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_whole_objective_at_every_mesh_matches_one_process(raw_for, tmp_path, mesh):
    nproc, overrides = MESHES[mesh]
    base = [*WHOLE, *(o for o in overrides if not o.startswith("dist."))]  # both sides
    one, got = _trainer_parity(raw_for, tmp_path, nproc, [o for o in overrides if o.startswith("dist.")],
                               base=base)
    _check_trainer_parity(one, got)
    # the sparse layers select (one process counts what attention visits on its log steps)
    assert any(a["sparse"] and a["kept_frac"] < 1 for a in one["attn"].values()), one["attn"]
