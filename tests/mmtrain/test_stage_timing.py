"""The pipeline split from measured cost (mmtrain/parallel/stage_timing.py, `dist.pp_split: measured`).

Times proportional to the FLOP model give the FLOP model's split (every layer's time from its kind's
timed layer, the encoder's on stage 0, the head's on the last); and ranks whose clocks disagree cut
the same way (the times' MAX over the world), over gloo (slow). The timer is injected, but for one
test that runs the default timer on a tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve()
SHAPES = SimpleNamespace(data=SimpleNamespace(batch_size=2, seq_len=96))


def _proportional(costs: dict, scale: dict | None = None):
    """A timer whose seconds are 1e-12 x the FLOP model's cost of what it times (x scale[key])."""
    calls = []

    def timer(key, fn) -> float:
        calls.append(key)
        flops = costs["layers"][key[1]] if isinstance(key, tuple) else costs[key]
        return 1e-12 * flops * (scale or {}).get(key if isinstance(key, str) else "layers", 1.0)

    timer.calls = calls
    return timer


@pytest.mark.parametrize("vision_stage", [False, True])
def test_times_proportional_to_flops_give_the_flops_split(vision_stage):
    import torch
    from test_pipeline import _model

    from mmtrain.parallel.pipeline import split_layers, stage_costs
    from mmtrain.parallel.stage_timing import measured_costs

    model = _model(8)  # layer 0 dense, then MoE; full and sparse attention alternate: three kinds
    flops = stage_costs(model, SHAPES.data.seq_len)
    timer = _proportional(flops)
    got = measured_costs(model, SHAPES, torch.device("cpu"), timer)
    assert len(timer.calls) == 2 + 3  # the encoder, the head and one layer of each kind
    assert got["layers"] == pytest.approx([1e-12 * c for c in flops["layers"]], rel=1e-9)
    for n in (2, 3, 4, 5):
        assert split_layers(got, n, vision_stage) == split_layers(flops, n, vision_stage), n
    heavy = measured_costs(model, SHAPES, torch.device("cpu"), _proportional(flops, {"vision": 8.0}))
    assert len(split_layers(heavy, 2)[0]) < len(split_layers(got, 2)[0])  # the times move the cut


def test_the_default_timer_runs_every_part_and_leaves_the_run_as_it_was():
    """The default timer runs real forwards + backwards at the config's shapes (a tiny model; the
    seconds are not checked): each part runs, and no gradient or global RNG draw is left behind, so
    the run that follows is the run without the timing."""
    import torch
    from test_pipeline import _model

    from mmtrain.parallel.stage_timing import measured_costs, wall_timer

    model = _model(2)
    runs = []
    inner = wall_timer(torch.device("cpu"), iters=1)

    def counting(key, fn):
        runs.append(key)
        return inner(key, fn)

    rng = torch.get_rng_state()
    got = measured_costs(model, SHAPES, torch.device("cpu"), counting)
    assert torch.equal(rng, torch.get_rng_state())
    assert runs == ["vision", "head", ("layer", 0), ("layer", 1)]
    assert got["vision"] > 0 and got["head"] > 0 and all(t > 0 for t in got["layers"])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # a 2-rank run
@pytest.mark.distributed
def test_ranks_whose_times_differ_cut_the_same_way(tmp_path):
    """Two gloo ranks: rank 1 times the encoder 8x slower than rank 0 (alone they would cut
    differently); after the MAX every rank has the same costs and the same split."""
    from dist_runs import launch

    from mmtrain.parallel.pipeline import split_layers

    launch([str(HERE), str(tmp_path)], nproc=2, timeout=240)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    local = got[0]["local0"]  # rank 0's own times, before the MAX
    assert split_layers(local, 2) != [range(*r) for r in got[0]["split"]]


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sys.path.insert(0, str(HERE.parent))
    from test_pipeline import _model

    from mmtrain.parallel.pipeline import split_layers, stage_costs
    from mmtrain.parallel.stage_timing import measured_costs

    rank = dist.get_rank()
    model = _model(8)
    flops = stage_costs(model, SHAPES.data.seq_len)
    scale = {"vision": 8.0} if rank == 1 else {}
    costs = measured_costs(model, SHAPES, torch.device("cpu"), _proportional(flops, scale))
    local0 = {**costs, "vision": 1e-12 * flops["vision"]}  # what rank 0 timed
    split = [[r.start, r.stop] for r in split_layers(costs, 2)]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"costs": costs, "split": split, "local0": local0}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
