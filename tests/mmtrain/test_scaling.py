"""What each mesh dimension exists to save, per rank, at degrees 1, 2 and 4 (tools/bench/bench_scaling.py:
`mmtrain plan`'s trace of the trainer's parallelize code on the fake process group). Slow tier: the
fast tier keeps each path's own case (FSDP / EP / TP bytes at rest: test_rest_bytes; TP's gathered
weights and wire bytes: test_tp_scaling; PP's stage bytes at rest and at build: test_pipeline_memory)."""

from __future__ import annotations

import pytest

from tools.bench.bench_scaling import measure

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def measured():
    cache = {}

    def get(dim: str, n: int) -> dict:
        if (dim, n) not in cache:
            cache[dim, n] = measure(dim, n)
        return cache[dim, n]

    return get


def _falls(values: list[float], per_doubling: float) -> bool:
    return all(b <= a * per_doubling for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("dim", ["fsdp", "ep", "cp", "tp"])
def test_state_at_rest_halves_per_doubling(measured, dim):
    rest = [measured(dim, n)["rest"] for n in (1, 2, 4)]
    assert _falls(rest, 0.55), (dim, rest)


def test_cp_divides_the_activation_peak(measured):
    """A row's activations split over the cp ranks (K/V of the kept blocks come back, transient)."""
    act = [measured("cp", n)["activations"] for n in (1, 2, 4)]
    assert _falls(act, 0.65), act


def test_ep_gathers_less_than_fsdp_over_the_same_ranks(measured):
    """The routed experts are never all-gathered under EP: its weight all-gathers move less than FSDP's
    over the same 4 ranks (and its all-to-alls move the rows instead)."""
    def gathered(dim: str) -> float:
        return sum(b for (group, kind), b in measured(dim, 4)["wire"].items() if kind == "all_gather")

    assert gathered("ep") <= 0.6 * gathered("fsdp"), (gathered("ep"), gathered("fsdp"))
    assert any(kind == "all_to_all" for _, kind in measured("ep", 4)["wire"])


def test_pp_divides_the_largest_stages_state_but_not_1f1bs_activations(measured):
    """A stage holds L / pp layers' state; under 1F1B rank r holds pp - r micro-batches of its L / pp
    layers' activations, so the first stage's activations stay about one process's (stated in
    docs/DISTRIBUTED.md, "When to choose")."""
    rest = [measured("pp", n)["rest"] for n in (1, 2, 4)]
    assert _falls(rest, 0.65), rest
    act = [measured("pp", n)["activations"] for n in (1, 2, 4)]
    assert all(0.8 <= a / act[0] <= 1.2 for a in act), act


def test_tp_divides_the_activation_peak(measured):
    """Sequence parallelism splits every activation between the matmuls. (TP's gathered weights fall
    against FSDP over the same ranks, test_tp_scaling; against one process the peak gather is the
    blocks tp does not split, the embedding and encoder, gathered whole as FSDP does.)"""
    act = [measured("tp", n)["activations"] for n in (1, 2, 4)]
    assert _falls(act, 0.75), act
