"""vision.balance: dp over whole 2-rank FSDP runs (torchrun, gloo). The masked-patch pass
(loss.visual_ssl) and the eval forwards encode locally (mmtrain/parallel/vision_balance.py says why),
so a run with the balance on matches the run with it off: per-step losses, the visual_ssl term and
the end-of-run eval. A run whose rank 1 is killed while saving step 6 resumes (torchrun restart)
from step_4 and reproduces the uninterrupted balanced run's losses bit for bit."""

from __future__ import annotations

import json

import pytest
import yaml
from dist_runs import checkpoint_names, losses, step_records, train, write_config

pytestmark = pytest.mark.distributed

SSL = ["model.vision.ssl_head=true", "loss.visual_ssl.weight=0.5"]


@pytest.fixture(scope="module")
def balanced(raw_for, tmp_path_factory):
    """The uninterrupted run with the balance on."""
    ref = tmp_path_factory.mktemp("vbal") / "ref"
    config = write_config(raw_for, ref, [*SSL, "vision.balance=dp"])
    train(config, 2)
    return ref, config


def test_balance_on_matches_off_with_visual_ssl_and_eval(balanced, raw_for, tmp_path):
    ref, _ = balanced
    off = tmp_path / "off"
    train(write_config(raw_for, off, SSL), 2)
    on_recs, off_recs = step_records(ref), step_records(off)
    assert "vision.balance: dp over 2 ranks" in (ref / "train.log").read_text()
    for key in ("loss", "visual_ssl", "grad_norm"):
        on, got = [on_recs[s][key] for s in sorted(on_recs)], [off_recs[s][key] for s in sorted(off_recs)]
        assert on == pytest.approx(got, rel=1e-5, abs=0), key
    assert all(r["visual_ssl"] > 0 for r in on_recs.values())
    ends = [json.loads((run / "summary.json").read_text())["end"] for run in (ref, off)]
    for key in ("loss", "blank_loss", "mismatch_loss"):
        assert ends[0][key] == pytest.approx(ends[1][key], rel=1e-5, abs=0), key


def test_kill_and_resume_with_the_balance_on_is_exact(balanced, tmp_path):
    ref, ref_config = balanced
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(ref_config.read_text()), "run_dir": str(run)}))
    train(config, 2, "train.faults.kill_in_save_at_step=6", "train.faults.rank=1", max_restarts=1)
    assert losses(run) == losses(ref)
    assert f"resumed from {run / 'step_4'} at step 4" in (run / "train.log").read_text()
    assert checkpoint_names(run) == ["step_2", "step_4", "step_6", "step_8"]
