"""End-to-end training on the small built-in corpus: loss falls, checkpoints restore, runs resume."""

from __future__ import annotations

import torch

from mmtrain.loop.trainer import Trainer
from mmtrain.state.checkpoint import Checkpointer, load_state


def test_short_run_loss_falls(make_config, tmp_path):
    cfg = make_config(tmp_path / "run", ["train.steps=40", "optim.lr=0.01", "train.ckpt_every=0"])
    summary = Trainer(cfg, verbose=False).fit()
    start, end = summary["start"]["loss"], summary["end"]["loss"]
    assert set(start) == {"text", "image_text", "video_text"}
    for task in start:
        assert end[task] < start[task] - 0.5, (task, start[task], end[task])
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    assert any((run / "tb").iterdir()), "no TensorBoard events"
    assert (run / "step_40" / "state.pt").is_file()


def test_checkpoint_restores_parameters_and_optimizer(make_config, tmp_path):
    cfg = make_config(tmp_path / "run", ["train.steps=4"])
    trainer = Trainer(cfg, verbose=False)
    trainer.fit()
    restored = Trainer(make_config(tmp_path / "run", ["train.steps=4"]), verbose=False)
    assert restored.resumed_from == tmp_path / "run" / "step_4"
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(), restored.model.state_dict().items()):
        assert torch.equal(a, b), name
    opt_a, opt_b = trainer.optimizer.state_dict(), restored.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for pid, state in opt_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, opt_b["state"][pid][key]), (pid, key)
    assert restored.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert restored.train_loader.state_dict() == trainer.train_loader.state_dict()


def test_resume_continues_step_count(make_config, tmp_path):
    run = tmp_path / "run"
    Trainer(make_config(run, ["train.steps=4"]), verbose=False).fit()
    longer = Trainer(make_config(run, ["train.steps=6"]), verbose=False)
    assert longer.step == 4
    summary = longer.fit()
    assert summary["steps"] == 6
    assert summary["start"]["step"] == 0  # the eval history survives the restart
    assert [p.name for p in Checkpointer(run, keep_last=2).checkpoints()] == ["step_4", "step_6"]
    assert load_state(run / "step_6")["train"]["step"] == 6
