"""Every shipped config planned at its intended mesh (tools/plan_tables.py's rows: small at 1 and 8
GPUs, base at 32 and 64, long at 256 at 64k tokens (cp 2) and at 1M (cp 32), m3 at 256): each plan
runs, each shipped config fits its GPU there (NO_FIT: the rows that show why a setting is needed),
and docs/DISTRIBUTED.md's plan tables are exactly today's plans, so the docs cannot drift from the
code; every configs/*.yaml is planned, each within ROW_BUDGET_S CPU seconds (one layer per kind
traced and scaled, mmtrain/plan/layers.py). CI time: see docs/BENCHMARKS.md (plan speed).

Default CI plans CI_ROWS (m3 at its published TP2 / PP4 / EP32 mesh: the most planning code in one
row; and the test configs, ~35 CPU s); every row, its fit and the docs' tables (~4 min alone) run with
MMTRAIN_SLOW_TESTS=1 -- run them after changing the plan or a shipped config (`make test-slow`).
"""

from __future__ import annotations

import pytest

from tools import plan_tables
from tools.plan_tables import BEGIN, END, REPO, ROWS, SMALL_ROWS

pytestmark = pytest.mark.timeout(1800)  # ten rows: ~4-5 min, more on busy cores
SLOW = pytest.mark.slow  # every plan row: make test-slow
CI_ROWS = [ROWS[-1], *SMALL_ROWS]
NO_FIT = {  # rows that show why a setting is what it is, and must not fit
    ("dist.dp_replicate=8", "dist.activation_checkpointing=false"),  # why checkpointing is on
    # 1M tokens: the ViT encodes the row's 512 images on each of the 32 cp ranks (154 GiB a rank);
    # vision.balance dp_cp encodes each once (the plan traces it: --set vision.balance=dp_cp)
    ("dist.dp_replicate=8", "dist.cp=32", "data.seq_len=1048576"),
}


ROW_BUDGET_S = 45.0  # CPU seconds a shipped config's plan may take (measured: docs/BENCHMARKS.md)
SECONDS: list[float] = []


@pytest.fixture(scope="module")
def planned() -> list[tuple[str, dict]]:
    return plan_tables.plans(seconds=SECONDS)


def test_every_shipped_config_has_a_plan_row():
    names = {n for n, _, _ in ROWS + SMALL_ROWS}
    assert names == {p.stem for p in (REPO / "configs").glob("*.yaml")}, "a shipped config without a plan row"


@pytest.mark.budget(60)  # 14 s measured
def test_m3_at_its_published_mesh_and_the_test_configs_plan_within_budget_and_fit():
    seconds: list[float] = []
    rows = plan_tables.plans(CI_ROWS, seconds)
    assert max(seconds) < ROW_BUDGET_S, list(zip([c for c, _ in rows], seconds))
    for cmd, plan in rows:
        assert plan["memory"]["fits"], cmd
        assert plan["flops"]["hardware"] > 0 and plan["roofline"]["step_s_overlapped"] > 0, cmd


@SLOW
def test_every_shipped_config_plans_within_its_budget(planned):
    small: list[float] = []
    plan_tables.plans(SMALL_ROWS, small)
    slow = [(cmd, round(s, 1)) for (cmd, _), s in zip(planned, SECONDS) if s > ROW_BUDGET_S]
    assert not slow and max(small) < ROW_BUDGET_S, (slow, small)


@SLOW
def test_every_shipped_config_fits_at_its_intended_mesh(planned):
    for (cmd, plan), (_, _, sets) in zip(planned, ROWS):
        peak_gib = plan["memory"]["peak_bytes"] / 2**30
        assert plan["memory"]["fits"] == (tuple(sets) not in NO_FIT), (cmd, peak_gib)
        assert plan["flops"]["hardware"] > 0 and plan["roofline"]["step_s_overlapped"] > 0, cmd


@SLOW
def test_the_docs_tables_are_todays_plans(planned):
    doc = (REPO / "docs" / "DISTRIBUTED.md").read_text(encoding="utf-8")
    block = doc[doc.index(BEGIN):doc.index(END) + len(END)]
    assert block == plan_tables.tables(planned), (
        "docs/DISTRIBUTED.md's plan tables differ from today's plans: "
        "python -m tools.plan_tables --write docs/DISTRIBUTED.md")
