"""The suite's tiers and budgets (docs/CONVENTIONS.md, "Tests"):

- `@pytest.mark.slow` puts a case in the slow tier, run only by `make test-slow`
  (MMTRAIN_SLOW_TESTS=1, the one spelling: any other value, "0" included, is off);
- `@pytest.mark.distributed` marks every case that starts several ranks: dist_runs.launch refuses
  nproc > 1 from a case without it, so `-m "not distributed"` really leaves them out;
- every fast-tier case has a time budget (setup + call + teardown): BUDGET_S by kind, or
  `@pytest.mark.budget(seconds)`. A case over its budget fails the session, naming it.
"""

from __future__ import annotations

import os

import pytest

SLOW = os.environ.get("MMTRAIN_SLOW_TESTS") == "1"
# seconds, on the 2-core CI machine: ~3x what the slowest of each kind measured there (the machines
# differ ~2x); a case that needs more says so with its own budget mark
BUDGET_S = {"plain": 20.0, "distributed": 60.0}
_SPENT = pytest.StashKey[dict]()


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


@pytest.fixture(autouse=True)
def _distributed_flag(request, monkeypatch):
    """dist_runs.launch reads it: several ranks only from a case marked `distributed`."""
    marked = request.node.get_closest_marker("distributed") is not None
    monkeypatch.setenv("MMTRAIN_TEST_DISTRIBUTED", "1" if marked else "0")


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
    late = over_budget(config)
    if late:
        terminalreporter.section("over the time budget (docs/CONVENTIONS.md)", red=True)
        for node, t, b in sorted(late, key=lambda x: -x[1]):
            terminalreporter.line(f"{t:7.1f} s > {b:5.0f} s  {node}")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and over_budget(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
