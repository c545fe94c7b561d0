"""Configuration of the attention layers (one dataclass shared by every backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmtrain.checks import check

from .registry import backend_choices


@dataclass
class AttentionConfig:
    # A registered backend (registry.py: dense, gather, sdpa, flex, flash) or auto: sparse layers ->
    # flex on CUDA, gather on CPU; full layers -> flash if installed and the batch has no
    # bidirectional span, else flex on CUDA, sdpa (fused SDPA per document) on CPU. A backend that
    # cannot compute a call runs its fallback (sdpa's sparse layers and split documents: gather).
    backend: str = "auto"
    block_size: int = 64  # Bs: tokens per block, counted from each document's first token
    window: int = 256  # sliding window in tokens (sparse layers)
    top_k: int = 4  # selected completed earlier key blocks of the document
    sink: bool = True  # keep the document's first block
    visual_always: bool = True  # keep every earlier visual block of the same document
    select_per: Literal["head", "kv_group"] = "kv_group"
    # Who scores the top-k candidates (both causal, see select.py): "block" = one choice per
    # document block, scored with the mean query of the previous block (the default: as good on
    # make train's losses and gaps and far cheaper, docs/EXPERIMENTS.md); "token" = each query
    # token with its own q (MoBA's rule, the reference; its tiles visit the union of their
    # tokens' picks, which grows with block size x top_k).
    select: Literal["token", "block"] = "block"
    # Extensions (all defaulted): implementation knobs that never change the function computed.
    dense_impl: Literal["sdpa", "eager"] = "sdpa"  # eager = the fp32 reference
    gather_chunk: int = 32  # query blocks per gather chunk (bounds the transient memory)
    # Recompute each chunk in backward: O(S*D) saved, not O(S*k*B) (full layers and the eager or
    # non-CPU kernels: the sparse layers' CPU kernel, tiles.py, never saves tiles)
    gather_checkpoint: bool = True
    # ... only when a layer's gathered tiles (keys, values, the fused call's mask) would hold more
    # than this many MiB: below it keeping them costs less than the recompute (0: always).
    gather_checkpoint_mib: float = 256.0
    full_tile: int = 64  # query tokens per tile of a full layer's gather path (it has no blocks)
    sdpa_group: int = 256  # sdpa: documents up to this long are grouped into masked calls (sdpa.py)
    # gather's tile attention: "sdpa" = fused: on CPU the tile kernel (tiles.py) for sparse layers
    # with blocks of >= 32 tokens, else one SDPA call per chunk of tiles with the rule as a mask
    # (small tiles: fewer, larger calls); "tiles" / "batched" = one of the two always; "eager" =
    # matmul + masked softmax + matmul (the reference).
    gather_kernel: Literal["sdpa", "tiles", "batched", "eager"] = "sdpa"

    def __post_init__(self) -> None:
        check(self, "backend", choices=backend_choices())
        check(self, "select_per", choices=("head", "kv_group"))
        check(self, "select", choices=("token", "block"))
        check(self, "dense_impl", choices=("sdpa", "eager"))
        check(self, "gather_kernel", choices=("sdpa", "tiles", "batched", "eager"))
        check(self, "block_size", "full_tile", "gather_chunk", ge=1)
        check(self, "window", "top_k", "sdpa_group", ge=0)  # sdpa_group 0: no grouping
        check(self, "gather_checkpoint_mib", ge=0)
