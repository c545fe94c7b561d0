"""The end-of-run table read through a pipe (SLURM logs, `tee`): nothing cut."""

from __future__ import annotations

import re

from mmtrain.evaluation.report import print_summary


def _record(step: int, gap: float) -> dict:
    tasks = ("text", "image_text", "video_text")
    return {"step": step, "loss": dict.fromkeys(tasks, 2.3456), "accuracy": dict.fromkeys(tasks, 0.5),
            "mismatch_gap": {"image_text": gap, "video_text": -gap},
            "reliance_gap": {"image_text": 2 * gap, "video_text": 3 * gap}}


def test_piped_table_keeps_every_gap_whole(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    summary = {"run_dir": "runs/" + "a_long_run_name_" * 4, "start": _record(0, 0.0012),
               "end": _record(1800, 1.7404), "balancer": "reliance_guard",
               "weights": {"text": 1.0, "image_text": 1.5, "video_text": 1.0}, "steps": 1800,
               "tokens_seen": 3_500_000, "data_wait_fraction": 0.01, "skipped_steps": 0,
               "checkpoint": "runs/x/step_1800"}
    print_summary(summary, 60.0)
    out = capsys.readouterr().out  # captured: not a terminal, as under a pipe
    assert "…" not in out
    rows = {line.split()[1]: line for line in out.splitlines() if re.match(r"\W*(image|video)_text ", line)}
    for task in ("image_text", "video_text"):
        gaps = [summary[when][key][task] for key in ("mismatch_gap", "reliance_gap")
                for when in ("start", "end")]
        assert re.findall(r"[+-]\d+\.\d{3}\b", rows[task]) == [f"{g:+.3f}" for g in gaps], rows[task]
    assert "1800 steps, 3,500,000 tokens in 1.0 min; data wait" in out  # the lines after it unfolded
