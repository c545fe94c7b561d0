"""Configuration of the attention layers (one dataclass shared by every backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BACKENDS = ("auto", "dense", "gather", "flex", "flash")


@dataclass
class AttentionConfig:
    # auto: sparse layers -> flex on CUDA, gather on CPU; full layers -> flash if installed and the
    # batch has no bidirectional span, else flex on CUDA, gather (exact, block-chunked) on CPU.
    backend: Literal["auto", "dense", "gather", "flex", "flash"] = "auto"
    block_size: int = 64  # B in DESIGN.md
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
    gather_checkpoint: bool = True  # recompute each chunk in backward: O(S*D) saved, not O(S*k*B)
    full_tile: int = 64  # query tokens per tile of a full layer's gather path (it has no blocks)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS} (got {self.backend!r})")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1 (got {self.block_size})")
        if self.window < 0:
            raise ValueError(f"window: must be >= 0 (got {self.window})")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (got {self.top_k})")
        if self.select_per not in ("head", "kv_group"):
            raise ValueError(f"select_per: must be 'head' or 'kv_group' (got {self.select_per!r})")
        if self.select not in ("token", "block"):
            raise ValueError(f"select: must be 'token' or 'block' (got {self.select!r})")
        if self.dense_impl not in ("sdpa", "eager"):
            raise ValueError(f"dense_impl: must be 'sdpa' or 'eager' (got {self.dense_impl!r})")
        if self.full_tile < 1:
            raise ValueError(f"full_tile: must be >= 1 (got {self.full_tile})")
        if self.gather_chunk < 1:
            raise ValueError(f"gather_chunk: must be >= 1 (got {self.gather_chunk})")
