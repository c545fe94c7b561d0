"""FLOPs per step and rank by component, counted by hand (a fake trace counts none, and
FlopCounterMode counts 0 for `_grouped_mm` and doubles under DTensor).

Training = 3 x forward (backward is twice the forward): a matmul of P parameters costs 6 x P per
row; attention 12 x H x head_dim per (query, key) pair kept. Keys per query come from the planned
batch's documents: a full layer attends its document causally (a document of L tokens: L(L+1)/2
pairs); a sparse layer keeps at most `window + (1 + sink + top_k) x block_size` keys of that reach
(the rule's own block, window, sink and picks; visual_always and span closures are inside the
window for the planned one-image documents), or `keep_rate` x the full layer's pairs when given.
The vision tower: its matmuls per patch, bidirectional attention inside each medium (n^2 pairs
per medium), the projector per visual token. Activation checkpointing recomputes the blocks'
forward: `recompute` (hardware FLOPs, not model FLOPs). Norms, softmax and rotary: not counted.
"""

from __future__ import annotations

import torch
from torch import nn


def matmul_params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def doc_lengths(batch) -> list[int]:
    """Tokens of every document of every row (padding excluded)."""
    out = []
    for row in batch.doc_ids_BS:
        _, counts = torch.unique_consecutive(row[row >= 0], return_counts=True)
        out += counts.tolist()
    return out


def pairs(lengths: list[int], cap: float | None = None) -> float:
    """Causal (query, key) pairs of the documents, each query keeping at most `cap` keys."""
    total = 0.0
    for n in lengths:
        if cap is None or cap >= n:
            total += n * (n + 1) / 2
        else:
            total += cap * (cap + 1) / 2 + (n - cap) * cap
    return total


def component_flops(model: nn.Module, batch, accum: int = 1, keep_rate: float | None = None,
                    recompute: bool = False, cp: int = 1,
                    encoded: list[int] | None = None) -> dict[str, float]:
    """{component: FLOPs} of one optimizer step on this rank (`model` on any device, meta too).
    Context parallelism: the decoder's work is split over the cp ranks (the mean rank: later
    chunks attend more keys), the vision tower encodes every medium on each of them, unless
    `encoded` (vision.balance: the patches of each medium this rank encodes) says otherwise."""
    dec_cfg, vis_cfg = model.cfg.decoder, model.cfg.vision
    dec, vis = model.decoder, model.vision
    T = batch.num_tokens()
    docs = doc_lengths(batch)
    a = dec_cfg.attention
    cap = a.window + (1 + int(a.sink) + a.top_k) * a.block_size
    per_pair = 12 * dec_cfg.n_heads * dec_cfg.head_dim
    out = dict.fromkeys(("vit", "full attention", "sparse attention", "dense ffn", "moe experts",
                         "shared experts", "router", "lm head", "visual head"), 0.0)
    for i, layer in enumerate(dec.layers):
        kind = "sparse attention" if dec_cfg.is_sparse(i) else "full attention"
        full_pairs = pairs(docs)
        kept = full_pairs
        if kind == "sparse attention":
            kept = keep_rate * full_pairs if keep_rate is not None else pairs(docs, cap)
        out[kind] += 6 * matmul_params(layer.attn) * T + per_pair * kept
        ffn = layer.ffn
        if hasattr(ffn, "experts"):
            per_expert = matmul_params(ffn.experts) / ffn.cfg.n_routed
            out["moe experts"] += 6 * per_expert * ffn.cfg.top_k * T
            out["shared experts"] += 6 * matmul_params(getattr(ffn, "shared", None)) * T
            out["router"] += 6 * matmul_params(ffn.router) * T
        else:
            out["dense ffn"] += 6 * matmul_params(ffn) * T
    head = dec.lm_head if dec.lm_head is not None else dec.embed
    out["lm head"] = 6 * head.weight.numel() * T
    out["vit"] = _vit(vis, vis_cfg, batch, encoded)
    visual = int((batch.modality_BS != 0).sum())
    if getattr(model, "visual_head", None) is not None:
        out["visual head"] = 6 * matmul_params(model.visual_head) * visual
    out = {k: v * accum / (1 if k == "vit" else cp) for k, v in out.items()}
    if recompute:  # the checkpointed blocks' forward again: a third of their training FLOPs
        out["recompute"] = sum(v for k, v in out.items() if k not in ("lm head", "visual head")) / 3
    return out


def _vit(vis: nn.Module, cfg, batch, encoded: list[int] | None = None) -> float:
    n_M = batch.grid_thw_M3.prod(-1).tolist() if encoded is None else encoded
    not_per_patch = matmul_params(vis.projector) + matmul_params(getattr(vis, "ssl_head", None))
    not_per_patch += sum(p.numel() for p in (vis.row_embed, vis.col_embed) if p is not None)
    tower = matmul_params(vis) - not_per_patch
    visual = int((batch.modality_BS != 0).sum()) if encoded is None else sum(encoded) // cfg.merge ** 2
    attn = 12 * cfg.dim * cfg.depth * sum(n * n for n in n_M)
    return 6 * tower * sum(n_M) + attn + 6 * matmul_params(vis.projector) * visual


MODEL_EXCLUDES = ("recompute",)


def model_flops(parts: dict[str, float]) -> float:
    """MFU's numerator: what the model needs, not what checkpointing adds."""
    return sum(v for k, v in parts.items() if k not in MODEL_EXCLUDES)
