"""The vision balance's assignment and exchange plan (mmtrain/parallel/vision_plan.py), without a
process group: every rank's plan is computed from the same gathered grids and both all-to-alls
are simulated, so each rank's received tokens can be checked against encoding its own media."""

from __future__ import annotations

import random

import pytest
import torch

from mmtrain.parallel.vision_plan import assign, make_plan, rank_costs

COST = (1e-3, 1.0, 4.0)
MERGE, P = 2, 3


def random_grids(rng: random.Random, units: int, empty_unit: bool) -> list[list[list[int]]]:
    out = []
    for u in range(units):
        n = 0 if (empty_unit and u == units - 1) else rng.randint(0, 4)
        out.append([[rng.choice([1, 1, 2, 4]), 2 * rng.randint(1, 4), 2 * rng.randint(1, 3)]
                    for _ in range(n)])
    return out


def fake_encode(patches_NP: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
    """A per-medium function of its patches (like the encoder): each merged token = the sum of its
    merge^2 patches times its place in the medium (so swapped media or tokens show)."""
    out, at = [], 0
    for t, h, w in grids:
        n = t * h * w
        x_QkP = patches_NP[at:at + n].reshape(n // MERGE ** 2, MERGE ** 2, P)
        out.append(x_QkP.sum(1) * torch.arange(1, n // MERGE ** 2 + 1)[:, None])
        at += n
    return torch.cat(out) if out else patches_NP.new_zeros(0, P)


def all_to_all(sends: list[torch.Tensor], send_splits: list[list[int]]) -> list[torch.Tensor]:
    G = len(sends)
    parts = [list(s.split(send_splits[q])) for q, s in enumerate(sends)]
    return [torch.cat([parts[q][p] for q in range(G)]) for p in range(G)]


def simulate(grids_U, unit, need_U=None):
    """-> (each rank's received tokens, each rank's own reference tokens, the plans, the owners);
    reference rows of media a rank does not read (`need_U`) are zeroed."""
    G = len(grids_U) * unit
    sizes_U = [[t * h * w for t, h, w in g] for g in grids_U]
    owner_U = assign(sizes_U, G, *COST)
    patches_U = [torch.randn(sum(sizes), P) for sizes in sizes_U]  # a unit's ranks hold the same rows
    plans = [make_plan(grids_U, owner_U, r, unit, MERGE, need_U) for r in range(G)]
    sends = [patches_U[r // unit][pl.send_patch_idx] for r, pl in enumerate(plans)]
    got = all_to_all(sends, [pl.send_patches for pl in plans])
    for r, pl in enumerate(plans):
        assert got[r].shape[0] == sum(pl.recv_patches)
    enc = [fake_encode(got[r], pl.enc_grid) for r, pl in enumerate(plans)]
    back = all_to_all([e[pl.send_token_idx] for e, pl in zip(enc, plans)], [pl.send_tokens for pl in plans])
    mine = [b.new_zeros(pl.n_tokens, P).index_copy(0, pl.local_token_idx, b) for b, pl in zip(back, plans)]
    ref = [fake_encode(patches_U[r // unit], grids_U[r // unit]) for r in range(G)]
    for r in range(G) if need_U else ():
        u, at = r // unit, 0
        for (t, h, w), need in zip(grids_U[u], need_U[u]):
            q = t * h * w // MERGE ** 2
            ref[r][at:at + q] *= need >> (r % unit) & 1
            at += q
    return mine, ref, plans, owner_U


@pytest.mark.parametrize("unit", [1, 2, 4])
def test_every_rank_gets_the_tokens_of_its_own_media(unit):
    """Any rank's view gives the same plan: the simulated exchanges deliver exactly the tokens
    each rank would encode alone, and every medium is encoded once (once per cp group)."""
    rng = random.Random(unit)
    for trial in range(40):
        grids_U = random_grids(rng, rng.choice([1, 2, 3, 4]), empty_unit=trial % 3 == 0)
        mine, ref, plans, owner_U = simulate(grids_U, unit)
        for r in range(len(mine)):
            torch.testing.assert_close(mine[r], ref[r], rtol=0, atol=0)
        encoded = sorted(tuple(g) for pl in plans for g in pl.enc_grid)
        assert encoded == sorted(tuple(g) for grids in grids_U for g in grids)
        assert owner_U == assign([[t * h * w for t, h, w in g] for g in grids_U], len(mine), *COST)


@pytest.mark.parametrize("unit", [2, 4])
def test_tokens_go_only_to_the_ranks_that_read_them(unit):
    """With need masks (the cp ranks whose chunk holds a placeholder of the medium), each rank gets
    exactly the tokens of the media it reads; every medium is still encoded once."""
    rng = random.Random(10 + unit)
    for _ in range(30):
        grids_U = random_grids(rng, rng.choice([1, 2, 3]), empty_unit=False)
        need_U = [[rng.randint(1, (1 << unit) - 1) for _ in g] for g in grids_U]
        mine, ref, plans, _ = simulate(grids_U, unit, need_U)
        for r in range(len(mine)):
            torch.testing.assert_close(mine[r], ref[r], rtol=0, atol=0)
        sent = sum(sum(pl.send_tokens) for pl in plans)
        assert sent == sum(t * h * w // MERGE ** 2 * bin(n).count("1") for g, nd in zip(grids_U, need_U)
                           for (t, h, w), n in zip(g, nd))  # each medium's tokens to its readers only


@pytest.mark.parametrize("unit", [1, 2])
def test_balanced_max_cost_is_never_above_the_unbalanced(unit):
    """Over random patch counts at 8-16 ranks: max rank cost <= the unbalanced max (each cp rank
    encoding all of its rows' media), so max / mean of the work is too; on a skewed batch, lower."""
    rng = random.Random(7)
    for _ in range(50):
        units = rng.choice([8, 16]) // unit
        sizes_U = [[rng.choice([16, 64, 256, 1024, 4096]) for _ in range(rng.randint(0, 5))]
                   for _ in range(units)]
        G = units * unit
        bal = rank_costs(sizes_U, assign(sizes_U, G, *COST), G, *COST)
        unbal = [sum(c for c in rank_costs([s], [[0] * len(s)], 1, *COST)) for s in sizes_U
                 for _ in range(unit)]  # every cp rank encodes all of its rows' media
        assert max(bal) <= max(unbal) + 1e-9
        assert sum(bal) * unit == pytest.approx(sum(unbal))  # each medium once, not once per cp rank
    skew = [[4096, 4096, 1024], [], [16], []]
    bal = rank_costs(skew, assign(skew, 4, *COST), 4, *COST)
    assert max(bal) < rank_costs([skew[0]], [[0, 0, 0]], 1, *COST)[0]


def test_lpt_loses_to_the_local_split_is_caught():
    """{3, 3} | {2, 2, 2} at 2 ranks: LPT would make 7, the rows' own split is 6."""
    sizes_U = [[3, 3], [2, 2, 2]]
    owner_U = assign(sizes_U, 2, 0.0, 1.0, 0.0)
    assert max(rank_costs(sizes_U, owner_U, 2, 0.0, 1.0, 0.0)) == 6
