"""What a diagnostics run reports: its config (thresholds), the result, its scalars and alarms.

`DiagResult` holds per media task the loss with real, blanked and swapped media (the blanked reliance
gap, out of distribution, and the mismatch gap, the in-distribution verdict on reading the pixels),
per layer and task the text->visual attention mass, entropy and sink mass, per MoE layer the expert
load and router entropy per modality, the effective ranks of the pooled visual embeddings per kind,
the pointing game and the probe; `scalars()` is the TensorBoard view, `alarms()` one
line per signal past its `DiagConfig` threshold (none before `warmup_steps`), `to_dict()` the
JSON line of the run's history. How they are measured: mmtrain/evaluation/diagnostics.py.

Legend: E routed experts, H, W image height and width.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from torch import Tensor

from mmtrain.checks import check
from mmtrain.data_pipelines.batch import MODALITY_NAMES

# The load-ratio alarm needs enough routed tokens per expert that max/mean is not sampling noise
# (uniform routing with 8 tokens per expert: max/mean ~ 1 + sqrt(2 ln E / 8) < 2 for E <= 256).
MIN_LOAD_PER_EXPERT = 8.0


@dataclass
class DiagConfig:
    every: int = 0  # steps between runs; 0 = off
    batches: int = 2  # the first val batches are used, the same ones every time
    max_rows: int = 256  # text query rows recomputed per batch (evenly spaced): bounds the cost
    warmup_steps: int = 100  # no alarms before this step
    min_mismatch_gap: float = 0.02  # nats per token: the verdict on reading the pixels (with `mismatch`)
    min_reliance_gap: float = 0.02  # nats per token, blanked media: only for tasks without a mismatch gap
    min_attention_mass: float = 0.02  # text->visual mass, mean over layers
    min_effective_rank: float = 2.0
    max_expert_load_ratio: float = 4.0  # max / mean expert load within one modality and MoE layer
    min_router_entropy: float = 0.1  # nats
    # Pointing game (mmtrain/evaluation/pointing.py) on the first val images/videos whose key.json has boxes,
    # each with its own caption; 0 = off (corpora without boxes: nothing to score).
    pointing_media: int = 8
    mismatch: bool = True  # the mismatch gap: a third forward per batch with media swapped across documents
    # Linear probe of the ViT's pooled features over each object's box (colour, shape, size) on this
    # many val media with boxes, against a raw-pixel ceiling (mmtrain/evaluation/probe.py); 0 = off.
    probe_media: int = 0
    # Knockout faithfulness of the default map method (mmtrain/evaluation/knockout.py) on the pointing
    # game's words: its deletion AUC over random orders' (`faithfulness_draws` a word); 0 = off. Small
    # by default (~50 batch rows of a forward a word): a curve over the run, not the CLI's verdict.
    faithfulness_words: int = 8
    faithfulness_draws: int = 10

    def __post_init__(self) -> None:
        for name, low in (("every", 0), ("batches", 1), ("max_rows", 1), ("warmup_steps", 0),
                          ("pointing_media", 0), ("probe_media", 0), ("faithfulness_words", 0),
                          ("faithfulness_draws", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low} (got {value!r})")
        for name in ("min_mismatch_gap", "min_reliance_gap", "min_attention_mass", "min_effective_rank",
                     "max_expert_load_ratio", "min_router_entropy"):
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
    # Media swapped across documents (mismatch.mismatch_media), on the trained tokens of the documents
    # that got a foreign medium; only tasks with such tokens.
    mismatch_loss: dict[str, float] = field(default_factory=dict)  # per-token loss, swapped media
    mismatch_real_loss: dict[str, float] = field(default_factory=dict)  # ... the same tokens, own media
    mismatch_tokens: dict[str, int] = field(default_factory=dict)
    # Mean L2 norm of the visual tokens entering the decoder, per media kind (text embeddings: ~0.3 at
    # init in tiny): a blow-up shrinks every gradient into the vision path through the pre-norms.
    visual_norm: dict[str, float] = field(default_factory=dict)
    # probe.py: attribute -> {"vit": held-out accuracy, "pixels": ceiling, "chance": ..., "n": objects}
    probe: dict[str, dict] = field(default_factory=dict)
    # knockout.grounding_faithfulness: method, words, deletion ratio (map / random), its 95% interval, z
    faithfulness: dict = field(default_factory=dict)
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
        out.update({f"{prefix}/visual_norm_{k}": v for k, v in self.visual_norm.items()})
        ranks = {k: v for k, v in self.effective_rank.items() if v is not None}
        out.update({f"{prefix}/effective_rank_{k}": v for k, v in ranks.items()})
        centred = {k: v for k, v in self.effective_rank_centered.items() if v is not None}
        out.update({f"{prefix}/effective_rank_centered_{k}": v for k, v in centred.items()})
        for cat, p in self.pointing.items():
            out[f"{prefix}/pointing_{cat}"] = p["accuracy"]
            out[f"{prefix}/pointing_chance_{cat}"] = p["chance_cell"]
        for attr, p in self.probe.items():
            out.update({f"{prefix}/probe_{attr}_{k}": p[k] for k in ("vit", "vit_pre", "pixels", "chance")})
        for key in ("deletion_ratio", "deletion_z"):  # None: undefined (knockout.grounding_faithfulness)
            if self.faithfulness.get("words") and self.faithfulness.get(key) is not None:
                out[f"{prefix}/faithfulness_{key}"] = self.faithfulness[key]
        out[f"{prefix}/alarms"] = float(len(self.alarms()))
        return out

    def alarms(self, cfg: DiagConfig | None = None, step: int | None = None) -> list[str]:
        """One line per signal past its threshold; none before cfg.warmup_steps."""
        cfg, step = cfg or self.cfg, self.step if step is None else step
        if step < cfg.warmup_steps:
            return []
        out = self._reading_alarms(cfg)
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

    def _reading_alarms(self, cfg: DiagConfig) -> list[str]:
        """Whether the text reads the pixels: judged by the mismatch gap (in distribution) where it was
        measured; the blanked gap (out of distribution) only for tasks without one (mismatch off, or
        no document got a foreign medium)."""
        out, mismatch = [], self.mismatch_gap
        for task, gap in mismatch.items():
            if gap < cfg.min_mismatch_gap:
                out.append(f"mismatch gap {task} {gap:+.4f} < {cfg.min_mismatch_gap:g}: text ignores the "
                           f"pixels (other documents' media do as well as its own)")
        for task, gap in self.reliance_gap.items():
            if task not in mismatch and gap < cfg.min_reliance_gap:
                out.append(f"reliance gap {task} {gap:+.4f} < {cfg.min_reliance_gap:g} (blanked media, "
                           f"out of distribution; no mismatch gap): text ignores the pixels")
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
            "media": self.media, "pointing": self.pointing, "probe": self.probe,
            "faithfulness": self.faithfulness,
            "visual_norm": self.visual_norm, "alarms": self.alarms(),
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
