"""Asynchronous saves (train.async_save): the step goes on while the files are written; a checkpoint
exists (and is acknowledged) only once every rank's files are on disk and it is committed; what
was staged is the state of its step; a kill during the background write loses nothing that was
acknowledged, and the resumed run has the uninterrupted run's losses bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_runs import checkpoint_names, losses, reference_run, step_records, train, write_config

from mmtrain.callbacks import Callback
from mmtrain.loop.trainer import Trainer
from mmtrain.parallel.distributed import DistEnv
from mmtrain.state.checkpoint import Checkpointer, load_model_state, load_rank_state, load_state
from mmtrain.state.manifest import verify


# ----- the checkpointer alone ------------------------------------------------------------------
def save_async(ckpt: Checkpointer, step: int, w: torch.Tensor, shared: dict, per_rank: dict) -> None:
    ckpt.save_async(step, {"model": {"w": w}}, shared, per_rank, "run_dir: x\n")


def test_an_async_save_is_the_staged_state_and_invisible_until_committed(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    assert ckpt.poll(wait=True) is None  # nothing pending: nothing to do
    w = torch.randn(64)
    before = w.clone()
    shared, per_rank = {"step": 1, "evals": [0.5]}, {"data": {"seen": [1]}}
    save_async(ckpt, 1, w, shared, per_rank)
    w.add_(1.0)  # training goes on in place, as the optimizer does
    shared["evals"].append(0.4)
    per_rank["data"]["seen"].append(2)
    with pytest.raises(RuntimeError, match="save of step 1 is not committed"):
        save_async(ckpt, 2, w, shared, per_rank)
    with pytest.raises(RuntimeError, match="save of step 1 is not committed"):
        ckpt.save(2, {"model": {"w": w}}, shared, per_rank, "run_dir: x\n")
    assert ckpt.checkpoints() == [] and (tmp_path / ".step_1.tmp").is_dir()  # written or not: hidden
    path = ckpt.poll(wait=True)
    assert path == tmp_path / "step_1" and ckpt.checkpoints() == [path] and verify(path, DistEnv()) is None
    assert torch.equal(load_model_state(path)["w"], before)
    assert load_state(path) == {"step": 1, "evals": [0.5]}
    assert load_rank_state(path, 0) == {"data": {"seen": [1]}}
    assert ckpt.poll() is None


def test_a_failed_background_write_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    save_async(ckpt, 1, torch.ones(3), {"step": 1}, {})
    assert ckpt.poll(wait=True) == tmp_path / "step_1"

    def disk_full(step):
        raise OSError(f"disk full at step {step}")

    ckpt.while_writing = disk_full
    save_async(ckpt, 2, torch.ones(3), {"step": 2}, {})
    with pytest.raises(RuntimeError, match=r"background write failed \(rank 0: disk full at step 2\)"):
        ckpt.poll(wait=True)
    assert ckpt.checkpoints() == [tmp_path / "step_1"] and ckpt.poll() is None


# ----- in the trainer ----------------------------------------------------------------------------
class Acknowledged(Callback):
    """Each checkpoint as the trainer acknowledges it: (its step, the step then, committed?)."""

    def __init__(self):
        self.seen: list[tuple[int, int, bool]] = []

    def on_checkpoint(self, trainer, path):
        committed = path.is_dir() and (path / "manifest.json").is_file() and verify(path, trainer.env) is None
        self.seen.append((int(path.name[5:]), trainer.step, committed))


def fit(make_config, run: Path, *overrides: str) -> tuple[Trainer, Acknowledged]:
    ack = Acknowledged()
    over = ["train.steps=6", "train.ckpt_every=2", "train.keep_last=3", "train.eval_batches=1", *overrides]
    trainer = Trainer(make_config(run, over), verbose=False, callbacks=[ack])
    trainer.fit()
    return trainer, ack


def step_losses(run: Path) -> dict[int, float]:
    return {step: rec["loss"] for step, rec in step_records(run).items()}


def test_async_saves_train_as_sync_ones_and_are_acknowledged_once_committed(make_config, tmp_path):
    fit(make_config, tmp_path / "sync")
    _, ack = fit(make_config, tmp_path / "async", "train.async_save=true")
    assert step_losses(tmp_path / "async") == step_losses(tmp_path / "sync")
    # staged at 2 and 4, committed at a later step boundary (or before the next save); the last waits
    assert [s for s, _, _ in ack.seen] == [2, 4, 6] and all(committed for _, _, committed in ack.seen)
    assert all(s < at <= s + 2 for s, at, _ in ack.seen[:-1]) and ack.seen[-1][:2] == (6, 6)
    for step in (2, 4, 6):  # the same checkpoints: each holds the state of its own step
        a, b = (tmp_path / run / f"step_{step}" for run in ("sync", "async"))
        assert load_state(a)["train"] == load_state(b)["train"]
        assert all(torch.equal(x, load_model_state(b)[k]) for k, x in load_model_state(a).items())
        assert load_rank_state(a, 0)["data"] == load_rank_state(b, 0)["data"]  # the loader position
    log = (tmp_path / "async" / "train.log").read_text()
    assert f"checkpoint {tmp_path / 'async' / 'step_2'} committed at step" in log


# ----- killed while writing ---------------------------------------------------------------------
def acknowledged(run: Path, log: str = "train.log") -> list[Path]:
    prefix = "checkpoint "
    lines = (run / log).read_text().splitlines()
    return [Path(line[len(prefix):].split(" committed")[0]) for line in lines if line.startswith(prefix)]


def test_a_kill_in_the_background_write_loses_nothing_acknowledged(make_raw, tmp_path):
    ref = tmp_path / "ref"
    reference_run(write_config(make_raw, ref))  # synchronous, uninterrupted
    run = tmp_path / "run"
    config = write_config(make_raw, run, ["train.async_save=true"])
    assert train(config, 1, "train.faults.kill_in_save_at_step=6", check=False).returncode == -9
    assert checkpoint_names(run) == [".step_6.tmp", "step_2", "step_4"]
    half = run / ".step_6.tmp"
    assert (half / "dcp" / ".metadata").is_file() and not (half / "state.pt").exists()
    assert acknowledged(run) == [run / "step_2", run / "step_4"]
    assert all(verify(p, DistEnv()) is None for p in acknowledged(run))
    train(config)  # resumes from step_4 and finishes
    assert losses(run) == losses(ref)
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]


@pytest.mark.distributed
def test_two_ranks_killed_in_the_background_write_resume_exactly(make_raw, tmp_path):
    """Rank 1 dies in its writer thread halfway through the step-6 save while rank 0 trains on;
    torchrun restarts the job, which resumes from step_4 with the uninterrupted run's losses."""
    ref = tmp_path / "ref"
    reference_run(write_config(make_raw, ref), 2)
    run = tmp_path / "run"
    config = write_config(make_raw, run, ["train.async_save=true", "train.faults.rank=1"])
    train(config, 2, "train.faults.kill_in_save_at_step=6", max_restarts=1)
    assert losses(run) == losses(ref)
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]
    assert acknowledged(run) == [run / f"step_{s}" for s in (2, 4, 6, 8)]  # the first launch's 2, 4 too
    assert acknowledged(run, "train.rank1.log") == acknowledged(run)
