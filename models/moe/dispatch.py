"""Token dispatch: the one place that knows where a routed (token, expert) row is computed.

A dispatcher takes the tokens and their routing, hands the experts module rows grouped by expert
with the rows per expert, and combines what comes back: y_T = sum_k w_TK * expert_{idx_TK}(x_T).
`LocalDispatcher` keeps every row on this rank (sort, run, weighted scatter-add back). The
expert-parallel dispatcher (mmtrain/parallel/expert_parallel.py) sends the rows to the ranks that
hold their experts with an uneven all-to-all; the trainer installs it on each MoE layer from
outside the model files, through `MoE.dispatcher`.

`chunks(T, chunk, device)` is how many times the layer calls the dispatcher for T tokens in chunks of
`chunk` (models/chunked.py): here the chunks T needs; a collective dispatcher returns the same
count on every rank of its group (the most any rank needs), whatever each rank's T.

Tokens that are not routed (padding) carry the virtual expert E: sorted last, not counted, never
computed by an expert; they enter as zeros and leave as zeros.

Legend: T tokens, K top_k, R = T*K rows, E experts, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chunked import chunk_count

Tensor = torch.Tensor


def count(idx: Tensor, n: int) -> Tensor:
    """(n,) int64 occurrences of 0..n-1 (bincount with a static shape: compiles without a break)."""
    idx = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))


@dataclass
class Sorted:
    """The T*K rows in expert order (stable): which token and top-k slot each row is."""

    token_R: Tensor
    slot_R: Tensor
    expert_R: Tensor  # E for the rows of unrouted tokens, which come last
    counts_E: Tensor  # rows per real expert

    @property
    def routed_R1(self) -> Tensor:
        return (self.expert_R < self.counts_E.shape[0])[:, None]

    def weights_R1(self, w_TK: Tensor) -> Tensor:
        return w_TK.reshape(-1).index_select(0, self.token_R * w_TK.shape[1] + self.slot_R)[:, None]


def sort_by_expert(idx_TK: Tensor, n_experts: int) -> Sorted:
    K = idx_TK.shape[1]
    order_R = torch.argsort(idx_TK.reshape(-1), stable=True)
    counts_E = count(idx_TK, n_experts + 1)[:n_experts]
    return Sorted(order_R // K, order_R % K, idx_TK.reshape(-1)[order_R], counts_E)


def combine(y_RD: Tensor, rows: Sorted, w_TK: Tensor, x_TD: Tensor) -> Tensor:
    """Weight each row by its combine weight and sum the K rows of every token."""
    y_RD = torch.where(rows.routed_R1, y_RD * rows.weights_R1(w_TK).to(y_RD.dtype), 0)
    return torch.zeros_like(x_TD).index_add(0, rows.token_R, y_RD.to(x_TD.dtype))


class LocalDispatcher:
    """Every row stays here: sorted by expert, run through all experts at once, unsorted."""

    def chunks(self, T: int, chunk: int, device: torch.device) -> int:
        return chunk_count(T, chunk)

    def __call__(self, experts, x_TD: Tensor, idx_TK: Tensor, w_TK: Tensor) -> Tensor:
        rows = sort_by_expert(idx_TK, experts.w_in_EDF2.shape[0])
        # index_select, not advanced indexing: its backward is an index_add, where x[idx]'s is an
        # index_put with accumulate (several times slower on CPU)
        x_RD = torch.where(rows.routed_R1, x_TD.index_select(0, rows.token_R), 0)
        return combine(experts(x_RD, rows.counts_E), rows, w_TK, x_TD)
