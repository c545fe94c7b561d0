"""The reliance-driven mixture controller (mmtrain/objectives/mixture.py): its rule, its bounds, and its
contracts inside the trainer -- the shares it sets are the loader's, every step's batch follows them,
and a run killed after a change resumes bit-identically."""

from __future__ import annotations

import json
import random

import pytest

from mmtrain.callbacks import Callback
from mmtrain.data_pipelines.config import MixControllerConfig, SourceConfig
from mmtrain.errors import ConfigError
from mmtrain.loop.trainer import Trainer
from mmtrain.objectives.mixture import MixController, clip_shares

TASKS = {"image": "image_text", "video": "video_text", "interleaved": "image_text"}
SOURCES = [SourceConfig("image", [], 0.07), SourceConfig("video", [], 0.04),
           SourceConfig("interleaved", [], 0.03), SourceConfig("text", [], 0.86)]


def _controller(**kw) -> tuple[MixController, list[dict]]:
    applied: list[dict] = []
    cfg = MixControllerConfig(kind="reliance", tasks=TASKS, **kw)
    return MixController(cfg, SOURCES, lambda w: applied.append(w) or True), applied


@pytest.mark.parametrize("seed", range(20))
def test_clip_shares_respects_bounds_and_keeps_the_free_ratios(seed):
    rng = random.Random(seed)
    names = [f"s{i}" for i in range(rng.randint(2, 6))]
    raw = {n: rng.random() + 1e-3 for n in names}
    shares = {n: v / sum(raw.values()) for n, v in raw.items()}
    lo = {n: rng.uniform(0, 0.8 / len(names)) for n in names if rng.random() < 0.4}
    hi = {n: rng.uniform(lo.get(n, 0) + 0.05, 1) for n in names if rng.random() < 0.4}
    out = clip_shares(shares, lo, hi)
    assert abs(sum(out.values()) - 1) < 1e-9
    free = [n for n in names if lo.get(n, 0) + 1e-9 < out[n] < hi.get(n, 1) - 1e-9]
    for n in names:
        assert lo.get(n, 0) - 1e-9 <= out[n] <= hi.get(n, 1) + 1e-9 or not free  # infeasible: renormalised
    for a in free:
        for b in free:  # the sources no bound touched keep their relative shares
            assert out[a] / out[b] == pytest.approx(shares[a] / shares[b])


def test_low_or_falling_gap_raises_its_sources_healthy_gap_relaxes_back():
    ctl, applied = _controller(low_gap=0.1, high_gap=0.3, fall=0.2, up=2.0, relax=0.5, max_boost=4.0)
    start = ctl.weights()
    assert applied == [start] and start["image"] == pytest.approx(0.07)  # configured shares at first
    assert ctl.decide({"image_text": 0.01, "video_text": 0.5}, step=50)  # image low, video healthy
    assert ctl.boost == {"image_text": 2.0, "video_text": 1.0}
    w = ctl.weights()
    assert w["image"] / w["text"] == pytest.approx(2 * 0.07 / 0.86)
    assert w["interleaved"] / w["text"] == pytest.approx(2 * 0.03 / 0.86)  # feeds image_text too
    assert w["video"] / w["text"] == pytest.approx(0.04 / 0.86)
    ctl.decide({"image_text": 0.02, "video_text": 0.25}, step=100)  # video fell by 0.25 > fall
    assert ctl.boost == {"image_text": 4.0, "video_text": 2.0}
    ctl.decide({"image_text": 0.0, "video_text": 0.28}, step=150)  # capped at max_boost; video in band
    assert ctl.boost == {"image_text": 4.0, "video_text": 2.0}
    ctl.decide({"image_text": 0.9, "video_text": 0.9}, step=200)  # healthy: half the excess goes
    assert ctl.boost == {"image_text": 2.5, "video_text": 1.5}
    assert not ctl.decide({}, step=250)  # no evidence (no tokens of a task): nothing moves
    assert [h["step"] for h in ctl.history] == [50, 100, 150, 200, 250]


def test_boosts_start_at_initial_boost_and_relax_towards_one():
    ctl, applied = _controller(initial_boost=2.0, relax=0.5, high_gap=0.3)
    assert ctl.boost == {"image_text": 2.0, "video_text": 2.0}
    w = applied[0]  # what the loader gets before the first step
    assert w["image"] / w["text"] == pytest.approx(2 * 0.07 / 0.86)
    assert w["video"] / w["text"] == pytest.approx(2 * 0.04 / 0.86)
    ctl.decide({"image_text": 0.9, "video_text": 0.9}, step=50)  # healthy: half the excess over 1 goes
    assert ctl.boost == {"image_text": 1.5, "video_text": 1.5}
    assert _controller()[0].boost == {"image_text": 1.0, "video_text": 1.0}  # default: the configured mix


def test_media_token_cap_stops_raising_and_shrinks_the_boosts():
    ctl, _ = _controller(up=2.0, max_media_share=0.3)
    ctl.decide({"image_text": 0.0, "video_text": 0.0}, step=1)
    assert ctl.boost == {"image_text": 2.0, "video_text": 2.0}
    ctl.tokens = {"media": 40, "all": 100}  # 40% media tokens so far: above the cap
    ctl.decide({"image_text": 0.0, "video_text": 0.0}, step=2)
    assert ctl.boost == {"image_text": 1.0, "video_text": 1.0} and ctl.history[-1]["over_cap"]


def test_share_bounds_hold_whatever_the_boost():
    ctl, _ = _controller(up=8.0, max_boost=8.0, max_share={"image": 0.2}, min_share={"text": 0.5})
    ctl.decide({"image_text": 0.0, "video_text": 0.0}, step=1)
    w = ctl.weights()
    assert w["image"] <= 0.2 + 1e-12 and w["text"] >= 0.5 - 1e-12 and sum(w.values()) == pytest.approx(1)


def test_config_rejects_what_cannot_work():
    with pytest.raises(ValueError, match="tasks"):
        MixControllerConfig(kind="reliance")
    with pytest.raises(ValueError, match="tasks"):
        MixControllerConfig(kind="reliance", tasks={"image": "text"})
    with pytest.raises(ValueError, match="high_gap"):
        MixControllerConfig(kind="reliance", tasks=TASKS, low_gap=0.5, high_gap=0.1)
    with pytest.raises(ValueError, match="min_share"):
        MixControllerConfig(min_share={"a": 0.7, "b": 0.6})
    for bad in (0.5, 9.0):  # below 1, above max_boost
        with pytest.raises(ValueError, match="initial_boost"):
            MixControllerConfig(kind="reliance", tasks=TASKS, initial_boost=bad, max_boost=8.0)


# ----- inside the trainer ---------------------------------------------------------------------
# Every diagnostics check (every 2 steps) reads a gap below low_gap = 100 nats: the boosts rise
# at each check, so the loader's weights change at steps 0, 2, 4, ...
CONTROLLED = ["data.mix.controller.kind=reliance", "data.mix.controller.signal=blank",
              "data.mix.controller.tasks={image: image_text, video: video_text, interleaved: image_text}",
              "data.mix.controller.low_gap=100", "data.mix.controller.high_gap=100",
              "data.mix.controller.up=3", "data.mix.controller.max_boost=100",
              "diagnostics.every=2", "diagnostics.batches=1", "diagnostics.max_rows=8",
              "diagnostics.warmup_steps=0", "train.eval_batches=1",
              "data.train.0.weight=0.05", "data.train.1.weight=0.05", "data.train.2.weight=0.05",
              "data.train.3.weight=0.85"]


class Crash(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, stats):
        if trainer.step == self.step:
            raise Crash


def _records(run) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval" not in rec:
            out[rec["step"]] = rec  # a step replayed after a resume: the later line wins
    return out


def test_trainer_applies_the_shares_and_resumes_bit_identically(make_config, tmp_path):
    ref = Trainer(make_config(tmp_path / "ref", CONTROLLED), verbose=False)
    summary = ref.fit()
    recs = _records(tmp_path / "ref")
    shares = [recs[s]["mix"] for s in sorted(recs)]
    assert shares[0]["text"] > shares[-1]["text"]  # the media shares rose...
    loader_weights = {s.name: s.weight for s in ref.train_loader.sources}
    assert loader_weights == pytest.approx(shares[-1])  # ...in the loader
    assert summary["mix"]["decisions"] >= 4 and summary["mix"]["media_share"] > 0
    media = [sum(recs[s]["task_tokens"][t] for t in ("image_text", "video_text")) for s in sorted(recs)]
    assert sum(media[4:]) > sum(media[:4])  # and the batches followed them

    run = tmp_path / "run"
    with pytest.raises(Crash):  # killed at step 6; the newest checkpoint is step 4's, taken right
        Trainer(make_config(run, CONTROLLED), verbose=False, callbacks=[CrashAt(6)]).fit()  # after a change
    resumed = Trainer(make_config(run, CONTROLLED), verbose=False)
    # a record's "mix" is what its step's batch was drawn under: step 5's are those set at step 4
    assert resumed.step == 4
    assert resumed.train_loader.sources[3].weight == pytest.approx(recs[5]["mix"]["text"])
    resumed.fit()
    got = _records(run)
    assert [got[s]["loss"] for s in range(1, 9)] == [recs[s]["loss"] for s in range(1, 9)]  # bit-identical
    assert [got[s]["mix"] for s in range(1, 9)] == [recs[s]["mix"] for s in range(1, 9)]


def test_controller_needs_diagnostics_and_excludes_stages(make_config, tmp_path):
    with pytest.raises(ConfigError, match="diagnostics.every"):
        make_config(tmp_path / "a", [*CONTROLLED, "diagnostics.every=0"])
    with pytest.raises(ConfigError, match="train.stages"):
        make_config(tmp_path / "b", [*CONTROLLED, "train.stages=[{until_step: 3, sources: [text]}]"])
    with pytest.raises(ConfigError, match="no train source"):
        make_config(tmp_path / "c", [*CONTROLLED, "data.mix.controller.tasks={pictures: image_text}"])
