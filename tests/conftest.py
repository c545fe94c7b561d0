"""The suite's tiers and budgets (docs/CONVENTIONS.md, "Tests"):

- `@pytest.mark.slow` puts a case in the slow tier, run only by `make test-slow`
  (MMTRAIN_SLOW_TESTS=1, the one spelling: any other value, "0" included, is off);
- `@pytest.mark.distributed` marks every case that starts several ranks: dist_runs.launch refuses
  nproc > 1 from a case without it, so `-m "not distributed"` really leaves them out;
- every fast-tier case has a time budget (setup + call + teardown): BUDGET_S by kind, or
  `@pytest.mark.budget(seconds)`. A case over its budget fails the session, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # warm_launch.py, under --import-mode=importlib
    sys.path.insert(0, str(TESTS))

SLOW = os.environ.get("MMTRAIN_SLOW_TESTS") == "1"
# seconds a case may take (setup + call + teardown): ~4x the slowest of each kind on this project's
# 2-core machine, as CI's has run ~2.7x slower (stop 45: `.ci/run` 2155 s where `make test` took 714 s
# here). A case that needs more carries its own `budget` mark, with what it measured.
BUDGET_S = {"plain": 20.0, "distributed": 40.0}
_SPENT = pytest.StashKey[dict]()
_REFS = pytest.StashKey[Path]()


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds): this fast-tier case's time budget")
    config.stash[_SPENT] = {}


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow tier: make test-slow (MMTRAIN_SLOW_TESTS=1)")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _reference_cache(request, tmp_path_factory):
    """dist_runs.parity_reference / reference_run share identical one-process (and reference) runs
    across the session through this folder; its log.jsonl counts the runs and the copies."""
    root = tmp_path_factory.mktemp("references")
    os.environ["MMTRAIN_REFERENCE_CACHE"] = str(root)
    request.config.stash[_REFS] = root
    yield root
    os.environ.pop("MMTRAIN_REFERENCE_CACHE", None)


@pytest.fixture(autouse=True)
def _distributed_flag(request, monkeypatch):
    """dist_runs.launch reads it: several ranks only from a case marked `distributed`."""
    marked = request.node.get_closest_marker("distributed") is not None
    monkeypatch.setenv("MMTRAIN_TEST_DISTRIBUTED", "1" if marked else "0")


@pytest.fixture
def warm_subprocess(monkeypatch):
    """subprocess.run forks Python and torchrun commands from the warm parent (warm_launch.py) for
    this test: a tool that launches `python -m ...` runs as it would, without the interpreter starts.
    Its commands get one OpenMP thread each (as the dist tests' ranks), unless they set their own."""
    import warm_launch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(subprocess, "run", warm_launch.subprocess_run)


def budget_of(item) -> float | None:
    """None for the slow tier and GPU cases: no budget."""
    if item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        return None
    mark = item.get_closest_marker("budget")
    if mark:
        return float(mark.args[0])
    return BUDGET_S["distributed" if item.get_closest_marker("distributed") else "plain"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    spent = item.config.stash[_SPENT]
    spent[item.nodeid] = spent.get(item.nodeid, (0.0, budget_of(item)))
    total, budget = spent[item.nodeid]
    spent[item.nodeid] = (total + call.duration, budget)


def over_budget(config) -> list[tuple[str, float, float]]:
    if os.environ.get("MMTRAIN_TEST_BUDGET") == "0":  # measuring on a loaded machine: report only
        return []
    return [(node, t, b) for node, (t, b) in config.stash[_SPENT].items() if b is not None and t > b]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    log = config.stash.get(_REFS, TESTS) / "log.jsonl"
    if log.is_file():
        hits = [json.loads(line)["hit"] for line in log.read_text().splitlines()]
        terminalreporter.write_line(f"reference runs: {hits.count(False)} run, {hits.count(True)} shared "
                                    "(tests/mmtrain/dist_runs.py reference_key)")
    late = over_budget(config)
    if late:
        terminalreporter.section("over the time budget (docs/CONVENTIONS.md)", red=True)
        for node, t, b in sorted(late, key=lambda x: -x[1]):
            terminalreporter.line(f"{t:7.1f} s > {b:5.1f} s  {node}")
        terminalreporter.line(f"{len(late)} case(s) over the time budget: the session fails")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and over_budget(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
