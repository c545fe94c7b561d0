"""Per-token functions over long rows, a chunk of tokens at a time, each chunk checkpointed.

Why: at long context the FFN/MoE internals of one layer (expert inputs, hidden activations,
gates: ~13 KB per token for `tiny`) dominate the memory of that layer's recompute under
activation checkpointing. Run chunk by chunk, each chunk under its own checkpoint, only the chunk
outputs (T x D) stay alive and the internals are rebuilt one chunk at a time in backward.
Exact up to fp32 rounding: the functions act on each token alone (MoE routing is decided
beforehand on all tokens, so the balance losses still see the whole row).

`n_chunks` fixes how many chunks run, whatever T is: when fn is collective (the expert-parallel
dispatch, two all-to-alls per call), every rank of the group must run it equally often, in
forward and in the recompute, so the ranks agree on the count first and a rank with fewer tokens
runs empty chunks (checkpointed like the others: the recompute replays them in the same order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor


def chunk_count(T: int, chunk: int) -> int:
    """Chunks of `chunk` tokens that cover T tokens (1 when chunk <= 0: all at once)."""
    return 1 if chunk <= 0 else max(1, -(-T // chunk))


def over_tokens(fn: Callable[..., Tensor], chunk: int, *args_T: Tensor,
                n_chunks: int | None = None) -> Tensor:
    """fn(*args_T) computed on chunks of `chunk` tokens along dim 0 (all at once if chunk <= 0);
    exactly `n_chunks` calls when given (>= the chunks T needs; the last ones may be empty)."""
    n = chunk_count(args_T[0].shape[0], chunk) if n_chunks is None else n_chunks
    if n == 1:
        return fn(*args_T)
    outs = []
    for i in range(n):
        part = [a[i * chunk:(i + 1) * chunk] for a in args_T]  # empty past T
        outs.append(checkpoint(fn, *part, use_reentrant=False) if torch.is_grad_enabled() else fn(*part))
    return torch.cat(outs)
