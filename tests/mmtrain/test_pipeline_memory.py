"""What pipeline parallelism exists to save, per rank: parameter and buffer bytes, at rest and at
build time, of `PipelineModel` on torch's fake process group (one process plays each rank in turn;
the tensors are real CPU tensors, the collectives answer nothing).

Each rank builds its stages on the meta device and gives them values block by block
(`pipeline.materialize`), and the evaluation replica is a meta skeleton except on a pipeline's first
rank around evaluation points (mmtrain/parallel/pipeline_replica.py). So a rank holds its stage and
nothing more, and building it never needs more than the stage: torch's MemTracker (a dispatch mode
counting live storages) sees the build's peak. Before this, every rank built the whole model and
kept a deep copy (`PipelineModel.full`): a rank held 1.3-1.7x one process's bytes, and the build's
peak was 2-3 whole models.

The split minimises the largest stage's FLOPs (pipeline.split_layers), so a stage's share of the
bytes follows its FLOPs: in tiny (MoE) the MoE layers hold 8 experts' weights for 2 experts' FLOPs,
and PP(2)'s shares are 0.32 and 0.68. In a dense model bytes follow FLOPs, and the largest share is
about 1/pp plus the embedding's and encoder's share on stage 0 (tiny dense, 8 layers: 0.52 at PP(2),
0.33 at PP(4))."""

from __future__ import annotations

import pytest
import torch

SETS = ["loss.visual_next.weight=0", "model.visual_head=false", "model.decoder.vocab_size=512"]
DENSE = ["model.decoder.moe=null", "model.decoder.n_layers=8"]


def _built(pp: int, extra: list[str]) -> tuple[int, list[dict]]:
    """(one process's bytes, per rank {"stage", "held", "peak", "block", "replica"} bytes)."""
    from dist_runs import fake_process_group, state_bytes
    from torch.distributed._tools.mem_tracker import MemTracker

    from mmtrain.config import load_config
    from mmtrain.models.multimodal import MultimodalModel
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.pipeline_model import PipelineModel
    from mmtrain.parallel.pipeline_replica import block_modules
    from mmtrain.run_config import RunConfig

    sets = [f"dist.pp={pp}", f"train.grad_accum={pp}", *SETS, *extra]
    cfg = load_config(RunConfig, "configs/tiny.yaml", sets)
    whole = MultimodalModel(cfg.model)
    one = state_bytes([whole])
    block = max(state_bytes([m]) for m in block_modules(whole).values())
    out = []
    for rank in range(pp):
        with fake_process_group(pp, rank):
            dims = ParallelDims.from_config(cfg.dist, pp, rank)
            tracker = MemTracker()
            with tracker:
                pm = PipelineModel(cfg, DistEnv(rank, pp, rank, pp), torch.device("cpu"), dims)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
            rec = {"stage": state_bytes(pm.parts), "held": state_bytes([pm.replica.model, *pm.parts]),
                   "peak": peak, "block": block}
            pm.refresh()  # the holder takes host memory for the whole model; the others nothing
            rec["replica"] = pm.replica.streamed.nbytes() if pm.evaluates else state_bytes([pm.replica.model])
            pm.replica.release()
            rec["released"] = pm.replica.streamed.nbytes() if pm.evaluates else 0
            out.append(rec)
    return one, out


@pytest.fixture(scope="module")
def measured():
    return {(pp, kind): _built(pp, extra) for pp in (2, 4) for kind, extra in (("moe", []), ("dense", DENSE))}


def test_the_stages_partition_the_models_bytes_and_the_largest_share_falls(measured):
    largest = {}
    for (pp, kind), (one, ranks) in measured.items():
        stages = [r["stage"] for r in ranks]
        assert sum(stages) == pytest.approx(one, rel=0.01), (pp, kind, stages, one)  # each weight on one rank
        largest[pp, kind] = max(stages) / one
    for kind in ("moe", "dense"):
        assert largest[4, kind] < largest[2, kind] < 1.0, largest
    assert largest[2, "dense"] <= 0.55 and largest[4, "dense"] <= 0.35, largest  # module docstring


def test_a_pipeline_rank_holds_its_stage_and_nothing_more(measured):
    for (pp, kind), (one, ranks) in measured.items():
        for rank, r in enumerate(ranks):
            assert r["held"] <= r["stage"] * 1.01, (pp, kind, rank, r["held"] / one, r["stage"] / one)


def test_building_a_stage_never_holds_more_than_the_stage_and_one_block(measured):
    for (pp, kind), (one, ranks) in measured.items():
        for rank, r in enumerate(ranks):
            assert r["peak"] <= r["stage"] + r["block"], (pp, kind, rank, r["peak"] / one, r["stage"] / one)


def test_the_replica_is_one_models_host_memory_on_the_first_rank_and_only_around_evaluation(measured):
    for (pp, kind), (one, ranks) in measured.items():
        assert ranks[0]["replica"] == pytest.approx(one, rel=0.01), (pp, kind)  # host memory, one model
        assert ranks[0]["released"] == 0
        assert all(r["replica"] == 0 for r in ranks[1:]), (pp, kind)  # a meta skeleton
