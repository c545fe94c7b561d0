"""Onset of reading: the survival statistics against hand-worked cases, and the onset experiment's
arms running with records that outlive their run directories."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.tools.test_collapse_experiment import _experiment
from tools.experiments import posthoc
from tools.experiments.collapse import main
from tools.experiments.onset_report import onset_summary
from tools.experiments.survival import as_events, km_curve, km_median, log_rank, onset

ONSET = Path("configs/experiments/collapse/onset.yaml")


def test_onset_is_the_first_check_at_the_threshold_else_censored():
    assert onset([(100, 0.03), (0, 0.0), (50, 0.02)], 0.02) == (50, 50)
    assert onset([(0, 0.0), (50, 0.019)], 0.02) == (None, 50)
    assert onset([], 0.02) == (None, None)
    assert as_events([(50, 50), (None, 1000), (None, None)]) == [(50, True), (1000, False)]


def test_kaplan_meier_with_censoring():
    # 4 runs: onsets at 100 and 300, one censored at 200, one at 1000.
    events = [(100, True), (200, False), (300, True), (1000, False)]
    # S(100) = 3/4; at 300 two are at risk, one starts: S = 3/4 * 1/2 = 3/8.
    assert km_curve(events) == [(100, 0.75), (300, 0.375)]
    assert km_median(events) == 300
    assert km_median([(100, True), (1000, False), (1000, False)]) is None  # fewer than half started


def test_log_rank_by_hand_and_symmetric():
    a, b = [(1, True), (2, True)], [(3, True), (4, True)]
    # t=1: E1 = 2/4, V = 1/4; t=2: E1 = 1/3, V = 2/9; later times: nobody of a at risk.
    o, e, v = 2.0, 0.5 + 1 / 3, 0.25 + 2 / 9
    chi2, p = log_rank(a, b)
    assert chi2 == pytest.approx((o - e) ** 2 / v)
    assert p == pytest.approx(math.erfc(math.sqrt(chi2 / 2)))
    assert log_rank(b, a)[0] == pytest.approx(chi2)
    assert log_rank(a, a) == (pytest.approx(0.0), pytest.approx(1.0))  # identical arms: no evidence
    assert log_rank([(1000, False)], [(1000, False)]) == (0.0, 1.0)  # no events: no evidence


def _run(arm, onset_step, final, text):
    curve = [(s, {"image_text": (0.03 if onset_step is not None and s >= onset_step else 0.0)})
             for s in range(0, 1001, 50)]
    return {"arm": arm, "mismatch_curve": curve, "mismatch_end": {"image_text": final},
            "loss": {"text": text}, "media_share": 0.056}


def test_onset_summary_counts_reads_and_tests_against_the_pooled_reference():
    runs = [_run("static", None, 0.01, 0.65) for _ in range(5)] + [_run("static", 900, 0.06, 0.65)]
    runs += [_run("fix", s, 0.1, 0.652) for s in (200, 250, 300, 300, 350, 400)]
    pool = [_run("static", None, 0.0, 0.65) for _ in range(6)]
    o = onset_summary(runs, 0.05, "static", pool)
    fix, static = o["arms"]["fix"], o["arms"]["static"]
    assert (fix["reads"], static["reads"]) == (6, 1)
    assert fix["km_median"] == 300 and static["km_median"] is None
    assert fix["log_rank_p"] < 0.001 and static["log_rank_p"] is None
    assert fix["text_vs_ref"] == pytest.approx(0.002)
    assert o["ref_pooled"]["seeds"] == 12 and o["ref_pooled"]["started"] == 1


@pytest.mark.budget(30)  # 5 s measured
def test_onset_arms_run_and_their_records_outlive_the_run_dirs(tmp_path, capsys, warm_subprocess):
    exp = _experiment(tmp_path, ONSET)
    out, records = tmp_path / "out", tmp_path / "records"
    args = ["--experiment", str(exp), "--out", str(out), "--smoke", "--seeds", "0",
            "--arms", "static,frozen_vit,release", "--records", str(records)]
    assert main(args) == 0
    for arm in ("static", "frozen_vit", "release"):
        record = json.loads((records / arm / "seed0.json").read_text())
        assert record["steps"] == 4 and record["overrides"][-1].startswith("run_dir=")
    # posthoc adds the final checkpoint's whole-val eval, probe and word classes to each record
    assert posthoc.main(["--records", str(records), "--runs", str(out), "--media", "2"]) == 0
    record = json.loads((records / "static" / "seed0.json").read_text())
    assert set(record["posthoc"]) == {"eval", "probe", "words", "visual_norm", "text_embed_norm"}
    assert record["posthoc"]["eval"]["tokens"]["text"] > 0 and record["posthoc"]["probe"] is not None
    assert posthoc.main(["--records", str(records), "--runs", str(out), "--media", "2", "--force"]) == 0
    again = json.loads((records / "static" / "seed0.json").read_text())
    assert again["posthoc"] == record["posthoc"]  # deterministic: the same checkpoint, the same figures
    shutil.rmtree(out)  # a stop loses the run directories ...
    capsys.readouterr()
    assert main(args) == 0  # ... the records stand in for them: nothing retrains
    printed = capsys.readouterr().out
    assert printed.count("cached") == 3 and "Onset of reading" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["onset"]["arms"]) == {"static", "frozen_vit", "release"}
    summarize = ["--experiment", str(exp), "--out", str(out), "--smoke", "--seeds", "0",
                 "--arms", "static,mix10", "--records", str(records), "--summarize-only"]
    assert main(summarize) == 0  # mix10 never ran: listed, left out, nothing trains
    assert "1 unfinished run(s) left out: mix10/seed0" in capsys.readouterr().out
    assert not (out / "mix10").exists()
    assert (out / "onset_km.png").is_file()
