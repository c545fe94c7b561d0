"""tools/bench/bench_vision.py at a tiny size: both sides run, and grouping by size changes nothing."""

from __future__ import annotations

import re

from tools.bench import bench_vision


def test_bench_vision_sides_agree(capsys):
    bench_vision.main(["--images", "3", "--clips", "2", "--steps", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| input order |" in out and "| grouped by size |" in out
    diff = float(re.search(r"outputs and patch gradients: (\S+)", out).group(1))
    assert diff < 1e-5
