"""Checkpoints in one process: atomic commit and recovery, export and `load_for_inference`, and
non-finite steps (skipped, counted; the run stops with its last checkpoint intact)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmtrain.cli import main
from mmtrain.config import from_dict
from mmtrain.errors import UserError
from mmtrain.loop.trainer import Trainer
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.run_config import RunConfig
from mmtrain.state.checkpoint import Checkpointer, load_for_inference, load_state


def save(ckpt: Checkpointer, step: int, value: float = 0.0, before_commit=None):
    return ckpt.save(step, {"model": {"w": torch.full((3,), value)}}, {"step": step}, {"data": step},
                     "run_dir: x\n", before_commit=before_commit)


def names(run):
    return sorted(p.name for p in run.iterdir())


def test_keeps_last_k_and_hides_a_save_that_did_not_finish(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        save(ckpt, step)
    assert names(tmp_path) == ["step_2", "step_3"]
    assert names(tmp_path / "step_3") == ["config.yaml", "dcp", "manifest.json", "rank_00000.pt", "state.pt"]

    def crash():
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError):
        save(ckpt, 4, before_commit=crash)
    assert ckpt.latest() == tmp_path / "step_3" and ".step_4.tmp" in names(tmp_path)
    save(ckpt, 5)  # the next save clears the debris
    assert names(tmp_path) == ["step_3", "step_5"]


def test_resave_of_a_step_survives_a_crash_between_the_renames(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    save(ckpt, 4, value=1.0)
    save(ckpt, 4, value=2.0)  # the same step again (e.g. a finished run started once more)
    assert names(tmp_path) == ["step_4"]
    (tmp_path / "step_4").rename(tmp_path / ".step_4.old")  # crash after the first rename
    assert ckpt.latest() is None
    assert ckpt.latest_agreed() == tmp_path / "step_4"
    assert load_state(tmp_path / "step_4")["step"] == 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory, raw_for):
    from mmtrain.config import apply_override

    run = tmp_path_factory.mktemp("ckpt") / "run"
    raw = raw_for(run)
    for item in ("train.steps=2", "train.eval_batches=1"):
        apply_override(raw, item)
    trainer = Trainer(from_dict(RunConfig, raw), verbose=False)
    trainer.fit()
    return run, trainer


def test_load_for_inference_and_export_round_trip(trained, tmp_path):
    run, trainer = trained
    cfg, state, tok = load_for_inference(run / "step_2")
    live = trainer.model.state_dict()
    assert set(state) == set(live)
    assert all(torch.equal(state[k], live[k]) for k in live)
    assert tok == run / "step_2" / "tokenizer.json"
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0  # a run dir: its newest checkpoint
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer.json"]
    cfg2, state2, tok2 = load_for_inference(out)
    assert cfg2 == cfg and tok2 == out / "tokenizer.json"
    assert all(torch.equal(state2[k], state[k]) for k in state)
    model = MultimodalModel(from_dict(RunConfig, cfg2).model)
    model.load_state_dict(state2, strict=True)


def test_load_for_inference_reads_single_file_checkpoints_and_rejects_others(trained, tmp_path):
    run, trainer = trained
    old = tmp_path / "step_9"
    old.mkdir()
    torch.save({"model": trainer.model.state_dict(), "config": {"run_dir": "x"}, "step": 9, "layout": 2},
               old / "state.pt")  # this code's rows (state/layout.py)
    cfg, state, tok = load_for_inference(old)
    assert cfg == {"run_dir": "x"} and tok is None and set(state) == set(trainer.model.state_dict())
    with pytest.raises(UserError, match="not a checkpoint"):
        load_for_inference(tmp_path)
    assert main(["export", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2


def test_nan_step_is_skipped_and_counted(make_config, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(run, ["train.steps=4", "train.faults.nan_at_step=3", "train.eval_batches=1"])
    trainer = Trainer(cfg, verbose=False)
    summary = trainer.fit()
    assert summary["skipped_steps"] == 1 and summary["steps"] == 4
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False, True, False]
    assert math.isnan(recs[2]["loss"]) and all(math.isfinite(r["loss"]) for r in recs if not r["skipped"])
    assert "step 3: non-finite loss or gradient, update skipped (1 in a row, 1 in all)" in \
        (run / "train.log").read_text()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert load_state(run / "step_4")["train"]["skipped_steps"] == 1


def test_consecutive_nan_steps_stop_the_run_with_its_checkpoint_intact(make_config, tmp_path):
    run = tmp_path / "run"
    cfg = make_config(run, ["train.steps=6", "train.ckpt_every=2", "train.faults.nan_at_step=3",
                            "train.max_skipped_steps=1", "train.eval_batches=1"])
    with pytest.raises(UserError, match=r"1 consecutive non-finite steps at step 3.*step_2"):
        Trainer(cfg, verbose=False).fit()
    assert Checkpointer(run, keep_last=2).checkpoints() == [run / "step_2"]
    _, state, _ = load_for_inference(run / "step_2")
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
