"""`dist.compile` under FSDP2 on 2 gloo ranks: the compiled blocks (FSDP wraps them, its hooks run
around the compiled call) train to the eager losses, log steps included (every step here: the
attention counts come back from the compiled layers as outputs), and a run with diagnostics (q/k
captures of every layer, evaluating forwards under no_grad) completes.

aot_eager (Dynamo + AOTAutograd: the graphs Inductor would receive, FSDP2's DTensor parameters
and hooks included) keeps the runs in seconds; Inductor's code generation is not what broke.
"""

from __future__ import annotations

import json

import pytest
from dist_runs import HERE as WORKER
from dist_runs import launch, step_records, train, write_config

pytestmark = pytest.mark.distributed
COMPILED = ["dist.compile=true", "dist.compile_backend=aot_eager"]


SLOW = pytest.mark.slow  # make test-slow


# CI runs fsdp-ep2 (FSDP2's hooks around compiled blocks and the experts' all-to-alls inside them);
# plain FSDP, whose compiled path fsdp-ep2's dense layers also run, with MMTRAIN_SLOW_TESTS=1
@pytest.mark.parametrize("mesh", [pytest.param([], marks=SLOW, id="fsdp"),
                                  pytest.param(["dist.ep=2"], id="fsdp-ep2")])
def test_compiled_fsdp_ranks_match_eager(make_raw, tmp_path, mesh):
    """Same global batches, same mesh: compiled and eager losses and grad norms agree to fp32
    reordering (rel 1e-5); every step is a log step (train.log_every=1). With expert parallelism
    the experts' DTensor shards and the dispatcher's all-to-alls run inside the compiled blocks."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", COMPILED)):
        overrides = ["data.batch_size=4", "dist.strategy=fsdp", *mesh, *extra]
        config = write_config(make_raw, tmp_path / name, overrides)
        launch([str(WORKER), "parity", str(config), str(tmp_path / f"{name}.json"), "3"], nproc=2)
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    eager, compiled = runs["eager"], runs["compiled"]
    assert compiled["tokens"] == eager["tokens"]
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5, abs=0)
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5, abs=0)


@pytest.mark.budget(60)  # 16 s measured: inductor compiles on both ranks
def test_compiled_fsdp_run_with_diagnostics(make_raw, tmp_path):
    """A compiled 2-rank run with diagnostics (captures of every layer, eval mode, no grad, through
    the FSDP-wrapped compiled layers) before step 1 and at the end: it completes."""
    run = tmp_path / "run"
    config = write_config(make_raw, run, ["train.steps=1", "train.ckpt_every=0", "diagnostics.every=2",
                                          "diagnostics.batches=1", "diagnostics.warmup_steps=0",
                                          "train.eval_batches=0", "dist.strategy=fsdp", *COMPILED])
    train(config, 2)
    diags = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diags] == [0, 1] and all(d["attention"] and d["pointing"] for d in diags)
    recs = step_records(run)
    assert sorted(recs) == [1]
    assert all(r["loss"] == r["loss"] for r in recs.values())  # finite
