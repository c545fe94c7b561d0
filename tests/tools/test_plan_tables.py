"""Every shipped config planned at its intended mesh (tools/plan_tables.py's rows: small at 1 and 8
GPUs, base at 32 and 64, long at 256 with cp 2, m3 at 256): each plan runs, each shipped config fits
its GPU there, and docs/DISTRIBUTED.md's plan tables are exactly today's plans, so the docs cannot
drift from the code. About 3 minutes of CI on 2 cores in all (m3 at 256 GPUs: ~95 s of it).
"""

from __future__ import annotations

import pytest

from tools import plan_tables
from tools.plan_tables import BEGIN, END, REPO, ROWS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def planned() -> list[tuple[str, dict]]:
    return plan_tables.plans()


def test_every_shipped_config_fits_at_its_intended_mesh(planned):
    for (cmd, plan), (_, _, sets) in zip(planned, ROWS):
        shipped = "dist.activation_checkpointing=false" not in sets  # the row that shows why it is on
        assert plan["memory"]["fits"] == shipped, (cmd, plan["memory"]["peak_bytes"] / 2**30)
        assert plan["flops"]["hardware"] > 0 and plan["roofline"]["step_s_overlapped"] > 0, cmd


def test_the_docs_tables_are_todays_plans(planned):
    doc = (REPO / "docs" / "DISTRIBUTED.md").read_text(encoding="utf-8")
    block = doc[doc.index(BEGIN):doc.index(END) + len(END)]
    assert block == plan_tables.tables(planned), (
        "docs/DISTRIBUTED.md's plan tables differ from today's plans: "
        "python -m tools.plan_tables --write docs/DISTRIBUTED.md")
