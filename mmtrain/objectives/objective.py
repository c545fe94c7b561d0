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
the step was skipped. Every term but the task losses is an entry of the registry in loss_terms/
(its hooks run in the registry's order; the losses are added in it). The per-token CE comes from
the model's full logits (`loss.ce_chunk: 0`, the reference) or from the LM head applied chunk by
chunk to the final hidden states (`heads.py`, `chunked_ce.py`): no (B, S, V) tensor. Legend: B rows,
S sequence, V vocabulary, D width, N patches, L layers, C attention counts
(models/attention/counts.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mmtrain.callbacks import StepStats
from mmtrain.checks import check
from mmtrain.data_pipelines.batch import IGNORE_INDEX, TASK_NAMES, TEXT, PackedBatch
from mmtrain.models.attention.counts import ATTN_COUNTS
from mmtrain.objectives.balance import BalanceConfig, Balancer
from mmtrain.objectives.heads import ChunkedHead, FullHead, head_weight
from mmtrain.objectives.loss_terms import TERMS, MicroBatch, Reported
from mmtrain.objectives.loss_terms.visual_next import VisualNextConfig
from mmtrain.objectives.loss_terms.visual_ssl import VisualSSLConfig
from mmtrain.objectives.sums import Sums
from mmtrain.objectives.terms import TaskLosses, dummy_batch, head_grads, task_sums, weighted_total
from mmtrain.parallel.context_parallel import local_targets
from mmtrain.parallel.distributed import DistEnv, all_reduce

if TYPE_CHECKING:
    from mmtrain.run_config import RunConfig

__all__ = ["LossConfig", "Objective", "StepSums", "VisualNextConfig", "VisualSSLConfig"]


def _loss_post_init(self) -> None:
    check(self, "text", "image_text", "video_text", "z_loss", "ce_chunk", ge=0)


LossConfig = dataclasses.make_dataclass(
    "LossConfig",
    [("text", float, field(default=1.0)), ("image_text", float, field(default=1.0)),
     ("video_text", float, field(default=1.0)),
     ("z_loss", float, field(default=1e-4)),  # weight of mean(logsumexp(logits)^2) over trained tokens
     # tokens a chunk of the LM head + cross-entropy (chunked_ce.py: no (B, S, V) logits); 0: the
     # reference, full logits from the model's forward
     ("ce_chunk", int, field(default=0)),
     ("balancer", BalanceConfig, field(default_factory=BalanceConfig)),
     *[(name, cls.Config, field(default_factory=cls.Config)) for name, cls in TERMS.items() if cls.Config]],
    namespace={"__post_init__": _loss_post_init,
               "__doc__": "Per-modality loss weights (the base weights every balancer starts from or "
                          "multiplies), the balancer that adapts them, the head's chunking, and one "
                          "section per registered loss term (loss_terms/)."},
)
LossConfig.__module__ = __name__


def _per_task() -> dict[str, float]:
    return dict.fromkeys(TASK_NAMES, 0.0)


@dataclass
class _StepSumsBase(Sums):
    loss: float = 0.0  # the loop's: this rank's share of the loss, mean over micro-batches
    task_ce: dict[str, float] = field(default_factory=_per_task)  # CE summed over trained tokens
    task_tokens: dict[str, float] = field(default_factory=_per_task)  # trained tokens
    task_correct: dict[str, float] = field(default_factory=_per_task)  # argmax = label


@dataclass
class _StepSumsTail(Sums):
    tokens: float = 0.0  # real tokens
    visual: float = 0.0  # real visual tokens
    media: float = 0.0
    patches: float = 0.0
    wait_s: float = 0.0  # the loop's: waiting for the data
    nonfinite: float = 0.0  # the loop's: a non-finite loss or gradient norm
    time_up: float = 0.0  # the loop's: train.time_limit_min reached


StepSums = dataclasses.make_dataclass(
    "StepSums",
    [*[(f.name, f.type, f) for f in dataclasses.fields(_StepSumsBase)],
     *[(name, object, field(default_factory=cls.Sums)) for name, cls in TERMS.items() if cls.Sums],
     *[(f.name, f.type, f) for f in dataclasses.fields(_StepSumsTail)]],
    bases=(Sums,),
    namespace={"__doc__": "One step's sums over its micro-batches (this rank; `reduce` sums them over "
                          "ranks): the task sums, one field per registered term with `Sums`, counts. "
                          "The objective adds 0-dim float64 tensors (no host sync); `floats()` reads them."},
)
StepSums.__module__ = __name__


class Objective:
    """Every loss term of the run's config, over a model that may be wrapped (FSDP, DDP).

    Host syncs (each makes the host wait for the device's queue) on a training step's path. A plain
    step (task losses, MoE aux, z-loss; reference or chunked head; tests/mmtrain/test_objective.py
    pins it) has one: `end_step` reads the step's sums in one transfer (`Sums.floats`; distributed:
    the reduce's). The global counts of a distributed run stay a device tensor. What is left is
    in the optional terms, where a shape depends on the data:
      token weighting: `nonzero` (the rows to blank-forward), `take_rows`' masks (their media),
        `reliance_stats`' mask (the top-decile count `k`), the blank pass's CUDA sync (its timing);
      contrast: `nonzero`, `any`/`all` (the rows to copy), `mismatch_media`'s `.tolist()`s and mask
        (the swap is planned on the host), `document_gaps`' `unique`, mask and `bincount` (the
        number of documents);
      visual_ssl: `make_ssl_mask` draws on the host from `grid_thw_M3.cpu()`;
      GradNorm's head gradients: `float(count)` and the masks of each task's tokens.
    A log step adds the attention counts' read (`end_backward`). Outside: the loop's
    `float(loss)` per micro-batch and the step's skip decision (mmtrain/loop/trainer.py).
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, balancer: Balancer, *, env: DistEnv,
                 device: torch.device, raw_model: torch.nn.Module | None = None, dp_rank: int = 0,
                 cp_rank: int = 0, context=None, autocast: Callable = contextlib.nullcontext, pp: int = 1,
                 donors=None):
        self.cfg, self.model, self.raw_model = cfg, model, raw_model or model
        self.balancer, self.env, self.device, self.autocast = balancer, env, device, autocast
        self.dp_rank, self.cp_rank, self.context = dp_rank, cp_rank, context  # context: a CP shard
        self.terms = [cls(self) for cls in TERMS.values() if cls.enabled(cfg.loss)]
        self.step = 0  # optimizer steps done before the current one
        self.weights: dict[str, float] = {}
        self._head_g: dict[str, torch.Tensor] = {}  # GradNorm: LM-head gradient (V, D) per task
        self._attn: dict[int, torch.Tensor] | None = None  # per layer (C,) attention counts, log steps
        self.attn_stats: dict[int, dict] = {}  # per layer, latest log step: kept_frac, keys_per_token
        # ranks that read the same rows and compute the same tokens (pipeline stages; dist.pp): the
        # data's world is the rest, and a count all-reduced over the whole world counts each row pp times
        self.pp = pp
        self.donors = donors  # the contrast's donors over the data ranks (contrast_donors.py), or None

    @property
    def data_world(self) -> int:
        """Ranks holding distinct shares of the global batch's loss (the world without pipeline stages)."""
        return self.env.world_size // self.pp

    @property
    def token_weighting(self):
        """The token weighting's blank pass (None when off)."""
        return next((t.tw for t in self.terms if t.name == "token_weighting"), None)

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
        mb = self.prepare(batch, sums)
        cp = {"context": self.context} if self.context is not None else {}
        with self.autocast():
            mb.out = self.model(**mb.inputs, attn_stats=self._attn is not None,
                                compute_logits=not self.cfg.loss.ce_chunk, **mb.kwargs, **cp)
        return self.finish(mb)

    def prepare(self, batch: PackedBatch, sums: StepSums, share_of: PackedBatch | None = None,
                share_rows: range | None = None) -> MicroBatch:
        """The micro-batch before its forward: global counts, the terms' `before_forward` hooks.
        (A pipeline prepares every micro-batch of the step first: loop/pipeline_step.py.) `share_of`:
        the batch whose rows `share_rows` `batch` is (a pipeline's row split): the counts, so the task
        means, are that batch's, and the parts' losses add up to its loss."""
        world, inputs, whole = self.data_world, batch.model_inputs(), None
        if self.context is not None:
            whole, batch = batch, local_targets(batch, self.context)
        counted = batch if share_of is None else (
            share_of if self.context is None else local_targets(share_of, self.context))
        counts_T = self._global_counts(counted) if world > 1 or share_of is not None else None
        mb = MicroBatch(batch, inputs, sums, counts_T, whole=whole, share_of=share_of,
                        share_rows=share_rows, ref=None if share_of is None else share_of.model_inputs())
        for term in self.terms:
            term.before_forward(mb)
        self._row_counts(mb)
        return mb

    @property
    def replicas(self) -> int:
        """Ranks holding the same rows: a row's pipeline stages and its cp x tp chunks."""
        return self.pp * self.cfg.dist.cp * self.cfg.dist.tp

    def _row_counts(self, mb: MicroBatch) -> None:
        """The terms' whole-row divisors summed over the ranks holding distinct rows, in one
        all-reduce of float64 counts (exact): every rank holds the same terms, so joins it."""
        counts = {t.name: n for t in self.terms if (n := t.row_count(mb)) is not None}  # a count or a tuple
        if counts and self.env.distributed:
            flat = [n for c in counts.values() for n in (c if isinstance(c, tuple) else (c,))]
            n_T = all_reduce(torch.stack([torch.as_tensor(n, dtype=torch.float64, device=self.device)
                                          for n in flat]), self.env) / self.replicas
            it = iter(n_T)
            counts = {k: tuple(next(it) for _ in c) if isinstance(c, tuple) else next(it)
                      for k, c in counts.items()}
        mb.row_counts = counts

    def finish(self, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's loss from its forward's output `mb.out` (a ModelOutput)."""
        chunk, batch = self.cfg.loss.ce_chunk, mb.batch
        if mb.out.attn_stats:
            self.add_attention(mb.out.attn_stats)
        labels_BS = batch.labels_BS if mb.labels_BS is None else mb.labels_BS
        mb.head = (ChunkedHead(mb.out.hidden_BSD, head_weight(self.raw_model), labels_BS, chunk,
                               self.autocast) if chunk else FullHead(mb.out.logits_BSV, labels_BS))
        mb.losses, local_n = self._task_losses(mb)
        trained = mb.losses
        for term in self.terms:
            trained = term.reweight(mb, trained)
        loss = weighted_total(trained, self.weights)
        if self.needs_head_grads:
            self._add_head_grads(mb)
        for term in self.terms:
            add = term.loss(mb)
            for part in add if isinstance(add, list) else [] if add is None else [add]:
                loss = loss + part
        self._count(batch, mb.losses, local_n, sums=mb.sums)
        return loss

    def _task_losses(self, mb: MicroBatch) -> tuple[TaskLosses, dict[str, torch.Tensor]]:
        """-> the batch's own rows' task sums, and their local trained-token counts. In a distributed
        run the sums' counts (the means' divisors) are the global ones: the same sums one process
        would form over the global micro-batch."""
        labels_BS = mb.batch.labels_BS
        ce_BS, hit_BS = mb.head.ce(0, mb.rows)
        losses = task_sums(ce_BS, hit_BS, labels_BS, mb.batch.task_BS)
        local_n = losses.count
        if mb.counts_T is not None:
            losses = dataclasses.replace(losses, count=dict(zip(TASK_NAMES, mb.counts_T.long())))
        return losses, local_n

    @property
    def measures_attention(self) -> bool:
        """This step counts what attention visits (a log step, whole rows: no cp / tp shard)."""
        return self._attn is not None

    def add_attention(self, attn_stats: dict) -> None:
        """A forward's per-layer counts (attention/counts.py) into the step's; a pipeline stage adds
        those of its own layers (loop/pipeline_step.py)."""
        for layer, st in attn_stats.items():
            row_C = torch.stack([st[k].double() for k in ATTN_COUNTS])
            self._attn[layer] = self._attn.get(layer, 0) + row_C

    def _global_counts(self, batch: PackedBatch) -> torch.Tensor:
        """(tasks + 1,) float64: trained tokens per task (and in all) on every rank, known before the
        forward. A device tensor: no host sync (token weighting reads it only without media rows)."""
        counts = torch.stack([((batch.labels_BS != IGNORE_INDEX) & (batch.task_BS == t)).sum()
                              for t in range(len(TASK_NAMES))]).to(torch.float64)
        total = all_reduce(torch.cat([counts, counts.sum()[None]]), self.env)
        return total / self.pp if self.pp > 1 else total  # integers in float64: exact

    def _count(self, batch: PackedBatch, losses: TaskLosses, local_n: dict[str, torch.Tensor],
               sums: StepSums) -> None:
        """This micro-batch into the step's sums: 0-dim float64 device tensors, read at the step's end."""
        for t in TASK_NAMES:
            sums.task_ce[t] += losses.loss_sum[t].detach().double()
            sums.task_tokens[t] += local_n[t].double()
            sums.task_correct[t] += losses.correct[t].double()
        real_BS = batch.task_BS >= 0
        sums.tokens += real_BS.sum().double()
        sums.visual += (real_BS & (batch.modality_BS != TEXT)).sum().double()
        if self.cp_rank == 0:  # the media are whole on every rank of a cp group
            sums.media += batch.grid_thw_M3.shape[0]
            sums.patches += batch.patches_NP.shape[0]

    def _add_head_grads(self, mb: MicroBatch) -> None:
        """GradNorm: add this micro-batch's per-task LM-head gradients (of the unweighted task means)."""
        head = self.raw_model.decoder.lm_head
        weight_VD = (self.raw_model.decoder.embed if head is None else head).weight
        if hasattr(weight_VD, "full_tensor"):  # FSDP2 DTensor shard: gather it (every rank does)
            weight_VD = weight_VD.full_tensor()
        B, batch = mb.rows, mb.batch
        logits_BSV = mb.out.logits_BSV[:B].detach() if mb.out.logits_BSV is not None else None
        grads = head_grads(mb.out.hidden_BSD[:B].detach(), logits_BSV, batch.labels_BS, batch.task_BS,
                           weight_VD.detach(), mb.losses.count, self.cfg.loss.ce_chunk)
        accum = self.cfg.train.grad_accum
        for t, g_VD in grads.items():
            self._head_g[t] = self._head_g.get(t, 0) + g_VD / accum

    def end_backward(self) -> None:
        """A log step's attention counts, summed over micro-batches and ranks -> self.attn_stats.
        An (L, counts) table on every rank, zero where a rank holds no such layer (a pipeline stage
        counts only its own), so the all-reduce has one shape everywhere; the layers listed are
        those that counted a token."""
        if self._attn is None:  # not a log step (the same on every rank)
            return
        dec = self.raw_model.cfg.decoder
        local_LC = torch.zeros(dec.n_layers, len(ATTN_COUNTS), dtype=torch.float64, device=self.device)
        for i, row_C in self._attn.items():
            local_LC[i] = row_C
        total_LC = all_reduce(local_LC, self.env).cpu()
        self.attn_stats = {
            i: {"sparse": dec.is_sparse(i), "kept_frac": float(c[1] / max(float(c[2]), 1.0)),
                "keys_per_token": float(c[0] / max(float(c[3]), 1.0))}
            for i, c in enumerate(total_LC) if c[3] > 0}

    def end_step(self, total: StepSums, *, grad_norm: float, skipped: bool, started: float) -> StepStats:
        """The step's stats from the all-reduced sums; the balancer observes the step unless skipped."""
        total = total.floats()  # the step's one read of its sums (a no-op after a distributed reduce)
        world, n = self.env.world_size, total.task_tokens
        task_loss = {t: total.task_ce[t] / n[t] for t in TASK_NAMES if n[t]}
        task_acc = {t: total.task_correct[t] / n[t] for t in TASK_NAMES if n[t]}
        if not skipped:
            self._observe(task_loss)
        rep = Reported()
        for cls in TERMS.values():
            cls.report(self.cfg.loss, total, self.cfg.train.grad_accum, world, rep)
        return StepStats(
            loss=total.loss, task_loss=task_loss, task_acc=task_acc, grad_norm=grad_norm,
            tokens=int(total.tokens), data_wait_s=total.wait_s / world,
            step_s=time.perf_counter() - started, skipped=skipped, visual_tokens=int(total.visual),
            media=int(total.media), patches=int(total.patches), time_up=total.time_up > 0,
            task_tokens={t: int(n[t]) for t in TASK_NAMES}, terms=rep.terms,
            figures={k: v for k, v in rep.figures.items() if v})

    def _observe(self, task_loss: dict[str, float]) -> None:
        provide = {"task_loss": lambda: task_loss, "head_grad_norm": lambda: self._head_grad_norms(task_loss)}
        wanted = self.balancer.wants("step")
        if wanted:
            self.balancer.observe({s: provide[s]() for s in wanted}, self.step + 1)

    def _head_grad_norms(self, tasks) -> dict[str, float]:
        """Norms of this step's per-task LM-head gradients (`tasks`: those with tokens on any rank),
        summed over ranks first: a (3, V, D) all-reduce per step, GradNorm's distributed cost. Under
        dist.pp only the last stage's ranks formed any (the loss runs there): the other stages join
        with zeros, so every rank's balancer reads the same norms (the head's shape from the config:
        their stage holds neither head nor embedding)."""
        if self.env.distributed:
            dec = self.raw_model.decoder.cfg
            zeros_VD = torch.zeros(dec.vocab_size, dec.dim, device=self.device)
            stacked_TVD = torch.stack([self._head_g.get(t, zeros_VD) for t in TASK_NAMES])
            all_reduce(stacked_TVD, self.env)
            self._head_g = dict(zip(TASK_NAMES, stacked_TVD))
        return {t: float(self._head_g[t].norm()) for t in tasks if t in self._head_g}
