"""tools/bench/bench_vision_balance.py's arithmetic and tools/bench/fit_vision_cost.py's fit (no
timing here: both run later, alone)."""

import random

import pytest

from tools.bench.bench_vision_balance import step_costs, summarize
from tools.bench.fit_vision_cost import fit, sizes

COST = (1.6e-4, 1.0, 64.0)


def test_balancing_evens_a_skewed_step_and_never_worsens_one():
    rng = random.Random(0)
    steps = [[[rng.choice([144, 576, 2304, 9216]) for _ in range(rng.randint(0, 4))] for _ in range(16)]
             for _ in range(20)]
    r = summarize(steps, 1, COST)
    assert 1.0 <= r["balanced"] < r["unbalanced"] and r["max_ratio"] <= 1.0
    cp = summarize([s[:8] for s in steps], 2, COST)  # 8 cp groups of 2: without balancing, twice the work
    assert cp["unbalanced"] >= 2 - 1e-9 and cp["balanced"] < cp["unbalanced"]  # (one big video: not /2)
    unbal, bal = step_costs([[576, 576], []], 2, COST)
    assert len(unbal) == len(bal) == 4 and sum(unbal) == pytest.approx(2 * sum(bal))


def test_fit_recovers_the_coefficients_of_exact_times():
    n = [t * h * w for t, h, w in sizes(2, 64, (1, 4, 16))]
    a, b, c = fit(n, [3e-4 * x * x + 2.0 * x + 50.0 for x in n])
    assert (a, b, c) == pytest.approx((3e-4, 2.0, 50.0), rel=1e-6)


def test_fit_drops_a_term_that_would_come_out_negative():
    n = [t * h * w for t, h, w in sizes(2, 64, (1, 4))]
    a, b, c = fit(n, [1e-3 * x * x + 400.0 - 0.5 * x for x in n])  # no cost model: b < 0
    assert b == 0 and a > 0 and c >= 0
