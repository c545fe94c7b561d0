"""What tensor parallelism exists to save, measured on torch's fake process group (rank 0 of 4: the
trainer's `build_model`, FSDP2 and the tp split as they run; tensors are real, collectives answer
nothing): over the same 4 ranks, TP(1) x FSDP(4), TP(2) x FSDP(2) and TP(4), a split decoder layer's
gathered weights and the bytes its all-gather sends fall to <= 0.55 per doubling of tp (a tp rank
gathers only its Shard of wqkv / wo / w_in / w_out, over the dp ranks; the routed experts are not
split); a split layer's exit is a reduce-scatter sending half the bytes of the all-reduce the same
partial sums would need.
(At rest a rank holds 1/N at TP(N): test_rest_bytes.py; the whole model's all-gather: test_plan.py.)
"""

from __future__ import annotations

import torch

SETS = ["model.decoder.vocab_size=512", "model.decoder.n_kv_heads=4"]
SPLIT = ("attn.wqkv.weight", "attn.wo.weight", "ffn.w_in.weight", "ffn.w_out.weight",
         "ffn.shared.w_in.weight", "ffn.shared.w_out.weight")
EXPERTS = ("experts.w_in_EDF2", "experts.w_out_EFD")


def _gathered(tp: int, layer: int) -> dict[str, float]:
    """Decoder layer `layer` on rank 0 of 4 at dist.tp = `tp`, every FSDP unit in it gathered: the bytes
    of its split weights and of its routed experts as gathered, and the wire bytes its all-gathers send."""
    from dist_runs import fake_process_group
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from mmtrain.config import load_config
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.distributed import DistEnv
    from mmtrain.parallel.parallelize import build_model
    from mmtrain.plan.comm import CommCounter, group_names
    from mmtrain.run_config import RunConfig

    def held(block, names) -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                   for name, p in block.named_parameters() if name.endswith(names))

    cfg = load_config(RunConfig, "configs/tiny.yaml", [*SETS, f"dist.tp={tp}"])
    with fake_process_group(4):
        dims = ParallelDims.from_config(cfg.dist, 4, 0)
        model, _ = build_model(cfg, DistEnv(0, 4, 0, 4), torch.device("cpu"), dims)
        block = model.decoder.layers[layer]
        units = [m for m in block.modules() if isinstance(m, FSDPModule)]  # the layer, its norms', experts'
        counter = CommCounter(group_names(dims))
        with counter:
            for unit in units:
                unit.unshard()
        out = {"split": held(block, SPLIT), "experts": held(block, EXPERTS)}
        for unit in units:
            unit.reshard()
    out["wire"] = sum(nbytes for (_, kind), (_, nbytes) in counter.calls.items() if kind == "all_gather")
    return out


def _falls(values: list[float]) -> bool:
    return values[0] > 0 and all(b <= 0.55 * a for a, b in zip(values, values[1:]))


def test_a_split_layer_gathers_one_tpth_of_its_weights_over_the_same_ranks():
    """A dense layer (attention + SwiGLU): its gathered weights and its all-gathers' bytes (norms
    included) fall per doubling (at TP(4) no dp rank is left to gather from: 0 bytes)."""
    runs = [_gathered(tp, 0) for tp in (1, 2, 4)]
    assert _falls([r["split"] for r in runs]) and _falls([r["wire"] for r in runs]), runs


def test_a_moe_layers_shared_expert_splits_and_its_routed_experts_do_not():
    """An MoE layer: attention and the shared expert fall as a dense layer's; the routed experts are
    not split over tp (each tp rank routes its own tokens to whole experts: expert parallelism is
    what shards them), so a rank gathers them whole at every tp."""
    runs = [_gathered(tp, 1) for tp in (1, 2, 4)]
    assert _falls([r["split"] for r in runs]), runs
    assert runs[0]["experts"] > 0 and len({r["experts"] for r in runs}) == 1, runs


def test_a_split_layers_exit_is_a_reduce_scatter_half_an_all_reduce():
    """A split SwiGLU on the fake process group (tp 2): training (rows split: the exit reduce-scatters
    the partial sums) against whole rows (evaluation: the exit all-reduces the same (2T, D) sums),
    each counted by the plan's dispatch-level collective counter on the tp group."""
    from dist_runs import fake_process_group

    from mmtrain.config import load_config
    from mmtrain.models.ffn import SwiGLU
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.tensor_parallel import TPComm, _split_swiglu
    from mmtrain.plan.comm import CommCounter, group_names
    from mmtrain.run_config import RunConfig

    cfg = load_config(RunConfig, "configs/tiny.yaml", ["dist.tp=2"])
    T, D = 16, 32
    with fake_process_group(2):
        dims = ParallelDims.from_config(cfg.dist, 2, 0)
        comm = TPComm(dims.tp_mesh("cpu"))
        ffn = SwiGLU(D, 64)
        _split_swiglu(ffn, comm)
        sent = {}
        for whole, rows in ((False, T), (True, 2 * T)):
            comm.whole = whole
            counter = CommCounter(group_names(dims))
            with counter:
                ffn(torch.randn(rows, D))
            sent[whole] = {kind: nbytes for (dim, kind), (_, nbytes) in counter.calls.items() if dim == "tp"}
    assert set(sent[False]) == {"all_gather", "reduce_scatter"} and set(sent[True]) == {"all_reduce"}
    assert sent[False]["reduce_scatter"] == 0.5 * sent[True]["all_reduce"] == T * D * 4 > 0
