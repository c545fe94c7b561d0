"""The objectives inside the trainer: balancers, diagnostics, curriculum stages, the visual SSL and
visual-next terms."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import ConfigError
from mmtrain.evaluation.diagnostics_callback import DIAG_FILE
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.curriculum import Curriculum


def _metrics(run) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def _scalar_tags(run) -> set[str]:
    """Every TensorBoard scalar tag the run wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for folder in {p.parent for p in (run / "tb").rglob("events.*")}:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_diagnostics_leave_training_unchanged(make_config, tmp_path):
    base = ["train.steps=4", "train.ckpt_every=0"]
    Trainer(make_config(tmp_path / "plain", base), verbose=False).fit()
    diag = ["diagnostics.every=2", "diagnostics.batches=1", "diagnostics.warmup_steps=0"]
    summary = Trainer(make_config(tmp_path / "diag", base + diag), verbose=False).fit()
    plain, with_diag = _metrics(tmp_path / "plain"), _metrics(tmp_path / "diag")
    assert [plain[s]["loss"] for s in range(1, 5)] == [with_diag[s]["loss"] for s in range(1, 5)]
    lines = (tmp_path / "diag" / DIAG_FILE).read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [0, 2, 4]
    assert summary["diagnostics"]["step"] == 4 and "reliance_gap" in summary["diagnostics"]


def test_adaptive_weights_are_logged_checkpointed_and_resumed(make_config, tmp_path):
    run = tmp_path / "run"
    over = ["train.steps=4", "train.ckpt_every=0", "loss.balancer.kind=uncertainty", "loss.balancer.lr=0.2"]
    trainer = Trainer(make_config(run, over), verbose=False)
    summary = trainer.fit()
    weights = summary["weights"]
    assert any(abs(w - 1.0) > 1e-3 for w in weights.values()), weights
    logged = _metrics(run)[4]["weights"]
    assert logged == pytest.approx(weights)
    resumed = Trainer(make_config(run, over), verbose=False)
    assert resumed.step == 4 and resumed.balancer.weights() == pytest.approx(weights)


def test_gradnorm_moves_weights_and_keeps_their_sum(make_config, tmp_path):
    over = ["train.steps=3", "train.ckpt_every=0", "loss.balancer.kind=gradnorm", "loss.balancer.lr=0.5"]
    trainer = Trainer(make_config(tmp_path / "run", over), verbose=False)
    summary = trainer.fit()
    weights = summary["weights"]
    assert sum(weights.values()) == pytest.approx(3.0)
    assert any(abs(w - 1.0) > 1e-3 for w in weights.values()), weights
    assert any(k.startswith("balance/grad_norm_") for k in trainer.balancer.scalars())


def test_reliance_guard_raises_media_weights_of_an_untrained_model(make_config, tmp_path):
    with pytest.raises((ConfigError, ValueError), match="diagnostics.every"):
        make_config(tmp_path / "bad", ["loss.balancer.kind=reliance_guard"])
    over = ["train.steps=2", "train.ckpt_every=0", "loss.balancer.kind=reliance_guard",
            "diagnostics.every=2", "diagnostics.batches=1"]
    summary = Trainer(make_config(tmp_path / "run", over), verbose=False).fit()
    w = summary["weights"]  # an untrained model reads no pixels: the guard raised both media weights
    assert w["text"] == 1.0 and w["image_text"] > 1.0 and w["video_text"] > 1.0


def test_stages_train_text_first_then_every_source_and_resume_in_the_stage(make_config, tmp_path):
    run = tmp_path / "run"
    over = ["train.steps=8", "train.ckpt_every=4", "train.stages=[{until_step: 3, sources: [text]}]"]
    trainer = Trainer(make_config(run, over), verbose=False)
    curriculum = trainer.callbacks.get(Curriculum)
    assert curriculum.stage == 0 and [s.name for s in curriculum.stage_data(0).train] == ["text"]
    trainer.fit()
    metrics = _metrics(run)
    for step in (1, 2, 3):
        assert set(metrics[step]["task_loss"]) == {"text"}, metrics[step]
    assert any(set(metrics[s]["task_loss"]) - {"text"} for s in range(4, 9))
    assert curriculum.stage == 1
    log = (run / "train.log").read_text()
    assert "step 3: curriculum stage 1" in log
    resumed = Trainer(make_config(run, [*over[:-2], "train.steps=8", over[-1]]), verbose=False)
    assert resumed.step == 8 and resumed.callbacks.get(Curriculum).stage == 1
    assert resumed.train_loader.state_dict() == trainer.train_loader.state_dict()
    with pytest.raises((ConfigError, ValueError), match="not a data.train source"):
        make_config(tmp_path / "bad", ["train.stages=[{until_step: 3, sources: [nope]}]"])


def test_visual_ssl_term_and_train_accuracy_are_logged(make_config, tmp_path):
    with pytest.raises((ConfigError, ValueError), match="ssl_head"):
        make_config(tmp_path / "bad", ["loss.visual_ssl.weight=0.5"])
    over = ["train.steps=3", "train.ckpt_every=0", "loss.visual_ssl.weight=0.5", "model.vision.ssl_head=true"]
    trainer = Trainer(make_config(tmp_path / "run", over), verbose=False)
    trainer.fit()
    metrics = _metrics(tmp_path / "run")
    ssl = [metrics[s]["visual_ssl"] for s in (1, 2, 3)]
    assert all(v is not None and torch.isfinite(torch.tensor(v)) for v in ssl)
    assert any(v > 0 for v in ssl)
    for s in (1, 2, 3):
        assert all(0.0 <= a <= 1.0 for a in metrics[s]["task_acc"].values())
        assert set(metrics[s]["task_acc"]) == set(metrics[s]["task_loss"])


def test_visual_next_term_is_logged_resumed_and_refused_without_its_head(make_config, tmp_path):
    with pytest.raises((ConfigError, ValueError), match=r"loss\.visual_next\.weight.*model\.visual_head"):
        make_config(tmp_path / "bad", ["model.visual_head=false", "loss.visual_next.weight=1"])
    over = ["train.steps=1", "train.log_every=1", "train.ckpt_every=0", "model.visual_head=true",
            "loss.visual_next.weight=1"]
    trainer = Trainer(make_config(tmp_path / "run", over), verbose=False)
    trainer.fit()
    value = _metrics(tmp_path / "run")[1]["visual_next"]
    assert value is not None and 0 < value < float("inf")
    assert "train/loss_visual_next" in _scalar_tags(tmp_path / "run")
    head = trainer.raw_model.visual_head.weight  # an ordinary parameter: checkpointed and resumed
    resumed = Trainer(make_config(tmp_path / "run", [*over, "train.steps=2"]), verbose=False)
    assert resumed.step == 1 and torch.equal(resumed.raw_model.visual_head.weight, head)
    assert torch.equal(resumed.optimizer.state[resumed.raw_model.visual_head.weight]["exp_avg"],
                       trainer.optimizer.state[head]["exp_avg"])
