"""The progress line's ETA (mmtrain/loop/eta.py): its schedule of evaluations, diagnostics passes and
checkpoints must be the loop's own, and its sum the steps' plus the events' measured times."""

from __future__ import annotations

import pytest

from mmtrain.loop.eta import Eta, due_left, format_eta
from mmtrain.loop.trainer import Trainer


def loop_events(total: int, every: int) -> list[int]:
    """The steps at which the trainer runs a scheduled event: each multiple of `every` below the
    last step, then one final one at the last step (written out from Trainer.fit / _finish)."""
    inner = [k for k in range(1, total) if every and k % every == 0]
    return inner + [total]


@pytest.mark.parametrize("total", [1, 2, 7, 12, 20])
@pytest.mark.parametrize("every", [0, 1, 3, 4, 20, 25])
def test_due_left_counts_the_events_still_to_run_from_each_step(total, every):
    events = loop_events(total, every)
    for step in range(1, total + 1):  # the progress line of `step` is printed before its events
        assert due_left(step, total, every) == sum(k >= step for k in events), (step, total, every)


def test_remaining_is_steps_times_the_median_step_plus_each_event_left_times_its_time():
    eta = Eta(10, {"eval": 4, "diagnostics": 5, "checkpoint": 0})
    assert eta.remaining(1) is None  # nothing timed yet
    for s in (1.0, 9.0, 1.2):  # a slow warm-up step does not move the median
        eta.step_done(s)
    eta.event_done("eval", 3.0)
    eta.event_done("diagnostics", 2.0)
    # after step 4: 6 steps; evals at 4 and 8 + the final one; diagnostics at 5 + the final one;
    # the final checkpoint, not yet timed (0 s)
    assert eta.remaining(4) == pytest.approx(6 * 1.2 + 3 * 3.0 + 2 * 2.0)
    eta.event_done("checkpoint", 0.5)
    assert eta.remaining(10) == pytest.approx(3.0 + 2.0 + 0.5)  # only the final events are left
    with pytest.raises(ValueError, match="unknown event"):
        eta.event_done("captions", 1.0)


def test_time_limit_caps_the_steps_left():
    eta = Eta(1000, {"eval": 0, "diagnostics": 0, "checkpoint": 0}, time_limit_s=60.0)
    eta.step_done(2.0)
    eta.event_done("eval", 5.0)
    assert eta.remaining(5, elapsed_s=20.0) == pytest.approx(20 * 2.0 + 5.0)


def test_format():
    assert format_eta(None) == ""
    assert format_eta(425.4) == "eta 7m05s"
    assert format_eta(3725) == "eta 1h02m"


def test_the_trainer_times_every_event_at_the_steps_the_eta_expects(make_config, tmp_path, monkeypatch):
    """A real run: each event kind is timed exactly where due_left placed it, so after every step the
    events the ETA still counted are the ones the run went on to do."""
    done: list[tuple[str, int]] = []
    orig = Eta.event_done
    trainer = None

    def spy(self, kind, seconds):
        done.append((kind, trainer.step))
        orig(self, kind, seconds)

    monkeypatch.setattr(Eta, "event_done", spy)
    steps, every = 7, {"eval": 3, "diagnostics": 2, "checkpoint": 4}
    cfg = make_config(tmp_path / "run", [f"train.steps={steps}", "train.eval_every=3", "train.ckpt_every=4",
                                         "diagnostics.every=2", "diagnostics.batches=1",
                                         "diagnostics.warmup_steps=0"])
    trainer = Trainer(cfg, verbose=False)
    trainer.fit()
    for kind, n in every.items():
        at = [s for k, s in done if k == kind and s > 0]
        assert at == loop_events(steps, n), kind
        for step in range(1, steps + 1):
            assert due_left(step, steps, n) == sum(s >= step for s in at)
    assert sorted(k for k, s in done if s == 0) == ["diagnostics", "eval"]  # both run before step 1
    assert len(trainer.eta._steps) == steps


def test_eta_check_scores_each_minute_mark_against_the_real_end():
    from tools.bench.eta_check import marks

    recs = [{"wall_s": 30.0, "eta_s": 200.0}, {"wall_s": 61.0, "eta_s": 150.0},
            {"wall_s": 90.0, "eta_s": 100.0}, {"wall_s": 125.0, "eta_s": 80.0}]
    # the run really ended at 211 s: at 61 s the ETA said 211 (exact), at 125 s it said 205
    assert marks(recs, 211.0) == [(61.0, 211.0, 0.0), (125.0, 205.0, pytest.approx(-6 / 86))]
