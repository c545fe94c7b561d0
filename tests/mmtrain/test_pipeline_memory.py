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
import torch.distributed as dist

SETS = ["loss.visual_next.weight=0", "model.visual_head=false", "model.decoder.vocab_size=512"]


def _bytes(modules) -> int:
    """Unique storages' bytes of the modules' parameters and buffers (a DTensor's local shard)."""
    seen = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _ranks(pp: int):
    """(one process's bytes, [(stage bytes, everything the rank's PipelineModel holds) per rank])."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mmtrain.config import load_config
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline_model import PipelineModel
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", [f"dist.pp={pp}", f"train.grad_accum={pp}", *SETS])
    one = _bytes([MultimodalModel(cfg.model)])
    out = []
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            dims = ParallelDims.from_config(cfg.dist, pp, rank)
            pm = PipelineModel(cfg, DistEnv(rank, pp, rank, pp), torch.device("cpu"), dims)
            out.append((_bytes(pm.parts), _bytes([pm.full, *pm.parts])))
        finally:
            dist.destroy_process_group()
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
