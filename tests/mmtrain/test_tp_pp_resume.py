"""Checkpoints across TP(2) x PP(2), FSDP(4) and one process (issue 38: "saved at TP2xPP2 and resumed
at FSDP(4), and back, model and optimizer state are equal; a run killed at one mesh and resumed at
another continues the uninterrupted run's losses").

At TP(2) x PP(2) a rank holds its stage's parameters under the full model's names as FSDP2 shards
over its pp slice's fsdp group (tp included: tensor_parallel.py slices the gathered weights), so
DCP reshards them to any other mesh. The killed-and-resumed runs keep one data-parallel slot on
both sides (TP(2) x PP(2), TP(4) and one process read the same rows), so the data position resumes
exactly; FSDP(4) has four slots, and a change of slots restarts the data at its next epoch
(mmtrain/state/train_state.py), so across it only the state is compared. TP(2) x PP(2) -> one
process kill/resume runs in CI; the rest with MMTRAIN_SLOW_TESTS=1.
"""

from __future__ import annotations

import pytest
from test_pipeline_trainer import _saved_and_loaded
from test_tensor_parallel import _assert_same_state

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow  # make test-slow
HEADS = ["model.decoder.n_kv_heads=2"]  # a tp rank holds whole KV groups
TP2_PP2 = ["dist.tp=2", "dist.pp=2"]
FSDP = ["dist.tp=1", "dist.pp=1"]  # dp_shard: the rest of the world


@SLOW
def test_state_saved_at_tp2_pp2_is_the_state_loaded_at_fsdp4_and_in_one_process(make_raw, tmp_path):
    runs = _saved_and_loaded(make_raw, tmp_path, 4, [*HEADS, *TP2_PP2],
                             {"one": (1, FSDP), "fsdp4": (4, FSDP)})
    assert runs["one"]["step"] == 2 and runs["one"]["optim"]
    _assert_same_state(runs["fsdp4"], runs["one"], "tp2xpp2->fsdp4")


@SLOW
def test_state_saved_at_fsdp4_is_the_state_loaded_at_tp2_pp2(make_raw, tmp_path):
    runs = _saved_and_loaded(make_raw, tmp_path, 4, [*HEADS, *FSDP],
                             {"one": (1, FSDP), "tp2xpp2": (4, TP2_PP2)})
    _assert_same_state(runs["tp2xpp2"], runs["one"], "fsdp4->tp2xpp2")


@SLOW
def test_state_saved_at_tp2_pp2_fsdp2_ep2_is_the_state_loaded_in_one_process(make_raw, tmp_path):
    """8 ranks, M3's layout in small (efsdp 1: the experts Shard(0) over ep, FSDP2 over the tp pair):
    the experts' and the stages' shards go through DCP; loaded at the saving mesh and in one process,
    one state."""
    moe = ["dist.ep=2", "model.decoder.moe.first_dense_layers=0"]
    runs = _saved_and_loaded(make_raw, tmp_path, 8, [*HEADS, *TP2_PP2, *moe],
                             {"one": (1, FSDP), "tp2xpp2xfsdp2xep2": (8, [])})
    assert runs["one"]["step"] == 2 and runs["one"]["optim"]
    _assert_same_state(runs["tp2xpp2xfsdp2xep2"], runs["one"], "tp2xpp2xfsdp2xep2")


# meshes of one data-parallel slot: (ranks, dist overrides)
RANKS = {"tp2xpp2": (4, TP2_PP2), "one": (1, FSDP), "tp4": (4, ["dist.tp=4", "dist.pp=1"])}
HEADS4 = ["model.decoder.n_heads=4", "model.decoder.n_kv_heads=4", "model.decoder.mrope_sections=[1, 1, 2]"]


@pytest.mark.parametrize("first, then, heads", [
    pytest.param("tp2xpp2", "one", HEADS, id="tp2xpp2-to-one"),
    pytest.param("one", "tp2xpp2", HEADS, id="one-to-tp2xpp2", marks=SLOW),
    pytest.param("tp2xpp2", "tp4", HEADS4, id="tp2xpp2-to-tp4", marks=SLOW)])
def test_killed_at_tp2_pp2_resumed_at_another_mesh_continues_the_run(make_raw, tmp_path, first, then, heads):
    """One data-parallel slot on both sides, so the data position resumes exactly: the losses after
    the resume are the uninterrupted run's, and so is the last evaluation. The uninterrupted run is
    one process's (TP(2) x PP(2) gives its losses, test_pipeline_trainer.py), the cheapest to run."""
    import json

    from dist_runs import checkpoint_names, losses, reference_run, train, write_config

    ref, run = tmp_path / "ref", tmp_path / "run"
    base = ["train.grad_accum=2", *heads]
    reference_run(write_config(make_raw, ref, base))
    config = write_config(make_raw, run, [*base, *RANKS[first][1]])
    assert train(config, RANKS[first][0], "train.faults.kill_at_step=3", check=False).returncode != 0
    assert checkpoint_names(run) == ["step_2"]  # steps 3-8 run at the other mesh
    train(config, RANKS[then][0], *RANKS[then][1])
    assert f"resumed from {run / 'step_2'} at step 2" in (run / "train.log").read_text()
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)
    ends = [json.loads((r / "summary.json").read_text())["end"]["loss"] for r in (ref, run)]
    assert ends[0].keys() == ends[1].keys()
    assert ends[1] == pytest.approx(ends[0], rel=1e-5, abs=0)
