"""Which rank encodes which medium, and the two exchanges that follow from it: pure functions of
the gathered patch counts, so that every rank computes the same plan with no further talk.

The balance group is G ranks (group-rank order); `unit` consecutive ranks hold the same rows
(unit = cp under `dp_cp`, 1 otherwise), so a medium belongs to its unit, not to a rank: medium
(u, i) is the i-th medium of unit u's rows. Each medium gets one owner (its encoding rank) by
longest-processing-time-first bin packing on cost(n) = a n^2 + b n + c (n patches).

Its sender is the owner itself when the owner is in the unit (no traffic), else unit member
i % unit (the unit's sends spread over its ranks). The owner encodes its media in (sender, i)
order -- the order they arrive in -- and sends each medium's tokens back to the ranks of its unit
that read them (`need_U`: a bit per unit rank, e.g. the cp ranks whose chunk holds a placeholder
of the medium; default: all). A rank's tokens of media it does not read stay zero.

Legend: G ranks of the balance group, U units, M media of this rank's rows, N patches, Q tokens.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def medium_cost(n: int, a: float, b: float, c: float) -> float:
    return a * n * n + b * n + c


def assign(sizes_U: list[list[int]], n_ranks: int, a: float, b: float, c: float) -> list[list[int]]:
    """-> owner_U[u][i]: the rank (0..n_ranks-1) that encodes medium (u, i). The better (lower
    max rank cost) of LPT over all ranks and LPT inside each unit (no patch leaves its unit; kept
    on a tie). LPT alone can lose to the rows' own split ({3, 3} | {2, 2, 2}: 7 against 6)."""
    unit = n_ranks // max(len(sizes_U), 1)
    world = _lpt([(u, i, n) for u, sizes in enumerate(sizes_U) for i, n in enumerate(sizes)],
                 list(range(n_ranks)), (a, b, c))
    local = {}
    for u, sizes in enumerate(sizes_U):
        local |= _lpt([(u, i, n) for i, n in enumerate(sizes)], list(range(u * unit, (u + 1) * unit)),
                      (a, b, c))
    best = min((local, world), key=lambda o: max(rank_costs(sizes_U, _nested(o, sizes_U), n_ranks,
                                                             a, b, c), default=0.0))
    return _nested(best, sizes_U)


def _lpt(items: list[tuple[int, int, int]], ranks: list[int], cost: tuple) -> dict:
    """Costliest medium first (ties: lower (u, i)) onto the least-loaded rank (ties: the lower)."""
    loads = [(0.0, r) for r in ranks]  # sorted: a heap
    out = {}
    for neg_cost, u, i in sorted((-medium_cost(n, *cost), u, i) for u, i, n in items):
        load, r = heapq.heappop(loads)
        out[u, i] = r
        heapq.heappush(loads, (load - neg_cost, r))
    return out


def _nested(owner: dict, sizes_U: list[list[int]]) -> list[list[int]]:
    return [[owner[u, i] for i in range(len(sizes))] for u, sizes in enumerate(sizes_U)]


def local_owner(sizes_U: list[list[int]], unit: int) -> list[list[int]]:
    """The unbalanced reference: each unit's first rank encodes its own media."""
    return [[u * unit] * len(sizes) for u, sizes in enumerate(sizes_U)]


def rank_costs(sizes_U: list[list[int]], owner_U: list[list[int]], n_ranks: int,
               a: float, b: float, c: float) -> list[float]:
    """Encoder cost per rank under an assignment."""
    out = [0.0] * n_ranks
    for sizes, owners in zip(sizes_U, owner_U):
        for n, r in zip(sizes, owners):
            out[r] += medium_cost(n, a, b, c)
    return out


def sender(u: int, i: int, owner: int, unit: int) -> int:
    return owner if owner // unit == u else u * unit + i % unit


@dataclass
class Plan:
    """This rank's part of both exchanges (row indices and all-to-all splits by group rank)."""

    send_patch_idx: Tensor  # local patch rows to send, grouped by destination
    send_patches: list[int]  # patches to each rank
    recv_patches: list[int]  # patches from each rank
    enc_grid: list[list[int]]  # (t, h, w) of the media this rank encodes, in arrival order
    send_token_idx: Tensor  # rows of the encoded tokens to send, grouped by destination
    send_tokens: list[int]
    recv_tokens: list[int]
    local_token_idx: Tensor  # for each received token row, its row in this rank's media order
    n_tokens: int  # visual tokens of this rank's media (rows not received stay zero)


def make_plan(grids_U: list[list[list[int]]], owner_U: list[list[int]], me: int, unit: int,
              merge: int, need_U: list[list[int]] | None = None) -> Plan:
    G, u_me = len(grids_U) * unit, me // unit
    need_U = need_U or [[(1 << unit) - 1] * len(grids) for grids in grids_U]
    size = [[t * h * w for t, h, w in grids] for grids in grids_U]
    enc = [sorted((sender(u, i, o, unit), u, i) for u, owners in enumerate(owner_U)
                  for i, o in enumerate(owners) if o == r) for r in range(G)]  # each owner's order
    start = [0]
    for n in size[u_me]:
        start.append(start[-1] + n)
    send_patch, send_patches = [], []
    for p in range(G):  # my media that I send to p: p's arrival order restricted to me
        mine = [i for s, _, i in enc[p] if s == me]
        send_patch += [j for i in mine for j in range(start[i], start[i + 1])]
        send_patches.append(sum(size[u_me][i] for i in mine))
    recv_patches = [sum(size[u][i] for s, u, i in enc[me] if s == q) for q in range(G)]
    tok = [[n // merge ** 2 for n in sizes] for sizes in size]
    enc_start = [0]
    for _, u, i in enc[me]:
        enc_start.append(enc_start[-1] + tok[u][i])
    send_token, send_tokens = [], []
    for p in range(G):  # tokens of the media I encoded back to every rank of their unit
        rows = [j for k, (_, u, i) in enumerate(enc[me]) if u == p // unit and need_U[u][i] >> (p % unit) & 1
                for j in range(enc_start[k], enc_start[k + 1])]
        send_token += rows
        send_tokens.append(len(rows))
    mine = tok[u_me]
    start_tok = [sum(mine[:i]) for i in range(len(mine))]
    local_idx, recv_tokens = [], []
    for q in range(G):  # arrival: by owner q, in q's order restricted to what I read
        got = [i for _, u, i in enc[q] if u == u_me and need_U[u][i] >> (me % unit) & 1]
        local_idx += [j for i in got for j in range(start_tok[i], start_tok[i] + mine[i])]
        recv_tokens.append(sum(mine[i] for i in got))
    return Plan(_idx(send_patch), send_patches, recv_patches, [grids_U[u][i] for _, u, i in enc[me]],
                _idx(send_token), send_tokens, recv_tokens, _idx(local_idx), sum(mine))


def _idx(rows: list[int]) -> Tensor:
    return torch.tensor(rows, dtype=torch.long)
