"""What gloo cannot show about the GPU path, checked on torch's fake process group in one process:
the collectives a pipeline or EP rank makes carry tensors on the run's device (the meta device stands
in for CUDA: a CPU tensor there is the bug NCCL raises on), all-to-alls block the host only on gloo,
MoE's chunk count is agreed within the pipeline stage, and the stage boundary takes the stages'
compute dtype. What no CPU test can show: NCCL's own behaviour on a wrong byte count (a hang)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn


@pytest.fixture
def fake_world():
    """fake_world(N): this test's process as rank 0 of a fake world of N, torn down after it."""
    from dist_runs import fake_process_group

    with contextlib.ExitStack() as stack:
        yield lambda world: stack.enter_context(fake_process_group(world))


def test_a_stage_without_gradients_adds_a_zero_on_the_runs_device(fake_world):
    from mmtrain.parallel.pipeline import pp_grad_norm, pp_grad_norm_of

    fake_world(2)
    meta = torch.device("meta")
    assert pp_grad_norm([nn.Linear(2, 2, device=meta)], dist.group.WORLD, 1.0).device == meta
    assert pp_grad_norm_of([], dist.group.WORLD, meta).device == meta


def test_an_all_to_all_waits_on_the_host_only_on_gloo(fake_world, monkeypatch):
    from mmtrain.parallel import comm

    fake_world(2)
    calls = []

    class NoWait:
        def wait(self, timeout=None):
            raise AssertionError("a host wait on a backend that bounds its own collectives")

    def record(out, x, out_P=None, in_P=None, group=None, async_op=False):
        calls.append(async_op)
        return NoWait() if async_op else None

    monkeypatch.setattr(dist, "all_to_all_single", record)
    comm.all_to_all_single(torch.empty(2), torch.ones(2), None, None, dist.group.WORLD)
    assert calls == [False]


def test_moe_chunks_are_agreed_within_the_pipeline_stage(fake_world, monkeypatch):
    from mmtrain.parallel.config import DistConfig
    from mmtrain.parallel.dims import ParallelDims
    from mmtrain.parallel.expert_parallel import shard_experts

    fake_world(4)
    dims = ParallelDims.from_config(DistConfig(pp=2, ep=2, dp_shard=2), 4, rank=0)
    stage = dims.stage_mesh("cpu").get_group()
    assert dist.get_world_size(stage) == 2  # pp 2 x 2 ranks a stage
    moe = _moe()
    shard_experts([moe], dims.expert_mesh("cpu")["ep"], None, stage)
    groups = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: groups.append(group))
    assert moe.dispatcher.chunks(10, 4, torch.device("cpu")) >= 1
    assert groups == [stage]  # not None: the world, whose other stage never joins


def test_the_stage_boundary_takes_the_stages_compute_dtype():
    from types import SimpleNamespace

    from mmtrain.parallel.parallelize import compute_dtype
    from mmtrain.parallel.pipeline import boundary_args

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    off = SimpleNamespace(cpu_mixed_precision=False)
    bf16 = SimpleNamespace(train=SimpleNamespace(dtype="bfloat16"), dist=off)
    fp32 = SimpleNamespace(train=SimpleNamespace(dtype="float32"), dist=off)
    assert compute_dtype(bf16, cuda) == torch.bfloat16  # FSDP2's bf16 policy: the stage sends bf16
    assert compute_dtype(bf16, cuda, sharded=False) == torch.float32  # fp32 weights, fp32 stream
    assert compute_dtype(bf16, cpu) == compute_dtype(fp32, cuda) == torch.float32
    h, aux = boundary_args(2, 8, 4, torch.bfloat16, torch.device("meta"))
    assert (h.dtype, h.shape, aux.dtype) == (torch.bfloat16, (2, 8, 4), torch.float32)


def _moe():
    from mmtrain.models.moe.config import MoEConfig
    from mmtrain.models.moe.layer import MoE

    return MoE(8, MoEConfig(n_routed=4, expert_dim=8))


def test_calls_are_numbered_per_thread_and_named_only_when_printed(fake_world):
    import threading

    from mmtrain.parallel import calls

    fake_world(2)
    calls.install()
    dist.all_reduce(torch.ones(3))
    mine = calls.recent()[-1]
    assert not isinstance(mine.group, str) and not isinstance(mine.shape, str)  # nothing formatted yet
    assert str(mine).startswith(f"all_reduce #{mine.n} on group world ((3,)) from ")
    seen = []
    writer = threading.Thread(target=lambda: (dist.barrier(), seen.extend(calls.recent())))
    writer.start()  # as DCP's async writer: its own numbers, not the training thread's
    writer.join()
    assert [c.n for c in seen] == [1] and calls.recent()[-1] is mine
    dist.all_reduce(torch.ones(3))
    assert calls.recent()[-1].n == mine.n + 1


def test_a_compiled_collective_is_not_a_graph_break(fake_world):
    from torch._dynamo.utils import counters

    from mmtrain.parallel import calls

    fake_world(2)
    calls.install()
    counters.clear()

    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(4))
    assert out.shape == (4,) and not counters["graph_break"]
