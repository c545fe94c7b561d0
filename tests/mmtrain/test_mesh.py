"""Checkpoints across meshes (4 gloo ranks, tiny config with MoE): saved at one mesh, loaded at
another, the model and optimizer state are the same tensors; a run killed at one mesh and resumed
at another continues with the losses of the uninterrupted run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from dist_runs import HERE as WORKER
from dist_runs import checkpoint_names, launch, losses, step_records, train, write_config

pytestmark = pytest.mark.distributed
EP2 = ["dist.ep=2"]


@pytest.fixture(scope="module")
def ep2_reference(raw_for, tmp_path_factory):
    """An uninterrupted 8-step run on 4 ranks as FSDP(4) + EP(2), checkpoints every 2 steps."""
    ref = tmp_path_factory.mktemp("mesh") / "ref"
    config = write_config(raw_for, ref, ["data.batch_size=1", *EP2])
    train(config, 4)
    return ref, config


def _state(config, run, nproc: int, tmp_path, overrides=()) -> dict:
    raw = yaml.safe_load(config.read_text())
    raw["run_dir"] = str(run)
    for item in overrides:
        key, value = item.split("=")
        raw["dist"][key.removeprefix("dist.")] = yaml.safe_load(value)
    path = tmp_path / f"state{nproc}.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / f"state{nproc}.pt"
    launch([str(WORKER), "state", str(path), str(out)], nproc)
    return torch.load(out, weights_only=True)


def test_state_saved_at_ep2_is_the_state_loaded_at_ep4_hsdp_and_one_process(ep2_reference, tmp_path):
    ref, config = ep2_reference
    runs = {}
    meshes = (("ep4", 4, ["dist.ep=4"]), ("hsdp", 4, ["dist.ep=1", "dist.dp_replicate=2"]),
              ("one", 1, ["dist.ep=1"]))
    for name, nproc, overrides in meshes:
        run = tmp_path / name
        run.mkdir()
        (run / "step_8").symlink_to(ref / "step_8", target_is_directory=True)
        runs[name] = _state(config, run, nproc, tmp_path, overrides)
    one = runs.pop("one")
    assert one["step"] == 8 and any("experts" in k for k in one["model"])
    for name, got in runs.items():
        assert got["step"] == 8
        assert got["model"].keys() == one["model"].keys()
        for key, value in one["model"].items():
            assert torch.equal(got["model"][key], value), (name, key)
        assert got["optim"].keys() == one["optim"].keys()
        for key, slots in one["optim"].items():
            for slot, value in slots.items():
                assert torch.equal(got["optim"][key][slot], value), (name, key, slot)


@pytest.mark.parametrize("resume_at", [["dist.ep=4"], ["dist.ep=1", "dist.dp_replicate=2"]],
                         ids=["ep2-to-ep4", "ep2-to-hsdp"])
def test_killed_at_one_mesh_resumed_at_another_continues_the_run(ep2_reference, raw_for, tmp_path, resume_at):
    ref, _ = ep2_reference
    run = tmp_path / "run"
    config = write_config(raw_for, run, ["data.batch_size=1", *EP2])
    assert train(config, 4, "train.faults.kill_at_step=5", check=False).returncode != 0
    assert checkpoint_names(run) == ["step_2", "step_4"]
    train(config, 4, *resume_at)
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)
    assert losses(run)[:4] == losses(ref)[:4]  # the steps before the kill ran at the same mesh


def test_mmtrain_train_under_torchrun_takes_the_mesh_keys(raw_for, tmp_path):
    """As a user runs it: torchrun starting the `mmtrain` console script, the mesh set on the
    command line (2 ranks: cp=2, the experts split over the same 2)."""
    run = tmp_path / "run"
    config = write_config(raw_for, run, ["train.steps=3", "model.decoder.attention.full_tile=16"])
    mmtrain = str(Path(sys.executable).parent / "mmtrain")
    mesh = ["--set", "dist.cp=2", "--set", "dist.ep=2"]
    launch(["--no-python", mmtrain, "train", str(config), "--quiet", *mesh], nproc=2)
    log = (run / "train.log").read_text()
    assert "mesh dp_replicate=1 dp_shard=1 cp=2 ep=2 (world 2)" in log
    assert sorted(step_records(run)) == [1, 2, 3]


def test_killed_under_context_parallelism_resumed_without_it_continues_the_run(raw_for, tmp_path):
    """FSDP(2) x CP(2) on 4 ranks, killed after step 5, resumed as FSDP(2) on 2 ranks: the same two
    data-parallel slots read on, so the losses are the uninterrupted run's."""
    cp = ["data.batch_size=1", "model.decoder.attention.full_tile=16", "dist.cp=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(write_config(raw_for, ref, cp), 4)
    config = write_config(raw_for, run, cp)
    assert train(config, 4, "train.faults.kill_at_step=5", check=False).returncode != 0
    train(config, 2, "dist.cp=1")
    log = (run / "train.log").read_text()
    assert "the same 2 data-parallel slots: the data position resumes exactly" in log
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5, abs=0)
