"""Smoke test of tools/bench/bench_decode.py at a tiny size (the numbers are for docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

from tools.bench import bench_decode


def test_bench_decode_runs_and_reports_both_layouts(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_decode.main(["--contexts", "32", "80", "--prefill", "48", "--steps", "2", "--warmup", "1",
                              "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for L in ("32", "80"):
        assert {"S", "F"} == set(res["decode"][L]) and res["decode"][L]["S"]["cache_bytes_per_token"] > 0
    assert res["prefill"]["48"]["S"]["prefill_tok_s"] > 0
    assert "growth S" in capsys.readouterr().out
