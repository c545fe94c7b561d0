"""The vision encoder's work balanced across ranks (section `vision`, `balance`).

Each training forward: gather every rank's media grids over the balance group, assign each
medium to an encoding rank (mmtrain/parallel/vision_plan.py: LPT on a n^2 + b n + c), all-to-all
the patches there, encode them with the model's own VisionEncoder, all-to-all the visual tokens
back. Both exchanges are the autograd `AllToAll` (backward: the reverse exchange), so the
encoder's gradients are those of each rank encoding its own media. A rank that encodes nothing
still runs every block (VisionEncoder's blank frame): FSDP's collectives stay matched.

    none    each rank encodes the media of its rows (the default; no collective)
    dp      balanced over the data ranks with the same (cp, tp) coordinate (each cp and tp rank
            still encodes all the media of its rows, as without balancing)
    dp_cp   balanced over the world; a (cp, tp) group's ranks hold the same rows, so each of their
            media is encoded once in the world and its tokens go to the ranks of the group whose
            chunk holds one of its placeholders (tp: the encoder is replicated, not split, so its
            tp ranks would otherwise encode the same media tp times)

Under dist.pp > 1 only stage 0 encodes (pp rank 0's ranks: `balance_group`); either mode balances
over its ranks, whose schedules run the same micro-batches' forwards (row parts included) and
backwards in the same order, so the exchanges line up as FSDP's collectives do.

Installed as `MultimodalModel.encode_media`, used by training forwards only. Two passes stay local:
- eval forwards (evaluate, diagnostics, probe, captioning): not every one runs on every rank in
  step (captioning decodes on rank 0 alone), so a collective inside would hang; they have no
  backward and run on a few batches, so there is little to balance.
- the masked-patch pass (loss.visual_ssl): it would need the masks sent with the patches and
  per-patch predictions (not merged tokens) sent back, a third exchange pair, for a pass over
  `media_share` (0.25) of the media. It is exact as it is and every rank runs it (a blank frame
  when nothing is masked). tests/mmtrain/test_vision_balance_runs.py: on = off, both included.

Legend: N patches, P patch dim, M media, Q visual tokens, O decoder dim, G ranks of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.callbacks import Callback
from mmtrain.checks import check
from mmtrain.parallel.comm import AllToAll, Traffic
from mmtrain.parallel.vision_plan import assign, local_owner, make_plan, rank_costs

Tensor = torch.Tensor


@dataclass
class VisionBalanceConfig:
    balance: Literal["none", "dp", "dp_cp"] = "none"
    # per-medium encoder cost a n^2 + b n + c (n patches): attention, MLP, fixed; to be fitted
    # (tools/bench/fit_vision_cost.py). Only the ratios matter.
    cost_a: float = 1.6e-4
    cost_b: float = 1.0
    cost_c: float = 64.0

    def __post_init__(self):
        if self.balance not in ("none", "dp", "dp_cp"):
            raise ValueError(f"balance: must be none, dp or dp_cp (got {self.balance!r})")
        check(self, "cost_a", "cost_b", "cost_c", ge=0)


class VisionBalancer(Callback):
    """The encode_media callable; as a callback it logs the modelled encoder cost's max / mean over
    the group's ranks (mean: the work there is to do), balanced and as it would be without."""

    def __init__(self, group: dist.ProcessGroup, unit: int, cost: tuple[float, float, float],
                 traffic: Traffic | None = None) -> None:
        self.group, self.unit, self.cost, self.traffic = group, unit, cost, traffic
        self.me, self.G = dist.get_rank(group), dist.get_world_size(group)
        self.spread: list[tuple[float, float]] = []  # per forward of this step: (balanced, unbalanced)
        self.last: dict[str, float] = {}

    def __call__(self, vision: nn.Module, patches_NP: Tensor, grid_thw_M3: Tensor,
                 modality_BS: Tensor | None = None) -> Tensor:
        """`modality_BS` (whole rows, under cp): a medium's tokens go only to the cp ranks whose
        chunk holds one of its placeholders; the other rows of the result stay zero (unread)."""
        merge = vision.cfg.merge
        need_M = self._need(modality_BS, grid_thw_M3, merge)
        grids_U, need_U = self._gather_grids(torch.cat([grid_thw_M3.long(), need_M[:, None]], 1))
        sizes_U = [[t * h * w for t, h, w in g] for g in grids_U]
        owner_U = assign(sizes_U, self.G, *self.cost)
        self._note(sizes_U, owner_U)
        plan = make_plan(grids_U, owner_U, self.me, self.unit, merge, need_U)
        dev = patches_NP.device
        send_NP = patches_NP.index_select(0, plan.send_patch_idx.to(dev))
        enc_NP = self._exchange(send_NP, plan.recv_patches, plan.send_patches, "vision_patches")
        grid_E3 = torch.tensor(plan.enc_grid, dtype=grid_thw_M3.dtype, device=dev).reshape(-1, 3)
        enc_QO = vision(enc_NP, grid_E3)
        send_QO = enc_QO.index_select(0, plan.send_token_idx.to(dev))
        got_QO = self._exchange(send_QO, plan.recv_tokens, plan.send_tokens, "vision_tokens")
        return got_QO.new_zeros(plan.n_tokens, got_QO.shape[1]).index_copy(
            0, plan.local_token_idx.to(dev), got_QO)

    def _need(self, modality_BS: Tensor | None, grid_thw_M3: Tensor, merge: int) -> Tensor:
        """(M,) int64: bit r set when unit rank r's chunk of the rows holds a token of the medium."""
        M, dev = grid_thw_M3.shape[0], grid_thw_M3.device
        everyone_M = torch.full((M,), (1 << self.unit) - 1, dtype=torch.long, device=dev)
        if self.unit == 1 or modality_BS is None:
            return everyone_M
        _, s_Q = torch.nonzero(modality_BS != 0, as_tuple=True)
        tok_M = grid_thw_M3.long().prod(-1) // merge ** 2
        if s_Q.numel() != int(tok_M.sum()):  # not ours to judge: the decoder names the mismatch
            return everyone_M
        medium_Q = torch.repeat_interleave(torch.arange(M, device=dev), tok_M)
        chunk_Q = s_Q // (modality_BS.shape[1] // self.unit)
        need_MR = torch.zeros(M, self.unit, dtype=torch.long, device=dev)
        need_MR[medium_Q, chunk_Q] = 1
        return (need_MR << torch.arange(self.unit, device=dev)).sum(1)

    def _note(self, sizes_U: list[list[int]], owner_U: list[list[int]]) -> None:
        bal = rank_costs(sizes_U, owner_U, self.G, *self.cost)
        mean = sum(bal) / self.G
        if mean > 0:  # without balancing every rank of a unit encodes all of its media
            unbal = [rank_costs([s], local_owner([s], 1), 1, *self.cost)[0] for s in sizes_U]
            self.spread.append((max(bal) / mean, max(unbal) / mean))

    def on_step_end(self, trainer, stats) -> None:
        n, (bal, unbal) = len(self.spread), (zip(*self.spread) if self.spread else ((), ()))
        self.last = {"vision/cost_max_over_mean": sum(bal) / n,
                     "vision/cost_max_over_mean_unbalanced": sum(unbal) / n} if n else {}
        self.spread = []

    def on_log(self, trainer, stats, scalars: dict) -> None:
        scalars.update(self.last)

    def _gather_grids(self, grid_M4: Tensor) -> tuple[list[list[list[int]]], list[list[int]]]:
        """Every unit's (t, h, w) grids and need masks (from its first rank: the unit's ranks hold
        the same rows)."""
        n = grid_M4.new_tensor([grid_M4.shape[0]])
        counts = [torch.empty_like(n) for _ in range(self.G)]
        dist.all_gather(counts, n, group=self.group)
        most = max(int(c) for c in counts)
        pad_M4 = grid_M4.new_zeros(most, 4)
        pad_M4[:grid_M4.shape[0]] = grid_M4
        parts = [torch.empty_like(pad_M4) for _ in range(self.G)]
        dist.all_gather(parts, pad_M4, group=self.group)
        rows_U = [parts[r][:int(counts[r])].tolist() for r in range(0, self.G, self.unit)]
        return [[g[:3] for g in rows] for rows in rows_U], [[g[3] for g in rows] for rows in rows_U]

    def _exchange(self, x_ND: Tensor, out_G: list[int], in_G: list[int], kind: str) -> Tensor:
        return AllToAll.apply(x_ND, out_G, in_G, self.group, lambda x, in_P: self._count(x, in_P, kind))

    def _count(self, x_ND: Tensor, in_G: list[int], kind: str) -> None:
        if self.traffic is not None:  # rows to the other ranks (our own never leave)
            others = sum(in_G) - in_G[self.me]
            self.traffic.add(kind, others * x_ND[:1].numel() * x_ND.element_size())


def balance_group(kind: str, dims) -> tuple[dist.ProcessGroup | None, int]:
    """-> (the balance group, ranks per unit); None when there is nothing to balance. Every rank
    calls it (new_group is collective). A unit is a (cp, tp) group (`seq_size` consecutive ranks,
    group rank = seq_rank: the row chunk `_need` reads). Under dist.pp the encoder is stage 0's,
    on pp rank 0 under every schedule (the vision stage's too): the groups are made of those ranks
    (the first world / pp, pp being the outermost dim) and the other stages' ranks get None."""
    if kind == "none" or dims.world_size == 1:
        return None, 1
    seq, pp, first = dims.seq_size, dims.pp, dims.pp_rank == 0
    if pp == 1 and (kind == "dp_cp" or seq == 1):
        return (dist.group.WORLD, seq) if kind == "dp_cp" or dims.dp_size > 1 else (None, 1)
    stage0 = range(dims.world_size // pp)  # pp rank 0's ranks: every data rank and (cp, tp) chunk
    if kind == "dp_cp":
        group = dist.new_group(list(stage0))
        return (group, seq) if first else (None, 1)
    groups = [dist.new_group([r for r in stage0 if r % seq == s]) for s in range(seq)]
    return (groups[dims.seq_rank], 1) if first and dims.dp_size > 1 else (None, 1)


def install(model, cfg: VisionBalanceConfig, dims, traffic: Traffic | None = None) -> str:
    """Set `model.encode_media` per `cfg.balance` (`model`: what the training forwards encode with;
    None on a pipeline rank without stage 0); -> a line for the log."""
    group, unit = balance_group(cfg.balance, dims)
    if group is None:
        if cfg.balance == "none":
            return "vision.balance: none"
        why = ("this rank holds no vision encoder: stage 0's ranks balance" if dims.pp_rank > 0
               else "one rank" if dims.pp == 1 else "one data rank on the first pipeline stage")
        return f"vision.balance: {cfg.balance} (nothing to balance: {why})"
    model.encode_media = VisionBalancer(group, unit, (cfg.cost_a, cfg.cost_b, cfg.cost_c), traffic)
    return (f"vision.balance: {cfg.balance} over {dist.get_world_size(group)} ranks "
            f"(units of {unit}; cost {cfg.cost_a:g} n^2 + {cfg.cost_b:g} n + {cfg.cost_c:g})")
