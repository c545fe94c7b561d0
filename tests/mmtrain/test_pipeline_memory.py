"""What pipeline parallelism exists to save, per rank: parameter and buffer bytes at rest, built by
`PipelineModel` on torch's fake process group (one process plays each rank in turn; the tensors are
real CPU tensors, the collectives answer nothing). The split is by FLOPs, so a stage's share of the
bytes follows its layers (tiny at PP(2): 0.32 and 0.68, the MoE layers on stage 1); what must hold at
any degree is that the stages partition the model's bytes and the largest share falls as pp grows.
Open (the scale-out issue): a rank also keeps a whole replica for evaluation (`PipelineModel.full`),
so it holds 1.2-1.7x one process's bytes; the strict xfail below turns into a failure once that is
gone, so that its marker is removed with it."""

from __future__ import annotations

import pytest
import torch

SETS = ["loss.visual_next.weight=0", "model.visual_head=false", "model.decoder.vocab_size=512"]


def _ranks(pp: int):
    """(one process's bytes, [(stage bytes, everything the rank's PipelineModel holds) per rank])."""
    from dist_runs import fake_process_group, state_bytes

    from mmtrain.config import load_config
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline_model import PipelineModel
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", [f"dist.pp={pp}", f"train.grad_accum={pp}", *SETS])
    one = state_bytes([MultimodalModel(cfg.model)])
    out = []
    for rank in range(pp):
        with fake_process_group(pp, rank):
            dims = ParallelDims.from_config(cfg.dist, pp, rank)
            pm = PipelineModel(cfg, DistEnv(rank, pp, rank, pp), torch.device("cpu"), dims)
            out.append((state_bytes(pm.parts), state_bytes([pm.full, *pm.parts])))
    return one, out


@pytest.fixture(scope="module")
def measured():
    return {pp: _ranks(pp) for pp in (2, 4)}


def test_the_stages_partition_the_models_bytes_and_the_largest_share_falls(measured):
    largest = {}
    for pp, (one, ranks) in measured.items():
        stages = [s for s, _ in ranks]
        assert sum(stages) == pytest.approx(one, rel=0.01), (pp, stages, one)  # each weight on one rank
        largest[pp] = max(stages) / one
    assert largest[4] < largest[2] < 1.0, largest


@pytest.mark.xfail(strict=True, reason="open (the scale-out issue): PipelineModel keeps a whole replica "
                                       "(`full`) on every rank besides its stage")
def test_a_pipeline_rank_holds_its_stage_and_nothing_more(measured):
    for pp, (one, ranks) in measured.items():
        for rank, (stage, held) in enumerate(ranks):
            assert held <= stage * 1.01, (pp, rank, held / one, stage / one)
