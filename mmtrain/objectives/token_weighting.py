"""Token reliance weighting (`loss.token_weighting`) inside the train step.

Before the training forward of a micro-batch, a forward without grad with every medium blanked,
on the rows that hold media-task trained tokens only (`terms.take_rows`; documents never
cross rows, so the rows' outputs equal the whole batch's), gives each caption token's loss
without the pixels. The media tasks' loss then weights each token by how much the pixels help
(`terms.reliance_weights`); the unweighted losses stay what is logged and balanced.

It runs first so its activations are freed before the training graph exists. Training state is
left alone (`frozen.frozen_state`: eval mode, so MoE layers count no load, RNG restored).
Its cost and weights are summed in a `TokenWeightingSums` (part of the step's sums, all-reduced
with them); `figures()` turns the step's total into the logged figures.

Under context / tensor parallelism (a `ContextShard`: the ranks of a cp / tp group read the same
whole rows, each predicts its chunk [lo, hi) of them) the blank pass is a sharded forward of the
same rows on every rank of the group: the rows are chosen from the whole rows, so the group's ranks
take the same ones and join the same collectives (a rank whose chunk holds no media token too), and
each gets its chunk's CE. The per-task mean of the reliance is the group's (its sums and counts
all-reduced over the group), and so are the logged figures: tokens and delta are sums (each rank
its chunk's), the top decile is taken over the group's weights (all-gathered) by its first rank.
Legend: B rows, S row tokens, s = hi - lo the rank's chunk, R rows forwarded, T tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import PackedBatch
from mmtrain.frozen import frozen_state
from mmtrain.models.attention.context import ContextShard
from mmtrain.objectives.chunked_ce import head_ce
from mmtrain.objectives.sums import Sums
from mmtrain.objectives.terms import (
    MEDIA_TASK_IDS,
    TaskLosses,
    blank_media,
    media_tokens,
    reliance_stats,
    reliance_weights,
    reweighted,
    take_rows,
    token_losses,
)


@dataclass
class TokenWeightingConfig:
    """Token reliance weighting (mmtrain/objectives/terms.py, reliance_weights): each trained token of a
    media task is weighted by how much the pixels help predict it, from an extra forward without
    grad with every medium blanked, on the rows that hold such tokens (about their share of a
    forward's cost). Per task and micro-batch the weights average 1; text tokens keep weight 1."""

    strength: float = 0.0  # 0: off (no extra forward); 1: weights proportional to the reliance
    floor: float = 0.05  # nats added to max(blank CE - real CE, 0): unhelped tokens keep some weight

    def __post_init__(self):
        check(self, "strength", ge=0, le=1)
        check(self, "floor", gt=0)


@dataclass
class TokenWeightingSums(Sums):
    """Over micro-batches (and, reduced, ranks): the media tasks' trained tokens weighted."""

    seconds: float = 0.0  # the blank forwards' wall time
    tokens: float = 0.0  # tokens weighted
    delta: float = 0.0  # sum of max(ce_blank - ce_real, 0) over them
    top: float = 0.0  # sum of each micro-batch's top-decile weights ...
    top_n: float = 0.0  # ... and how many those are

    def figures(self, world: int) -> dict[str, float] | None:
        """The step's figures from the all-reduced sums: blank-forward seconds (mean over ranks),
        mean positive loss difference blank - real of the weighted tokens, mean weight of each
        micro-batch's top decile. None when no token was weighted."""
        if not self.tokens:
            return None
        return {"seconds": self.seconds / world, "mean_delta": self.delta / self.tokens,
                "top_decile_weight": self.top / max(self.top_n, 1.0)}


class TokenWeighting:
    def __init__(self, cfg: TokenWeightingConfig, model: torch.nn.Module, device: torch.device,
                 autocast: Callable, pad_batch: Callable[[], PackedBatch], fsdp: bool,
                 ce_chunk: int = 0, head_weight: Callable[[], torch.Tensor] | None = None,
                 context: ContextShard | None = None):
        self.cfg, self.model, self.device = cfg, model, device
        self.autocast, self.pad_batch, self.fsdp = autocast, pad_batch, fsdp
        self.ce_chunk, self.head_weight = ce_chunk, head_weight  # chunk > 0: no (R, S, V) logits
        self.context = context  # cp / tp: the group that splits every row

    def blank_ce(self, batch: PackedBatch, counts: list[float] | None,
                 sums: TokenWeightingSums) -> torch.Tensor | None:
        """(B, S) cross-entropy with every medium blanked, forwarded only on the rows that hold
        media-task trained tokens (0 on the others); None when this rank has none.

        `counts`: the global per-task counts (distributed runs). Under FSDP every forward is
        collective, so a rank without media tokens joins the others' with the one-row pad batch.
        With a context shard `batch` is the whole rows (the same on every rank of the group, so the
        group's ranks agree on the rows, or on the pad batch) and the result (B, s) this rank's chunk.
        """
        rows_R = media_tokens(batch.labels_BS, batch.task_BS).any(1).nonzero().squeeze(1)
        if not len(rows_R):
            others = counts is not None and any(counts[i] for i in MEDIA_TASK_IDS)
            if others and self.fsdp:
                self._frozen_ce(self.pad_batch().to(self.device), sums)
            return None
        sub = batch if len(rows_R) == batch.labels_BS.shape[0] else take_rows(batch, rows_R)
        ce_Rs = self._frozen_ce(blank_media(sub), sums)
        labels_Bs = batch.labels_BS if self.context is None else self.context.local(batch.labels_BS)
        return torch.zeros(labels_Bs.shape, device=self.device).index_copy_(0, rows_R, ce_Rs)

    def _frozen_ce(self, batch: PackedBatch, sums: TokenWeightingSums) -> torch.Tensor:
        """Per-token CE of a forward that leaves training state alone (with a context shard: of
        this rank's chunk of the rows, the forward sharded as the training one). Its time ->
        sums.seconds."""
        t0 = time.perf_counter()
        c = self.context
        cp = {} if c is None else {"context": c}
        labels_BS = batch.labels_BS if c is None else c.local(batch.labels_BS)
        with torch.no_grad(), frozen_state(self.model, self.device), self.autocast():
            out = self.model(**batch.model_inputs(), compute_logits=not self.ce_chunk, **cp)
            if self.ce_chunk:  # the LM head chunk by chunk, as the training loss's
                ce_BS = head_ce(out.hidden_BSD, self.head_weight(), labels_BS, self.ce_chunk)[0]
        if not self.ce_chunk:
            ce_BS = token_losses(out.logits_BSV, labels_BS)
        if self.device.type == "cuda":  # the forward's GPU time, not its launch time
            torch.cuda.synchronize(self.device)
        sums.seconds += time.perf_counter() - t0
        return ce_BS

    def reweight(self, losses: TaskLosses, ce_blank_BS: torch.Tensor, batch: PackedBatch,
                 sums: TokenWeightingSums, totals: torch.Tensor | None = None) -> TaskLosses:
        """`losses` with the media tasks' tokens weighted by reliance (the sums to optimise). With a
        context shard, `batch` and the CEs are this rank's chunk. `totals`: the per-task means' sums
        over the global batch (`terms.reliance_sums`, reduced by the caller in a distributed run)."""
        labels_BS, task_BS = batch.labels_BS, batch.task_BS
        ce_real_BS = losses.ce_BS.detach()
        cfg, c = self.cfg, self.context
        w_BS = reliance_weights(ce_real_BS, ce_blank_BS, labels_BS, task_BS, cfg.strength, cfg.floor, totals)
        stats = reliance_stats(ce_real_BS, ce_blank_BS, w_BS, labels_BS, task_BS)
        if c is not None:
            stats.update(self._group_top_decile(w_BS, labels_BS, task_BS))
        for key, value in stats.items():
            setattr(sums, key, getattr(sums, key) + value.double().to(ce_real_BS.device))  # read at step end
        return reweighted(losses, w_BS, labels_BS, task_BS)

    @torch.no_grad()
    def _group_top_decile(self, w_Bs: torch.Tensor, labels_Bs: torch.Tensor,
                          task_Bs: torch.Tensor) -> dict[str, torch.Tensor]:
        """top / top_n of `reliance_stats` over the whole rows of the cp / tp group: the chunks'
        weights and masks all-gathered (one small collective, its bytes counted with the K/V
        gathers), the group's top decile counted once, by its first rank (the step's sums add
        every rank's)."""
        c = self.context
        sel_Bs = media_tokens(labels_Bs, task_Bs)
        both_B2s1 = torch.stack([w_Bs * sel_Bs, sel_Bs.to(w_Bs.dtype)], 1)[..., None]
        whole_B2S1 = c.comm.gather_seq(both_B2s1)  # the chunks in rank order: the whole rows
        if c.comm.rank:
            return {"top": torch.zeros(()), "top_n": torch.zeros(())}
        w_T = whole_B2S1[:, 0, :, 0][whole_B2S1[:, 1, :, 0] > 0]
        k = math.ceil(w_T.numel() / 10)
        return {"top": w_T.topk(k).values.sum(), "top_n": torch.tensor(k)}

