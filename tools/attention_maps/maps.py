"""Capture and recompute: attention rows of chosen layers, reduced to what the maps and metrics need.

A forward with `capture_layers` records q and k (after RoPE) and a sparse layer's block selection;
`models.attention.recompute_probs` rebuilds softmax(q.k^T / sqrt(d) + mask) for chosen query rows
with exactly the layer's mask. Rows are processed in chunks and reduced at once (probability mass on
visual tokens, entropy, sink mass, and the probabilities over the document's visual tokens), so no
S x S map is ever held. The row selection and reductions (doc_first_BS, text_rows, row_stats) live
in models/attention/stats.py, shared with the trainer's collapse diagnostics
(mmtrain/evaluation/diagnostics.py).

Definitions (per layer, per head, per query row):
  mass    = sum of the row's probabilities on visual tokens (they are all in the query's document);
  entropy = -sum p log p over all keys, in nats;
  sink    = probability on the first token of the query's document (its <|bos|>).
Statistics average over *text rows*: text tokens (no special ids) that come after the first visual
token of their document -- the rows that can see pixels at all.

Legend: B batch rows, S tokens, H heads, R query rows, r rows in a chunk, V visual tokens of the
document, G selection heads, Q/N query/key blocks, L layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmtrain.data_pipelines.batch import TEXT
from mmtrain.models.attention import AttentionConfig, AttnMeta, build_meta
from mmtrain.models.attention.recompute import block_pattern
from mmtrain.models.attention.stats import (
    doc_first_BS as doc_first_BS,  # re-exported: shared with the trainer
)
from mmtrain.models.attention.stats import row_stats, text_rows
from mmtrain.models.multimodal import MultimodalModel

from .inputs import DocInputs, MediumInfo

Tensor = torch.Tensor


@dataclass
class LayerRows:
    layer: int
    sparse: bool
    mass_HR: Tensor  # float32, probability on visual tokens
    entropy_HR: Tensor  # float32, nats
    sink_HR: Tensor  # float32, probability on the document's first token
    visual_HKV: Tensor | None  # float32, probabilities on the V visual tokens, for K kept rows (one document)
    kept_GQN: Tensor | None  # float share of a block's queries attending a key block (row 0, sparse layers)
    reach_QN: Tensor  # bool blocks the token rule can reach at all (batch row 0)


def parse_layers(spec: str | Sequence[int] | None, n_layers: int) -> list[int]:
    """"0,4,-1" -> sorted distinct layer indices (negative: from the end); None/"all" -> every layer."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = set()
    for item in items:
        try:
            i = int(item)
        except ValueError:
            raise ValueError(f"layers: {item!r} is not an integer") from None
        if not -n_layers <= i < n_layers:
            raise ValueError(f"layers: {i} is out of range for a model of {n_layers} layers")
        out.add(i % n_layers)
    if not out:
        raise ValueError("layers: empty list")
    return sorted(out)


@torch.no_grad()
def run_capture(model: MultimodalModel, inputs: dict[str, Tensor], layers: Sequence[int]
                ) -> tuple[dict[int, dict], AttnMeta]:
    """Forward with capture; -> ({layer: {"q", "k"[, "selection"]}}, the attention metadata)."""
    out = model(**inputs, capture_layers=list(layers), compute_logits=False)
    block = model.cfg.decoder.attention.block_size
    return out.captures, build_meta(inputs["doc_ids_BS"], inputs["span_ids_BS"], block)


@torch.no_grad()
def layer_rows(capture: dict, meta: AttnMeta, cfg: AttentionConfig, sparse: bool, layer: int,
               rows_R2: Tensor, modality_BS: Tensor, doc_ids_BS: Tensor, keep_R: Tensor | None = None,
               chunk: int = 32) -> LayerRows:
    """Recompute the rows (R, 2) in chunks of `chunk` and reduce them (models.attention.row_stats).
    keep_R (bool): rows whose probabilities on the visual tokens of batch row 0 are kept too
    (single-document inputs)."""
    vis_pos_V = (modality_BS[0] != TEXT).nonzero().squeeze(1).cpu()
    H = capture["q"].shape[1]
    keep_R = None if keep_R is None else keep_R.cpu()
    visual_HKV = None if keep_R is None else torch.zeros(H, int(keep_R.sum()), len(vis_pos_V))
    kept = 0

    def keep_maps(r0: int, p_HrS: Tensor) -> None:
        nonlocal kept
        k_r = keep_R[r0:r0 + p_HrS.shape[1]]
        visual_HKV[:, kept:kept + int(k_r.sum())] = p_HrS.cpu()[:, k_r][..., vis_pos_V]
        kept += int(k_r.sum())

    s = row_stats(capture, meta, cfg, sparse, rows_R2, modality_BS, doc_ids_BS, chunk,
                  on_chunk=None if visual_HKV is None else keep_maps)
    kept_GQN, reach_QN = block_pattern(capture, meta, cfg, sparse)
    return LayerRows(layer, sparse, s.mass_HR.cpu(), s.entropy_HR.cpu(), s.sink_HR.cpu(), visual_HKV,
                     kept_GQN if sparse else None, reach_QN)


@dataclass
class DocAttention:
    """Recomputed attention rows of one document, for the chosen layers."""

    doc: DocInputs
    layers: list[int]
    rows: np.ndarray  # (R,) query positions recomputed: every non-visual token after the first medium
    stat_rows: np.ndarray  # (R,) bool: text rows (no special ids), the ones statistics average over
    map_rows: np.ndarray  # (K,) positions among `rows` whose maps (visual probabilities) were kept
    per_layer: dict[int, LayerRows]
    n_heads: int
    block_size: int

    def has_maps(self, positions: Sequence[int]) -> bool:
        return len(self._map_index(positions)) == len(positions)

    def _map_index(self, positions: Sequence[int]) -> np.ndarray:
        where = {int(p): i for i, p in enumerate(self.map_rows)}
        return np.array([where[int(p)] for p in positions if int(p) in where], dtype=np.int64)

    def medium_map(self, layer: int, positions: Sequence[int], medium: MediumInfo) -> np.ndarray:
        """(H, t, h, w) probabilities over the medium's merged token grid, mean over the rows
        `positions` (e.g. the tokens of one word)."""
        idx = self._map_index(positions)
        off = sum(m.n_tokens for m in self.doc.media[:medium.index])
        v_HrV = self.per_layer[layer].visual_HKV[:, idx, off:off + medium.n_tokens]
        return v_HrV.mean(1).reshape(self.n_heads, *medium.grid_thw).numpy()

    def medium_mass(self, layer: int, position: int) -> np.ndarray:
        """(H, M) probability mass of one query row on each medium."""
        i = self._map_index([position])[0]
        v_HV = self.per_layer[layer].visual_HKV[:, i]
        bounds = np.cumsum([0] + [m.n_tokens for m in self.doc.media])
        return np.stack([v_HV[:, a:b].sum(-1).numpy() for a, b in zip(bounds[:-1], bounds[1:])], axis=1)


def analyze_document(model: MultimodalModel, doc: DocInputs, layers: Sequence[int], chunk: int = 32,
                     device: torch.device | str = "cpu", map_rows: Sequence[int] | None = None
                     ) -> DocAttention:
    """Capture the layers for one document and recompute every row after its first medium.

    Statistics cover all those rows; maps (probabilities over every visual token, H x V floats a
    row) are kept for `map_rows` only (default: all rows -- bound it for long documents)."""
    inputs = {k: v.to(device) for k, v in doc.batch.model_inputs().items()}
    captures, meta = run_capture(model, inputs, layers)
    dec = model.cfg.decoder
    first = min(m.start for m in doc.media)
    rows = np.array([p for p in range(first, len(doc)) if doc.document.modality_L[p] == TEXT], dtype=np.int64)
    rows_R2 = torch.stack([torch.zeros(len(rows), dtype=torch.long), torch.from_numpy(rows)], 1).to(device)
    keep_R = np.ones(len(rows), bool) if map_rows is None else np.isin(rows, np.asarray(list(map_rows)))
    per_layer = {
        layer: layer_rows(captures[layer], meta, dec.attention, dec.is_sparse(layer), layer, rows_R2,
                          inputs["modality_BS"], inputs["doc_ids_BS"], torch.from_numpy(keep_R), chunk)
        for layer in layers
    }
    return DocAttention(doc, list(layers), rows, ~doc.special_L[rows], rows[keep_R], per_layer, dec.n_heads,
                        dec.attention.block_size)


@torch.no_grad()
def batch_attention_stats(model: MultimodalModel, inputs: dict[str, Tensor], text_BS: Tensor,
                          layers: Sequence[int], chunk: int = 64) -> dict[int, dict[str, Tensor]]:
    """Packed-batch version (e.g. for collapse diagnostics): per layer, the (H,) means over all text
    rows of mass, entropy and sink, plus the row count. text_BS: bool, text tokens to count
    (e.g. modality text, not a special id, not padding)."""
    captures, meta = run_capture(model, inputs, layers)
    dec = model.cfg.decoder
    rows_R2 = text_rows(inputs["modality_BS"], inputs["doc_ids_BS"], text_BS)
    out = {}
    for layer in layers:
        r = row_stats(captures[layer], meta, dec.attention, dec.is_sparse(layer), rows_R2,
                      inputs["modality_BS"], inputs["doc_ids_BS"], chunk)
        n = max(rows_R2.shape[0], 1)
        out[layer] = {"mass": r.mass_HR.sum(1).cpu() / n, "entropy": r.entropy_HR.sum(1).cpu() / n,
                      "sink": r.sink_HR.sum(1).cpu() / n, "rows": torch.tensor(rows_R2.shape[0])}
    return out
