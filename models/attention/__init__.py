"""Attention for mmtrain: one definition, several backends (ARCHITECTURE, "Model").

    from mmtrain.models.attention import AttentionConfig, AttnMeta, build_meta, attend, recompute_probs
    meta = build_meta(doc_ids_BS, span_ids_BS, cfg.block_size)   # once per forward, all layers
    out_BHSD = attend(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, capture=None, stats=None)

Token rule (meta.py): query i may attend key j iff doc[i] == doc[j] and (j <= i or i, j are in
one visual span); document ids < 0 are padding. Sparse layers also apply the block rule
(blocks.py: own block, window, sink, visual blocks, the query's span, top-k picks of select.py),
with blocks counted from each document's first token: what a query keeps depends only on its own
document up to its position, and nothing is S x S. Backends compute the same function and form a
registry (registry.py): dense (the reference), gather (CPU/GPU; tiles.py on CPU), sdpa (fused full
layers on CPU), flex (CUDA), flash (optional). `recompute_probs` rebuilds attention rows from a
capture with the layer's exact mask; counts.py says what a layer visited.
"""

from .api import attend, resolve_backend
from .config import AttentionConfig
from .meta import AttnMeta, build_meta, token_mask
from .recompute import recompute_probs
from .select import Selection, select_blocks
from .stats import RowStats, doc_first_BS, even_subset, reduce_rows, row_stats, text_rows

__all__ = ["AttentionConfig", "AttnMeta", "RowStats", "Selection", "attend", "build_meta", "doc_first_BS",
           "even_subset", "recompute_probs", "reduce_rows", "resolve_backend", "row_stats", "select_blocks",
           "text_rows", "token_mask"]
