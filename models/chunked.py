"""Per-token functions over long rows, a chunk of tokens at a time, each chunk checkpointed.

Why: at long context the FFN/MoE internals of one layer (expert inputs, hidden activations,
gates: ~13 KB per token for `tiny`) dominate the memory of that layer's recompute under
activation checkpointing. Run chunk by chunk, each chunk under its own checkpoint, only the chunk
outputs (T x D) stay alive and the internals are rebuilt one chunk at a time in backward.
Exact up to fp32 rounding: the functions act on each token alone (MoE routing is decided
beforehand on all tokens, so the balance losses still see the whole row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor


def over_tokens(fn: Callable[..., Tensor], chunk: int, *args_T: Tensor) -> Tensor:
    """fn(*args_T) computed on chunks of `chunk` tokens along dim 0 (all at once if chunk <= 0)."""
    T = args_T[0].shape[0]
    if chunk <= 0 or chunk >= T:
        return fn(*args_T)
    outs = []
    for start in range(0, T, chunk):
        part = [a[start:start + chunk] for a in args_T]
        outs.append(checkpoint(fn, *part, use_reentrant=False) if torch.is_grad_enabled() else fn(*part))
    return torch.cat(outs)
