"""Attention for mmtrain: one definition, several backends.

Token rule (full layers): query i may attend key j iff doc[i] == doc[j] and
(j <= i or (span[i] == span[j] and span[i] >= 0)). Text is causal; the tokens of one image / one
video frame (one span) see each other bidirectionally; across spans and media the order is causal.
Every query sees at least itself, so padding (its own document) never produces NaNs.

Sparse layers restrict keys further to the union of key blocks (size Bs) chosen per query block
(see `select.py`): own block, the ceil(window / Bs) blocks before it, the first block of each
document present in the query block (sink), with visual_always every visual block of the same
document, the top_k best remaining earlier blocks of the document (MoBA score
mean_i q_i . mean(K_block)), and ALWAYS the span closure: every block holding part of a visual span
that has a token in the query block (including blocks after it). The token rule is then applied
inside the selected blocks. Because of the closure, the span rule holds exactly in sparse layers
too: two tokens of one span always see each other, whatever the selection.

Backends (identical function): dense (reference, O(S^2)), gather (pure PyTorch, trainable on CPU and
GPU, O(S*k*Bs)), flex (FlexAttention BlockMask, CUDA training path), flash (flash-attn varlen, full
layers of span-free batches; falls back otherwise).
"""

from .api import attend, resolve_backend
from .config import AttentionConfig
from .meta import AttnMeta, build_meta, token_mask
from .recompute import recompute_probs
from .select import select_blocks

__all__ = ["AttentionConfig", "AttnMeta", "attend", "build_meta", "recompute_probs", "resolve_backend",
           "select_blocks", "token_mask"]
