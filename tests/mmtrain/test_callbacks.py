"""The trainer's contracts with its callbacks and its checkpoint parts, as properties:
a user callback sees every step once and in order, and its state survives a crash and resume;
every Stateful part round-trips into a fresh trainer; resume equals the uninterrupted run bit for
bit; checkpoints of the previous format (2) still resume."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.callbacks import Callback, Callbacks
from mmtrain.errors import UserError
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.curriculum import Curriculum
from mmtrain.state.checkpoint import STATE_FILE, load_state

STAGED = ["train.stages=[{until_step: 3, sources: [text]}]", "diagnostics.every=4", "diagnostics.batches=1",
          "loss.balancer.kind=uncertainty", "train.eval_batches=1"]


class Crash(Exception):
    pass


class StepRecorder(Callback):
    """Records every hook call; its list of finished steps is checkpointed."""

    name = "recorder"

    def __init__(self, crash_at: int = 0):
        self.seen: list[int] = []
        self.events: list[tuple] = []
        self.crash_at = crash_at

    def state_dict(self) -> dict:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = list(state["seen"])

    def on_train_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, trainer, stats):
        assert stats.tokens > 0 and (not self.seen or trainer.step == self.seen[-1] + 1)  # no gap, no repeat
        self.seen.append(trainer.step)
        self.events.append(("step", trainer.step))
        if trainer.step == self.crash_at:
            raise Crash

    def on_eval(self, trainer, record):
        record["recorder"] = trainer.step  # lands in the eval history
        self.events.append(("eval", trainer.step))

    def on_checkpoint_written(self, trainer, step):
        self.events.append(("written", step))

    def on_checkpoint(self, trainer, path):
        self.events.append(("checkpoint", path.name))

    def on_train_end(self, trainer, summary):
        summary["recorder"] = list(self.seen)
        self.events.append(("end", trainer.step))


def _losses(run) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval" not in rec:
            out[rec["step"]] = rec["loss"]  # a step replayed after a resume: the later line wins
    return out


def test_user_callback_sees_every_step_and_survives_a_crash_and_resume(make_config, tmp_path):
    ref = StepRecorder()
    summary = Trainer(make_config(tmp_path / "ref", STAGED), verbose=False, callbacks=[ref]).fit()
    assert ref.seen == list(range(1, 9)) and summary["recorder"] == ref.seen
    assert ref.events == [("eval", 0), ("start", 0), *[("step", s) for s in range(1, 5)], ("written", 4),
                          ("checkpoint", "step_4"), *[("step", s) for s in range(5, 9)], ("eval", 8),
                          ("written", 8), ("checkpoint", "step_8"), ("end", 8)]
    run = tmp_path / "run"
    with pytest.raises(Crash):  # a crash between checkpoints: step_4 is the newest
        Trainer(make_config(run, STAGED), verbose=False, callbacks=[StepRecorder(crash_at=6)]).fit()
    again = StepRecorder()
    resumed = Trainer(make_config(run, STAGED), verbose=False, callbacks=[again])
    assert resumed.step == 4 and again.seen == [1, 2, 3, 4]
    resumed.fit()
    assert again.seen == list(range(1, 9)) and again.events[0] == ("start", 4)
    assert _losses(run) == _losses(tmp_path / "ref")  # bit-identical, across a curriculum boundary
    assert load_state(run / "step_8")["callback.recorder"] == {"seen": list(range(1, 9))}
    assert [e["step"] for e in load_state(run / "step_8")["train"]["evals"]] == [0, 8]
    assert load_state(run / "step_8")["train"]["evals"][-1]["recorder"] == 8


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_every_part_round_trips_into_a_fresh_trainer(make_config, tmp_path):
    trained = Trainer(make_config(tmp_path / "a", STAGED), verbose=False, callbacks=[StepRecorder()])
    batches = iter(trained.train_loader)
    for _ in range(3):
        trained.train_step(batches)
    trained.callbacks.get(Curriculum).enter(1)  # a stage whose loader differs from a fresh trainer's
    trained.callbacks.get(StepRecorder).seen = [1, 2, 3]
    fresh = Trainer(make_config(tmp_path / "b", STAGED), verbose=False, callbacks=[StepRecorder()])
    source, target = trained.parts(), fresh.parts()
    names = []
    for group in ("sharded", "replicated", "per_rank"):  # the order a checkpoint loads in
        for name, part in getattr(source, group).items():
            state = part.state_dict()
            getattr(target, group)[name].load_state_dict(state)
            assert _equal(getattr(target, group)[name].state_dict(), state), name
            names.append(name)
    assert names == ["model", "optim", "train", "scheduler", "balancer", "callback.curriculum",
                     "callback.diagnostics", "callback.recorder", "data", "rng"]
    assert fresh.step == 3 and fresh.callbacks.get(Curriculum).stage == 1


def _as_format_2(state: dict) -> dict:
    """state.pt as the previous code wrote it: counters and histories flat, no curriculum part (the
    weights' row layout kept: they are this code's)."""
    return {"format": 2, "layout": state["layout"], "world_size": state["world_size"],
            "config": state["config"], "scheduler": state["scheduler"], "balancer": state["balancer"],
            **state["train"], "diagnostics": state["callback.diagnostics"]["history"]}


def test_a_format_2_checkpoint_resumes_and_a_newer_format_is_refused(make_config, tmp_path):
    run = tmp_path / "run"
    over = [*STAGED, "train.steps=4"]
    Trainer(make_config(run, over), verbose=False).fit()
    ckpt = run / "step_4"
    saved = load_state(ckpt)
    (ckpt / "manifest.json").unlink()  # no manifest: taken as it is
    torch.save(_as_format_2(saved), ckpt / STATE_FILE)
    trainer = Trainer(make_config(run, [*STAGED, "train.steps=6"]), verbose=False, callbacks=[StepRecorder()])
    assert trainer.step == 4 and trainer.callbacks.get(Curriculum).stage == 1  # derived from the step
    assert "callback.recorder is not in the checkpoint: it starts fresh" in trainer.resume_note
    parts = trainer.parts().replicated
    for name in ("train", "scheduler", "balancer", "callback.diagnostics"):
        assert _equal(parts[name].state_dict(), saved[name]), name
    assert trainer.fit()["steps"] == 6
    state = load_state(run / "step_6")
    state["format"] = 99
    (run / "step_6" / "manifest.json").unlink()
    torch.save(state, run / "step_6" / STATE_FILE)
    with pytest.raises(UserError, match="format 99 is newer"):
        Trainer(make_config(run, [*STAGED, "train.steps=6"]), verbose=False)


def test_stateful_callbacks_need_unique_names():
    with pytest.raises(ValueError, match="unique names"):
        Callbacks([StepRecorder(), StepRecorder()])
    Callbacks([Callback(), Callback()])  # stateless ones may share the default name


class LogAdder(Callback):
    """Adds one scalar on log steps; records the order of its hooks."""

    def __init__(self):
        self.events: list[tuple] = []

    def on_step_end(self, trainer, stats):
        self.events.append(("step", trainer.step))

    def on_log(self, trainer, stats, scalars):
        assert "perf/tokens_per_s" in scalars  # the built-in throughput callback ran before
        scalars["user/step_squared"] = float(trainer.step ** 2)
        self.events.append(("log", trainer.step))


def test_on_log_runs_on_log_steps_after_the_step_and_its_scalars_are_written(make_config, tmp_path,
                                                                             monkeypatch):
    from mmtrain.loop.logger import RunLogger

    written: dict[int, dict[str, float]] = {}
    orig = RunLogger.scalars

    def spy(self, step, values):
        written.setdefault(step, {}).update(values)
        orig(self, step, values)

    monkeypatch.setattr(RunLogger, "scalars", spy)
    cb = LogAdder()
    Trainer(make_config(tmp_path / "run"), verbose=False, callbacks=[cb]).fit()  # log_every 2, 8 steps
    log_steps = [2, 4, 6, 8]
    assert [e for e in cb.events if e[0] == "log"] == [("log", s) for s in log_steps]
    for s in log_steps:  # each log follows its own step's on_step_end
        assert cb.events.index(("log", s)) == cb.events.index(("step", s)) + 1
        assert written[s]["user/step_squared"] == s ** 2 and "train/loss" in written[s]
    assert not any("user/step_squared" in written.get(s, {}) for s in (1, 3, 5, 7))
