"""Collapse diagnostics: run every `every` steps on the first `batches` held-out batches.

Signals (docs: DESIGN "Objectives, balancing, diagnostics"):
  * reliance gap per media task: per-token loss with every medium blanked (evaluate.blank_media)
    minus the loss with the real media; near zero means the text ignores the pixels;
  * mismatch gap per media task (`mismatch`): per-token loss with each document's media swapped for
    another document's real media of the same kind and patch grid (evaluate.mismatch_media) minus the
    loss with its own, on the trained tokens of the documents that got a foreign medium. Blank media
    are out of distribution (a model can react to grey frames without reading real ones); swapped
    media are real inputs, so this gap measures how much the text depends on *which* medium it sees.
    A third forward per batch, run on every batch (the forwards are collective) even when a batch has
    nothing to swap; `DiagResult.seconds` has the wall time of each pass;
  * per layer, text->visual attention mass, attention entropy and sink mass of the text rows of each
    media task (recomputed from captured q, k with the layer's own mask: models.attention.stats, the
    same code as the attention-map tool);
  * per MoE layer, the expert load per modality (share of that modality's routed tokens) and the
    router entropy per modality;
  * the pointing game of caption words on val images/videos with key.json boxes (pointing.py);
  * effective rank of the mean-pooled visual embeddings of each medium, per kind (Roy & Vetterli
    2007: exp of the entropy of the normalised singular values). Uncentred: it measures how many
    directions the media span, which is what an RMS-normalising decoder sees (a large shared
    component drives it to 1); the centred rank (spread around the mean) is reported alongside.
Text rows are text-modality positions of image_text / video_text documents whose next-token
prediction is trained (the positions the media losses average over) and that come after a visual
token of their document; at most `max_rows` of them per batch, evenly spaced, are recomputed.

Exactness across ranks: everything is accumulated as float64 sums and counts in one flat vector
(the pooled embeddings as a D x D Gram matrix per kind, whose eigenvalues are the squared singular
values), so one `reduce_fn` (an in-place sum over data-parallel ranks) combines ranks exactly.
Every rank must pass the same number of batches: the forwards are collective under DDP/FSDP.

Wrapped models: the forwards are plain calls of `model` (DDP/FSDP wrapper or not) with
`capture_layers`; q and k are activations, which neither wrapper shards, and the recompute runs on
them locally. Tests cover one process; under DDP it is the same forward. Config (layers, experts,
widths) comes from `raw_model`. Memory: one batch's q and k of every decoder layer are held at once
(on top of an inference forward), so keep diagnostics batches no larger than training ones.

Legend: B rows, S tokens, D decoder dim, E routed experts, L decoder layers, M media, Q merged
visual tokens, H heads, R text rows.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import (
    IGNORE_INDEX,
    IMAGE,
    MODALITY_NAMES,
    TASK_NAMES,
    TEXT,
    VIDEO,
    PackedBatch,
)
from mmtrain.evaluate import MEDIA_TASKS, blank_media, mismatch_media
from mmtrain.models.attention import AttentionConfig, build_meta, even_subset, row_stats, text_rows
from mmtrain.objectives import task_losses
from mmtrain.pointing import GroundingDoc, pointing_scores

Tensor = torch.Tensor
MEDIA_KINDS = {IMAGE: "image", VIDEO: "video"}
ATTN_STATS = ("mass", "entropy", "sink")
RECOMPUTE_CHUNK = 64  # rows recomputed at once: memory H x 64 x S floats
# The load-ratio alarm needs enough routed tokens per expert that max/mean is not sampling noise
# (uniform routing with 8 tokens per expert: max/mean ~ 1 + sqrt(2 ln E / 8) < 2 for E <= 256).
MIN_LOAD_PER_EXPERT = 8.0


@dataclass
class DiagConfig:
    every: int = 0  # steps between runs; 0 = off
    batches: int = 2  # the first val batches are used, the same ones every time
    max_rows: int = 256  # text query rows recomputed per batch (evenly spaced): bounds the cost
    warmup_steps: int = 100  # no alarms before this step
    min_reliance_gap: float = 0.02  # nats per token
    min_attention_mass: float = 0.02  # text->visual mass, mean over layers
    min_effective_rank: float = 2.0
    max_expert_load_ratio: float = 4.0  # max / mean expert load within one modality and MoE layer
    min_router_entropy: float = 0.1  # nats
    # Pointing game (mmtrain/pointing.py) on the first val images/videos whose key.json has boxes,
    # each with its own caption; 0 = off (corpora without boxes: nothing to score).
    pointing_media: int = 8
    mismatch: bool = True  # the mismatch gap: a third forward per batch with media swapped across documents

    def __post_init__(self) -> None:
        for name, low in (("every", 0), ("batches", 1), ("max_rows", 1), ("warmup_steps", 0),
                          ("pointing_media", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low} (got {value!r})")
        for name in ("min_reliance_gap", "min_attention_mass", "min_effective_rank", "max_expert_load_ratio",
                     "min_router_entropy"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number (got {value!r})")
        check(self, "min_attention_mass", ge=0, le=1)
        check(self, "min_effective_rank", "min_router_entropy", ge=0)
        check(self, "max_expert_load_ratio", ge=1)
        if not isinstance(self.mismatch, bool):
            raise ValueError(f"mismatch: must be true or false (got {self.mismatch!r})")


@dataclass
class DiagResult:
    step: int
    loss: dict[str, float]  # media task -> per-token loss with the real media
    blank_loss: dict[str, float]  # ... with every medium blanked
    tokens: dict[str, int]  # trained tokens per media task
    attention: dict[str, dict[str, list[float | None]]]  # task -> mass/entropy/sink -> per layer
    attention_rows: dict[str, int]  # recomputed text rows per task (each layer)
    expert_load: dict[int, Tensor]  # MoE layer -> (3, E) float64 share of each modality's routed tokens
    expert_load_max_ratio: dict[int, list[float | None]]  # (3,) max / mean over the modality's experts
    expert_mean_load: dict[int, list[float]]  # (3,) routed (token, expert) pairs per allowed expert
    router_entropy: dict[int, list[float | None]]  # (3,) nats, mean over the modality's tokens
    effective_rank: dict[str, float | None]  # kind present -> rank (None with fewer than 2 media)
    effective_rank_centered: dict[str, float | None]  # the same after subtracting the mean embedding
    media: dict[str, int]
    batches: int
    cfg: DiagConfig = field(default_factory=DiagConfig)
    pointing: dict[str, dict] = field(default_factory=dict)  # category -> n, accuracy, chance_cell
    # Media swapped across documents (evaluate.mismatch_media), on the trained tokens of the documents
    # that got a foreign medium; only tasks with such tokens.
    mismatch_loss: dict[str, float] = field(default_factory=dict)  # per-token loss, swapped media
    mismatch_real_loss: dict[str, float] = field(default_factory=dict)  # ... the same tokens, own media
    mismatch_tokens: dict[str, int] = field(default_factory=dict)
    # Wall seconds of this rank's passes, summed over batches: real (forward with captures), stats
    # (attention recompute, experts, embeddings), blank, mismatch (swap + forward), pointing, total.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def reliance_gap(self) -> dict[str, float]:
        return {t: self.blank_loss[t] - self.loss[t] for t in self.loss}

    @property
    def mismatch_gap(self) -> dict[str, float]:
        return {t: self.mismatch_loss[t] - self.mismatch_real_loss[t] for t in self.mismatch_loss}

    def layer_mean(self, task: str, stat: str) -> float | None:
        values = [v for v in self.attention[task][stat] if v is not None]
        return sum(values) / len(values) if values else None

    def scalars(self, prefix: str = "diag") -> dict[str, float]:
        out = {}
        for task, gap in self.reliance_gap.items():
            out.update({f"{prefix}/reliance_gap_{task}": gap, f"{prefix}/loss_{task}": self.loss[task],
                        f"{prefix}/blank_loss_{task}": self.blank_loss[task]})
        for task, gap in self.mismatch_gap.items():
            out.update({f"{prefix}/mismatch_gap_{task}": gap,
                        f"{prefix}/mismatch_loss_{task}": self.mismatch_loss[task]})
        names = {"mass": "attn_mass", "entropy": "attn_entropy", "sink": "sink"}
        for task, per_stat in self.attention.items():
            for stat, values in per_stat.items():
                key = f"{prefix}/{names[stat]}_{task}"
                out.update({f"{key}_L{i}": v for i, v in enumerate(values) if v is not None})
                if (mean := self.layer_mean(task, stat)) is not None:
                    out[key] = mean
        for layer in self.expert_load:
            for m, name in enumerate(MODALITY_NAMES):
                if (ent := self.router_entropy[layer][m]) is not None:
                    out[f"{prefix}/router_entropy_{name}_L{layer}"] = ent
                if (ratio := self.expert_load_max_ratio[layer][m]) is not None:
                    out[f"{prefix}/expert_load_max_ratio_{name}_L{layer}"] = ratio
        ranks = {k: v for k, v in self.effective_rank.items() if v is not None}
        out.update({f"{prefix}/effective_rank_{k}": v for k, v in ranks.items()})
        centred = {k: v for k, v in self.effective_rank_centered.items() if v is not None}
        out.update({f"{prefix}/effective_rank_centered_{k}": v for k, v in centred.items()})
        for cat, p in self.pointing.items():
            out[f"{prefix}/pointing_{cat}"] = p["accuracy"]
            out[f"{prefix}/pointing_chance_{cat}"] = p["chance_cell"]
        out[f"{prefix}/alarms"] = float(len(self.alarms()))
        return out

    def alarms(self, cfg: DiagConfig | None = None, step: int | None = None) -> list[str]:
        """One line per signal past its threshold; none before cfg.warmup_steps."""
        cfg, step = cfg or self.cfg, self.step if step is None else step
        if step < cfg.warmup_steps:
            return []
        out = []
        for task, gap in self.reliance_gap.items():
            if gap < cfg.min_reliance_gap:
                out.append(f"reliance gap {task} {gap:+.4f} < {cfg.min_reliance_gap:g}: "
                           f"text ignores the pixels")
        for task in self.attention:
            mass = self.layer_mean(task, "mass")
            if mass is not None and mass < cfg.min_attention_mass:
                out.append(f"attention mass {task} {mass:.4f} < {cfg.min_attention_mass:g}: "
                           f"text rows barely attend to visual tokens")
        # Judged on the centred embeddings: a shared mean direction dominates the raw ones (raw rank ~1
        # even when the media are told apart), so only the spread around the mean says whether
        # different media still get different embeddings. With M media the rank is at most M - 1.
        for kind, rank in self.effective_rank_centered.items():
            if rank is not None and self.media[kind] - 1 > cfg.min_effective_rank > rank:
                out.append(f"effective rank {kind} {rank:.2f} < {cfg.min_effective_rank:g} (centred): "
                           f"pooled visual embeddings collapsed")
        for layer in self.expert_load:
            out.extend(self._expert_alarms(cfg, layer))
        return out

    def _expert_alarms(self, cfg: DiagConfig, layer: int) -> list[str]:
        out = []
        for m, name in enumerate(MODALITY_NAMES):
            ratio, ent = self.expert_load_max_ratio[layer][m], self.router_entropy[layer][m]
            enough = self.expert_mean_load[layer][m] >= MIN_LOAD_PER_EXPERT
            if ratio is not None and enough and ratio > cfg.max_expert_load_ratio:
                out.append(f"expert load {name} L{layer} max/mean {ratio:.2f} > "
                           f"{cfg.max_expert_load_ratio:g}: routing concentrates on few experts")
            if ent is not None and ent < cfg.min_router_entropy:
                out.append(f"router entropy {name} L{layer} {ent:.3f} < {cfg.min_router_entropy:g} nats: "
                           f"routing is near-deterministic")
        return out

    def to_dict(self) -> dict:
        """JSON-able (the run's diagnostics history)."""
        return {
            "step": self.step, "batches": self.batches, "loss": self.loss, "blank_loss": self.blank_loss,
            "reliance_gap": self.reliance_gap, "tokens": self.tokens,
            "mismatch_gap": self.mismatch_gap, "mismatch_loss": self.mismatch_loss,
            "mismatch_real_loss": self.mismatch_real_loss, "mismatch_tokens": self.mismatch_tokens,
            "seconds": self.seconds, "attention": self.attention,
            "attention_rows": self.attention_rows,
            "expert_load": {str(k): v.tolist() for k, v in self.expert_load.items()},
            "expert_load_max_ratio": {str(k): v for k, v in self.expert_load_max_ratio.items()},
            "expert_mean_load": {str(k): v for k, v in self.expert_mean_load.items()},
            "router_entropy": {str(k): v for k, v in self.router_entropy.items()},
            "effective_rank": self.effective_rank, "effective_rank_centered": self.effective_rank_centered,
            "media": self.media, "pointing": self.pointing, "alarms": self.alarms(),
            "config": asdict(self.cfg),
        }

    def expert_load_image(self) -> np.ndarray | None:
        """uint8 (H, W, 3) heatmaps, one panel per MoE layer: rows text/image/video, columns experts,
        value = share of that modality's routed tokens (TensorBoard add_image, dataformats HWC)."""
        if not self.expert_load:
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: plotting only here
        from matplotlib.figure import Figure

        layers = sorted(self.expert_load)
        E = self.expert_load[layers[0]].shape[1]
        size = (min(2.0 + 0.3 * E, 12.0), 0.6 + 1.1 * len(layers))
        fig = Figure(figsize=size, dpi=80, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(layers), 1, squeeze=False)[:, 0]
        vmax = max(float(self.expert_load[i].max()) for i in layers) or 1.0
        for ax, layer in zip(axes, layers):
            im = ax.imshow(self.expert_load[layer].numpy(), aspect="auto", cmap="viridis",
                           vmin=0.0, vmax=vmax)
            ax.set_yticks(range(3), MODALITY_NAMES, fontsize=7)
            ax.set_xticks(range(E), [str(e) if E <= 32 else "" for e in range(E)], fontsize=6)
            ax.set_title(f"MoE layer {layer}: expert share per modality", fontsize=8)
        fig.colorbar(im, ax=list(axes), fraction=0.05)
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


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
               "media": (len(MEDIA_KINDS),)}
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
                    grounding: list[GroundingDoc] | None = None) -> DiagResult:
    """Collapse signals on the first cfg.batches of `batches`; training state is left untouched
    (eval mode inside, module modes and CPU/CUDA RNG restored after, no MoE load accumulated).

    reduce_fn: sums a float64 1-D tensor across data-parallel ranks in place (called once).
    grounding: documents with boxes for the pointing game (`pointing.grounding_docs`), the same on
    every rank (so no reduction)."""
    device = torch.device(device)
    raw = raw_model if raw_model is not None else getattr(model, "module", model)
    layout = _Layout.of(raw)
    sums = _Sums(layout.shapes(), device)
    n_batches, pointing = 0, {}
    clock = _Clock(device)
    with frozen_state(model, device):
        for batch in itertools.islice(batches, cfg.batches):
            _diagnose_batch(model, batch.to(device), layout, sums, cfg, autocast, clock)
            n_batches += 1
        if grounding:
            with clock("pointing"):
                pointing = pointing_scores(model, grounding, device, raw.cfg, autocast)
    if reduce_fn is not None:
        reduce_fn(sums.flat)
    result = _result(sums, layout, step, n_batches, cfg)
    result.pointing = pointing
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


@contextlib.contextmanager
def frozen_state(model: nn.Module, device: torch.device):
    """Eval mode (MoE layers count no load, no dropout) and the CPU/CUDA RNG saved, restored after:
    a forward inside leaves training state as it found it (diagnostics, token weighting)."""
    modes = [(m, m.training) for m in model.modules()]
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):  # saves and restores the CPU and these CUDA generators
        model.eval()
        try:
            yield
        finally:
            for module, mode in modes:
                module.training = mode


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
    for k, kind in enumerate(MEDIA_KINDS):
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
                      mismatch_tokens={t: int(loss_T6[j, 5]) for j, t in swapped})


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
