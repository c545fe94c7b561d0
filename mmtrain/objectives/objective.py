"""The objective: the forward of each micro-batch, every loss term, and what the step did.

    sums = objective.begin_step(step)        # a fresh StepSums; the balancer's weights for the step
    loss = objective.micro_batch(batch, sums)  # this rank's share of the micro-batch's loss
    ... the loop: on_loss, backward of loss * world / grad_accum, sums.loss ...
    objective.end_backward()                 # a log step's attention counts, summed over ranks
    stats = objective.end_step(sums.reduce(env, device), grad_norm=..., skipped=..., started=...)

A micro-batch's loss = sum over tasks of weight * (CE summed over the task's trained tokens here,
token-weighted on the media tasks with loss.token_weighting) / (the task's trained tokens on ALL
ranks) + the model's aux terms (MoE balance, router z) / world + visual_ssl.weight * masked-patch
MSE / world + visual_next.weight * next-visual-token pixel MSE / world + contrast.weight * the
mismatch contrast's hinge / world (contrast.py: swapped-media copies of the media rows, appended to
the forward) + z_loss * mean lse^2 (scaled to this rank's share of trained tokens): the ranks' shares
add up to the loss of one process holding the whole global batch. `end_step` hands the balancer the
step signals it declares (task_loss, head_grad_norm: GradNorm's closed-form LM-head gradients) unless
the step was skipped. Legend: B rows, S sequence, V vocabulary, D width, N patches, L layers, C
attention counts (models/attention/counts.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import StepStats
from mmtrain.checks import check
from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_NAMES, TEXT, PackedBatch
from mmtrain.models.attention.counts import ATTN_COUNTS
from mmtrain.models.vision import make_ssl_mask
from mmtrain.models.visual_next import chunk_pairs
from mmtrain.objectives.balance import BalanceConfig, Balancer
from mmtrain.objectives.contrast import ContrastConfig, ContrastSums, contrast_term, extend
from mmtrain.objectives.sums import Sums
from mmtrain.objectives.terms import (
    TaskLosses,
    dummy_batch,
    head_grads,
    task_losses,
    visual_next_loss,
    weighted_total,
    z_loss,
)
from mmtrain.objectives.token_weighting import TokenWeighting, TokenWeightingConfig, TokenWeightingSums
from mmtrain.parallel.context_parallel import local_targets
from mmtrain.parallel.distributed import DistEnv, all_reduce

if TYPE_CHECKING:
    from mmtrain.run_config import RunConfig


@dataclass
class VisualSSLConfig:
    """Masked-patch reconstruction in the vision encoder (needs model.vision.ssl_head: true): a second
    encoder pass over `media_share` of each batch's media with `mask_ratio` of their patches hidden."""

    weight: float = 0.0  # 0: off
    mask_ratio: float = 0.5
    media_share: float = 0.25

    def __post_init__(self):
        check(self, "weight", ge=0)
        check(self, "mask_ratio", gt=0, lt=1)
        check(self, "media_share", gt=0, le=1)


@dataclass
class VisualNextConfig:
    """Next visual token prediction on the decoder's visual positions (needs model.visual_head: true;
    models/visual_next.py): each visual token regresses the pixels of the next merged token of its
    medium from the decoder's final hidden state, so every medium gives targets that only its pixels
    can meet, whatever its caption says."""

    weight: float = 0.0  # 0: off
    normalize: bool = True  # each target token to mean 0 / variance 1 over its values (as MAE)

    def __post_init__(self):
        check(self, "weight", ge=0)


@dataclass
class LossConfig:
    """Per-modality loss weights (the base weights every balancer starts from or multiplies), the
    balancer that adapts them, and the extra terms."""

    text: float = 1.0
    image_text: float = 1.0
    video_text: float = 1.0
    z_loss: float = 1e-4  # weight of mean(logsumexp(logits)^2) over trained tokens
    balancer: BalanceConfig = field(default_factory=BalanceConfig)
    visual_ssl: VisualSSLConfig = field(default_factory=VisualSSLConfig)
    contrast: ContrastConfig = field(default_factory=ContrastConfig)
    visual_next: VisualNextConfig = field(default_factory=VisualNextConfig)
    token_weighting: TokenWeightingConfig = field(default_factory=TokenWeightingConfig)

    def __post_init__(self):
        check(self, "text", "image_text", "video_text", "z_loss", ge=0)


def _per_task() -> dict[str, float]:
    return dict.fromkeys(TASK_NAMES, 0.0)


@dataclass
class StepSums(Sums):
    """One step's sums over its micro-batches (this rank; `reduce` sums them over ranks)."""

    loss: float = 0.0  # the loop's: this rank's share of the loss, mean over micro-batches
    task_ce: dict[str, float] = field(default_factory=_per_task)  # CE summed over trained tokens
    task_tokens: dict[str, float] = field(default_factory=_per_task)  # trained tokens
    task_correct: dict[str, float] = field(default_factory=_per_task)  # argmax = label
    visual_ssl: float = 0.0  # masked-patch loss, summed over micro-batches
    visual_next: float = 0.0  # next-visual-token pixel loss, summed over micro-batches
    tokens: float = 0.0  # real tokens
    visual: float = 0.0  # real visual tokens
    media: float = 0.0
    patches: float = 0.0
    token_weighting: TokenWeightingSums = field(default_factory=TokenWeightingSums)
    contrast: ContrastSums = field(default_factory=ContrastSums)
    wait_s: float = 0.0  # the loop's: waiting for the data
    nonfinite: float = 0.0  # the loop's: a non-finite loss or gradient norm
    time_up: float = 0.0  # the loop's: train.time_limit_min reached


class Objective:
    """Every loss term of the run's config, over a model that may be wrapped (FSDP, DDP)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, balancer: Balancer, *, env: DistEnv,
                 device: torch.device, raw_model: torch.nn.Module | None = None, dp_rank: int = 0,
                 cp_rank: int = 0, context=None, autocast: Callable = contextlib.nullcontext):
        self.cfg, self.model, self.raw_model = cfg, model, raw_model or model
        self.balancer, self.env, self.device, self.autocast = balancer, env, device, autocast
        self.dp_rank, self.cp_rank, self.context = dp_rank, cp_rank, context  # context: a CP shard
        tw = cfg.loss.token_weighting
        self.token_weighting = TokenWeighting(tw, model, device, autocast, self.pad_batch,
                                              cfg.dist.strategy == "fsdp") if tw.strength else None
        self.step = 0  # optimizer steps done before the current one
        self.weights: dict[str, float] = {}
        self._head_g: dict[str, torch.Tensor] = {}  # GradNorm: LM-head gradient (V, D) per task
        self._attn: dict[int, torch.Tensor] | None = None  # per layer (C,) attention counts, log steps
        self.attn_stats: dict[int, dict] = {}  # per layer, latest log step: kept_frac, keys_per_token

    def pad_batch(self) -> PackedBatch:
        """A batch that adds nothing to any sum (a rank without media joins the others' forward)."""
        return dummy_batch(self.cfg.data.seq_len, self.cfg.model.vision.patch_dim)

    @property
    def needs_head_grads(self) -> bool:
        return "head_grad_norm" in self.balancer.signals

    def begin_step(self, step: int) -> StepSums:
        """Before the first micro-batch of the step after `step` done."""
        self.step, self.weights, self._head_g = step, self.balancer.weights(), {}
        log_step = (step + 1) % self.cfg.train.log_every == 0  # the layers count what they attended
        self._attn = {} if log_step and self.context is None else None  # (counts need whole rows)
        return StepSums()

    def micro_batch(self, batch: PackedBatch, sums: StepSums) -> torch.Tensor:
        """Forward one micro-batch; -> this rank's share of its loss (the whole loss in one process).
        Under context parallelism the model reads whole rows and predicts this rank's chunk of
        them: `batch` holds the chunk's targets from here on."""
        world, inputs, cp = self.env.world_size, batch.model_inputs(), {}
        if self.context is not None:
            batch, cp = local_targets(batch, self.context), {"context": self.context}
        counts = self._global_counts(batch) if world > 1 else None
        ssl_cfg, contrast = self.cfg.loss.visual_ssl, self.cfg.loss.contrast
        ssl_mask = self._ssl_mask(batch) if ssl_cfg.weight else None
        next_cfg = self.cfg.loss.visual_next
        # token weighting: the blank forward first, so its activations are gone before the graph's
        tw = self.token_weighting
        ce_blank_BS = tw.blank_ce(batch, counts, sums.token_weighting) if tw else None
        extra = None
        if contrast.weight:  # the swapped-media copies ride in the same forward as extra rows
            extended, extra = extend(batch)
            if extra is not None:
                inputs = extended.model_inputs()
                if ssl_mask is not None:  # the copies' patches are never masked
                    ssl_mask = torch.cat([ssl_mask, ssl_mask.new_zeros(extended.patches_NP.shape[0]
                                                                       - ssl_mask.shape[0])])
        with self.autocast():
            out = self.model(**inputs, ssl_mask_N=ssl_mask, attn_stats=self._attn is not None,
                             visual_next=next_cfg.weight > 0, **cp)
        for layer, st in out.attn_stats.items():
            row_C = torch.stack([st[k].double() for k in ATTN_COUNTS])
            self._attn[layer] = self._attn.get(layer, 0) + row_C
        B = batch.labels_BS.shape[0]
        logits_BSV, hidden_BSD = out.logits_BSV[:B], out.hidden_BSD[:B]
        losses = task_losses(logits_BSV, batch.labels_BS, batch.task_BS)
        local_n = [int(losses.count[t]) for t in TASK_NAMES]
        if counts is not None:  # the same sum as one process would form over the global micro-batch
            losses.count = {t: torch.tensor(int(counts[i]), device=self.device)
                            for i, t in enumerate(TASK_NAMES)}
        trained = losses if tw is None or ce_blank_BS is None else (
            tw.reweight(losses, ce_blank_BS, batch, sums.token_weighting))
        loss = weighted_total(trained, self.weights)
        if self.needs_head_grads:
            self._add_head_grads(hidden_BSD, logits_BSV, batch, losses.count)
        for aux in out.aux_losses.values():  # MoE balance and router z-loss: means over rows/tokens
            loss = loss + (aux / world if world > 1 else aux)
        if out.visual_ssl is not None:  # a mean per rank: gradients average it over ranks
            loss = loss + ssl_cfg.weight * out.visual_ssl / world
            sums.visual_ssl += float(out.visual_ssl.detach())
        if out.visual_next_KT is not None:  # the same: a mean over this rank's predicted tokens
            # (the forward's media: with the contrast, the copies' too)
            vn = self._visual_next(out.visual_next_KT, inputs)
            loss = loss + next_cfg.weight * vn / world
            sums.visual_next += float(vn.detach())
        if extra is not None:  # a mean per rank, as visual_ssl
            term = contrast_term(losses.ce_BS, out.logits_BSV[B:], extended.labels_BS[B:], extra,
                                 contrast.margin, sums.contrast)
            loss = loss + contrast.weight * term / world
        if self.cfg.loss.z_loss:
            z = z_loss(logits_BSV, batch.labels_BS)
            if counts is not None:
                z = z * (batch.loss_mask_BS.sum() / max(counts[-1], 1.0))
            loss = loss + self.cfg.loss.z_loss * z
        self._count(batch, losses, local_n, sums)
        return loss

    def _global_counts(self, batch: PackedBatch) -> list[float]:
        """Trained tokens per task (and in all) on every rank, known before the forward."""
        counts = torch.stack([((batch.labels_BS != IGNORE_INDEX) & (batch.task_BS == t)).sum()
                              for t in range(len(TASK_NAMES))]).to(torch.float64)
        return all_reduce(torch.cat([counts, counts.sum()[None]]), self.env).tolist()

    def _count(self, batch: PackedBatch, losses: TaskLosses, local_n: list[int], sums: StepSums) -> None:
        for t, n in zip(TASK_NAMES, local_n):
            sums.task_ce[t] += float(losses.loss_sum[t].detach())
            sums.task_tokens[t] += n
            sums.task_correct[t] += float(losses.correct[t])
        real_BS = batch.task_BS >= 0
        sums.tokens += batch.num_tokens()
        sums.visual += int((real_BS & (batch.modality_BS != TEXT)).sum())
        if self.cp_rank == 0:  # the media are whole on every rank of a cp group
            sums.media += batch.grid_thw_M3.shape[0]
            sums.patches += batch.patches_NP.shape[0]

    def _visual_next(self, pred_KT: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The visual next-token term of this rank. Context parallelism: its chunk's squared errors
        over the group's count, times the group size -- so that the group's terms over `world` add
        up to the rows' mean over data-parallel ranks, as a mean per rank does without it."""
        merge, c = self.cfg.model.vision.merge, self.context
        keep_K = None if c is None else chunk_pairs(inputs["modality_BS"], inputs["grid_thw_M3"], merge,
                                                    c.lo, c.hi)[2]
        vn = visual_next_loss(pred_KT, inputs["patches_NP"], inputs["grid_thw_M3"], merge,
                              self.cfg.loss.visual_next.normalize, keep_K)
        return vn if c is None else vn * c.comm.size

    def _ssl_mask(self, batch: PackedBatch) -> torch.Tensor:
        """Which patches the masked-patch term hides: a pure function of (seed, step, data-parallel
        rank, batch), so the ranks of a cp group, which encode the same media, hide the same ones."""
        cfg = self.cfg.loss.visual_ssl
        gen = torch.Generator().manual_seed(hash((self.cfg.train.seed, self.step, self.dp_rank,
                                                  batch.patches_NP.shape[0])) % 2**63)
        mask_N = make_ssl_mask(batch.grid_thw_M3.cpu(), cfg.mask_ratio, cfg.media_share, gen)
        return mask_N.to(self.device)

    def _add_head_grads(self, hidden_BSD: torch.Tensor, logits_BSV: torch.Tensor, batch: PackedBatch,
                        counts: dict[str, torch.Tensor]) -> None:
        """GradNorm: add this micro-batch's per-task LM-head gradients (of the unweighted task means)."""
        head = self.raw_model.decoder.lm_head
        weight_VD = (self.raw_model.decoder.embed if head is None else head).weight
        if hasattr(weight_VD, "full_tensor"):  # FSDP2 DTensor shard: gather it (every rank does)
            weight_VD = weight_VD.full_tensor()
        grads = head_grads(hidden_BSD.detach(), logits_BSV.detach(), batch.labels_BS, batch.task_BS,
                           weight_VD.detach(), counts)
        accum = self.cfg.train.grad_accum
        for t, g_VD in grads.items():
            self._head_g[t] = self._head_g.get(t, 0) + g_VD / accum

    def end_backward(self) -> None:
        """A log step's attention counts, summed over micro-batches and ranks -> self.attn_stats."""
        layers = sorted(self._attn or {})
        if not layers:
            return
        total_LC = all_reduce(torch.stack([self._attn[i] for i in layers]), self.env).cpu()
        sparse = self.raw_model.cfg.decoder.is_sparse
        self.attn_stats = {
            i: {"sparse": sparse(i), "kept_frac": float(c[1] / max(float(c[2]), 1.0)),
                "keys_per_token": float(c[0] / max(float(c[3]), 1.0))} for i, c in zip(layers, total_LC)}

    def end_step(self, total: StepSums, *, grad_norm: float, skipped: bool, started: float) -> StepStats:
        """The step's stats from the all-reduced sums; the balancer observes the step unless skipped."""
        world, n = self.env.world_size, total.task_tokens
        task_loss = {t: total.task_ce[t] / n[t] for t in TASK_NAMES if n[t]}
        task_acc = {t: total.task_correct[t] / n[t] for t in TASK_NAMES if n[t]}
        if not skipped:
            self._observe(task_loss)
        accum = self.cfg.train.grad_accum
        ssl = total.visual_ssl / (accum * world) if self.cfg.loss.visual_ssl.weight else None
        nxt = total.visual_next / (accum * world) if self.cfg.loss.visual_next.weight else None
        tw = total.token_weighting.figures(world)
        terms = {"visual_ssl": ssl, "visual_next": nxt}
        if self.cfg.loss.contrast.weight:  # the step's mean hinge (before the weight)
            terms["contrast"] = total.contrast.term / (accum * world)
        figures = {"token_weighting": tw, "contrast_stats": total.contrast.figures()}
        return StepStats(
            loss=total.loss, task_loss=task_loss, task_acc=task_acc, grad_norm=grad_norm,
            tokens=int(total.tokens), data_wait_s=total.wait_s / world,
            step_s=time.perf_counter() - started, skipped=skipped, visual_tokens=int(total.visual),
            media=int(total.media), patches=int(total.patches), time_up=total.time_up > 0,
            task_tokens={t: int(n[t]) for t in TASK_NAMES}, terms=terms,
            figures={k: v for k, v in figures.items() if v})

    def _observe(self, task_loss: dict[str, float]) -> None:
        provide = {"task_loss": lambda: task_loss, "head_grad_norm": lambda: self._head_grad_norms(task_loss)}
        wanted = self.balancer.wants("step")
        if wanted:
            self.balancer.observe({s: provide[s]() for s in wanted}, self.step + 1)

    def _head_grad_norms(self, tasks) -> dict[str, float]:
        """Norms of this step's per-task LM-head gradients (`tasks`: those with tokens on any rank),
        summed over ranks first: a (3, V, D) all-reduce per step, GradNorm's distributed cost."""
        if self.env.distributed:
            zeros_VD = torch.zeros(self.raw_model.decoder.embed.weight.shape, device=self.device)
            stacked_TVD = torch.stack([self._head_g.get(t, zeros_VD) for t in TASK_NAMES])
            all_reduce(stacked_TVD, self.env)
            self._head_g = dict(zip(TASK_NAMES, stacked_TVD))
        return {t: float(self._head_g[t].norm()) for t in tasks if t in self._head_g}
