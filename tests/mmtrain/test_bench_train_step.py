"""tools/bench/bench_train_step.py on the small corpus: both feeds train and the table is printed."""

from __future__ import annotations

import re

import yaml

from tools.bench import bench_train_step


def test_bench_train_step_reports_both_feeds(make_raw, tmp_path, capsys):
    cfg_path = tmp_path / "tiny.yaml"
    raw = make_raw(tmp_path / "unused")
    raw["data"]["num_workers"] = 1  # the live side's worker process, as in make train
    cfg_path.write_text(yaml.safe_dump(raw))
    bench_train_step.main(["--config", str(cfg_path), "--steps", "1", "--rounds", "1", "--warmup", "1",
                           "--settle", "0"])
    out = capsys.readouterr().out
    assert "| live loader |" in out and "| batches drawn beforehand |" in out
    assert re.search(r"the live loader adds -?\d+\.\d ms per step", out)
