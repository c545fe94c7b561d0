"""tests/conftest.py's tiers and budgets, on a throwaway suite run with the same conftest: one slow
switch (MMTRAIN_SLOW_TESTS=1, nothing else), and a fast-tier case over its budget fails the session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
PROBES = '''
import time
import pytest

@pytest.mark.budget(0.05)
def test_over_its_budget():
    time.sleep(0.3)

@pytest.mark.slow
def test_in_the_slow_tier():
    pass

def test_plain():
    pass
'''


def _run(tmp_path: Path, probes: str, slow: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_probes.py").write_text(probes)
    env = {k: v for k, v in os.environ.items() if k not in ("MMTRAIN_SLOW_TESTS", "MMTRAIN_TEST_BUDGET")}
    if slow is not None:
        env["MMTRAIN_SLOW_TESTS"] = slow
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_case_over_its_budget_fails_the_session_and_is_named(tmp_path):
    run = _run(tmp_path, PROBES, None)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "2 passed, 1 skipped" in run.stdout  # every case passed: the budget alone fails it
    assert "test_probes.py::test_over_its_budget" in run.stdout.split("over the time budget")[1]


def test_only_one_spelling_turns_the_slow_tier_on(tmp_path):
    fast = PROBES.replace("budget(0.05)", "budget(60)")
    for value, ran in ((None, False), ("0", False), ("", False), ("true", False), ("1", True)):
        run = _run(tmp_path, fast, value)
        assert run.returncode == 0, run.stdout[-2000:]
        assert ("3 passed" in run.stdout) == ran and ("slow tier" in run.stdout) != ran, (value, run.stdout)
