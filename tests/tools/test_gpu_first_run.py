"""The first GPU run's verdict: a drift past the tolerance, a non-finite loss or a graph built after
warmup each fail it (the CPU dry run of tools/bench/gpu_check.sh exercises the rest)."""

from __future__ import annotations

from tools.bench.gpu_first_run import verdict

REF = [10.0, 9.5, 9.0]


def test_within_tolerance_and_no_recompile_passes():
    assert verdict([10.1, 9.4, 9.2], REF, graphs=0, tol=0.03) == []


def test_each_failure_is_named():
    assert "step 2" in verdict([10.0, 9.5, 9.5], REF, graphs=0, tol=0.03)[0]
    assert verdict([10.0, float("nan"), 9.0], REF, graphs=0, tol=0.03) == ["non-finite loss"]
    assert "recompiles" in verdict(REF, REF, graphs=2, tol=0.03)[0]
