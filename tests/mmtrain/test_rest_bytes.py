"""What FSDP, EP and TP keep per rank at rest: parameter and buffer bytes of the trainer's model
(`parallelize.build_model`) on torch's fake process group, rank 0 of N. Each shards over the world
(FSDP2 over fsdp, the experts over ep then efsdp, tp inside fsdp), so a rank holds 1/N of one
process's bytes at N = 2 and 4, the experts 1/N too. (What TP still does not save is its gathered
weights and their traffic: test_plan.py; PP's replica: test_pipeline_memory.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

SETS = ["model.decoder.vocab_size=512", "model.decoder.n_kv_heads=4"]


def _bytes(model, experts: bool | None = None) -> int:
    seen = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if experts is not None and (".experts." in name) != experts:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _rank0(n: int, sets: list[str]):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mmtrain.config import load_config
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.parallelize import build_model
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", [*SETS, *sets])
    if n > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        model, _ = build_model(cfg, DistEnv(0, n, 0, n), torch.device("cpu"))
        return _bytes(model), _bytes(model, experts=True)
    finally:
        if n > 1:
            dist.destroy_process_group()


@pytest.mark.parametrize("dim", ["fsdp", "ep", "tp"])
def test_a_rank_holds_one_nth_of_the_model_at_rest(dim):
    whole, experts = _rank0(1, [])
    for n in (2, 4):
        sets = {"fsdp": [], "ep": [f"dist.ep={n}"], "tp": [f"dist.tp={n}"]}[dim]
        mine, my_experts = _rank0(n, sets)
        assert mine == pytest.approx(whole / n, rel=0.02), (dim, n, mine / whole)
        assert my_experts == pytest.approx(experts / n, rel=0.02), (dim, n, my_experts / experts)
