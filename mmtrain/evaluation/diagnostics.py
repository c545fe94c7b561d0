"""Collapse diagnostics: measured every `every` steps on the first `batches` held-out batches.

    result = run_diagnostics(model, val_batches, device, DiagConfig(...), step, reduce_fn=all_reduce_)
    result.alarms(), result.scalars(), result.to_dict()      # diagnostics_report.py

Per batch: forwards with real media (q/k captured in every layer), blanked and (`mismatch`) swapped
media (mismatch.mismatch_media) for the gaps; attention statistics on <= `max_rows` text rows with each
layer's mask (models.attention.stats); expert load, router entropy, effective ranks of the visual
embeddings; the pointing game (pointing.py) and the default map's knockout faithfulness
(knockout.py) on `grounding`; the ViT's linear probe (probe.py) on `probe`. All is one flat
float64 sum vector: one `reduce_fn` combines ranks exactly; every rank must pass as many batches
(the forwards are collective).
`model` is called as is (DDP/FSDP or not; config from `raw_model`); one batch's q/k of all layers are held.

Legend: B rows, S tokens, D decoder dim, E routed experts, L decoder layers, M media, Q merged
visual tokens, H heads, R text rows.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    MEDIA_TASKS,
    TASK_NAMES,
    TEXT,
    VIDEO,
    PackedBatch,
)
from mmtrain.evaluation.diagnostics_report import DiagConfig, DiagResult
from mmtrain.evaluation.knockout import grounding_faithfulness
from mmtrain.evaluation.pointing import GroundingDoc, pointing_scores
from mmtrain.evaluation.probe import ProbeMedium, probe_scores
from mmtrain.frozen import frozen_state
from mmtrain.models.attention import AttentionConfig, build_meta, even_subset, row_stats, text_rows
from mmtrain.objectives.mismatch import mismatch_media
from mmtrain.objectives.terms import blank_media, task_losses

Tensor = torch.Tensor
MEDIA_KINDS = {IMAGE: "image", VIDEO: "video"}
ATTN_STATS = ("mass", "entropy", "sink")
RECOMPUTE_CHUNK = 64  # rows recomputed at once: memory H x 64 x S floats
__all__ = ["DiagConfig", "DiagResult", "effective_rank", "run_diagnostics"]


class _Sums:
    """Named float64 accumulators, views into one flat vector (one in-place reduce for all)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        sizes = [math.prod(s) for s in shapes.values()]
        self.flat = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
        starts = itertools.accumulate([0, *sizes])
        self.parts = {k: self.flat[a:a + n].view(s) for (k, s), a, n in zip(shapes.items(), starts, sizes)}

    def __getitem__(self, name: str) -> Tensor:
        return self.parts[name]


@dataclass
class _Layout:
    """What the raw model's config decides: layers to capture, MoE layers, widths."""

    n_layers: int
    sparse: list[bool]
    attn_cfg: AttentionConfig
    moe_experts: dict[int, list[int]]  # MoE layer -> expert group per routed expert
    moe_groups: dict[int, bool]  # MoE layer -> modality groups on
    dim: int

    @classmethod
    def of(cls, raw_model: nn.Module) -> _Layout:
        dec = raw_model.cfg.decoder
        moes = raw_model.moe_layers()
        return cls(dec.n_layers, [dec.is_sparse(i) for i in range(dec.n_layers)], dec.attention,
                   {i: m.cfg.expert_group_E() for i, m in moes.items()},
                   {i: m.cfg.modality_groups for i, m in moes.items()}, dec.dim)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        # real sum, blank sum, tokens; on the swapped documents' tokens: real sum, mismatch sum, tokens
        out = {"loss": (len(MEDIA_TASKS), 6),
               "attn": (self.n_layers, len(MEDIA_TASKS), len(ATTN_STATS) + 1),  # + rows
               "gram": (len(MEDIA_KINDS), self.dim, self.dim), "vsum": (len(MEDIA_KINDS), self.dim),
               "media": (len(MEDIA_KINDS),), "vnorm": (len(MEDIA_KINDS), 2)}  # token norm sum, tokens
        for layer, groups in self.moe_experts.items():
            out[f"load_{layer}"] = (3, len(groups))
            out[f"rent_{layer}"] = (3, 2)  # entropy x tokens, tokens
        return out

    def allowed_3E(self, layer: int) -> Tensor:
        """Experts each modality may route to (with modality groups: text -> group 0, visual -> 1)."""
        group_E = torch.tensor(self.moe_experts[layer])
        if not self.moe_groups[layer]:
            return torch.ones(3, len(group_E), dtype=torch.bool)
        return torch.stack([group_E == (m != TEXT) for m in range(3)])


@torch.no_grad()
def run_diagnostics(model: nn.Module, batches: Iterable[PackedBatch], device: torch.device | str,
                    cfg: DiagConfig, step: int,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                    reduce_fn: Callable[[Tensor], None] | None = None, raw_model: nn.Module | None = None,
                    grounding: list[GroundingDoc] | None = None,
                    probe: list[ProbeMedium] | None = None) -> DiagResult:
    """Collapse signals on the first cfg.batches of `batches`; training state is left untouched
    (eval mode inside, module modes and CPU/CUDA RNG restored after, no MoE load accumulated).

    reduce_fn: sums a float64 1-D tensor across data-parallel ranks in place (called once).
    grounding: documents with boxes for the pointing game (`pointing.grounding_docs`), the same on
    every rank (so no reduction). probe: val images with boxes for the ViT's linear probe
    (`probe.probe_media`), likewise the same on every rank."""
    device = torch.device(device)
    raw = raw_model if raw_model is not None else getattr(model, "module", model)
    layout = _Layout.of(raw)
    sums = _Sums(layout.shapes(), device)
    n_batches, pointing, probed, faith = 0, {}, {}, {}
    clock = _Clock(device)
    with frozen_state(model, device):
        for batch in itertools.islice(batches, cfg.batches):
            _diagnose_batch(model, batch.to(device), layout, sums, cfg, autocast, clock)
            n_batches += 1
        if grounding:
            with clock("pointing"):
                pointing = pointing_scores(model, grounding, device, raw.cfg, autocast)
        if probe:
            with clock("probe"):
                probed = probe_scores(model, probe, device, raw, autocast)
        if grounding and cfg.faithfulness_words:  # the same documents and rows on every rank
            with clock("faithfulness"):
                faith = grounding_faithfulness(raw, grounding, device, cfg.faithfulness_words,
                                               cfg.faithfulness_draws, seed=step)
    if reduce_fn is not None:
        reduce_fn(sums.flat)
    result = _result(sums, layout, step, n_batches, cfg)
    result.pointing, result.probe, result.faithfulness = pointing, probed, faith
    result.seconds = clock.seconds | {"total": clock.since_start()}
    return result


class _Clock:
    """Wall seconds per named pass, summed (CUDA synchronised at both ends, so queued kernels count
    for the pass that launched them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.start = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def since_start(self) -> float:
        return self._now() - self.start

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = self._now()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + self._now() - start


def _diagnose_batch(model: nn.Module, batch: PackedBatch, layout: _Layout, sums: _Sums, cfg: DiagConfig,
                    autocast: Callable[[], contextlib.AbstractContextManager], clock: _Clock) -> None:
    if cfg.mismatch:  # computed first: the real pass also sums its loss on the swapped documents
        mismatched, swapped_BS = mismatch_media(batch)
        swapped_labels_BS = batch.labels_BS.masked_fill(~swapped_BS, IGNORE_INDEX)
    with clock("real"):
        with autocast():
            out = model(**batch.model_inputs(), capture_layers=list(range(layout.n_layers)))
        _add_losses(sums, batch.labels_BS, batch.task_BS, out.logits_BSV, col=0, count_col=2)
        if cfg.mismatch:
            _add_losses(sums, swapped_labels_BS, batch.task_BS, out.logits_BSV, col=3, count_col=5)
    with clock("stats"):
        _add_attention(sums, batch, out.captures, layout, cfg.max_rows)
        _add_experts(sums, out.expert_load, out.router_entropy)
        _add_embeddings(sums, batch, out.visual_embeds_ND)
    del out  # the captures of every layer: free them before the second forward
    with clock("blank"):
        with autocast():
            out = model(**blank_media(batch).model_inputs())
        _add_losses(sums, batch.labels_BS, batch.task_BS, out.logits_BSV, col=1)
    del out
    if cfg.mismatch:  # every batch, even with nothing swapped: the forwards are collective
        with clock("mismatch"):
            with autocast():
                out = model(**mismatched.model_inputs())
            _add_losses(sums, swapped_labels_BS, batch.task_BS, out.logits_BSV, col=4)


def _add_losses(sums: _Sums, labels_BS: Tensor, task_BS: Tensor, logits_BSV: Tensor, col: int,
                count_col: int | None = None) -> None:
    losses = task_losses(logits_BSV, labels_BS, task_BS)
    for j, task in enumerate(MEDIA_TASKS):
        sums["loss"][j, col] += losses.loss_sum[task].double()
        if count_col is not None:
            sums["loss"][j, count_col] += losses.count[task].double()


def _add_attention(sums: _Sums, batch: PackedBatch, captures: dict[int, dict], layout: _Layout,
                   max_rows: int) -> None:
    task_ids = torch.tensor([TASK_NAMES.index(t) for t in MEDIA_TASKS], dtype=batch.task_BS.dtype,
                            device=batch.task_BS.device)
    text_BS = (batch.modality_BS == TEXT) & batch.loss_mask_BS & torch.isin(batch.task_BS, task_ids)
    rows_R2 = text_rows(batch.modality_BS, batch.doc_ids_BS, text_BS)
    if rows_R2.shape[0] == 0:
        return
    rows_R2 = rows_R2[even_subset(rows_R2.shape[0], max_rows, rows_R2.device)]
    task_R = batch.task_BS[rows_R2[:, 0], rows_R2[:, 1]]
    meta = build_meta(batch.doc_ids_BS, batch.span_ids_BS, layout.attn_cfg.block_size)
    for layer in range(layout.n_layers):
        s = row_stats(captures[layer], meta, layout.attn_cfg, layout.sparse[layer], rows_R2,
                      batch.modality_BS, batch.doc_ids_BS, RECOMPUTE_CHUNK)
        per_row_4R = torch.stack([s.mass_HR.mean(0), s.entropy_HR.mean(0), s.sink_HR.mean(0),
                                  torch.ones_like(s.mass_HR[0])]).double()
        for j, task_id in enumerate(task_ids.tolist()):
            sums["attn"][layer, j] += per_row_4R[:, task_R == task_id].sum(1)


def _add_experts(sums: _Sums, load: dict[int, Tensor] | None, entropy: dict[int, Tensor] | None) -> None:
    for layer, load_3E in (load or {}).items():
        tokens_3 = load_3E.sum(1).double()  # top_k x tokens: the same weights as tokens
        sums[f"load_{layer}"].add_(load_3E.double())
        sums[f"rent_{layer}"].add_(torch.stack([entropy[layer].double() * tokens_3, tokens_3], 1))


def _add_embeddings(sums: _Sums, batch: PackedBatch, visual_QD: Tensor) -> None:
    M = batch.media_kind_M.shape[0]
    if M == 0:
        return
    medium_Q = batch.media_ids_BS[batch.modality_BS != TEXT].long()  # placeholder order = encoder order
    pooled_MD = torch.zeros(M, visual_QD.shape[1], dtype=torch.float64, device=visual_QD.device)
    pooled_MD.index_add_(0, medium_Q, visual_QD.double())
    pooled_MD /= torch.bincount(medium_Q, minlength=M).clamp(min=1)[:, None]
    kind_Q, norm_Q = batch.media_kind_M[medium_Q], visual_QD.double().norm(dim=-1)
    for k, kind in enumerate(MEDIA_KINDS):
        on_Q = kind_Q == kind
        sums["vnorm"][k] += torch.stack([norm_Q[on_Q].sum(), on_Q.sum().double()])
        x_KD = pooled_MD[batch.media_kind_M == kind]
        sums["gram"][k] += x_KD.T @ x_KD
        sums["vsum"][k] += x_KD.sum(0)
        sums["media"][k] += x_KD.shape[0]


def effective_rank(gram_DD: Tensor, scale: float | None = None) -> float:
    """exp(entropy of the normalised singular values) of X, from its Gram matrix X^T X.

    Eigenvalues within rounding (of the Gram's dtype) of `scale` count as 0: default the largest
    eigenvalue; pass the uncentred one for a centred Gram, whose cancellation leaves noise that big."""
    eps = torch.finfo(gram_DD.dtype).eps
    eig_D = torch.linalg.eigvalsh(gram_DD.double())
    top = float(eig_D.max()) if scale is None else scale
    eig_D = torch.where(eig_D > top * eig_D.shape[0] * eps, eig_D, 0.0)
    sigma_D = eig_D.sqrt()
    if float(sigma_D.sum()) == 0:
        return 0.0
    return float(torch.exp(torch.special.entr(sigma_D / sigma_D.sum()).sum()))


def _result(sums: _Sums, layout: _Layout, step: int, n_batches: int, cfg: DiagConfig) -> DiagResult:
    loss_T6 = sums["loss"].cpu()
    present = [(j, t) for j, t in enumerate(MEDIA_TASKS) if loss_T6[j, 2] > 0]
    loss = {t: float(loss_T6[j, 0] / loss_T6[j, 2]) for j, t in present}
    blank = {t: float(loss_T6[j, 1] / loss_T6[j, 2]) for j, t in present}
    tokens = {t: int(loss_T6[j, 2]) for j, t in present}
    swapped = [(j, t) for j, t in enumerate(MEDIA_TASKS) if loss_T6[j, 5] > 0]
    attn_LT4 = sums["attn"].cpu()
    attention, rows = {}, {}
    for j, task in present:
        n_L = attn_LT4[:, j, -1]
        attention[task] = {stat: [float(a / n) if n > 0 else None for a, n in zip(attn_LT4[:, j, s], n_L)]
                           for s, stat in enumerate(ATTN_STATS)}
        rows[task] = int(n_L[0])
    load, ratio, per_expert, entropy = {}, {}, {}, {}
    for layer in layout.moe_experts:
        load[layer], ratio[layer], per_expert[layer] = _expert_load(sums[f"load_{layer}"].cpu(),
                                                                    layout.allowed_3E(layer))
        ent_32 = sums[f"rent_{layer}"].cpu()
        entropy[layer] = [float(e / n) if n > 0 else None for e, n in ent_32.tolist()]
    counts = sums["media"].tolist()
    media = {name: int(n) for name, n in zip(MEDIA_KINDS.values(), counts) if n > 0}
    ranks, centred = {}, {}
    for k, name in enumerate(MEDIA_KINDS.values()):
        if name in media:
            ranks[name], centred[name] = _ranks(sums["gram"][k], sums["vsum"][k], media[name])
    return DiagResult(step, loss, blank, tokens, attention, rows, load, ratio, per_expert, entropy, ranks,
                      centred, media, n_batches, cfg,
                      mismatch_loss={t: float(loss_T6[j, 4] / loss_T6[j, 5]) for j, t in swapped},
                      mismatch_real_loss={t: float(loss_T6[j, 3] / loss_T6[j, 5]) for j, t in swapped},
                      mismatch_tokens={t: int(loss_T6[j, 5]) for j, t in swapped},
                      visual_norm=_visual_norm(sums["vnorm"].cpu()))


def _visual_norm(vnorm_K2: Tensor) -> dict[str, float]:
    """Per media kind present: the mean L2 norm of its visual tokens."""
    return {name: float(s / n) for name, (s, n) in zip(MEDIA_KINDS.values(), vnorm_K2.tolist()) if n > 0}


def _ranks(gram_DD: Tensor, sum_D: Tensor, n: int) -> tuple[float | None, float | None]:
    """Uncentred and centred effective rank of n embeddings from their Gram matrix and sum."""
    if n < 2:
        return None, None
    centred_DD = gram_DD - torch.outer(sum_D, sum_D) / n  # sum over media of (x - mean)(x - mean)^T
    scale = float(torch.linalg.eigvalsh(gram_DD).max())
    return effective_rank(gram_DD, scale), effective_rank(centred_DD, scale)


def _expert_load(load_3E: Tensor, allowed_3E: Tensor) -> tuple[Tensor, list[float | None], list[float]]:
    """-> shares (3, E), max / mean over the experts each modality may use, mean load of those."""
    total_3 = load_3E.sum(1)
    share_3E = load_3E / total_3.clamp(min=1)[:, None]
    ratio, mean = [], []
    for m in range(3):
        allowed = load_3E[m][allowed_3E[m]]
        ratio.append(float(allowed.max() / allowed.mean()) if total_3[m] > 0 else None)
        mean.append(float(allowed.mean()))
    return share_3E, ratio, mean
