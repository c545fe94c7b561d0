"""Attention for mmtrain: one definition, several backends.

    from models.attention import AttentionConfig, AttnMeta, build_meta, attend, recompute_probs
    meta = build_meta(doc_ids_BS, span_ids_BS, cfg.block_size)   # once per forward, all layers
    out_BHSD = attend(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, capture=None)

Token rule (every layer, every backend): query i may attend key j iff doc[i] == doc[j] and
(j <= i or (span[i] == span[j] and span[i] >= 0)). Text is causal; the tokens of one image / one
video frame (one span, id >= 0) see each other bidirectionally; across spans and media, causal.
Every query sees itself, so padding (its own document) never gives NaNs.

Sparse layers: per query block q (size Bs = block_size) and per head or GQA group (select_per), the
kept key blocks are the union of
  * own: block q;
  * window: the ceil(window / Bs) blocks before q (those overlapping the `window` tokens before q);
  * sink (cfg.sink): the block holding the first token of every document with a token in q;
  * visual (cfg.visual_always): every block holding a visual token of a document present in q;
  * span closure (always on): every block, before or after q, holding part of a visual span that
    has a token in q -- so the span rule is never cut by the selection;
  * top-k: the cfg.top_k best of the remaining candidates (blocks before q sharing its document and
    not already kept; fewer candidates than top_k -> all of them), scored by
    mean_{i in q} q_i . mean_{j in n} k_j in fp32 (a GQA group averages its heads' scores),
    chosen under no_grad;
all intersected with reach(q) (blocks sharing a document with q, not after q except the
closure). The token rule is then applied inside the kept blocks. Consequences: two tokens of one
span always see each other in every layer; a sparse layer whose window or top_k covers every
block equals the full layer. `capture["kv_blocks"]` is this (B, G, Q, N) bool selection.
Documents and spans are assumed to be contiguous runs (the packer's output); otherwise block
summaries are supersets (the function stays exact, only more blocks are visited) and flash is off.

Backends (same function): `dense` (reference; eager fp32 or SDPA with the materialised mask,
O(S^2)); `gather` (pure PyTorch, trainable on CPU/GPU, O(S*T*Bs) with T kept blocks per query
block; full layers visit every reachable block, never S x S); `flex` (FlexAttention BlockMask
+ mask_mod, the CUDA training path; compiled flex on CPU is inference only); `flash`
(flash-attn varlen, full layers of span-free batches; absent -> one warning and a fallback).
`auto`: sparse -> flex on CUDA, gather on CPU; full -> flash if usable, else flex on CUDA, gather
on CPU. `recompute_probs` rebuilds attention rows from a capture with exactly the layer's mask.
"""

from .api import attend, resolve_backend
from .config import AttentionConfig
from .meta import AttnMeta, build_meta, token_mask
from .recompute import recompute_probs
from .select import select_blocks
from .stats import RowStats, doc_first_BS, even_subset, reduce_rows, row_stats, text_rows

__all__ = ["AttentionConfig", "AttnMeta", "RowStats", "attend", "build_meta", "doc_first_BS", "even_subset",
           "recompute_probs", "reduce_rows", "resolve_backend", "row_stats", "select_blocks", "text_rows",
           "token_mask"]
