"""Attention for mmtrain: one definition, several backends.

    from mmtrain.models.attention import AttentionConfig, AttnMeta, build_meta, attend, recompute_probs
    meta = build_meta(doc_ids_BS, span_ids_BS, cfg.block_size)   # once per forward, all layers
    out_BHSD = attend(q_BHSD, k_BKSD, v_BKSD, meta, cfg, sparse, capture=None, stats=None)

Token rule (every layer, every backend): query i may attend key j iff doc[i] == doc[j] and
(j <= i or i, j are in one visual span). Text is causal; the tokens of one image / one video frame
(one span) see each other bidirectionally; across spans and media, causal. Every query sees
itself. Document ids < 0 are padding (a document of its own, not counted by counts.py or MoE).

Sparse layers keep, for each query token, a set of key blocks of its own document, with blocks
counted from the document's first token (block n = its tokens [n*Bs, (n+1)*Bs)) so a document
computes the same thing wherever the packer put it (blocks.py):
  * own block (causal inside), the ceil(window / Bs) blocks before it, block 0 (cfg.sink), every
    earlier block holding a visual token (cfg.visual_always), the blocks of the query's own
    visual span (closure, so spans stay bidirectional);
  * top-k of the completed earlier blocks not kept already, scored by q . mean(k over the block)
    with the query token's own q ("token", MoBA's gating) or the previous block's mean query
    ("block"); select.py.
What a query keeps depends only on its own document up to its own position (plus its span):
causality is a property, tested as one (test_attention_properties.py, test_causality.py).
Selection is stored as O(S * k) doc-relative ids per selection head (`Selection`); nothing in the
sparse path is S x S or blocks x blocks.

Backends (same function), a registry (registry.py: each entry states its layer kinds, devices,
backward, compiled path, optional package, per-call check and fallback; `resolve` picks one for
eager calls, compiled calls and the custom ops' bodies alike): `dense` (reference; eager fp32 or
SDPA with the materialised mask, O(S^2)); `gather` (pure PyTorch, trainable on CPU/GPU: sparse
layers on the aligned layout, full layers on the row layout, tiles visiting ranges of blocks);
`sdpa` (full layers: fused SDPA per document; documents split across a row -> gather); `flex`
(FlexAttention BlockMask + mask_mod, the CUDA training path; CPU: forward only); `flash`
(flash-attn varlen, full layers of span-free half-precision batches -> flex / gather). `auto`:
sparse -> flex on CUDA, gather on CPU; full -> flash if usable, else flex on CUDA, sdpa on CPU.
Under torch.compile a backend's host-sized paths (sdpa, the sparse gather path with its
selection) run as opaque custom ops (opaque.py): no graph break.
`recompute_probs` rebuilds attention rows from a capture with exactly the layer's mask;
`counts` says what a layer visited (keys, kept blocks).
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
