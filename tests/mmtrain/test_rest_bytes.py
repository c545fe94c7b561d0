"""What FSDP, EP and TP keep per rank at rest: parameter and buffer bytes of the trainer's model
(`parallelize.build_model`) on torch's fake process group, rank 0 of N. Each shards over the world
(FSDP2 over fsdp, the experts over ep then efsdp; at TP(N) the split layers' weights Shard over tp,
the rest FSDP over dp x tp), so a rank holds 1/N of one process's bytes at N = 2 and 4, the experts
1/N too. (TP's gathered weights and their traffic over the same ranks: test_tp_scaling.py.)"""

from __future__ import annotations

import pytest
import torch

SETS = ["model.decoder.vocab_size=512", "model.decoder.n_kv_heads=4"]


def _rank0(n: int, sets: list[str]):
    from dist_runs import fake_process_group, state_bytes

    from mmtrain.config import load_config
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.parallelize import build_model
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", [*SETS, *sets])
    with fake_process_group(n):
        model, _ = build_model(cfg, DistEnv(0, n, 0, n), torch.device("cpu"))
        return state_bytes([model]), state_bytes([model], experts=True)


@pytest.mark.parametrize("dim", ["fsdp", "ep", "tp"])
def test_a_rank_holds_one_nth_of_the_model_at_rest(dim):
    whole, experts = _rank0(1, [])
    for n in (2, 4):
        sets = {"fsdp": [], "ep": [f"dist.ep={n}"], "tp": [f"dist.tp={n}"]}[dim]
        mine, my_experts = _rank0(n, sets)
        assert mine == pytest.approx(whole / n, rel=0.02), (dim, n, mine / whole)
        assert my_experts == pytest.approx(experts / n, rel=0.02), (dim, n, my_experts / experts)
